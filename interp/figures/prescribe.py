"""Figures of mixed-precision prescription: per-weight sensitivity by layer and role, and the
Pareto view of the allocation strategies (average bits per weight against mean held-out error).

Example:
    >>> import numpy as np, pandas as pd
    >>> from interp.quant.prescribe import Validation
    >>> table = pd.DataFrame({"budget": [np.nan, np.nan, 4.0, 4.0], "strategy": ["uniform", "uniform", "interp",
    ...                       "heuristic"], "average_bits": [3.5, 4.5, 4.0, 3.99], "mean_error": [0.8, 0.1, 0.3, 0.35]})
    >>> pareto_figure(Validation(table)).layout.xaxis.title.text
    'average bits per weight (scales and zero-points counted)'
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import plotly.graph_objects as go

from interp.figures.style import PALETTE, heatmap, styled
from interp.quant.prescribe import Validation
from interp.quant.sensitivity import Sensitivity

STRATEGY_COLORS = {"interp": PALETTE[0], "heuristic": PALETTE[1], "random": PALETTE[7 % len(PALETTE)],
                   "interp-sequential": PALETTE[3]}


def sensitivity_figure(result: Sensitivity, title: str | None = None) -> go.Figure:
    """Heatmap of the per-weight sensitivity (NLL increase, nats) by layer (rows) and role (columns)."""
    grid = result.grid()
    return heatmap(grid.to_numpy(), list(grid.columns), list(grid.index),
                   title or f"Sensitivity: NLL increase with only that weight at {result.spec.split(',')[0]}",
                   "role", "layer", colorbar="nats", colorscale="Viridis")


def sensitivity_by_half(result: Sensitivity) -> go.Figure:
    """Summed sensitivity per role in the lower and the upper half of the layers (the localization's view)."""
    table = result.table()
    half = (max(result.layers) + 1) // 2
    roles = list(result.grid().columns)
    fig = go.Figure()
    for i, (name, rows) in enumerate((("lower half", table[table["layer"] < half]),
                                      ("upper half", table[table["layer"] >= half]))):
        sums = rows.groupby("role")["score"].sum()
        fig.add_trace(go.Bar(x=roles, y=[float(sums.get(r, 0.0)) for r in roles], name=name,
                             marker_color=PALETTE[i]))
    fig.update_layout(barmode="group")
    return styled(fig, "Sensitivity summed per role, lower vs upper half of the layers", "role", "nats")


def pareto_figure(result: Validation, title: str = "Mean held-out error against average bits") -> go.Figure:
    """Each strategy's plans as points (average bits, mean error), one line per strategy across budgets;
    the all-low and all-high ends joined by a dashed line."""
    table = result.table
    fig = go.Figure()
    ends = table[table["budget"].isna()].sort_values("average_bits")
    fig.add_trace(go.Scatter(x=ends["average_bits"], y=ends["mean_error"], mode="lines+markers", name="uniform",
                             line=dict(color="black", dash="dash"), marker=dict(size=9, symbol="square")))
    plans = table[table["budget"].notna()]
    for i, (strategy, rows) in enumerate(plans.groupby("strategy", sort=False)):
        rows = rows.sort_values("average_bits")
        color = STRATEGY_COLORS.get(str(strategy), PALETTE[(i + 4) % len(PALETTE)])
        fig.add_trace(go.Scatter(x=rows["average_bits"], y=rows["mean_error"], mode="lines+markers",
                                 name=str(strategy), line=dict(color=color), marker=dict(size=8),
                                 error_y=_error_bars(rows)))
    return styled(fig, title, "average bits per weight (scales and zero-points counted)", "mean error (nats)")


def _error_bars(rows: Any) -> dict[str, Any] | None:
    """The interval of the difference to interp's plan, drawn around the strategy's own mean (where present)."""
    if "diff_low" not in rows or rows["diff_low"].isna().all():
        return None
    high = (rows["diff_high"] - rows["diff"]).to_numpy(dtype=float)
    low = (rows["diff"] - rows["diff_low"]).to_numpy(dtype=float)
    if not np.isfinite(high).any() or all(math.isnan(v) for v in high):
        return None
    return dict(type="data", symmetric=False, array=np.nan_to_num(high), arrayminus=np.nan_to_num(low))


DRAWERS = {Sensitivity: sensitivity_figure, Validation: pareto_figure}
