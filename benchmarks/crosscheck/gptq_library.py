"""interp's GPTQ against gptqmodel's, on the bundled SmolLM2, with the same calibration examples.

Two stages in the project venv around one in gptqmodel's own venv (``gptq_theirs.py``; the whole
chain is ``gptq_library.sh``):

- ``prepare WORK``: write the reference (GGUF Q4_1 dequantized to fp32) as a plain Hugging Face
  folder ``WORK/reference`` and the report's calibration token ids (wiki, 32 x 128, seed 0,
  split ``calibration``) as ``WORK/calibration.safetensors``.
- ``compare WORK``: for each bit width that ``gptq_theirs.py`` wrote, put gptqmodel's dequantized
  weights into a copy of the reference, quantize the reference with interp's GPTQ on the same
  calibration rows (also with its grid patched to gptqmodel's integer zero-points), and compute
  crosscheck.py's columns (same grid level, relative weight
  difference, per-example error Pearson, top-10% Jaccard, mean errors) on the evaluation
  examples (wiki, ``--n`` x 128 tokens, seed 0). Rows go to ``docs/data/crosscheck/crosscheck_gptq.csv``
  and the per-example errors to ``crosscheck_gptq_errors.csv``.

    .venv/bin/python benchmarks/crosscheck/gptq_library.py prepare /tmp/gptq-work
    /tmp/xvenv/bin/python benchmarks/crosscheck/gptq_theirs.py /tmp/gptq-work --bits 4 3
    .venv/bin/python benchmarks/crosscheck/gptq_library.py compare /tmp/gptq-work --n 64
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import torch

import interp
from interp.models import export_hf
from interp.quant import quantize
from interp.quant.methods._common import MinMaxGrid
from interp.runtime import hooks

sys.path.insert(0, str(Path(__file__).parent))
from crosscheck import GROUP, top_jaccard, weight_agreement  # noqa: E402

# interp's spec for each of gptqmodel's settings (gptq_theirs.py's defaults: act-order on, damp 0.01, asymmetric)
OURS = "gptq:bits={b},group=64,damp=0.01,act_order=1,block=128"


@contextlib.contextmanager
def integer_zero_points() -> Iterator[None]:
    """interp's GPTQ with gptqmodel's grid: each group's range widened to include 0, zero-point rounded.

    interp's ``gptq`` has no ``zero`` option (its grid is the float-zero-point min-max grid of
    ``rtn``'s default); this patches the grid fitter it calls, for this comparison only, so the
    row isolates the algorithm from the grid convention.
    """
    original = MinMaxGrid.__dict__["fit"]

    def fit(cls, values, bits, dim=-1, integer_zero=False):
        return original.__func__(cls, values, bits, dim, True)

    MinMaxGrid.fit = classmethod(fit)
    try:
        yield
    finally:
        MinMaxGrid.fit = original


def on_static_grid(pairs, bits: int) -> float:
    """Share of gptqmodel's weights that sit on the integer-zero-point min-max grid of their original group.

    With static groups every dequantized weight is such a grid point, levels 0 .. 2^bits - 1, so
    this checks that the weights were read out of gptqmodel correctly (orientation, zero-point layout).
    gptqmodel stores the scales in float16 (relative rounding <= 2^-11), which moves level q by up to
    q * 2^-11; the tolerance is twice the largest such shift.
    """
    tolerance = (2**bits - 1) * 2.0**-10
    on, total = 0, 0
    for W, theirs in pairs.values():
        grid = MinMaxGrid.fit(W.reshape(W.shape[0], -1, GROUP), bits, integer_zero=True)
        levels = theirs.reshape(W.shape[0], -1, GROUP) * grid.inv_scale + grid.zero
        on += int((((levels - levels.round()).abs() <= tolerance) & (levels.round() >= 0)
                   & (levels.round() <= 2**bits - 1)).sum())
        total += levels.numel()
    return on / total


def calibration_examples(model):
    return interp.load_examples("wiki", model.tokenizer, n=32, seq_len=128, seed=0, split="calibration")


def prepare(work: Path) -> None:
    from safetensors.torch import save_file

    model = interp.load_model("smollm2-135m")
    cal = calibration_examples(model)
    if cal.padded:
        raise SystemExit("the calibration rows are padded; gptq_theirs.py passes them unpadded")
    work.mkdir(parents=True, exist_ok=True)
    export_hf(model, work / "reference")
    save_file({"input_ids": cal.tokens.contiguous()}, str(work / "calibration.safetensors"))
    (work / "calibration.json").write_text(json.dumps({"ids": list(cal.ids), "split": "calibration", "n": len(cal),
                                                       "seq_len": cal.seq_len, "seed": 0}, indent=1) + "\n")


def hf_names(model) -> dict[str, str]:
    """``"{layer}.{role}"`` -> the Hugging Face parameter name of that block weight (bridge wrappers dropped)."""
    by_id = {id(module): name for name, module in model.original_model.named_modules()}
    return {f"{layer}.{role}": f"{by_id[id(slot.module)]}.weight".replace("._original_component", "")
            for layer in range(hooks.n_layers(model)) for role, slot in hooks.linear_weights(model, layer).items()}


def with_library_weights(reference, weights: dict[str, torch.Tensor]):
    model = copy.deepcopy(reference)
    names, pairs = hf_names(model), {}
    for layer in range(hooks.n_layers(model)):
        for role, slot in hooks.linear_weights(model, layer).items():
            W = slot.read().detach().float().clone()
            theirs = weights[names[f"{layer}.{role}"]]
            if theirs.shape != W.shape:
                raise SystemExit(f"{names[f'{layer}.{role}']}: gptqmodel's weight is {tuple(theirs.shape)}, "
                                 f"the reference's {tuple(W.shape)}")
            slot.write(theirs)
            pairs[f"{layer}.{role}"] = (W, theirs)
    return model, pairs


def compare(work: Path, n: int, out: Path) -> None:
    from safetensors.torch import load_file

    model = interp.load_model("smollm2-135m")
    cal = calibration_examples(model)
    stored = json.loads((work / "calibration.json").read_text())["ids"]
    if stored != list(cal.ids):
        raise SystemExit("the calibration rows differ from the ones gptq_theirs.py used; rerun prepare")
    examples = interp.load_examples("wiki", model.tokenizer, n=n, seq_len=128, seed=0, split="eval")
    reference = interp.nll(model, examples).double()
    rows, errors = [], {"example": list(examples.ids)}
    for bits, zero in ((4, "float"), (4, "int"), (3, "float"), (3, "int")):
        path = work / f"theirs-gptq{bits}.safetensors"
        if not path.exists():
            continue
        settings = json.loads((work / f"theirs-gptq{bits}.json").read_text())
        start = time.time()
        spec = OURS.format(b=bits)
        with integer_zero_points() if zero == "int" else contextlib.nullcontext():
            ours = quantize(model, spec, calibration=cal, progress=False)
        seconds_ours = time.time() - start
        if zero == "int":
            spec += " (grid patched to integer zero-points)"
        theirs, pairs = with_library_weights(model, load_file(str(path)))
        same, rel = weight_agreement(ours, pairs, bits)
        theirs_on_grid = on_static_grid(pairs, bits)
        e_ours = interp.nll(ours, examples).double() - reference
        e_theirs = errors.get(f"theirs|{OURS.format(b=bits)}")
        e_theirs = (interp.nll(theirs, examples).double() - reference if e_theirs is None
                    else torch.tensor(e_theirs, dtype=torch.float64))
        rows.append({"ours": spec, "library": settings["library"], "bits": bits, "group": GROUP,
                     "library_settings": json.dumps({k: settings[k] for k in ("desc_act", "damp_percent", "sym")}),
                     "same_level_share": same, "relative_weight_difference": rel,
                     "theirs_on_static_int_grid": theirs_on_grid,
                     "pearson": float(torch.corrcoef(torch.stack([e_ours, e_theirs]))[0, 1]),
                     "top10_jaccard": top_jaccard(e_ours, e_theirs), "mean_error_ours": float(e_ours.mean()),
                     "mean_error_theirs": float(e_theirs.mean()), "n": len(examples),
                     "seconds_quantize_ours": round(seconds_ours, 1), "seconds_quantize_theirs": settings["seconds"],
                     "seconds": round(time.time() - start, 1)})
        errors[f"ours|{spec}"], errors[f"theirs|{OURS.format(b=bits)}"] = e_ours.tolist(), e_theirs.tolist()
        print(json.dumps(rows[-1]), flush=True)
        out.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(out / "crosscheck_gptq.csv", index=False)
        pd.DataFrame(errors).to_csv(out / "crosscheck_gptq_errors.csv", index=False)
    if not rows:
        raise SystemExit(f"no theirs-gptq*.safetensors in {work}: run gptq_theirs.py first")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("stage", choices=["prepare", "compare"])
    parser.add_argument("work", type=Path)
    parser.add_argument("--n", type=int, default=64, help="evaluation examples")
    parser.add_argument("--out", type=Path, default=Path("docs/data/crosscheck"))
    args = parser.parse_args()
    if args.stage == "prepare":
        prepare(args.work)
    else:
        compare(args.work, args.n, args.out)


if __name__ == "__main__":
    main()
