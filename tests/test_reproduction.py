"""The pre-registered reproduction criteria and the paper-protocol statistics behind them.

Every claim's rule gets synthetic statistics that must land on each of its outcomes; every
statistic is checked against a naive computation (explicit loops, scipy) or a known case.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import scipy.stats as sps

from interp.quant import protocol as pr
from interp.report import reproduction as rp
from interp.stats import Estimate

M = rp.Measurement


def E(value: float, low: float, high: float) -> Estimate:  # noqa: N802 - reads like the maths
    return Estimate(value, low, high, 100)


def count(v: int) -> Estimate:
    return Estimate(v, v, v)


SEEDS_OK = {"seeds": count(3), "baseline_sink": Estimate(0.6), "baseline_norm_entropy": Estimate(0.8)}
NO_SINK = {"seeds": count(3), "baseline_sink": Estimate(0.05), "baseline_norm_entropy": Estimate(0.8)}
COLLAPSED = {"seeds": count(3), "baseline_sink": Estimate(0.05), "baseline_norm_entropy": Estimate(0.2)}

S, C, W, NS, X = rp.AS_STRONG, rp.CONSISTENT, rp.WEAKER, rp.NOT_SHOWN, rp.CONTRADICTED
SD = {"loss_diff_sd": Estimate(0.06)}

# claim -> [(measurement, expected verdict)]: every outcome each rule can give
CASES: dict[str, list[tuple[rp.Measurement, str]]] = {
    "saobp_inference": [(M(text="x"), rp.BY_CONSTRUCTION)],
    "saobp_training_entropy": [
        (M({**SEEDS_OK, "entropy_diff": E(0.3, 0.1, 0.5)}), S),
        (M({**COLLAPSED, "entropy_diff": E(0.3, 0.1, 0.5)}), S),
        (M({**SEEDS_OK, "entropy_diff": E(0.1, -0.1, 0.3)}), NS),
        (M({**SEEDS_OK, "entropy_diff": E(-0.3, -0.5, -0.1)}), X),
        (M({**NO_SINK, "entropy_diff": E(0.3, 0.1, 0.5)}), rp.NOT_TESTABLE),
        (M({"seeds": count(2), "entropy_diff": E(0.3, 0.1, 0.5)}), rp.NOT_TESTABLE),
    ],
    "saobp_training_loss": [
        (M({**NO_SINK, **SD, "loss_diff": E(-0.05, -0.08, -0.02)}), S),
        (M({**NO_SINK, **SD, "loss_diff": E(-0.01, -0.03, 0.01)}), NS),
        (M({**NO_SINK, **SD, "loss_diff": E(0.05, 0.02, 0.08)}), X),
    ],
    "saobp_training_gtd": [(M({**NO_SINK, "gtd_diff": E(0.05, 0.01, 0.09)}), rp.NOT_TESTABLE)],
    "agreement": [
        (M({"pearson": E(0.88, 0.83, 0.93)}), S),
        (M({"pearson": E(0.78, 0.7, 0.85)}), C),  # contains the paper's mean 0.82
        (M({"pearson": E(0.63, 0.59, 0.66)}), W),  # registration 1's agreement: below 0.82
        (M({"pearson": E(0.1, -0.05, 0.2)}), NS),
        (M({"pearson": E(-0.3, -0.4, -0.2)}), X),
    ],
    "agreement_disattenuated": [
        (M({"pearson": E(0.8, 0.7, 0.9), "ceiling": E(0.5, 0.3, 0.6)}), rp.DIAGNOSTIC),  # never a verdict
        (M({"pearson": E(-0.3, -0.4, -0.2), "ceiling": E(0.5, 0.3, 0.6)}), rp.DIAGNOSTIC),
        (M({"pearson": E(0.9, 0.8, 1.2), "ceiling": E(0.5, 0.3, 0.6)}), rp.NOT_TESTABLE),  # above 1
        (M({"pearson": E(0.8, 0.7, 0.9), "ceiling": E(0.3, -0.05, 0.5)}), rp.NOT_TESTABLE),  # denominator spans 0
    ],
    "jaccard_top10": [
        (M({"jaccard": E(0.6, 0.52, 0.7), "chance": Estimate(0.05)}), S),
        (M({"jaccard": E(0.5, 0.4, 0.6), "chance": Estimate(0.05)}), C),
        (M({"jaccard": E(0.25, 0.15, 0.35), "chance": Estimate(0.05)}), W),
        (M({"jaccard": E(0.06, 0.03, 0.1), "chance": Estimate(0.05)}), NS),
        (M({"jaccard": E(0.02, 0.01, 0.03), "chance": Estimate(0.05)}), X),
    ],
    "norm_error": [
        (M({"r_3bit": E(-0.75, -0.8, -0.7)}), S),
        (M({"r_3bit": E(-0.6, -0.7, -0.5)}), C),
        (M({"r_3bit": E(-0.41, -0.55, -0.27)}), W),
        (M({"r_3bit": E(-0.1, -0.2, 0.05)}), NS),
        (M({"r_3bit": E(0.3, 0.2, 0.4)}), X),
    ],
    "reversal_h_mse": [
        (M({"layers_above": count(9), "layers_below": count(0), "upper_layers": count(15)}), S),
        (M({"layers_above": count(2), "layers_below": count(3), "upper_layers": count(15)}), NS),
        (M({"layers_above": count(0), "layers_below": count(8), "upper_layers": count(15)}), X),
    ],
    "kurtosis": [
        (M({"diff": E(-0.2, -0.3, -0.1)}), S),
        (M({"diff": E(-0.05, -0.2, 0.1)}), NS),
        (M({"diff": E(0.2, 0.1, 0.3)}), X),
    ],
    "outlier_gamma": [
        (M({"percentile": E(0.05, 0.02, 0.09)}), S),
        (M({"percentile": E(0.12, 0.08, 0.2)}), C),
        (M({"percentile": E(0.26, 0.15, 0.38)}), W),
        (M({"percentile": E(0.5, 0.35, 0.65)}), NS),
        (M({"percentile": E(0.7, 0.6, 0.8)}), X),
    ],
    "early_exit_logit": [
        (M({"share_after_split": E(0.1, 0.05, 0.15)}), S),
        (M({"share_after_split": E(0.17, 0.1, 0.25)}), C),
        (M({"share_after_split": E(0.22, 0.2, 0.24)}), W),
        (M({"share_after_split": E(0.3, 0.2, 0.4)}), NS),
        (M({"share_after_split": E(0.6, 0.5, 0.7)}), X),
        (M(untestable="lens uninformative"), rp.NOT_TESTABLE),
    ],
    "early_exit_tuned": [
        (M({"share_after_split": E(0.1, 0.05, 0.15)}), S),
        (M({"share_after_split": E(0.3, 0.2, 0.9)}), NS),
        (M({"share_after_split": E(0.6, 0.5, 0.9)}), X),
        # registration 2 reads all three split rules: the verdict asserts what all three assert
        (M({"share_after_split": E(0.1, 0.05, 0.15), "share_after_split_0.33": E(0.12, 0.1, 0.15),
            "share_after_split_0.67": E(0.05, 0.03, 0.1)}), S),
        (M({"share_after_split": E(0.22, 0.2, 0.23), "share_after_split_0.33": E(0.33, 0.32, 0.37),
            "share_after_split_0.67": E(0.1, 0.1, 0.13)}), NS),  # registration 1's three fractions
        (M({"share_after_split": E(0.22, 0.2, 0.23), "share_after_split_0.33": E(0.1, 0.05, 0.15),
            "share_after_split_0.67": E(0.1, 0.05, 0.15)}), C),  # weaker at one, as strong at two: level unresolved
    ],
    "restoration": [
        (M({"recovery": E(0.1, 0.05, 0.15)}), S),
        (M({"recovery": E(0.2, 0.1, 0.3)}), C),
        (M({"recovery": E(0.4, 0.3, 0.45)}), W),
        (M({"recovery": E(0.4, 0.3, 0.55)}), NS),
        (M({"recovery": E(0.05, -0.05, 0.15)}), NS),
        (M({"recovery": E(0.7, 0.6, 0.8)}), X),
        (M({"recovery": E(-0.3, -0.4, -0.2)}), X),  # restoring makes the model worse
        (M({"recovery": E(0.1, 0.05, 0.15), "top_minus_random": E(0.08, 0.05, 0.11)}), S),
        (M({"recovery": E(0.1, 0.05, 0.15), "top_minus_random": E(0.02, -0.01, 0.05)}), NS),
        (M({"recovery": E(0.1, 0.05, 0.15), "top_minus_random": E(-0.05, -0.08, -0.02)}), X),
    ],
    "patch_down": [
        (M({"recovery": E(0.96, 0.94, 0.98), "margin": E(0.5, 0.3, 0.7)}), S),
        (M({"recovery": E(0.9, 0.8, 1.0), "margin": E(0.5, 0.3, 0.7)}), C),
        (M({"recovery": E(0.4, 0.3, 0.5), "margin": E(0.5, 0.3, 0.7)}), W),
        (M({"recovery": E(0.9, 0.8, 1.0), "margin": E(0.1, -0.1, 0.3)}), NS),
        (M({"recovery": E(0.3, 0.1, 0.5), "margin": E(-0.3, -0.5, -0.2)}), X),
        (M(untestable="no gate"), rp.NOT_TESTABLE),
    ],
    "patch_gate": [
        (M({"recovery": E(0.9, 0.85, 0.95), "margin": E(0.4, 0.2, 0.6)}), S),
        (M({"recovery": E(0.85, 0.7, 0.95), "margin": E(0.4, 0.2, 0.6)}), C),
        (M({"recovery": E(0.6, 0.4, 0.75), "margin": E(0.4, 0.2, 0.6)}), W),
        (M({"recovery": E(0.1, -0.1, 0.2), "margin": E(0.4, 0.2, 0.6)}), NS),
        (M({"recovery": E(0.1, 0.0, 0.2), "margin": E(-0.4, -0.6, -0.2)}), X),
    ],
    "patch_up": [  # the paper's own up recovery ranges from -124% to +78%: the ordering alone is judged
        (M({"recovery": E(-1.95, -2.3, -1.6), "margin": E(2.4, 2.1, 2.7)}), S),
        (M({"recovery": E(0.5, 0.3, 0.7), "margin": E(0.1, -0.1, 0.3)}), NS),
        (M({"recovery": E(0.8, 0.7, 0.9), "margin": E(-0.2, -0.3, -0.1)}), X),
    ],
    "patch_attn_out": [
        (M({"recovery": E(0.15, 0.1, 0.2), "margin": E(0.3, 0.1, 0.5)}), S),
        (M({"recovery": E(0.3, 0.2, 0.4), "margin": E(0.3, 0.1, 0.5)}), C),
        (M({"recovery": E(0.4, 0.35, 0.45), "margin": E(0.3, 0.1, 0.5)}), W),
        (M({"recovery": E(0.3, 0.2, 0.4), "margin": E(0.0, -0.1, 0.1)}), NS),
        (M({"recovery": E(0.6, 0.55, 0.7), "margin": E(0.0, -0.1, 0.1)}), X),
    ],
    "gate_input": [
        (M({"diff": E(0.2, 0.1, 0.3)}), S),
        (M({"diff": E(0.0, -0.1, 0.1)}), NS),
        (M({"diff": E(-0.2, -0.3, -0.1)}), X),
    ],
}

# the outcomes each rule can produce (not testable comes from missing data for every rule)
QUANTITATIVE = {S, C, W, NS, X, rp.NOT_TESTABLE}
OUTCOMES = {
    "saobp_inference": {rp.BY_CONSTRUCTION},
    "saobp_training_gtd": {rp.NOT_TESTABLE},
    "agreement_disattenuated": {rp.DIAGNOSTIC, rp.NOT_TESTABLE},
    **{k: {S, NS, X, rp.NOT_TESTABLE} for k in ("saobp_training_entropy", "saobp_training_loss", "kurtosis",
                                                "gate_input", "reversal_h_mse", "early_exit_tuned", "patch_up")},
}


@pytest.mark.parametrize("key", list(rp.CLAIMS))
def test_every_claim_reaches_each_outcome(key: str) -> None:
    assert key in CASES, f"claim {key} has no synthetic cases"
    for measurement, expected in CASES[key]:
        judgement = rp.judge(key, measurement)
        assert judgement.verdict == expected, (key, measurement, judgement)
        assert judgement.reason
    seen = {expected for _, expected in CASES[key]}
    if key != "saobp_inference":  # a measurement with no statistics is never judged
        assert rp.judge(key, M()).verdict == rp.NOT_TESTABLE
        seen.add(rp.NOT_TESTABLE)
    wanted = OUTCOMES.get(key, QUANTITATIVE)
    assert wanted <= seen, f"{key}: outcomes {wanted - seen} are not covered"


def _widened(m: rp.Measurement, factors: dict[str, tuple[float, float]]) -> rp.Measurement:
    """``m`` with each interval stretched around the same point (low and high moved outwards)."""
    out = {}
    for name, e in m.estimates.items():
        lo_f, hi_f = factors.get(name, (1.0, 1.0))
        if e.has_interval and e.low != e.high:
            out[name] = Estimate(e.value, e.value - (e.value - e.low) * lo_f, e.value + (e.high - e.value) * hi_f, e.n)
        else:
            out[name] = e
    return rp.Measurement(out, m.text, m.untestable)


@pytest.mark.parametrize("key", list(rp.CLAIMS))
def test_a_wider_interval_never_earns_a_stronger_verdict(key: str) -> None:
    """The monotonicity property, for every rule: widening any interval around the same point only removes
    conclusions (``rp.CONCLUSIONS``). Random points and intervals, each widened by random factors >= 1, one
    side or both."""
    rng = np.random.default_rng(abs(hash(key)) % 2**32)
    names = sorted({n for m, _ in CASES[key] for n, e in m.estimates.items() if e.has_interval and e.low != e.high})
    if not names or OUTCOMES.get(key, QUANTITATIVE) <= {rp.NOT_TESTABLE, rp.BY_CONSTRUCTION}:
        return  # counts, seeds and rules with one outcome: nothing that widening could move
    template = next(m for m, _ in CASES[key] if set(names) <= set(m.estimates))
    checked = 0
    for _ in range(3000):
        estimates = dict(template.estimates)
        for name in names:
            base = template.estimates[name]
            scale = max(abs(base.value), abs(base.high - base.low), 0.1) * 2
            point = base.value + rng.normal() * scale
            estimates[name] = Estimate(point, point - abs(rng.normal()) * scale / 2,
                                       point + abs(rng.normal()) * scale / 2, 100)
        narrow = rp.Measurement(estimates)
        factors = {n: (1 + rng.exponential() * (rng.random() < 0.7), 1 + rng.exponential() * (rng.random() < 0.7))
                   for n in names}
        wide = _widened(narrow, factors)
        before, after = rp.judge(key, narrow).verdict, rp.judge(key, wide).verdict
        assert rp.CONCLUSIONS[after] <= rp.CONCLUSIONS[before], (key, narrow, wide, before, after)
        checked += before != after
    assert checked > 0, f"{key}: no widening changed a verdict, so the property was not exercised"


def test_precision_cannot_pass_a_claim_that_a_wider_interval_passes() -> None:
    """The referee's example at today's level (0.82): a wide interval around the same point is 'present; level
    not resolved' (it asserts less), the narrow one 'weaker'."""
    wide = rp.judge("agreement", M({"pearson": Estimate(0.78, 0.70, 0.85)}))
    narrow = rp.judge("agreement", M({"pearson": Estimate(0.78, 0.75, 0.81)}))
    assert (wide.verdict, narrow.verdict) == (C, W)
    assert rp.CONCLUSIONS[C] < rp.CONCLUSIONS[W]


