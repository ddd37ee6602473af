"""Quantize the reference SmolLM2 with llm-compressor's AWQ; write the dequantized block weights as safetensors.

Runs in llm-compressor's own environment (``requirements-awq.txt``: llm-compressor 0.14 wants
transformers <= 5.17, the project pins 5.23), never imports interp. Reads what
``gptq_library.py prepare`` wrote into WORK (the reference as a plain Hugging Face folder and the
project's calibration token ids), writes ``WORK/theirs-awq{bits}.safetensors`` and
``WORK/theirs-awq{bits}.json`` (the library's settings, the chosen scales' summary, wall seconds).

llm-compressor's AWQ does not fold the scale back into the weight: it multiplies the balance
layers' input columns by ``s`` and divides the previous op (the RMSNorm gamma, or the rows of
``v_proj`` / ``up_proj``) by ``s``, then quantizes the scaled weights. The scales are recorded here
(a wrapper around ``AWQModifier._compute_best_scale``, no change to the library's arithmetic) and
every dequantized weight is written back in the original model's space,
``diag(r) Q(W') diag(1/s)`` (``s`` its input columns' scale, ``r`` the scale its output rows were
divided by), so that it can replace the reference's weight with the reference's own norms: the
function is the library model's (diagonal scalings commute with the attention mix and the SwiGLU
product).

    python awq_theirs.py WORK --bits 4 3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def check_unfolding(work: Path, library_model, library_space: dict, unfolded: dict, tokens) -> dict:
    """Logits of the library's model against the reference with the unfolded weights, on a few calibration rows.

    The library's model is rebuilt as a plain transformers model (no quantization wrappers): the
    reference architecture with the library's smoothed parameters (RMSNorm gammas divided by s) and
    its dequantized weights in its own space. The unfolded weights in the reference with the
    reference's own gammas must give the same logits, to float32 rounding.
    """
    import torch
    from transformers import AutoModelForCausalLM

    def load(state: dict):
        m = AutoModelForCausalLM.from_pretrained(str(work / "reference"), dtype=torch.float32)
        missing = set(state) - set(m.state_dict())
        if missing:
            raise SystemExit(f"unknown parameters {sorted(missing)[:3]}")
        m.load_state_dict(state, strict=False)
        return m.eval()

    smoothed = {k: v.detach().float() for k, v in library_model.state_dict().items() if k.endswith("norm.weight")}
    with torch.no_grad():
        a = load({**smoothed, **library_space})(tokens).logits
        b = load(unfolded)(tokens).logits
    return {"rows": len(tokens), "max_abs_logit_diff": float((a - b).abs().max()),
            "max_abs_logit": float(a.abs().max()), "n_smoothed_norms": len(smoothed)}


def quantize(work: Path, bits: int, group: int, duo_scaling: bool, n_grid: int) -> None:
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, forward_quantize
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.modifiers.transform.awq import base as awq_base
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    tokens = load_file(str(work / "calibration.safetensors"))["input_ids"]
    dataset = Dataset.from_dict({"input_ids": tokens.tolist(), "attention_mask": [[1] * tokens.shape[1]] * len(tokens)})
    original = {k: v.float() for k, v in load_file(str(work / "reference" / "model.safetensors")).items()}

    scales: dict[str, torch.Tensor] = {}  # balance layer -> s (input columns); smooth Linear -> s (output rows)
    ratios: dict[str, float] = {}
    compute = awq_base.AWQModifier._compute_best_scale

    def recording(self, mapping, fp16_outputs, orig_layer_weights):
        best = compute(self, mapping, fp16_outputs, orig_layer_weights)
        for name in mapping.balance_names:
            scales[f"in|{name}"] = best.float().clone()
        scales[f"out|{mapping.smooth_name}"] = best.float().clone()
        history = [m for m in self._error_metrics if m["layer_name"] == mapping.smooth_name]
        ratios[mapping.smooth_name] = float(history[-1]["reduction"]) if history else float("nan")
        return best

    awq_base.AWQModifier._compute_best_scale = recording
    # CPU patch: AWQ pins the cached block inputs before each mapping's grid search, for faster host-to-device
    # copies; pin_memory() raises "Cannot access accelerator device when none is available" without one
    from llmcompressor.pipelines.cache import IntermediatesCache
    if not torch.accelerator.is_available():
        IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None

    weights_args = QuantizationArgs(num_bits=bits, type="int", symmetric=False, strategy="group", group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights_args)
    recipe = [AWQModifier(duo_scaling=duo_scaling, n_grid=n_grid),
              QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])]
    start = time.time()
    model = AutoModelForCausalLM.from_pretrained(str(work / "reference"), dtype=torch.float32)
    oneshot(model=model, dataset=dataset, recipe=recipe, num_calibration_samples=len(tokens),
            max_seq_length=tokens.shape[1], batch_size=1, shuffle_calibration_samples=False)
    seconds = time.time() - start

    weights, library_space, folded_in, folded_out = {}, {}, 0, 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not hasattr(module, "weight_scale"):
            continue
        with torch.no_grad():
            W = forward_quantize(module, module.weight, "weight", module.quantization_scheme.weights).float()
        library_space[f"{name}.weight"] = W
        if f"in|{name}" in scales:
            W = W / scales[f"in|{name}"].view(1, -1)
            folded_in += 1
        if f"out|{name}" in scales:
            s = scales[f"out|{name}"]
            W = W.clone()
            W[-s.numel():] *= s.view(-1, 1)
            folded_out += 1
        key = f"{name}.weight"
        if key in original and original[key].shape != W.shape:
            raise SystemExit(f"{key}: {tuple(W.shape)} against the reference's {tuple(original[key].shape)}")
        weights[key] = W.contiguous()
    if not weights:
        raise SystemExit("llm-compressor left no quantized Linear with weight_scale; nothing to compare.")
    save_file(weights, str(work / f"theirs-awq{bits}.safetensors"))
    try:
        unfold_check = check_unfolding(work, model, library_space, weights, tokens[:4])
    except Exception as error:  # recorded, not fatal: the weights are already written
        unfold_check = {"error": repr(error)}
    import compressed_tensors
    import llmcompressor
    import transformers

    smooth_layers = sorted({k.split("|", 1)[1] for k in scales if k.startswith("out|")})
    settings = {"library": f"llm-compressor {llmcompressor.__version__}",
                "compressed_tensors": compressed_tensors.__version__, "transformers": transformers.__version__,
                "torch": torch.__version__, "bits": bits, "group_size": group, "sym": False,
                "duo_scaling": duo_scaling, "n_grid": n_grid, "n_calibration": len(tokens),
                "n_layers_quantized": len(weights), "n_scaled_inputs": folded_in, "n_scaled_output_rows": folded_out,
                "smooth_layers": len(smooth_layers),
                "smooth_layer_kinds": sorted({n.rsplit(".", 1)[-1] for n in smooth_layers}),
                "unfolding_check": unfold_check,
                "mean_error_reduction": float(torch.tensor(list(ratios.values())).nanmean()) if ratios else None,
                "seconds": round(seconds, 1)}
    (work / f"theirs-awq{bits}.json").write_text(json.dumps(settings, indent=1) + "\n")
    print(json.dumps(settings), flush=True)
    awq_base.AWQModifier._compute_best_scale = compute


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("work", type=Path)
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 3])
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--duo-scaling", type=int, default=0,
                        help="llm-compressor's default 1: s = mean|x|^a / mean|w|^(1-a); 0: interp's mean|x|^a")
    parser.add_argument("--n-grid", type=int, default=20)
    args = parser.parse_args()
    work = args.work.resolve()
    for bits in args.bits:
        quantize(work, bits, args.group, bool(args.duo_scaling), args.n_grid)


if __name__ == "__main__":
    main()
