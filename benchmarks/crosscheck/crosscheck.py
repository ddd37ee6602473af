"""interp's quantizers against library implementations of the same algorithm, on the bundled SmolLM2.

Pairs (the libraries installed in the project environment):

- RTN against compressed-tensors' fake quantization (its min-max observer, asymmetric int, group-wise):
  compressed-tensors widens each group's range to include 0 and rounds the zero-point to an integer,
  which is interp's ``rtn:...,zero=int``; interp's default (``zero=float``, hqq's and llama.cpp Q4_1's
  convention) is compared too, as a deliberate difference.
- HQQ against the ``hqq`` package called directly (interp's ``hqq`` calls it: the control).
- NF4 against bitsandbytes' ``quantize_4bit``/``dequantize_4bit`` (CPU).

For each pair and bit width: the share of block weights on the same grid level (the two dequantized values
closer than half a grid step of the reference group), the relative weight difference
``||W_ours - W_theirs|| / ||W||``, the per-example errors NLL(quantized) - NLL(reference) of both models on
the report's evaluation examples (wiki, 128 x 128 tokens, seed 0), their Pearson correlation and top-10%
Jaccard, and each one's mean error.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/crosscheck/crosscheck.py [--n 128] [--out docs/data/crosscheck]
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import pandas as pd
import torch

import interp
from interp.quant import quantize
from interp.runtime import hooks

GROUP = 64  # divides SmolLM2's d_in (576 and 1536); 128 does not


def theirs_rtn(W: torch.Tensor, bits: int) -> torch.Tensor:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=False, strategy="group", group_size=GROUP)
    grouped = W.reshape(W.shape[0], -1, GROUP)
    scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    return fake_quantize(W, scale, zero, args)


def theirs_hqq(W: torch.Tensor, bits: int) -> torch.Tensor:
    from hqq.core.quantize import Quantizer

    levels, meta = Quantizer.quantize(W, nbits=bits, group_size=GROUP, optimize=True, axis=1, bitpack=False,
                                      compute_dtype=torch.float32, device="cpu")
    meta["compute_dtype"] = torch.float32
    return Quantizer.dequantize(levels, meta).reshape(W.shape).float()


def theirs_nf4(W: torch.Tensor, bits: int) -> torch.Tensor:
    import bitsandbytes.functional as bnb

    packed, state = bnb.quantize_4bit(W, blocksize=GROUP, quant_type="nf4")
    return bnb.dequantize_4bit(packed, state).float()


PAIRS = [  # (ours, theirs, library, bits)
    ("rtn:bits={b},group=64,zero=int", theirs_rtn, "compressed-tensors 0.20.1", (3, 4)),
    ("rtn:bits={b},group=64", theirs_rtn, "compressed-tensors 0.20.1 (ours: float zero-point)", (3, 4)),
    ("hqq:bits={b},group=64", theirs_hqq, "hqq 0.2.8.post1", (3, 4)),
    ("nf:bits={b},group=64", theirs_nf4, "bitsandbytes 0.50.2", (4,)),
]


def with_weights(reference, fn, bits):
    """A copy of ``reference`` whose block linear weights are ``fn(W, bits)``; also the weight statistics' inputs."""
    model = copy.deepcopy(reference)
    pairs = {}
    for layer in range(hooks.n_layers(model)):
        for role, slot in hooks.linear_weights(model, layer).items():
            W = slot.read().detach().float().clone()
            W_theirs = fn(W, bits)
            slot.write(W_theirs)
            pairs[f"{layer}.{role}"] = (W, W_theirs)
    return model, pairs


def weight_agreement(ours_model, pairs, bits):
    same, total, diff2, ref2 = 0, 0, 0.0, 0.0
    for layer in range(hooks.n_layers(ours_model)):
        for role, slot in hooks.linear_weights(ours_model, layer).items():
            W, W_theirs = pairs[f"{layer}.{role}"]
            W_ours = slot.read().detach().float()
            grouped = W.reshape(W.shape[0], -1, GROUP)
            step = ((grouped.amax(-1, keepdim=True) - grouped.amin(-1, keepdim=True)) / (2**bits - 1))
            close = (W_ours - W_theirs).abs().reshape_as(grouped) < step / 2
            same += int(close.sum())
            total += close.numel()
            diff2 += float(((W_ours - W_theirs) ** 2).sum())
            ref2 += float((W**2).sum())
    return same / total, (diff2 / ref2) ** 0.5


def top_jaccard(a: torch.Tensor, b: torch.Tensor, share: float = 0.1) -> float:
    k = max(1, round(share * len(a)))
    top_a, top_b = set(torch.topk(a, k).indices.tolist()), set(torch.topk(b, k).indices.tolist())
    return len(top_a & top_b) / len(top_a | top_b)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=128, help="evaluation examples (the report: 128)")
    parser.add_argument("--out", default="docs/data/crosscheck")
    args = parser.parse_args()
    model = interp.load_model("smollm2-135m")
    examples = interp.load_examples("wiki", model.tokenizer, n=args.n, seq_len=128, seed=0, split="eval")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for ours_spec, fn, library, bit_widths in PAIRS:  # first the weights (cheap) for every pair
        for bits in bit_widths:
            spec = ours_spec.format(b=bits)
            ours = quantize(model, spec, progress=False)
            theirs, pairs = with_weights(model, fn, bits)
            same, rel = weight_agreement(ours, pairs, bits)
            rows.append({"ours": spec, "library": library, "bits": bits, "same_level_share": same,
                         "relative_weight_difference": rel, "n": len(examples)})
            print(json.dumps(rows[-1]), flush=True)
            pd.DataFrame(rows).to_csv(out / "crosscheck.csv", index=False)
    errors = {"example": list(examples.ids)}
    reference = interp.nll(model, examples).double()
    for row, (ours_spec, fn, _library, bits) in zip(rows, [(o, f, lib, b) for o, f, lib, bw in PAIRS for b in bw],
                                                     strict=True):
        start = time.time()
        spec = ours_spec.format(b=bits)
        ours, (theirs, _) = quantize(model, spec, progress=False), with_weights(model, fn, bits)
        e_ours = interp.nll(ours, examples).double() - reference
        e_theirs = interp.nll(theirs, examples).double() - reference
        row.update({"pearson": float(torch.corrcoef(torch.stack([e_ours, e_theirs]))[0, 1]),
                    "top10_jaccard": top_jaccard(e_ours, e_theirs), "mean_error_ours": float(e_ours.mean()),
                    "mean_error_theirs": float(e_theirs.mean()), "seconds": round(time.time() - start, 1)})
        errors[f"ours|{spec}"], errors[f"theirs|{spec}"] = e_ours.tolist(), e_theirs.tolist()
        print(json.dumps(row), flush=True)
        pd.DataFrame(rows).to_csv(out / "crosscheck.csv", index=False)
        pd.DataFrame(errors).to_csv(out / "crosscheck_errors.csv", index=False)


if __name__ == "__main__":
    main()
