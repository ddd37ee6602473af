"""Stage (h): cross-model activation patching."""

from __future__ import annotations

from typing import Any

from interp.figures import draw
from interp.figures.localize import recovery_intervals
from interp.localize.patching import gate_input_vs_gate_weights, layer_sweep, patching_table
from interp.quant import protocol as pr
from interp.report.context import ReportContext, Stage, StageOutput
from interp.report.reproduction import Measurement
from interp.report.stages.common import (
    N_BOOT,
    d_large_split,
    patched_spec,
    quantized_weights,
    record_claims,
    short_spec,
)

STRONG, WEAK = ("down", "gate"), ("up", "attn_out")  # the paper's strong and weak components


def patching_claims(table_result: Any, gate: Any, n_boot: int = N_BOOT, seed: int = 0
                    ) -> tuple[dict[str, Measurement], Any]:
    """The patching claims' measurements (each component's NLL-scale recovery and its margin to the other kind,
    and the gate input against the gate weights) from :func:`~interp.localize.patching.patching_table`'s and
    :func:`~interp.localize.patching.gate_input_vs_gate_weights`' results, as the report and notebook 05 judge
    them (:func:`interp.report.compare.comparison`); and the paired bootstrap of the recoveries."""
    values = table_result.values.double().numpy()
    patched = {p.component: values[i] for i, p in enumerate(table_result.patches)}
    boot = pr.recovery_boot(table_result.target.double().numpy(), table_result.source.double().numpy(), patched,
                            n_boot=n_boot, seed=seed)
    claims: dict[str, Measurement] = {}
    have = all(c in patched for c in STRONG + WEAK)
    for component in STRONG + WEAK:
        if not have:
            claims[f"patch_{component}"] = Measurement(untestable="this model lacks one of down, gate, up, attn_out")
            continue
        strong = component in STRONG
        others = WEAK if strong else STRONG
        est, margin = boot.estimate(component), boot.margin(component, others, stronger=strong)
        claims[f"patch_{component}"] = Measurement(
            {"recovery": est, "margin": margin},
            f"{est.text(percent=True)} on NLL ({boot.estimate(component, 'ppl').text(percent=True)} on perplexity); "
            f"margin to {'/'.join(others)} {margin.text(percent=True)}")
    gate_in = gate.patched.values[0].double().numpy()
    diff = pr.paired_mean_difference(gate.restored_nll.double().numpy(), gate_in, n_boot=n_boot, seed=seed)
    g = gate.table().set_index("setting")["perplexity"]
    claims["gate_input"] = Measurement({"diff": diff}, f"{float(g.iloc[2]):.2f} vs {float(g.iloc[3]):.2f} perplexity; "
                                                       f"NLL difference {diff.text(3)}")
    return claims, boot


def stage_patching(ctx: ReportContext) -> StageOutput:
    split = d_large_split(ctx)
    spec = patched_spec(ctx)
    quantized = quantized_weights(ctx, spec)  # one copy: swapped into the reference per batch
    bs, seed = ctx.settings.batch_size, ctx.settings.seed
    engine = {"batch_size": bs, "progress": False, "stash": ctx.stash}
    shards = ctx.batched("patching")
    table_result = shards.patch("patching/table", lambda sub: patching_table(ctx.model, quantized, sub, **engine),
                                ctx.model, split.large)
    gate = shards.gate_input(lambda sub: gate_input_vs_gate_weights(ctx.model, quantized, sub, **engine), ctx.model,
                             split.large, stage="patching/gate_input")
    # one layer at a time over the upper half, where the paper's table patches (`interp patch
    # --experiments sweep --layers all` covers every layer)
    sweep = shards.patch("patching/sweep", lambda sub: layer_sweep(ctx.model, quantized, sub, layers="upper_half",
                                                                   **engine), ctx.model, split.large)
    ctx.main_only()
    claims, boot = patching_claims(table_result, gate, n_boot=N_BOOT, seed=seed)
    table = table_result.table().rename(columns={"recovery": "recovery (perplexity scale)"})
    table["recovery (NLL scale)"] = [boot.point[c] for c in table["component"]]
    table["NLL-scale low"] = [boot.estimate(c).low for c in table["component"]]
    table["NLL-scale high"] = [boot.estimate(c).high for c in table["component"]]
    out = StageOutput(tables={"patching_upper_half": table, "gate_input_vs_weights": gate.table(),
                              "layer_sweep": sweep.table()},
                      figures={"patching_upper_half": recovery_intervals(
                                   [f"{n} ({span})" for n, span in zip(table["name"], table["layers"], strict=True)],
                                   table["recovery (NLL scale)"], table["NLL-scale low"], table["NLL-scale high"],
                                   secondary=table["recovery (perplexity scale)"],
                                   title=f"Patching into {short_spec(spec)}: recovery of the gap"),
                               "gate_input": draw(gate),
                               "layer_sweep": draw(sweep)})
    out.numbers = {"recovery_nll": boot.point, "recovery_ppl": boot.point_ppl, "spec": spec,
                   "quantized_ppl": float(table_result.target_value), "reference_ppl": float(table_result.source_value),
                   "d_large": len(split.large)}
    record_claims(out, claims)
    out.notes.append(f"Reference activations patched into {spec} on D_large ({len(split.large)} examples, chosen by "
                     f"{spec}'s own error). Recovery is reported on the NLL scale (primary; the perplexity scale "
                     "explodes when a patch makes the model worse) with paired bootstrap intervals over D_large.")
    return out


STAGE = Stage("patching", "(h) Cross-model activation patching",
              "The quantized model runs on D_large while one component in the upper half of the layers is "
              "overwritten with the reference model's activation. Recovery = (L_quant - L_patched) / "
              "(L_quant - L_ref), on NLL (primary) and perplexity.", stage_patching)
