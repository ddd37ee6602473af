"""``interp survive``: which induction heads and circuit edges of a bundled model survive each quantizer.

Runs the pre-registered survival study (``docs/preregistration/survival-1.json``, docs/survival.md) for one bundled
model and the quantized models you name, resumably, and writes its section: ``survival.md`` (per-method survival
tables, verdicts from crossed intervals), ``tables/*.csv``, ``figures/*.html`` (labelled by head and edge; PNG too
when a Chromium is found) and the raw data under ``raw/``. A rerun into the same ``--out`` resumes where it stopped.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from interp.cli.common import add_checks, check_out, command, int_at_least
from interp.errors import DataError

MODELS = ("smollm2-135m", "gemma3-270m")
STAGES = ("induction", "circuits", "features")


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help=f"a bundled model the study registers: {', '.join(MODELS)}")
    p.add_argument("--methods", default="headline",
                   help="'headline' (the registration's headline rows), 'all', or roster labels separated by ';' "
                        "(e.g. 'rtn:bits=3,group=64;llama.cpp Q3_K_M'); with 'headline' or 'all' and no llama.cpp "
                        "build, the llama.cpp mixes and plans are left out, and the run says so")
    p.add_argument("--stages", default="induction", help=f"comma-separated: {', '.join(STAGES)}")
    p.add_argument("--llama-cpp", default=None,
                   help="folder of llama.cpp's binaries, for the llama.cpp mixes and plans (default $LLAMA_CPP_BIN)")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads")
    p.add_argument("--out", default="reports/survive", help="output folder")
    add_checks(p, check_request, check_out)


def check_request(args: argparse.Namespace) -> None:
    """Model, stages and methods are the registration's; a llama.cpp build exists when a mix or plan is asked for.
    Sets ``args.labels``, ``args.stage_list`` and ``args.build``, before any model loads."""
    from interp.quant.llama_cpp_run import find_build
    from interp.report.survival.roster import roster

    if args.model not in MODELS:
        raise DataError(f"--model {args.model}: the survival study registers {', '.join(MODELS)} only")
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = sorted(set(stages) - set(STAGES))
    if not stages or bad:
        raise DataError(f"--stages {args.stages}: choose from {', '.join(STAGES)} (comma-separated)")
    if "features" in stages and args.model != "smollm2-135m":
        raise DataError("--stages features: the registration trains SAEs on smollm2-135m only")
    entries = roster(args.model)
    if args.methods == "headline":
        labels = [e.label for e in entries if e.headline]
    elif args.methods == "all":
        labels = [e.label for e in entries]
    else:
        labels = [m.strip() for m in args.methods.split(";") if m.strip()]
        known = [e.label for e in entries]
        unknown = [m for m in labels if m not in known]
        if unknown or not labels:
            raise DataError(f"--methods: {', '.join(unknown) or 'nothing named'} is not in {args.model}'s registered "
                            f"roster; choose from: {'; '.join(known)} (or 'headline', 'all')")
    by_llama = [e.label for e in entries if e.label in labels and e.kind in ("mix", "plan")]
    args.build = find_build(args.llama_cpp, need=("llama-quantize",))
    args.skipped = []
    if by_llama and args.build is None and args.methods in ("headline", "all"):
        args.skipped = by_llama  # the default asks for what can be made here; the run says what it left out
        labels = [label for label in labels if label not in by_llama]
    elif by_llama and args.build is None:
        raise DataError("the llama.cpp mixes and plans are made by llama-quantize: name a build with --llama-cpp DIR "
                        "or LLAMA_CPP_BIN (`make llama-cpp` builds one), or leave them out of --methods")
    args.labels, args.stage_list = labels, stages


@command("survive", "which induction heads and circuit edges survive each quantizer (the registered survival study)",
         _args)
def cmd_survive(args: argparse.Namespace) -> int:
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    from interp.figures.style import export_static, save_html
    from interp.figures.survival import unit_heatmap
    from interp.io import ensure_writable_dir, write_csv, write_text
    from interp.report.survival.page import analyse_model, model_section
    from interp.report.survival.run import run
    from interp.runtime.distributed import pin_threads

    out = ensure_writable_dir(args.out)
    pin_threads(args.threads)
    start = time.time()
    raw = run(args.model, out / "raw" / args.model, args.stage_list, args.labels, args.build)
    results = analyse_model(Path(raw), args.model)
    tables = ensure_writable_dir(out / "tables")
    figures = {}
    for family, res in results.items():
        for name, frame in res.items():
            if hasattr(frame, "to_csv") and not frame.empty:
                write_csv(tables / f"{family}-{name}.csv", frame, index=False)
    if "induction" in results and not results["induction"]["survival"].empty:
        figures["induction"] = unit_heatmap(results["induction"]["survival"], "head", "r_pm",
                                            f"{args.model}: induction heads' prefix matching, quantized / reference")
    for task in ("ioi", "capitals"):
        if task in results and not results[task]["per_edge"].empty:
            figures[f"circuit-{task}"] = unit_heatmap(results[task]["per_edge"], "edge", "ratio",
                                                      f"{args.model}: {task} circuit edges, quantized / reference")
    folder = ensure_writable_dir(out / "figures")
    save_html(figures, folder)
    if figures and (os.environ.get("BROWSER_PATH") or Path("/usr/bin/chromium").exists()):
        export_static(figures, folder, formats=("png",))
    text = f"# Survival: {args.model}\n\n" + model_section(Path(raw), args.model, results).replace(
        f"### {args.model}\n", "")
    write_text(out / "survival.md", text)
    if args.skipped:
        print(f"Left out (no llama.cpp build named; --llama-cpp DIR or LLAMA_CPP_BIN): {'; '.join(args.skipped)}")
    print(f"Measured {len(args.labels)} quantized model(s) in {time.time() - start:.0f} s. "
          f"Saved {out / 'survival.md'}, "
          f"{len(figures)} figure(s) in {folder}, tables in {tables}.")
    return 0
