"""Patching heatmaps in one call: layer x head and layer x position, labelled with the prompt's tokens.

Denoising activation patching on a prompt pair: run the corrupted prompt, put one site's
activation from the clean run in its place, and read the logit difference
``logit(answer) - logit(wrong)`` at the last token. The heatmap's cell is the normalised
recovery ``(ld_patched - ld_corrupt) / (ld_clean - ld_corrupt)``, averaged the usual way (on the
mean logit difference over the prompt pairs): 1 where that one site carries the whole
difference, 0 where it carries none.

- ``over="head"``: one cell per (layer, head), patching that head's ``z`` (its attention
  mix, before ``W_O``) at every position;
- ``over="position"``: one cell per (layer, position), patching the residual stream entering
  the block (``resid_pre``, or ``component=``) at that position alone. Positions count from each
  prompt's end, so prompt pairs of different lengths line up at their last token; the columns
  are labelled with the first clean prompt's tokens.

Both run on the patching engine (:func:`interp.localize.patching.patch`), whose stacked and
staggered forwards are checked against the textbook loop; ``result.patching`` is its full
:class:`~interp.localize.patching.PatchResult`.

Example:
    >>> import interp
    >>> model = interp.tiny_model("llama")
    >>> grid = interp.patch_heatmap(model, "a cat", "a dog", answer="s", wrong="!", over="position")
    >>> grid.recovery.shape, grid.columns[-1]  # [layers, positions], labelled by token
    (torch.Size([2, 6]), '5:t')
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from interp.data import real_lengths
from interp.display import ResultDisplay
from interp.errors import InterpError
from interp.localize.patching.engine import patch
from interp.localize.patching.metrics import LogitDiffMetric
from interp.localize.patching.patches import Patch
from interp.localize.patching.results import PatchResult
from interp.localize.prompts import Answers, Prompts, answer_ids, as_examples, token_strings
from interp.models import Model
from interp.runtime import hooks as hk
from interp.validate import checked

Over = Literal["head", "position"]


@dataclass(frozen=True)
class PatchHeatmap(ResultDisplay):
    """A layer x head or layer x position patching grid.

    Attributes:
        recovery: ``[layers, columns]`` normalised recovery of the mean logit difference.
        logit_diff: ``[layers, columns]`` the patched mean logit difference.
        layers: the rows' layers.
        columns: the columns' labels (``"H3"``; or ``"position:token"`` of the first clean prompt).
        over: ``"head"`` or ``"position"``.
        clean, corrupt: the unpatched clean and corrupted mean logit differences.
        patching: the engine's :class:`~interp.localize.patching.PatchResult`.
    """

    recovery: Float[Tensor, "layers columns"]
    logit_diff: Float[Tensor, "layers columns"]
    layers: list[int]
    columns: list[str]
    over: str
    clean: float
    corrupt: float
    patching: PatchResult
    settings: dict[str, Any] = field(default_factory=dict)

    def table(self) -> pd.DataFrame:
        """The recovery grid: one row per layer, one column per head or position."""
        return pd.DataFrame(self.recovery.numpy(), index=pd.Index(self.layers, name="layer"), columns=self.columns)

    def summary(self) -> pd.DataFrame:
        """The ten cells of largest recovery."""
        long = self.table().stack().rename("recovery").reset_index()
        long.columns = ["layer", self.over, "recovery"]
        return long.reindex(long["recovery"].abs().sort_values(ascending=False).index).head(10).reset_index(drop=True)


@checked
def patch_heatmap(
    model: Model,
    clean: Prompts,
    corrupt: Prompts,
    answer: Answers,
    wrong: Answers,
    *,
    over: Over = "head",
    component: str | None = None,
    layers: Sequence[int] | None = None,
    batch_size: int = 8,
    progress: bool | None = None,
) -> PatchHeatmap:
    """Patch every (layer, head) or (layer, position) site from the clean run into the corrupted one.

    Args:
        model: a bridge from :func:`interp.load_model`.
        clean, corrupt: the prompt pairs (strings, token rows or Examples), one corrupt row per clean row.
        answer, wrong: the right and wrong next token (strings or ids), one or one per pair.
        over: ``"head"`` (a layer x head grid) or ``"position"`` (a layer x position grid).
        component: what is patched (default ``"z"`` per head, ``"resid_pre"`` per position).
        layers: the layers (default: all).
        batch_size: prompt pairs per batch.
        progress: show a progress bar.

    Returns:
        A :class:`~interp.localize.heatmaps.PatchHeatmap`; ``interp.figures.draw(result)`` draws it with token labels.

    Example:
        >>> import interp
        >>> model = interp.tiny_model("llama")
        >>> grid = interp.patch_heatmap(model, ["a cat", "a hat"], ["a dog", "a hog"], answer="s", wrong="!")
        >>> grid.recovery.shape, grid.columns  # [layers, heads]
        (torch.Size([2, 4]), ['H0', 'H1', 'H2', 'H3'])
    """
    if over not in ("head", "position"):
        raise InterpError(f"over must be 'head' or 'position'; got {over!r}.")
    clean_ex, corrupt_ex = as_examples(model, clean, "clean prompts"), as_examples(model, corrupt, "corrupt prompts")
    if len(clean_ex) != len(corrupt_ex):
        raise InterpError(f"patch_heatmap pairs each clean prompt with one corrupted prompt; got {len(clean_ex)} "
                          f"clean and {len(corrupt_ex)} corrupted.")
    n = len(clean_ex)
    metric = LogitDiffMetric(answer_ids(model, answer, n, "answer"), answer_ids(model, wrong, n, "wrong"))
    chosen = hk.check_layers(model, layers)
    if over == "head":
        part = component or "z"
        heads = int(model.cfg.n_heads)
        jobs = [Patch(part, (layer,), None, (h,)) for layer in chosen for h in range(heads)]
        columns = [f"H{h}" for h in range(heads)]
    else:
        part = component or "resid_pre"
        width = int(torch.minimum(real_lengths(clean_ex), real_lengths(corrupt_ex)).min())
        ends = list(range(-width, 0))
        jobs = [Patch(part, (layer,), (q,)) for layer in chosen for q in ends]
        first = clean_ex.tokens[0]
        if clean_ex.attention_mask is not None:
            first = first[clean_ex.attention_mask[0]]
        length = len(first)
        columns = [f"{length + q}:{text}" for q, text in zip(ends, token_strings(model, first[-width:]), strict=True)]
    result = patch(model, model, corrupt_ex, jobs, source_examples=clean_ex, metric=metric, batch_size=batch_size,
                   progress=progress)
    shape = (len(chosen), len(columns))
    return PatchHeatmap(recovery=result.recovery().reshape(shape), logit_diff=result.aggregate().reshape(shape),
                        layers=chosen, columns=columns, over=over, clean=result.source_value,
                        corrupt=result.target_value, patching=result,
                        settings={"component": part, "over": over, "pairs": n, "batch_size": batch_size})
