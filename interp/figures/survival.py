"""Figures of the survival study (issue 48): what each quantized model keeps of the reference's units.

Each heatmap has one row per quantized model and one column per unit (an induction head ``layer.head``, or a
judged circuit edge ``sender -> receiver``); the colour is the ratio quantized / reference (1: kept as it was,
0: gone), the cell's text the registered verdict. :func:`rate_heatmap` draws the latents' survival rate per SAE
layer the same way.

Example:
    >>> import pandas as pd
    >>> frame = pd.DataFrame({"method": ["rtn", "rtn"], "head": ["17.3", "18.6"], "r_pm": [0.3, 0.9],
    ...                       "verdict": ["loses its role", "keeps its role"]})
    >>> unit_heatmap(frame, "head", "r_pm", "Induction heads").data[0].x
    ('head 17.3', 'head 18.6')
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from interp.figures.style import styled

SHORT = {"keeps its role": "keeps", "loses its role": "loses", "not resolved": "?", "kept": "kept",
         "weakened": "weak", "broken": "broken", "kept or weakened": "kept/weak", "weakened or broken": "weak/broken"}


def unit_heatmap(frame: pd.DataFrame, unit: str, value: str, title: str) -> go.Figure:
    """Methods (rows, in the frame's order) by units (columns), coloured by ``value``, labelled by verdict."""
    methods = list(dict.fromkeys(frame["method"]))
    units = list(dict.fromkeys(frame[unit]))
    z = np.full((len(methods), len(units)), np.nan)
    text = np.full(z.shape, "", dtype=object)
    for _, row in frame.iterrows():
        i, j = methods.index(row["method"]), units.index(row[unit])
        z[i, j] = row[value]
        verdict = str(row.get("verdict", ""))
        text[i, j] = "~" + SHORT.get(verdict.split(": ")[-1].split(" /")[0], verdict) \
            if verdict.startswith("on the boundary") else SHORT.get(verdict, verdict)
    labels = [f"head {u}" if unit == "head" else str(u) for u in units]
    # two lines: on a figure of three heads one line ran past the right edge and was cut
    note = ("cell: the registered verdict. ?: not resolved; ~: on the boundary (within 2 Monte Carlo SEs of its "
            "threshold).<br>Colour: the point ratio, clipped to 0-1.2")
    return _grid(z, text, labels, methods, title, unit, "quantized / reference", 1.2, note)


def rate_heatmap(frame: pd.DataFrame, title: str) -> go.Figure:
    """The latents' survival: methods (rows) by SAE layer (columns), coloured and labelled by the share of judged
    latents that survive (``frame``: the page's per-layer rows of one definition, ``rate`` with its interval).

    Example:
        >>> frame = pd.DataFrame({"method": ["rtn", "rtn"], "layer": [5, 15], "rate": [0.44, 0.11],
        ...                       "rate_low": [0.43, 0.10], "rate_high": [0.45, 0.12]})
        >>> rate_heatmap(frame, "Latents").data[0].text.tolist()
        [['0.44<br>[0.43, 0.45]', '0.11<br>[0.10, 0.12]']]
    """
    methods = list(dict.fromkeys(frame["method"]))
    layers = list(dict.fromkeys(frame["layer"]))
    z = np.full((len(methods), len(layers)), np.nan)
    text = np.full(z.shape, "", dtype=object)
    for _, row in frame.iterrows():
        i, j = methods.index(row["method"]), layers.index(row["layer"])
        z[i, j] = row["rate"]
        text[i, j] = f"{row['rate']:.2f}<br>[{row['rate_low']:.2f}, {row['rate_high']:.2f}]"
    note = "cell: the share of judged latents that survive, with its 95% interval.<br>Colour: that share (0-1)"
    return _grid(z, text, [f"layer {v}" for v in layers], methods, title, "SAE layer", "share surviving", 1.0, note)


def _grid(z: np.ndarray, text: np.ndarray, labels: list[str], methods: list[str], title: str, unit: str,
          scale: str, zmax: float, note: str) -> go.Figure:
    fig = go.Figure(go.Heatmap(z=z, x=labels, y=methods, text=text, texttemplate="%{text}", textfont={"size": 13},
                               zmin=0, zmax=zmax, colorscale="RdYlGn", colorbar={"title": scale}))
    fig.update_yaxes(autorange="reversed")
    fig = styled(fig, title, x=unit, y="quantized model")
    # wide enough that a verdict fits its cell (16 edges at the default width left 7-pixel text), and the labels
    # read: '?' not resolved, '~' on the boundary (a deciding bound within 2 Monte Carlo SEs of its threshold)
    fig.update_layout(width=max(900, 300 + 95 * len(labels)), height=max(520, 300 + 60 * len(methods)),
                      margin={"t": 130})
    fig.add_annotation(text=note, xref="paper", yref="paper", x=0, y=1.02, yanchor="bottom", showarrow=False,
                       xanchor="left", align="left", font={"size": 12})
    return fig
