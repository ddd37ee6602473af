"""Stage (c): quantization and per-example error for every method."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import torch

from interp import (
    figures,
    models,  # models.load_model looked up at call time, so a patched loader is seen
)
from interp.quant.store import ScoreStore
from interp.report.context import ReportContext, Stage, StageOutput
from interp.report.stages.common import method_errors, setup, spec_bits
from interp.runtime.scoring import nll as model_nll
from interp.runtime.scoring import perplexity


def stage_quantization(ctx: ReportContext) -> StageOutput:
    errors = method_errors(ctx)
    ctx.main_only()
    with ScoreStore(ctx.out / "scores.sqlite") as store:
        nll = store.nll_frame().reindex(errors.index)
    ref = torch.tensor(nll["reference"].to_numpy())  # host: scores read from the SQLite store
    rows, timing = [], []
    for spec in errors.columns:
        info = setup(ctx).quant_info(spec)  # the cache's record: no model load
        bits = spec_bits(spec)
        rows.append({"method": spec, "role": "headline (3-bit)" if bits <= 3 else "re-gridding (4-bit onto 4-bit)",
                     "mean error (nats)": float(errors[spec].mean()),
                     "median error": float(errors[spec].median()), "max error": float(errors[spec].max()),
                     "perplexity": perplexity(torch.tensor(nll[spec].to_numpy())),  # host: as ref above
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
    if ctx.settings.dtype != "float32":
        precision = _precision_check(ctx, ref, errors)
        out.tables["precision"] = precision
        out.numbers["precision"] = precision.to_dict(orient="records")
        row = precision.iloc[0]
        out.notes.append(
            f"Precision: this report ran in {ctx.settings.dtype}. Against the same reference in float32, the "
            f"per-example NLL moves by {row['mean |difference| (nats)']:.4f} nats on average (largest "
            f"{row['max |difference| (nats)']:.4f}); the smallest mean quantization error here is "
            f"{row['smallest mean quantization error (nats)']:.4f} nats ({row['smallest method']}), "
            f"{row['ratio']:.0f}x the precision noise.")
    out.notes.append(
        f"The reference is {ctx.reference_description}; every quantizer re-quantizes it further. The 3-bit "
        "methods are the meaningful low-bit comparison; the 4-bit ones move one 4-bit grid onto another "
        f"(re-gridding). GPTQ and AWQ calibrate on {ctx.settings.calibration_n} calibration-split examples, "
        "disjoint from the evaluation examples. Per-token NLL of every method is kept as parquet under "
        "token_nll/ beside scores.sqlite."
    )
    return out


def _precision_check(ctx: ReportContext, reference_nll: torch.Tensor, errors: pd.DataFrame) -> pd.DataFrame:
    """The report's dtype against float32: per-example NLL difference of the reference, beside the
    smallest quantization effect, so a reader sees whether precision noise could blur the comparison."""
    full = models.load_model(ctx.settings.model, dtype=torch.float32, device=ctx.settings.device)
    fp32 = model_nll(full, ctx.examples, batch_size=ctx.settings.batch_size, progress=ctx.progress).double()
    signed = reference_nll.double() - fp32
    diff = signed.abs()
    means = errors.mean()
    smallest = str(means.abs().idxmin())
    return pd.DataFrame([{
        "dtype": ctx.settings.dtype, "mean |difference| (nats)": float(diff.mean()),
        "max |difference| (nats)": float(diff.max()), "mean difference (nats)": float(signed.mean()),
        "smallest method": smallest, "smallest mean quantization error (nats)": float(means[smallest]),
        "ratio": float(abs(means[smallest]) / max(float(diff.mean()), 1e-12)),
    }])


STAGE = Stage("quantization", "(c) Quantization and per-example error",
              "Each method fake-quantizes every linear weight in the transformer blocks (embeddings, unembedding "
              "and norms unchanged). Error = NLL(quantized) - NLL(reference) per example, scored in batches into a "
              "resumable SQLite store.", stage_quantization)
