"""Time ``quantize_weight`` for every method against the libraries it is checked against.

Shapes are SmolLM2-135M's MLP projections: gate/up ``[1536, 576]`` and down
``[576, 1536]``. GPTQ and AWQ get 128 x 128 = 16,384 calibration tokens of a synthetic,
LLM-like input distribution (correlated channels, a few 12x outlier channels, a
per-token magnitude), and the reported output error is on 2,048 other tokens of it.

References:
- ``bnb nf4``: bitsandbytes ``quantize_4bit`` + ``dequantize_4bit`` (CPU);
- ``hqq pkg``: ``hqq.core.quantize.Quantizer.quantize`` + ``dequantize`` called directly.

Run from the repository root::

    python benchmarks/bench_quant_methods.py [--repeats 5] [--threads 1] [--quick] [--json PATH]

``--quick`` times the first shape only, by process CPU time (``--clock cpu``: a descheduled
thread on a loaded machine does not count), all variants round-robin (``--interleave``: load
that changes during the run falls on all of them alike); explicit options still win. Every row is also written
as a comparison (``ratio_is`` candidate/baseline, as in the table) to ``--json`` (default
``benchmarks/results/quant_methods.json``; schema in docs/benchmarks.md).

One thread by default: on a shared 2-core machine, two torch threads contend with
other processes and the timings scatter by 10x; one thread gives repeatable numbers.

It prints a markdown table: median wall time over the repeats, the ratio to the
reference named in the row (for gptq/awq: to our rtn at the same bits), and the
relative weight and held-out output errors.
"""

from __future__ import annotations

import argparse
import logging
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchjson  # noqa: E402

from interp.quant import quantize_weight  # noqa: E402
from interp.quant.methods import relative_error, relative_output_error  # noqa: E402

SHAPES = [(1536, 576), (576, 1536)]
N_CALIBRATION = 128 * 128
N_HELD_OUT = 2048
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]  # set by main() from --clock

# (our spec, reference label or None, rtn spec to compare against when no reference)
ROWS = [
    ("rtn:bits=4,group=64", "hqq pkg optimize=0", None),
    ("rtn:bits=4,group=64,zero=int", "hqq pkg optimize=0", None),
    ("nf:bits=4,group=64", "bnb nf4", None),
    ("nf:bits=3,group=64", "bnb nf4", None),
    ("hqq:bits=4,group=64,optimize=0", "hqq pkg optimize=0", None),
    ("hqq:bits=4,group=64", "hqq pkg optimize=1", None),
    ("gptq:bits=4,group=64", None, "rtn:bits=4,group=64"),
    ("gptq:bits=4,group=64,act_order=0", None, "rtn:bits=4,group=64"),
    ("gptq:bits=3,group=64", None, "rtn:bits=3,group=64"),
    ("awq:bits=4,group=64", None, "rtn:bits=4,group=64"),
    ("awq:bits=3,group=64", None, "rtn:bits=3,group=64"),
]


