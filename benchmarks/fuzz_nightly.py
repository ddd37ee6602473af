"""Nightly-style signature fuzz: the suite's fuzz tests with fresh random draws from a recorded seed.

``tests/test_fuzz_api.py`` is derandomized in ``make test`` (the same hostile values every run, so CI is never
flaky). This script runs it with ``INTERP_FUZZ_SEED`` (hypothesis draws from that seed instead) and more draws per
callable, and records the seed and the outcome in ``docs/data/benchmarks/fuzz_nightly.jsonl``, one line a run, so a
failure names the seed that reproduces it:

    python benchmarks/fuzz_nightly.py                  # a seed from the clock, 24 draws per function
    python benchmarks/fuzz_nightly.py --seed 123 --examples 48

Reproduce a failure with ``INTERP_FUZZ_SEED=<seed> INTERP_FUZZ_EXAMPLES=<n> pytest tests/test_fuzz_api.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from interp.io import write_text  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: from the clock)")
    parser.add_argument("--examples", type=int, default=24, help="draws per function (the suite makes 12)")
    parser.add_argument("--record", default=str(ROOT / "docs" / "data" / "benchmarks" / "fuzz_nightly.jsonl"))
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % (2**31)
    env = {**os.environ, "INTERP_FUZZ_SEED": str(seed), "INTERP_FUZZ_EXAMPLES": str(args.examples)}
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fuzz_api.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    tail = [line for line in done.stdout.splitlines() if line.strip()][-1:] or ["no output"]
    line = {"seed": seed, "examples": args.examples, "exit": done.returncode, "summary": tail[0],
            "seconds": round(time.time() - start), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    record = Path(args.record)
    old = record.read_text() if record.is_file() else ""
    record.parent.mkdir(parents=True, exist_ok=True)
    write_text(record, old + json.dumps(line) + "\n")
    print(json.dumps(line))
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())
