"""Stage (g): layer restoration."""

from __future__ import annotations

from interp.figures import draw
from interp.quant import protocol as pr
from interp.report.context import ReportContext, Stage, StageOutput
from interp.report.reproduction import Measurement
from interp.report.stages.common import N_BOOT, d_large_split, patched_spec, quantized_weights, record_claims


def stage_restoration(ctx: ReportContext) -> StageOutput:
    split = d_large_split(ctx)
    spec = patched_spec(ctx)
    n_layers = ctx.model.info.n_layers
    k_paper = max(1, round(n_layers * 7 / 40))  # the paper restored 7 of 40 layers
    ks = sorted(k for k in {0, 1, 2, 4, k_paper, n_layers // 4, n_layers // 2, n_layers} if k <= n_layers)
    result = ctx.batched("restoration").restoration(quantized_weights(ctx, spec), ctx.model, split.large, ks,
                                                    stage="restoration", stash=ctx.stash)
    ctx.main_only()
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
    out = StageOutput(tables={"restoration": table}, figures={"restoration": draw(result)})
    out.numbers = {"quantized_ppl": q, "reference_ppl": ref, "k_paper": k_paper, "ppl_top_k_paper": ppl_k,
                   "recovery_nll": est.value, "recovery_nll_low": est.low, "recovery_nll_high": est.high,
                   "recovery_ppl": est_ppl.value, "spec": spec}
    record_claims(out, {"restoration": Measurement(
        {"recovery": est}, f"top {k_paper} of {n_layers}: {est.text(percent=True)} on NLL (perplexity {q:.2f} -> "
                           f"{ppl_k:.2f}, ref {ref:.2f}: {est_ppl.text(percent=True)}); {spec}")})
    return out


STAGE = Stage("restoration", "(g) Layer restoration",
              "D_large loss of the quantized model with the reference weights put back in its top-k layers.",
              stage_restoration)
