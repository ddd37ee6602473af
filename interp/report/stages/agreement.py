"""Stage (d): cross-method agreement, the paper's pair rule, and each method's noise ceiling."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from interp import figures
from interp.errors import InterpError
from interp.figures.quant import short_spec
from interp.quant import protocol as pr
from interp.quant.analysis import agreement
from interp.quant.store import ScoreStore
from interp.report.context import ReportContext, Stage, StageOutput
from interp.report.reproduction import Measurement
from interp.report.stages.common import N_BOOT, method_errors, record_claims


def _token_errors(ctx: ReportContext, errors: pd.DataFrame) -> dict[str, np.ndarray] | None:
    """spec -> ``[N, T-1]`` per-token error, or None when the store predates per-token storage."""

    ids = list(errors.index)
    try:
        with ScoreStore(ctx.out / "scores.sqlite") as store:
            ref = store.token_nll("reference", ids=ids).to_numpy(dtype=np.float64)
            out = {spec: store.token_nll(spec, ids=ids).to_numpy(dtype=np.float64) - ref for spec in errors.columns}
    except InterpError:
        return None
    return None if any(not np.isfinite(v).all() for v in out.values()) else out


PAPER_PAIRS = "paper pairs (3- and 4-bit)"


def paper_agreement(errors: pd.DataFrame, n_boot: int = N_BOOT, seed: int = 0
                    ) -> tuple[dict[str, list[tuple[str, str]]], dict[str, dict[str, Any]]]:
    """The paper's pair rule on ``errors`` (examples x specs): the pairs of each group (all paper pairs, 3-bit,
    4-bit) and, for each group with pairs, :func:`~interp.quant.protocol.pair_agreement`'s estimates."""
    specs = list(errors.columns)
    groups = {PAPER_PAIRS: pr.paper_pairs(specs), "3-bit pairs": pr.paper_pairs(specs, bits=3),
              "4-bit pairs (re-gridding)": pr.paper_pairs(specs, bits=4)}
    lines = {name: pr.pair_agreement(errors, pairs, n_boot=n_boot, seed=seed) for name, pairs in groups.items()
             if pairs}
    return groups, lines


def agreement_claims(groups: dict[str, list[tuple[str, str]]], lines: dict[str, dict[str, Any]]
                     ) -> dict[str, Measurement]:
    """The agreement and top-10% Jaccard measurements of :func:`paper_agreement`'s result, as the report and
    notebook 04 judge them (:func:`interp.report.compare.comparison`)."""
    paper = lines.get(PAPER_PAIRS)
    if paper is None:
        return {"agreement": Measurement(untestable="fewer than two specs that the paper's pair rule can pair")}
    beside = "; ".join(f"{name}: {v['pearson'].text()}" for name, v in lines.items() if name != PAPER_PAIRS)
    return {"agreement": Measurement({"pearson": paper["pearson"]},
                                     f"{paper['pearson'].text()} over {len(groups[PAPER_PAIRS])} pairs"
                                     + (f" ({beside})" if beside else "")),
            "jaccard_top10": Measurement({"jaccard": paper["jaccard"], "chance": paper["chance"]},
                                         f"{paper['jaccard'].text()} (chance {paper['chance'].value:.3f})")}


