"""The cross-check tables in docs/quantization_methods.md are the committed data, regenerated."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_crosscheck_tables_are_generated_from_the_committed_data():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "crosscheck" / "table.py"), "--check"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr + run.stdout
