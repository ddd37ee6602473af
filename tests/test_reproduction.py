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

# claim -> [(measurement, expected verdict)]: every outcome each rule can give
CASES: dict[str, list[tuple[rp.Measurement, str]]] = {
    "saobp_inference": [(M(text="x"), rp.BY_CONSTRUCTION)],
    "saobp_training_entropy": [
        (M({**SEEDS_OK, "entropy_diff": E(0.3, 0.1, 0.5)}), rp.HOLDS),
        (M({**COLLAPSED, "entropy_diff": E(0.3, 0.1, 0.5)}), rp.HOLDS),
        (M({**SEEDS_OK, "entropy_diff": E(0.1, -0.1, 0.3)}), rp.FAILS),
        (M({**SEEDS_OK, "entropy_diff": E(-0.3, -0.5, -0.1)}), rp.FAILS),
        (M({**NO_SINK, "entropy_diff": E(0.3, 0.1, 0.5)}), rp.NOT_TESTABLE),
        (M({**SEEDS_OK, "seeds": count(2), "entropy_diff": E(0.3, 0.1, 0.5)}), rp.NOT_TESTABLE),
    ],
    "saobp_training_loss": [
        (M({**NO_SINK, "loss_diff": E(-0.05, -0.08, -0.02)}), rp.HOLDS),
        (M({**NO_SINK, "loss_diff": E(-0.01, -0.03, 0.01)}), rp.FAILS),
        (M({**NO_SINK, "loss_diff": E(0.05, 0.02, 0.08)}), rp.FAILS),
        (M({"seeds": count(1), "loss_diff": E(-0.05, -0.08, -0.02)}), rp.NOT_TESTABLE),
    ],
    "agreement": [
        (M({"pearson": E(0.8, 0.7, 0.9)}), rp.HOLDS),
        (M({"pearson": E(0.6, 0.5, 0.7)}), rp.HOLDS),  # reaches the weakest model's 0.66
        (M({"pearson": E(0.44, 0.35, 0.52)}), rp.PARTLY),
        (M({"pearson": E(0.1, -0.05, 0.2)}), rp.FAILS),
        (M({"pearson": E(-0.3, -0.4, -0.2)}), rp.FAILS),
        (M({"pearson": Estimate(0.5)}), rp.NOT_TESTABLE),  # no interval
        (M(untestable="too few specs"), rp.NOT_TESTABLE),
    ],
    "agreement_disattenuated": [
        (M({"pearson": E(0.9, 0.8, 1.0)}), rp.HOLDS),
        (M({"pearson": E(0.5, 0.4, 0.6)}), rp.PARTLY),
        (M({"pearson": E(0.0, -0.1, 0.1)}), rp.FAILS),
    ],
    "jaccard_top10": [
        (M({"jaccard": E(0.5, 0.4, 0.6), "chance": Estimate(0.05)}), rp.HOLDS),
        (M({"jaccard": E(0.25, 0.15, 0.35), "chance": Estimate(0.05)}), rp.PARTLY),
        (M({"jaccard": E(0.06, 0.03, 0.1), "chance": Estimate(0.05)}), rp.FAILS),
        (M({"jaccard": E(0.5, 0.4, 0.6)}), rp.NOT_TESTABLE),  # no chance value
    ],
    "norm_error": [
        (M({"r_3bit": E(-0.7, -0.8, -0.6)}), rp.HOLDS),
        (M({"r_3bit": E(-0.41, -0.55, -0.27)}), rp.PARTLY),
        (M({"r_3bit": E(-0.1, -0.2, 0.05)}), rp.FAILS),
        (M({"r_3bit": E(0.3, 0.2, 0.4)}), rp.FAILS),
    ],
    "reversal_h_mse": [
        (M({"layers_above": count(9), "layers_reaching": count(12), "upper_layers": count(15)}), rp.HOLDS),
        (M({"layers_above": count(2), "layers_reaching": count(5), "upper_layers": count(15)}), rp.PARTLY),
        (M({"layers_above": count(0), "layers_reaching": count(9), "upper_layers": count(15)}), rp.PARTLY),
        (M({"layers_above": count(0), "layers_reaching": count(4), "upper_layers": count(15)}), rp.FAILS),
    ],
    "kurtosis": [
        (M({"diff": E(-0.2, -0.3, -0.1)}), rp.HOLDS),
        (M({"diff": E(-0.05, -0.2, 0.1)}), rp.FAILS),
        (M({"diff": E(0.2, 0.1, 0.3)}), rp.FAILS),
    ],
    "outlier_gamma": [
        (M({"percentile": E(0.05, 0.02, 0.09)}), rp.HOLDS),
        (M({"percentile": E(0.26, 0.15, 0.38)}), rp.PARTLY),
        (M({"percentile": E(0.5, 0.35, 0.65)}), rp.FAILS),
    ],
    "early_exit_logit": [
        (M({"share_after_split": E(0.17, 0.1, 0.25)}), rp.HOLDS),
        (M({"share_after_split": E(0.3, 0.2, 0.4)}), rp.PARTLY),
        (M({"share_after_split": E(0.6, 0.5, 0.7)}), rp.FAILS),
        (M(untestable="lens uninformative"), rp.NOT_TESTABLE),
    ],
    "early_exit_tuned": [
        (M({"share_after_split": E(0.1, 0.05, 0.2)}), rp.HOLDS),
        (M({"share_after_split": E(0.5, 0.3, 0.9)}), rp.FAILS),
    ],
    "restoration": [
        (M({"recovery": E(0.2, 0.1, 0.3)}), rp.HOLDS),
        (M({"recovery": E(0.4, 0.3, 0.55)}), rp.PARTLY),
        (M({"recovery": E(0.7, 0.6, 0.8)}), rp.FAILS),
    ],
    "patch_down": [
        (M({"recovery": E(0.9, 0.8, 1.0), "margin": E(0.5, 0.3, 0.7)}), rp.HOLDS),
        (M({"recovery": E(0.4, 0.3, 0.5), "margin": E(0.5, 0.3, 0.7)}), rp.PARTLY),
        (M({"recovery": E(0.9, 0.8, 1.0), "margin": E(0.1, -0.1, 0.3)}), rp.PARTLY),
        (M({"recovery": E(0.3, 0.1, 0.5), "margin": E(0.0, -0.2, 0.2)}), rp.FAILS),
        (M(untestable="no gate"), rp.NOT_TESTABLE),
    ],
    "patch_gate": [
        (M({"recovery": E(0.85, 0.7, 0.95), "margin": E(0.4, 0.2, 0.6)}), rp.HOLDS),
        (M({"recovery": E(0.6, 0.4, 0.8), "margin": E(0.4, 0.2, 0.6)}), rp.PARTLY),
        (M({"recovery": E(0.1, 0.0, 0.2), "margin": E(-0.4, -0.6, -0.2)}), rp.FAILS),
    ],
    "patch_up": [
        (M({"recovery": E(0.1, 0.0, 0.2), "margin": E(0.5, 0.3, 0.7)}), rp.HOLDS),
        (M({"recovery": E(-11.8, -14.0, -9.0), "margin": E(12.0, 9.0, 15.0)}), rp.HOLDS),
        (M({"recovery": E(0.5, 0.3, 0.7), "margin": E(0.3, 0.1, 0.5)}), rp.PARTLY),
        (M({"recovery": E(0.8, 0.6, 0.9), "margin": E(-0.1, -0.3, 0.1)}), rp.FAILS),
    ],
    "patch_attn_out": [
        (M({"recovery": E(0.3, 0.2, 0.4), "margin": E(0.3, 0.1, 0.5)}), rp.HOLDS),
        (M({"recovery": E(0.3, 0.2, 0.4), "margin": E(0.0, -0.1, 0.1)}), rp.PARTLY),
        (M({"recovery": E(0.6, 0.55, 0.7), "margin": E(0.0, -0.1, 0.1)}), rp.FAILS),
    ],
    "gate_input": [
        (M({"diff": E(0.2, 0.1, 0.3)}), rp.HOLDS),
        (M({"diff": E(0.0, -0.1, 0.1)}), rp.FAILS),
        (M({"diff": E(-0.2, -0.3, -0.1)}), rp.FAILS),
    ],
}

