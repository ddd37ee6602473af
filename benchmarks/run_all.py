"""Run every ``benchmarks/bench_*.py`` and keep each one's output as markdown and JSON.

Each script prints its results as markdown (tables and a few lines of text) and writes its
measured comparisons as JSON (``--json``; schema ``interp-benchmark/1``, see ``benchjson.py``
and docs/benchmarks.md). This runner runs them one after another in fresh processes, and
writes, per script, into ``--out`` (default ``benchmarks/results/``):

- ``<name>.md``: what the script printed;
- ``<name>.json``: the script's own JSON (date, machine, settings, ``comparisons``,
  ``metrics``) plus the runner's fields: the command, exit status, wall time, and every
  markdown table as a list of row objects (numbers parsed) with the other printed lines.

``--quick`` passes ``--quick`` to every script: small sizes and few repeats, about 4 minutes
for all four on one thread. Quick numbers are what docs/data/benchmarks/ holds (the reference
for ``check_regression.py``); they are not the numbers in ``docs/benchmarks*.md``.
``--threads N`` passes ``--threads N`` to every script; it defaults to ``$OMP_NUM_THREADS``
when that is set, else each script's own default.

Run from the repository root (``make bench`` does)::

    python benchmarks/run_all.py [--quick] [--threads 1] [--only saobp,quant_methods] [--out benchmarks/results]

The exit status is non-zero when any script failed; its stderr tail is in its JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import benchjson

HERE = Path(__file__).resolve().parent
_SEPARATOR = re.compile(r"^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")


def scripts(only: list[str] | None = None) -> list[Path]:
    """The benchmark scripts, sorted by name; ``only`` keeps those named (without ``bench_``)."""
    found = sorted(HERE.glob("bench_*.py"))
    if only is None:
        return found
    names = {path.stem.removeprefix("bench_"): path for path in found}
    unknown = [name for name in only if name not in names]
    if unknown:
        raise SystemExit(f"No benchmark named {', '.join(unknown)}; choose from {', '.join(names)}.")
    return [names[name] for name in only]


def script_args(quick: bool, threads: int | None) -> list[str]:
    """The options every script gets: ``--quick`` and ``--threads N`` when asked for."""
    return (["--quick"] if quick else []) + ([] if threads is None else ["--threads", str(threads)])


def default_threads() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() else None


def _cell(text: str) -> Any:
    text = text.strip().strip("*`")
    try:
        return float(text.removesuffix("x")) if re.fullmatch(r"-?[\d.]+(e-?\d+)?x?", text) else text
    except ValueError:
        return text


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def parse_markdown(text: str) -> dict[str, Any]:
    """Markdown tables as ``[{"columns": [...], "rows": [{column: value}]}]`` plus the other lines.

    Example:
        >>> out = parse_markdown("speed\\n\\n| method | ms |\\n|---|---|\\n| rtn | 1.5 |")
        >>> out["tables"][0]["rows"], out["lines"]
        ([{'method': 'rtn', 'ms': 1.5}], ['speed'])
    """
    lines = text.splitlines()
    tables: list[dict[str, Any]] = []
    other: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("|") and i + 1 < len(lines) and _SEPARATOR.match(lines[i + 1].strip()):
            columns = _cells(line)
            rows = []
            i += 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                values = _cells(lines[i])
                rows.append({col: _cell(val) for col, val in zip(columns, values, strict=False)})
                i += 1
            tables.append({"columns": columns, "rows": rows})
            continue
        if line.strip():
            other.append(line.strip())
        i += 1
    return {"tables": tables, "lines": other}


def run_one(script: Path, args: list[str], out: Path, timeout: float) -> dict[str, Any]:
    name = script.stem.removeprefix("bench_")
    result = out / f"{name}.json"
    result.unlink(missing_ok=True)  # a stale file must not pass for this run's results
    command = [sys.executable, str(script), *args, "--json", str(result)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent)
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        returncode, stderr = -1, f"timed out after {timeout:.0f} s"
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    wall = time.perf_counter() - start
    (out / f"{name}.md").write_text(stdout)
    if returncode == 0 and result.exists():
        record = json.loads(result.read_text())
    else:  # the script failed before writing its results: keep what is known
        record = {"schema": benchjson.SCHEMA, "benchmark": name, "date": benchjson.now(), "quick": "--quick" in args,
                  "machine": benchjson.machine(), "comparisons": [], "metrics": {}}
    record.update({"command": ["python", f"benchmarks/{script.name}", *args], "returncode": returncode,
                   "wall_s": round(wall, 2), **parse_markdown(stdout)})
    if returncode != 0:
        record["stderr_tail"] = stderr[-4000:]
    result.write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick: small sizes, few repeats")
    parser.add_argument("--threads", type=int, default=default_threads(),
                        help="pass --threads N to every script (default: $OMP_NUM_THREADS if set, else theirs)")
    parser.add_argument("--only", default=None, help="comma-separated names, e.g. saobp,patching")
    parser.add_argument("--out", default=str(HERE / "results"), help="folder for <name>.md and <name>.json")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds allowed per script")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for script in scripts(args.only.split(",") if args.only else None):
        extra = script_args(args.quick, args.threads)
        print(f"{script.name} {' '.join(extra)}".rstrip(), flush=True)
        record = run_one(script, extra, out, args.timeout)
        status = "ok" if record["returncode"] == 0 else f"FAILED (exit {record['returncode']})"
        print(f"  {status} in {record['wall_s']:.0f} s: {out / (record['benchmark'] + '.md')}, "
              f"{len(record['tables'])} tables and {len(record['comparisons'])} comparisons in "
              f"{record['benchmark']}.json", flush=True)
        if record["returncode"] != 0:
            failed.append(record["benchmark"])
    if failed:
        print(f"Failed: {', '.join(failed)}; see stderr_tail in their JSON files.", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
