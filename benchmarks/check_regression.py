"""Compare a fresh benchmark run with the committed results, by ratio, and flag what got worse.

The committed results are the ``<name>.json`` files in ``docs/data/benchmarks/`` (schema
``interp-benchmark/1``, see docs/benchmarks.md). Every comparison in them times a candidate
against a baseline in the same process; only the ratio of the two is compared here, never an
absolute time, so a slower or busier machine does not read as a regression. For each
comparison (matched by benchmark and ``id``)::

    change = committed speedup / fresh speedup - 1,   speedup = baseline_s / candidate_s

i.e. how much slower the candidate got relative to its baseline. A comparison whose change
exceeds ``--threshold`` (default 0.15: more than 15% worse) is a regression; all of them are
printed, and the exit status is 1 if there is any (0 with ``--warn-only``). A benchmark that
fails or is missing from the fresh run also gives exit status 1.

Without ``--fresh DIR`` the benchmarks are run first (``run_all.py`` into a temporary
folder), each with the ``--quick`` flag and ``--threads`` the committed file was made with; a
benchmark with a regression is then run again, up to ``--retries`` times (default 1), and each
comparison keeps its best fresh ratio: a regression has to show in every run, not in one noisy
one. ``--fresh`` may be given several times to the same effect for runs made beforehand.

Run from the repository root (``make bench-check`` does)::

    python benchmarks/check_regression.py [--fresh benchmarks/results ...] [--only saobp,quant_methods]
        [--threshold 0.15] [--retries 1] [--warn-only] [--verbose] [--keep DIR]
    python benchmarks/check_regression.py --self-test   # the comparison logic, on synthetic data

This is a benchmark tool, not a test: timings on a shared machine move, so it is not part of
pytest.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
COMMITTED = HERE.parent / "docs" / "data" / "benchmarks"
SCHEMA = "interp-benchmark/1"


@dataclass
class Finding:
    """One comparison's fate: ``worse``, ``better``, ``same``, ``missing`` (not in the fresh run)
    or ``new`` (not in the committed run). ``change`` is committed speedup / fresh speedup - 1."""

    benchmark: str
    id: str
    kind: str
    ratio_is: str = ""
    old_ratio: float | None = None
    new_ratio: float | None = None
    change: float | None = None

    def line(self) -> str:
        where = f"{self.benchmark}: {self.id}"
        if self.kind in ("missing", "new"):
            return f"{self.kind.upper():10s} {where}" + (
                " (in the committed results, not in the fresh run)" if self.kind == "missing"
                else " (no committed reference)")
        assert self.change is not None
        direction = "slower" if self.change > 0 else "faster"
        return (f"{self.kind.upper():10s} {where}: ratio ({self.ratio_is}) {self.old_ratio:.3g} -> "
                f"{self.new_ratio:.3g}; candidate {abs(self.change):.0%} {direction} relative to its baseline")


def speedup(comparison: dict[str, Any]) -> float:
    """``baseline_s / candidate_s``: the only number compared (a ratio, so machine speed cancels)."""
    return float(comparison["baseline_s"]) / float(comparison["candidate_s"])


def compare_one(name: str, committed: dict[str, Any], fresh: dict[str, Any], threshold: float) -> list[Finding]:
    """Findings for one benchmark's committed and fresh result objects."""
    old = {c["id"]: c for c in committed.get("comparisons", [])}
    new = {c["id"]: c for c in fresh.get("comparisons", [])}
    findings = []
    for cid, before in old.items():
        after = new.get(cid)
        if after is None:
            findings.append(Finding(name, cid, "missing"))
            continue
        change = speedup(before) / speedup(after) - 1
        kind = "worse" if change > threshold else "better" if change < -threshold else "same"
        findings.append(Finding(name, cid, kind, before.get("ratio_is", ""), before.get("ratio"),
                                after.get("ratio"), change))
    findings += [Finding(name, cid, "new") for cid in new if cid not in old]
    return findings


def compare(committed: dict[str, dict], fresh: dict[str, dict], threshold: float = 0.15) -> list[Finding]:
    """Findings for every benchmark in ``committed`` (``{name: result object}``) against ``fresh``.

    Example:
        >>> c = {"id": "a vs b", "candidate_s": 1.0, "baseline_s": 2.0, "ratio": 2.0, "ratio_is": "baseline/candidate"}
        >>> slower = {**c, "candidate_s": 5.0, "baseline_s": 8.0, "ratio": 1.6}   # 25% worse, 4x slower machine
        >>> [f.kind for f in compare({"x": {"comparisons": [c]}}, {"x": {"comparisons": [slower]}})]
        ['worse']
    """
    findings = []
    for name, before in sorted(committed.items()):
        after = fresh.get(name)
        if after is None:
            findings += [Finding(name, c["id"], "missing") for c in before.get("comparisons", [])]
        else:
            findings += compare_one(name, before, after, threshold)
    return findings


