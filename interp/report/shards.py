"""Long analyses in whole batches, in one process or over the ranks of a ``torchrun`` job.

:class:`Sharding` runs an analysis stage through :func:`interp.runtime.distributed.map_batches`:
the stage's library function (``probe``, ``early_exit``, ``restoration_sweep``, ``patch``, ...)
runs on one batch of examples at a time; the batch's per-example values (the result's tensors
with the example axis moved first) go to ``<folder>/<stage>/<start>-<end>.safetensors``; the
files are concatenated in example order and the result is rebuilt, whose tables (means over
examples, perplexities, recoveries) are then computed once, as a single-process run computes
them. The batches are those of a single-process run whatever the world size, so the results are
bit-identical to it, and a killed run resumes from its finished batches, with the same or another
number of ranks.

Two users: ``interp probe``, ``attention``, ``lens`` and ``patch`` (:mod:`interp.cli.shard`:
rank 0 gets the result and writes every file, the other ranks leave), and ``interp report``
(``everywhere=True``: every rank gets the result and goes on to the next stage, so all ranks
reach the next stage's batches together; see :mod:`interp.report.run`).

Example (one process; a torchrun job runs the same lines on every rank):
    >>> import tempfile, torch, interp
    >>> from interp.report.shards import Sharding
    >>> model = interp.tiny_model("llama")
    >>> ex = interp.Examples.from_tokens(torch.randint(0, 256, (5, 8), generator=torch.Generator().manual_seed(0)))
    >>> shards = Sharding(tempfile.mkdtemp(), {"note": "doctest"}, batch_size=2, progress=False)
    >>> result = shards.probe(model, ex, components=["resid_post"], reducers=["norm"])
    >>> direct = interp.probe(model, ex, ["resid_post"], ["norm"], batch_size=2, progress=False)
    >>> bool(torch.equal(result["resid_post", "norm"], direct["resid_post", "norm"]))
    True
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from interp.data import Examples
from interp.runtime.distributed import Gathered, map_batches, world

if TYPE_CHECKING:
    from interp.attention.analysis import Mode
    from interp.localize.lens import ExitPoint

__all__ = ["Sharding", "is_main"]

Compute = Callable[[Examples], tuple[Mapping[str, torch.Tensor], Mapping[str, Any]]]


def is_main() -> bool:
    """Rank 0 (or no torchrun): the process that writes the outputs."""
    return world()[0] == 0


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


# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sharding:
    """Where and how a run's analysis stages go through their batches.

    Attributes:
        folder: the per-batch files of stage ``s`` go to ``folder / s``.
        settings: what makes two runs the same run besides the stage, the examples and the weights
            (the options that change numbers); a rerun with other settings starts a stage afresh.
        batch_size: examples per batch (and per forward).
        progress: a bar per stage on rank 0 (``None``: when stderr is a terminal).
        everywhere: every rank gets each result (the report); by default rank 0 alone, the others
            get ``None``.
    """

    folder: str | os.PathLike[str]
    settings: Mapping[str, Any]
    batch_size: int
    progress: bool | None = None
    everywhere: bool = False

    def fingerprint(self, model: Any, stage: str) -> dict[str, Any]:
        """What makes two runs of ``stage`` the same run: the settings and the weights."""
        from interp.models import model_hash

        return {"stage": stage, "options": dict(self.settings), "model": model_hash(model), "world_independent": True}

    def run(self, model: Any, stage: str, examples: Examples, compute: Compute,
            batch_size: int | None = None) -> Gathered | None:
        """``compute`` over the batches of ``examples`` into ``folder/<stage>``, gathered."""
        size = self.batch_size if batch_size is None else batch_size
        return map_batches(compute, examples, size, Path(self.folder) / stage,
                           settings=self.fingerprint(model, stage), progress=self.progress, desc=stage,
                           everywhere=self.everywhere)

    def _mine(self) -> bool:
        return self.everywhere or is_main()

    def probe(self, model: Any, examples: Examples, stage: str = "probe", **kwargs: Any) -> Any:
        """:func:`interp.probes.probe` over the batches (``kwargs`` are its options)."""
        from interp.probes import _full_bytes, probe
        from interp.runtime import hooks as hk
        from interp.runtime.batching import check_memory

        if "full" in kwargs.get("reducers", ()):  # the gathered result holds every batch's capture, as probe() would
            n, seq_len = examples.tokens.shape
            need = sum(_full_bytes(model, c, n, seq_len, hk.n_layers(model)) for c in kwargs.get("components", ()))
            check_memory(need, "Keeping full activations", 0.5)

        def compute(sub: Examples) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
            return probe_parts(probe(model, sub, batch_size=self.batch_size, progress=False, **kwargs))

        gathered = self.run(model, stage, examples, compute)
        return None if gathered is None else probe_result(gathered, examples)

    def attention(self, model: Any, examples: Examples, saobp_beta: float | None, layers: list[int] | None,
                  mode: Mode = "exact", stage: str = "attention") -> Any:
        """:func:`interp.attention.analysis.analyze` over the batches."""
        from interp import validate
        from interp.attention import analysis
        from interp.runtime import hooks as hk

        layer_list = validate.layer_indices(layers, hk.n_layers(model))

        def compute(sub: Examples) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
            reference, refined = analysis.attention_probes(model, sub, saobp_beta, layer_list, mode,
                                                           self.batch_size, True, False)
            tensors, meta = probe_parts(reference, "reference/")
            if refined is not None:
                tensors.update(probe_parts(refined, "saobp/")[0])
            return tensors, meta

        gathered = self.run(model, stage, examples, compute)
        if gathered is None:
            return None
        reference = probe_result(gathered, examples, "reference/")
        refined = probe_result(gathered, examples, "saobp/") if saobp_beta is not None else None
        settings = analysis.settings(model, examples, saobp_beta, layer_list, mode, self.batch_size)
        return analysis.attention_result(reference, refined, settings)

    def early_exit(self, models: Mapping[str, Any], sets: Mapping[str, Examples], at: ExitPoint = "resid_post",
                   stage: str = "early_exit") -> Any:
        """:func:`interp.localize.lens.early_exit_curves` over the batches of every (model, set)."""
        from interp.localize import lens

        results = {}
        for m, model in models.items():
            for s, examples in sets.items():
                def compute(sub: Examples, model: Any = model) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
                    r = lens.early_exit(model, sub, at=at, batch_size=self.batch_size, progress=False)
                    return {"nll": r.nll.movedim(1, 0)}, {"layers": r.layers, "at": r.at, "settings": r.settings}

                g = self.run(model, f"{stage}/{m}/{s}", examples, compute)
                if g is not None:
                    results[f"{m} / {s}"] = lens.EarlyExitResult(
                        nll=g.tensors["nll"].movedim(0, 1).contiguous(), layers=list(g.meta["layers"]),
                        ids=list(examples.ids), at=g.meta["at"],
                        settings=_examples_settings(g.meta["settings"], examples))
        return lens.EarlyExitCurves(results=results, models=list(models), sets=list(sets)) if self._mine() else None

    def restoration(self, quantized: Any, reference: Any, examples: Examples, ks: list[int] | None,
                    stage: str = "restoration", stash: Any = None) -> Any:
        """:func:`interp.localize.restoration.restoration_sweep` over the batches (``stash``: the one
        :class:`~interp.runtime.swap.WeightStash` every batch shares when ``quantized`` is block weights)."""
        from interp.localize import restoration

        def compute(sub: Examples) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
            r = restoration.restoration_sweep(quantized, reference, sub, ks=ks, batch_size=self.batch_size,
                                              progress=False, stash=stash)
            return ({"nll": r.nll.movedim(1, 0), "reference_nll": r.reference_nll},
                    {"ks": r.ks, "restored": r.restored, "settings": r.settings})

        g = self.run(reference, stage, examples, compute)
        if g is None:
            return None
        return restoration.RestorationResult(
            ks=list(g.meta["ks"]), restored=[list(x) for x in g.meta["restored"]],
            nll=g.tensors["nll"].movedim(0, 1).contiguous(), reference_nll=g.tensors["reference_nll"],
            ids=list(examples.ids), settings=_examples_settings(g.meta["settings"], examples))

    def patch(self, stage: str, run: Callable[[Examples], Any], model: Any, examples: Examples) -> Any:
        """A patching experiment ``run(sub_examples) -> PatchResult`` over the batches."""

        def compute(sub: Examples) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
            return _patch_parts(run(sub))

        g = self.run(model, stage, examples, compute)
        return None if g is None else _patch_result(g, examples)

    def gate_input(self, run: Callable[[Examples], Any], model: Any, examples: Examples,
                   stage: str = "gate_input") -> Any:
        """:func:`interp.localize.patching.gate_input_vs_gate_weights` over the batches."""
        from interp.localize.patching.experiments import GateInputComparison

        def compute(sub: Examples) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
            c = run(sub)
            tensors, meta = _patch_parts(c.patched)
            return {**tensors, "restored_nll": c.restored_nll}, {**meta, "layers": c.layers}

        g = self.run(model, stage, examples, compute)
        if g is None:
            return None
        return GateInputComparison(patched=_patch_result(g, examples), restored_nll=g.tensors["restored_nll"],
                                   layers=list(g.meta["layers"]))

    def attribution(self, run: Callable[[Examples], Any], model: Any, examples: Examples, batch_size: int,
                    stage: str = "attribution") -> Any:
        """:func:`interp.localize.patching.attribution` over the batches (of ``batch_size``)."""
        from interp.localize.patching.attribution import AttributionResult

        def compute(sub: Examples) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
            r = run(sub)
            return {"estimates": r.estimates.movedim(1, 0)}, {"points": r.points, "metric": r.metric,
                                                              "settings": r.settings}

        g = self.run(model, stage, examples, compute, batch_size)
        if g is None:
            return None
        return AttributionResult(estimates=g.tensors["estimates"].movedim(0, 1).contiguous(),
                                 points=[(str(c), int(layer)) for c, layer in g.meta["points"]],
                                 ids=list(examples.ids), metric=g.meta["metric"],
                                 settings=_examples_settings(g.meta["settings"], examples))
