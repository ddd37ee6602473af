"""interp's AWQ against llm-compressor's, on the bundled SmolLM2, with the same calibration examples.

The AWQ counterpart of ``gptq_library.py`` (whose ``prepare`` stage writes the reference folder and
the calibration token ids, and whose helpers are reused here); the whole chain is ``awq_library.sh``:

- ``gptq_library.py prepare WORK`` (project venv);
- ``awq_theirs.py WORK --bits B`` (llm-compressor's venv): ``WORK/theirs-awq{B}.safetensors``, the
  library's dequantized weights unfolded to the original model's space;
- ``awq_library.py compare WORK`` (project venv): for each bit width, put llm-compressor's weights
  into a copy of the reference, quantize the reference with interp's AWQ on the same calibration rows
  (also with its grid patched to integer zero-points, the grid of llm-compressor's asymmetric
  ``QuantizationArgs``), and compute crosscheck.py's columns on the evaluation examples (wiki,
  ``--n`` x 128 tokens, seed 0). Rows go to ``docs/data/crosscheck/crosscheck_awq.csv``, the
  per-example errors to ``crosscheck_awq_errors.csv``.

    .venv/bin/python benchmarks/crosscheck/awq_library.py compare /tmp/awq-work --n 64
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import pandas as pd
import torch

import interp
from interp.quant import quantize

sys.path.insert(0, str(Path(__file__).parent))
from crosscheck import GROUP, top_jaccard, weight_agreement  # noqa: E402
from gptq_library import calibration_examples, integer_zero_points, with_library_weights  # noqa: E402

OURS = "awq:bits={b},group=64"
SETTINGS = ("duo_scaling", "n_grid", "sym", "smooth_layer_kinds")


def compare(work: Path, n: int, out: Path) -> None:
    from safetensors.torch import load_file

    model = interp.load_model("smollm2-135m")
    cal = calibration_examples(model)
    stored = json.loads((work / "calibration.json").read_text())["ids"]
    if stored != list(cal.ids):
        raise SystemExit("the calibration rows differ from the ones awq_theirs.py used; rerun prepare")
    examples = interp.load_examples("wiki", model.tokenizer, n=n, seq_len=128, seed=0, split="eval")
    reference = interp.nll(model, examples).double()
    rows, errors = [], {"example": list(examples.ids)}
    for bits, zero in ((4, "float"), (4, "int"), (3, "float"), (3, "int")):
        path = work / f"theirs-awq{bits}.safetensors"
        if not path.exists():
            continue
        settings = json.loads((work / f"theirs-awq{bits}.json").read_text())
        start = time.time()
        spec = OURS.format(b=bits)
        with integer_zero_points() if zero == "int" else contextlib.nullcontext():
            ours = quantize(model, spec, calibration=cal, progress=False)
        seconds_ours = time.time() - start
        if zero == "int":
            spec += " (grid patched to integer zero-points)"
        theirs, pairs = with_library_weights(model, load_file(str(path)))
        same, rel = weight_agreement(ours, pairs, bits)
        e_ours = interp.nll(ours, examples).double() - reference
        e_theirs = errors.get(f"theirs|{OURS.format(b=bits)}")
        e_theirs = (interp.nll(theirs, examples).double() - reference if e_theirs is None
                    else torch.tensor(e_theirs, dtype=torch.float64))
        rows.append({"ours": spec, "library": settings["library"], "bits": bits, "group": GROUP,
                     "library_settings": json.dumps({k: settings[k] for k in SETTINGS}),
                     "same_level_share": same, "relative_weight_difference": rel,
                     "pearson": float(torch.corrcoef(torch.stack([e_ours, e_theirs]))[0, 1]),
                     "top10_jaccard": top_jaccard(e_ours, e_theirs), "mean_error_ours": float(e_ours.mean()),
                     "mean_error_theirs": float(e_theirs.mean()), "n": len(examples),
                     "seconds_quantize_ours": round(seconds_ours, 1), "seconds_quantize_theirs": settings["seconds"],
                     "seconds": round(time.time() - start, 1)})
        errors[f"ours|{spec}"], errors[f"theirs|{OURS.format(b=bits)}"] = e_ours.tolist(), e_theirs.tolist()
        print(json.dumps(rows[-1]), flush=True)
        out.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(out / "crosscheck_awq.csv", index=False)
        pd.DataFrame(errors).to_csv(out / "crosscheck_awq_errors.csv", index=False)
    if not rows:
        raise SystemExit(f"no theirs-awq*.safetensors in {work}: run awq_theirs.py first")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("stage", choices=["compare"])
    parser.add_argument("work", type=Path)
    parser.add_argument("--n", type=int, default=64, help="evaluation examples")
    parser.add_argument("--out", type=Path, default=Path("docs/data/crosscheck"))
    args = parser.parse_args()
    compare(args.work, args.n, args.out)


if __name__ == "__main__":
    main()
