"""The checks and bookkeeping every patching entry point shares (:func:`~interp.localize.patching.engine.patch`,
:func:`~interp.localize.patching.engine.patch_naive`, attribution, path patching, EAP).

Each runs before any forward: the two models and their example rows fit together
(``_check_pair``), every patch names a real hook point, layer, position and head
(``_checked_patches``), and padded rows or pairs of different lengths have an end-aligned
counterpart for every explicit position (``_checked_lengths``). ``_result`` refuses
non-finite values and assembles the :class:`~interp.localize.patching.results.PatchResult`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from interp.data import Examples, refuse_padding
from interp.errors import ComponentError, DataError, InterpError, NonFiniteError
from interp.localize.patching.metrics import Metric, PerRow
from interp.localize.patching.patches import Patch
from interp.localize.patching.results import PatchResult
from interp.models import Model, model_name
from interp.runtime import hooks as hk
from interp.runtime.batching import check_examples, check_finite_weights
from interp.typing import Key

# ---------------------------------------------------------------------------------------
# Rows' real lengths (padded examples and pairs of different lengths)


@dataclass(frozen=True)
class _Lengths:
    """Real tokens per row of the target and source examples (present only when some row needs aligning)."""

    target: Tensor
    source: Tensor


def _row_lengths(examples: Examples) -> Tensor:
    if examples.attention_mask is None:
        return torch.full((len(examples),), examples.seq_len, dtype=torch.long, device=examples.tokens.device)
    return examples.attention_mask.sum(dim=1)


def _pair_lengths(examples: Examples, source_examples: Examples) -> _Lengths | None:
    """``None`` for unpadded rows of one width (the plain path), else every row's real lengths."""
    if not (examples.padded or source_examples.padded or examples.seq_len != source_examples.seq_len):
        return None
    return _Lengths(_row_lengths(examples), _row_lengths(source_examples))


def _check_positions(patches: Sequence[Patch], lengths: _Lengths, ids: Sequence[str]) -> None:
    """Every explicit position names a real target position with an end-aligned source counterpart."""
    target, source = lengths.target, lengths.source
    for p in patches:
        for q in p.positions or ():
            if q < 0:
                bad = torch.minimum(target, source) < -q
            else:
                bad = (target <= q) | (q < target - source)
            if bool(bad.any()):
                row = int(bad.nonzero()[0, 0])
                raise DataError(
                    f"Patch {p.label}: position {q} has no counterpart in example {ids[row]!r} (target "
                    f"{int(target[row])} real tokens, source {int(source[row])}; rows are aligned at their last "
                    "real token). Count positions from the end (-1 is the answer position), or use positions "
                    "that every target row has and its source row matches.")


def _takes_lengths(metric: Metric) -> bool:
    return all("lengths" in inspect.signature(method).parameters
               for method in (metric.from_resid, metric.from_logits))


def _metric_values(metric: Metric, fn: str, *args: Any, lengths: Tensor | None) -> PerRow:
    """``metric.<fn>(*args)``, with ``lengths=`` only for aligned rows (metrics of their own may lack it)."""
    method = getattr(metric, fn)
    return method(*args) if lengths is None else method(*args, lengths=lengths)


# ---------------------------------------------------------------------------------------
# Checks


def _checked_patches(model: Model, patches: Sequence[Patch], seq_len: int) -> list[Patch]:
    patches = list(patches)
    if not patches:
        raise InterpError("No patches given: build them with single_layer_patches / joint_patches.")
    n_heads = int(model.cfg.n_heads)
    for p in patches:
        for layer in p.layers:
            hk.hook_point(model, p.component, layer)  # raises a ComponentError naming the problem
        if p.positions is not None and any(not -seq_len <= q < seq_len for q in p.positions):
            raise ComponentError(f"Patch {p.label}: positions must lie in 0..{seq_len - 1} (or -{seq_len}..-1, "
                                 "counted from each row's end).")
        if p.heads is not None and any(not 0 <= h < n_heads for h in p.heads):
            raise ComponentError(f"Patch {p.label}: heads must lie in 0..{n_heads - 1}.")
    return [Patch(p.component, tuple(hk.check_layers(model, p.layers)), p.positions, p.heads) for p in patches]


def _check_pair(target: Model, source: Model, examples: Examples, source_examples: Examples,
                unpadded: str | None = None) -> None:
    """Two models of one architecture and one source row per target row.

    ``unpadded`` names an entry point that still needs unpadded rows of one shape (attribution).
    """
    if hk.n_layers(target) != hk.n_layers(source) or target.cfg.d_model != source.cfg.d_model:
        raise ComponentError("Patching needs two models with the same architecture (layers and widths).")
    if len(source_examples) != len(examples):
        raise DataError(f"Patching pairs each target example with one source example: got {len(examples)} target "
                        f"and {len(source_examples)} source examples.")
    if unpadded is not None and source_examples.tokens.shape != examples.tokens.shape:
        raise DataError(f"Source and target token rows must have the same shape; got "
                        f"{tuple(source_examples.tokens.shape)} and {tuple(examples.tokens.shape)}.")
    check_examples(target, examples)
    check_examples(source, source_examples)
    check_finite_weights(target, "target model")
    if source is not target:
        check_finite_weights(source, "source model")
    if unpadded is not None:
        refuse_padding(examples, unpadded)
        refuse_padding(source_examples, unpadded)


def _checked_lengths(examples: Examples, source_examples: Examples, patches: Sequence[Patch],
                     metric: Metric) -> _Lengths | None:
    """The rows' real lengths when they need aligning (``None`` otherwise), all checked before any forward."""
    lengths = _pair_lengths(examples, source_examples)
    check = getattr(metric, "check_lengths", None)
    if lengths is None:
        if check is not None:
            full = torch.full((len(examples),), examples.seq_len, dtype=torch.long, device=examples.tokens.device)
            check(full, examples.ids, "target")
        return None
    if not _takes_lengths(metric):
        raise DataError(f"The metric {type(metric).__name__} takes no lengths=, so it cannot skip pad positions: "
                        "padded examples and pairs of different lengths need a metric whose from_resid and "
                        "from_logits accept lengths (NLLMetric and LogitDiffMetric do).")
    _check_positions(patches, lengths, examples.ids)
    if check is not None:
        check(lengths.target, examples.ids, "target")
        check(lengths.source, source_examples.ids, "source")
    return lengths


def _source_keys(patches: Sequence[Patch]) -> list[Key]:
    return list(dict.fromkeys((p.component, layer) for p in patches for layer in p.layers))


def _settings(target: Model | str, source: Model, examples: Examples, batch_size: int, **extra: Any
              ) -> dict[str, Any]:
    def name(model: Model | str) -> str:
        return model if isinstance(model, str) else str(model_name(model))

    return {"target": name(target), "source": name(source), "batch_size": batch_size,
            "examples": dict(examples.settings), **extra}


def _result(values: Tensor, target: Tensor, source: Tensor, patches: list[Patch], examples: Examples, metric: Metric,
            settings: dict[str, Any]) -> PatchResult:
    for name, tensor in (("patched", values), ("target", target), ("source", source)):
        if not torch.isfinite(tensor).all():
            raise NonFiniteError(f"Patching produced NaN/inf {name} values: check both models' weights.")
    return PatchResult(values=values, target=target, source=source, patches=patches, ids=list(examples.ids),
                       metric=metric.name, settings=settings)
