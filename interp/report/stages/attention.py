"""Stage (b): attention entropy, GTD and sink share, with and without SAOBP at inference."""

from __future__ import annotations

from interp.attention.analysis import capture_patterns
from interp.figures.attention import attention_map, metric_by_layer, metric_heatmap
from interp.report.context import ReportContext, Stage, StageOutput
from interp.report.reproduction import Measurement
from interp.report.stages.common import record_claims


def stage_attention(ctx: ReportContext) -> StageOutput:
    s = ctx.settings
    subset = ctx.examples.subset(range(min(s.attention_n, len(ctx.examples))))
    result = ctx.batched("attention").attention(ctx.model, subset, s.saobp_beta, None, stage="attention")
    ctx.main_only()
    by_layer = result.by_layer()
    out = StageOutput(tables={"by_layer": by_layer.round(5)})
    for metric in ("entropy", "gtd", "sink_share"):
        out.figures[f"{metric}_by_layer"] = metric_by_layer(result, metric)
    out.figures["entropy_heatmap_reference"] = metric_heatmap(result, "entropy", "reference")
    out.figures["entropy_heatmap_saobp"] = metric_heatmap(result, "entropy", "saobp")
    n_layers = ctx.model.info.n_layers
    deep = list(range(n_layers - max(1, n_layers // 3), n_layers))
    length = min(24, s.seq_len)
    labels = ctx.token_labels(0, length)
    tokens = subset.tokens[0, :length]
    ref_maps = capture_patterns(ctx.model, tokens, [n_layers - 1])
    sao_maps = capture_patterns(ctx.model, tokens, [n_layers - 1], saobp_beta=s.saobp_beta)
    pattern = ref_maps[n_layers - 1]
    head = int(pattern[:, 1:, 0].mean(1).argmax())
    out.figures["map_last_layer_reference"] = attention_map(
        pattern[head], labels, f"layer {n_layers - 1}, head {head} (most sink-heavy), reference")
    out.figures["map_last_layer_saobp"] = attention_map(
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

    n = out.numbers
    nll_text = "n/a" if n["delta_nll_saobp"] is None else f"{n['delta_nll_saobp']:+.3f}"
    record_claims(out, {"saobp_inference": Measurement(text=(
        f"layers {deep[0]}-{deep[-1]}: entropy {n['deep_entropy_reference']:.2f} -> {n['deep_entropy_saobp']:.2f} "
        f"nats, GTD {n['deep_gtd_reference']:.2f} -> {n['deep_gtd_saobp']:.2f}, sink share "
        f"{n['deep_sink_reference']:.2f} -> {n['deep_sink_saobp']:.2f}; NLL cost {nll_text} nats (beta "
        f"{s.saobp_beta}, {len(subset)} examples)"))})
    out.notes.append(
        f"Inference-time SAOBP (exact, beta={s.saobp_beta}) on every layer of the pretrained model, measured on "
        f"{len(subset)} examples. GTD and SAOBP follow this project's derivation from the SAOBP paper's "
        "description (docs/attention.md)."
    )
    return out


STAGE = Stage("attention", "(b) Attention entropy, GTD and sink share, with and without SAOBP",
              "Attention entropy (nats), Global Token Dependency (total variation between direct and two-hop "
              "attention) and the mass on the first token, per layer and head, for the pretrained model and with "
              "one step of SAOBP belief propagation applied at inference.",
              stage_attention)
