"""Figures: plotly builders that turn analysis results into ``go.Figure`` objects.

Results never draw themselves. Each module here draws one family of results and lists its
default builder per result type in ``DRAWERS``; :func:`draw` picks the builder for any result:

- :mod:`interp.figures.style`: palette, layout, line/band/heatmap primitives, static export;
- :mod:`interp.figures.attention`, :mod:`interp.figures.probes`, :mod:`interp.figures.quant`,
  :mod:`interp.figures.localize`, :mod:`interp.figures.training`: one module per analysis family.

Example:
    >>> import interp, torch
    >>> from interp.figures import draw
    >>> model = interp.tiny_model("llama")
    >>> ex = interp.Examples.from_tokens(torch.randint(0, 256, (2, 8)))
    >>> fig = draw(interp.probe(model, ex, ["resid_mid"], ["norm"], progress=False), components=["resid_mid"])
    >>> type(fig).__name__
    'Figure'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from interp.errors import InterpError
from interp.figures.style import LAYOUT, PALETTE, band_lines, export_static, heatmap, lines, styled

FAMILIES = ("attention", "probes", "quant", "localize", "training", "prescribe", "toolbox")

__all__ = ["FAMILIES", "LAYOUT", "PALETTE", "band_lines", "draw", "drawer", "export_static", "heatmap", "lines",
           "styled"]


def drawer(result: Any) -> Callable[..., Any]:
    """The default figure builder for ``result``'s type, from the family modules' ``DRAWERS`` tables.

    The family modules are imported here, on first use, because importing them pulls in every
    analysis package (and transformers); ``import interp.figures`` alone stays light.
    """
    for family in FAMILIES:
        table = getattr(importlib.import_module(f"interp.figures.{family}"), "DRAWERS", {})
        for kind in type(result).__mro__:
            if kind in table:
                return table[kind]
    raise InterpError(f"No figure is registered for a {type(result).__name__}. Figures exist for: "
                      + ", ".join(sorted(kind.__name__ for kind in _all_kinds())) + ".")


def _all_kinds() -> list[type]:
    kinds: list[type] = []
    for family in FAMILIES:
        kinds += list(getattr(importlib.import_module(f"interp.figures.{family}"), "DRAWERS", {}))
    return kinds


def draw(result: Any, *args: Any, **kwargs: Any) -> Any:
    """Draw ``result`` with its default builder; extra arguments go to that builder."""
    return drawer(result)(result, *args, **kwargs)
