"""Plotly figure builders. Each takes a result (or plain arrays) and returns a ``go.Figure``.

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

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22"]
LAYOUT = dict(template="plotly_white", font=dict(size=13), margin=dict(l=60, r=20, t=60, b=50),
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


# -- attention ---------------------------------------------------------------------------


def metric_by_layer(result: Any, metric: str = "entropy") -> go.Figure:
    """Per-layer mean over heads of an attention metric, with the min-max band over heads,
    for the reference model and (when present) SAOBP."""
    from interp.attention.analysis import LABELS

    by_layer = result.by_layer()
    series = {}
    for variant in result.variants:
        rows = by_layer[by_layer["variant"] == variant]
        series[variant] = (rows[f"{metric}_mean"].tolist(), rows[f"{metric}_min"].tolist(),
                           rows[f"{metric}_max"].tolist())
    layers = sorted(set(by_layer["layer"]))
    beta = result.settings.get("saobp_beta")
    title = f"{LABELS[metric]} by layer" + (f" (SAOBP beta={beta}, band = head min-max)" if beta else
                                             " (band = head min-max)")
    return band_lines(layers, series, title, LABELS[metric])


def metric_heatmap(result: Any, metric: str = "entropy", variant: str = "reference") -> go.Figure:
    """Layer x head heatmap of an attention metric."""
    from interp.attention.analysis import LABELS

    table = result.table[result.table["variant"] == variant]
    grid = table.pivot(index="layer", columns="head", values=metric)
    return heatmap(grid.to_numpy(), grid.columns, grid.index, f"{LABELS[metric]} per head ({variant})",
                   "head", "layer", colorbar=metric)


def attention_map(pattern: Any, tokens: Sequence[str], title: str) -> go.Figure:
    """One head's attention pattern ``[q, k]`` with token labels on both axes."""
    z = np.asarray(pattern, dtype=float)
    labels = [f"{i}:{t}" for i, t in enumerate(tokens)]
    fig = heatmap(z, labels, labels, title, "key", "query", colorbar="weight", colorscale="Blues")
    fig.update_yaxes(autorange="reversed", tickmode="array", tickvals=labels)
    fig.update_xaxes(tickmode="array", tickvals=labels)
    fig.update_layout(height=560)
    return fig


# -- probes ------------------------------------------------------------------------------


def probe_norms(result: Any, components: Sequence[str] = ("resid_mid", "resid_post", "h", "gate"),
                reducer: str = "norm") -> go.Figure:
    """Mean norm per layer for each component, with the 10-90% band over examples."""
    series = {}
    for component in components:
        name = f"{component}/{reducer}"
        if name not in result.stats:
            continue
        values = result.stats[name].float()
        series[component] = (values.mean(1).tolist(), values.quantile(0.1, dim=1).tolist(),
                             values.quantile(0.9, dim=1).tolist())
    fig = band_lines(result.layers, series, f"{reducer} by layer (band = 10-90% of examples)", reducer)
    fig.update_yaxes(type="log")
    return fig


# -- static export -----------------------------------------------------------------------


def export_static(figures: Mapping[str, go.Figure], folder: str | Path, formats: Sequence[str] = ("png", "svg"),
                  scale: float = 2.0) -> list[Path]:
    """Write each figure as PNG/SVG through kaleido, starting the browser once for all of them.

    Needs a Chromium: kaleido uses ``BROWSER_PATH`` (the Makefile sets ``/usr/bin/chromium``).
    """
    import plotly.io as pio

    from interp.errors import ResourceError

    if not os.environ.get("BROWSER_PATH") and Path("/usr/bin/chromium").exists():
        os.environ["BROWSER_PATH"] = "/usr/bin/chromium"
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    figs, paths = [], []
    for name, fig in figures.items():
        for fmt in formats:
            figs.append(fig)
            paths.append(out / f"{name}.{fmt}")
    try:
        pio.write_images(figs, paths, scale=scale, width=900, height=520)
    except Exception as exc:  # noqa: BLE001 - kaleido reports browser problems in many ways
        raise ResourceError(
            f"Static figure export failed ({type(exc).__name__}: {exc}). It needs Chromium: run "
            "`make chromium` or set BROWSER_PATH to a Chromium/Chrome binary."
        ) from None
    return paths
