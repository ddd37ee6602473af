"""Pre-registered reproduction claims: each paper finding, its statistic, and the rule that judges it.

Every finding the report reproduces is declared here once, before anything is measured:

- the paper, the claim in this project's words, and the paper's own number;
- the statistic measured here, always with a 95% interval when one can be computed;
- a criterion, fixed in code, that turns the statistic and its interval into one verdict:
  ``holds``, ``partly``, ``does not hold``, ``not testable here`` (with the reason) or
  ``by construction``.

No verdict reads a point estimate when an interval exists. The thresholds come from the
papers' own numbers, never from what was measured here:

- **"present"** means the interval excludes the null value (0, chance, or 0.5 for a
  percentile) on the side the paper claims;
- **"at the paper's level"** means the interval reaches the paper's reported value, or
  the paper's weakest model where it reports several (for agreement, Qwen2.5-7B's 0.66;
  for the norm correlation, -0.66);
- a quantitative claim **holds** when the effect is present and at the paper's level, is
  **partly** reproduced when it is present but the whole interval falls short of that
  level, and **does not hold** when the interval includes the null or lies on the other
  side (the reason says which: "not shown" or "contradicted");
- a claim that something is **"little"** (restoration) holds when the whole interval lies
  below the stated threshold, does not hold when the whole interval lies above it, and is
  partly reproduced when the interval straddles it.

``judge`` applies a claim's rule; :func:`reproduction_frame` builds the report's table. The
unit tests feed synthetic statistics to every rule and cover each outcome.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import pandas as pd

from interp.stats import Estimate

Verdict = Literal["holds", "partly", "does not hold", "not testable here", "by construction"]
HOLDS: Verdict = "holds"
PARTLY: Verdict = "partly"
FAILS: Verdict = "does not hold"
NOT_TESTABLE: Verdict = "not testable here"
BY_CONSTRUCTION: Verdict = "by construction"
VERDICTS: tuple[Verdict, ...] = (HOLDS, PARTLY, FAILS, NOT_TESTABLE, BY_CONSTRUCTION)

SAOBP_PAPER = "SAOBP (arXiv 2509.07324)"
QUANT_PAPER = "Quantization errors (arXiv 2506.12044)"

# -- thresholds, each from the papers' own numbers (never from a measurement made here) --------
AGREEMENT_LEVEL = 0.66  # the paper's weakest model (Qwen2.5-7B); its mean over 50 pairs is 0.82
JACCARD_LEVEL = 0.51  # the paper's mean top-10% Jaccard over pairs
NORM_LEVEL = -0.66  # the paper's weakest last-layer correlation (Qwen2.5-7B); others -0.76 to -0.80
H_MSE_LEVEL = 0.6  # the paper: corr(||h||, MLP-output MSE) "above 0.6 in most upper layers"
OUTLIER_LEVEL = 0.10  # "the outlier dims get the smallest gamma": within the smallest 10% of dims
EARLY_EXIT_SHARE = 0.25  # "only the last layers": the paper's 7 of 40 (17.5%) lies in the last quarter
LITTLE = 0.5  # "restoration recovers little": less than half of the NLL gap (the paper: 20%)
STRONG = 0.5  # "patching down/gate recovers most": more than half of the NLL gap (the paper: 93%, 84%)
# SAOBP training is testable only where the baseline shows what SAOBP is claimed to prevent:
SINK_SHARE = 0.3  # baseline deep-layer mass on key 0 at the end of training, or ...
COLLAPSED_ENTROPY = 0.35  # ... baseline deep-layer normalised entropy (1 = uniform) at or below this
MIN_SEEDS = 3


@dataclass(frozen=True)
class Measurement:
    """What a stage measured for one claim.

    Attributes:
        estimates: the named statistics the claim's rule reads.
        text: the "measured here" cell, in words.
        untestable: why the claim cannot be tested here (then the rule is not applied).
    """

    estimates: dict[str, Estimate] = field(default_factory=dict)
    text: str = ""
    untestable: str | None = None


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    reason: str


Rule = Callable[[Measurement], Judgement]


@dataclass(frozen=True)
class Claim:
    """One pre-registered finding."""

    key: str
    paper: str
    claim: str
    paper_value: str
    statistic: str
    criterion: str
    rule: Rule


CLAIMS: dict[str, Claim] = {}


def claim(key: str, paper: str, text: str, paper_value: str, statistic: str, criterion: str
          ) -> Callable[[Rule], Rule]:
    """Register ``rule`` as the criterion of claim ``key`` (claims keep their declaration order)."""

    def register(rule: Rule) -> Rule:
        if key in CLAIMS:
            raise ValueError(f"claim {key!r} is declared twice")
        CLAIMS[key] = Claim(key, paper, text, paper_value, statistic, criterion, rule)
        return rule

    return register


# ---------------------------------------------------------------------------------------
# Rule builders


def _need(m: Measurement, *names: str) -> Judgement | None:
    """A not-testable judgement when a statistic or its interval is missing, else None."""
    for name in names:
        est = m.estimates.get(name)
        if est is None or not math.isfinite(est.value):
            return Judgement(NOT_TESTABLE, f"the statistic '{name}' could not be computed here")
        if not est.has_interval:
            return Judgement(NOT_TESTABLE, f"no interval for '{name}' (too few examples to resample)")
    return None


def present_at_level(est: Estimate, null: float, level: float, direction: int) -> Judgement:
    """The quantitative rule: present (interval excludes ``null`` on the claimed side) and at level.

    ``direction`` is +1 when the paper claims a value above ``null``, -1 when below.
    """
    lo, hi = (est.low, est.high) if direction > 0 else (-est.high, -est.low)
    nul, lev = direction * null, direction * level
    if hi < nul:
        return Judgement(FAILS, f"contradicted: the interval lies on the other side of {null:.3g}")
    if lo <= nul:
        return Judgement(FAILS, f"not shown: the interval includes {null:.3g}")
    if hi >= lev:
        return Judgement(HOLDS, f"the interval excludes {null:.3g} and reaches the paper's level {level:g}")
    return Judgement(PARTLY, f"present (the interval excludes {null:.3g}) but wholly short of the paper's level "
                             f"{level:g}")


def below_threshold(est: Estimate, threshold: float) -> Judgement:
    """The "little" rule: holds when the whole interval lies below ``threshold``."""
    if est.high < threshold:
        return Judgement(HOLDS, f"the whole interval lies below {threshold:g}")
    if est.low >= threshold:
        return Judgement(FAILS, f"the whole interval lies at or above {threshold:g}")
    return Judgement(PARTLY, f"the interval straddles {threshold:g}")


def signed(est: Estimate, direction: int, what: str) -> Judgement:
    """A qualitative direction: holds when the interval excludes 0 on the claimed side."""
    lo, hi = (est.low, est.high) if direction > 0 else (-est.high, -est.low)
    if lo > 0:
        return Judgement(HOLDS, f"the interval excludes 0: {what}")
    if hi < 0:
        return Judgement(FAILS, f"contradicted: the interval lies on the other side of 0 ({what} reversed)")
    return Judgement(FAILS, "not shown: the interval includes 0")


def two_part(first: bool, second: bool, first_text: str, second_text: str) -> Judgement:
    """Both parts of a two-part claim: holds with both, partly with one, does not hold with neither."""
    if first and second:
        return Judgement(HOLDS, f"{first_text} and {second_text}")
    if first or second:
        shown, missing = (first_text, second_text) if first else (second_text, first_text)
        return Judgement(PARTLY, f"{shown}; not shown: {missing}")
    return Judgement(FAILS, f"neither {first_text} nor {second_text}")


# ---------------------------------------------------------------------------------------
# SAOBP


@claim("saobp_inference", SAOBP_PAPER,
       "Inference-time SAOBP on the pretrained model raises deep-layer attention entropy",
       "not claimed (the paper trains with SAOBP)",
       "change in deep-layer entropy (nats), with GTD, sink share and the NLL cost beside it",
       "by construction: the repulsive update never lowers a sink-dominated row's entropy (a unit test "
       "asserts it), so measuring it on a pretrained model tests nothing the paper claims")
def _saobp_inference(m: Measurement) -> Judgement:
    return Judgement(BY_CONSTRUCTION, "the operator raises entropy by design; the paper's claim concerns "
                                      "training (next rows)")


def _training_testable(m: Measurement, need_collapse: bool) -> Judgement | None:
    seeds = m.estimates.get("seeds")
    if seeds is None or seeds.value < MIN_SEEDS:
        n = 0 if seeds is None else int(seeds.value)
        return Judgement(NOT_TESTABLE, f"{n} training seed(s) logged; the criterion needs at least {MIN_SEEDS}")
    if need_collapse:
        sink, entropy = m.estimates.get("baseline_sink"), m.estimates.get("baseline_norm_entropy")
        formed = (sink is not None and sink.value >= SINK_SHARE) or (
            entropy is not None and entropy.value <= COLLAPSED_ENTROPY)
        if not formed:
            return Judgement(NOT_TESTABLE, f"the baseline formed neither an attention sink (deep-layer sink share "
                                           f"{_v(sink)} < {SINK_SHARE}) nor an entropy collapse (normalised entropy "
                                           f"{_v(entropy)} > {COLLAPSED_ENTROPY}), so there is nothing to prevent")
    return None


def _v(est: Estimate | None) -> str:
    return "n/a" if est is None else f"{est.value:.2f}"


@claim("saobp_training_entropy", SAOBP_PAPER,
       "Trained with SAOBP, deep layers keep higher attention entropy than a baseline trained alike",
       "qualitative: SAOBP prevents entropy collapse in deep layers",
       "final deep-half entropy, SAOBP minus baseline (nats): mean over seeds, t-interval",
       f"testable with >= {MIN_SEEDS} seeds and a baseline that forms a sink (deep-layer sink share >= "
       f"{SINK_SHARE}) or collapses (normalised entropy <= {COLLAPSED_ENTROPY}); holds when the interval "
       "lies above 0")
def _saobp_training_entropy(m: Measurement) -> Judgement:
    gate = _training_testable(m, need_collapse=True) or _need(m, "entropy_diff")
    return gate or signed(m.estimates["entropy_diff"], +1, "SAOBP's deep layers have higher entropy")


@claim("saobp_training_loss", SAOBP_PAPER,
       "Trained with SAOBP, a small model reaches a lower held-out loss than the baseline",
       "qualitative: better small models",
       "final held-out loss, SAOBP minus baseline (nats/token): mean over seeds, t-interval",
       f"testable with >= {MIN_SEEDS} seeds; holds when the interval lies below 0")
def _saobp_training_loss(m: Measurement) -> Judgement:
    gate = _training_testable(m, need_collapse=False) or _need(m, "loss_diff")
    return gate or signed(m.estimates["loss_diff"], -1, "SAOBP's held-out loss is lower")


# ---------------------------------------------------------------------------------------
# Why some inputs break low-bit quantization


# Each claim below is a declaration of the same shape (statement, paper value, statistic, criterion,
# rule): the registry's entries repeat their form on purpose, one per finding.
@claim("agreement", QUANT_PAPER,
       "Per-example errors agree across quantization methods",
       "Pearson 0.82 (mean of 50 pairs; weakest model 0.66)",
       "mean Pearson over the paper's pairs (no same-algorithm, different-bits pair), bootstrap interval; "
       "3-bit-only and 4-bit-only means beside it",
       f"present: interval above 0; at level: the interval reaches {AGREEMENT_LEVEL} (the paper's weakest model)")
def _agreement(m: Measurement) -> Judgement:
    return _need(m, "pearson") or present_at_level(m.estimates["pearson"], 0.0, AGREEMENT_LEVEL, +1)


@claim("agreement_disattenuated", QUANT_PAPER,
       "Per-example errors agree across methods once measurement noise is removed (this project's noise ceiling)",
       "Pearson 0.82 (the paper does not correct for noise)",
       "mean over the same pairs of r_ab / sqrt(rel_a rel_b), rel = split-half reliability (odd vs even target "
       "tokens, Spearman-Brown); bootstrap interval",
       f"as for agreement: present above 0, at level when the interval reaches {AGREEMENT_LEVEL}")
def _agreement_disattenuated(m: Measurement) -> Judgement:
    return _need(m, "pearson") or present_at_level(m.estimates["pearson"], 0.0, AGREEMENT_LEVEL, +1)


@claim("jaccard_top10", QUANT_PAPER,
       "The top-10% error sets of different methods overlap far above chance",
       "Jaccard 0.51 (chance about 0.05)",
       "mean top-10% Jaccard over the paper's pairs, bootstrap interval; exact chance value",
       f"present: interval above chance; at level: the interval reaches {JACCARD_LEVEL}")
def _jaccard(m: Measurement) -> Judgement:
    chance = m.estimates.get("chance")
    if chance is None or not math.isfinite(chance.value):
        return Judgement(NOT_TESTABLE, "the chance overlap could not be computed here")
    return _need(m, "jaccard") or present_at_level(m.estimates["jaccard"], chance.value, JACCARD_LEVEL, +1)


@claim("norm_error", QUANT_PAPER,
       "The last layer's residual norm correlates negatively with the error",
       "-0.66 to -0.80 (3-bit methods, per-method Pearson averaged)",
       "Pearson(last-layer ||resid_mid||, error) per 3-bit method, averaged, bootstrap interval (shared "
       "resamples); the 4-bit average beside it",
       f"present: interval below 0; at level: the interval reaches {NORM_LEVEL} (the paper's weakest model)")
def _norm_error(m: Measurement) -> Judgement:
    return _need(m, "r_3bit") or present_at_level(m.estimates["r_3bit"], 0.0, NORM_LEVEL, -1)


@claim("reversal_h_mse", QUANT_PAPER,
       "corr(||h||, MLP-output MSE) exceeds 0.6 in most upper layers",
       "> 0.6 in most upper layers",
       "per upper layer, Pearson(||h||, MSE) with a bootstrap interval; the count of layers whose interval lies "
       "above 0.6, and whose interval reaches 0.6",
       f"holds when more than half the upper layers have their whole interval above {H_MSE_LEVEL}; partly when "
       "at least one does, or more than half reach it; otherwise does not hold")
def _reversal(m: Measurement) -> Judgement:
    if any(k not in m.estimates for k in ("layers_above", "layers_reaching", "upper_layers")):
        return Judgement(NOT_TESTABLE, "the per-layer correlations could not be computed here")
    above, reaching, total = (int(m.estimates[k].value) for k in ("layers_above", "layers_reaching", "upper_layers"))
    if above > total / 2:
        return Judgement(HOLDS, f"{above} of {total} upper layers lie wholly above {H_MSE_LEVEL}")
    if above >= 1 or reaching > total / 2:
        return Judgement(PARTLY, f"{above} of {total} upper layers lie wholly above {H_MSE_LEVEL}; {reaching} reach "
                                 "it")
    return Judgement(FAILS, f"no upper layer lies wholly above {H_MSE_LEVEL}; {reaching} of {total} reach it")


@claim("kurtosis", QUANT_PAPER,
       "Residual kurtosis is lower for D_large than for D_ctrl",
       "lower for D_large",
       "mean over layers of [mean log-kurtosis(D_large) - mean log-kurtosis(D_ctrl)] of resid_mid, bootstrap "
       "over examples within each set",
       "holds when the interval lies below 0")
def _kurtosis(m: Measurement) -> Judgement:
    return _need(m, "diff") or signed(m.estimates["diff"], -1, "D_large has lower kurtosis")


@claim("outlier_gamma", QUANT_PAPER,
       "The top-5 outlier dimensions of the residual get the smallest |gamma|",
       "the smallest gamma",
       "share of dimensions with a smaller |gamma| than the outlier dims (0 = smallest), mean over layers, "
       "bootstrap over layers",
       f"present: interval below 0.5 (random dims); at level: the interval reaches {OUTLIER_LEVEL} (the smallest "
       "10%)")
def _outlier_gamma(m: Measurement) -> Judgement:
    return _need(m, "percentile") or present_at_level(m.estimates["percentile"], 0.5, OUTLIER_LEVEL, -1)


def _early_exit(m: Measurement) -> Judgement:
    return _need(m, "share_after_split") or below_threshold(m.estimates["share_after_split"], EARLY_EXIT_SHARE + 1e-9)


_EARLY_EXIT_CRITERION = (
    f"share of layers after the split (the first layer from which the D_large gap stays >= half its final "
    f"value), bootstrap over D_large; holds when the whole interval is <= {EARLY_EXIT_SHARE} (the last quarter, "
    "where the paper's 17.5% lies), partly when it straddles, does not hold above; not testable when the lens "
    "is informative (reference NLL below log|V|) only inside the last quarter"
)

claim("early_exit_logit", QUANT_PAPER,
      "Early exit (logit lens): the quantized curve leaves the reference only in the last layers",
      "last ~7 of 40 layers (17.5%)",
      "split measured on the layers where the reference's logit lens beats uniform", _EARLY_EXIT_CRITERION,
      )(_early_exit)
claim("early_exit_tuned", QUANT_PAPER,
      "Early exit (tuned lens): the quantized curve leaves the reference only in the last layers",
      "last ~7 of 40 layers (17.5%)",
      "split under an affine translator per layer fitted on the calibration split", _EARLY_EXIT_CRITERION,
      )(_early_exit)


@claim("restoration", QUANT_PAPER,
       "Restoring the top layers (7 of 40) recovers little of D_large's loss",
       "8.67 -> 8.05 perplexity (reference 5.60): 20%",
       "recovery on the NLL scale, (NLL_q - NLL_k) / (NLL_q - NLL_ref), bootstrap over D_large; perplexity scale "
       "beside it",
       f"'little' means below {LITTLE}: holds when the whole interval lies below it, partly when it straddles")
def _restoration(m: Measurement) -> Judgement:
    return _need(m, "recovery") or below_threshold(m.estimates["recovery"], LITTLE)


def _strong_component(m: Measurement) -> Judgement:
    gate = _need(m, "recovery", "margin")
    if gate:
        return gate
    return two_part(m.estimates["margin"].low > 0, m.estimates["recovery"].low > STRONG,
                    "recovers more than up and attention (margin interval above 0)",
                    f"recovery above {STRONG} (whole interval)")


def _weak_component(m: Measurement) -> Judgement:
    gate = _need(m, "recovery", "margin")
    if gate:
        return gate
    return two_part(m.estimates["margin"].low > 0, m.estimates["recovery"].high < LITTLE,
                    "recovers less than down and gate (margin interval above 0)",
                    f"recovery below {LITTLE} (whole interval)")


_PATCH_STAT = ("recovery on the NLL scale over D_large (the patched model's own top 10%), bootstrap interval; "
               "margin = its gap to the other group, paired bootstrap")
for _component, _value, _strong in (("down", "93%", True), ("gate", "84%", True), ("up", "14% (Qwen -13%, Mistral "
                                    "-124%)", False), ("attn_out", "28%", False)):
    claim(f"patch_{_component}", QUANT_PAPER,
          f"Patching {_component} (upper half of layers) into the quantized model "
          + ("recovers most of the gap" if _strong else "recovers little"),
          f"{_value} recovery (Llama3-8B AWQ3)", _PATCH_STAT,
          (f"holds when its recovery exceeds both up's and attention's (margin interval above 0) and its whole "
           f"interval lies above {STRONG}; partly with one of the two") if _strong else
          (f"holds when its recovery is below both down's and gate's (margin interval above 0) and its whole "
           f"interval lies below {LITTLE}; partly with one of the two"),
          )(_strong_component if _strong else _weak_component)


@claim("gate_input", QUANT_PAPER,
       "Patching only the gate's input beats restoring the gate weights",
       "6.53 vs 10.45 perplexity (Llama3-8B NF3)",
       "mean NLL with the gate weights restored minus with the gate input patched, paired bootstrap over D_large",
       "holds when the interval lies above 0")
def _gate_input(m: Measurement) -> Judgement:
    return _need(m, "diff") or signed(m.estimates["diff"], +1, "patching the gate input gives the lower loss")


# ---------------------------------------------------------------------------------------
# Judging


def judge(key: str, measurement: Measurement | None) -> Judgement:
    """Apply claim ``key``'s rule (not testable when nothing was measured or the stage says why)."""
    if key not in CLAIMS:
        raise KeyError(f"unknown claim {key!r}; known: {', '.join(CLAIMS)}")
    if measurement is None:
        return Judgement(NOT_TESTABLE, "this report did not run the stage that measures it")
    if measurement.untestable:
        return Judgement(NOT_TESTABLE, measurement.untestable)
    return CLAIMS[key].rule(measurement)