def test_underpowered_loss_row_says_how_many_seeds() -> None:
    j = rp.judge("saobp_training_loss", M({**NO_SINK, **SD, "loss_diff": E(0.028, -0.043, 0.1)}))
    assert j.verdict == NS and "underpowered" in j.reason
    # the paired t-test's power, checked against a simulation: at the computed n the power reaches 0.8,
    # at n - 1 it does not (noncentral t, exact)
    n = rp.seeds_for_power(0.06, 0.05)
    crit = sps.t.ppf(0.975, n - 1)
    power = 1 - sps.nct.cdf(crit, n - 1, 0.05 / (0.06 / math.sqrt(n))) + sps.nct.cdf(-crit, n - 1,
                                                                                   0.05 / (0.06 / math.sqrt(n)))
    rng = np.random.default_rng(0)
    sims = rng.normal(0.05, 0.06, size=(20000, n))
    t = sims.mean(axis=1) / (sims.std(axis=1, ddof=1) / math.sqrt(n))
    simulated = float((np.abs(t) > crit).mean())
    assert power >= 0.8 and abs(simulated - power) < 0.02  # 20k draws: sd of a share near 0.8 is 0.003
    assert rp.seeds_for_power(0.06, 0.05) > rp.seeds_for_power(0.06, 0.1)
    assert f"{n} seeds for 0.05" in j.reason


