"""How ``interp probe``, ``attention``, ``lens`` and ``patch`` run their analyses in whole batches,
one process or the ranks of a ``torchrun`` job (docs/scaling.md).

The machinery is :class:`interp.report.shards.Sharding` (the report runs its stages through it
too): each analysis stage's library function runs on one batch of examples at a time, each
batch's per-example values go to ``--out/parts/<stage>/<start>-<end>.safetensors``, and rank 0
concatenates them in example order and rebuilds the result, whose tables are then computed
once, as a single-process run computes them. The batches are those of a single-process run
whatever the world size, so the results are bit-identical to it, and a killed run resumes from
its finished batches, with the same or another number of ranks.

Rank 0 writes every output file; the other ranks compute their batches and leave. This module
is the glue from the command's options to a :class:`~interp.report.shards.Sharding`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from interp.data import Examples
from interp.report.shards import Sharding, is_main

__all__ = ["is_main", "sharding", "sharded_probe", "sharded_attention", "sharded_early_exit", "sharded_restoration",
           "sharded_patch", "sharded_gate_input", "sharded_attribution"]

# options that change no number: they are left out of the fingerprint that decides whether a
# parts folder belongs to this run
_NOT_RESULTS = {"quiet", "out", "threads", "checks", "func", "command", "no_static", "map_layers", "experiments"}


def sharding(args: argparse.Namespace) -> Sharding:
    """The command's batches: parts in ``--out/parts``, keyed by the options that change numbers."""
    options = {k: v for k, v in vars(args).items()
               if k not in _NOT_RESULTS and (v is None or isinstance(v, str | int | float | bool | dict | list))}
    return Sharding(Path(args.out) / "parts", options, args.batch_size, progress=False if args.quiet else None)


def sharded_probe(args: argparse.Namespace, model: Any, examples: Examples, **kwargs: Any) -> Any:
    """:func:`interp.probes.probe` over the batches (``None`` on ranks other than 0)."""
    return sharding(args).probe(model, examples, **kwargs)


def sharded_attention(args: argparse.Namespace, model: Any, examples: Examples, saobp_beta: float | None,
                      layers: list[int] | None) -> Any:
    """:func:`interp.attention.analysis.analyze` over the batches (``None`` on ranks other than 0)."""
    return sharding(args).attention(model, examples, saobp_beta, layers, args.mode)


def sharded_early_exit(args: argparse.Namespace, models: Mapping[str, Any], sets: Mapping[str, Examples]) -> Any:
    """:func:`interp.localize.lens.early_exit_curves` over the batches of every (model, set)."""
    return sharding(args).early_exit(models, sets, args.at)


def sharded_restoration(args: argparse.Namespace, quantized: Any, reference: Any, examples: Examples,
                        ks: list[int] | None, stash: Any = None) -> Any:
    """:func:`interp.localize.restoration.restoration_sweep` over the batches."""
    return sharding(args).restoration(quantized, reference, examples, ks, stash=stash)


def sharded_patch(args: argparse.Namespace, stage: str, run: Callable[[Examples], Any], model: Any,
                  examples: Examples) -> Any:
    """A patching experiment ``run(sub_examples) -> PatchResult`` over the batches."""
    return sharding(args).patch(stage, run, model, examples)


def sharded_gate_input(args: argparse.Namespace, run: Callable[[Examples], Any], model: Any,
                       examples: Examples) -> Any:
    """:func:`interp.localize.patching.gate_input_vs_gate_weights` over the batches."""
    return sharding(args).gate_input(run, model, examples)


def sharded_attribution(args: argparse.Namespace, run: Callable[[Examples], Any], model: Any, examples: Examples,
                        batch_size: int) -> Any:
    """:func:`interp.localize.patching.attribution` over the batches (of ``batch_size``)."""
    return sharding(args).attribution(run, model, examples, batch_size)
