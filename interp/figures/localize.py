"""Figures of localization results: early exit, layer restoration, activation patching and attribution.

``DRAWERS`` maps each result type to its default figure, so ``interp.figures.draw(result)``
works for every result of :mod:`interp.localize`; the builders below take extra arguments
(a curve's name, a title) or draw one kind of patching figure directly.

Example:
    >>> import interp, torch
    >>> from interp.figures import draw
    >>> from interp.figures.localize import early_exit_curves
    >>> from interp.localize import lens
    >>> model = interp.tiny_model("llama")
    >>> rows = interp.Examples.from_tokens(torch.randint(0, 256, (4, 8)))
    >>> res = lens.early_exit(model, rows)
    >>> [trace.name for trace in draw(res, name="tiny").data]
    ['tiny']
    >>> fig = early_exit_curves({"tiny / D_large": res, "tiny / D_ctrl": res})
    >>> [trace.line.dash for trace in fig.data]  # control sets are dashed
    ['solid', 'dash']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go

from interp.figures.style import PALETTE, heatmap, styled
from interp.localize.circuit import Circuit
from interp.localize.dla import LogitAttribution
from interp.localize.eap import EdgeAttribution
from interp.localize.lens import EarlyExitCurves, EarlyExitResult
from interp.localize.patching import PAPER_NAMES, AttributionResult, GateInputComparison, PatchResult, span
from interp.localize.paths import PathPatchResult
from interp.localize.restoration import RestorationResult

# ---------------------------------------------------------------------------------------
# Early exit and restoration


def early_exit_curves(results: EarlyExitCurves | Mapping[str, EarlyExitResult], title: str | None = None) -> go.Figure:
    """Mean NLL by layer, one curve per result (e.g. ``"quantized / D_large"``).

    Curves whose name mentions ``ctrl`` are dashed, so {model} x {D_large, D_ctrl} reads at
    a glance.
    """
    curves = results.results if isinstance(results, EarlyExitCurves) else results
    fig = go.Figure()
    for name, res in curves.items():
        fig.add_trace(go.Scatter(
            x=res.layers, y=res.layer_mean().numpy(), mode="lines+markers", name=name,
            line={"dash": "dash" if "ctrl" in name.lower() else "solid"},
        ))
    at = next(iter(curves.values())).at if curves else "resid_post"
    return styled(fig, title or f"Early exit: NLL decoding {at} at each layer", "layer",
                  "mean next-token NLL (nats)")


def early_exit(result: EarlyExitResult, name: str | None = None, title: str | None = None) -> go.Figure:
    """One early-exit result's NLL by layer (the curve named ``name``, default the model's)."""
    return early_exit_curves({name or str(result.settings.get("model", "model")): result}, title)


def restoration(result: RestorationResult) -> go.Figure:
    """Perplexity with the top-k blocks restored, against k, with the reference's as a dashed line."""
    fig = go.Figure(go.Scatter(x=result.ks, y=result.perplexity().numpy(), mode="lines+markers",
                               name="top-k blocks restored"))
    fig.add_hline(y=result.reference_perplexity, line_dash="dash", annotation_text="reference")
    return styled(fig, "Layer restoration: perplexity with the top-k blocks restored",
                  "k (restored blocks, from the top)", "perplexity")


# ---------------------------------------------------------------------------------------
# Patching


def _clip_recovery_axis(fig: go.Figure, recovery: Any) -> go.Figure:
    """Keep -100%..+110% readable when one patch moves far away from the source (hover shows the value)."""
    low, high = float(np.nanmin(recovery)) * 100, float(np.nanmax(recovery)) * 100
    if low < -100 or high > 200:
        fig.update_yaxes(range=[max(low, -100) - 10, min(max(high, 110), 200) + 10])
        fig.update_yaxes(title=f"{fig.layout.yaxis.title.text} (axis clipped: hover for values)")
    return fig


def _by_component(table: Any, x: str, y: str, scale: float = 1.0) -> go.Figure:
    """One line per component (in table order) of ``y`` against ``x``."""
    fig = go.Figure()
    for i, (component, rows) in enumerate(table.groupby("component", sort=False)):
        fig.add_trace(go.Scatter(x=rows[x].astype(int), y=scale * rows[y], mode="lines+markers",
                                 name=PAPER_NAMES.get(component, component),
                                 line={"color": PALETTE[i % len(PALETTE)]}))
    return fig


def patching_sweep(result: PatchResult) -> go.Figure:
    """Recovery (%) by layer, one line per component: for single-layer sweeps."""
    table = result.table()
    fig = styled(_by_component(table, "layers", "recovery", 100.0),
                 "Patching one layer at a time: recovery of the gap", "layer", "recovery (%)")
    return _clip_recovery_axis(fig, table["recovery"])