def activations(n_tokens: int, d_in: int, seed: int) -> torch.Tensor:
    """One fixed synthetic input distribution per d_in (seeded), sampled with ``seed``."""
    structure = torch.Generator().manual_seed(d_in)
    mixing = torch.eye(d_in) + 0.6 * torch.randn(d_in, d_in, generator=structure) / math.sqrt(d_in)
    channel_scale = torch.ones(d_in)
    channel_scale[torch.randperm(d_in, generator=structure)[: d_in // 100]] = 12.0
    sample = torch.Generator().manual_seed(seed)
    token_scale = torch.rand(n_tokens, 1, generator=sample) + 0.5
    return (torch.randn(n_tokens, d_in, generator=sample) @ mixing) * channel_scale * token_scale


def median_seconds(fn: Callable[[], torch.Tensor], repeats: int) -> tuple[float, torch.Tensor]:
    result = fn()  # warm-up: imports, codebooks, allocator
    times = []
    for _ in range(repeats):
        start = clock()
        result = fn()
        times.append(clock() - start)
    return statistics.median(times), result


def reference_fns(W: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    import bitsandbytes.functional as bnb
    from hqq.core.quantize import Quantizer

    def hqq_pkg(optimize: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            levels, meta = Quantizer.quantize(
                W,
                nbits=4,
                group_size=64,
                optimize=optimize,
                axis=1,
                bitpack=False,
                compute_dtype=torch.float32,
                device="cpu",
            )
            meta["compute_dtype"] = torch.float32
            return Quantizer.dequantize(levels, meta)

        return run

    def bnb_nf4() -> torch.Tensor:
        packed, state = bnb.quantize_4bit(W, blocksize=64, quant_type="nf4")
        return bnb.dequantize_4bit(packed, state)

    return {
        "bnb nf4": bnb_nf4,
        "hqq pkg optimize=0": hqq_pkg(False),
        "hqq pkg optimize=1": hqq_pkg(True),
    }


def interleaved(W: torch.Tensor, calibration: torch.Tensor, repeats: int) -> tuple[dict, dict]:
    """Every reference and spec of ``ROWS`` timed round-robin: ``(medians, results)``."""
    variants = dict(reference_fns(W))
    for spec, _, rtn_spec in ROWS:
        variants[spec] = lambda s=spec: quantize_weight(W, s, calibration)
        if rtn_spec is not None and rtn_spec not in variants:
            variants[rtn_spec] = lambda s=rtn_spec: quantize_weight(W, s)
    return benchjson.round_robin(variants, repeats, clock)


def bench_shape(shape: tuple[int, int], repeats: int, comparisons: list[dict] | None = None,
                interleave: bool = False) -> list[str]:
    d_out, d_in = shape
    W = torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(0)) * 0.02
    calibration = activations(N_CALIBRATION, d_in, seed=1)
    held_out = activations(N_HELD_OUT, d_in, seed=2)
    timed: dict[str, float] = {}
    W_hats: dict[str, torch.Tensor] = {}
    if interleave:
        timed, W_hats = interleaved(W, calibration, repeats)
    else:  # one after another: the references, then each spec and (once) the rtn it is compared with
        for label, fn in reference_fns(W).items():
            timed[label], _ = median_seconds(fn, repeats)
        for spec, reference, rtn_spec in ROWS:
            timed[spec], W_hats[spec] = median_seconds(lambda s=spec: quantize_weight(W, s, calibration), repeats)
            against = reference or rtn_spec
            if against is not None and against not in timed:
                timed[against], _ = median_seconds(lambda s=against: quantize_weight(W, s), repeats)
    lines = []
    for spec, reference, rtn_spec in ROWS:
        seconds, W_hat = timed[spec], W_hats[spec]
        against = reference or rtn_spec
        assert against is not None
        weight_error, output_error = relative_error(W, W_hat), relative_output_error(W, W_hat, held_out)
        if comparisons is not None:
            comparisons.append(benchjson.comparison(
                f"{d_out}x{d_in} {spec} vs {against}", spec, against, seconds, timed[against], repeats=repeats,
                ratio_is="candidate/baseline", clock="cpu" if clock is time.process_time else "wall",
                threads=torch.get_num_threads(), shape=[d_out, d_in],
                rel_weight_error=weight_error, rel_output_error=output_error))
        lines.append(
            f"| `{d_out}x{d_in}` | `{spec}` | {1000 * seconds:.1f} | {against} | "
            f"{1000 * timed[against]:.1f} | {seconds / timed[against]:.2f} | "
            f"{weight_error:.4f} | {output_error:.4f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default=None,
                        help="wall time (default) or process CPU time (default with --quick)")
    benchjson.add_interleave_option(parser)
    benchjson.add_options(parser, "quant_methods")
    args = parser.parse_args()
    if args.interleave is None:
        args.interleave = args.quick
    if args.clock is None:
        args.clock = "cpu" if args.quick else "wall"
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    print(
        f"torch {torch.__version__}, {args.threads} threads, {platform.processor() or platform.machine()}, "
        f"median of {args.repeats} runs after one warm-up{', cpu time' if args.clock == 'cpu' else ''}"
        f"{', variants interleaved' if args.interleave else ''}; "
        f"W ~ N(0, 0.02^2); "
        f"gptq/awq calibrated on {N_CALIBRATION} synthetic tokens, output error on "
        f"{N_HELD_OUT} held-out tokens\n"
    )
    print(
        "| W shape | spec | ours (ms) | compared with | theirs (ms) | ratio | rel. weight error | rel. output error |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|")
    comparisons: list[dict] = []
    for shape in SHAPES[:1] if args.quick else SHAPES:
        for line in bench_shape(shape, args.repeats, comparisons, args.interleave):
            print(line, flush=True)
    benchjson.write(args.json, "quant_methods", comparisons, args)


if __name__ == "__main__":
    main()
