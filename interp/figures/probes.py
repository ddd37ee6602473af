"""Figures of probe results: per-layer statistics with a band over examples."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from interp.figures.style import band_lines
from interp.probes import ProbeResult


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


DRAWERS = {ProbeResult: probe_norms}