def best_of(runs: list[dict[str, dict]]) -> dict[str, dict]:
    """Several fresh runs merged: per benchmark, each comparison from the run where its speedup was highest.

    The merged record is the latest run's, with ``comparisons`` replaced and ``runs`` (how many
    runs had this benchmark) added; a failed run contributes nothing but its record.
    """
    merged: dict[str, dict] = {}
    for run in runs:
        for name, record in run.items():
            if name not in merged:
                merged[name] = {**record, "runs": 1}
                continue
            best = {c["id"]: c for c in merged[name]["comparisons"]}
            for c in record.get("comparisons", []):
                if c["id"] not in best or speedup(c) > speedup(best[c["id"]]):
                    best[c["id"]] = c
            runs_so_far = merged[name]["runs"] + 1
            merged[name] = {**record, "comparisons": list(best.values()), "runs": runs_so_far}
            if record.get("returncode", 0) != 0 and merged[name]["comparisons"]:
                merged[name]["returncode"] = 0  # an earlier run of it succeeded
    return merged


def load_dir(folder: Path, only: list[str] | None = None) -> dict[str, dict]:
    """``{benchmark: result object}`` for every ``*.json`` of this schema in ``folder``."""
    out = {}
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        if record.get("schema") == SCHEMA and (only is None or record["benchmark"] in only):
            out[record["benchmark"]] = record
    return out


def run_fresh(committed: dict[str, dict], out: Path) -> None:
    """Run each committed benchmark again into ``out``, with the committed ``--quick`` and ``--threads``."""
    out.mkdir(parents=True, exist_ok=True)
    for name, record in sorted(committed.items()):
        command = [sys.executable, str(HERE / "run_all.py"), "--only", name, "--out", str(out)]
        if record.get("quick"):
            command.append("--quick")
        threads = record.get("settings", {}).get("threads")
        if threads is not None:
            command += ["--threads", str(threads)]
        print("$ python benchmarks/run_all.py", " ".join(command[2:]), flush=True)
        subprocess.run(command, check=False, cwd=HERE.parent)


def run_with_retries(committed: dict[str, dict], out: Path, retries: int, threshold: float) -> dict[str, dict]:
    """Run every committed benchmark into ``out/run1``; rerun those with regressions into ``run2``, ..."""
    runs = []
    todo = committed
    for attempt in range(1 + retries):
        folder = out / f"run{attempt + 1}"
        run_fresh(todo, folder)
        runs.append(load_dir(folder, list(todo)))
        fresh = best_of(runs)
        flagged = {f.benchmark for f in compare(committed, fresh, threshold) if f.kind == "worse"}
        if not flagged or attempt == retries:
            return fresh
        print(f"rerunning {', '.join(sorted(flagged))}: a regression has to show again", flush=True)
        todo = {name: committed[name] for name in sorted(flagged)}
    return best_of(runs)


def settings_notes(committed: dict[str, dict], fresh: dict[str, dict]) -> list[str]:
    """Benchmarks whose fresh run failed, or ran with other settings (its ratios may not compare)."""
    notes = []
    for name, before in sorted(committed.items()):
        after = fresh.get(name)
        if after is None:
            notes.append(f"{name}: no fresh result")
        elif after.get("returncode", 0) != 0:
            notes.append(f"{name}: the fresh run failed (exit {after['returncode']}); see its stderr_tail")
        elif before.get("settings") != after.get("settings"):
            old, new = before.get("settings") or {}, after.get("settings") or {}
            differ = ", ".join(f"{key} {old.get(key)!r} -> {new.get(key)!r}" for key in sorted({*old, *new})
                               if old.get(key) != new.get(key))
            notes.append(f"{name}: settings differ ({differ}); its ratios may not compare")
    return notes


def report(findings: list[Finding], threshold: float, verbose: bool) -> list[Finding]:
    """Print the regressions (everything with ``verbose``) and a summary; return the regressions."""
    worse = [f for f in findings if f.kind == "worse"]
    for finding in findings if verbose else worse:
        print(finding.line())
    counts = {kind: sum(f.kind == kind for f in findings) for kind in ("worse", "better", "same", "missing", "new")}
    compared = counts["worse"] + counts["better"] + counts["same"]
    print(f"{compared} comparisons against the committed ratios: {counts['worse']} worse by more than "
          f"{threshold:.0%}, {counts['better']} better by more than {threshold:.0%}, {counts['same']} within; "
          f"{counts['missing']} not in the fresh run, {counts['new']} new")
    return worse


