"""Pre-registered reproduction claims: each paper finding, its statistic, and the rule that judges it.

Every finding the report reproduces is declared here once, before anything is measured:

- the paper, the claim in this project's words, and the paper's own number;
- the statistic measured here, always with a 95% interval when one can be computed;
- a criterion, fixed in code, that turns the statistic and its interval into one verdict.

**The verdicts** (what each asserts, and why a wider interval never earns a stronger one) are
defined in :mod:`interp.report.verdicts`, with the :class:`~interp.report.verdicts.Measurement` a rule reads.

**The levels** come from the papers' own numbers (the paper's weakest model where it reports
several); the few thresholds that are this project's own (:data:`LITTLE`, :data:`EARLY_EXIT_SHARE`)
are named as such, and were fixed before the confirmatory data were measured
(``docs/preregistration/``).

``judge`` applies a claim's rule; :func:`reproduction_frame` builds the report's table.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping

import pandas as pd
import scipy.stats as sps

from interp.report import verdicts
from interp.report.verdicts import (  # noqa: F401 (the claims' vocabulary, importable from here as before)
    AS_STRONG,
    BY_CONSTRUCTION,
    CONCLUDING,
    CONSISTENT,
    CONTRADICTED,
    DIAGNOSTIC,
    INSTANCE_LIMITED,
    NOT_SHOWN,
    NOT_TESTABLE,
    TOO_FEW,
    VERDICTS,
    WEAKER,
    Claim,
    Judgement,
    Measurement,
    Rule,
    Verdict,
    measurement_from_dict,
    measurement_to_dict,
)
from interp.stats import MIN_INSTANCES, Estimate

CONCLUSIONS: dict[str, frozenset[str]] = verdicts.CONCLUSIONS  # what each verdict asserts (named here for the rules)

SAOBP_PAPER = "SAOBP (arXiv 2509.07324)"
QUANT_PAPER = "Quantization errors (arXiv 2506.12044)"

# -- levels, each from the papers' own numbers (never from a measurement made here) ------------
# Every level is on the scale of the statistic its rule reads; a recovery is read on the NLL scale and its level
# is converted exactly from the paper's perplexities (unrounded). Principle: where the paper reports several
# models, the level is what all of them reach (the weakest); where it reports one, that model's number.


def nll_recovery(quantized: float, patched: float, reference: float) -> float:
    """Recovery on the NLL scale from three perplexities: ``(ln q - ln p) / (ln q - ln ref)``."""
    return (math.log(quantized) - math.log(patched)) / (math.log(quantized) - math.log(reference))


def ppl_recovery(quantized: float, patched: float, reference: float) -> float:
    """Recovery on the perplexity scale: ``(q - p) / (q - ref)`` (the paper's own percentages)."""
    return (quantized - patched) / (quantized - reference)


# The paper's Table 4, Llama3-8B AWQ3, D_large perplexity (docs: /work/shared/specs/quantization.md, section 7)
PATCH_PPL = {"reference": 5.62, "quantized": 10.68, "down": 5.95, "gate": 6.42, "up": 9.97, "attn_out": 9.27}
PATCH_LEVELS = {c: nll_recovery(PATCH_PPL["quantized"], PATCH_PPL[c], PATCH_PPL["reference"])
                for c in ("down", "gate", "up", "attn_out")}
PATCH_LEVELS_PPL = {c: ppl_recovery(PATCH_PPL["quantized"], PATCH_PPL[c], PATCH_PPL["reference"])
                    for c in ("down", "gate", "up", "attn_out")}
# Table 4's up-patching recovery per model (perplexity scale): the paper itself varies from -124% to +78%
UP_RECOVERY_BY_MODEL_PPL = {"Llama3-8B": 0.14, "Qwen2.5-7B": -0.13, "Mistral-12B": -1.24, "Llama3-70B": 0.78}
# The restoration experiment: top 7 of 40 layers (a 40-layer model, Mistral-12B AWQ3 as in the early-exit figure),
# D_large perplexity quantized 8.67 -> 8.05 with the layers restored, reference 5.60
RESTORATION_PPL = (8.67, 8.05, 5.60)
RESTORATION_LEVEL = nll_recovery(*RESTORATION_PPL)
RESTORATION_LEVEL_PPL = ppl_recovery(*RESTORATION_PPL)
AGREEMENT_LEVEL = 0.82  # the paper's stated mean Pearson over its 50 method pairs (all models; abstract and section 3)
JACCARD_LEVEL = 0.51  # the paper's mean top-10% Jaccard over pairs
NORM_LEVEL = -0.66  # the weakest of the paper's four last-layer correlations (Qwen2.5-7B; others -0.76 to -0.80)
H_MSE_LEVEL = 0.6  # the paper: corr(||h||, MLP-output MSE) "above 0.6 in most upper layers"
OUTLIER_LEVEL = 0.10  # "the outlier dims get the smallest gamma": within the smallest 10% of dims
EARLY_EXIT_LEVEL = 7 / 40  # the paper: the curves split in the last ~7 of 40 layers (Mistral-12B AWQ3)
# -- this project's own thresholds (not the paper's), fixed before the confirmatory measurement --
EARLY_EXIT_SHARE = 0.25  # "only the last layers": the last quarter, where the paper's 17.5% lies
LITTLE = 0.5  # "recovers little": less than half of the gap, on the NLL scale (the perplexity-scale reading beside
# uses half of the perplexity gap)
# SAOBP training is testable only where the baseline shows what SAOBP is claimed to prevent:
SINK_SHARE = 0.3  # baseline deep-layer mass on key 0 at the end of training, or ...
COLLAPSED_ENTROPY = 0.35  # ... baseline deep-layer normalised entropy (1 = uniform) at or below this
MIN_SEEDS = 3
# The fewest examples an interval over examples may rest on: the smallest n at which a nominal 95% percentile
# bootstrap interval of a mean of normal data covers at least 90% (its half-width is z sqrt((n-1)/n) s/sqrt(n)
# against the exact t_{n-1} s/sqrt(n): coverage 60% at n = 2, 89.8% at 9, 90.4% at 10). Below it a claim gets
# "too few examples for a verdict" (:func:`judge`).
MIN_EXAMPLES = 10
POWER_EFFECTS = (0.01, 0.02, 0.05)  # loss differences (nats/token) the seed count is sized for


CLAIMS: dict[str, Claim] = {}


def claim(key: str, paper: str, text: str, paper_value: str, statistic: str, criterion: str,
          model_independent: bool = False, min_n: int = 0) -> Callable[[Rule], Rule]:
    """Register ``rule`` as the criterion of claim ``key`` (claims keep their declaration order)."""

    def register(rule: Rule) -> Rule:
        if key in CLAIMS:
            raise ValueError(f"claim {key!r} is declared twice")
        CLAIMS[key] = Claim(key, paper, text, paper_value, statistic, criterion, rule, model_independent, min_n)
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
    """The quantitative rule: present (interval excludes ``null`` on the claimed side), then compared with
    the paper's ``level``.

    ``direction`` is +1 when the paper claims a value above ``null``, -1 when below.
    """
    lo, hi = (est.low, est.high) if direction > 0 else (-est.high, -est.low)
    nul, lev = direction * null, direction * level
    if hi < nul:
        return Judgement(CONTRADICTED, f"the whole interval lies on the other side of {null:.3g}")
    if lo <= nul:
        return Judgement(NOT_SHOWN, f"the interval includes {null:.3g}")
    if lo >= lev:
        return Judgement(AS_STRONG, f"the whole interval lies at or beyond the paper's level {level:g}")
    if hi >= lev:
        return Judgement(CONSISTENT, f"the interval excludes {null:.3g} and contains the paper's level {level:g}")
    return Judgement(WEAKER, f"present (the interval excludes {null:.3g}) but the whole interval falls short of "
                             f"the paper's level {level:g}")


def in_band(est: Estimate, floor: float, ceiling: float, level: float, below: str, above: str) -> Judgement:
    """A two-sided "little" rule: the claim puts the value in ``[floor, ceiling)``, the paper at ``level``.

    The whole interval below ``floor`` or at/above ``ceiling`` contradicts the claim, and the reason says
    which way (``below`` / ``above``: what happened, in words). Inside the band, the interval is compared
    with the paper's level as in :func:`present_at_level`, "beyond" meaning nearer the floor.
    """
    if est.high < floor:
        return Judgement(CONTRADICTED, f"{below} (the whole interval lies below {floor:g})")
    if est.low >= ceiling:
        return Judgement(CONTRADICTED, f"{above} (the whole interval lies at or above {ceiling:g})")
    if est.low < floor:
        return Judgement(NOT_SHOWN, f"the interval straddles {floor:g} ({below} cannot be excluded)")
    if est.high >= ceiling:
        return Judgement(NOT_SHOWN, f"the interval straddles {ceiling:g}")
    if est.high <= level:
        return Judgement(AS_STRONG, f"the whole interval lies in [{floor:g}, {level:g}], at or beyond the paper's "
                                    f"level {level:g}")
    if est.low <= level:
        return Judgement(CONSISTENT, f"the whole interval lies in [{floor:g}, {ceiling:g}) and contains the paper's "
                                     f"level {level:g}")
    return Judgement(WEAKER, f"the whole interval lies in ({level:g}, {ceiling:g}): little, but short of the "
                             f"paper's {level:g}")


def signed(est: Estimate, direction: int, what: str, reversed_what: str = "") -> Judgement:
    """A claim of direction only: as strong as the paper when the interval excludes 0 on the claimed side."""
    lo, hi = (est.low, est.high) if direction > 0 else (-est.high, -est.low)
    if lo > 0:
        return Judgement(AS_STRONG, f"the whole interval lies on the claimed side of 0: {what}")
    if hi < 0:
        return Judgement(CONTRADICTED, f"the whole interval lies on the other side of 0: "
                                       f"{reversed_what or what + ' reversed'}")
    return Judgement(NOT_SHOWN, "the interval includes 0")


def both(first: Judgement, second: Judgement) -> Judgement:
    """A claim with two parts (e.g. a level and an ordering): it asserts only what both parts assert.

    A contradicted part contradicts the claim; otherwise a part that is not shown leaves the claim not
    shown; otherwise the level part's verdict stands (the ordering part is then shown).
    """
    reason = f"{first.reason}; {second.reason}"
    for part in (first, second):
        if part.verdict == CONTRADICTED:
            return Judgement(CONTRADICTED, reason)
    for part in (first, second):
        if part.verdict in (NOT_SHOWN, NOT_TESTABLE):
            return Judgement(NOT_SHOWN, reason)
    return Judgement(first.verdict, reason)


@functools.lru_cache(maxsize=256)
def seeds_for_power(sd: float, effect: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Seeds a paired two-sided t-test needs to detect a mean difference ``effect`` with ``power``.

    The smallest n >= 2 whose exact power (noncentral t) reaches ``power`` given the per-seed
    standard deviation ``sd`` of the difference. The search starts a little below the normal
    approximation ``((z_a + z_b) sd / effect)^2``, which never overestimates n.
    """
    if not (math.isfinite(sd) and sd > 0 and effect > 0):
        return 0

    def achieved(n: int) -> float:
        df, shift = n - 1, effect / (sd / math.sqrt(n))
        crit = sps.t.ppf(1 - alpha / 2, df)
        return float(1 - sps.nct.cdf(crit, df, shift) + sps.nct.cdf(-crit, df, shift))

    normal = ((sps.norm.ppf(1 - alpha / 2) + sps.norm.ppf(power)) * sd / effect) ** 2
    n = max(2, int(normal))
    while n > 2 and achieved(n - 1) >= power:
        n -= 1
    while achieved(n) < power:
        n += 1
    return n


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


def _underpowered(judgement: Judgement, m: Measurement, name: str) -> Judgement:
    """A "not shown" over seeds says how many seeds would detect effects of the stated sizes."""
    sd = m.estimates.get(f"{name}_sd")
    if judgement.verdict != NOT_SHOWN or sd is None:
        return judgement
    needed = ", ".join(f"{seeds_for_power(sd.value, d)} seeds for {d:g}" for d in POWER_EFFECTS)
    return Judgement(NOT_SHOWN, f"{judgement.reason}; underpowered: with the per-seed sd {sd.value:.3f}, 80% power "
                                f"at the 5% level needs {needed} nats/token (the paper states no effect size)")


@claim("saobp_training_entropy", SAOBP_PAPER,
       "Trained with SAOBP, deep layers keep higher attention entropy than a baseline trained alike",
       "qualitative: SAOBP prevents entropy collapse in deep layers",
       "final deep-half entropy, SAOBP minus baseline (nats): mean over seeds, t-interval",
       f"testable with >= {MIN_SEEDS} seeds and a baseline that forms a sink (deep-layer sink share >= "
       f"{SINK_SHARE}) or collapses (normalised entropy <= {COLLAPSED_ENTROPY}); as strong as the paper when the "
       "interval lies above 0", model_independent=True)
def _saobp_training_entropy(m: Measurement) -> Judgement:
    gate = _training_testable(m, need_collapse=True) or _need(m, "entropy_diff")
    return gate or signed(m.estimates["entropy_diff"], +1, "SAOBP's deep layers have higher entropy")


@claim("saobp_training_loss", SAOBP_PAPER,
       "Trained with SAOBP, a small model reaches a lower held-out loss than the baseline",
       "qualitative: better small models",
       "final held-out loss, SAOBP minus baseline (nats/token): mean over seeds, t-interval; the seeds a paired "
       "t-test would need beside it",
       f"testable with >= {MIN_SEEDS} seeds; as strong as the paper when the interval lies below 0",
       model_independent=True)
def _saobp_training_loss(m: Measurement) -> Judgement:
    gate = _training_testable(m, need_collapse=False) or _need(m, "loss_diff")
    if gate:
        return gate
    judgement = signed(m.estimates["loss_diff"], -1, "SAOBP's held-out loss is lower",
                       "SAOBP's held-out loss is higher")
    return _underpowered(judgement, m, "loss_diff")


@claim("saobp_training_gtd", SAOBP_PAPER,
       "Trained with SAOBP, global token dependency stays at task-appropriate levels",
       "qualitative: GTD kept at task-appropriate levels (no number given)",
       "final deep-half GTD, SAOBP minus baseline: mean over seeds, t-interval (shown, not judged)",
       "not testable: the paper defines no task-appropriate GTD level or range to compare with",
       model_independent=True)
def _saobp_training_gtd(m: Measurement) -> Judgement:
    return Judgement(NOT_TESTABLE, "the paper gives no quantitative level or range for 'task-appropriate' GTD, so "
                                   "no interval can be judged against it; the measured difference is shown")


# ---------------------------------------------------------------------------------------
# Why some inputs break low-bit quantization


# Each claim below is a declaration of the same shape (statement, paper value, statistic, criterion,
# rule): the registry's entries repeat their form on purpose, one per finding.
_LEVEL_RULE = ("as strong as the paper when the whole interval lies at or beyond {level}, 'present; level not "
               "resolved' when it excludes {null} and contains {level}, weaker when it excludes {null} but falls "
               "short of {level}, not shown when it includes {null}, contradicted when it lies wholly on the other "
               "side of {null}")


@claim("agreement", QUANT_PAPER,
       "Per-example errors agree across quantization methods",
       "Pearson 0.82 (mean over the paper's 50 method pairs, all its models; abstract and section 3)",
       "mean Pearson over the paper's pairs (no same-algorithm, different-bits pair), bootstrap interval; "
       "3-bit-only and 4-bit-only means and each calibrated method's across-instance self-agreement beside it",
       _LEVEL_RULE.format(level=f"{AGREEMENT_LEVEL} (the paper's mean over 50 pairs)", null="0"), min_n=MIN_EXAMPLES)
def _agreement(m: Measurement) -> Judgement:
    return _need(m, "pearson") or present_at_level(m.estimates["pearson"], 0.0, AGREEMENT_LEVEL, +1)


@claim("agreement_disattenuated", QUANT_PAPER,
       "Per-example errors agree across methods once token noise is removed (this project's noise ceiling)",
       "Pearson 0.82 (the paper does not correct for noise)",
       "mean over the same pairs of r(a odd, b even) / sqrt(r(a odd, a even) r(b odd, b even)): disjoint target "
       "tokens in the numerator, so the two errors share no token noise; bootstrap interval",
       "a diagnostic, not judged: the paper makes no noise-corrected claim. A correction is valid only when every "
       "pair's denominator interval excludes 0 and no corrected value (point or interval) exceeds 1; otherwise the "
       "row says 'correction not valid here'", min_n=MIN_EXAMPLES)
def _agreement_disattenuated(m: Measurement) -> Judgement:
    gate = _need(m, "pearson", "ceiling")
    if gate:
        return gate
    est, ceiling = m.estimates["pearson"], m.estimates["ceiling"]
    if ceiling.low <= 0:
        return Judgement(NOT_TESTABLE, f"correction not valid here: the smallest reliability's interval includes 0 "
                                       f"({ceiling.text(2)})")
    if est.value > 1 or est.high > 1:
        return Judgement(NOT_TESTABLE, f"correction not valid here: the corrected agreement reaches above 1 "
                                       f"({est.text(2)}), so the noise model's assumptions do not hold")
    return Judgement(DIAGNOSTIC, "the paper makes no noise-corrected claim: the corrected agreement is shown as a "
                                 "diagnostic beside the agreement row")


@claim("jaccard_top10", QUANT_PAPER,
       "The top-10% error sets of different methods overlap far above chance",
       "Jaccard 0.51 (chance about 0.05)",
       "mean top-10% Jaccard over the paper's pairs, bootstrap interval; exact chance value",
       _LEVEL_RULE.format(level=f"{JACCARD_LEVEL}", null="chance"), min_n=MIN_EXAMPLES)
def _jaccard(m: Measurement) -> Judgement:
    chance = m.estimates.get("chance")
    if chance is None or not math.isfinite(chance.value):
        return Judgement(NOT_TESTABLE, "the chance overlap could not be computed here")
    return _need(m, "jaccard") or present_at_level(m.estimates["jaccard"], chance.value, JACCARD_LEVEL, +1)


@claim("norm_error", QUANT_PAPER,
       "The last layer's residual norm correlates negatively with the error",
       "-0.66 to -0.80 (3-bit methods, per-method Pearson averaged)",
       "Pearson(last-layer ||resid_mid||, error) per 3-bit method, averaged, bootstrap interval (shared "
       "resamples) over all examples; the 4-bit average beside it",
       _LEVEL_RULE.format(level=f"{NORM_LEVEL} (the paper's weakest model)", null="0"), min_n=MIN_EXAMPLES)
def _norm_error(m: Measurement) -> Judgement:
    return _need(m, "r_3bit") or present_at_level(m.estimates["r_3bit"], 0.0, NORM_LEVEL, -1)


@claim("reversal_h_mse", QUANT_PAPER,
       "corr(||h||, MLP-output MSE) exceeds 0.6 in most upper layers",
       "> 0.6 in most upper layers",
       "per upper layer, Pearson(||h||, MSE) with a bootstrap interval (over all examples from registration 2 on; "
       "the selected sets before); the count of layers whose interval lies wholly above 0.6 and wholly below it",
       f"as strong as the paper when more than half the upper layers lie wholly above {H_MSE_LEVEL}; contradicted "
       f"when at least half lie wholly below it; otherwise not shown")
def _reversal(m: Measurement) -> Judgement:
    if any(k not in m.estimates for k in ("layers_above", "layers_below", "upper_layers")):
        return Judgement(NOT_TESTABLE, "the per-layer correlations could not be computed here")
    above, below, total = (int(m.estimates[k].value) for k in ("layers_above", "layers_below", "upper_layers"))
    counts = f"{above} of {total} upper layers lie wholly above {H_MSE_LEVEL}, {below} wholly below"
    if above > total / 2:
        return Judgement(AS_STRONG, counts)
    if below >= total / 2:
        return Judgement(CONTRADICTED, counts)
    return Judgement(NOT_SHOWN, counts)


@claim("kurtosis", QUANT_PAPER,
       "Residual kurtosis is lower for D_large than for D_ctrl",
       "lower for D_large",
       "mean over layers of [mean log-kurtosis(D_large) - mean log-kurtosis(D_ctrl)] of resid_mid, bootstrap "
       "over examples within each set",
       "as strong as the paper when the interval lies below 0 (a claim of direction only)",
       min_n=2 * MIN_EXAMPLES)  # its n counts D_large and D_ctrl together
def _kurtosis(m: Measurement) -> Judgement:
    return _need(m, "diff") or signed(m.estimates["diff"], -1, "D_large has lower kurtosis",
                                      "D_large has higher kurtosis")


@claim("outlier_gamma", QUANT_PAPER,
       "The top-5 outlier dimensions of the residual get the smallest |gamma|",
       "the smallest gamma",
       "share of dimensions with a smaller |gamma| than the outlier dims (0 = smallest), mean over layers, "
       "block bootstrap over layers (blocks of 3 adjacent layers)",
       _LEVEL_RULE.format(level=f"{OUTLIER_LEVEL} (the smallest 10%)", null="0.5 (random dims)"))
def _outlier_gamma(m: Measurement) -> Judgement:
    return _need(m, "percentile") or present_at_level(m.estimates["percentile"], 0.5, OUTLIER_LEVEL, -1)


SPLIT_FRACTIONS = (0.33, 0.5, 0.67)  # the split rules registered for early exit (0.5 is share_after_split)


def _share_key(fraction: float) -> str:
    return "share_after_split" if fraction == 0.5 else f"share_after_split_{fraction:g}"


def agreeing(parts: Mapping[str, Judgement]) -> Judgement:
    """One verdict from several readings of the same claim: it asserts only what every reading asserts (the
    intersection of their :data:`CONCLUSIONS`), so a claim that holds under one split rule and not another is
    not shown, and one as strong under one and weaker under another is present with its level not resolved."""
    common = functools.reduce(frozenset.__and__, (CONCLUSIONS[j.verdict] for j in parts.values()))
    reason = "; ".join(f"{name}: {j.verdict} ({j.reason})" for name, j in parts.items())
    for verdict in (AS_STRONG, WEAKER, CONSISTENT, CONTRADICTED):
        if CONCLUSIONS[verdict] == common:
            return Judgement(verdict, reason)
    return Judgement(NOT_SHOWN, reason)


def _early_exit(m: Measurement) -> Judgement:
    gate = _need(m, "share_after_split")
    if gate:
        return gate
    keys = [_share_key(f) for f in SPLIT_FRACTIONS if _share_key(f) in m.estimates]
    parts = {f"split at {f:g} of the final gap": in_band(m.estimates[_share_key(f)], 0.0, EARLY_EXIT_SHARE + 1e-9,
                                                         EARLY_EXIT_LEVEL, below="impossible",
                                                         above="the curves split before the last quarter")
             for f in SPLIT_FRACTIONS if _share_key(f) in keys}
    missing = [k for k in keys if _need(m, k)]
    if missing:
        return _need(m, missing[0])  # type: ignore[return-value]
    return agreeing(parts)


_EARLY_EXIT_CRITERION = (
    f"share of layers after the split (the first layer from which the D_large gap stays >= a fraction of its final "
    f"value), bootstrap over D_large, at each registered fraction {SPLIT_FRACTIONS} that was measured (0.5 alone in "
    f"runs before registration 2); the verdict asserts only what every fraction's reading asserts; "
    f"the claim puts it in the last quarter (<= {EARLY_EXIT_SHARE}, this project's "
    f"reading of 'only the last layers'), the paper at {EARLY_EXIT_LEVEL:.3f}: as strong when the whole interval "
    f"is <= {EARLY_EXIT_LEVEL:.3f}, 'present; level not resolved' when it lies within the quarter and "
    f"contains it, weaker when it lies "
    f"within the quarter above it, not shown when it straddles {EARLY_EXIT_SHARE}, contradicted above; not testable "
    "when the lens is informative (reference NLL below log|V|) only inside the last quarter"
)

claim("early_exit_logit", QUANT_PAPER,
      "Early exit (logit lens): the quantized curve leaves the reference only in the last layers",
      "last ~7 of 40 layers (17.5%)",
      "split measured on the layers where the reference's logit lens beats uniform", _EARLY_EXIT_CRITERION,
      min_n=MIN_EXAMPLES)(_early_exit)
claim("early_exit_tuned", QUANT_PAPER,
      "Early exit (tuned lens): the quantized curve leaves the reference only in the last layers",
      "last ~7 of 40 layers (17.5%)",
      "split under an affine translator per layer fitted on the calibration split", _EARLY_EXIT_CRITERION,
      min_n=MIN_EXAMPLES)(_early_exit)

_LITTLE_RULE = (f"the claim puts the recovery in [0, {LITTLE}) ('little': this project's threshold), the paper at "
                "{level}: as strong when the whole interval lies in [0, {level}], 'present; level not resolved' "
                "when it lies in the band "
                "and contains {level}, weaker when it lies in the band above {level}, not shown when it straddles 0 or "
                f"{LITTLE}, contradicted when it lies wholly below 0 (the intervention makes the model worse) or "
                f"wholly at or above {LITTLE}")


@claim("restoration", QUANT_PAPER,
       "Restoring the top layers (7 of 40) recovers little of D_large's loss",
       f"8.67 -> 8.05 perplexity (reference 5.60; a 40-layer model, Mistral-12B AWQ3): 20% on perplexity, "
       f"{RESTORATION_LEVEL:.4f} on NLL",
       "recovery on the NLL scale, (NLL_q - NLL_k) / (NLL_q - NLL_ref), bootstrap over D_large; the perplexity "
       "scale beside it; where measured, top-k minus the mean of the random k-layer draws, paired on the same "
       "examples",
       "two parts where the paired control was measured (else the level alone): the top layers recover more than "
       "as many random layers (as strong when the paired interval lies above 0, contradicted below), and the level: "
       + _LITTLE_RULE.format(level=f"{RESTORATION_LEVEL:.4f} (NLL scale)"), min_n=MIN_EXAMPLES)
def _restoration(m: Measurement) -> Judgement:
    gate = _need(m, "recovery")
    if gate:
        return gate
    level = _with_ppl(m, in_band(m.estimates["recovery"], 0.0, LITTLE, RESTORATION_LEVEL,
                                 below="restoring the reference layers makes the model worse",
                                 above="restoration recovers more than little"),
                      lambda e: in_band(e, 0.0, LITTLE, RESTORATION_LEVEL_PPL, below="worse", above="more than little"))
    if "top_minus_random" not in m.estimates:
        return level
    return _need(m, "top_minus_random") or both(level, signed(
        m.estimates["top_minus_random"], +1, "the top layers recover more than random ones",
        "random layers recover more than the top ones"))


def _with_ppl(m: Measurement, judgement: Judgement, rule: Callable[[Estimate], Judgement]) -> Judgement:
    """The NLL-scale judgement, with the perplexity-scale reading of the same rule beside it (shown, not judged)."""
    ppl = m.estimates.get("recovery_ppl")
    if ppl is None or not ppl.has_interval:
        return judgement
    return Judgement(judgement.verdict, f"{judgement.reason}; on the perplexity scale (shown, not judged): "
                                        f"{rule(ppl).verdict}")


def _ordering(m: Measurement, stronger: bool) -> Judgement:
    return signed(m.estimates["margin"], +1,
                  "recovers more than up and attention" if stronger else "recovers less than down and gate",
                  "recovers less than up or attention" if stronger else "recovers more than down or gate")


def _component_rule(component: str, strong: bool) -> Rule:
    level, level_ppl = PATCH_LEVELS[component], PATCH_LEVELS_PPL[component]

    def rule(m: Measurement) -> Judgement:
        if component == "up":  # the paper's own level varies by model: the ordering alone is tested
            gate = _need(m, "margin")
            return gate or _ordering(m, stronger=False)
        gate = _need(m, "recovery", "margin")
        if gate:
            return gate
        recovery = m.estimates["recovery"]
        if strong:
            return both(_with_ppl(m, present_at_level(recovery, 0.0, level, +1),
                                  lambda e: present_at_level(e, 0.0, level_ppl, +1)), _ordering(m, stronger=True))
        return both(_with_ppl(m, in_band(recovery, 0.0, LITTLE, level, below="patching it makes the model worse",
                                         above="it recovers more than little"),
                              lambda e: in_band(e, 0.0, LITTLE, level_ppl, below="worse", above="more than little")),
                    _ordering(m, stronger=False))

    return rule


_PATCH_STAT = ("recovery on the NLL scale over D_large, bootstrap interval (perplexity scale beside it); "
               "margin = its gap to the other group, paired bootstrap")
_UP_SPREAD = ", ".join(f"{model} {100 * v:+.0f}%" for model, v in UP_RECOVERY_BY_MODEL_PPL.items())
for _component, _strong in (("down", True), ("gate", True), ("up", False), ("attn_out", False)):
    _level = PATCH_LEVELS[_component]
    _value = (f"{PATCH_PPL[_component]} perplexity (quantized {PATCH_PPL['quantized']}, reference "
              f"{PATCH_PPL['reference']}): {100 * PATCH_LEVELS_PPL[_component]:.1f}% on perplexity, {_level:.4f} on "
              f"NLL (Table 4, Llama3-8B AWQ3)")
    if _component == "up":
        _value += f"; the paper's own up recovery varies by model: {_UP_SPREAD}"
    claim(f"patch_{_component}", QUANT_PAPER,
          f"Patching {_component} (upper half of layers) into the quantized model "
          + ("recovers most of the gap" if _strong else "recovers less than down and gate" if _component == "up"
             else "recovers little"),
          _value, _PATCH_STAT,
          ("two parts, both needed: the ordering (margin to up and attention: as strong when its interval lies "
           "above 0, contradicted below) and the level on the NLL scale: "
           + _LEVEL_RULE.format(level=f"{_level:.4f}", null="0"))
          if _strong else
          ("the ordering alone (margin to down and gate: as strong when its interval lies above 0, contradicted "
           f"below): the paper's own up recovery ranges over {_UP_SPREAD} (Table 4), so no level or band holds on "
           "all its models" if _component == "up" else
           "two parts, both needed: the ordering (margin to down and gate: shown when its interval lies above 0, "
           "contradicted below) and the level on the NLL scale: " + _LITTLE_RULE.format(level=f"{_level:.4f}")),
          min_n=MIN_EXAMPLES)(_component_rule(_component, _strong))


@claim("gate_input", QUANT_PAPER,
       "Patching only the gate's input beats restoring the gate weights",
       "6.53 vs 10.45 perplexity (Llama3-8B NF3)",
       "mean NLL with the gate weights restored minus with the gate input patched, paired bootstrap over D_large",
       "as strong as the paper when the interval lies above 0 (a claim of direction only)", min_n=MIN_EXAMPLES)
def _gate_input(m: Measurement) -> Judgement:
    return _need(m, "diff") or signed(m.estimates["diff"], +1, "patching the gate input gives the lower loss",
                                      "restoring the gate weights gives the lower loss")


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
    counts = [e.n for e in measurement.estimates.values() if e.n is not None and e.has_interval]
    if counts and min(counts) < CLAIMS[key].min_n:  # the one place a small sample withholds the verdict
        return Judgement(TOO_FEW, f"its interval rests on {min(counts)} examples; this claim needs at least "
                                  f"{CLAIMS[key].min_n} (MIN_EXAMPLES in interp/report/reproduction.py)")
    judgement = CLAIMS[key].rule(measurement)
    instances = measurement.estimates.get("instances")
    if instances is not None and instances.value < MIN_INSTANCES and judgement.verdict in CONCLUDING:
        return Judgement(INSTANCE_LIMITED, f"{int(instances.value)} calibrated instance(s): the instance component "
                                           f"needs at least {MIN_INSTANCES}; over the examples alone the rule reads "
                                           f"'{judgement.verdict}' ({judgement.reason})")
    return judgement


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


def __getattr__(name: str) -> object:
    """The side-by-side comparison of finished reports, still importable from here: it lives in
    :mod:`interp.report.compare`, which reads this module's claims (looked up on use, so the two import no cycle)."""
    if name in ("comparison", "side_by_side", "markdown_table", "main"):
        import importlib

        return getattr(importlib.import_module("interp.report.compare"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":  # python -m interp.report.compare is the command; this name still runs it
    raise SystemExit(__getattr__("main")())  # type: ignore[operator]
