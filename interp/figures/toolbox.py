"""Figures of the toolbox: the attention view, the lens's top tokens, patching heatmaps and probe accuracy.

Every position axis is labelled ``"position:token"`` with the prompt's own tokens. The attention
view is interactive (a menu picks the layer and head) and needs nothing online: in a notebook
plotly renders it from the kernel, in the HTML report from the plotly.js beside the page, and
:func:`standalone_html` writes one file with plotly.js inlined.

Example:
    >>> import interp
    >>> model = interp.tiny_model("llama")
    >>> fig = interp.attention_view(model, "abc", layers=[1])
    >>> len(fig.data), fig.data[0].x  # one heatmap per head, the tokens on both axes
    (4, ('0:<bos>', '1:a', '2:b', '3:c'))
    >>> [button.label for button in fig.layout.updatemenus[0].buttons][:2]
    ['layer 1 head 0', 'layer 1 head 1']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go

from interp.errors import InterpError
from interp.figures.style import PALETTE, heatmap, styled
from interp.localize.heatmaps import PatchHeatmap
from interp.localize.linear_probe import LinearProbeResult
from interp.localize.patterns import AttentionPatterns, attention_patterns
from interp.localize.top_tokens import TopTokens
from interp.results import check_result
from interp.validate import checked, indices


@checked
def attention_view(model_or_patterns: Any, prompt: Any = None, *, layers: Sequence[int] | None = None,
                   heads: Sequence[int] | None = None, title: str | None = None) -> go.Figure:
    """Every head's attention pattern on one prompt, a menu choosing the (layer, head) shown.

    Args:
        model_or_patterns: a model (then ``prompt`` is captured, :func:`interp.localize.patterns.attention_patterns`)
            or an :class:`~interp.localize.patterns.AttentionPatterns` already captured.
        prompt: the prompt, with a model.
        layers: the layers offered (default: all captured).
        heads: the heads offered (default: all).
        title: the figure's title.

    Example:
        >>> import interp
        >>> from interp.localize.patterns import attention_patterns
        >>> att = attention_patterns(interp.tiny_model("llama"), "hi")
        >>> fig = attention_view(att, heads=[2])
        >>> bool((fig.data[0].z == att.pattern[0, 2].numpy()).all())
        True
    """
    if isinstance(model_or_patterns, AttentionPatterns):
        patterns = model_or_patterns
    elif prompt is None:
        raise InterpError("attention_view needs a prompt with a model: interp.attention_view(model, 'your prompt').")
    else:
        patterns = attention_patterns(model_or_patterns, prompt, layers)
    check_result(patterns)  # patterns a caller changed after they were made are checked again (interp.results)
    rows = [i for i, layer in enumerate(patterns.layers) if layers is None or layer in set(layers)]
    if not rows:
        raise InterpError(f"None of layers {list(layers or [])} was captured; these were: {patterns.layers}.")
    n_heads = patterns.pattern.shape[1]
    picked = list(range(n_heads)) if heads is None else [int(h) for h in indices(heads, "heads", n_heads, "heads")]
    labels = patterns.labels
    fig = go.Figure()
    names = []
    for i in rows:
        for h in picked:
            names.append(f"layer {patterns.layers[i]} head {h}")
            fig.add_trace(go.Heatmap(z=patterns.pattern[i, h].numpy(), x=labels, y=labels, zmin=0, zmax=1,
                                     colorscale="Blues", visible=len(names) == 1, name=names[-1],
                                     colorbar={"title": "weight"},
                                     hovertemplate="query %{y}<br>key %{x}<br>weight %{z:.3f}<extra></extra>"))
    buttons = [{"label": name, "method": "update",
                "args": [{"visible": [j == k for j in range(len(names))]}, {"title.text": _title(title, name)}]}
               for k, name in enumerate(names)]
    fig.update_layout(updatemenus=[{"buttons": buttons, "direction": "down", "x": 0.0, "xanchor": "left", "y": 1.12,
                                    "yanchor": "bottom", "showactive": True}])
    styled(fig, _title(title, names[0]), "key", "query")
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category", tickangle=-45)
    fig.update_layout(height=600, margin={"t": 130})
    return fig


def _title(title: str | None, name: str) -> str:
    return f"{title}: {name}" if title else f"Attention pattern, {name} (menu: other heads)"


def top_tokens(result: TopTokens, title: str | None = None) -> go.Figure:
    """Layer x position: the top decoded token written in each cell, its probability as the colour."""
    z = result.probs[:, :, 0].numpy()
    text = [[cell[0] for cell in row] for row in result.strings]
    hover = [["<br>".join(f"{s!r} {p:.3f}" for s, p in zip(cell, result.probs[i, j].tolist(), strict=True))
              for j, cell in enumerate(row)] for i, row in enumerate(result.strings)]
    fig = go.Figure(go.Heatmap(z=z, x=result.labels, y=[str(layer) for layer in result.layers], text=text,
                               texttemplate="%{text}", customdata=hover, colorscale="Blues", zmin=0, zmax=1,
                               hovertemplate="layer %{y}, %{x}<br>%{customdata}<extra></extra>",
                               colorbar={"title": "p(top)"}))
    lens = "tuned lens" if result.lens == "tuned" else "logit lens"
    styled(fig, title or f"Top next token per layer and position ({lens})", "position", "layer")
    fig.update_xaxes(type="category", tickangle=-45)
    fig.update_yaxes(type="category")
    fig.update_layout(height=max(400, 22 * len(result.layers) + 160))
    return fig


def patch_heatmap(result: PatchHeatmap, title: str | None = None) -> go.Figure:
    """The recovery grid, layer upwards, heads or token-labelled positions across."""
    what = "head" if result.over == "head" else "position"
    fig = heatmap(result.recovery.numpy(), result.columns, [str(layer) for layer in result.layers],
                  title or f"Patching clean into corrupted, per layer and {what}: recovery of the logit difference",
                  what, "layer", colorbar="recovery", colorscale="RdBu", zmid=0.0)
    fig.update_xaxes(type="category", tickangle=-45 if what == "position" else 0)
    fig.update_yaxes(type="category")
    return fig


def probe_accuracy(result: LinearProbeResult, title: str | None = None) -> go.Figure:
    """Held-out accuracy by layer against the control task's, and the majority baseline."""
    fig = go.Figure()
    for i, (name, values) in enumerate((("probe", result.accuracy), ("control task", result.control_accuracy))):
        fig.add_trace(go.Scatter(x=result.layers, y=values.numpy(), mode="lines+markers", name=name,
                                 line={"color": PALETTE[i]}))
    fig.add_trace(go.Scatter(x=result.layers, y=np.full(len(result.layers), result.majority), mode="lines",
                             name="majority class", line={"color": PALETTE[8], "dash": "dot"}))
    return styled(fig, title or f"Linear probe: held-out accuracy ({result.n_test} held out)", "layer", "accuracy")


def standalone_html(fig: go.Figure) -> str:
    """One HTML page holding ``fig`` with plotly.js inlined (about 4.6 MB): opens offline, fetches nothing."""
    return fig.to_html(include_plotlyjs=True, full_html=True, config={"displaylogo": False})


DRAWERS = {AttentionPatterns: attention_view, TopTokens: top_tokens, PatchHeatmap: patch_heatmap,
           LinearProbeResult: probe_accuracy}
