"""Report stages (f)-(h): early exit (logit and tuned lens), layer restoration and cross-model patching."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from interp.errors import InterpError
from interp.report import ReportContext, Stage, StageOutput
from interp.report_quant_stages import N_BOOT, _claims, _patch_spec, _quantized, _split
from interp.reproduction import EARLY_EXIT_SHARE, Measurement


def _lens_measurement(curves: Any, n_layers: int, vocab: int, seed: int, lens: str) -> tuple[Measurement, dict]:
    """The early-exit claim's measurement under one lens: split share over the informative layers."""
    from interp.quant import protocol as pr

    ref = curves.results["reference / D_large"]
    quant = curves.results["quantized / D_large"]
    ref_nll, q_nll = ref.nll.double().numpy(), quant.nll.double().numpy()
    usable = ref_nll.mean(axis=1) < math.log(vocab)
    info: dict[str, Any] = {"usable_layers": [int(layer) for layer, u in zip(ref.layers, usable, strict=True) if u]}
    if not usable.any():
        return Measurement(untestable=f"the {lens} lens is worse than uniform (NLL > log|V| = {math.log(vocab):.2f}) "
                                      "at every layer"), info
    first = int(ref.layers[int(np.argmax(usable))])
    info["first_usable_layer"] = first
    if first >= n_layers * (1 - EARLY_EXIT_SHARE):
        why = (f"the {lens} lens beats uniform only from layer {first} of {n_layers}, inside the last quarter: any "
               "split found there would agree with the paper by construction")
        return Measurement(untestable=why), info
    est, split_layer = pr.split_share(ref_nll, q_nll, ref.layers, n_layers, usable, n_boot=N_BOOT, seed=seed)
    info.update({"split_layer": split_layer, "share": est.value, "low": est.low, "high": est.high})
    return Measurement({"share_after_split": est},
                       f"split at layer {split_layer}: last {n_layers - split_layer} of {n_layers} layers, share "
                       f"{est.text(percent=True)}; lens informative from layer {first}"), info


def stage_early_exit(ctx: ReportContext) -> StageOutput:
    from interp.lens import EarlyExitCurves, early_exit_curves
    from interp.models import cache_dir
    from interp.tuned_lens import tuned_early_exit, tuned_lens_cached

    split = _split(ctx)
    spec = _patch_spec(ctx)
    models = {"reference": ctx.model, "quantized": _quantized(ctx, spec)}
    sets = {"D_large": split.large, "D_ctrl": split.ctrl}
    bs = ctx.settings.batch_size
    logit = early_exit_curves(models, sets, at="resid_post", batch_size=bs, progress=ctx.progress)
    n_layers = ctx.model.info.n_layers
    vocab = int(ctx.model.cfg.d_vocab)
    seed = ctx.settings.seed
    m_logit, info_logit = _lens_measurement(logit, n_layers, vocab, seed, "logit")
    table = logit.table().add_prefix("logit lens: ")
    figs = {"early_exit_logit": logit.figure()}
    tables: dict[str, pd.DataFrame] = {}
    try:
        lens = tuned_lens_cached(ctx.model, ctx.calibration, cache_dir() / "tuned_lens", batch_size=bs,
                                 progress=ctx.progress)
    except InterpError as exc:  # too few calibration tokens for a d x d fit (e.g. --quick)
        m_tuned, info_tuned = Measurement(untestable=f"no tuned lens: {exc}"), dict[str, Any]()
    else:
        tuned = EarlyExitCurves(results={f"{m} / {s}": tuned_early_exit(model, lens, ex, batch_size=bs)
                                         for m, model in models.items() for s, ex in sets.items()},
                                models=list(models), sets=list(sets))
        m_tuned, info_tuned = _lens_measurement(tuned, n_layers, vocab, seed, "tuned")
        table = table.join(tuned.table().add_prefix("tuned lens: "))
        figs["early_exit_tuned"] = tuned.figure()
        tables["tuned_lens_fit"] = pd.DataFrame({"layer": lens.layers, "r2": lens.settings["r2_by_layer"]})
    table = table.reset_index()
    for name, fig in figs.items():
        fig.add_hline(y=math.log(vocab), line_dash="dot", annotation_text="uniform (log |V|)")
        fig.update_layout(title=("Logit lens" if "logit" in name else "Tuned lens (affine translator per layer)")
                          + f": NLL by layer, reference vs {spec}")
    out = StageOutput(tables={"nll_by_layer": table, **tables}, figures=figs)
    out.numbers = {"n_layers": n_layers, "spec": spec, "log_vocab": math.log(vocab), "logit": info_logit,
                   "tuned": info_tuned}
    _claims(out, {"early_exit_logit": m_logit, "early_exit_tuned": m_tuned})
    out.notes.append(
        "The split is searched only among layers where the reference's lens beats a uniform guess on D_large "
        "(NLL below log|V|): elsewhere the lens is uninformative and a gap means nothing. The tuned lens fits one "
        "affine map per layer to the final normalised hidden state on the calibration split (ridge least squares) "
        "and reads the quantized model with the reference's maps.")
    return out