def test_every_claim_says_its_criterion_and_missing_stage_is_not_testable() -> None:
    frame = rp.reproduction_frame({})
    assert list(frame.columns) == rp.COLUMNS
    assert len(frame) == len(rp.CLAIMS)
    assert set(frame["verdict"]) == {rp.NOT_TESTABLE}
    assert all(len(c) > 20 for c in frame["criterion"])
    with pytest.raises(KeyError):
        rp.judge("no_such_claim", None)


@pytest.mark.parametrize("key", [k for k in CASES if k in rp.CLAIMS])
def test_a_notebooks_sentence_says_what_the_reports_table_says(key: str) -> None:
    """comparison() (the sentence notebooks 04 and 05 print) carries the reproduction table's verdict, reason and
    measurement for every outcome of every claim."""
    for measurement, _ in CASES[key]:
        m = rp.Measurement(measurement.estimates, measurement.text or "the measured text", measurement.untestable)
        row = rp.reproduction_frame({key: m}, [key]).iloc[0]
        sentence = rp.comparison(key, m)
        assert f": {row['verdict']} ({row['why']})." in sentence
        assert rp.CLAIMS[key].paper_value in sentence and m.text in sentence


def test_measurement_round_trips_through_json() -> None:
    import json

    m = M({"pearson": E(0.4, 0.3, 0.5), "chance": Estimate(0.05, n=10)}, "text", None)
    back = rp.measurement_from_dict(json.loads(json.dumps(rp.measurement_to_dict(m))))
    assert back.estimates["pearson"] == m.estimates["pearson"]
    assert math.isnan(back.estimates["chance"].low) and back.estimates["chance"].n == 10
    assert rp.judge("agreement", back) == rp.judge("agreement", m)


