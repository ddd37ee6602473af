"""Plotly figures of the baseline-versus-SAOBP training log (:mod:`interp.attention.train`).

Each builder takes the log DataFrame (``load_log(out_dir)`` or the frame ``run`` returns:
one row per model per logged step, wide per-layer columns such as ``entropy_l3``) and
returns a ``go.Figure``; the caller decides where it goes (notebook, HTML, PNG).

* :func:`entropy_figure`: mean attention entropy per layer over training, both models;
* :func:`gtd_figure`: mean GTD per layer over training;
* :func:`loss_figure`: held-out (and training) loss curves, spikes marked;
* :func:`beta_figure`: the learned beta of every SAOBP head;
* :func:`final_layers_figure`: one metric per layer at the last logged step, both models.

Colour encodes the layer, line style the model (solid baseline, dashed SAOBP).
"""

from __future__ import annotations

import re
from functools import partial

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import sample_colorscale

from interp.errors import InterpError

DASH = {"baseline": "solid", "saobp": "dash"}
MODEL_COLOR = {"baseline": "#1f77b4", "saobp": "#d62728"}

__all__ = ["beta_figure", "entropy_figure", "final_layers_figure", "gtd_figure", "loss_figure", "per_layer_figure"]


def _layers(log: pd.DataFrame, metric: str) -> list[int]:
    pattern = re.compile(rf"^{re.escape(metric)}_l(\d+)$")
    layers = sorted(int(m.group(1)) for column in log.columns if (m := pattern.match(column)))
    if not layers:
        raise InterpError(
            f"The log has no per-layer columns for {metric!r} (expected e.g. '{metric}_l0'); "
            "pass the frame from interp.attention.train.run or load_log."
        )
    return layers


def _layer_colors(n_layers: int) -> list[str]:
    if n_layers == 1:
        return sample_colorscale("Viridis", [0.0])
    return sample_colorscale("Viridis", [i / (n_layers - 1) for i in range(n_layers)])


def per_layer_figure(log: pd.DataFrame, metric: str, title: str, y_title: str) -> go.Figure:
    """One line per (model, layer): ``{metric}_l{layer}`` against the training step.

    Args:
        log: the training log.
        metric: column stem, e.g. ``"entropy"``, ``"entropy_norm"``, ``"gtd"``, ``"sink"``,
            ``"prior_entropy"`` (SAOBP's unrefined pattern).
        title: figure title.
        y_title: y-axis label.
    """
    layers = _layers(log, metric)
    colors = _layer_colors(len(layers))
    figure = go.Figure()
    for model, rows in log.groupby("model", sort=True):
        rows = rows.sort_values("step")
        for color, layer in zip(colors, layers, strict=True):
            values = rows[f"{metric}_l{layer}"]
            if values.isna().all():
                continue
            figure.add_trace(
                go.Scatter(
                    x=rows["step"], y=values, mode="lines", name=f"{model} L{layer}",
                    line={"color": color, "dash": DASH.get(str(model), "dot")},
                    legendgroup=str(model),
                )
            )  # fmt: skip
    figure.update_layout(title=title, xaxis_title="training step", yaxis_title=y_title, template="plotly_white")
    return figure


entropy_figure = partial(
    per_layer_figure, metric="entropy", title="Mean attention entropy per layer", y_title="entropy (nats)"
)
entropy_figure.__doc__ = "Mean attention entropy per layer over training, baseline (solid) vs SAOBP (dashed)."

gtd_figure = partial(per_layer_figure, metric="gtd", title="Mean GTD per layer", y_title="GTD (TV, 0-1)")
gtd_figure.__doc__ = "Mean Global Token Dependency per layer over training, baseline vs SAOBP."


def loss_figure(log: pd.DataFrame) -> go.Figure:
    """Held-out loss (markers) and mean training loss (thin) per model; loss spikes marked with x."""
    figure = go.Figure()
    for model, rows in log.groupby("model", sort=True):
        rows = rows.sort_values("step")
        dash = DASH.get(str(model), "dot")
        color = MODEL_COLOR.get(str(model), "#7f7f7f")
        figure.add_trace(
            go.Scatter(x=rows["step"], y=rows["heldout_loss"], mode="lines+markers", name=f"{model} held-out",
                       line={"dash": dash, "width": 2, "color": color})
        )  # fmt: skip
        figure.add_trace(
            go.Scatter(x=rows["step"], y=rows["train_loss"], mode="lines", name=f"{model} train",
                       line={"dash": dash, "width": 1, "color": color}, opacity=0.6)
        )  # fmt: skip
        spikes = rows[rows["spike"].astype(bool)]
        if len(spikes):
            figure.add_trace(
                go.Scatter(x=spikes["step"], y=spikes["train_loss"], mode="markers", name=f"{model} spike",
                           marker={"symbol": "x", "size": 10, "color": color})
            )  # fmt: skip
    figure.update_layout(
        title="Loss", xaxis_title="training step", yaxis_title="cross-entropy (nats/token)", template="plotly_white"
    )
    return figure


def beta_figure(log: pd.DataFrame) -> go.Figure:
    """Learned beta of every SAOBP head over training (one line per head, coloured by layer)."""
    columns = [c for c in log.columns if re.match(r"^beta_l\d+_h\d+$", c)]
    rows = log[log["model"] == "saobp"].sort_values("step")
    if not columns or rows.empty:
        raise InterpError("The log has no SAOBP beta columns; it must come from interp.attention.train.run.")
    layers = sorted({int(re.findall(r"\d+", c)[0]) for c in columns})
    colors = dict(zip(layers, _layer_colors(len(layers)), strict=True))
    figure = go.Figure()
    for column in columns:
        layer, head = (int(x) for x in re.findall(r"\d+", column))
        figure.add_trace(
            go.Scatter(x=rows["step"], y=rows[column], mode="lines", name=f"L{layer} H{head}",
                       line={"color": colors[layer]}, legendgroup=f"L{layer}")
        )  # fmt: skip
    figure.update_layout(
        title="Learned SAOBP beta per head", xaxis_title="training step", yaxis_title="beta", template="plotly_white"
    )
    return figure


def final_layers_figure(log: pd.DataFrame, metric: str = "entropy") -> go.Figure:
    """``{metric}`` per layer at the last logged step: grouped bars, one group per layer."""
    layers = _layers(log, metric)
    last = log[log["step"] == log["step"].max()]
    figure = go.Figure()
    for _, row in last.sort_values("model").iterrows():
        figure.add_trace(go.Bar(x=[f"L{layer}" for layer in layers], y=[row[f"{metric}_l{layer}"] for layer in layers],
                                name=str(row["model"]), marker_color=MODEL_COLOR.get(str(row["model"]))))  # fmt: skip
    figure.update_layout(
        title=f"{metric} per layer at step {int(log['step'].max())}", barmode="group",
        xaxis_title="layer", yaxis_title=metric, template="plotly_white",
    )  # fmt: skip
    return figure
