"""Report stages (c)-(h): quantization and scoring, agreement, norms and reversal, early exit,
layer restoration and cross-model patching. Each calls the public API and the figure builders."""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.graph_objects as go

from interp import figures
from interp.report import ReportContext, Stage, StageOutput


def _quantized(ctx: ReportContext, spec: str) -> Any:
    """A quantized copy of the reference, through the report's own disk cache."""
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
    from interp.quant.store import score

    if "errors" not in ctx.cache:
        needs_cal = any("gptq" in m or "awq" in m for m in ctx.settings.methods)
        ctx.cache["errors"] = score(ctx.model, list(ctx.settings.methods), ctx.examples,
                                    store=ctx.out / "scores.sqlite",
                                    calibration=ctx.calibration if needs_cal else None,
                                    batch_size=ctx.settings.batch_size, progress=ctx.progress,
                                    cache_dir=quantized_cache_dir())
    return ctx.cache["errors"]


def _split(ctx: ReportContext) -> Any:
    from interp.quant.analysis import split_large_ctrl

    if "split" not in ctx.cache:
        errors = _errors(ctx)
        ctx.cache["split"] = split_large_ctrl(errors.mean(axis=1).rename("mean"), ctx.examples, seed=ctx.settings.seed)
    return ctx.cache["split"]


def _patch_spec(ctx: ReportContext) -> str:
    from interp.quant.spec import parse_spec

    return str(parse_spec(ctx.settings.patch_method))


# ---------------------------------------------------------------------------------------
# (c) quantization and per-example scoring


def stage_quantization(ctx: ReportContext) -> StageOutput:
    from interp.quant.store import ScoreStore
    from interp.scoring import perplexity

    errors = _errors(ctx)
    import torch

    with ScoreStore(ctx.out / "scores.sqlite") as store:
        nll = store.nll_frame().reindex(errors.index)
    ref = torch.tensor(nll["reference"].to_numpy())
    rows, timing = [], []
    for spec in errors.columns:
        qmodel = _quantized(ctx, spec)
        info = qmodel.quant_info
        rows.append({"method": spec, "mean error (nats)": float(errors[spec].mean()),
                     "median error": float(errors[spec].median()), "max error": float(errors[spec].max()),
                     "perplexity": perplexity(torch.tensor(nll[spec].to_numpy())),
                     "reference perplexity": perplexity(ref)})
        timing.append({"method": spec, "seconds per layer": info.seconds_per_layer,
                       "total seconds": info.seconds_per_layer * ctx.model.info.n_layers})
    summary = pd.DataFrame(rows)
    out = StageOutput(tables={"methods": summary, "quantizer_time": pd.DataFrame(timing),
                              "per_example_errors": errors.reset_index()})
    fig = go.Figure()
    for i, spec in enumerate(errors.columns):
        fig.add_trace(go.Box(y=errors[spec], name=spec.split(",")[0] + "," + spec.split(",")[1].replace("group=", "g"),
                             boxpoints="outliers", marker_color=figures.PALETTE[i % len(figures.PALETTE)]))
    out.figures["error_distribution"] = figures.styled(fig, "Per-example error NLL(quantized) - NLL(reference)",
                                                       "method", "error (nats)")
    out.numbers = {"methods": summary.to_dict(orient="records"), "n_examples": len(errors),
                   "quantizer_seconds_per_layer": {t["method"]: t["seconds per layer"] for t in timing}}
    out.notes.append(
        "The reference weights were dequantized from the bundled Q4_1 GGUF; every quantizer re-quantizes them "
        f"further. GPTQ and AWQ calibrate on {ctx.settings.calibration_n} calibration-split examples, disjoint "
        "from the evaluation examples."
    )
    return out


# ---------------------------------------------------------------------------------------
# (d) cross-method agreement


def stage_agreement(ctx: ReportContext) -> StageOutput:
    from interp.quant.analysis import agreement

    errors = _errors(ctx)
    result = agreement(errors, n_boot=500, seed=ctx.settings.seed)
    d = result.to_dict()
    out = StageOutput(tables={"pairs": result.to_frame()}, figures={"agreement": result.figure()})
    out.numbers = {"mean_pearson": d["mean_pearson"], "mean_spearman": d["mean_spearman"],
                   "mean_jaccard_top10": d["mean_jaccard_top"], "chance_jaccard": d["chance_jaccard"], "n": d["n"]}
    return out


# ---------------------------------------------------------------------------------------
# (e) residual norm against error, and reversal


