"""Metrics: one value per example, read from the final residual (the engine) or from full logits (the naive loop).

Example:
    >>> import torch
    >>> from interp.localize.patching.metrics import LogitDiffMetric
    >>> logits = torch.tensor([[[0.0, 2.0, 5.0]]])  # [batch 1, pos 1, vocab 3]
    >>> tokens = torch.zeros(1, 1, dtype=torch.long)  # the prompt (a logit difference does not read it)
    >>> LogitDiffMetric(answers=2, wrongs=1).from_logits(logits, tokens, torch.arange(1)).tolist()
    [3.0]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from interp.data import counted_positions
from interp.errors import DataError, InterpError
from interp.results import distinct_answers
from interp.runtime.readout import Readout
from interp.runtime.scoring import token_nll
from interp.typing import Resid, Tokens
from interp.validate import checked_class, token_ids

PerRow = Float[Tensor, " rows"]


@checked_class
class Metric:
    """A per-example scalar read from the model's output.

    ``from_resid`` decodes the final (pre-norm) residual with a :class:`~interp.runtime.readout.Readout`;
    ``from_logits`` reads full logits. Both give the same values. ``index`` holds each row's
    example index (rows of stacked patch jobs repeat examples), on the host: it picks per-example
    data the metric keeps on the host (answer ids), which then moves to the values' device.

    Padded examples, and source/target pairs of different lengths, reach a metric as
    left-aligned rows (:func:`interp.data.left_aligned`: each row's real tokens first) with
    ``lengths [rows]``, the real tokens per row: a metric must then read positions
    ``< lengths`` only. ``lengths=None`` means every position is real. A metric whose methods
    take no ``lengths`` argument works on unpadded rows of one length only (the engine says so
    before running).
    """

    name = "metric"
    aggregate_name = "mean"

    def from_resid(self, readout: Readout, resid: Resid, tokens: Tokens, index: Tensor,
                   lengths: Tensor | None = None) -> PerRow:
        raise NotImplementedError

    def from_logits(self, logits: Float[Tensor, "batch pos vocab"], tokens: Tokens, index: Tensor,
                    lengths: Tensor | None = None) -> PerRow:
        raise NotImplementedError

    def check_lengths(self, lengths: Tensor, ids: Sequence[str], what: str) -> None:
        """Raise a :class:`~interp.errors.DataError` when a row of these real ``lengths`` cannot be read."""

    def aggregate(self, values: Float[Tensor, "... n_examples"]) -> Float[Tensor, "..."]:
        return values.double().mean(dim=-1)


@checked_class
class NLLMetric(Metric):
    """Mean next-token NLL per example; aggregated as perplexity ``exp(mean NLL)``."""

    name = "nll"
    aggregate_name = "perplexity"

    def from_resid(self, readout: Readout, resid: Resid, tokens: Tokens, index: Tensor,
                   lengths: Tensor | None = None) -> PerRow:
        return readout.mean_nll(resid, tokens, lengths)

    def from_logits(self, logits: Float[Tensor, "batch pos vocab"], tokens: Tokens, index: Tensor,
                    lengths: Tensor | None = None) -> PerRow:
        per_token = token_nll(logits, tokens.to(logits.device)).double()
        if lengths is None:
            return per_token.mean(dim=1)
        targets = counted_positions(lengths.to(logits.device), tokens.shape[1], skip_first=True)[:, 1:]
        return (per_token * targets).sum(dim=1) / targets.sum(dim=1).clamp(min=1)  # targets 1..length-1

    def aggregate(self, values: Float[Tensor, "... n_examples"]) -> Float[Tensor, "..."]:
        return torch.exp(values.double().mean(dim=-1))


@checked_class(answers=token_ids, wrongs=token_ids)  # one id, or one per row: repeats are welcome
class LogitDiffMetric(Metric):
    """``logit[answer] - logit[wrong]`` at one position (default: the last).

    ``position`` counts in each row's own real tokens: ``-1`` is its last real token (the
    answer position) whatever its length or padding, ``0`` its first (BOS).
    """

    name = "logit_diff"
    aggregate_name = "mean logit difference"

    def __init__(self, answers: Sequence[int] | Tensor | int, wrongs: Sequence[int] | Tensor | int, position: int = -1):
        # host: the user's ids, picked per row by the host-side example index, then moved with each run's values
        self.answers = torch.as_tensor(answers, dtype=torch.long).reshape(-1)
        self.wrongs = torch.as_tensor(wrongs, dtype=torch.long).reshape(-1)  # host: as above
        self.position = position
        distinct_answers(self.answers, self.wrongs)  # answer == wrong measures nothing: refused before any run

    def _pick(self, logits: Float[Tensor, "rows vocab"], index: Tensor) -> PerRow:
        def per_row(tokens: Tensor) -> Tensor:  # one token for all rows, or one per example
            return (tokens.expand(len(index)) if len(tokens) == 1 else tokens[index]).to(logits.device)

        rows = torch.arange(logits.shape[0], device=logits.device)
        return (logits[rows, per_row(self.answers)] - logits[rows, per_row(self.wrongs)]).double()

    def _at(self, x: Tensor, lengths: Tensor | None) -> Tensor:
        """``x[:, position]``, counted in each left-aligned row's own ``lengths`` when given."""
        if lengths is None:
            return x[:, self.position]
        lengths = lengths.to(x.device)
        where = lengths + self.position if self.position < 0 else torch.full_like(lengths, self.position)
        return x[torch.arange(x.shape[0], device=x.device), where]

    def check_lengths(self, lengths: Tensor, ids: Sequence[str], what: str) -> None:
        p = self.position
        bad = (lengths + p < 0) if p < 0 else (lengths <= p)
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise DataError(f"The logit difference is read at position {p}, but {what} example {ids[row]!r} has "
                            f"only {int(lengths[row])} real tokens. Use position=-1 (each row's last token).")

    def from_resid(self, readout: Readout, resid: Resid, tokens: Tokens, index: Tensor,
                   lengths: Tensor | None = None) -> PerRow:
        return self._pick(readout.logits(self._at(resid, lengths)).float(), index)

    def from_logits(self, logits: Float[Tensor, "batch pos vocab"], tokens: Tokens, index: Tensor,
                    lengths: Tensor | None = None) -> PerRow:
        return self._pick(self._at(logits, lengths).float(), index)


def _metric(metric: Metric | str | None) -> Metric:
    if metric is None or metric == "nll":
        return NLLMetric()
    if isinstance(metric, Metric):
        return metric
    raise InterpError(f"Unknown metric {metric!r}: use 'nll' or a LogitDiffMetric(answers, wrongs).")