def patching_bars(result: PatchResult) -> go.Figure:
    """Recovery (%) per patch as bars: for joint patches (e.g. the paper's table)."""
    table = result.table()
    labels = [f"{n} ({layers})" for n, layers in zip(table["name"], table["layers"], strict=True)]
    fig = go.Figure(go.Bar(x=labels, y=100 * table["recovery"], text=[f"{100 * r:.0f}%" for r in table["recovery"]],
                           marker_color=PALETTE[0]))
    return _clip_recovery_axis(styled(fig, "Patching: recovery of the gap", "", "recovery (%)"), table["recovery"])


def recovery_intervals(labels: Sequence[str], point: Sequence[float], low: Sequence[float], high: Sequence[float],
                       secondary: Sequence[float] | None = None, title: str = "Patching: recovery of the gap",
                       scale: str = "NLL", secondary_scale: str = "perplexity") -> go.Figure:
    """Recovery (%) per patch as bars with their interval, on one scale (``scale``), and optionally
    the same recovery on a second scale as open markers (e.g. NLL primary, perplexity beside it).

    Example:
        >>> fig = recovery_intervals(["down", "up"], [0.55, -0.3], [0.49, -0.4], [0.6, -0.2], secondary=[0.69, -0.5])
        >>> [trace.type for trace in fig.data], fig.layout.yaxis.title.text
        (['bar', 'scatter'], 'recovery (%)')
        >>> recovery_intervals(["up"], [-1.9], [-2.2], [-1.7]).layout.yaxis.title.text  # beyond -100%: clipped
        'recovery (%) (axis clipped: hover for values)'
    """
    pct = [100 * float(v) for v in point]
    fig = go.Figure(go.Bar(
        x=list(labels), y=pct, name=f"{scale} scale (95% interval)", marker_color=PALETTE[0],
        text=[f"{v:.0f}%" for v in pct], textposition="inside", insidetextanchor="start",  # at the bar's base,
        # clear of the interval's whiskers and visible on a clipped bar
        error_y=dict(type="data", symmetric=False, array=[100 * float(h) - v for h, v in zip(high, pct, strict=True)],
                     arrayminus=[v - 100 * float(lo) for lo, v in zip(low, pct, strict=True)])))
    if secondary is not None:
        fig.add_trace(go.Scatter(x=list(labels), y=[100 * float(v) for v in secondary], mode="markers",
                                 name=f"{secondary_scale} scale", marker=dict(symbol="circle-open", size=11,
                                                                              color=PALETTE[1])))
    values = np.array([*pct, *(100 * float(v) for v in (list(secondary) if secondary is not None else []))]) / 100
    return _clip_recovery_axis(styled(fig, title, "", "recovery (%)"), values)


def patching_positions(result: PatchResult, tokens: Sequence[str] | None = None) -> go.Figure:
    """Layer x position heatmap of the recovery: for per-position patches (e.g. clean/corrupt).

    With ``tokens`` (the prompt's tokens as strings, position 0 first), positions are labelled by
    their tokens (:func:`token_labels`); otherwise by number."""
    table = result.table()
    grid = table.pivot_table(index="layers", columns="positions", values="recovery", sort=False, dropna=False)
    columns = list(grid.columns)
    if tokens is not None:
        labels = token_labels(tokens)
        columns = [labels[int(c)] if str(c).lstrip("-").isdigit() and -len(labels) <= int(c) < len(labels) else c
                   for c in columns]
    return heatmap(grid.to_numpy(), columns, grid.index,
                   f"Patching {', '.join(table['component'].unique())} by layer and position", "position", "layer",
                   colorbar="recovery", colorscale="RdBu", zmid=0)


def patching(result: PatchResult, tokens: Sequence[str] | None = None) -> go.Figure:
    """The fitting figure for a :class:`~interp.localize.patching.PatchResult`: a layer x
    position heatmap when patches name positions (labelled by ``tokens`` when given), recovery
    by layer for single-layer sweeps, bars otherwise."""
    if any(p.positions is not None for p in result.patches):
        return patching_positions(result, tokens)
    if all(len(p.layers) == 1 and p.heads is None for p in result.patches):
        return patching_sweep(result)
    return patching_bars(result)


def attribution(result: AttributionResult) -> go.Figure:
    """Estimated change in the mean metric by layer, one line per component."""
    return styled(_by_component(result.table(), "layer", "estimate"),
                  "Attribution patching: first-order effect of each patch", "layer",
                  f"estimated change in mean {result.metric}")


