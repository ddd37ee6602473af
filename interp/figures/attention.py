"""Figures of attention localization: a metric by layer (band over heads), per-head heatmaps, one head's map."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go

from interp.attention.analysis import AttentionResult
from interp.attention.metrics import METRICS
from interp.figures.style import band_lines, heatmap


def metric_by_layer(result: Any, metric: str = "entropy") -> go.Figure:
    """Per-layer mean over heads of an attention metric, with the min-max band over heads,
    for the reference model and (when present) SAOBP."""
    by_layer = result.by_layer()
    series = {}
    for variant in result.variants:
        rows = by_layer[by_layer["variant"] == variant]
        series[variant] = (rows[f"{metric}_mean"].tolist(), rows[f"{metric}_min"].tolist(),
                           rows[f"{metric}_max"].tolist())
    layers = sorted(set(by_layer["layer"]))
    beta = result.settings.get("saobp_beta")
    title = f"{METRICS[metric].label} by layer" + (f" (SAOBP beta={beta}, band = head min-max)" if beta else
                                             " (band = head min-max)")
    return band_lines(layers, series, title, METRICS[metric].label)


def metric_heatmap(result: Any, metric: str = "entropy", variant: str = "reference") -> go.Figure:
    """Layer x head heatmap of an attention metric."""
    table = result.table[result.table["variant"] == variant]
    grid = table.pivot(index="layer", columns="head", values=metric)
    return heatmap(grid.to_numpy(), grid.columns, grid.index, f"{METRICS[metric].label} per head ({variant})",
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


DRAWERS = {AttentionResult: metric_by_layer}
