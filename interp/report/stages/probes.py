"""Stage (a): residual, h and gate norms per layer, from streaming probes."""

from __future__ import annotations

from interp.figures.probes import probe_norms
from interp.report.context import ReportContext, Stage, StageOutput


def stage_probes(ctx: ReportContext) -> StageOutput:
    components = ["resid_mid", "resid_post", "h", "gate"]
    result = ctx.batched("probes").probe(ctx.model, ctx.examples, stage="probes", components=components,
                                         reducers=["norm", "kurtosis"])
    ctx.main_only()
    summary = result.summary().reset_index()
    out = StageOutput(tables={"by_layer": summary})
    out.figures["norms"] = probe_norms(result, components, "norm")
    kurt = probe_norms(result, ["resid_mid", "h"], "kurtosis")
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


STAGE = Stage("probes", "(a) Residual, h and gate norms per layer",
              "Per-layer statistics captured by streaming probes: mean L2 norm of the residual after attention "
              "(resid_mid) and after the block (resid_post), of the MLP input h, and of the gate activation.",
              stage_probes)
