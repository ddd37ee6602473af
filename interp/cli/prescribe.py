"""``interp prescribe``: a mixed-precision plan (a bit width per block linear weight) under a bit budget.

It measures each weight's sensitivity on calibration examples (the NLL increase when it alone
is quantized at the low width; cached), allocates the high width greedily by sensitivity per
extra bit, and writes ``plan.json`` (the width of every weight, the achieved average bits per
weight, the settings, and the spec that quantizes with the plan: ``interp quantize --method
@OUT/plan.json``) and ``sensitivity.csv``. See :mod:`interp.quant.prescribe` for the bit
accounting and the allocation.

The method, the two widths and the budget are checked before the model loads: the widths
must be ones the method supports and the budget must lie strictly between the all-low and
all-high averages (scales and zero-points counted).
"""

from __future__ import annotations

import argparse
import time

from interp.cli.common import (
    add_checks,
    add_model_data,
    check_loads_model,
    check_out,
    command,
    float_in,
    int_at_least,
    set_threads,
)
from interp.quant.spec import METHODS


def _bits(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bits must be whole numbers like 3,4; got {text!r}") from None
    if len(values) < 2:
        raise argparse.ArgumentTypeError(f"bits must be two widths or more, like 3,4 (or 3,4,5,6,8 with --format "
                                         f"llama.cpp); got {text!r}")
    return values


def _method(text: str) -> str:
    from interp.cli.common import unknown_name

    if text not in METHODS:
        raise argparse.ArgumentTypeError(unknown_name("method", text, list(METHODS)))
    return text


def check_request(args: argparse.Namespace) -> None:
    """Supported widths, and a budget the widths allow (SpecError otherwise)."""
    from interp.quant.prescribe import check_llama_budget, validate_request

    if args.format == "llama.cpp":
        check_llama_budget(None, args.bits, args.budget)
    else:
        validate_request(args.method, args.bits, args.budget, args.group)


def _args(p: argparse.ArgumentParser) -> None:
    add_model_data(p, n=32, seq_len=128)
    p.add_argument("--method", default="gptq", type=_method, help=f"quantizer, one of {', '.join(METHODS)}")
    p.add_argument("--bits", default=(3, 4), type=_bits,
                   help="the two bit widths, low,high (e.g. 3,4); with --format llama.cpp the candidate widths, "
                        "e.g. 4,5,6,8 (each becomes its llama.cpp type: Q4_K, Q5_K, Q6_K, Q8_0, before the shape "
                        "fallback)")
    p.add_argument("--format", default="interp", choices=("interp", "llama.cpp"),
                   help="interp: plan.json for interp quantize; llama.cpp: tensor_types.txt for llama-quantize "
                        "--tensor-type-file, types chosen by the output-error proxy, the budget in llama.cpp bits "
                        "per weight over the block linear weights")
    p.add_argument("--score", default="proxy", choices=("proxy", "fisher"),
                   help="with --format llama.cpp: proxy, the output-error proxy tr(dW H dW^T) (RTN stand-ins); "
                        "fisher, the Fisher-weighted output error in KL nats, with llama.cpp's exact rounding for "
                        "its legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)")
    p.add_argument("--budget", required=True, type=float_in(0, 64, low_open=True),
                   help="average bits per weight, group scales and zero-points counted (gptq group 64: 3.5 to "
                        "4.5 for 3,4)")
    p.add_argument("--group", type=int_at_least(1), default=64, help="group size")
    p.add_argument("--sensitivity-n", type=int_at_least(1), default=8,
                   help="calibration examples the sensitivity is measured on (the first of the --n)")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads")
    p.add_argument("--out", default="reports/prescribe", help="output folder")
    add_checks(p, check_request, check_out)


@command("prescribe", "a mixed-precision plan: a bit width per block weight under an average-bit budget", _args)
def cmd_prescribe(args: argparse.Namespace) -> int:
    from pathlib import Path

    from interp.cli.common import load_model_and_examples
    from interp.quant.prescribe import prescribe

    set_threads(args)
    start = time.time()
    model, calibration = load_model_and_examples(args, split="calibration")
    if args.format == "llama.cpp":
        return _llama_cpp(args, model, calibration, start)
    plan = prescribe(model, args.method, args.bits, args.budget, calibration=calibration, group=args.group,
                     sensitivity_n=args.sensitivity_n, batch_size=args.batch_size, progress=not args.quiet and None)
    path = plan.save(args.out)
    from interp.quant.sensitivity import sensitivity

    rows = calibration.subset(list(range(min(args.sensitivity_n, len(calibration)))))
    scores = sensitivity(model, f"{args.method}:bits={min(args.bits)},group={args.group}", rows,
                         calibration=calibration, progress=False)  # cached by prescribe: a read
    from interp.io import write_csv

    write_csv(Path(args.out) / "sensitivity.csv", scores.table(n_boot=1000, seed=args.seed), index=False)
    high = sum(1 for bits in plan.widths.values() if bits == max(args.bits))
    print(f"{high} of {len(plan.widths)} weights at {max(args.bits)} bits: {plan.achieved:.4f} bits per weight "
          f"(budget {plan.budget:g}; ends {plan.ends[0]:.4f} and {plan.ends[1]:.4f}), {time.time() - start:.0f} s. "
          f"Saved {path}")
    return 0


def _llama_cpp(args: argparse.Namespace, model: object, calibration: object, start: float) -> int:
    from interp.quant.prescribe import model_shapes, prescribe_llama_cpp

    plan = prescribe_llama_cpp(model, args.budget, calibration, widths=args.bits, chunks=min(8, len(calibration)),
                               batch_size=args.batch_size, progress=not args.quiet and None, score=args.score,
                               seed=args.seed)
    path = plan.save(args.out, model_shapes(model))
    mixes = ", ".join(f"{mix} {bits:.3f}" for mix, bits in plan.baselines.items())
    print(f"{plan.achieved:.4f} bits per weight over the block linear weights (budget {plan.budget:g}; ends "
          f"{plan.ends[0]:.4f} and {plan.ends[1]:.4f}; llama.cpp's own mixes here: {mixes}), "
          f"{time.time() - start:.0f} s. Saved {path}: llama-quantize --tensor-type-file {path} ...")
    return 0


def _imatrix_args(p: argparse.ArgumentParser) -> None:
    add_model_data(p, n=128, seq_len=128)
    p.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads")
    p.add_argument("--out", default="reports/imatrix", help="output folder (imatrix.gguf, imatrix.csv)")
    add_checks(p, check_out)


@command("imatrix", "llama.cpp's importance matrix (imatrix.gguf for llama-quantize --imatrix) from calibration "
         "examples", _imatrix_args)
def cmd_imatrix(args: argparse.Namespace) -> int:
    from pathlib import Path

    from interp.cli.common import load_model_and_examples
    from interp.quant.imatrix import importance_matrix, write_imatrix

    set_threads(args)
    start = time.time()
    model, calibration = load_model_and_examples(args, split="calibration")
    matrix = importance_matrix(model, calibration, batch_size=args.batch_size, progress=not args.quiet and None,
                               datasets=(str(args.data),))
    out = Path(args.out)
    path = write_imatrix(matrix, out / "imatrix.gguf")
    from interp.io import write_file

    table = matrix.table()
    write_file(out / "imatrix.csv", lambda tmp: table.to_csv(tmp, index=False))
    top = table.sort_values("max_over_mean", ascending=False).iloc[0]
    print(f"{len(table)} weights, {matrix.tokens} tokens ({matrix.chunk_count} chunks of {matrix.chunk_size}), "
          f"{time.time() - start:.0f} s; most uneven input: {top.tensor} (largest channel {top.max_over_mean:.0f}x "
          f"the mean). Saved {path}: llama-quantize --imatrix {path} ...")
    return 0


def _tensor_type_file(args: argparse.Namespace) -> None:
    """The tensor-type file reads as llama-quantize reads it (names are checked once the model is known)."""
    from interp.quant.llama_cpp import read_tensor_types

    read_tensor_types(args.file)


def _tensor_types_args(p: argparse.ArgumentParser) -> None:
    from interp.quant.llama_cpp import MIXES

    p.add_argument("file", help="a llama-quantize --tensor-type-file: whitespace-separated PATTERN=TYPE items")
    p.add_argument("--model", default="smollm2-135m",
                   help="bundled model (smollm2-135m, gemma3-270m), a Hugging Face folder, or a .gguf file")
    p.add_argument("--mix", default="Q4_K_M", choices=MIXES, help="the llama-quantize type the file goes with")
    p.add_argument("--out", default="reports/tensor-types", help="output folder (tensor_types.csv)")
    add_checks(p, _tensor_type_file, check_loads_model, check_out)


@command("tensor-types", "what llama-quantize MIX --tensor-type-file FILE stores for each block weight of a model, "
         "the shape fallback applied, and its bytes against the mix alone", _tensor_types_args)
def cmd_tensor_types(args: argparse.Namespace) -> int:
    from pathlib import Path

    import interp
    from interp.io import write_file
    from interp.quant import llama_cpp as lc
    from interp.quant.prescribe import model_shapes

    model = interp.load_model(args.model)
    shapes = model_shapes(model)
    names = [lc.gguf_name(s.layer, s.role) for s in shapes]
    items = lc.read_tensor_types(args.file, [*names, "token_embd.weight", "output.weight"])
    resolved = lc.resolve_tensor_types(shapes, items, args.mix)
    alone = lc.stored_types(shapes, lc.mix_types(shapes, args.mix))
    import pandas as pd

    def nbytes(ggml_type: str, d_out: int, d_in: int) -> int:
        block, size = lc.GGML_TYPES[ggml_type]
        return d_out * (d_in // block) * size

    rows = [{"tensor": name, "d_out": s.d_out, "d_in": s.d_in, "pattern": resolved[s.name][1],
             "type": resolved[s.name][0], "bits_per_weight": lc.bits_per_weight(resolved[s.name][0]),
             "bytes": nbytes(resolved[s.name][0], s.d_out, s.d_in), "mix_type": alone[s.name],
             "mix_bytes": nbytes(alone[s.name], s.d_out, s.d_in)} for name, s in zip(names, shapes, strict=True)]
    table = pd.DataFrame(rows)
    out = Path(args.out)
    path = out / "tensor_types.csv"
    write_file(path, lambda tmp: table.to_csv(tmp, index=False))
    named = int((table.pattern != "").sum())
    weights = sum(s.size for s in shapes)
    total, mix_total = int(table.bytes.sum()), int(table.mix_bytes.sum())
    print(f"{named} of {len(table)} block weights named by {args.file}, {len(table) - named} left to {args.mix}'s "
          f"rule. Block weights: {total} bytes, {8 * total / weights:.4f} bits per weight; {args.mix} alone: "
          f"{mix_total} bytes, {8 * mix_total / weights:.4f} ({total - mix_total:+d} bytes). Saved {path}")
    return 0
