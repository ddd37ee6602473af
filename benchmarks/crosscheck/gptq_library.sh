#!/usr/bin/env bash
# interp's GPTQ against gptqmodel's on the bundled SmolLM2, in one command (from the repository root):
#   benchmarks/crosscheck/gptq_library.sh [WORK=/tmp/gptq-work] [VENV=/tmp/xvenv] [N=64]
# Builds gptqmodel's venv if missing (requirements-gptq.txt), writes the reference folder and the
# report's calibration token ids into WORK (project venv), quantizes there with gptqmodel at 4 and 3 bits,
# group 64, and compares (project venv) into docs/data/crosscheck/crosscheck_gptq*.csv.
set -euo pipefail
WORK=${1:-/tmp/gptq-work}
VENV=${2:-/tmp/xvenv}
N=${3:-64}
HERE=$(cd "$(dirname "$0")" && pwd)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -r "$HERE/requirements-gptq.txt"
fi
.venv/bin/python "$HERE/gptq_library.py" prepare "$WORK"
"$VENV/bin/python" "$HERE/gptq_theirs.py" "$WORK" --bits 4 3
.venv/bin/python "$HERE/gptq_library.py" compare "$WORK" --n "$N"
.venv/bin/python "$HERE/table.py"
