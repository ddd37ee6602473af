"""The shape of one block linear weight, shared by the bit planner and llama.cpp's type rules.

It lives apart from both so that :mod:`interp.quant.prescribe` (which plans widths) and
:mod:`interp.quant.llama_cpp` (which maps them to llama.cpp's types) can each use it without
importing the other.

Example:
    >>> shape = WeightShape(3, "down", 576, 1536)
    >>> shape.name, shape.size
    ('3.down', 884736)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WeightShape"]


@dataclass(frozen=True)
class WeightShape:
    """One block linear weight: its block, role and ``[d_out, d_in]`` shape."""

    layer: int
    role: str
    d_out: int
    d_in: int

    @property
    def name(self) -> str:
        return f"{self.layer}.{self.role}"

    @property
    def size(self) -> int:
        return self.d_out * self.d_in