# ---------------------------------------------------------------------------------------
# Protocol statistics against naive computations


SPECS = ["rtn:bits=3,group=64,zero=float", "rtn:bits=4,group=64,zero=float", "nf:bits=3,group=64",
         "gptq:bits=3,group=64", "gptq:bits=4,group=64"]


def test_paper_pairs_drop_same_algorithm_different_bits() -> None:
    from interp.quant.spec import parse_spec

    canonical = [str(parse_spec(s)) for s in SPECS]
    pairs = pr.paper_pairs(canonical)
    naive = [(a, b) for i, a in enumerate(canonical) for b in canonical[i + 1:]
             if not (a.split(":")[0] == b.split(":")[0] and a != b and "bits=3" in a + b and "bits=4" in a + b)]
    assert pairs == naive
    assert len(pairs) == 10 - 2  # rtn3-rtn4 and gptq3-gptq4 are dropped
    assert all("bits=3" in a and "bits=3" in b for a, b in pr.paper_pairs(canonical, bits=3))
    assert len(pr.paper_pairs(canonical, bits=4)) == 1


def _errors(n: int = 200, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    shared = rng.normal(size=n)
    return pd.DataFrame({s: shared + rng.normal(scale=0.5 + i / 4, size=n) for i, s in enumerate(SPECS)},
                        index=[f"ex{i}" for i in range(n)])


def test_pair_agreement_matches_naive_pair_means() -> None:
    errors = _errors()
    pairs = [(SPECS[0], SPECS[2]), (SPECS[2], SPECS[3]), (SPECS[1], SPECS[4])]
    out = pr.pair_agreement(errors, pairs, n_boot=50, seed=0)
    naive_r = np.mean([sps.pearsonr(errors[a], errors[b]).statistic for a, b in pairs])
    k = round(0.1 * len(errors))

    def top(col: str) -> set[str]:
        return set(errors[col].sort_values(ascending=False, kind="stable").index[:k])

    naive_j = np.mean([len(top(a) & top(b)) / len(top(a) | top(b)) for a, b in pairs])
    # float64 throughout: agreement to rounding of ~200-term sums
    assert out["pearson"].value == pytest.approx(naive_r, abs=1e-12)
    assert out["jaccard"].value == pytest.approx(naive_j, abs=1e-12)
    assert out["pearson"].low <= out["pearson"].value <= out["pearson"].high
    assert out["chance"].value == pytest.approx(0.1 / 1.9, abs=5e-3)  # large-n limit of E[J] for k = n/10


def test_mean_method_correlation_matches_loop() -> None:
    errors = _errors()
    rng = np.random.default_rng(1)
    norms = -errors[SPECS[0]].to_numpy() + rng.normal(size=len(errors))
    chosen = [SPECS[0], SPECS[2], SPECS[3]]
    est = pr.mean_method_correlation(norms, errors, chosen, n_boot=100, seed=0)
    naive = np.mean([sps.pearsonr(norms, errors[s]).statistic for s in chosen])
    assert est.value == pytest.approx(naive, abs=1e-12)  # float64, same formula
    assert est.low < est.value < est.high


def test_split_half_reliability_against_loops_and_known_case() -> None:
    rng = np.random.default_rng(0)
    n, t = 300, 127
    truth = rng.normal(size=(n, 1))
    tokens = truth + rng.normal(scale=3.0, size=(n, t))
    odd, even = pr.split_halves(tokens)
    naive_odd = [sum(tokens[i, j] for j in range(0, t, 2)) / len(range(0, t, 2)) for i in range(n)]
    naive_even = [sum(tokens[i, j] for j in range(1, t, 2)) / len(range(1, t, 2)) for i in range(n)]
    np.testing.assert_allclose(odd, naive_odd, rtol=0, atol=1e-12)  # float64 means of <= 64 terms
    np.testing.assert_allclose(even, naive_even, rtol=0, atol=1e-12)
    assert pr.spearman_brown(0.5) == pytest.approx(2 / 3, abs=1e-15)
    assert pr.spearman_brown(1.0) == pytest.approx(1.0, abs=1e-15)
    b_tokens = truth + rng.normal(scale=3.0, size=(n, t))
    ceiling = pr.noise_ceiling({"a": tokens, "b": b_tokens}, [("a", "b")], n_boot=200, seed=0)
    rel = ceiling.reliability.set_index("spec")
    r_half = np.corrcoef(odd, even)[0, 1]
    assert rel.loc["a", "r_half"] == pytest.approx(r_half, abs=1e-12)
    assert rel.loc["a", "reliability"] == pytest.approx(2 * r_half / (1 + r_half), abs=1e-12)
    # known case: true variance 1, noise variance 9 / 127 per mean, so reliability = 1 / (1 + 9/127) = 0.934;
    # the estimate's sampling sd at n = 300 is about 0.008, so 0.03 is ~4 sd
    assert rel.loc["a", "reliability"] == pytest.approx(1 / (1 + 9 / t), abs=0.03)
    # both measure the same truth: the disattenuated correlation is 1 up to sampling error (sd ~0.015 here)
    assert ceiling.mean_disattenuated.value == pytest.approx(1.0, abs=0.06)
    assert ceiling.mean_observed.value < ceiling.mean_disattenuated.value
    # the numerator compares disjoint tokens: naive loop over the two cross-half correlations
    b_odd, b_even = pr.split_halves(b_tokens)
    cross = (np.corrcoef(odd, b_even)[0, 1] + np.corrcoef(even, b_odd)[0, 1]) / 2
    r_b = np.corrcoef(b_odd, b_even)[0, 1]
    pair = ceiling.pairs.iloc[0]
    assert pair["r_cross"] == pytest.approx(cross, abs=1e-12)
    assert pair["disattenuated"] == pytest.approx(cross / math.sqrt(r_half * r_b), abs=1e-12)
    assert ceiling.invalid_pairs == 0 and ceiling.min_half_reliability.low > 0


def test_noise_ceiling_is_not_fooled_by_shared_reference_noise() -> None:
    """Two methods whose errors share the reference's token noise but whose true errors are independent:
    the classical correction (full errors over full-length reliabilities) reports agreement above 1, the
    symptom the referee found; the disjoint-token correction finds none.

    Per example: true error sd 0.2 (variance 0.04); shared noise sd 3 per token, so its mean over 127
    tokens has variance 9/127 = 0.071; own noise sd 1 per token (variance 0.008 per mean). The full
    errors then correlate at about 0.071 / (0.04 + 0.071 + 0.008) = 0.6, and the split-half reliability
    (which cannot see the shared noise: odd and even tokens differ) is about 0.33, so the classical
    value is about 1.8. The truth is 0."""
    rng = np.random.default_rng(3)
    n, t = 400, 127
    shared = rng.normal(scale=3.0, size=(n, t))  # the reference NLL's token noise, subtracted by both
    a = rng.normal(scale=0.2, size=(n, 1)) + shared + rng.normal(scale=1.0, size=(n, t))
    b = rng.normal(scale=0.2, size=(n, 1)) + shared + rng.normal(scale=1.0, size=(n, t))
    ceiling = pr.noise_ceiling({"a": a, "b": b}, [("a", "b")], n_boot=200, seed=0)
    pair = ceiling.pairs.iloc[0]
    rel_a, rel_b = ceiling.reliability["reliability"]
    classical = pair["r"] / math.sqrt(rel_a * rel_b)
    assert classical > 1.0
    # disjoint tokens: r_cross has sd about 1/sqrt(400) = 0.05, divided by sqrt(0.2 * 0.2) = 0.2: sd ~0.25
    assert abs(pair["disattenuated"]) < 0.75 and abs(pair["r_cross"]) < 0.15
    assert pair["r_cross"] < pair["r"] - 0.3


def test_noise_ceiling_reports_undefined_pairs_instead_of_dropping_them() -> None:
    """A method equal to the reference (error 0 on every token, like RTN4 g32 on the Q4_1 reference) has no
    reliability: its pairs are counted as invalid and the mean over pairs is undefined, not the mean of the rest."""
    rng = np.random.default_rng(4)
    n, t = 200, 64
    good = rng.normal(size=(n, 1)) + rng.normal(size=(n, t))
    other = 0.5 * good.mean(axis=1, keepdims=True) + rng.normal(size=(n, 1)) + rng.normal(size=(n, t))
    ceiling = pr.noise_ceiling({"good": good, "zero": np.zeros((n, t)), "good2": other},
                               [("good", "zero"), ("good", "good2")], n_boot=50, seed=0)
    assert ceiling.invalid_pairs == 1
    assert math.isnan(ceiling.mean_disattenuated.value)  # not the mean of the one valid pair
    assert not ceiling.pairs.set_index("spec_b").loc["zero", "valid"]
    assert ceiling.pairs.set_index("spec_b").loc["good2", "valid"]


def test_self_agreement_is_pair_agreement_over_instances() -> None:
    rng = np.random.default_rng(5)
    truth = rng.normal(size=300)
    inst = {f"i{k}": truth + rng.normal(scale=0.5, size=300) for k in range(3)}
    out = pr.self_agreement(inst, n_boot=50, seed=0)
    naive = np.mean([np.corrcoef(inst[a], inst[b])[0, 1] for a, b in (("i0", "i1"), ("i0", "i2"), ("i1", "i2"))])
    assert out["pearson"].value == pytest.approx(naive, abs=1e-12)
    assert pr.self_agreement({"i0": truth}) == {}


def test_block_bootstrap_means_against_a_loop() -> None:
    from interp import stats

    x = np.arange(10.0)
    boot = stats.block_bootstrap_means(x, 3, 5, seed=7)
    starts = np.random.default_rng(7).integers(0, 8, size=(5, 4))
    naive = [np.mean([x[s + j] for s in row for j in range(3)][:10]) for row in starts]
    np.testing.assert_allclose(boot, naive, rtol=0, atol=1e-12)
    assert np.allclose(stats.block_bootstrap_means(x, 10, 3), x.mean())  # one block: always the whole series


def test_recovery_boot_and_margin_match_formula() -> None:
    rng = np.random.default_rng(0)
    n = 40
    ref = rng.normal(3.0, 0.3, n)
    quant = ref + 0.5 + rng.normal(0, 0.05, n)
    patched = {"down": ref + 0.05, "up": quant + 0.2, "attn_out": quant - 0.1, "gate": ref + 0.1}
    boot = pr.recovery_boot(quant, ref, patched, n_boot=300, seed=0)
    for k, v in patched.items():
        nll_rec = (quant.mean() - v.mean()) / (quant.mean() - ref.mean())
        ppl_rec = (math.exp(quant.mean()) - math.exp(v.mean())) / (math.exp(quant.mean()) - math.exp(ref.mean()))
        assert boot.point[k] == pytest.approx(nll_rec, abs=1e-12)  # float64 means of 40 values
        assert boot.point_ppl[k] == pytest.approx(ppl_rec, abs=1e-12)
    margin = boot.margin("down", ["up", "attn_out"], stronger=True)
    assert margin.value == pytest.approx(boot.point["down"] - max(boot.point["up"], boot.point["attn_out"]),
                                         abs=1e-12)
    assert margin.low > 0
    weak = boot.margin("up", ["down", "gate"], stronger=False)
    assert weak.value == pytest.approx(min(boot.point["down"], boot.point["gate"]) - boot.point["up"], abs=1e-12)


def test_t_estimate_matches_scipy() -> None:
    values = [0.03, -0.01, 0.05, 0.02]
    est = pr.t_estimate(values)
    low, high = sps.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=sps.sem(values))
    assert (est.value, est.low, est.high) == pytest.approx((np.mean(values), low, high), abs=1e-12)
    assert not pr.t_estimate([0.1]).has_interval


