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

from interp.cli.common import add_checks, add_model_data, check_out, command, float_in, int_at_least, set_threads
from interp.quant.spec import METHODS


def _bits(text: str) -> tuple[int, int]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bits must be two whole numbers like 3,4; got {text!r}") from None
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"bits must be two widths, low and high, like 3,4; got {text!r}")
    return values[0], values[1]


def _method(text: str) -> str:
    from interp.cli.common import unknown_name

    if text not in METHODS:
        raise argparse.ArgumentTypeError(unknown_name("method", text, list(METHODS)))
    return text


def check_request(args: argparse.Namespace) -> None:
    """Supported widths, and a budget strictly between the two ends (SpecError otherwise)."""
    from interp.quant.prescribe import validate_request

    validate_request(args.method, args.bits, args.budget, args.group)


def _args(p: argparse.ArgumentParser) -> None:
    add_model_data(p, n=32, seq_len=128)
    p.add_argument("--method", default="gptq", type=_method, help=f"quantizer, one of {', '.join(METHODS)}")
    p.add_argument("--bits", default=(3, 4), type=_bits, help="the two bit widths, low,high (e.g. 3,4)")
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
    plan = prescribe(model, args.method, args.bits, args.budget, calibration=calibration, group=args.group,
                     sensitivity_n=args.sensitivity_n, batch_size=args.batch_size, progress=not args.quiet and None)
    path = plan.save(args.out)
    from interp.quant.sensitivity import sensitivity

    rows = calibration.subset(list(range(min(args.sensitivity_n, len(calibration)))))
    scores = sensitivity(model, f"{args.method}:bits={min(args.bits)},group={args.group}", rows,
                         calibration=calibration, progress=False)  # cached by prescribe: a read
    scores.table(n_boot=1000, seed=args.seed).to_csv(Path(args.out) / "sensitivity.csv", index=False)
    high = sum(1 for bits in plan.widths.values() if bits == max(args.bits))
    print(f"{high} of {len(plan.widths)} weights at {max(args.bits)} bits: {plan.achieved:.4f} bits per weight "
          f"(budget {plan.budget:g}; ends {plan.ends[0]:.4f} and {plan.ends[1]:.4f}), {time.time() - start:.0f} s. "
          f"Saved {path}")
    return 0