def gate_input(result: GateInputComparison) -> go.Figure:
    """Perplexity of the reference, the quantized model, the gate-input patch and the restored gate weights."""
    table = result.table()
    fig = go.Figure(go.Bar(x=table["setting"], y=table["perplexity"], text=[f"{v:.2f}" for v in table["perplexity"]],
                           marker_color=PALETTE[0]))
    return styled(fig, f"Gate input vs gate weights (layers {span(result.layers)})", "", "perplexity")


DRAWERS: dict[type, Callable[..., go.Figure]] = {
    EarlyExitResult: early_exit,
    EarlyExitCurves: early_exit_curves,
    RestorationResult: restoration,
    PatchResult: patching,
    AttributionResult: attribution,
    GateInputComparison: gate_input,
}


# ---------------------------------------------------------------------------------------
# Circuits: positions labelled by their tokens, answers by their strings


def token_labels(tokens: Sequence[str]) -> list[str]:
    """Axis labels for a prompt's positions: each token as written, its spaces trimmed (a line break shown
    as ``↵``, a token of spaces alone as ``␣``), and a token that occurs more than once suffixed with its
    position (``Paris·3``), so that no two positions share a label (plotly would merge them).

    Example:
        >>> token_labels(["<s>", " Paris", " is", " Paris", " "])
        ['<s>', 'Paris·1', 'is', 'Paris·3', '␣']
    """
    shown = [t.replace("\n", "↵").strip() or "␣" for t in tokens]
    counts: dict[str, int] = {}
    for label in shown:
        counts[label] = counts.get(label, 0) + 1
    return [f"{label}·{i}" if counts[label] > 1 else label for i, label in enumerate(shown)]


def answer_label(settings: Mapping[str, Any], what: str = "logit") -> str:
    """``logit(' Paris') - logit(' Rome')`` from a result's answer strings (``answer_text``, ``wrong_text``),
    or ``logit(answer) - logit(wrong)`` when the prompts have different answers or none were given as text.

    Example:
        >>> answer_label({"answer_text": [" Paris"], "wrong_text": [" Rome"]})
        "logit(' Paris') − logit(' Rome')"
    """
    def one(key: str, fallback: str) -> str:
        texts = settings.get(key) or []
        return f"{what}({texts[0]!r})" if texts and len(set(texts)) == 1 else f"{what}({fallback})"

    if "answer_text" not in settings:
        return "logit difference" if settings.get("versus") is not None else what
    if "wrong_text" not in settings:
        return one("answer_text", "answer")
    return f"{one('answer_text', 'answer')} − {one('wrong_text', 'wrong')}"


def logit_attribution(result: LogitAttribution, title: str | None = None) -> go.Figure:
    """Direct logit attribution: layer x head heatmap of each head's mean contribution (diverging at 0),
    the answers named by their strings when they were given as text (:func:`interp.dla`)."""
    grid = result.head_means().numpy()
    what = answer_label(result.settings)
    of = f" of {what}" if "answer_text" in result.settings else ""
    return heatmap(grid, list(range(grid.shape[1])), list(range(grid.shape[0])),
                   title or f"Direct logit attribution{of} per head (frozen final norm), mean over {len(result.ids)} "
                   "prompts", "head", "layer", colorbar=_short(what), colorscale="RdBu", zmid=0.0)


def _short(label: str) -> str:
    """A colorbar title: the label broken before its minus sign, so it fits beside the heatmap."""
    return label.replace(" − ", "<br>− ")


DRAWERS[LogitAttribution] = logit_attribution


def top_edges(table: Any, k: int = 15, title: str | None = None) -> go.Figure:
    """Horizontal bars of the ``k`` edges with the largest absolute ``score`` in ``table`` (columns
    ``edge`` and ``score``, as :meth:`~interp.localize.eap.EdgeAttribution.table` gives), largest on top;
    blue where the edge raises the metric, red where it lowers it (the signs of the RdBu heatmaps).

    Example:
        >>> import pandas as pd
        >>> fig = top_edges(pd.DataFrame({"edge": ["a", "b", "c"], "score": [0.1, -2.0, 0.5]}), k=2)
        >>> list(fig.data[0].y), list(fig.data[0].x)
        (['c', 'b'], [0.5, -2.0])
    """
    ranked = table.reindex(table["score"].abs().sort_values(ascending=False).index).head(k)[::-1]
    colors = [PALETTE[0] if v > 0 else PALETTE[1] for v in ranked["score"]]
    fig = go.Figure(go.Bar(x=list(ranked["score"]), y=list(ranked["edge"]), orientation="h", marker_color=colors))
    fig.update_layout(height=max(400, 28 * len(ranked) + 150))
    fig = styled(fig, title or f"Edge attribution: the {len(ranked)} largest edges", "estimated change of the metric",
                 "")
    fig.update_yaxes(automargin=True)
    return fig