def test_split_index_and_share_known_case() -> None:
    gap = np.array([0.0, 0.1, -0.05, 0.1, 0.6, 0.8, 1.0])
    assert pr.split_index(gap) == 4  # from index 4 on the gap stays >= 0.5
    assert pr.split_index(np.array([0.2, 0.1, -0.1])) == 2  # final gap <= 0: no split
    layers = list(range(7))
    ref = np.zeros((7, 5))
    quant = ref + gap[:, None]
    usable = np.array([False, False, True, True, True, True, True])
    est, split_layer = pr.split_share(ref, quant, layers, 7, usable, n_boot=20)
    assert split_layer == 4 and est.value == pytest.approx(3 / 7)
    assert est.low == pytest.approx(3 / 7) and est.high == pytest.approx(3 / 7)  # no noise: every resample agrees


def test_paired_mean_difference() -> None:
    a, b = np.arange(10.0), np.arange(10.0) - 1.5
    est = pr.paired_mean_difference(a, b, n_boot=50)
    assert est.value == pytest.approx(1.5) and est.low == pytest.approx(1.5) and est.high == pytest.approx(1.5)


@pytest.mark.integration
def test_rtn4_group32_reproduces_the_bundled_reference(smol) -> None:
    """The SmolLM2 reference is GGUF Q4_1 (4-bit, groups of 32, affine, full 0..15 code range):
    min-max RTN at 4 bits and group 32 maps every block linear weight back onto itself."""

    from interp.quant import quantize_weight
    from interp.quant.reference import describe_reference
    from interp.runtime import hooks as hk

    assert describe_reference("smollm2-135m").startswith("GGUF Q4_1 dequantized to fp32")
    worst, count = 0.0, 0
    for layer in range(smol.info.n_layers):
        for slot in hk.linear_weights(smol, layer).values():
            w = slot.read().detach().double()
            q = quantize_weight(w, "rtn:bits=4,group=32").double()
            worst = max(worst, float(((q - w).abs() / w.abs().amax(dim=1, keepdim=True)).max()))
            count += 1
    assert count == 210
    # Q4_1 stores d and m in float16, dequantized once to float32: RTN recomputes scale = (max - min) / 15
    # from the same values in float64, so codes match and the weights agree to float32 rounding of
    # d * q + m (|q| <= 15): a relative error of a few 2^-24 of the row's largest weight
    assert worst < 1e-6


