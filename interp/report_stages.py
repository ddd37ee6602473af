"""The stages of ``interp report`` and its reproduction table.

Each stage is a function ``ReportContext -> StageOutput`` that calls the public API and the
figure builders; nothing here computes an analysis itself.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from interp import figures
from interp.report import ReportContext, ReportSettings, Stage, StageOutput

# ---------------------------------------------------------------------------------------
# (a) probes


def stage_probes(ctx: ReportContext) -> StageOutput:
    from interp.probes import probe

    components = ["resid_mid", "resid_post", "h", "gate"]
    result = probe(ctx.model, ctx.examples, components, ["norm", "kurtosis"], batch_size=ctx.settings.batch_size,
                   progress=ctx.progress)
    summary = result.summary().reset_index()
    out = StageOutput(tables={"by_layer": summary})
    out.figures["norms"] = figures.probe_norms(result, components, "norm")
    kurt = figures.probe_norms(result, ["resid_mid", "h"], "kurtosis")
    kurt.update_layout(title="kurtosis over features by layer (band = 10-90% of examples; Gaussian = 3)")
    out.figures["kurtosis"] = kurt
    last = summary.iloc[-1]
    out.numbers = {
        "layers": int(len(summary)),
        "resid_mid_norm_by_layer": summary["resid_mid/norm"].round(4).tolist(),
        "h_norm_by_layer": summary["h/norm"].round(4).tolist(),
        "gate_norm_by_layer": summary["gate/norm"].round(4).tolist(),
        "last_layer_resid_mid_norm": float(last["resid_mid/norm"]),
        "last_layer_h_norm": float(last["h/norm"]),
    }
    out.notes.append(
        "Residual norms grow with depth while the MLP input h = RMSNorm(r) * gamma stays small: the norm "
        "removes the residual's scale, so ||h|| reflects how r's energy spreads over dimensions."
    )
    return out


# ---------------------------------------------------------------------------------------
# (b) attention


def stage_attention(ctx: ReportContext) -> StageOutput:
    from interp.attention.analysis import analyze, capture_patterns

    s = ctx.settings
    subset = ctx.examples.subset(range(min(s.attention_n, len(ctx.examples))))
    result = analyze(ctx.model, subset, saobp_beta=s.saobp_beta, batch_size=s.batch_size, progress=ctx.progress)
    by_layer = result.by_layer()
    out = StageOutput(tables={"by_layer": by_layer.round(5)})
    for metric in ("entropy", "gtd", "sink_share"):
        out.figures[f"{metric}_by_layer"] = result.figure(metric)
    out.figures["entropy_heatmap_reference"] = result.heatmap("entropy", "reference")
    out.figures["entropy_heatmap_saobp"] = result.heatmap("entropy", "saobp")
    n_layers = ctx.model.info.n_layers
    deep = list(range(n_layers - max(1, n_layers // 3), n_layers))
    length = min(24, s.seq_len)
    labels = ctx.token_labels(0, length)
    tokens = subset.tokens[0, :length]
    ref_maps = capture_patterns(ctx.model, tokens, [n_layers - 1])
    sao_maps = capture_patterns(ctx.model, tokens, [n_layers - 1], saobp_beta=s.saobp_beta)
    pattern = ref_maps[n_layers - 1]
    head = int(pattern[:, 1:, 0].mean(1).argmax())
    out.figures["map_last_layer_reference"] = figures.attention_map(
        pattern[head], labels, f"layer {n_layers - 1}, head {head} (most sink-heavy), reference")
    out.figures["map_last_layer_saobp"] = figures.attention_map(
        sao_maps[n_layers - 1][head], labels, f"layer {n_layers - 1}, head {head}, SAOBP beta={s.saobp_beta}")

    def deep_mean(metric: str, variant: str) -> float:
        rows = by_layer[(by_layer["variant"] == variant) & by_layer["layer"].isin(deep)]
        return float(rows[f"{metric}_mean"].mean())

    out.numbers = {
        "deep_layers": deep,
        "deep_entropy_reference": deep_mean("entropy", "reference"),
        "deep_entropy_saobp": deep_mean("entropy", "saobp"),
        "deep_gtd_reference": deep_mean("gtd", "reference"),
        "deep_gtd_saobp": deep_mean("gtd", "saobp"),
        "deep_sink_reference": deep_mean("sink_share", "reference"),
        "deep_sink_saobp": deep_mean("sink_share", "saobp"),
        "delta_nll_saobp": float(result.delta_nll.mean()) if result.delta_nll is not None else None,
        "saobp_beta": s.saobp_beta,
        "n_examples": len(subset),
    }
    out.notes.append(
        f"Inference-time SAOBP (exact, beta={s.saobp_beta}) on every layer of the pretrained model, measured on "
        f"{len(subset)} examples. GTD and SAOBP follow this project's derivation from the SAOBP paper's "
        "description (docs/attention.md)."
    )
    return out


STAGES: list[Stage] = [
    Stage("probes", "(a) Residual, h and gate norms per layer",
          "Per-layer statistics captured by streaming probes: mean L2 norm of the residual after attention "
          "(resid_mid) and after the block (resid_post), of the MLP input h, and of the gate activation.",
          stage_probes),
    Stage("attention", "(b) Attention entropy, GTD and sink share, with and without SAOBP",
          "Attention entropy (nats), Global Token Dependency (total variation between direct and two-hop "
          "attention) and the mass on the first token, per layer and head, for the pretrained model and with "
          "one step of SAOBP belief propagation applied at inference.",
          stage_attention),
]


def _all_stages() -> list[Stage]:
    from interp.report_quant_stages import QUANT_STAGES

    return STAGES + list(QUANT_STAGES)


# ---------------------------------------------------------------------------------------
# Reproduction table


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def reproduction_table(outputs: dict[str, StageOutput], settings: ReportSettings) -> pd.DataFrame:
    rows: list[dict[str, str]] = []

    def add(paper: str, finding: str, paper_value: str, measured: str, holds: str) -> None:
        rows.append({"paper": paper, "finding": finding, "paper value": paper_value, "measured here": measured,
                     "holds here": holds})

    att = outputs.get("attention")
    if att is not None:
        n = att.numbers
        add("SAOBP (arXiv 2509.07324)", "SAOBP raises attention entropy in deep layers (prevents entropy collapse)",
            "qualitative", f"{_fmt(n['deep_entropy_reference'])} -> {_fmt(n['deep_entropy_saobp'])} nats "
            f"(layers {n['deep_layers'][0]}-{n['deep_layers'][-1]})",
            "yes" if n["deep_entropy_saobp"] > n["deep_entropy_reference"] else "no")
        add("SAOBP (arXiv 2509.07324)", "SAOBP raises global token dependency (GTD) in deep layers",
            "qualitative", f"{_fmt(n['deep_gtd_reference'])} -> {_fmt(n['deep_gtd_saobp'])}",
            "yes" if n["deep_gtd_saobp"] > n["deep_gtd_reference"] else "no")
        add("SAOBP (arXiv 2509.07324)", "Cost of SAOBP at inference on a model not trained with it (NLL change)",
            "not reported", f"{_fmt(n['delta_nll_saobp'], 4)} nats", "n/a")
    from interp.report_quant_stages import quant_reproduction_rows

    for row in quant_reproduction_rows(outputs):
        add(*row)
    return pd.DataFrame(rows, columns=["paper", "finding", "paper value", "measured here", "holds here"])
