"""How much does SAOBP cost? Attention forward and a training step, against standard attention.

Two measurements, printed as markdown tables (median milliseconds and ratio to standard):

1. Attention forward alone on random ``[batch, heads, L, d_head]`` queries, keys and values
   with a causal mask: standard (``softmax(QK^T/sqrt(d) + mask) @ V``), SAOBP first-order
   and SAOBP exact, at L = 128 and 512.
2. One optimisation step (forward, backward, AdamW) of the training experiment's models
   (:mod:`interp.attention.train`): baseline, SAOBP first-order and SAOBP exact, for the
   quick and the full configuration (exact mode is timed at a smaller batch on the full
   model: it keeps an L x L x L term per head for backward).

Variants are timed round-robin, one call each per repeat, so load from other processes on a
shared machine spreads over all of them; the median is reported. The clock is the process's
CPU time (``time.process_time``) by default: with one torch thread it counts the work done and
not the time spent waiting for a core, so ratios stay stable on a loaded machine. Pass
``--clock wall`` for wall-clock time (meaningful on an idle machine, and with several threads).

Run: ``python benchmarks/bench_saobp.py [--repeats 7] [--threads 1] [--quick] [--json PATH]``.

``--quick``: L = 128 only for the forward, the quick training model only, median of 5 (``--repeats``
still wins). Every ratio in the tables is also written as a comparison (``ratio_is``
candidate/baseline, as printed) to ``--json`` (default ``benchmarks/results/saobp.json``; schema in
docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import benchjson
import torch

from interp.attention import saobp
from interp.attention.train import TrainConfig, _optimizer
from interp.attention.trainable import build_llama


def round_robin(
    variants: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    clock: Callable[[], float] = time.process_time,
) -> dict[str, float]:
    """Median seconds per call of each variant, timed in interleaved rounds."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_index in range(warmup + repeats):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            start = clock()
            variants[name]()
            if round_index >= warmup:
                times[name].append(clock() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def attention_variants(batch: int, heads: int, length: int, d_head: int) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, d_head, generator=gen) for _ in range(3))
    mask = torch.full((length, length), float("-inf")).triu(1)
    scale = 1 / math.sqrt(d_head)

    @torch.no_grad()
    def standard() -> torch.Tensor:
        return torch.softmax(q @ k.transpose(-1, -2) * scale + mask, dim=-1) @ v

    @torch.no_grad()
    def refined(mode: str) -> torch.Tensor:
        scores = q @ k.transpose(-1, -2) * scale + mask
        pattern = torch.softmax(scores, dim=-1)
        return saobp(pattern, 1.0, mode=mode, scores=scores if mode == "first_order" else None) @ v

    return {
        "standard": standard,
        "first_order": lambda: refined("first_order"),
        "exact": lambda: refined("exact"),
    }


def training_variants(config: TrainConfig, modes: tuple[str, ...]) -> dict[str, Callable[[], object]]:
    tokens = torch.randint(0, config.vocab_size, (config.batch_size, config.seq_len))
    variants = {}
    for mode in modes:
        settings = None if mode == "baseline" else replace(config, saobp={**config.saobp, "mode": mode}).saobp_config()
        model = build_llama(config.model_kwargs(), settings, seed=0)
        optimizer = _optimizer(model, config)

        def step(model: torch.nn.Module = model, optimizer: torch.optim.Optimizer = optimizer) -> None:
            optimizer.zero_grad(set_to_none=True)
            model(tokens, labels=tokens).loss.backward()
            optimizer.step()

        variants[mode] = step
    return variants


def table(title: str, rows: list[tuple[str, dict[str, float]]], reference: str) -> str:
    names = list(rows[0][1])
    header = f"| {title} | " + " | ".join(f"{n} (ms)" for n in names)
    header += " | " + " | ".join(f"{n} / {reference}" for n in names if n != reference) + " |"
    lines = [header, "|" + "---|" * (1 + 2 * len(names) - 1)]
    for label, medians in rows:
        cells = [f"{1000 * medians[n]:.1f}" for n in names]
        cells += [f"{medians[n] / medians[reference]:.2f}x" for n in names if n != reference]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def comparisons_of(section: str, label: str, medians: dict[str, float], reference: str,
                   args: argparse.Namespace) -> list[dict]:
    """The table row's ratios as ``benchjson`` comparisons (variant / reference, as printed)."""
    return [benchjson.comparison(f"{section}: {label}: {name} vs {reference}", name, reference, seconds,
                                 medians[reference], repeats=args.repeats, ratio_is="candidate/baseline",
                                 clock=args.clock, threads=args.threads)
            for name, seconds in medians.items() if name != reference]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="default 7 (5 with --quick)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadier on a shared machine)")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="process CPU time or wall time")
    benchjson.add_options(parser, "saobp")
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 5 if args.quick else 7
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(
        f"torch {torch.__version__}, {platform.machine()}, {args.threads} thread(s), {args.clock} time, "
        f"median of {args.repeats} interleaved repeats\n"
    )

    rows, comparisons = [], []
    for length in (128,) if args.quick else (128, 512):
        for batch in (1, 2):
            label = f"L={length}, batch={batch}, {args.heads} heads, d_head=64"
            rows.append(
                (label, round_robin(attention_variants(batch, args.heads, length, 64), args.repeats, clock=clock))
            )
    print("### Attention forward (no grad)\n")
    print(table("shape", rows, "standard"))
    for label, medians in rows:
        comparisons += comparisons_of("attention forward", label, medians, "standard", args)

    quick, full = TrainConfig.quick(), TrainConfig.full()
    small_batch = replace(full, batch_size=4)
    all_modes = ("baseline", "first_order", "exact")
    cases = [
        (f"quick model, batch {quick.batch_size} x {quick.seq_len}", quick, all_modes),
        (f"full model, batch {full.batch_size} x {full.seq_len}", full, ("baseline", "first_order")),
        (f"full model, batch {small_batch.batch_size} x {full.seq_len}", small_batch, all_modes),
    ]
    print("\n### Training step (forward + backward + AdamW)\n")
    for label, config, modes in cases[:1] if args.quick else cases:
        medians = round_robin(training_variants(config, modes), args.repeats, clock=clock)
        print(table("model", [(label, medians)], "baseline") + "\n")
        comparisons += comparisons_of("training step", label, medians, "baseline", args)
    benchjson.write(args.json, "saobp", comparisons, args)


if __name__ == "__main__":
    main()