def edge_attribution(result: EdgeAttribution, k: int = 15) -> go.Figure:
    """The ``k`` largest edges of an :class:`~interp.localize.eap.EdgeAttribution` (mean score over examples)."""
    kind = "EAP" if result.settings.get("ig_steps", 1) == 1 else f"EAP-IG ({result.settings['ig_steps']} steps)"
    metric = answer_label(result.settings) if "answer_text" in result.settings else result.metric
    fig = top_edges(result.table(), k, f"{kind}: the {min(k, len(result.table()))} largest edges, mean over "
                    f"{len(result.ids)} prompts ({metric})")
    return fig.update_xaxes(title=f"estimated change of {metric}")


def path_patching(result: PathPatchResult) -> go.Figure:
    """Path patching: each sender's mean effect on the metric through the result's receivers, as bars."""
    table = result.table()
    receivers = result.receivers
    if isinstance(receivers, str):
        through = "the logits (direct path)"
    else:
        through = ", ".join(f"{kind} {layer}.{head}" for layer, head, kind in receivers)
    metric = answer_label(result.settings) if "answer_text" in result.settings else result.metric
    fig = go.Figure(go.Bar(x=table["sender"], y=table["effect"], marker_color=PALETTE[0]))
    return styled(fig, f"Path patching through {through}", "sender", f"mean change of {metric}")


def estimate_vs_exact(labels: Sequence[str], estimate: Sequence[float], exact: Sequence[float],
                      title: str = "Edge attribution against exact path patching",
                      names: tuple[str, str] = ("EAP estimate", "path patching (exact)"),
                      y: str = "change of the metric") -> go.Figure:
    """Grouped bars: an estimate and the exact value side by side for each labelled item (e.g. each edge).

    Example:
        >>> fig = estimate_vs_exact(["head 9.1 -> logits", "mlp 3 -> q 9.1"], [0.8, -0.1], [0.7, -0.2])
        >>> [trace.name for trace in fig.data], fig.layout.barmode
        (['EAP estimate', 'path patching (exact)'], 'group')
    """
    fig = go.Figure([go.Bar(x=list(labels), y=[float(v) for v in estimate], name=names[0], marker_color=PALETTE[0]),
                     go.Bar(x=list(labels), y=[float(v) for v in exact], name=names[1], marker_color=PALETTE[1])])
    fig.update_layout(barmode="group")
    fig = styled(fig, title, "", y)
    fig.update_xaxes(tickangle=-40, automargin=True)
    return fig


DRAWERS[EdgeAttribution] = edge_attribution
DRAWERS[PathPatchResult] = path_patching


def circuit_confirmation(result: Circuit) -> go.Figure:
    """EAP's top edges of a :class:`~interp.localize.circuit.Circuit`, its estimate beside the exact
    path-patching effect, in EAP's order."""
    table = result.confirmed
    what = answer_label({"answer_text": result.answer_text, "wrong_text": result.wrong_text})
    agree = int(table["agree"].sum())
    return estimate_vs_exact(table["edge"], table["eap"], table["path_patching"],
                             title=f"The top {len(table)} EAP edges against exact path patching ({agree} of "
                             f"{len(table)} agree in sign)", y=f"change of {what}")


def circuit_attention(result: Circuit) -> go.Figure:
    """Where the movers look: each mover head's attention from the last token over the first clean
    prompt's tokens (positions labelled by their tokens, :func:`token_labels`)."""
    table = result.attention
    labels = token_labels(result.tokens)
    heads = list(dict.fromkeys(table["head"]))
    grid = np.array([table.loc[table["head"] == h, "weight"].to_numpy() for h in heads]).reshape(len(heads), -1)
    fig = heatmap(grid, labels[: grid.shape[1]], heads, f"Attention of the top heads from the last token "
                  f"({labels[-1] if labels else ''})", "attended token", "", colorbar="attention")
    fig.update_xaxes(tickangle=-40, automargin=True, type="category")
    return fig.update_yaxes(type="category", automargin=True)


def circuit_figures(result: Circuit, k: int = 15) -> dict[str, go.Figure]:
    """Every figure of a :class:`~interp.localize.circuit.Circuit` by name: ``dla_heads``, ``edges``,
    ``confirmed`` and, when there are movers, ``attention``."""
    what = answer_label({"answer_text": result.answer_text, "wrong_text": result.wrong_text})
    figures = {"dla_heads": logit_attribution(result.dla),
               "edges": top_edges(result.edges, k, f"EAP: the {min(k, len(result.edges))} largest of "
                                  f"{len(result.edges)} edges ({what})").update_xaxes(
                                      title=f"estimated change of {what}"),
               "confirmed": circuit_confirmation(result)}
    if len(result.attention):
        figures["attention"] = circuit_attention(result)
    return figures


DRAWERS[Circuit] = circuit_confirmation