def test_side_by_side_says_where_each_claim_holds_and_counts_training_once() -> None:
    def table(verdicts: list[str]) -> pd.DataFrame:
        keys = ["agreement", "kurtosis", "restoration", "saobp_inference", "saobp_training_loss"]
        return pd.DataFrame({"paper": "p", "claim": [rp.CLAIMS[k].claim for k in keys], "paper value": "v",
                             "measured here": "m", "verdict": verdicts})

    both = rp.side_by_side({"A": table([S, S, X, rp.BY_CONSTRUCTION, NS]),
                            "B": table([S, NS, rp.NOT_TESTABLE, rp.BY_CONSTRUCTION, NS])})
    assert both["across columns"].tolist() == [
        f"{S} on both", f"{S} on A; {NS} on B", f"{X} on A; {rp.NOT_TESTABLE} on B", f"{rp.BY_CONSTRUCTION} on both",
        f"{NS} (once, model-independent)"]
    assert both["B: verdict"].iloc[-1].startswith("counted once")
    text = rp.markdown_table(both[["claim", "across columns"]])
    assert text.count("\n") == len(both) + 2 and text.startswith("| claim | across columns |")
    assert rp.markdown_table(pd.DataFrame({"a": ["x|y"]})).splitlines()[2] == "| x\\|y |"