def stage_agreement(ctx: ReportContext) -> StageOutput:
    errors = method_errors(ctx)
    ctx.main_only()
    seed = ctx.settings.seed
    result = agreement(errors, n_boot=500, seed=seed)
    groups, lines = paper_agreement(errors, n_boot=N_BOOT, seed=seed)
    table = pd.DataFrame([{
        "pairs": name, "n pairs": len(groups[name]),
        "mean Pearson": v["pearson"].value, "Pearson low": v["pearson"].low, "Pearson high": v["pearson"].high,
        "mean Jaccard top 10%": v["jaccard"].value, "Jaccard low": v["jaccard"].low,
        "Jaccard high": v["jaccard"].high, "chance Jaccard": v["chance"].value,
    } for name, v in lines.items()])
    out = StageOutput(tables={"paper_protocol": table, "pairs": result.to_frame()},
                      figures={"agreement": figures.draw(result)})
    paper = lines.get(PAPER_PAIRS)
    claims = agreement_claims(groups, lines)
    token_errors = _token_errors(ctx, errors)
    if token_errors is None or paper is None:
        claims["agreement_disattenuated"] = Measurement(
            untestable="no per-token NLL in this store (scored by an older interp); rerun scoring into a new --out")
    else:
        ceiling = pr.noise_ceiling(token_errors, groups[PAPER_PAIRS], n_boot=N_BOOT, seed=seed)
        out.tables["reliability"] = ceiling.reliability
        out.tables["disattenuated_pairs"] = ceiling.pairs
        out.figures["reliability"] = _reliability_figure(ceiling)
        by_group = {name: ceiling if name == PAPER_PAIRS else
                    pr.noise_ceiling({s: token_errors[s] for s in sorted({x for p in pairs for x in p})}, pairs,
                                     n_boot=N_BOOT, seed=seed)
                    for name, pairs in groups.items() if pairs}
        table["disattenuated Pearson"] = [by_group[n].mean_disattenuated.value for n in table["pairs"]]
        table["disattenuated low"] = [by_group[n].mean_disattenuated.low for n in table["pairs"]]
        table["disattenuated high"] = [by_group[n].mean_disattenuated.high for n in table["pairs"]]
        rel = ceiling.reliability["r_half"]
        beside = "; ".join(f"{name}: {c.mean_disattenuated.text()}" for name, c in by_group.items()
                           if name != PAPER_PAIRS)
        above_one = int((ceiling.pairs["disattenuated"] > 1).sum())
        undefined = f"; {ceiling.invalid_pairs} pair(s) without a valid ceiling" if ceiling.invalid_pairs else ""
        claims["agreement_disattenuated"] = Measurement(
            {"pearson": ceiling.mean_disattenuated, "ceiling": ceiling.min_half_reliability},
            f"{ceiling.mean_disattenuated.text()} on disjoint tokens (observed {ceiling.mean_observed.text()}; "
            f"{beside}; half-length reliability {rel.min():.2f}-{rel.max():.2f} over methods, smallest "
            f"{ceiling.min_half_reliability.text()}; {above_one} of {len(ceiling.pairs)} pairs corrected above 1"
            f"{undefined}; no across-instance self-agreement in a one-instance report)")
        out.numbers["reliability"] = ceiling.reliability.to_dict(orient="records")
        out.notes.append(
            "Noise ceiling: each method's per-example error is split into odd and even target tokens; the "
            "correlation of the halves across examples is the half-length reliability. Both errors of a pair are "
            "differences from the same reference NLL on the same tokens, so the correction compares disjoint tokens "
            "only: r(a odd, b even) / sqrt(r(a odd, a even) r(b odd, b even)). A corrected value above 1, or a "
            "reliability whose interval reaches 0, means the correction is not valid here (no verdict).")
    d = result.to_dict()
    out.numbers.update({"mean_pearson": d["mean_pearson"], "mean_jaccard_top10": d["mean_jaccard_top"],
                        "chance_jaccard": d["chance_jaccard"], "n": d["n"],
                        "paper_protocol": table.to_dict(orient="records")})
    out.notes.append("The paper averages over its configuration pairs except same-algorithm pairs at different bit "
                     "widths; the first line of the protocol table follows that rule, the others split it by bits.")
    record_claims(out, claims)
    return out


def _reliability_figure(ceiling: Any) -> go.Figure:
    rel = ceiling.reliability
    fig = go.Figure(go.Bar(
        x=[short_spec(s) for s in rel["spec"]], y=rel["reliability"],
        error_y=dict(type="data", symmetric=False, array=rel["high"] - rel["reliability"],
                     arrayminus=rel["reliability"] - rel["low"]), marker_color=figures.PALETTE[0]))
    return figures.styled(fig, "Split-half reliability of each method's per-example error (Spearman-Brown, 95% CI)",
                          "method", "reliability")


STAGE = Stage("agreement", "(d) Cross-method agreement and its noise ceiling",
              "Pearson and Spearman correlation of the per-example error vectors across methods (bootstrap 95% "
              "intervals), the Jaccard overlap of their top-10% error sets against chance, the paper's pair rule, and "
              "each method's split-half reliability.", stage_agreement)