# the outcomes each rule can produce (not testable comes from missing data for every rule)
OUTCOMES = {
    "saobp_inference": {rp.BY_CONSTRUCTION},
    "saobp_training_entropy": {rp.HOLDS, rp.FAILS, rp.NOT_TESTABLE},
    "saobp_training_loss": {rp.HOLDS, rp.FAILS, rp.NOT_TESTABLE},
    "kurtosis": {rp.HOLDS, rp.FAILS},
    "gate_input": {rp.HOLDS, rp.FAILS},
    "early_exit_tuned": {rp.HOLDS, rp.FAILS},
    "agreement_disattenuated": {rp.HOLDS, rp.PARTLY, rp.FAILS},
    "patch_gate": {rp.HOLDS, rp.PARTLY, rp.FAILS},
    "patch_attn_out": {rp.HOLDS, rp.PARTLY, rp.FAILS},
    "patch_up": {rp.HOLDS, rp.PARTLY, rp.FAILS},
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
    wanted = OUTCOMES.get(key, {rp.HOLDS, rp.PARTLY, rp.FAILS, rp.NOT_TESTABLE})
    assert wanted <= seen, f"{key}: outcomes {wanted - seen} are not covered"


def test_every_claim_says_its_criterion_and_missing_stage_is_not_testable() -> None:
    frame = rp.reproduction_frame({})
    assert list(frame.columns) == rp.COLUMNS
    assert len(frame) == len(rp.CLAIMS)
    assert set(frame["verdict"]) == {rp.NOT_TESTABLE}
    assert all(len(c) > 20 for c in frame["criterion"])
    with pytest.raises(KeyError):
        rp.judge("no_such_claim", None)


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
    ceiling = pr.noise_ceiling({"a": tokens, "b": truth + rng.normal(scale=3.0, size=(n, t))}, [("a", "b")],
                               n_boot=200, seed=0)
    rel = ceiling.reliability.set_index("spec")
    r_half = np.corrcoef(odd, even)[0, 1]
    assert rel.loc["a", "r_half"] == pytest.approx(r_half, abs=1e-12)
    assert rel.loc["a", "reliability"] == pytest.approx(2 * r_half / (1 + r_half), abs=1e-12)
    # known case: true variance 1, noise variance 9 / 127 per mean, so reliability = 1 / (1 + 9/127) = 0.934;
    # the estimate's sampling sd at n = 300 is about 0.008, so 0.03 is ~4 sd
    assert rel.loc["a", "reliability"] == pytest.approx(1 / (1 + 9 / t), abs=0.03)
    # both measure the same truth: the disattenuated correlation is 1 up to sampling error (sd ~0.01 here)
    assert ceiling.mean_disattenuated.value == pytest.approx(1.0, abs=0.05)
    assert ceiling.mean_observed.value < ceiling.mean_disattenuated.value
    pairs = ceiling.pairs.iloc[0]
    assert pairs["disattenuated"] == pytest.approx(pairs["r"] / pairs["ceiling"], abs=1e-12)


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


def test_side_by_side_says_where_each_claim_holds() -> None:
    def table(verdicts: list[str]) -> pd.DataFrame:
        keys = ["agreement", "kurtosis", "restoration", "saobp_inference"]
        return pd.DataFrame({"paper": "p", "claim": [rp.CLAIMS[k].claim for k in keys], "paper value": "v",
                             "measured here": "m", "verdict": verdicts})

    both = rp.side_by_side({"A": table([rp.HOLDS, rp.HOLDS, rp.FAILS, rp.BY_CONSTRUCTION]),
                            "B": table([rp.HOLDS, rp.FAILS, rp.NOT_TESTABLE, rp.BY_CONSTRUCTION])})
    assert both["across models"].tolist() == ["holds on both", "holds on A; does not hold on B",
                                              "does not hold on A; not testable on B", rp.BY_CONSTRUCTION]
    text = rp.markdown_table(both[["claim", "across models"]])
    assert text.count("\n") == len(both) + 2 and text.startswith("| claim | across models |")
    assert rp.markdown_table(pd.DataFrame({"a": ["x|y"]})).splitlines()[2] == "| x\\|y |"