# The paper's own headline numbers, as zero-width intervals, claim by claim (the spec's numbers; recoveries
# converted from the paper's perplexities with the same formula the rules' levels use).
def _zero(v: float) -> Estimate:
    return Estimate(v, v, v, 100)


def _paper_patching(component: str) -> rp.Measurement:
    rec = {c: rp.nll_recovery(rp.PATCH_PPL["quantized"], rp.PATCH_PPL[c], rp.PATCH_PPL["reference"])
           for c in ("down", "gate", "up", "attn_out")}
    if component in ("down", "gate"):
        margin = rec[component] - max(rec["up"], rec["attn_out"])
    else:
        margin = min(rec["down"], rec["gate"]) - rec[component]
    ppl = rp.ppl_recovery(rp.PATCH_PPL["quantized"], rp.PATCH_PPL[component], rp.PATCH_PPL["reference"])
    return M({"recovery": _zero(rec[component]), "margin": _zero(margin), "recovery_ppl": _zero(ppl)})


PAPER = {
    "agreement": M({"pearson": _zero(0.82)}),
    "jaccard_top10": M({"jaccard": _zero(0.51), "chance": Estimate(0.0529)}),
    **{f"norm_error@{r}": M({"r_3bit": _zero(r)}) for r in (-0.66, -0.76, -0.78, -0.80)},  # all four models
    "reversal_h_mse": M({"layers_above": count(15), "layers_below": count(0), "upper_layers": count(15)}),
    "kurtosis": M({"diff": _zero(-0.1)}),  # "lower for D_large": any negative difference
    "outlier_gamma": M({"percentile": _zero(0.0)}),  # "the smallest gamma"
    "early_exit_tuned": M({"share_after_split": _zero(7 / 40)}),
    "early_exit_logit": M({"share_after_split": _zero(7 / 40)}),
    "restoration": M({"recovery": _zero(rp.nll_recovery(8.67, 8.05, 5.60)),
                      "recovery_ppl": _zero(rp.ppl_recovery(8.67, 8.05, 5.60))}),
    **{f"patch_{c}": _paper_patching(c) for c in ("down", "gate", "up", "attn_out")},
    "gate_input": M({"diff": _zero(math.log(10.45) - math.log(6.53))}),
}


