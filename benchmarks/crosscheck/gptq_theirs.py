"""Quantize the reference SmolLM2 with gptqmodel's GPTQ; write the dequantized block weights as safetensors.

Runs in its own environment (``requirements-gptq.txt``: gptqmodel pins numpy, sets allocator
environment variables on import and writes ``./logs``), never imports interp. Reads what
``gptq_library.py prepare`` wrote into WORK (the reference as a plain Hugging Face folder and
the project's calibration token ids), writes ``WORK/theirs-gptq{bits}.safetensors`` (Hugging Face
names -> dequantized float32 weights, ``[d_out, d_in]``) and ``WORK/theirs-gptq{bits}.json`` (the
library's settings and the wall seconds).

    python gptq_theirs.py WORK --bits 4 3
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def quantize(work: Path, bits: int, group: int, desc_act: bool, damp: float, sym: bool) -> None:
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module
    from safetensors.torch import load_file, save_file

    tokens = load_file(str(work / "calibration.safetensors"))["input_ids"]
    calibration = [{"input_ids": row.tolist(), "attention_mask": [1] * len(row)} for row in tokens]
    # interp's GPTQ: act-order with static groups (each group's grid from the original weights), no
    # group-aware reordering (gptqmodel's default for desc_act=False, which interp has not got)
    config = QuantizeConfig(bits=bits, group_size=group, desc_act=desc_act, static_groups=True, act_group_aware=False,
                            damp_percent=damp, sym=sym, offload_to_disk=False)  # else the layers end as meta
    start = time.time()
    model = GPTQModel.load(str(work / "reference"), config, device="cpu", dtype=torch.float32)
    model.quantize(calibration, batch_size=8)
    weights, formats = {}, set()
    for name, module in model.model.named_modules():
        if hasattr(module, "dequantize_weight") and hasattr(module, "qweight"):
            if module.qweight.is_meta:
                raise SystemExit(f"{name}: gptqmodel left the packed weight on the meta device")
            # the packed zero-points are in GPTQ's v1 layout (zero - 1) after quantize(), while
            # dequantize_weight() reads them as v2 (zero): convert with gptqmodel's own function first,
            # or every weight comes out one grid step high
            formats.add(module.qzero_format())
            if module.qzero_format() == 1:
                convert_gptq_v1_to_v2_format_module(module, bits, module.pack_dtype)
            W = module.dequantize_weight().T  # gptqmodel's torch kernel gives [d_in, d_out], square ones too
            if W.shape != (module.out_features, module.in_features):
                raise SystemExit(f"{name}: dequantize_weight() gave {tuple(W.shape)}")
            weights[f"{name}.weight"] = W.float().contiguous()
    if not weights:
        raise SystemExit("gptqmodel left no quantized linear layer with dequantize_weight(); nothing to compare.")
    save_file(weights, str(work / f"theirs-gptq{bits}.safetensors"))
    import gptqmodel

    settings = {"library": f"gptqmodel {gptqmodel.__version__}", "torch": torch.__version__, "bits": bits,
                "group_size": group, "desc_act": desc_act, "static_groups": True, "damp_percent": damp, "sym": sym,
                "n_calibration": len(calibration), "n_layers_quantized": len(weights),
                "qzero_format_after_quantize": sorted(formats),
                "seconds": round(time.time() - start, 1)}
    (work / f"theirs-gptq{bits}.json").write_text(json.dumps(settings, indent=1) + "\n")
    print(json.dumps(settings), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("work", type=Path)
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 3])
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--desc-act", type=int, default=1, help="act-order (interp's default is on)")
    parser.add_argument("--damp", type=float, default=0.01)
    parser.add_argument("--sym", type=int, default=0, help="asymmetric by default, as interp's GPTQ")
    args = parser.parse_args()
    # gptqmodel 7.6.0 sizes its CPU pool as ceil(cores / 2) and then asks for a 2-worker loader pool
    # inside it, which fails on a 2-core machine ("Virtual pool 'model_loader:cpu' requests 2 workers
    # but parent 'cpu' only has 1"); its own override is this variable
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    work = args.work.resolve()
    os.chdir(work)  # gptqmodel writes ./logs
    for bits in args.bits:
        quantize(work, bits, args.group, bool(args.desc_act), args.damp, bool(args.sym))


if __name__ == "__main__":
    main()
