"""Stage (f): early exit through the logit lens and the tuned lens."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from interp.errors import InterpError
from interp.figures import draw
from interp.localize.lens import EarlyExitCurves
from interp.localize.tuned_lens import tuned_early_exit, tuned_lens_cached
from interp.models import cache_dir
from interp.quant import protocol as pr
from interp.report.context import ReportContext, Stage, StageOutput
from interp.report.reproduction import EARLY_EXIT_SHARE, Measurement
from interp.report.stages.common import (
    N_BOOT,
    d_large_split,
    patched_spec,
    quantized_weights,
    record_claims,
    short_spec,
)
from interp.runtime.swap import swapped


def lens_measurement(curves: Any, n_layers: int, vocab: int, seed: int, lens: str) -> tuple[Measurement, dict]:
    """The early-exit claim's measurement under one lens: split share over the informative layers (and what the
    report records of it). ``curves`` is :func:`~interp.localize.lens.early_exit_curves`' result with models
    ``reference`` and ``quantized`` and the set ``D_large``; notebook 05 judges it the report's way with it."""

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
    split = d_large_split(ctx)
    spec = patched_spec(ctx)
    sets = {"D_large": split.large, "D_ctrl": split.ctrl}
    bs = ctx.settings.batch_size
    # one copy of the weights: "quantized" is the reference carrying the quantized block weights
    weights = quantized_weights(ctx, spec)
    shards = ctx.batched("early exit")
    ref = shards.early_exit({"reference": ctx.model}, sets, at="resid_post", stage="early_exit")
    with swapped(ctx.model, weights, stash=ctx.stash):
        quant = shards.early_exit({"quantized": ctx.model}, sets, at="resid_post", stage="early_exit")
    logit = EarlyExitCurves(results={**ref.results, **quant.results}, models=["reference", "quantized"],
                            sets=list(sets))
    ctx.main_only()  # the tuned lens (its fit and its curves) is not split into batches: rank 0's
    n_layers = ctx.model.info.n_layers
    vocab = int(ctx.model.cfg.d_vocab)
    seed = ctx.settings.seed
    m_logit, info_logit = lens_measurement(logit, n_layers, vocab, seed, "logit")
    table = logit.table().add_prefix("logit lens: ")
    figs = {"early_exit_logit": draw(logit)}
    tables: dict[str, pd.DataFrame] = {}
    try:
        lens = tuned_lens_cached(ctx.model, ctx.calibration, cache_dir() / "tuned_lens", batch_size=bs,
                                 progress=ctx.progress)
    except InterpError as exc:  # too few calibration tokens for a d x d fit (e.g. --quick)
        m_tuned, info_tuned = Measurement(untestable=f"no tuned lens: {exc}"), dict[str, Any]()
    else:
        results = {f"reference / {s}": tuned_early_exit(ctx.model, lens, ex, batch_size=bs) for s, ex in sets.items()}
        with swapped(ctx.model, weights, stash=ctx.stash):
            results.update({f"quantized / {s}": tuned_early_exit(ctx.model, lens, ex, batch_size=bs)
                            for s, ex in sets.items()})
        tuned = EarlyExitCurves(results=results, models=["reference", "quantized"], sets=list(sets))
        m_tuned, info_tuned = lens_measurement(tuned, n_layers, vocab, seed, "tuned")
        table = table.join(tuned.table().add_prefix("tuned lens: "))
        figs["early_exit_tuned"] = draw(tuned)
        tables["tuned_lens_fit"] = pd.DataFrame({"layer": lens.layers, "r2": lens.settings["r2_by_layer"]})
    table = table.reset_index()
    for name, fig in figs.items():
        fig.add_hline(y=math.log(vocab), line_dash="dot", annotation_text="uniform (log |V|)")
        fig.update_layout(title=("Logit lens" if "logit" in name else "Tuned lens")
                          + f": NLL by layer, reference vs {short_spec(spec)}")
    out = StageOutput(tables={"nll_by_layer": table, **tables}, figures=figs)
    out.numbers = {"n_layers": n_layers, "spec": spec, "log_vocab": math.log(vocab), "logit": info_logit,
                   "tuned": info_tuned}
    record_claims(out, {"early_exit_logit": m_logit, "early_exit_tuned": m_tuned})
    out.notes.append(
        "The split is searched only among layers where the reference's lens beats a uniform guess on D_large "
        "(NLL below log|V|): elsewhere the lens is uninformative and a gap means nothing. The tuned lens fits one "
        "affine map per layer to the final normalised hidden state on the calibration split (ridge least squares) "
        "and reads the quantized model with the reference's maps.")
    return out


STAGE = Stage("early_exit", "(f) Early exit (logit lens and tuned lens)",
              "Mean NLL when decoding each layer's block output, for the reference and the quantized model on D_large "
              "and D_ctrl: with the model's own head (logit lens) and through an affine translator per layer fitted "
              "on the calibration split (tuned lens).", stage_early_exit)
