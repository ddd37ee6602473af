"""Attention localization: entropy, GTD, sink share, and the SAOBP refinement.

* :mod:`interp.attention.metrics`: pure functions of a pattern ``[..., query, key]``:
  :func:`entropy`, :func:`gtd`, :func:`sink_share`, :func:`effective_span`, plus
  :func:`valid_query_mask` to leave padding and single-key queries out of means.
* :mod:`interp.attention.saobp`: :func:`saobp` refines a pattern with one step of
  repulsive-Potts belief propagation; :func:`saobp_hook` applies it at inference through
  a transformer-lens hook on ``blocks.{l}.attn.hook_pattern``.
* :mod:`interp.attention.trainable`: SAOBP as a transformers attention implementation
  (``attn_implementation="saobp"``) with an optional learnable per-head beta:
  :class:`SAOBPConfig`, :func:`build_llama`. Imported on first use, since it pulls in
  transformers.
* :mod:`interp.attention.train`: the baseline-versus-SAOBP training experiment (import it
  explicitly).

The GTD and SAOBP formulas are this project's derivation from the description in the
SAOBP paper (Findings of EMNLP 2025, arXiv 2509.07324); see ``docs/attention.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

from interp.attention.metrics import (
    effective_span,
    entropy,
    gtd,
    keys_per_query,
    masked_mean,
    sink_share,
    valid_query_mask,
)
from interp.attention.saobp import saobp, saobp_hook

# The names interp.attention.trainable exports, listed here so that the package can offer them without
# importing transformers; tests/test_api_reference.py checks the two lists agree (a deliberate copy).
_TRAINABLE = (
    "SAOBPConfig",
    "build_llama",
    "capture_prior_patterns",
    "register_saobp_attention",
    "saobp_attention_forward",
    "saobp_betas",
)

__all__ = [
    "analyze",
    "effective_span",
    "entropy",
    "gtd",
    "keys_per_query",
    "masked_mean",
    "saobp",
    "saobp_hook",
    "sink_share",
    "valid_query_mask",
    *_TRAINABLE,
]


def __getattr__(name: str) -> Any:
    if name in ("analyze", "AttentionResult", "capture_patterns"):
        return getattr(importlib.import_module("interp.attention.analysis"), name)
    # The trainable pieces import transformers (slow); load them only when asked for.
    if name in _TRAINABLE:
        return getattr(importlib.import_module("interp.attention.trainable"), name)
    raise AttributeError(f"module 'interp.attention' has no attribute {name!r}")