COLUMNS = ["paper", "claim", "paper value", "statistic", "criterion", "measured here", "verdict", "why"]


def reproduction_frame(measurements: Mapping[str, Measurement], keys: list[str] | None = None) -> pd.DataFrame:
    """The reproduction table: one row per claim, in declaration order."""
    rows = []
    for key in keys if keys is not None else list(CLAIMS):
        c = CLAIMS[key]
        m = measurements.get(key)
        j = judge(key, m)
        rows.append({"paper": c.paper, "claim": c.claim, "paper value": c.paper_value, "statistic": c.statistic,
                     "criterion": c.criterion,
                     "measured here": "not run" if m is None else (m.text or "not measured (see why)"),
                     "verdict": j.verdict, "why": j.reason})
    return pd.DataFrame(rows, columns=COLUMNS)


def measurement_to_dict(m: Measurement) -> dict[str, object]:
    """JSON-ready form of a measurement (stages store it in ``numbers.json``)."""
    return {"estimates": {k: [e.value, e.low, e.high, e.n] for k, e in m.estimates.items()}, "text": m.text,
            "untestable": m.untestable}


def measurement_from_dict(d: Mapping[str, object]) -> Measurement:
    raw = d.get("estimates") or {}
    assert isinstance(raw, dict)

    def num(v: object) -> float:
        return math.nan if v is None else float(v)  # type: ignore[arg-type]

    estimates = {k: Estimate(num(v[0]), num(v[1]), num(v[2]), None if v[3] is None else int(v[3]))
                 for k, v in raw.items()}
    untestable = d.get("untestable")
    return Measurement(estimates, str(d.get("text", "")), None if untestable is None else str(untestable))


