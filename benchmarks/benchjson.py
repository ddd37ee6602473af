"""The machine-readable result every ``bench_*.py`` script writes beside its markdown.

One JSON object per script run (schema ``interp-benchmark/1``, documented in
docs/benchmarks.md, "Machine-readable results"): when and where it ran, the script's
settings, and one entry per measured comparison (a candidate timed against a baseline in
the same process) with both raw median times and their ratio. ``run_all.py`` adds the runner's
fields (command, exit status, wall time, the markdown parsed into tables) to the same file,
and ``check_regression.py`` compares two sets of these files by ratio.

This module is imported by the scripts as ``benchjson`` (Python puts the script's folder,
``benchmarks/``, first on ``sys.path``); it imports nothing from ``interp``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCHEMA = "interp-benchmark/1"
HERE = Path(__file__).resolve().parent
DEFAULT_DIR = HERE / "results"
COMMITTED_DIR = HERE.parent / "docs" / "data" / "benchmarks"
RATIO_KINDS = ("baseline/candidate", "candidate/baseline")


def cpu_model() -> str:
    """The first ``model name`` in /proc/cpuinfo (Linux), else what :mod:`platform` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """Where the numbers come from: CPU model and count, torch version and thread count."""
    try:
        import torch

        torch_version: str | None = torch.__version__
        torch_threads: int | None = torch.get_num_threads()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        torch_version, torch_threads = None, None
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "arch": platform.machine(),
        "torch": torch_version,
        "torch_threads": torch_threads,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def comparison(
    id: str,
    candidate: str,
    baseline: str,
    candidate_s: float,
    baseline_s: float,
    *,
    repeats: int,
    ratio_is: str = "baseline/candidate",
    clock: str = "wall",
    threads: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One measured comparison: ``candidate`` timed against ``baseline`` (median seconds each).

    ``ratio`` is the number the markdown reports, ``baseline_s / candidate_s`` or its inverse as
    ``ratio_is`` says; ``speedup`` is always ``baseline_s / candidate_s`` (higher is better for
    the candidate), the number the regression check compares. ``id`` is unique within the script.

    Example:
        >>> c = comparison("x vs y", "x", "y", 1.0, 2.0, repeats=3, ratio_is="candidate/baseline")
        >>> c["ratio"], c["speedup"]
        (0.5, 2.0)
    """
    if ratio_is not in RATIO_KINDS:
        raise ValueError(f"ratio_is must be one of {RATIO_KINDS}, not {ratio_is!r}")
    speedup = baseline_s / candidate_s
    return {
        "id": id,
        "candidate": candidate,
        "baseline": baseline,
        "candidate_s": candidate_s,
        "baseline_s": baseline_s,
        "ratio": speedup if ratio_is == "baseline/candidate" else 1 / speedup,
        "ratio_is": ratio_is,
        "speedup": speedup,
        "repeats": repeats,
        "clock": clock,
        "threads": threads,
        **({"extra": extra} if extra else {}),
    }


def round_robin(
    variants: dict[str, Callable[[], Any]],
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
    warmup: int = 1,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Median seconds per call of each variant, timed in interleaved rounds, and each one's last result.

    Each round calls every variant once, starting one further along each time, so a change in the
    machine's load during the run falls on all variants alike instead of on whichever ran then.

    Example:
        >>> medians, results = round_robin({"a": lambda: 1, "b": lambda: 2}, repeats=3)
        >>> sorted(medians), results
        (['a', 'b'], {'a': 1, 'b': 2})
    """
    times: dict[str, list[float]] = {name: [] for name in variants}
    results: dict[str, Any] = {}
    names = list(variants)
    for round_index in range(warmup + repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = clock()
            results[name] = variants[name]()
            if round_index >= warmup:
                times[name].append(clock() - start)
    return {name: statistics.median(values) for name, values in times.items()}, results


def add_interleave_option(parser: argparse.ArgumentParser) -> None:
    """``--interleave`` / ``--no-interleave``; the script turns it on by default with ``--quick``."""
    parser.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                        help="time the variants round-robin (default with --quick) instead of one after another")


def add_options(parser: argparse.ArgumentParser, name: str) -> None:
    """``--json PATH`` (default ``benchmarks/results/<name>.json``) and ``--quick``."""
    parser.add_argument("--json", default=str(DEFAULT_DIR / f"{name}.json"),
                        help="write the machine-readable results here (default: %(default)s); '' for none")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and few repeats: a run of seconds to a minute or two")


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The script's options as JSON values (without ``--json`` and hidden ones)."""
    hidden = {"json", "child", "out", "memory_child"}
    return {key: value for key, value in vars(args).items()
            if key not in hidden and (value is None or isinstance(value, str | int | float | bool | list))}


def now() -> str:
    """The current time, UTC, ISO 8601 to the second."""
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()


def write(
    path: str | os.PathLike[str] | None,
    benchmark: str,
    comparisons: list[dict[str, Any]],
    args: argparse.Namespace,
    metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the result object to ``path`` (nothing when ``path`` is empty) and return it."""
    record = {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "date": now(),
        "quick": bool(getattr(args, "quick", False)),
        "settings": settings_of(args),
        "machine": machine(),
        "comparisons": comparisons,
        "metrics": metrics or {},
    }
    ids = [c["id"] for c in comparisons]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValueError(f"comparison ids must be unique: {duplicates}")
    if not path:
        return record
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    return record
