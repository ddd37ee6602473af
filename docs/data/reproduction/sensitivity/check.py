"""How much the calibrated 3-bit models (GPTQ, AWQ) move when the code or the CPU kernels change.

Quantizes a bundled model with the report's calibrated 3-bit specs under the code and the
environment this script runs with, scores the report's first N evaluation examples (128 tokens,
seed 0; calibration: 32 x 128, seed 0, as the report), and writes the per-example NLL as JSON.
Run it twice and compare:

    # the calibration-feeder fix (commit 0d64ef4) on Gemma-3-270m: old code, then new
    PYTHONPATH=<checkout at b1972f0> python check.py --model gemma3-270m --out old.json
    PYTHONPATH=<checkout at HEAD>    python check.py --model gemma3-270m --out new.json
    # the same code under AVX2 and under the CPU's own (here AVX-512) kernels
    ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 python check.py --model smollm2-135m --out avx2.json
    python check.py --model smollm2-135m --out native.json

    python check.py --compare old.json new.json
    # one calibrated instance of a confirmatory run, as recorded (per-token NLL committed in raw/) and as
    # quantized again here from the same calibration sample: the same code, another machine
    python check.py --registration docs/preregistration/gemma3-confirmatory-1.json \
        --raw docs/data/reproduction/gemma3-confirmatory-1/raw --instance 3 --out recorded.json --again again.json

The comparison gives, per spec, the mean error (NLL minus the reference's) under each, the
Pearson correlation of the two per-example errors, and the Jaccard overlap of their top-10% sets
(the D_large the report would pick).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

SPECS = ["gptq:bits=3,group=64,damp=0.01,act_order=1,block=128", "awq:bits=3,group=64"]


def measure(model_name: str, out: str, n: int) -> None:
    import torch

    import interp
    from interp.quant.apply import quantize

    model = interp.load_model(model_name)
    ex = interp.load_examples("wiki", model.tokenizer, n=n, seq_len=128, seed=0, split="eval")
    cal = interp.load_examples("wiki", model.tokenizer, n=32, seq_len=128, seed=0, split="calibration")
    result = {"model": model_name, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "reference": interp.nll(model, ex).double().tolist(), "ids": list(ex.ids)}
    for spec in SPECS:
        q = quantize(model, spec, calibration=cal, progress=False)
        result[spec] = interp.nll(q, ex).double().tolist()
        del q
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


def measure_instance(registration: str, raw: str, instance: int, recorded_out: str, again_out: str) -> None:
    """Instance ``instance`` of a confirmatory run twice, in :func:`measure`'s format: as its committed per-token
    NLL recorded it, and quantized again here from the same calibration sample and scored on the same examples."""
    import numpy as np
    import torch

    import interp
    from interp.quant.apply import quantize_cached
    from interp.report import confirm
    from interp.runtime.batching import cpu_identity

    p = confirm.Preregistration.load(registration)
    folder = confirm._Folder(Path(raw))
    meta = json.loads((Path(raw) / "examples.json").read_text())
    model = interp.load_model(p.model)
    ex = confirm.heldout_examples(model.tokenizer, p)
    if list(ex.ids) != meta["ids"]:
        raise SystemExit(f"{raw} holds other examples than {registration} draws")
    cal = interp.load_examples(p.data, model.tokenizer, n=p.calibration_n, seq_len=p.seq_len,
                               seed=p.calibration_seeds[instance], split="calibration")

    def per_example(label: str) -> list:
        return folder.tokens(label).mean(axis=1).tolist()

    recorded = {"model": p.model, "cpu_capability": meta["starts"][0]["kernels"].removeprefix("cpu-"),
                "source": f"{raw} as recorded (start 1: commit {meta['starts'][0]['commit'][:10]})",
                "reference": per_example("reference"), "ids": meta["ids"]}
    again = {"model": p.model, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu": cpu_identity(),
             "source": f"quantized again from calibration seed {p.calibration_seeds[instance]}",
             "reference": np.mean(confirm._token_nll(model, ex, p.batch_size), axis=1).tolist(), "ids": meta["ids"]}
    for spec in SPECS:
        label = confirm._label(spec, instance)
        recorded[spec] = per_example(label)
        # through the quantized-model cache, as the run: on the run's machine, the model its localization steps used
        q = quantize_cached(model, spec, cal, progress=False, batch_size=p.batch_size)
        again[spec] = np.mean(confirm._token_nll(q, ex, p.batch_size), axis=1).tolist()
        del q
    for path, result in ((recorded_out, recorded), (again_out, again)):
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def compare(a_path: str, b_path: str) -> dict:
    import torch

    a, b = json.load(open(a_path)), json.load(open(b_path))
    ref_a, ref_b = torch.tensor(a["reference"]), torch.tensor(b["reference"])
    rows: dict = {"reference_max_abs_diff": float((ref_a - ref_b).abs().max()), "n": len(ref_a)}
    for spec in SPECS:
        e_a, e_b = torch.tensor(a[spec]) - ref_a, torch.tensor(b[spec]) - ref_b
        k = max(1, math.ceil(0.1 * len(e_a)))
        top_a, top_b = set(e_a.topk(k).indices.tolist()), set(e_b.topk(k).indices.tolist())
        rows[spec] = {
            "mean_error_a": round(float(e_a.mean()), 4), "mean_error_b": round(float(e_b.mean()), 4),
            "pearson_a_b": round(float(torch.corrcoef(torch.stack([e_a, e_b]))[0, 1]), 4),
            "top10_jaccard_a_b": round(len(top_a & top_b) / len(top_a | top_b), 3),
            "max_abs_error_diff": round(float((e_a - e_b).abs().max()), 4),
        }
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", help="write the per-example NLL here")
    parser.add_argument("--n", type=int, default=128, help="evaluation examples (the report's first n)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"))
    parser.add_argument("--registration", help="a confirmatory pre-registration (with --raw, --instance, --again)")
    parser.add_argument("--raw", help="its committed raw folder")
    parser.add_argument("--instance", type=int, help="the calibrated instance to quantize again")
    parser.add_argument("--again", help="write the instance quantized again here (--out: as recorded)")
    args = parser.parse_args()
    if args.compare:
        print(json.dumps(compare(*args.compare), indent=1))
    elif args.registration:
        measure_instance(args.registration, args.raw, args.instance, args.out, args.again)
    else:
        measure(args.model, args.out, args.n)
