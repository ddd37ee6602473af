"""Plotly builders for the quantization-error analyses (:mod:`interp.quant.analysis`).

Each function takes a result object and returns a ``go.Figure``; nothing here computes a
statistic. ``DRAWERS`` maps each result type to its default figure, so
``interp.figures.draw(result)`` draws any of them; a reversal has four figures, chosen with
``draw(result, kind=...)`` (:data:`REVERSAL_KINDS`). :func:`folder_figures` names the
figures of :func:`interp.quant.analysis.run_all`'s results as ``interp errors`` writes them.

Example:
    >>> import numpy as np, pandas as pd
    >>> from interp.figures import draw
    >>> from interp.quant import agreement
    >>> rng = np.random.default_rng(0)
    >>> errors = pd.DataFrame({"rtn:bits=3,group=64": rng.normal(size=50), "nf:bits=3,group=64": rng.normal(size=50)})
    >>> [trace.type for trace in draw(agreement(errors, n_boot=10)).data]
    ['heatmap', 'heatmap', 'heatmap']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from interp.errors import InterpError
from interp.figures.style import LAYOUT, PALETTE, band_lines, lines, styled
from interp.quant.analysis import AgreementResult, NormCorrelationResult, ReversalResult, SplitResult


def short_spec(spec: str) -> str:
    """``'gptq:bits=3,group=64,damp=0.01,...'`` -> ``'gptq3 g64'`` for axis labels."""
    method, _, body = spec.partition(":")
    params = dict(item.split("=", 1) for item in body.split(",") if "=" in item)
    if not params:
        return spec
    return f"{method}{params.get('bits', '')} g{params.get('group', '')}"


def agreement_heatmaps(result: Any) -> go.Figure:
    """Pearson, Spearman and top-10% Jaccard matrices side by side."""
    labels = [short_spec(s) for s in result.specs]
    top = result.settings.get("top", 0.1)
    panels = [("Pearson", result.pearson.r), ("Spearman", result.spearman.r),
              (f"Jaccard top {top:.0%}", result.jaccard)]
    fig = make_subplots(rows=1, cols=3, subplot_titles=[p[0] for p in panels], horizontal_spacing=0.08)
    for i, (name, matrix) in enumerate(panels, start=1):
        z = matrix.to_numpy(dtype=float)
        text = np.vectorize(lambda v: f"{v:.2f}")(z)
        fig.add_trace(go.Heatmap(z=z, x=labels, y=labels, zmin=0 if name.startswith("Jaccard") else -1, zmax=1,
                                 colorscale="RdBu_r" if not name.startswith("Jaccard") else "Viridis",
                                 text=text, texttemplate="%{text}", showscale=i == 3,
                                 hovertemplate=f"{name} %{{y}} vs %{{x}}: %{{z:.3f}}<extra></extra>"),
                      row=1, col=i)
        fig.update_yaxes(autorange="reversed", row=1, col=i)
    mean_r = result.mean_off_diagonal("pearson")
    title = (f"Cross-method agreement of per-example error (N={result.n}; mean Pearson {mean_r['mean']:.2f}, "
             f"mean Jaccard {result.mean_off_diagonal('jaccard')['mean']:.2f}, chance {result.chance_jaccard:.3f})")
    fig.update_layout(title=title, height=460, width=1300, template=LAYOUT["template"], font=LAYOUT["font"])
    return fig


def split_histogram(result: Any) -> go.Figure:
    """Distribution of the error, with D_large and D_ctrl overlaid."""
    frame = result.to_frame()
    fig = go.Figure()
    fig.add_trace(go.Histogram(x=frame["error"], name="all", marker_color="#bbbbbb", opacity=0.7, nbinsx=60))
    for i, (label, name) in enumerate((("large", "D_large"), ("ctrl", "D_ctrl"), ("duplicate", "dropped dup"))):
        values = frame.loc[frame["set"] == label, "error"]
        if len(values):
            fig.add_trace(go.Histogram(x=values, name=f"{name} (n={len(values)})", marker_color=PALETTE[i],
                                       opacity=0.8, nbinsx=60))
    fig.update_layout(barmode="overlay")
    return styled(fig, f"Per-example error ({result.settings.get('error', '')}); D_large = top "
                       f"{result.settings['top']:.0%} deduplicated, D_ctrl from the bottom "
                       f"{result.settings['ctrl_pool']:.0%}", x="NLL(quant) - NLL(ref) (nats)", y="examples")


def norm_correlation_lines(result: Any) -> go.Figure:
    """Pearson r(norm, error) per layer with its bootstrap interval, one line per component."""
    table = result.table
    series = {}
    for component, rows in table.groupby("component", sort=False):
        series[component] = (rows["r"].tolist(), rows["low"].tolist(), rows["high"].tolist())
    layers = sorted(table["layer"].unique())
    fig = band_lines(layers, series, "Residual norm vs per-example error (reference activations, BOS excluded; "
                                     "band = 95% bootstrap CI)", "Pearson r")
    fig.add_hline(y=0, line=dict(color="#888", width=1, dash="dot"))
    return fig


def reversal_norms(result: Any) -> go.Figure:
    """||r|| (resid_mid) and ||h|| (MLP input) per layer, D_large vs D_ctrl."""
    b = result.by_layer
    fig = make_subplots(rows=1, cols=2, subplot_titles=["||r|| (resid_mid)", "||h|| = ||RMSNorm2(r)||"])
    for col, stat in enumerate(("r_norm", "h_norm"), start=1):
        for i, name in enumerate(("large", "ctrl")):
            fig.add_trace(go.Scatter(x=b["layer"], y=b[f"{stat}_{name}"], name=f"D_{name}", mode="lines+markers",
                                     line=dict(color=PALETTE[i]), showlegend=col == 1, legendgroup=name),
                          row=1, col=col)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_layout(title="Reversal: residual norm vs MLP-input norm, D_large vs D_ctrl", **LAYOUT)
    fig.update_xaxes(title_text="layer")
    return fig


def reversal_mse_corr(result: Any) -> go.Figure:
    """Pearson r(||h||, MLP-output MSE) per layer, one line per spec, with bootstrap bands."""
    series = {}
    for spec, rows in result.mse.groupby("spec", sort=False):
        series[short_spec(spec)] = (rows["corr_h_mse"].tolist(), rows["corr_low"].tolist(),
                                    rows["corr_high"].tolist())
    fig = band_lines(sorted(result.mse["layer"].unique()), series,
                     "Amplification: corr(||h||, MSE of MLP output, quantized vs reference) per layer",
                     "Pearson r")
    fig.add_hline(y=0.6, line=dict(color="#888", width=1, dash="dot"), annotation_text="paper: > 0.6")
    return fig


def reversal_kurtosis(result: Any) -> go.Figure:
    """Mean per-example kurtosis of r per layer, D_large vs D_ctrl."""
    b = result.by_layer
    fig = lines(b["layer"].tolist(), {"D_large": b["kurtosis_large"].tolist(), "D_ctrl": b["kurtosis_ctrl"].tolist()},
                "Kurtosis of the residual r (over dims, mean over positions and examples)", "kurtosis")
    fig.update_yaxes(type="log")
    return fig


def reversal_outliers(result: Any) -> go.Figure:
    """Percentile of |gamma| of the top outlier dims of r, per layer (0 = smallest gamma)."""
    o = result.outliers
    fig = go.Figure()
    for rank, rows in o.groupby("rank"):
        fig.add_trace(go.Scatter(x=rows["layer"], y=rows["gamma_percentile"], mode="markers",
                                 name=f"outlier #{rank}", marker=dict(size=8, color=PALETTE[(rank - 1) % len(PALETTE)]),
                                 customdata=np.stack([rows["dim"], rows["gamma_abs"], rows["mean_abs_r"]], axis=1),
                                 hovertemplate="layer %{x}, dim %{customdata[0]}: |gamma| %{customdata[1]:.3f} "
                                               "(percentile %{y:.2f}), mean|r| %{customdata[2]:.2f}<extra></extra>"))
    fig.add_hline(y=0.5, line=dict(color="#888", width=1, dash="dot"), annotation_text="median gamma")
    fig.update_yaxes(range=[-0.02, 1.02])
    return styled(fig, "Outlier dimensions of r (largest mean |r|): where their |gamma| ranks among all dims",
                  y="|gamma| percentile")


REVERSAL_FIGURES: dict[str, Callable[[Any], go.Figure]] = {
    "norms": reversal_norms, "mse_corr": reversal_mse_corr, "kurtosis": reversal_kurtosis,
    "outliers": reversal_outliers,
}
REVERSAL_KINDS = tuple(REVERSAL_FIGURES)


def reversal_figure(result: Any, kind: str = "norms") -> go.Figure:
    """One of a reversal's figures, by ``kind``: ``"norms"``, ``"mse_corr"``, ``"kurtosis"`` or ``"outliers"``."""
    if kind not in REVERSAL_FIGURES:
        raise InterpError(f"Unknown reversal figure {kind!r}; choose one of {', '.join(REVERSAL_FIGURES)}.")
    return REVERSAL_FIGURES[kind](result)


def folder_figures(results: Mapping[str, Any]) -> dict[str, go.Figure]:
    """The figures ``interp errors`` writes, by file name, for :func:`interp.quant.analysis.run_all`'s results."""
    figures: dict[str, go.Figure] = {}
    for name, result in results.items():
        if isinstance(result, ReversalResult):
            figures.update({f"{name}_{kind}": reversal_figure(result, kind) for kind in REVERSAL_KINDS})
        else:
            figures[name] = DRAWERS[type(result)](result)
    return figures


DRAWERS: dict[type, Callable[..., go.Figure]] = {
    AgreementResult: agreement_heatmaps,
    SplitResult: split_histogram,
    NormCorrelationResult: norm_correlation_lines,
    ReversalResult: reversal_figure,
}
