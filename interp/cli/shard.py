"""How ``interp probe``, ``attention``, ``lens`` and ``patch`` run their analyses in whole batches,
one process or the ranks of a ``torchrun`` job (docs/scaling.md).

Each analysis stage goes through :func:`interp.runtime.distributed.map_batches`: the stage's
library function (``probe``, ``early_exit``, ``restoration_sweep``, ``patch``, ...) runs on one
batch of examples at a time; the batch's per-example values (the result's tensors with the
example axis moved first) go to ``--out/parts/<stage>/<start>-<end>.safetensors``; rank 0
concatenates them in example order and rebuilds the result, whose tables (means over
examples, perplexities, recoveries) are then computed once, as a single-process run computes
them. The batches are those of a single-process run whatever the world size, so the results are
bit-identical to it (see :mod:`interp.runtime.distributed`), and a killed run resumes from its
finished batches, with the same or another number of ranks.

Rank 0 writes every output file; the other ranks compute their batches and leave.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from interp.data import Examples
from interp.errors import InterpError
from interp.runtime.distributed import Gathered, map_batches, world

# options that change no number: they are left out of the fingerprint that decides whether a
# parts folder belongs to this run
_NOT_RESULTS = {"quiet", "out", "threads", "checks", "func", "command", "no_static", "map_layers", "experiments"}


def fingerprint(args: argparse.Namespace, model: Any, stage: str) -> dict[str, Any]:
    """What makes two runs of ``stage`` the same run: the options that change numbers, and the weights."""
    from interp.models import model_hash

    options = {k: v for k, v in vars(args).items()
               if k not in _NOT_RESULTS and (v is None or isinstance(v, str | int | float | bool | dict | list))}
    return {"stage": stage, "options": options, "model": model_hash(model), "world_independent": True}


def is_main() -> bool:
    return world()[0] == 0


def _progress(args: argparse.Namespace) -> bool | None:
    return False if args.quiet else None


Compute = Callable[[Examples], tuple[Mapping[str, torch.Tensor], Mapping[str, Any]]]


def run_stage(args: argparse.Namespace, model: Any, stage: str, examples: Examples, batch_size: int,
              compute: Compute) -> Gathered | None:
    """``compute`` over the batches of ``examples`` into ``--out/parts/<stage>``; gathered on rank 0."""
    return map_batches(compute, examples, batch_size, Path(args.out) / "parts" / stage,
                       settings=fingerprint(args, model, stage), progress=_progress(args), desc=stage)


def _examples_settings(settings: Mapping[str, Any], examples: Examples) -> dict[str, Any]:
    """A batch's settings with the batch's examples replaced by the whole set's."""
    return {**dict(settings), "examples": dict(examples.settings)}


# ---------------------------------------------------------------------------------------
# Results <-> per-batch tensors (example axis first) and JSON metadata


