"""NF4 through bitsandbytes' own 4-bit layers against interp's fake-quant ``nf:bits=4,group=64``.

The real-kernel model: the reference (GGUF Q4_1 dequantized to fp32) loaded by transformers with a
``BitsAndBytesConfig`` (NF4, blocksize 64, no double quantization, fp32 compute), so every block
linear layer is a ``bnb.nn.Linear4bit`` whose forward runs bitsandbytes' CPU ``gemm_4bit`` on the
packed codes; handed to ``interp.load_model`` in memory, which keeps those layers. The fake-quant
model: ``interp.quant.quantize(reference, "nf:bits=4,group=64")``, float weights through torch's
matmul. Both scored by ``interp.nll`` on the evaluation examples (wiki, ``--n`` x 128, seed 0).

Written: ``docs/data/crosscheck/kernels.json`` (the agreement numbers and wall seconds),
``kernels_errors.csv`` (per-example errors) and ``docs/img/crosscheck_kernel_nf4.png``.

    .venv/bin/python benchmarks/crosscheck/real_kernels.py [--n 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

import interp
from interp.models import canonical_state_dict, export_hf
from interp.quant import quantize

sys.path.insert(0, str(Path(__file__).parent))
from crosscheck import top_jaccard  # noqa: E402


def bnb_model(reference, fake, folder: Path):
    """The bnb model, and the largest |bnb dequantized - fake-quant weight| as loaded (before any forward)."""
    import bitsandbytes
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False,
                                bnb_4bit_compute_dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), quantization_config=config, dtype=torch.float32,
                                              device_map="cpu").eval()
    layers = [(n, m) for n, m in hf.named_modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]
    blocksizes = {m.weight.quant_state.blocksize for _, m in layers}
    if len(layers) != 210 or blocksizes != {64} or any(not n.startswith("model.layers.") for n, _ in layers):
        raise SystemExit(f"expected the 210 block linears as Linear4bit with blocksize 64; got {len(layers)} "
                         f"layers, blocksizes {blocksizes}")
    fake_hf = canonical_state_dict(fake)  # Hugging Face names
    as_loaded = max(float((kernel_weight(m) - fake_hf[f"{n}.weight"].detach()).abs().max()) for n, m in layers)
    return interp.load_model(hf, tokenizer=reference.tokenizer, name="smollm2-135m bnb-nf4"), layers, as_loaded


def kernel_weight(module) -> torch.Tensor:
    """The weight a Linear4bit multiplies by: before its first forward, bitsandbytes' own dequantization;
    after it, probed through the kernel itself (``module(I) = I W^T``, no bias here).

    On a CPU with AVX512-BF16 the first eval forward repacks the codes for bitsandbytes' CPU kernel
    and stores the block absmax in bfloat16, so the probe is what that kernel computes with.
    """
    import bitsandbytes.functional as bnbf

    data, state = module.weight.data, module.weight.quant_state
    if not getattr(state, "packing_format_for_cpu", False):
        return bnbf.dequantize_4bit(data, state).float()
    with torch.no_grad():
        return module(torch.eye(module.in_features)).T.float()


def figure(e_fake: torch.Tensor, e_real: torch.Tensor, path: Path, pearson: float) -> None:
    import plotly.graph_objects as go

    low, high = float(min(e_fake.min(), e_real.min())), float(max(e_fake.max(), e_real.max()))
    fig = go.Figure([go.Scatter(x=e_fake.tolist(), y=e_real.tolist(), mode="markers", name="example"),
                     go.Scatter(x=[low, high], y=[low, high], mode="lines", name="y = x",
                                line={"dash": "dot", "color": "gray"})])
    title = f"NF4, SmolLM2: per-example error, bitsandbytes kernel vs fake quant (Pearson {pearson:.4f})"
    fig.update_layout(title=title,
                      xaxis_title="error, interp nf:bits=4,group=64 (fake quant), nats/token",
                      yaxis_title="error, bnb Linear4bit (real kernel), nats/token", width=760, height=560)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.write_image(str(path))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("docs/data/crosscheck"))
    parser.add_argument("--img", type=Path, default=Path("docs/img/crosscheck_kernel_nf4.png"))
    args = parser.parse_args()
    import bitsandbytes

    reference = interp.load_model("smollm2-135m")
    examples = interp.load_examples("wiki", reference.tokenizer, n=args.n, seq_len=128, seed=0, split="eval")
    start = time.time()
    ref_nll = interp.nll(reference, examples).double()
    fake = quantize(reference, "nf:bits=4,group=64", progress=False)
    fake_nll = interp.nll(fake, examples).double()
    seconds_fake = time.time() - start
    with tempfile.TemporaryDirectory() as tmp:
        export_hf(reference, Path(tmp) / "reference")
        start = time.time()
        real, layers, as_loaded = bnb_model(reference, fake, Path(tmp) / "reference")
        real_nll = interp.nll(real, examples).double()
        seconds_real = time.time() - start
        fake_hf = canonical_state_dict(fake)
        diff2 = sum(float(((kernel_weight(m) - fake_hf[f"{n}.weight"].detach()) ** 2).sum()) for n, m in layers)
        ref2 = sum(float((fake_hf[f"{n}.weight"].detach() ** 2).sum()) for n, _ in layers)
        in_kernel = max(float((kernel_weight(m) - fake_hf[f"{n}.weight"].detach()).abs().max()) for n, m in layers)
        packed = sorted({bool(getattr(m.weight.quant_state, "packing_format_for_cpu", False)) for _, m in layers})
        absmax_dtypes = sorted({str(m.weight.quant_state.absmax.dtype) for _, m in layers})
        avx512bf16 = sorted({bool(getattr(m, "support_avx512bf16_for_cpu", False)) for _, m in layers})
    e_fake, e_real = fake_nll - ref_nll, real_nll - ref_nll
    pearson = float(torch.corrcoef(torch.stack([e_fake, e_real]))[0, 1])
    result = {
        "real": "transformers BitsAndBytesConfig nf4 blocksize 64, fp32 compute: bitsandbytes "
                f"{bitsandbytes.__version__} Linear4bit, its own CPU forward",
        "fake": "interp nf:bits=4,group=64", "n": len(examples), "seq_len": 128, "seed": 0,
        "weights_max_abs_diff_as_loaded": as_loaded, "weights_max_abs_diff_in_kernel": in_kernel,
        "weights_relative_difference_in_kernel": (diff2 / ref2) ** 0.5,
        "cpu_repacked": packed, "kernel_absmax_dtype": absmax_dtypes, "avx512bf16": avx512bf16,
        "pearson": pearson, "top10_jaccard": top_jaccard(e_fake, e_real),
        "mean_error_fake": float(e_fake.mean()), "mean_error_real": float(e_real.mean()),
        "mean_difference_real_minus_fake": float((e_real - e_fake).mean()),
        "max_abs_nll_difference": float((real_nll - fake_nll).abs().max()),
        "seconds_fake": round(seconds_fake, 1), "seconds_real": round(seconds_real, 1),
        "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    print(json.dumps(result), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels.json").write_text(json.dumps(result, indent=1) + "\n")
    pd.DataFrame({"example": list(examples.ids), "error_fake_nf4": e_fake.tolist(),
                  "error_bnb_nf4": e_real.tolist()}).to_csv(args.out / "kernels_errors.csv", index=False)
    figure(e_fake, e_real, args.img, pearson)


if __name__ == "__main__":
    main()
