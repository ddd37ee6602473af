"""Every head's attention pattern on one prompt, with its tokens: what an attention view draws.

:func:`attention_patterns` captures the attention probabilities ``[layer, head, query, key]``
of one prompt (the ``pattern`` component) together with ``"position:token"`` labels;
:func:`interp.figures.toolbox.attention_view` (``interp.attention_view``) draws them as an
interactive heatmap with a head menu, offline.

Example:
    >>> import interp
    >>> from interp.localize.patterns import attention_patterns
    >>> model = interp.tiny_model("llama")
    >>> att = attention_patterns(model, "abc", layers=[1])
    >>> tuple(att.pattern.shape), att.labels  # [layers, heads, query, key]
    ((1, 4, 4, 4), ['0:<bos>', '1:a', '2:b', '3:c'])
    >>> bool(att.pattern.sum(-1).sub(1).abs().max() < 1e-5)  # each query's row is a distribution
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from interp.display import ResultDisplay
from interp.localize.prompts import Prompts, one_prompt, token_labels
from interp.models import Model, model_name
from interp.results import CheckedResult, row_sum_tolerance
from interp.runtime import hooks as hk
from interp.runtime.batching import device_of
from interp.runtime.capture import capture
from interp.validate import checked


@dataclass(frozen=True)
class AttentionPatterns(CheckedResult, ResultDisplay):
    """Attention patterns of one prompt (made only finite: :mod:`interp.results`).

    Attributes:
        pattern: ``[layers, heads, query, key]`` attention probabilities.
        layers: the first axis's layers.
        labels: ``"position:token"`` per position (both axes).
    """

    pattern: Float[Tensor, "layers heads query key"]
    layers: list[int]
    labels: list[str]
    settings: dict[str, Any] = field(default_factory=dict)

    def table(self) -> pd.DataFrame:
        """Per (layer, head): the key the last token attends to most, and with what weight."""
        last = self.pattern[:, :, -1]  # [layers, heads, key]
        best = last.argmax(-1)
        return pd.DataFrame([{"layer": layer, "head": h, "last token attends to": self.labels[int(best[i, h])],
                              "weight": float(last[i, h, best[i, h]])}
                             for i, layer in enumerate(self.layers) for h in range(self.pattern.shape[1])])

    def meaningless(self) -> str | None:
        """Query rows that are not a distribution over keys (one prompt has no padded query, so each sums to 1)."""
        if self.pattern.ndim != 4 or self.pattern.numel() == 0:
            return None
        sums = self.pattern.double().sum(-1)
        # the rounding of the dtype the model computed the pattern in (a bfloat16 model's, before it was widened)
        limit = max(float(self.settings.get("row_sum_tolerance", 0.0)), row_sum_tolerance(self.pattern))
        bad = ((sums - 1).abs() > limit) | bool((self.pattern < 0).any())
        if not bool(bad.any()):
            return None
        layer, head, query = (int(i) for i in bad.nonzero()[0].tolist())
        return (f"query rows of the attention pattern do not sum to 1 (layer {self.layers[layer]}, head {head}, "
                f"query {query} sums to {float(sums[layer, head, query]):.6g}): the attention scores were NaN or "
                "masked out, so the pattern is not an attention distribution.")


@checked
def attention_patterns(model: Model, prompt: Prompts, layers: Sequence[int] | None = None) -> AttentionPatterns:
    """Capture every head's attention pattern on one prompt (all layers, or ``layers``).

    Example:
        >>> import interp
        >>> att = attention_patterns(interp.tiny_model("llama"), "hi")
        >>> att.layers, att.summary().shape  # one row per (layer, head)
        ([0, 1], (8, 4))
    """
    tokens = one_prompt(model, prompt)
    chosen = hk.check_layers(model, layers)
    with torch.no_grad():
        store, _ = capture(model, tokens[None].to(device_of(model)), [("pattern", layer) for layer in chosen])
    computed = [store[("pattern", layer)][0] for layer in chosen]
    pattern = torch.stack([p.float().cpu() for p in computed])
    return AttentionPatterns(pattern=pattern, layers=chosen, labels=token_labels(model, tokens),
                             settings={"model": model_name(model), "row_sum_tolerance": row_sum_tolerance(computed[0])})