def side_by_side(tables: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """Several models' reproduction tables, row by row: claim, the paper's value, then each model's
    measurement and verdict, and whether the claim holds on all, some or none of them."""
    names = list(tables)
    first = next(iter(tables.values()))
    out = first[["paper", "claim", "paper value"]].copy()
    for name, table in tables.items():
        indexed = table.set_index("claim")
        out[f"{name}: measured"] = [indexed.loc[c, "measured here"] if c in indexed.index else "not run"
                                    for c in out["claim"]]
        out[f"{name}: verdict"] = [indexed.loc[c, "verdict"] if c in indexed.index else NOT_TESTABLE
                                   for c in out["claim"]]

    def across(row: pd.Series) -> str:
        verdicts = [row[f"{n}: verdict"] for n in names]
        if all(v == BY_CONSTRUCTION for v in verdicts):
            return BY_CONSTRUCTION
        phrases = []
        for verdict, label in ((HOLDS, "holds"), (PARTLY, "partly"), (FAILS, "does not hold"),
                               (NOT_TESTABLE, "not testable"), (BY_CONSTRUCTION, "by construction")):
            which = [n for n, v in zip(names, verdicts, strict=True) if v == verdict]
            if which:
                who = ("both" if len(names) == 2 else "all") if len(which) == len(names) else ", ".join(which)
                phrases.append(f"{label} on {who}")
        return "; ".join(phrases)

    out["across models"] = out.apply(across, axis=1)
    return out


def markdown_table(table: pd.DataFrame) -> str:
    """A plain pipe table (pipes inside cells escaped)."""
    def cell(v: object) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(c) for c in table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m interp.report.compare REPORT_DIR [REPORT_DIR ...] --out FOLDER``: the side-by-side table
    of several finished reports (their ``tables/reproduction.csv``), as CSV and markdown."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description="Compare the reproduction tables of finished reports.")
    parser.add_argument("reports", nargs="+", help="report folders (each holds results.json)")
    parser.add_argument("--out", required=True, help="folder for reproduction.csv and reproduction.md")
    args = parser.parse_args(argv)
    tables = {}
    for folder in map(Path, args.reports):
        results = json.loads((folder / "results.json").read_text())
        tables[str(results["settings"]["model"])] = pd.DataFrame(results["reproduction"])
    table = side_by_side(tables)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "reproduction.csv", index=False)
    (out / "reproduction.md").write_text(markdown_table(table.drop(columns=["paper"])))
    print(table[["claim"] + [c for c in table.columns if c.endswith("verdict")] + ["across models"]].to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
