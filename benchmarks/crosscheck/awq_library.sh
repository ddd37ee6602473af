#!/usr/bin/env bash
# interp's AWQ against llm-compressor's on the bundled SmolLM2, in one command (from the repository root):
#   benchmarks/crosscheck/awq_library.sh [WORK=/tmp/awq-work] [VENV=/tmp/awqvenv] [N=64]
# Builds llm-compressor's venv if missing (requirements-awq.txt), writes the reference folder and the
# report's calibration token ids into WORK (project venv, gptq_library.py prepare), quantizes there with
# llm-compressor's AWQ at 4 and 3 bits, group 64, asymmetric, one process per bit width (oneshot keeps a
# global session), and compares (project venv) into docs/data/crosscheck/crosscheck_awq*.csv.
set -euo pipefail
WORK=${1:-/tmp/awq-work}
VENV=${2:-/tmp/awqvenv}
N=${3:-64}
HERE=$(cd "$(dirname "$0")" && pwd)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -r "$HERE/requirements-awq.txt"
fi
.venv/bin/python "$HERE/gptq_library.py" prepare "$WORK"
for BITS in 4 3; do
  (cd "$WORK" && "$VENV/bin/python" "$HERE/awq_theirs.py" "$WORK" --bits "$BITS")
done
.venv/bin/python "$HERE/awq_library.py" compare "$WORK" --n "$N"
.venv/bin/python "$HERE/table.py"
