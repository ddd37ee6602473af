"""``interp report``: the full offline HTML report."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from interp.cli.common import (
    DTYPES,
    add_checks,
    check_data,
    check_loads_model,
    check_out,
    check_writable_file,
    command,
    device_type,
    int_at_least,
    name_list,
)
from interp.cli.quant import spec_list_type, split_specs


def _stage_names() -> Sequence[str]:
    from interp.report.stages import STAGES

    return [stage.name for stage in STAGES]


def _check_screenshot(args: argparse.Namespace) -> None:
    if args.screenshot:
        check_writable_file(args.screenshot, "--screenshot")


def _report_args(p: argparse.ArgumentParser) -> None:
    from interp.report.run import ReportSettings

    full, quick = ReportSettings(), ReportSettings.quick()
    p.add_argument("--model", default="smollm2-135m",
                   help="bundled model (smollm2-135m, gemma3-270m), a Hugging Face folder, or a .gguf file")
    p.add_argument("--data", default="wiki",
                   help="'wiki' (bundled), a .txt file (documents separated by blank lines), a .jsonl file "
                        "or a .csv file with a 'text' field, or a saved datasets folder")
    p.add_argument("--out", default="reports/smollm2-wiki", help="output folder (a rerun resumes it)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small settings for a smoke run (< 3 min)")
    size.add_argument("--full", action="store_true", help="use every eligible example")
    p.add_argument("--n", type=int_at_least(1), default=None,
                   help=f"number of evaluation examples (default: {full.n}; with --quick: {quick.n})")
    p.add_argument("--seq-len", type=int_at_least(2), default=None,
                   help=f"tokens per example, BOS included (default: {full.seq_len}; with --quick: {quick.seq_len})")
    p.add_argument("--methods", default=None, type=spec_list_type,
                   help="method specs separated by ';' (or by ',' before a method name), "
                        f"e.g. 'rtn:bits=3,group=64;nf:bits=4' (default: {'; '.join(full.methods)}; with --quick: "
                        f"{'; '.join(quick.methods)})")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed for which documents are chosen")
    p.add_argument("--batch-size", type=int_at_least(1), default=8, help="examples per forward pass")
    p.add_argument("--stages", default=None, type=name_list("stage", _stage_names),
                   help=f"comma-separated subset of stages, from: {', '.join(_stage_names())} (default: all)")
    p.add_argument("--device", type=device_type, default="cpu", help="cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="model parameter dtype")
    p.add_argument("--no-static", action="store_true", help="skip PNG/SVG export")
    p.add_argument("--single-file", action="store_true",
                   help="also write OUT/report.html: one page with plotly.js inlined (~5 MB) that works on its own")
    p.add_argument("--screenshot", default=None, help="also save a headless-Chromium screenshot of the page here")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help="torch threads per process (under torchrun: default cores / ranks on this node)")
    add_checks(p, check_loads_model, check_data, check_out, _check_screenshot)


@command("report", "run every analysis and write the offline HTML report (resumable)", _report_args)
def cmd_report(args: argparse.Namespace) -> int:
    from interp.report.run import ReportSettings, run_report
    from interp.runtime.distributed import pin_threads, world

    pin_threads(args.threads)

    overrides: dict = {"model": args.model, "data": args.data, "seed": args.seed, "batch_size": args.batch_size,
                       "device": args.device, "dtype": args.dtype}
    if args.n is not None:
        overrides["n"] = args.n
    if args.full:
        overrides["n"] = None
    if args.seq_len is not None:
        overrides["seq_len"] = args.seq_len
    if args.methods:
        overrides["methods"] = tuple(split_specs(args.methods.text))  # as given: the settings parse them once
    settings = ReportSettings.quick(**overrides) if args.quick else ReportSettings(**overrides)
    start = time.time()
    results = run_report(args.out, settings, stages=args.stages.split(",") if args.stages else None,
                         progress=False if args.quiet else None, static=not args.no_static,
                         single_file=args.single_file, smoke=True if args.quick else None)
    if world()[0] != 0:  # torchrun: this rank's batches are in OUT/parts; rank 0 wrote the report
        return 0
    print(f"report written to {args.out}/index.html in {time.time() - start:.0f} s")
    if args.single_file:
        print(f"single-file report (plotly.js inlined): {args.out}/report.html")
    if args.screenshot:
        from interp.report.html import screenshot

        print(f"screenshot: {screenshot(args.out, args.screenshot)}")
    for name, seconds in results["stage_seconds"].items():
        print(f"  {name:<14} {seconds:7.1f} s")
    if results.get("smoke"):
        print("a smoke run: it concludes nothing (no verdicts; run without --quick for them)")
    for row in results["reproduction"]:
        print(f"  - [{row['verdict']}] {row['claim']}: paper {row['paper value']}, here {row['measured here']}")
    return 0
