"""The house style of every figure: palette, layout, line/band/heatmap primitives, and static export.

Computation lives in the analysis modules; these functions only draw. The caller decides
where a figure goes: a notebook cell, the HTML report, or a PNG/SVG for a paper
(:func:`export_static`, through kaleido and a headless Chromium).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go

from interp.errors import ResourceError

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22"]
LAYOUT = dict(template="plotly_white", font=dict(size=13), margin=dict(l=60, r=20, t=90, b=50),  # t: title above legend
              legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="right", x=1))


def styled(fig: go.Figure, title: str, x: str = "layer", y: str = "") -> go.Figure:
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, **LAYOUT)
    return fig


def _rgba(hex_color: str, alpha: float) -> str:
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def band_lines(x: Sequence[float], series: Mapping[str, tuple[Sequence[float], Sequence[float] | None,
               Sequence[float] | None]], title: str, y: str, x_title: str = "layer") -> go.Figure:
    """One line per series, each with an optional shaded band ``(mean, low, high)``."""
    fig = go.Figure()
    xs = list(x)
    for i, (name, (mean, low, high)) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        if low is not None and high is not None:
            fig.add_trace(go.Scatter(x=xs + xs[::-1], y=list(high) + list(low)[::-1], fill="toself",
                                     fillcolor=_rgba(color, 0.15), line=dict(width=0), hoverinfo="skip",
                                     showlegend=False, name=f"{name} range"))
        fig.add_trace(go.Scatter(x=xs, y=list(mean), mode="lines+markers", name=name,
                                 line=dict(color=color, width=2), marker=dict(size=5)))
    return styled(fig, title, x_title, y)


def lines(x: Sequence[float], series: Mapping[str, Sequence[float]], title: str, y: str,
          x_title: str = "layer") -> go.Figure:
    """Plain lines by layer (no bands)."""
    return band_lines(x, {k: (v, None, None) for k, v in series.items()}, title, y, x_title)


def heatmap(z: np.ndarray, x: Sequence[Any], y: Sequence[Any], title: str, x_title: str, y_title: str,
            colorbar: str = "", colorscale: str = "Viridis", zmid: float | None = None) -> go.Figure:
    fig = go.Figure(go.Heatmap(z=z, x=list(x), y=list(y), colorscale=colorscale, zmid=zmid,
                               colorbar=dict(title=colorbar)))
    return styled(fig, title, x_title, y_title)


# -- static export -----------------------------------------------------------------------


def export_static(figures: Mapping[str, go.Figure], folder: str | Path, formats: Sequence[str] = ("png", "svg"),
                  scale: float = 2.0) -> list[Path]:
    """Write each figure as PNG/SVG through kaleido, starting the browser once for all of them.

    Needs a Chromium: kaleido uses ``BROWSER_PATH`` (the Makefile sets ``/usr/bin/chromium``).
    """
    import plotly.io as pio

    from interp import io

    if not os.environ.get("BROWSER_PATH") and Path("/usr/bin/chromium").exists():
        os.environ["BROWSER_PATH"] = "/usr/bin/chromium"
    out = Path(folder)
    figs, paths = [], []
    for name, fig in figures.items():
        for fmt in formats:
            figs.append(fig)
            paths.append(out / f"{name}.{fmt}")
    try:  # one browser for all of them, through the one writer (each file renamed into place)
        # a figure sized for its content (e.g. one column per circuit edge) keeps its size; others get 900 x 520
        widths = [fig.layout.width or 900 for fig in figs]
        heights = [fig.layout.height or 520 for fig in figs]
        return io.write_many(paths, lambda tmps: pio.write_images(figs, tmps, scale=scale, width=widths,
                                                                  height=heights))
    except ResourceError:
        raise  # a full or read-only disk, in the writer's words
    except Exception as exc:  # noqa: BLE001 - kaleido reports browser problems in many ways
        raise ResourceError(
            f"Static figure export failed ({type(exc).__name__}: {exc}). It needs Chromium: run "
            "`make chromium` or set BROWSER_PATH to a Chromium/Chrome binary."
        ) from None


def save_html(figures: Mapping[str, go.Figure], folder: str | Path) -> list[Path]:
    """Each figure as ``<folder>/<name>.html``, with ``plotly.min.js`` written once beside them (offline, not
    copied into each page), every file through interp's one writer (:mod:`interp.io`)."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    from interp import io

    out = Path(folder)
    written = [io.write_text(out / "plotly.min.js", get_plotlyjs())] if figures else []
    for name, fig in figures.items():
        written.append(io.write_text(out / f"{name}.html", pio.to_html(fig, include_plotlyjs="directory",
                                                                      full_html=True)))
    return written[1:]
