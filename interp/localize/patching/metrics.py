"""Metrics: one value per example, read from the final residual (the engine) or from full logits (the naive loop).

Example:
    >>> import torch
    >>> from interp.localize.patching.metrics import LogitDiffMetric
    >>> logits = torch.tensor([[[0.0, 2.0, 5.0]]])  # [batch 1, pos 1, vocab 3]
    >>> LogitDiffMetric(answers=2, wrongs=1).from_logits(logits, None, torch.arange(1)).tolist()
    [3.0]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from interp.errors import InterpError
from interp.runtime.readout import Readout
from interp.runtime.scoring import token_nll
from interp.typing import Resid, Tokens

PerRow = Float[Tensor, " rows"]



class Metric:
    """A per-example scalar read from the model's output.

    ``from_resid`` decodes the final (pre-norm) residual with a :class:`~interp.runtime.readout.Readout`;
    ``from_logits`` reads full logits. Both give the same values. ``index`` holds each row's
    example index (rows of stacked patch jobs repeat examples).
    """

    name = "metric"
    aggregate_name = "mean"

    def from_resid(self, readout: Readout, resid: Resid, tokens: Tokens, index: Tensor) -> PerRow:
        raise NotImplementedError

    def from_logits(self, logits: Float[Tensor, "batch pos vocab"], tokens: Tokens, index: Tensor) -> PerRow:
        raise NotImplementedError

    def aggregate(self, values: Float[Tensor, "... n_examples"]) -> Float[Tensor, "..."]:
        return values.double().mean(dim=-1)


class NLLMetric(Metric):
    """Mean next-token NLL per example; aggregated as perplexity ``exp(mean NLL)``."""

    name = "nll"
    aggregate_name = "perplexity"

    def from_resid(self, readout: Readout, resid: Resid, tokens: Tokens, index: Tensor) -> PerRow:
        return readout.mean_nll(resid, tokens)

    def from_logits(self, logits: Float[Tensor, "batch pos vocab"], tokens: Tokens, index: Tensor) -> PerRow:
        return token_nll(logits, tokens.to(logits.device)).double().mean(dim=1)

    def aggregate(self, values: Float[Tensor, "... n_examples"]) -> Float[Tensor, "..."]:
        return torch.exp(values.double().mean(dim=-1))


class LogitDiffMetric(Metric):
    """``logit[answer] - logit[wrong]`` at one position (default: the last)."""

    name = "logit_diff"
    aggregate_name = "mean logit difference"

    def __init__(self, answers: Sequence[int] | Tensor | int, wrongs: Sequence[int] | Tensor | int, position: int = -1):
        self.answers = torch.as_tensor(answers, dtype=torch.long).reshape(-1)
        self.wrongs = torch.as_tensor(wrongs, dtype=torch.long).reshape(-1)
        self.position = position

    def _pick(self, logits: Float[Tensor, "rows vocab"], index: Tensor) -> PerRow:
        def per_row(tokens: Tensor) -> Tensor:  # one token for all rows, or one per example
            return (tokens.expand(len(index)) if len(tokens) == 1 else tokens[index]).to(logits.device)

        rows = torch.arange(logits.shape[0], device=logits.device)
        return (logits[rows, per_row(self.answers)] - logits[rows, per_row(self.wrongs)]).double()

    def from_resid(self, readout: Readout, resid: Resid, tokens: Tokens, index: Tensor) -> PerRow:
        return self._pick(readout.logits(resid[:, self.position]).float(), index)

    def from_logits(self, logits: Float[Tensor, "batch pos vocab"], tokens: Tokens, index: Tensor) -> PerRow:
        return self._pick(logits[:, self.position].float(), index)


def _metric(metric: Metric | str | None) -> Metric:
    if metric is None or metric == "nll":
        return NLLMetric()
    if isinstance(metric, Metric):
        return metric
    raise InterpError(f"Unknown metric {metric!r}: use 'nll' or a LogitDiffMetric(answers, wrongs).")

