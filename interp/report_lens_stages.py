"""Report stages (f)-(h): early exit, layer restoration and cross-model patching."""

from __future__ import annotations

from interp.report import ReportContext, Stage, StageOutput
from interp.report_quant_stages import _patch_spec, _quantized, _split

PAPER = "Quantization errors (arXiv 2506.12044)"


def stage_early_exit(ctx: ReportContext) -> StageOutput:
    from interp.lens import early_exit_curves

    split = _split(ctx)
    spec = _patch_spec(ctx)
    curves = early_exit_curves({"reference": ctx.model, "quantized": _quantized(ctx, spec)},
                               {"D_large": split.large, "D_ctrl": split.ctrl}, at="resid_post",
                               batch_size=ctx.settings.batch_size, progress=ctx.progress)
    table = curves.table().reset_index()
    n_layers = ctx.model.info.n_layers
    split_layer = curves.split_layer("D_large")
    out = StageOutput(tables={"nll_by_layer": table}, figures={"early_exit": curves.figure()})
    last = n_layers - split_layer
    out.numbers = {
        "split_layer": split_layer, "layers_after_split": last, "n_layers": n_layers, "spec": spec,
        "reproduction_rows": [(PAPER, "Early exit: the quantized curve leaves the reference only in the last layers",
                               "last ~7 of 40 layers (17%)",
                               f"last {last} of {n_layers} layers ({last / n_layers:.0%}), {spec}",
                               "yes" if last / n_layers <= 0.35 else "no")],
    }
    return out


def stage_restoration(ctx: ReportContext) -> StageOutput:
    from interp.lens import restoration_sweep

    split = _split(ctx)
    spec = _patch_spec(ctx)
    n_layers = ctx.model.info.n_layers
    k_paper = max(1, round(n_layers * 7 / 40))  # the paper restored 7 of 40 layers
    ks = sorted({0, 1, 2, 4, k_paper, n_layers // 4, n_layers // 2, n_layers})
    result = restoration_sweep(_quantized(ctx, spec), ctx.model, split.large, ks=ks,
                               batch_size=ctx.settings.batch_size, progress=ctx.progress)
    table = result.table()
    out = StageOutput(tables={"restoration": table}, figures={"restoration": result.figure()})
    result_k = table[table["k"] == k_paper].iloc[0]
    q = float(table.loc[table["k"] == 0, "perplexity"].iloc[0])
    ref = float(table["reference"].iloc[0])
    out.numbers = {
        "quantized_ppl": q, "reference_ppl": ref, "k_paper": k_paper, "ppl_top_k_paper": float(result_k["perplexity"]),
        "recovery_top_k_paper": float(result_k["recovery"]), "spec": spec,
        "reproduction_rows": [(PAPER, "Restoring the top layers (7 of 40) recovers little of D_large perplexity",
                               "8.67 -> 8.05 (ref 5.60): 20% recovered",
                               f"top {k_paper} of {n_layers}: {q:.2f} -> {result_k['perplexity']:.2f} (ref {ref:.2f}): "
                               f"{result_k['recovery']:.0%} recovered",
                               "yes" if result_k["recovery"] < 0.5 else "no")],
    }
    return out


def stage_patching(ctx: ReportContext) -> StageOutput:
    from interp.patching import gate_input_vs_gate_weights, layer_sweep, patching_table

    split = _split(ctx)
    spec = _patch_spec(ctx)
    quantized = _quantized(ctx, spec)
    bs = ctx.settings.batch_size
    table_result = patching_table(ctx.model, quantized, split.large, batch_size=bs, progress=ctx.progress)
    gate = gate_input_vs_gate_weights(ctx.model, quantized, split.large, batch_size=bs, progress=ctx.progress)
    # one layer at a time over the upper half, where the paper's table patches (the lower half
    # adds 75 patches of ~23 layers each and doubles the stage's time; `interp patch
    # --experiments sweep --layers all` covers every layer)
    sweep = layer_sweep(ctx.model, quantized, split.large, layers="upper_half", batch_size=bs,
                        progress=ctx.progress)
    table = table_result.table()
    out = StageOutput(tables={"patching_upper_half": table, "gate_input_vs_weights": gate.table(),
                              "layer_sweep": sweep.table()},
                      figures={"patching_upper_half": table_result.figure(), "gate_input": gate.figure(),
                               "layer_sweep": sweep.figure()})
    recovery = {row.component: float(row.recovery) for row in table.itertuples()}
    paper = {"down": 0.93, "gate": 0.84, "up": 0.14, "attn_out": 0.28}
    rows = []
    for component, value in paper.items():
        if component in recovery:
            rows.append((PAPER, f"Patching {component} (upper half of layers) into the quantized model recovers "
                         "D_large perplexity", f"{value:.0%} recovery", f"{recovery[component]:.0%} ({spec})",
                         _order_verdict(recovery, component)))
    g = gate.table().set_index("setting")["perplexity"]
    gate_in, gate_w = float(g.iloc[2]), float(g.iloc[3])
    rows.append((PAPER, "Gate input patched beats restoring the gate weights", "6.53 vs 10.45 perplexity",
                 f"{gate_in:.2f} vs {gate_w:.2f}", "yes" if gate_in < gate_w else "no"))
    out.numbers = {"recovery": recovery, "gate_input_ppl": gate_in, "gate_weights_ppl": gate_w, "spec": spec,
                   "quantized_ppl": float(table_result.target_value), "reference_ppl": float(table_result.source_value),
                   "reproduction_rows": rows}
    out.notes.append(f"Reference activations patched into {spec} on D_large ({len(split.large)} examples).")
    return out


def _order_verdict(recovery: dict[str, float], component: str) -> str:
    """The paper's ordering: down and gate recover most, up and attention least."""
    strong, weak = ("down", "gate"), ("up", "attn_out")
    if not all(c in recovery for c in strong + weak):
        return "n/a"
    if component in strong:
        return "yes" if recovery[component] > max(recovery[c] for c in weak) else "no"
    return "yes" if recovery[component] < min(recovery[c] for c in strong) else "no"


LENS_STAGES: list[Stage] = [
    Stage("early_exit", "(f) Early exit (logit lens)",
          "Mean NLL when decoding unembed(final_norm(resid_post)) at each layer, for the reference and the "
          "quantized model on D_large and D_ctrl.", stage_early_exit),
    Stage("restoration", "(g) Layer restoration",
          "D_large perplexity of the quantized model with the reference weights put back in its top-k layers.",
          stage_restoration),
    Stage("patching", "(h) Cross-model activation patching",
          "The quantized model runs on D_large while one component in the upper half of the layers is "
          "overwritten with the reference model's activation. Recovery = (ppl_quant - ppl_patched) / "
          "(ppl_quant - ppl_ref).", stage_patching),
]