def probe_parts(result: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {f"{prefix}stats/{k}": v.movedim(1, 0) for k, v in result.stats.items()}
    if result.nll is not None:
        tensors[f"{prefix}nll"] = result.nll
    return tensors, {"layers": result.layers, "settings": result.settings}


def probe_result(gathered: Gathered, examples: Examples, prefix: str = "", meta: Mapping[str, Any] | None = None
                 ) -> Any:
    from interp.probes import ProbeResult

    meta = gathered.meta if meta is None else meta
    head = f"{prefix}stats/"
    stats = {k[len(head):]: v.movedim(0, 1).contiguous() for k, v in gathered.tensors.items() if k.startswith(head)}
    return ProbeResult(stats=stats, layers=list(meta["layers"]), ids=list(examples.ids),
                       settings=_examples_settings(meta["settings"], examples),
                       nll=gathered.tensors.get(f"{prefix}nll"))


def sharded_probe(args: argparse.Namespace, model: Any, examples: Examples, **kwargs: Any) -> Any:
    """:func:`interp.probes.probe` over the batches (``None`` on ranks other than 0)."""
    from interp.probes import _full_bytes, probe
    from interp.runtime import hooks as hk
    from interp.runtime.batching import check_memory

    if "full" in kwargs.get("reducers", ()):  # rank 0 holds every batch's capture at the end, as probe() would
        n, seq_len = examples.tokens.shape
        need = sum(_full_bytes(model, c, n, seq_len, hk.n_layers(model)) for c in kwargs.get("components", ()))
        check_memory(need, "Keeping full activations", 0.5)

    def compute(sub: Examples) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return probe_parts(probe(model, sub, batch_size=args.batch_size, progress=False, **kwargs))

    gathered = run_stage(args, model, "probe", examples, args.batch_size, compute)
    return None if gathered is None else probe_result(gathered, examples)


def sharded_attention(args: argparse.Namespace, model: Any, examples: Examples, saobp_beta: float | None,
                      layers: list[int] | None) -> Any:
    """:func:`interp.attention.analysis.analyze` over the batches (``None`` on ranks other than 0)."""
    from interp import validate
    from interp.attention import analysis
    from interp.runtime import hooks as hk

    layer_list = validate.layer_indices(layers, hk.n_layers(model))

    def compute(sub: Examples) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        reference, refined = analysis.attention_probes(model, sub, saobp_beta, layer_list, args.mode,
                                                       args.batch_size, True, False)
        tensors, meta = probe_parts(reference, "reference/")
        if refined is not None:
            tensors.update(probe_parts(refined, "saobp/")[0])
        return tensors, meta

    gathered = run_stage(args, model, "attention", examples, args.batch_size, compute)
    if gathered is None:
        return None
    reference = probe_result(gathered, examples, "reference/")
    refined = probe_result(gathered, examples, "saobp/") if saobp_beta is not None else None
    settings = analysis.settings(model, examples, saobp_beta, layer_list, args.mode, args.batch_size)
    return analysis.attention_result(reference, refined, settings)


def sharded_early_exit(args: argparse.Namespace, models: Mapping[str, Any], sets: Mapping[str, Examples]) -> Any:
    """:func:`interp.localize.lens.early_exit_curves` over the batches of every (model, set)."""
    from interp.localize import lens

    results = {}
    for m, model in models.items():
        for s, examples in sets.items():
            def compute(sub: Examples, model: Any = model) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
                r = lens.early_exit(model, sub, at=args.at, batch_size=args.batch_size, progress=False)
                return {"nll": r.nll.movedim(1, 0)}, {"layers": r.layers, "at": r.at, "settings": r.settings}

            g = run_stage(args, model, f"early_exit/{m}/{s}", examples, args.batch_size, compute)
            if g is not None:
                results[f"{m} / {s}"] = lens.EarlyExitResult(
                    nll=g.tensors["nll"].movedim(0, 1).contiguous(), layers=list(g.meta["layers"]),
                    ids=list(examples.ids), at=g.meta["at"], settings=_examples_settings(g.meta["settings"], examples))
    return lens.EarlyExitCurves(results=results, models=list(models), sets=list(sets)) if is_main() else None


def sharded_restoration(args: argparse.Namespace, quantized: Any, reference: Any, examples: Examples,
                        ks: list[int] | None) -> Any:
    """:func:`interp.localize.restoration.restoration_sweep` over the batches."""
    from interp.localize import restoration

    def compute(sub: Examples) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        r = restoration.restoration_sweep(quantized, reference, sub, ks=ks, batch_size=args.batch_size,
                                          progress=False)
        return ({"nll": r.nll.movedim(1, 0), "reference_nll": r.reference_nll},
                {"ks": r.ks, "restored": r.restored, "settings": r.settings})

    g = run_stage(args, reference, "restoration", examples, args.batch_size, compute)
    if g is None:
        return None
    return restoration.RestorationResult(
        ks=list(g.meta["ks"]), restored=[list(x) for x in g.meta["restored"]],
        nll=g.tensors["nll"].movedim(0, 1).contiguous(), reference_nll=g.tensors["reference_nll"],
        ids=list(examples.ids), settings=_examples_settings(g.meta["settings"], examples))


def _patch_parts(r: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    patches = [dataclasses.asdict(p) for p in r.patches]
    return ({f"{prefix}values": r.values.movedim(1, 0), f"{prefix}target": r.target, f"{prefix}source": r.source},
            {"patches": patches, "metric": r.metric, "settings": r.settings})


def _patch_result(g: Gathered, examples: Examples, prefix: str = "") -> Any:
    from interp.localize.patching import Patch, PatchResult

    def tup(x: Any) -> Any:
        return None if x is None else tuple(x)

    patches = [Patch(p["component"], tuple(p["layers"]), tup(p["positions"]), tup(p["heads"]))
               for p in g.meta["patches"]]
    t = g.tensors
    return PatchResult(values=t[f"{prefix}values"].movedim(0, 1).contiguous(), target=t[f"{prefix}target"],
                       source=t[f"{prefix}source"], patches=patches, ids=list(examples.ids), metric=g.meta["metric"],
                       settings=_examples_settings(g.meta["settings"], examples))


def sharded_patch(args: argparse.Namespace, stage: str, run: Callable[[Examples], Any], model: Any,
                  examples: Examples) -> Any:
    """A patching experiment ``run(sub_examples) -> PatchResult`` over the batches."""

    def compute(sub: Examples) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return _patch_parts(run(sub))

    g = run_stage(args, model, stage, examples, args.batch_size, compute)
    return None if g is None else _patch_result(g, examples)


def sharded_gate_input(args: argparse.Namespace, run: Callable[[Examples], Any], model: Any,
                       examples: Examples) -> Any:
    """:func:`interp.localize.patching.gate_input_vs_gate_weights` over the batches."""
    from interp.localize.patching.experiments import GateInputComparison

    def compute(sub: Examples) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        c = run(sub)
        tensors, meta = _patch_parts(c.patched)
        return {**tensors, "restored_nll": c.restored_nll}, {**meta, "layers": c.layers}

    g = run_stage(args, model, "gate_input", examples, args.batch_size, compute)
    if g is None:
        return None
    return GateInputComparison(patched=_patch_result(g, examples), restored_nll=g.tensors["restored_nll"],
                               layers=list(g.meta["layers"]))


def sharded_attribution(args: argparse.Namespace, run: Callable[[Examples], Any], model: Any, examples: Examples,
                        batch_size: int) -> Any:
    """:func:`interp.localize.patching.attribution` over the batches (of ``batch_size``)."""
    from interp.localize.patching.attribution import AttributionResult

    def compute(sub: Examples) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        r = run(sub)
        return {"estimates": r.estimates.movedim(1, 0)}, {"points": r.points, "metric": r.metric,
                                                          "settings": r.settings}

    g = run_stage(args, model, "attribution", examples, batch_size, compute)
    if g is None:
        return None
    return AttributionResult(estimates=g.tensors["estimates"].movedim(0, 1).contiguous(),
                             points=[(str(c), int(layer)) for c, layer in g.meta["points"]], ids=list(examples.ids),
                             metric=g.meta["metric"], settings=_examples_settings(g.meta["settings"], examples))


# ---------------------------------------------------------------------------------------
# Commands that do not shard


SHARDED_COMMANDS = ("score", "probe", "attention", "lens", "patch")


def refuse_under_torchrun(name: str, why: str) -> None:
    """A clear error when a command that does not split its work is started with WORLD_SIZE > 1."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1:
        raise InterpError(f"interp {name} does not split its work over processes ({why}); started here with "
                          f"WORLD_SIZE={size}, every rank would repeat the whole run and write the same files. Run it "
                          f"without torchrun, or run its long steps under torchrun: interp "
                          f"{', interp '.join(SHARDED_COMMANDS)} shard whole batches over the ranks (docs/scaling.md).")
