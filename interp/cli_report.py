"""``interp report``: the full offline HTML report."""

from __future__ import annotations

import argparse
import time

from interp.cli import command


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, gemma3-270m, an HF folder or a .gguf")
    p.add_argument("--data", default="wiki", help="'wiki', a .txt/.jsonl file, or a saved datasets folder")
    p.add_argument("--out", default="reports/smollm2-wiki", help="output folder (a rerun resumes it)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small settings for a smoke run (< 3 min)")
    size.add_argument("--full", action="store_true", help="use every eligible example")
    p.add_argument("--n", type=int, default=None, help="number of evaluation examples")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per example, BOS included")
    p.add_argument("--methods", default=None, help="comma-separated method specs, e.g. rtn:bits=3,group=64;...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--stages", default=None, help="comma-separated subset of stages")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--no-static", action="store_true", help="skip PNG/SVG export")
    p.add_argument("--screenshot", default=None, help="also save a headless-Chromium screenshot of the page here")
    p.add_argument("--quiet", action="store_true")


def _split_methods(text: str) -> tuple[str, ...]:
    """Method specs contain commas, so a list is separated by ';' (or by ',' before a method name)."""
    import re

    parts = re.split(r";|,(?=\s*(?:rtn|nf|hqq|gptq|awq)\b)", text)
    return tuple(p.strip() for p in parts if p.strip())


@command("report", "run every analysis and write the offline HTML report (resumable)", _report_args)
def cmd_report(args: argparse.Namespace) -> int:
    from interp.report import ReportSettings, run_report

    overrides: dict = {"model": args.model, "data": args.data, "seed": args.seed, "batch_size": args.batch_size,
                       "device": args.device, "dtype": args.dtype}
    if args.n is not None:
        overrides["n"] = args.n
    if args.full:
        overrides["n"] = None
    if args.seq_len is not None:
        overrides["seq_len"] = args.seq_len
    if args.methods:
        overrides["methods"] = _split_methods(args.methods)
    settings = ReportSettings.quick(**overrides) if args.quick else ReportSettings(**overrides)
    start = time.time()
    results = run_report(args.out, settings, stages=args.stages.split(",") if args.stages else None,
                         progress=False if args.quiet else None, static=not args.no_static)
    print(f"report written to {args.out}/index.html in {time.time() - start:.0f} s")
    if args.screenshot:
        from interp.report import screenshot

        print(f"screenshot: {screenshot(args.out, args.screenshot)}")
    for name, seconds in results["stage_seconds"].items():
        print(f"  {name:<14} {seconds:7.1f} s")
    for row in results["reproduction"]:
        print(f"  - {row['finding']}: paper {row['paper value']}, here {row['measured here']} ({row['holds here']})")
    return 0
