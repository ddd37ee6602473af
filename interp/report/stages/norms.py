"""Stage (e): residual magnitude against error, and the reversal analysis."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from interp import figures, stats
from interp.quant import protocol as pr
from interp.quant.analysis import reversal
from interp.quant.protocol import estimate
from interp.report.context import ReportContext, Stage, StageOutput
from interp.report.reproduction import Measurement
from interp.report.stages.common import (
    N_BOOT,
    d_large_split,
    method_errors,
    patched_spec,
    quantized_weights,
    record_claims,
    spec_bits,
)
from interp.stats import Estimate


def _norm_probe(ctx: ReportContext) -> Any:
    if "norm_probe" not in ctx.cache:
        ctx.cache["norm_probe"] = ctx.batched("norm probe").probe(
            ctx.model, ctx.examples, stage="norms", components=["resid_mid", "resid_post"], reducers=["norm"],
            exclude_bos=True)
    return ctx.cache["norm_probe"]


def _per_method_norm_table(ctx: ReportContext, errors: pd.DataFrame) -> pd.DataFrame:
    result = _norm_probe(ctx)
    norms = result["resid_mid", "norm"].double().numpy()
    ordered = errors.reindex(ctx.examples.ids)
    groups = {bits: [s for s in errors.columns if spec_bits(s) == bits] for bits in (3, 4)}
    rows = []
    for li, layer in enumerate(result.layers):
        row: dict[str, Any] = {"layer": layer}
        for bits, specs in groups.items():
            est = pr.mean_method_correlation(norms[li], ordered, specs, n_boot=N_BOOT, seed=ctx.settings.seed)
            row.update({f"r_{bits}bit": est.value, f"low_{bits}bit": est.low, f"high_{bits}bit": est.high,
                        f"methods_{bits}bit": len(specs)})
        rows.append(row)
    return pd.DataFrame(rows)


def _kurtosis_estimate(rev: Any, seed: int) -> Estimate:
    """Mean over layers of [mean log-kurtosis(D_large) - mean log-kurtosis(D_ctrl)], bootstrap within sets."""

    per = rev.per_example
    arrays = {}
    for name in ("large", "ctrl"):
        part = per[per["set"] == name].pivot(index="layer", columns="example", values="kurtosis")
        arrays[name] = np.log(part.to_numpy(dtype=np.float64))
    a, b = arrays["large"], arrays["ctrl"]

    def diff(ia: Any, ib: Any) -> Any:
        return (a[:, ia].mean(axis=-1) - b[:, ib].mean(axis=-1)).mean(axis=0)

    ia = stats.bootstrap_indices(a.shape[1], N_BOOT, seed)
    ib = stats.bootstrap_indices(b.shape[1], N_BOOT, seed + 1)
    boot = np.array([diff(x, y) for x, y in zip(ia, ib, strict=True)])
    return estimate(float(diff(np.arange(a.shape[1]), np.arange(b.shape[1]))), boot, a.shape[1] + b.shape[1])


OUTLIER_BLOCK = 3  # adjacent layers share outlier dimensions, so layers are resampled in blocks


def _outlier_estimate(rev: Any, seed: int) -> Estimate:
    per_layer = rev.outliers.groupby("layer")["gamma_percentile"].mean().to_numpy(dtype=np.float64)
    boot = stats.block_bootstrap_means(per_layer, OUTLIER_BLOCK, N_BOOT, seed)
    return estimate(float(per_layer.mean()), boot, int(per_layer.size))


def stage_norms(ctx: ReportContext) -> StageOutput:
    errors = method_errors(ctx)
    split = d_large_split(ctx)
    seed = ctx.settings.seed
    _norm_probe(ctx)
    ctx.main_only()  # the reversal analysis (on D_large and D_ctrl) is not split into batches: rank 0's
    per_method = _per_method_norm_table(ctx, errors)
    spec = patched_spec(ctx)
    rev = reversal(ctx.model, {spec: quantized_weights(ctx, spec)}, split.large, split.ctrl,
                   batch_size=ctx.settings.batch_size, n_boot=N_BOOT, seed=seed, progress=ctx.progress,
                   stash=ctx.stash)
    out = StageOutput(tables={"norm_error_per_method": per_method, "reversal_by_layer": rev.by_layer,
                              "reversal_mse": rev.mse, "outlier_dims": rev.outliers, "split": split.to_frame()})
    out.figures["split"] = figures.draw(split)
    series = {f"{bits}-bit methods (mean of per-method Pearson)": (per_method[f"r_{bits}bit"],
                                                                    per_method[f"low_{bits}bit"],
                                                                    per_method[f"high_{bits}bit"])
              for bits in (3, 4) if per_method[f"methods_{bits}bit"].iloc[0] > 0}
    out.figures["norm_error_correlation"] = figures.band_lines(
        per_method["layer"], series, "Pearson(||resid_mid||, error) per layer, averaged over methods (95% CI)",
        "Pearson r")
    for kind in ("norms", "mse_corr", "kurtosis", "outliers"):
        out.figures[f"reversal_{kind}"] = figures.draw(rev, kind=kind)
    claims: dict[str, Measurement] = {}
    last = per_method.iloc[-1]
    if last["methods_3bit"] > 0:
        r3 = Estimate(float(last["r_3bit"]), float(last["low_3bit"]), float(last["high_3bit"]), len(errors))
        r4 = Estimate(float(last["r_4bit"]), float(last["low_4bit"]), float(last["high_4bit"]))
        four = f"; 4-bit methods {r4.text()}" if last["methods_4bit"] > 0 else ""
        claims["norm_error"] = Measurement({"r_3bit": r3}, f"{r3.text()} at layer {int(last['layer'])} over "
                                                           f"{int(last['methods_3bit'])} 3-bit methods{four}")
    else:
        claims["norm_error"] = Measurement(untestable="no 3-bit method in this report")
    rows = rev.mse[rev.mse["spec"] == spec]
    n_layers = ctx.model.info.n_layers
    upper = rows[rows["layer"] >= n_layers // 2]
    above, below = int((upper["corr_low"] > 0.6).sum()), int((upper["corr_high"] < 0.6).sum())
    claims["reversal_h_mse"] = Measurement(
        {"layers_above": Estimate(above, above, above), "layers_below": Estimate(below, below, below),
         "upper_layers": Estimate(len(upper), len(upper), len(upper))},
        f"{above} of {len(upper)} upper layers wholly above 0.6, {below} wholly below (mean r "
        f"{upper['corr_h_mse'].mean():.2f}; {spec})")
    kurt = _kurtosis_estimate(rev, seed)
    claims["kurtosis"] = Measurement({"diff": kurt}, f"{kurt.text(3)} (log-kurtosis, D_large minus D_ctrl, mean over "
                                                     f"{n_layers} layers)")
    outl = _outlier_estimate(rev, seed)
    claims["outlier_gamma"] = Measurement({"percentile": outl}, f"outlier dims' |gamma| at the {outl.text(2)} "
                                                                "share of dims (0 = smallest), mean over layers")
    out.numbers = {"per_method_last_layer": last.to_dict(), "reversal": rev.headline(), "reversal_spec": spec,
                   "d_large": len(split.large), "d_ctrl": len(split.ctrl)}
    record_claims(out, claims)
    out.notes.append(
        f"D_large: the top 10% of examples by the error of {spec}, the model patched and restored below (the "
        f"paper picks it from the quantized model under study), after 5-gram deduplication ({len(split.large)} "
        f"examples); D_ctrl: as many, sampled from the bottom half. The norm correlation is computed per method and "
        f"averaged over the 3-bit methods (the paper's protocol), with the 4-bit average beside it."
    )
    return out


STAGE = Stage("norms", "(e) Residual magnitude against error, and the reversal analysis",
              "Per layer, the Pearson correlation between the reference model's mean residual norm (BOS excluded) "
              "and each method's error, averaged over methods; then ||r|| against ||h|| = ||RMSNorm(r) * gamma|| for "
              "D_large and D_ctrl, the correlation of ||h|| with the MLP-output error, kurtosis, and the outlier "
              "dimensions' gammas.",
              stage_norms)
