"""Run every ``benchmarks/bench_*.py`` and keep each one's output as markdown and JSON.

Each script prints its results as markdown (tables and a few lines of text). This runner
runs them one after another in fresh processes, and writes, per script, into ``--out``
(default ``benchmarks/results/``):

- ``<name>.md``: what the script printed;
- ``<name>.json``: the same results, machine-readable: every markdown table as a list of
  row objects (numbers parsed), the other printed lines, the command, exit status, wall
  time and the machine (Python, torch, platform).

``--quick`` gives each script a short setting: ``--quick`` itself for a script whose source
defines that option, otherwise the reduced arguments in ``QUICK_ARGS`` (one repeat, fewer
examples). Quick numbers check that the benchmarks run; they are not the numbers in
``docs/benchmarks*.md``.

Run from the repository root (``make bench`` does)::

    python benchmarks/run_all.py [--quick] [--only saobp,quant_methods] [--out benchmarks/results]

The exit status is non-zero when any script failed; its stderr tail is in its JSON file.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
QUICK_ARGS: dict[str, list[str]] = {
    "patching": ["--n", "2", "--seq-len", "16", "--scenarios", "upper"],
    "probe_scoring": ["--repeats", "1"],
    "quant_methods": ["--repeats", "1"],
    "saobp": ["--repeats", "1"],
}
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


def quick_args(script: Path) -> list[str]:
    if '"--quick"' in script.read_text():
        return ["--quick"]
    return QUICK_ARGS.get(script.stem.removeprefix("bench_"), [])


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


def machine() -> dict[str, Any]:
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover - torch is a hard dependency
        torch_version = None
    return {"python": platform.python_version(), "torch": torch_version, "platform": platform.platform(),
            "processor": platform.machine()}


def run_one(script: Path, args: list[str], out: Path, timeout: float) -> dict[str, Any]:
    command = [sys.executable, str(script), *args]
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent)
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        returncode, stderr = -1, f"timed out after {timeout:.0f} s"
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    wall = time.perf_counter() - start
    name = script.stem.removeprefix("bench_")
    (out / f"{name}.md").write_text(stdout)
    record = {"benchmark": name, "command": ["python", f"benchmarks/{script.name}", *args],
              "returncode": returncode, "wall_s": round(wall, 2), "machine": machine(),
              **parse_markdown(stdout)}
    if returncode != 0:
        record["stderr_tail"] = stderr[-4000:]
    (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short settings: checks that every benchmark runs")
    parser.add_argument("--only", default=None, help="comma-separated names, e.g. saobp,patching")
    parser.add_argument("--out", default=str(HERE / "results"), help="folder for <name>.md and <name>.json")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds allowed per script")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for script in scripts(args.only.split(",") if args.only else None):
        extra = quick_args(script) if args.quick else []
        print(f"{script.name} {' '.join(extra)}".rstrip(), flush=True)
        record = run_one(script, extra, out, args.timeout)
        status = "ok" if record["returncode"] == 0 else f"FAILED (exit {record['returncode']})"
        print(f"  {status} in {record['wall_s']:.0f} s: {out / (record['benchmark'] + '.md')}, "
              f"{len(record['tables'])} tables in {record['benchmark']}.json", flush=True)
        if record["returncode"] != 0:
            failed.append(record["benchmark"])
    if failed:
        print(f"Failed: {', '.join(failed)}; see stderr_tail in their JSON files.", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
