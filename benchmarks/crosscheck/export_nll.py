"""The compressed-tensors export on the bundled SmolLM2: its NLL, loaded by plain transformers, against interp's.

For each spec: quantize SmolLM2 (the report's calibration: wiki, 32 examples x 128 tokens, seed 0),
write the compressed-tensors folder and the fake-quant model as a plain folder, load both in a
subprocess that imports only transformers, and compare per-example NLL on the report's 128
evaluation examples (wiki, 128 tokens, seed 0); also against interp.nll on the fake-quant bridge.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/crosscheck/export_nll.py [--n 64] [--out docs/data/crosscheck]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import interp
from interp.models import export_hf
from interp.quant import quantize
from interp.quant.export import export_compressed_tensors

SPECS = ["rtn:bits=4,group=32", "gptq:bits=4,group=64"]  # group 128 does not divide SmolLM2's d_in = 576

# The tolerance is derived, not picked: the fake-quant folder is also scored in float64, and the
# largest |NLL_fp32 - NLL_fp64| over the examples is the float32 accumulation error of one path.
# The export and the fake-quant model are two float32 paths over the same levels, so they may differ by
# twice that; a further factor 2 covers the dequantized weights differing in their last bit
# ((q - zero) * scale evaluated by compressed-tensors instead of by interp).
TOLERANCE_FACTOR = 4

LOAD = """
import json, sys, torch, transformers
tokens = torch.load(sys.argv[2])
out = {}
for name, folder in json.loads(sys.argv[1]).items():
    for dtype in (torch.float32, torch.float64) if name == "fake" else (torch.float32,):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        nll = []
        with torch.no_grad():
            for start in range(0, len(tokens), 8):
                batch = tokens[start:start + 8]
                logp = model(batch).logits[:, :-1].double().log_softmax(-1)
                nll += (-logp.gather(-1, batch[:, 1:, None])[..., 0].mean(1)).tolist()
        out[name if dtype == torch.float32 else name + "64"] = nll
assert not any(m == "interp" or m.startswith("interp.") for m in sys.modules)
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--out", default="docs/data/crosscheck")
    args = parser.parse_args()
    model = interp.load_model("smollm2-135m")
    examples = interp.load_examples("wiki", model.tokenizer, n=args.n, seq_len=128, seed=0, split="eval")
    calibration = interp.load_examples("wiki", model.tokenizer, n=32, seq_len=128, seed=0, split="calibration")
    assert not examples.padded, "equal-length rows: the subprocess scores them unpadded"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(examples.tokens, Path(tmp) / "tokens.pt")
        for spec in SPECS:
            start = time.time()
            qmodel = quantize(model, spec, calibration=calibration, progress=False)
            interp_nll = interp.nll(qmodel, examples).double()
            folders = {"export": str(export_compressed_tensors(qmodel, model, Path(tmp) / "ct")),
                       "fake": str(export_hf(qmodel, Path(tmp) / "fake"))}
            run = subprocess.run([sys.executable, "-c", LOAD, json.dumps(folders), str(Path(tmp) / "tokens.pt")],
                                 capture_output=True, text=True, check=True)
            nll = {k: torch.tensor(v, dtype=torch.float64) for k, v in json.loads(run.stdout.splitlines()[-1]).items()}
            fp32_error = float((nll["fake"] - nll["fake64"]).abs().max())
            rows.append({
                "spec": spec, "n": len(examples), "seq_len": 128, "seed": 0,
                "fp32_vs_fp64_max_abs_fake": fp32_error, "tolerance": TOLERANCE_FACTOR * fp32_error,
                "max_abs_export_minus_fake_plain": float((nll["export"] - nll["fake"]).abs().max()),
                "max_abs_export_minus_interp": float((nll["export"] - interp_nll).abs().max()),
                "mean_nll_export": float(nll["export"].mean()), "mean_nll_interp": float(interp_nll.mean()),
                "seconds": round(time.time() - start, 1),
            })
            rows[-1]["within_tolerance"] = rows[-1]["max_abs_export_minus_fake_plain"] <= rows[-1]["tolerance"]
            print(json.dumps(rows[-1]), flush=True)
            del qmodel
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "export_nll.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
