"""Float64 test models really run in float64, attention included.

Transformers' eager attention for the llama-style families computes its softmax with
``dtype=torch.float32`` whatever the input dtype: an upcast for half precision, but a
*downcast* for float64. A float64 test model would then carry float32 rounding inside every
attention pattern, and that rounding depends on the CPU's vector width (the sum of a softmax
row is reduced in a different order with AVX2 and with AVX-512), so "exact" float64 tests
that compare a padded batch with rows run alone passed on one machine and missed 1e-10 by
2e-8 on another.

:func:`install` wraps each family's ``eager_attention_forward``: float64 inputs go through the
same formula (``softmax(q k^T * scaling + mask) v``, with grouped key/value heads repeated)
with the softmax kept in float64; every other dtype calls transformers' own function
unchanged, so float32 and bfloat16 models compute exactly what they compute without it.
transformer-lens's bridge, which recomputes the pattern itself when a pattern hook is attached,
softmaxes in float32 the same way; its ``_masked_softmax`` is wrapped by the same rule.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

# families whose eager attention has llama's signature (module, query, key, value,
# attention_mask, scaling, dropout, **kwargs); others (gpt2: softmax in the input dtype
# already) are left alone
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2")
_SIGNATURE = ["module", "query", "key", "value", "attention_mask", "scaling", "dropout", "kwargs"]


def _float64_faithful(original: Any) -> Any:
    def attend(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs: Any) -> Any:
        if query.dtype != torch.float64 or (dropout and module.training):
            return original(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        groups = int(getattr(module, "num_key_value_groups", 1))
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask
        weights = torch.softmax(scores, dim=-1)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

    attend.float64_faithful = True  # type: ignore[attr-defined]
    return attend


def _bridge_softmax_keeps_float64() -> None:
    from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge

    original = AttentionBridge._masked_softmax
    if getattr(original, "float64_faithful", False):
        return

    def masked_softmax(self: Any, attn_scores: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        if attn_scores.dtype == torch.float64 and dtype == torch.float32:
            dtype = None  # keep float64; any other input is left exactly as transformer-lens computes it
        return original(self, attn_scores, dtype=dtype)

    masked_softmax.float64_faithful = True  # type: ignore[attr-defined]
    AttentionBridge._masked_softmax = masked_softmax  # type: ignore[method-assign]


def install() -> list[str]:
    """Wrap the families' eager attention and the bridge's softmax (idempotent); returns the
    families wrapped."""
    _bridge_softmax_keeps_float64()
    done = []
    for family in FAMILIES:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        original = getattr(module, "eager_attention_forward", None)
        if original is None or getattr(original, "float64_faithful", False):
            continue
        if list(inspect.signature(original).parameters) != _SIGNATURE:
            continue  # a different contract: leave it as transformers wrote it
        module.eager_attention_forward = _float64_faithful(original)
        done.append(family)
    return done
