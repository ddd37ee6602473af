"""How results show themselves: ``summary()`` is a DataFrame, and a notebook renders it as HTML.

Every result class mixes in :class:`ResultDisplay`. In Jupyter, evaluating a result shows its
name, its scalar settings and the first rows of ``summary()`` as a plain HTML table: no
JavaScript and nothing fetched, so it works offline and in exported notebooks. Figures stay
separate (``interp.figures.draw(result)``), so the caller decides whether to draw.

Example:
    >>> import pandas as pd
    >>> from dataclasses import dataclass, field
    >>> from interp.display import ResultDisplay
    >>> @dataclass(frozen=True)
    ... class Toy(ResultDisplay):
    ...     table: pd.DataFrame
    ...     settings: dict = field(default_factory=dict)
    >>> toy = Toy(pd.DataFrame({"layer": [0, 1], "r": [0.5, 0.25]}), {"model": "tiny"})
    >>> toy.summary().shape
    (2, 2)
    >>> html = toy._repr_html_()
    >>> "<table" in html and "model" in html and "<script" not in html
    True
"""

from __future__ import annotations

import html
from typing import Any, ClassVar

import pandas as pd

_SCALARS = (str, int, float, bool)


class ResultDisplay:
    """Mixin for result dataclasses: ``summary()`` returns a DataFrame; Jupyter shows it as HTML.

    The default ``summary()`` is the class's ``table()`` method or ``table`` DataFrame; a class
    whose table is long (one row per example or head) overrides it with a shorter one.
    """

    display_rows: ClassVar[int] = 30

    def summary(self) -> pd.DataFrame:
        """A short table of the result (one row per layer, patch, spec pair...)."""
        table = getattr(self, "table", None)
        if callable(table):
            return table()
        if isinstance(table, pd.DataFrame):
            return table.copy()
        raise NotImplementedError(f"{type(self).__name__} defines no summary().")

    def _repr_html_(self) -> str:
        return summary_html(type(self).__name__, self.summary(), getattr(self, "settings", None), self.display_rows)


def summary_html(title: str, table: pd.DataFrame, settings: dict[str, Any] | None = None, max_rows: int = 30) -> str:
    """``title``, the scalar entries of ``settings`` and the first ``max_rows`` rows of ``table``, as HTML."""
    parts = [f"<div class='interp-result'><strong>{html.escape(title)}</strong>"]
    shown = [(k, v) for k, v in (settings or {}).items() if isinstance(v, _SCALARS)][:8]
    if shown:
        items = ", ".join(f"{html.escape(str(k))}={html.escape(str(v)[:60])}" for k, v in shown)
        parts.append(f"<div style='color:#555;font-size:90%'>{items}</div>")
    parts.append(table.head(max_rows).to_html(border=0, float_format=lambda x: f"{x:.4g}", max_cols=20))
    if len(table) > max_rows:
        parts.append(f"<div style='color:#555;font-size:90%'>first {max_rows} of {len(table)} rows; "
                     "<code>.summary()</code> returns them all</div>")
    parts.append("</div>")
    return "\n".join(parts)