@pytest.mark.parametrize("name", list(PAPER))
def test_the_paper_passes_its_own_rules(name: str) -> None:
    """Fed the paper's own numbers with zero-width intervals, every rule that claims them says 'as strong as the
    paper' (on the NLL scale and, beside it, on the perplexity scale). Up-patching, where the paper itself ranges
    from -124% to +78% over its models, judges only the ordering, which the paper's Llama3-8B numbers show."""
    judgement = rp.judge(name.split("@")[0], PAPER[name])
    assert judgement.verdict == rp.AS_STRONG, judgement
    if "recovery_ppl" in PAPER[name].estimates and name != "patch_up":
        assert f"on the perplexity scale (shown, not judged): {rp.AS_STRONG}" in judgement.reason


def test_every_quantization_claim_with_a_level_is_fed_the_paper() -> None:
    judged = {k for k, c in rp.CLAIMS.items() if c.paper == rp.QUANT_PAPER} - {"agreement_disattenuated"}
    assert judged <= {n.split("@")[0] for n in PAPER}


def test_levels_are_the_papers_perplexities_converted_exactly() -> None:
    """Each level against an independent computation from the spec's perplexities (float64: the same three logs,
    so equal to a few ulps)."""
    assert rp.PATCH_LEVELS["down"] == pytest.approx((math.log(10.68) - math.log(5.95)) / math.log(10.68 / 5.62),
                                                    abs=1e-14)
    assert rp.PATCH_LEVELS["up"] == pytest.approx(math.log(10.68 / 9.97) / math.log(10.68 / 5.62), abs=1e-14)
    assert rp.RESTORATION_LEVEL == pytest.approx(math.log(8.67 / 8.05) / math.log(8.67 / 5.60), abs=1e-14)
    assert rp.PATCH_LEVELS_PPL["gate"] == pytest.approx((10.68 - 6.42) / (10.68 - 5.62), abs=1e-14)
    assert rp.AGREEMENT_LEVEL == 0.82  # the paper's stated mean over its 50 pairs


def test_fewer_than_three_instances_is_instance_limited() -> None:
    m = M({"recovery": E(0.56, 0.53, 0.59), "margin": E(0.1, 0.07, 0.14), "instances": count(2)})
    j = rp.judge("patch_down", m)
    assert j.verdict == rp.INSTANCE_LIMITED and "2 calibrated instance(s)" in j.reason and rp.WEAKER in j.reason
    assert rp.judge("patch_down", M({**m.estimates, "instances": count(5)})).verdict == rp.WEAKER
