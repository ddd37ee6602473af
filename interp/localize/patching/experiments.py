"""The front ends: cross-model and clean/corrupt patching, one-component shorthands, and the
reference paper's experiments (reference vs quantized: Table 4, the per-layer sweep, gate
input against gate weights).

Example:
    >>> import interp, torch
    >>> from interp.localize.patching.experiments import clean_corrupt
    >>> model = interp.tiny_model("llama")
    >>> clean = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    >>> corrupt = clean.clone()
    >>> corrupt[0, 2] = (clean[0, 2] + 1) % 256  # one token differs
    >>> res = clean_corrupt(model, clean, corrupt, answers=[5], wrongs=[7], layers=[0])
    >>> recovery = res.table().set_index("positions")["recovery"].round(3) + 0.0  # + 0.0: -0.0 prints as 0.0
    >>> recovery.loc[["1", "2"]].tolist()  # only position 2 matters
    [0.0, 1.0]
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import pandas as pd
from torch import Tensor

from interp.data import Examples
from interp.display import ResultDisplay
from interp.errors import DataError
from interp.localize.patching.engine import patch
from interp.localize.patching.metrics import LogitDiffMetric
from interp.localize.patching.patches import (
    PAPER_COMPONENTS,
    LayerSelection,
    Patch,
    joint_patches,
    position_patches,
    resolve_layers,
    single_layer_patches,
    span,
)
from interp.localize.patching.results import PatchResult
from interp.localize.restoration import restore_layers
from interp.models import Model
from interp.runtime import hooks as hk
from interp.runtime.scoring import nll
from interp.runtime.swap import WeightStash, is_block_weights, swapped
from interp.typing import PerExample, Tokens

# ---------------------------------------------------------------------------------------
# Front ends and thin specialisations


def cross_model(target: Model, source: Model, examples: Examples, patches: Sequence[Patch],
                **engine: Any) -> PatchResult:
    """Run ``target`` (e.g. quantized) on ``examples`` with components from ``source`` (e.g.
    the reference) on the same tokens. Keyword arguments go to :func:`~interp.localize.patching.engine.patch`."""
    return patch(target, source, examples, patches, **engine)


def patch_component(
    target: Model,
    source: Model,
    examples: Examples,
    layers: LayerSelection = None,
    *,
    component: str,
    joint: bool = False,
    heads: Sequence[int] | None = None,
    **engine: Any,
) -> PatchResult:
    """Patch one component, per layer (default) or at all ``layers`` at once (``joint=True``)."""
    chosen = resolve_layers(target, layers)
    if joint:
        jobs = joint_patches([component], chosen, heads)
    else:
        jobs = single_layer_patches([component], chosen, heads=heads)
    return patch(target, source, examples, jobs, **engine)


patch_attn_out = partial(patch_component, component="attn_out")
patch_attn_out.__doc__ = "Patch the attention output (what attention adds to the residual), ``[batch, pos, d_model]``."
patch_heads = partial(patch_component, component="head")
patch_heads.__doc__ = "Patch per-head attention mixes ``z`` (all, or ``heads=[...]``), ``[batch, pos, head, d_head]``."
patch_gate = partial(patch_component, component="gate")
patch_gate.__doc__ = "Patch the gate pre-activation ``W_gate h`` (= patching ``act(gate)``), ``[batch, pos, d_mlp]``."
patch_up = partial(patch_component, component="up")
patch_up.__doc__ = "Patch the up projection ``W_up h``, ``[batch, pos, d_mlp]``."
patch_down = partial(patch_component, component="down")
patch_down.__doc__ = "Patch the MLP output (after the down projection), ``[batch, pos, d_model]``."
patch_gate_input = partial(patch_component, component="gate_input")
patch_gate_input.__doc__ = ("Feed the source's gate-projection input through the target's gate weight "
                            "(the up projection keeps the target's input), ``[batch, pos, d_model]``.")
patch_resid_pre = partial(patch_component, component="resid_pre")
patch_resid_pre.__doc__ = "Patch the residual stream entering each block, ``[batch, pos, d_model]``."


def clean_corrupt(
    model: Model,
    clean: Tokens,
    corrupt: Tokens,
    answers: Sequence[int] | Tensor | int,
    wrongs: Sequence[int] | Tensor | int,
    component: str = "resid_pre",
    layers: LayerSelection = None,
    positions: Literal["each", "all"] | Sequence[int] = "each",
    heads: Sequence[int] | None = None,
    position: int = -1,
    **engine: Any,
) -> PatchResult:
    """Classic activation patching: run the corrupted prompts, patch in the clean activations.

    Args:
        model: the model (source and target).
        clean, corrupt: ``[N, T]`` token rows of the same shape (for padded prompts or pairs
            of different lengths, call :func:`~interp.localize.patching.engine.patch` with
            :class:`~interp.data.Examples` and a
            :class:`~interp.localize.patching.metrics.LogitDiffMetric`).
        answers, wrongs: the right and wrong answer token per row (or one for all rows).
        component: what to patch.
        layers: layer selection (default: all).
        positions: ``"each"`` (one patch per layer and position: a heatmap), ``"all"``, or a
            list of positions patched together.
        heads: for ``head``, the heads to patch.
        position: where the logit difference is read (default: the last position).

    Returns:
        A :class:`~interp.localize.patching.results.PatchResult` with ``metric="logit_diff"``;
        ``recovery()`` is the usual
        normalised logit difference ``(ld_patched - ld_corrupt) / (ld_clean - ld_corrupt)``.
    """
    if clean.shape != corrupt.shape:
        raise DataError(f"Clean and corrupted prompts must have the same shape; got {tuple(clean.shape)} "
                        f"and {tuple(corrupt.shape)}.")
    chosen = resolve_layers(model, layers)
    if isinstance(positions, str) and positions == "each":
        jobs = position_patches(component, chosen, range(corrupt.shape[1]))
    else:
        pos = None if isinstance(positions, str) else list(positions)
        jobs = single_layer_patches([component], chosen, positions=pos, heads=heads)
    metric = LogitDiffMetric(answers, wrongs, position)
    return patch(model, model, Examples.from_tokens(corrupt), jobs, source_examples=Examples.from_tokens(clean),
                 metric=metric, **engine)


# ---------------------------------------------------------------------------------------
# The reference paper's experiments (reference vs quantized)


def patching_table(
    reference: Model,
    quantized: Any,
    d_large: Examples,
    layers: LayerSelection = "upper_half",
    components: Sequence[str] = PAPER_COMPONENTS,
    **engine: Any,
) -> PatchResult:
    """Patch each component of the reference into the quantized model at ``layers`` (all at once).

    The paper's Table 4: run the quantized model on D_large and overwrite one component, in
    the upper half of the layers and at every position, with the reference model's
    activation. ``result.table()`` lists each component's perplexity and recovery.

    ``quantized`` may be the quantized model or its block weights alone (a
    :class:`~interp.runtime.swap.BlockWeights` such as :class:`interp.quant.inplace.SavedWeights`):
    then one copy of the weights is held (see :func:`~interp.localize.patching.engine.patch`).
    """
    chosen = resolve_layers(_layout(reference, quantized), layers)
    return patch(quantized, reference, d_large, joint_patches(components, chosen), **engine)


def layer_sweep(reference: Model, quantized: Any, examples: Examples, components: Sequence[str] = PAPER_COMPONENTS,
                layers: LayerSelection = None, **engine: Any) -> PatchResult:
    """Patch each component of the reference into the quantized model (or its block weights) one layer at a time."""
    jobs = single_layer_patches(components, resolve_layers(_layout(reference, quantized), layers))
    return patch(quantized, reference, examples, jobs, **engine)


def _layout(reference: Model, quantized: Any) -> Model:
    """The model whose layers a selection counts: the quantized one, or the reference when given its weights alone."""
    return reference if is_block_weights(quantized) else quantized


@dataclass(frozen=True)
class GateInputComparison(ResultDisplay):
    """Gate-input-only patching against restoring the gate weights, on the same layers.

    Attributes:
        patched: the ``gate_input`` patch (reference input, quantized gate weight).
        restored_nll: ``[N]`` NLL of the quantized model with the gate weights restored.
        layers: the layers both act on.
    """

    patched: PatchResult
    restored_nll: PerExample
    layers: list[int]

    def table(self) -> pd.DataFrame:
        p = self.patched
        quantized, reference = p.target_value, p.source_value
        rows = {
            "reference": reference,
            "quantized": quantized,
            "gate input patched (quantized gate weight)": float(p.aggregate()[0]),
            "gate weights restored (quantized input)": math.exp(float(self.restored_nll.double().mean())),
        }
        frame = pd.DataFrame({"setting": list(rows), "perplexity": list(rows.values())})
        frame["recovery"] = (quantized - frame["perplexity"]) / (quantized - reference)
        frame["layers"] = span(self.layers)
        return frame


def gate_input_vs_gate_weights(
    reference: Model,
    quantized: Any,
    d_large: Examples,
    layers: LayerSelection = "upper_half",
    batch_size: int = 8,
    **engine: Any,
) -> GateInputComparison:
    """Is the gate hurt by its input or by its weights? (the paper: 6.53 vs 10.45 perplexity)

    Compares (a) feeding the reference's gate input through the quantized gate weights with
    (b) restoring the gate weights to the reference's while the input stays quantized, both
    on ``layers`` of the quantized model. ``quantized`` may be its block weights alone
    (one copy of the weights, as in :func:`patching_table`); (b) then swaps them into the
    reference except the gate of ``layers`` (:func:`gate_restored_nll`).
    """
    chosen = resolve_layers(_layout(reference, quantized), layers)
    patched = patch(quantized, reference, d_large, joint_patches(["gate_input"], chosen), batch_size=batch_size,
                    **engine)
    stash = engine.get("stash")
    return GateInputComparison(patched=patched, layers=chosen,
                               restored_nll=gate_restored_nll(reference, quantized, d_large, chosen, batch_size, stash))


def gate_restored_nll(reference: Model, quantized: Any, examples: Examples, layers: Sequence[int],
                      batch_size: int = 8, stash: WeightStash | None = None) -> PerExample:
    """``[N]`` NLL of the quantized model with the gate weights of ``layers`` restored to the reference's.

    With the quantized model, on a copy (:func:`~interp.localize.restoration.restore_layers`). With its
    block weights alone, in place: they are swapped into ``reference`` everywhere except the gate
    role of ``layers`` (``swapped(..., roles=...)``), which keeps the reference's, and swapped back
    (``stash`` as in :func:`~interp.localize.patching.engine.patch`). Both give the same weights.
    """
    if not is_block_weights(quantized):
        restored = restore_layers(quantized, reference, layers, roles=["gate"])
        return nll(restored, examples, batch_size=batch_size).double()
    chosen = set(layers)
    others = [layer for layer in range(hk.n_layers(reference)) if layer not in chosen]
    roles = {role for layer in chosen for role in hk.linear_weights(reference, layer) if role != "gate"}
    with contextlib.ExitStack() as scope:
        active = stash if stash is not None else scope.enter_context(WeightStash(reference))
        scope.enter_context(swapped(reference, quantized, layers=others, stash=active))
        scope.enter_context(swapped(reference, quantized, layers=sorted(chosen), roles=roles, stash=active))
        return nll(reference, examples, batch_size=batch_size).double()