def stage_norms(ctx: ReportContext) -> StageOutput:
    from interp.quant.analysis import norm_error_correlation, reversal

    errors = _errors(ctx)
    split = _split(ctx)
    norms = norm_error_correlation(ctx.model, ctx.examples, errors.mean(axis=1).rename("mean"),
                                   batch_size=ctx.settings.batch_size, n_boot=500, seed=ctx.settings.seed,
                                   progress=ctx.progress)
    spec = _patch_spec(ctx)
    rev = reversal(ctx.model, {spec: _quantized(ctx, spec)}, split.large, split.ctrl,
                   batch_size=ctx.settings.batch_size, n_boot=200, seed=ctx.settings.seed, progress=ctx.progress)
    out = StageOutput(tables={"norm_error_correlation": norms.to_frame(), "reversal_by_layer": rev.by_layer,
                              "reversal_mse": rev.mse, "outlier_dims": rev.outliers, "split": split.to_frame()})
    out.figures["split"] = split.figure()
    out.figures["norm_error_correlation"] = norms.figure()
    for kind in ("norms", "mse_corr", "kurtosis", "outliers"):
        out.figures[f"reversal_{kind}"] = rev.figure(kind)
    summary = rev.summary()
    out.numbers = {"last_layer": norms.last_layer(), "reversal": summary, "reversal_spec": spec,
                   "d_large": len(split.large), "d_ctrl": len(split.ctrl)}
    out.notes.append(
        f"D_large: the top 10% of examples by mean error over methods after 5-gram deduplication "
        f"({len(split.large)} examples); D_ctrl: as many, sampled from the bottom half. The reversal analysis "
        f"compares the reference with {spec}."
    )
    return out


# ---------------------------------------------------------------------------------------
# Stage list (lens and patching stages join when available)


QUANT_STAGES: list[Stage] = [
    Stage("quantization", "(c) Quantization and per-example error",
          "Each method fake-quantizes every linear weight in the transformer blocks (embeddings, unembedding "
          "and norms unchanged). Error = NLL(quantized) - NLL(reference) per example, scored in batches into a "
          "resumable SQLite store.", stage_quantization),
    Stage("agreement", "(d) Cross-method agreement",
          "Pearson and Spearman correlation of the per-example error vectors across methods (bootstrap 95% "
          "intervals), and the Jaccard overlap of their top-10% error sets against chance.", stage_agreement),
    Stage("norms", "(e) Residual magnitude against error, and the reversal analysis",
          "Per layer, the Pearson correlation between the reference model's mean residual norm (BOS excluded) "
          "and the error; then ||r|| against ||h|| = ||RMSNorm(r) * gamma|| for D_large and D_ctrl, the "
          "correlation of ||h|| with the MLP-output error, kurtosis, and the outlier dimensions' gammas.",
          stage_norms),
]


def _lens_stages() -> list[Stage]:
    try:
        from interp.report_lens_stages import LENS_STAGES
    except ImportError:
        return []
    return list(LENS_STAGES)


QUANT_STAGES += _lens_stages()


# ---------------------------------------------------------------------------------------
# Reproduction rows


def _f(value: Any, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def quant_reproduction_rows(outputs: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    paper = "Quantization errors (arXiv 2506.12044)"
    rows: list[tuple[str, str, str, str, str]] = []
    agree = outputs.get("agreement")
    if agree is not None:
        n = agree.numbers
        r = n["mean_pearson"]["mean"]
        rows.append((paper, "Per-example errors agree across methods (mean Pearson over method pairs)", "0.82",
                     f"{_f(r)} [{_f(n['mean_pearson']['low'])}, {_f(n['mean_pearson']['high'])}]",
                     "yes" if r > 0.5 else "no"))
        j, c = n["mean_jaccard_top10"], n["chance_jaccard"]
        rows.append((paper, "Top-10% error sets overlap (mean Jaccard) well above chance", "0.51 (chance ~0.05)",
                     f"{_f(j)} (chance {_f(c, 3)})", "yes" if j > 3 * c else "no"))
    norms = outputs.get("norms")
    if norms is not None:
        last = norms.numbers["last_layer"].get("resid_mid", {})
        r = last.get("r")
        rows.append((paper, "Last-layer residual norm correlates negatively with error", "-0.66 to -0.80",
                     f"{_f(r)} [{_f(last.get('low'))}, {_f(last.get('high'))}]",
                     "yes" if r is not None and r < -0.3 else ("partly" if r is not None and r < 0 else "no")))
        summary = norms.numbers["reversal"]
        spec = norms.numbers["reversal_spec"]
        upper = summary.get("corr_h_mse_upper_above_0.6", {}).get(spec, "n/a")
        mean_corr = summary.get("corr_h_mse_upper_mean", {}).get(spec)
        rows.append((paper, "corr(||h||, MLP-output MSE) > 0.6 in most upper layers", "> 0.6 in most upper layers",
                     f"{upper} upper layers above 0.6 (mean {_f(mean_corr)})",
                     _majority(upper)))
        layers = summary["layers"]
        k = summary["kurtosis_large_below_ctrl"]
        rows.append((paper, "Residual kurtosis is lower for D_large", "lower for D_large",
                     f"lower in {k}/{layers} layers", "yes" if k > layers / 2 else "no"))
        share = summary["outlier_gamma_percentile_mean"]  # share of dims with a smaller |gamma|, in [0, 1]
        rows.append((paper, "Top-5 outlier dimensions get the smallest |gamma|", "smallest gamma",
                     f"outlier dims' |gamma| at the {100 * share:.0f}th percentile on average (0 = smallest)",
                     "yes" if share < 0.25 else ("partly" if share < 0.5 else "no")))
    for name in ("early_exit", "restoration", "patching"):
        output = outputs.get(name)
        if output is not None:
            rows.extend(tuple(r) for r in output.numbers.get("reproduction_rows", []))
    return rows


def _majority(fraction: str) -> str:
    try:
        above, total = (int(x) for x in fraction.split("/"))
    except ValueError:
        return "n/a"
    return "yes" if above > total / 2 else ("partly" if above > 0 else "no")
