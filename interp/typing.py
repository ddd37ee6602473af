"""Tensor type aliases shared across interp, so signatures read like prose."""

from __future__ import annotations

from jaxtyping import Float, Int64
from torch import Tensor

Tokens = Int64[Tensor, "batch pos"]
Pattern = Float[Tensor, "... query key"]
PerQuery = Float[Tensor, "... query"]
Resid = Float[Tensor, "batch pos d_model"]
Weight = Float[Tensor, "d_out d_in"]
PerExample = Float[Tensor, " n_examples"]
TokenNLL = Float[Tensor, "batch predicted"]
Key = tuple[str, int]  # an activation site: (component, layer)
