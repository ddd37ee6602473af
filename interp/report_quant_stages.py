"""Report stages (c)-(e): quantization and scoring, agreement with its noise ceiling, norms and reversal.

Each stage calls the public API, the paper-protocol statistics (:mod:`interp.quant.protocol`)
and the figure builders, and hands its measurements for the pre-registered claims
(:mod:`interp.reproduction`) to the report in ``numbers["claims"]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from interp import figures
from interp.report import ReportContext, Stage, StageOutput
from interp.reproduction import Measurement, measurement_to_dict
from interp.stats import Estimate

N_BOOT = 1000  # bootstrap resamples for every interval in the quantization stages


def _quantized(ctx: ReportContext, spec: str) -> Any:
    """A quantized copy of the reference, through the user cache of quantized models."""
    from interp.quant.apply import quantize_cached
    from interp.quant.spec import parse_spec

    key = f"quantized:{parse_spec(spec)}"
    if key not in ctx.cache:
        calibration = ctx.calibration if parse_spec(spec).needs_calibration else None
        # Quantized weights live in the user cache ($INTERP_CACHE/quantized), shared across reports,
        # so the report folder stays small (a quantized SmolLM2 copy is ~0.5 GB in float32).
        ctx.cache[key] = quantize_cached(ctx.model, spec, calibration, cache_dir=None,
                                         progress=ctx.progress, batch_size=ctx.settings.batch_size)
    return ctx.cache[key]


def quantized_cache_dir() -> Any:
    from interp.models import cache_dir

    return cache_dir() / "quantized"


def _errors(ctx: ReportContext) -> pd.DataFrame:
    """Per-example errors for every method (resumable: the SQLite store keeps finished batches)."""
    from interp.quant.spec import parse_spec
    from interp.quant.store import score

    if "errors" not in ctx.cache:
        needs_cal = any(parse_spec(m).needs_calibration for m in ctx.settings.methods)
        ctx.cache["errors"] = score(ctx.model, list(ctx.settings.methods), ctx.examples,
                                    store=ctx.out / "scores.sqlite",
                                    calibration=ctx.calibration if needs_cal else None,
                                    batch_size=ctx.settings.batch_size, progress=ctx.progress,
                                    cache_dir=quantized_cache_dir())
    return ctx.cache["errors"]


def _patch_spec(ctx: ReportContext) -> str:
    from interp.quant.spec import parse_spec

    return str(parse_spec(ctx.settings.patch_method))


def _split(ctx: ReportContext) -> Any:
    """D_large / D_ctrl chosen from the patched method's *own* error (the paper's localization protocol)."""
    from interp.quant.analysis import split_large_ctrl

    if "split" not in ctx.cache:
        errors = _errors(ctx)
        spec = _patch_spec(ctx)
        ctx.cache["split"] = split_large_ctrl(errors[spec].rename(spec), ctx.examples, seed=ctx.settings.seed)
    return ctx.cache["split"]


def _bits(spec: str) -> int:
    from interp.quant.spec import parse_spec

    return int(parse_spec(spec).bits)


def _claims(out: StageOutput, claims: dict[str, Measurement]) -> None:
    out.numbers["claims"] = {key: measurement_to_dict(m) for key, m in claims.items()}


# ---------------------------------------------------------------------------------------
# (c) quantization and per-example scoring


def stage_quantization(ctx: ReportContext) -> StageOutput:
    import torch

    from interp.quant.store import ScoreStore
    from interp.scoring import perplexity

    errors = _errors(ctx)
    with ScoreStore(ctx.out / "scores.sqlite") as store:
        nll = store.nll_frame().reindex(errors.index)
    ref = torch.tensor(nll["reference"].to_numpy())
    rows, timing = [], []
    for spec in errors.columns:
        qmodel = _quantized(ctx, spec)
        info = qmodel.quant_info
        bits = _bits(spec)
        rows.append({"method": spec, "role": "headline (3-bit)" if bits <= 3 else "re-gridding (4-bit onto 4-bit)",
                     "mean error (nats)": float(errors[spec].mean()),
                     "median error": float(errors[spec].median()), "max error": float(errors[spec].max()),
                     "perplexity": perplexity(torch.tensor(nll[spec].to_numpy())),
                     "reference perplexity": perplexity(ref)})
        timing.append({"method": spec, "seconds per layer": info.seconds_per_layer,
                       "total seconds": info.seconds_per_layer * ctx.model.info.n_layers})
    summary = pd.DataFrame(rows).sort_values("role", kind="stable")
    out = StageOutput(tables={"methods": summary, "quantizer_time": pd.DataFrame(timing),
                              "per_example_errors": errors.reset_index()})
    fig = go.Figure()
    for i, spec in enumerate(errors.columns):
        fig.add_trace(go.Box(y=errors[spec], name=spec.split(",")[0] + "," + spec.split(",")[1].replace("group=", "g"),
                             boxpoints="outliers", marker_color=figures.PALETTE[i % len(figures.PALETTE)]))
    out.figures["error_distribution"] = figures.styled(fig, "Per-example error NLL(quantized) - NLL(reference)",
                                                       "method", "error (nats)")
    out.numbers = {"methods": summary.to_dict(orient="records"), "n_examples": len(errors),
                   "reference": ctx.reference_description,
                   "quantizer_seconds_per_layer": {t["method"]: t["seconds per layer"] for t in timing}}
    out.notes.append(
        f"The reference is {ctx.reference_description}; every quantizer re-quantizes it further. The 3-bit "
        "methods are the meaningful low-bit comparison; the 4-bit ones move one 4-bit grid onto another "
        f"(re-gridding). GPTQ and AWQ calibrate on {ctx.settings.calibration_n} calibration-split examples, "
        "disjoint from the evaluation examples. Per-token NLL of every method is kept as parquet under "
        "token_nll/ beside scores.sqlite."
    )
    return out


# ---------------------------------------------------------------------------------------
# (d) cross-method agreement, with the paper's pair rule and the noise ceiling


def _token_errors(ctx: ReportContext, errors: pd.DataFrame) -> dict[str, np.ndarray] | None:
    """spec -> ``[N, T-1]`` per-token error, or None when the store predates per-token storage."""
    from interp.errors import InterpError
    from interp.quant.store import ScoreStore

    ids = list(errors.index)
    try:
        with ScoreStore(ctx.out / "scores.sqlite") as store:
            ref = store.token_nll("reference", ids=ids).to_numpy(dtype=np.float64)
            out = {spec: store.token_nll(spec, ids=ids).to_numpy(dtype=np.float64) - ref for spec in errors.columns}
    except InterpError:
        return None
    return None if any(not np.isfinite(v).all() for v in out.values()) else out


def stage_agreement(ctx: ReportContext) -> StageOutput:
    from interp.quant import protocol as pr
    from interp.quant.analysis import agreement

    errors = _errors(ctx)
    seed = ctx.settings.seed
    result = agreement(errors, n_boot=500, seed=seed)
    specs = list(errors.columns)
    groups = {"paper pairs (3- and 4-bit)": pr.paper_pairs(specs), "3-bit pairs": pr.paper_pairs(specs, bits=3),
              "4-bit pairs (re-gridding)": pr.paper_pairs(specs, bits=4)}
    lines = {name: pr.pair_agreement(errors, pairs, n_boot=N_BOOT, seed=seed) for name, pairs in groups.items()
             if pairs}
    table = pd.DataFrame([{
        "pairs": name, "n pairs": len(groups[name]),
        "mean Pearson": v["pearson"].value, "Pearson low": v["pearson"].low, "Pearson high": v["pearson"].high,
        "mean Jaccard top 10%": v["jaccard"].value, "Jaccard low": v["jaccard"].low,
        "Jaccard high": v["jaccard"].high, "chance Jaccard": v["chance"].value,
    } for name, v in lines.items()])
    out = StageOutput(tables={"paper_protocol": table, "pairs": result.to_frame()},
                      figures={"agreement": result.figure()})
    paper = lines.get("paper pairs (3- and 4-bit)")
    claims: dict[str, Measurement] = {}
    if paper is None:
        claims["agreement"] = Measurement(untestable="fewer than two specs that the paper's pair rule can pair")
    else:
        beside = "; ".join(f"{name}: {v['pearson'].text()}" for name, v in lines.items() if name != next(iter(lines)))
        claims["agreement"] = Measurement({"pearson": paper["pearson"]},
                                          f"{paper['pearson'].text()} over {len(groups[next(iter(lines))])} pairs"
                                          + (f" ({beside})" if beside else ""))
        claims["jaccard_top10"] = Measurement(
            {"jaccard": paper["jaccard"], "chance": paper["chance"]},
            f"{paper['jaccard'].text()} (chance {paper['chance'].value:.3f})")
    token_errors = _token_errors(ctx, errors)
    if token_errors is None or paper is None:
        claims["agreement_disattenuated"] = Measurement(
            untestable="no per-token NLL in this store (scored by an older interp); rerun scoring into a new --out")
    else:
        ceiling = pr.noise_ceiling(token_errors, groups["paper pairs (3- and 4-bit)"], n_boot=N_BOOT, seed=seed)
        out.tables["reliability"] = ceiling.reliability
        out.tables["disattenuated_pairs"] = ceiling.pairs
        out.figures["reliability"] = _reliability_figure(ceiling)
        by_group = {name: ceiling if name == "paper pairs (3- and 4-bit)" else
                    pr.noise_ceiling({s: token_errors[s] for s in sorted({x for p in pairs for x in p})}, pairs,
                                     n_boot=N_BOOT, seed=seed)
                    for name, pairs in groups.items() if pairs}
        table["disattenuated Pearson"] = [by_group[n].mean_disattenuated.value for n in table["pairs"]]
        table["disattenuated low"] = [by_group[n].mean_disattenuated.low for n in table["pairs"]]
        table["disattenuated high"] = [by_group[n].mean_disattenuated.high for n in table["pairs"]]
        rel = ceiling.reliability["reliability"]
        beside = "; ".join(f"{name}: {c.mean_disattenuated.text()}" for name, c in by_group.items()
                           if name != "paper pairs (3- and 4-bit)")
        claims["agreement_disattenuated"] = Measurement(
            {"pearson": ceiling.mean_disattenuated},
            f"{ceiling.mean_disattenuated.text()} (observed {ceiling.mean_observed.text()}; {beside}; split-half "
            f"reliability {rel.min():.2f}-{rel.max():.2f} over methods)")
        out.numbers["reliability"] = ceiling.reliability.to_dict(orient="records")
        out.notes.append(
            "Noise ceiling: each method's per-example error is split into odd and even target tokens; the "
            "correlation of the halves across examples, stepped up with Spearman-Brown, is the error's reliability. "
            "Two methods cannot agree above sqrt(rel_a rel_b); the disattenuated correlation divides it out.")
    d = result.to_dict()
    out.numbers.update({"mean_pearson": d["mean_pearson"], "mean_jaccard_top10": d["mean_jaccard_top"],
                        "chance_jaccard": d["chance_jaccard"], "n": d["n"],
                        "paper_protocol": table.to_dict(orient="records")})
    out.notes.append("The paper averages over its configuration pairs except same-algorithm pairs at different bit "
                     "widths; the first line of the protocol table follows that rule, the others split it by bits.")
    _claims(out, claims)
    return out


def _reliability_figure(ceiling: Any) -> go.Figure:
    from interp.quant_figures import short_spec

    rel = ceiling.reliability
    fig = go.Figure(go.Bar(
        x=[short_spec(s) for s in rel["spec"]], y=rel["reliability"],
        error_y=dict(type="data", symmetric=False, array=rel["high"] - rel["reliability"],
                     arrayminus=rel["reliability"] - rel["low"]), marker_color=figures.PALETTE[0]))
    return figures.styled(fig, "Split-half reliability of each method's per-example error (Spearman-Brown, 95% CI)",
                          "method", "reliability")


# ---------------------------------------------------------------------------------------
# (e) residual norm against error, and reversal


def _norm_probe(ctx: ReportContext) -> Any:
    from interp.probes import probe

    if "norm_probe" not in ctx.cache:
        ctx.cache["norm_probe"] = probe(ctx.model, ctx.examples, ["resid_mid", "resid_post"], ["norm"],
                                        batch_size=ctx.settings.batch_size, exclude_bos=True, progress=ctx.progress)
    return ctx.cache["norm_probe"]


def _per_method_norm_table(ctx: ReportContext, errors: pd.DataFrame) -> pd.DataFrame:
    from interp.quant import protocol as pr

    result = _norm_probe(ctx)
    norms = result["resid_mid", "norm"].double().numpy()
    ordered = errors.reindex(ctx.examples.ids)
    groups = {bits: [s for s in errors.columns if _bits(s) == bits] for bits in (3, 4)}
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
    from interp import stats
    from interp.quant.protocol import estimate

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


def _outlier_estimate(rev: Any, seed: int) -> Estimate:
    from interp import stats
    from interp.quant.protocol import estimate

    per_layer = rev.outliers.groupby("layer")["gamma_percentile"].mean().to_numpy(dtype=np.float64)
    boot = per_layer[stats.bootstrap_indices(per_layer.size, N_BOOT, seed)].mean(axis=1)
    return estimate(float(per_layer.mean()), boot, int(per_layer.size))


def stage_norms(ctx: ReportContext) -> StageOutput:
    from interp.quant.analysis import reversal

    errors = _errors(ctx)
    split = _split(ctx)
    seed = ctx.settings.seed
    per_method = _per_method_norm_table(ctx, errors)
    spec = _patch_spec(ctx)
    rev = reversal(ctx.model, {spec: _quantized(ctx, spec)}, split.large, split.ctrl,
                   batch_size=ctx.settings.batch_size, n_boot=N_BOOT, seed=seed, progress=ctx.progress)
    out = StageOutput(tables={"norm_error_per_method": per_method, "reversal_by_layer": rev.by_layer,
                              "reversal_mse": rev.mse, "outlier_dims": rev.outliers, "split": split.to_frame()})
    out.figures["split"] = split.figure()
    series = {f"{bits}-bit methods (mean of per-method Pearson)": (per_method[f"r_{bits}bit"],
                                                                    per_method[f"low_{bits}bit"],
                                                                    per_method[f"high_{bits}bit"])
              for bits in (3, 4) if per_method[f"methods_{bits}bit"].iloc[0] > 0}
    out.figures["norm_error_correlation"] = figures.band_lines(
        per_method["layer"], series, "Pearson(||resid_mid||, error) per layer, averaged over methods (95% CI)",
        "Pearson r")
    for kind in ("norms", "mse_corr", "kurtosis", "outliers"):
        out.figures[f"reversal_{kind}"] = rev.figure(kind)
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
    above, reaching = int((upper["corr_low"] > 0.6).sum()), int((upper["corr_high"] > 0.6).sum())
    claims["reversal_h_mse"] = Measurement(
        {"layers_above": Estimate(above, above, above), "layers_reaching": Estimate(reaching, reaching, reaching),
         "upper_layers": Estimate(len(upper), len(upper), len(upper))},
        f"{above} of {len(upper)} upper layers wholly above 0.6, {reaching} reach it (mean r "
        f"{upper['corr_h_mse'].mean():.2f}; {spec})")
    kurt = _kurtosis_estimate(rev, seed)
    claims["kurtosis"] = Measurement({"diff": kurt}, f"{kurt.text(3)} (log-kurtosis, D_large minus D_ctrl, mean over "
                                                     f"{n_layers} layers)")
    outl = _outlier_estimate(rev, seed)
    claims["outlier_gamma"] = Measurement({"percentile": outl}, f"outlier dims' |gamma| at the {outl.text(2)} "
                                                                "share of dims (0 = smallest), mean over layers")
    out.numbers = {"per_method_last_layer": last.to_dict(), "reversal": rev.headline(), "reversal_spec": spec,
                   "d_large": len(split.large), "d_ctrl": len(split.ctrl)}
    _claims(out, claims)
    out.notes.append(
        f"D_large: the top 10% of examples by the error of {spec}, the model patched and restored below (the "
        f"paper picks it from the quantized model under study), after 5-gram deduplication ({len(split.large)} "
        f"examples); D_ctrl: as many, sampled from the bottom half. The norm correlation is computed per method and "
        f"averaged over the 3-bit methods (the paper's protocol), with the 4-bit average beside it."
    )
    return out


# ---------------------------------------------------------------------------------------
# Stage list (the lens and patching stages follow in interp.report_lens_stages)


QUANT_STAGES: list[Stage] = [
    Stage("quantization", "(c) Quantization and per-example error",
          "Each method fake-quantizes every linear weight in the transformer blocks (embeddings, unembedding "
          "and norms unchanged). Error = NLL(quantized) - NLL(reference) per example, scored in batches into a "
          "resumable SQLite store.", stage_quantization),
    Stage("agreement", "(d) Cross-method agreement and its noise ceiling",
          "Pearson and Spearman correlation of the per-example error vectors across methods (bootstrap 95% "
          "intervals), the Jaccard overlap of their top-10% error sets against chance, the paper's pair rule, and "
          "each method's split-half reliability.", stage_agreement),
    Stage("norms", "(e) Residual magnitude against error, and the reversal analysis",
          "Per layer, the Pearson correlation between the reference model's mean residual norm (BOS excluded) "
          "and each method's error, averaged over methods; then ||r|| against ||h|| = ||RMSNorm(r) * gamma|| for "
          "D_large and D_ctrl, the correlation of ||h|| with the MLP-output error, kurtosis, and the outlier "
          "dimensions' gammas.",
          stage_norms),
]