def stage_restoration(ctx: ReportContext) -> StageOutput:
    from interp.lens import restoration_sweep
    from interp.quant import protocol as pr

    split = _split(ctx)
    spec = _patch_spec(ctx)
    n_layers = ctx.model.info.n_layers
    k_paper = max(1, round(n_layers * 7 / 40))  # the paper restored 7 of 40 layers
    ks = sorted({0, 1, 2, 4, k_paper, n_layers // 4, n_layers // 2, n_layers})
    result = restoration_sweep(_quantized(ctx, spec), ctx.model, split.large, ks=ks,
                               batch_size=ctx.settings.batch_size, progress=ctx.progress)
    nll = result.nll.double().numpy()
    boot = pr.recovery_boot(nll[ks.index(0)], result.reference_nll.double().numpy(),
                            {f"k={k}": nll[i] for i, k in enumerate(ks)}, n_boot=N_BOOT, seed=ctx.settings.seed)
    table = result.table()
    table["recovery (NLL scale)"] = [boot.point[f"k={k}"] for k in ks]
    table["NLL-scale low"] = [boot.estimate(f"k={k}").low for k in ks]
    table["NLL-scale high"] = [boot.estimate(f"k={k}").high for k in ks]
    table = table.rename(columns={"recovery": "recovery (perplexity scale)"})
    est, est_ppl = boot.estimate(f"k={k_paper}"), boot.estimate(f"k={k_paper}", "ppl")
    q, ref = float(table.loc[table["k"] == 0, "perplexity"].iloc[0]), float(table["reference"].iloc[0])
    ppl_k = float(table.loc[table["k"] == k_paper, "perplexity"].iloc[0])
    out = StageOutput(tables={"restoration": table}, figures={"restoration": result.figure()})
    out.numbers = {"quantized_ppl": q, "reference_ppl": ref, "k_paper": k_paper, "ppl_top_k_paper": ppl_k,
                   "recovery_nll": est.value, "recovery_nll_low": est.low, "recovery_nll_high": est.high,
                   "recovery_ppl": est_ppl.value, "spec": spec}
    _claims(out, {"restoration": Measurement(
        {"recovery": est}, f"top {k_paper} of {n_layers}: {est.text(percent=True)} on NLL (perplexity {q:.2f} -> "
                           f"{ppl_k:.2f}, ref {ref:.2f}: {est_ppl.text(percent=True)}); {spec}")})
    return out


STRONG, WEAK = ("down", "gate"), ("up", "attn_out")


def stage_patching(ctx: ReportContext) -> StageOutput:
    from interp.patching import gate_input_vs_gate_weights, layer_sweep, patching_table
    from interp.quant import protocol as pr

    split = _split(ctx)
    spec = _patch_spec(ctx)
    quantized = _quantized(ctx, spec)
    bs, seed = ctx.settings.batch_size, ctx.settings.seed
    table_result = patching_table(ctx.model, quantized, split.large, batch_size=bs, progress=ctx.progress)
    gate = gate_input_vs_gate_weights(ctx.model, quantized, split.large, batch_size=bs, progress=ctx.progress)
    # one layer at a time over the upper half, where the paper's table patches (`interp patch
    # --experiments sweep --layers all` covers every layer)
    sweep = layer_sweep(ctx.model, quantized, split.large, layers="upper_half", batch_size=bs,
                        progress=ctx.progress)
    values = table_result.values.double().numpy()
    patched = {p.component: values[i] for i, p in enumerate(table_result.patches)}
    boot = pr.recovery_boot(table_result.target.double().numpy(), table_result.source.double().numpy(), patched,
                            n_boot=N_BOOT, seed=seed)
    table = table_result.table().rename(columns={"recovery": "recovery (perplexity scale)"})
    table["recovery (NLL scale)"] = [boot.point[c] for c in table["component"]]
    table["NLL-scale low"] = [boot.estimate(c).low for c in table["component"]]
    table["NLL-scale high"] = [boot.estimate(c).high for c in table["component"]]
    out = StageOutput(tables={"patching_upper_half": table, "gate_input_vs_weights": gate.table(),
                              "layer_sweep": sweep.table()},
                      figures={"patching_upper_half": table_result.figure(), "gate_input": gate.figure(),
                               "layer_sweep": sweep.figure()})
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
    diff = pr.paired_mean_difference(gate.restored_nll.double().numpy(), gate_in, n_boot=N_BOOT, seed=seed)
    g = gate.table().set_index("setting")["perplexity"]
    claims["gate_input"] = Measurement({"diff": diff}, f"{float(g.iloc[2]):.2f} vs {float(g.iloc[3]):.2f} perplexity; "
                                                       f"NLL difference {diff.text(3)}")
    out.numbers = {"recovery_nll": boot.point, "recovery_ppl": boot.point_ppl, "spec": spec,
                   "quantized_ppl": float(table_result.target_value), "reference_ppl": float(table_result.source_value),
                   "d_large": len(split.large)}
    _claims(out, claims)
    out.notes.append(f"Reference activations patched into {spec} on D_large ({len(split.large)} examples, chosen by "
                     f"{spec}'s own error). Recovery is reported on the NLL scale (primary; the perplexity scale "
                     "explodes when a patch makes the model worse) with paired bootstrap intervals over D_large.")
    return out


LENS_STAGES: list[Stage] = [
    Stage("early_exit", "(f) Early exit (logit lens and tuned lens)",
          "Mean NLL when decoding each layer's block output, for the reference and the quantized model on D_large "
          "and D_ctrl: with the model's own head (logit lens) and through an affine translator per layer fitted "
          "on the calibration split (tuned lens).", stage_early_exit),
    Stage("restoration", "(g) Layer restoration",
          "D_large loss of the quantized model with the reference weights put back in its top-k layers.",
          stage_restoration),
    Stage("patching", "(h) Cross-model activation patching",
          "The quantized model runs on D_large while one component in the upper half of the layers is "
          "overwritten with the reference model's activation. Recovery = (L_quant - L_patched) / "
          "(L_quant - L_ref), on NLL (primary) and perplexity.", stage_patching),
]