def self_test() -> None:
    """Check the comparison logic on synthetic committed and fresh results (no benchmark runs)."""

    def comp(cid: str, candidate_s: float, baseline_s: float, ratio_is: str = "baseline/candidate") -> dict:
        ratio = baseline_s / candidate_s if ratio_is == "baseline/candidate" else candidate_s / baseline_s
        return {"id": cid, "candidate_s": candidate_s, "baseline_s": baseline_s, "ratio": ratio,
                "ratio_is": ratio_is}

    committed = {
        "alpha": {"comparisons": [
            comp("speedup drops 25%", 1.0, 2.0),             # fresh 1.6x: 2.0 / 1.6 - 1 = +25%: worse
            comp("slowdown grows 16%", 1.0, 1.0, "candidate/baseline"),  # fresh 1.16x as slow: worse
            comp("slowdown grows 14%", 1.0, 1.0, "candidate/baseline"),  # fresh 1.14x: within
            comp("machine 3x slower", 1.0, 2.0),             # both times x3, same ratio: within
            comp("speedup rises", 1.0, 2.0),                 # fresh 3.0x: better
            comp("dropped", 1.0, 1.0),                       # not in the fresh run: missing
        ]},
        "beta": {"comparisons": [comp("whole benchmark missing", 1.0, 1.0)]},
    }
    fresh = {
        "alpha": {"comparisons": [
            comp("speedup drops 25%", 1.25, 2.0),
            comp("slowdown grows 16%", 1.16, 1.0, "candidate/baseline"),
            comp("slowdown grows 14%", 1.14, 1.0, "candidate/baseline"),
            comp("machine 3x slower", 3.0, 6.0),
            comp("speedup rises", 1.0, 3.0),
            comp("added", 1.0, 1.0),
        ]},
    }
    kinds = {(f.benchmark, f.id): f.kind for f in compare(committed, fresh, threshold=0.15)}
    expected = {
        ("alpha", "speedup drops 25%"): "worse",
        ("alpha", "slowdown grows 16%"): "worse",
        ("alpha", "slowdown grows 14%"): "same",
        ("alpha", "machine 3x slower"): "same",
        ("alpha", "speedup rises"): "better",
        ("alpha", "dropped"): "missing",
        ("alpha", "added"): "new",
        ("beta", "whole benchmark missing"): "missing",
    }
    assert kinds == expected, f"self-test failed:\n got      {kinds}\n expected {expected}"
    change = next(f.change for f in compare(committed, fresh) if f.id == "speedup drops 25%")
    assert change is not None and abs(change - 0.25) < 1e-12, change
    # A looser threshold lets the 16% slowdown through; the 25% one still fails.
    loose = {f.id: f.kind for f in compare(committed, fresh, threshold=0.2)}
    assert loose["slowdown grows 16%"] == "same" and loose["speedup drops 25%"] == "worse", loose
    # The printed report: regressions only, then the summary.
    worse = report(compare(committed, fresh), 0.15, verbose=False)
    assert [f.id for f in worse] == ["speedup drops 25%", "slowdown grows 16%"], worse
    # A rerun: the best fresh ratio counts, so a regression must show in every run.
    rerun = {"alpha": {"comparisons": [comp("speedup drops 25%", 1.0, 2.0),           # back to 2.0x
                                       comp("slowdown grows 16%", 1.3, 1.0, "candidate/baseline")]}}
    merged = best_of([fresh, rerun])
    assert merged["alpha"]["runs"] == 2
    kinds = {f.id: f.kind for f in compare(committed, merged)}
    assert kinds["speedup drops 25%"] == "same" and kinds["slowdown grows 16%"] == "worse", kinds
    assert kinds["speedup rises"] == "better" and kinds["added"] == "new", kinds
    print("self-test passed: 8 synthetic comparisons classified as expected, and a rerun keeps the best ratio")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fresh", action="append", default=None,
                        help="folder of fresh <name>.json results (default: run them now); repeat for best-of")
    parser.add_argument("--committed", default=str(COMMITTED), help="folder of reference results (%(default)s)")
    parser.add_argument("--only", default=None, help="comma-separated benchmark names, e.g. saobp,quant_methods")
    parser.add_argument("--threshold", type=float, default=0.15, help="relative worsening that fails (0.15)")
    parser.add_argument("--warn-only", action="store_true", help="print regressions but exit 0")
    parser.add_argument("--verbose", action="store_true", help="print every comparison, not only regressions")
    parser.add_argument("--retries", type=int, default=1,
                        help="with no --fresh: rerun a benchmark with regressions up to N times, keep best ratios")
    parser.add_argument("--keep", default=None, help="with no --fresh: run into this folder and keep it")
    parser.add_argument("--self-test", action="store_true", help="check the comparison logic on synthetic data")
    args = parser.parse_args(argv)
    if args.self_test:
        self_test()
        return 0
    only = args.only.split(",") if args.only else None
    committed = load_dir(Path(args.committed), only)
    if not committed:
        print(f"No committed {SCHEMA} results in {args.committed}" + (f" for {args.only}" if only else ""),
              file=sys.stderr)
        return 2
    if args.fresh:
        fresh = best_of([load_dir(Path(folder), only) for folder in args.fresh])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = run_with_retries(committed, Path(args.keep or tmp), args.retries, args.threshold)
    notes = settings_notes(committed, fresh)
    notes += [f"{name}: best of {record['runs']} fresh runs" for name, record in sorted(fresh.items())
              if record.get("runs", 1) > 1]
    for note in notes:
        print(f"note: {note}")
    worse = report(compare(committed, fresh, args.threshold), args.threshold, args.verbose)
    incomplete = any("no fresh result" in n or "failed" in n for n in notes)
    if args.warn_only:
        return 0
    return 1 if worse or incomplete else 0


if __name__ == "__main__":
    raise SystemExit(main())
