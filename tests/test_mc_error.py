"""Monte Carlo error of the deciding interval ends (interp.report.mc_error): the committed re-analyses are what
the raw data give, the deciding end is found as defined, and the rule for future registrations reads both
verdicts near a threshold."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from interp.errors import InterpError
from interp.report import confirm
from interp.report import mc_error as mc
from interp.report import reproduction as rp
from interp.stats import Estimate

DATA = confirm.REPO / "docs" / "data" / "reproduction"
REGISTERED = ["smollm2-confirmatory-2", "gemma3-confirmatory-1"]
PATCH_KEYS = ("patch_down", "patch_gate", "patch_up", "patch_attn_out", "gate_input")


def _data(name: str) -> dict:
    return json.loads((DATA / name / "mc_error.json").read_text())


@pytest.mark.parametrize("name", REGISTERED)
def test_the_committed_reanalyses_belong_to_their_registration(name):
    p = confirm.Preregistration.load(confirm.PREREG_DIR / f"{name}.json")
    data = _data(name)
    assert (data["preregistration_sha256"], data["criteria"], data["n_boot"]) == (p.sha256, p.criteria, p.n_boot)
    assert data["registered_seed"] == p.seed and data["seeds"] == mc.fresh_seeds(p.seed, len(data["seeds"]))
    assert len(data["seeds"]) >= 20 and p.seed not in data["seeds"]
    committed = pd.read_csv(DATA / name / "reproduction.csv").set_index("claim")
    for key, record in data["claims"].items():  # the registered reading is the committed one, verdict by verdict
        assert record["verdict"] == committed.loc[rp.CLAIMS[key].claim, "verdict"], key
        assert all(len(v) == len(data["seeds"]) for sides in record["runs"].values() for v in sides.values())


@pytest.mark.parametrize("name", REGISTERED)
def test_two_seeds_of_the_patching_rows_recompute_from_the_raw_data(name):
    """The cheap part of the re-analysis: the crossed bootstrap of the patching steps, for the first two fresh seeds
    and the registered one, against the committed JSON and the committed patching table. Float64 sums of a few
    hundred terms in another order move by about 1e-14 relative; 1e-9 leaves room and is far below the 1e-3 that
    the Monte Carlo errors are printed at."""
    p = confirm.Preregistration.load(confirm.PREREG_DIR / f"{name}.json")
    data = _data(name)
    raw = confirm._Folder(DATA / name / "raw")
    patching = [raw.read(f"patching#{i}") for i in range(1, len(p.calibration_seeds))]
    registered, table = confirm._patch_claims(patching, p.n_boot, p.seed)
    stored = pd.read_csv(DATA / name / "patching.csv")
    np.testing.assert_allclose(table[["low", "high", "margin_low", "margin_high"]].to_numpy(np.float64),
                               stored[["low", "high", "margin_low", "margin_high"]].to_numpy(np.float64),
                               rtol=1e-9, atol=1e-12)
    for k, seed in enumerate(data["seeds"][:2]):
        claims, _ = confirm._patch_claims(patching, p.n_boot, seed)
        for key in PATCH_KEYS:
            for statistic, sides in data["claims"][key]["runs"].items():
                for side, values in sides.items():
                    assert getattr(claims[key].estimates[statistic], side) == pytest.approx(values[k], rel=1e-9,
                                                                                            abs=1e-12)
    for key in PATCH_KEYS:
        record = rp.measurement_from_dict(data["claims"][key]["registered"])
        for statistic in data["claims"][key]["runs"]:
            assert record.estimates[statistic].low == pytest.approx(registered[key].estimates[statistic].low,
                                                                    rel=1e-9, abs=1e-12)


def test_smollm2_patching_down_is_on_the_boundary_and_keeps_its_registered_verdict():
    """The referee's case: registration 2's patching-down margin ends about one Monte Carlo standard error below 0.
    The page shows it 'on the boundary'; the registered verdict is unchanged."""
    found = mc.summarise(_data("smollm2-confirmatory-2"))
    down = found["patch_down"]
    assert down is not None and (down.statistic, down.side, down.threshold) == ("margin", "low", 0.0)
    assert down.verdict == rp.NOT_SHOWN and down.other == rp.WEAKER
    assert down.z < mc.BOUNDARY_Z and down.flipped > 0
    assert down.reading() == f"on the boundary: {rp.NOT_SHOWN} / {rp.WEAKER}"
    far = [d for d in found.values() if d is not None and d.z > 10]
    assert all(d.flipped == 0 for d in far)  # a bound dozens of standard errors away: no fresh seed moves it


def _record(key: str, m: rp.Measurement, runs: dict[str, dict[str, list[float]]]) -> dict:
    verdict = rp.judge(key, m).verdict
    return {"registered": rp.measurement_to_dict(m), "verdict": verdict, "runs": runs,
            "run_verdicts": [verdict] * len(next(iter(next(iter(runs.values())).values())))}


def test_the_deciding_end_is_the_nearest_in_standard_errors_among_those_that_change_the_verdict():
    """Patching attention, 'weaker than the paper': the recovery's high end sits 0.05 above the level (0.2205) with
    a standard error of 0.001 (50 SE), the margin's low end 0.004 above 0 with an error of 0.002 (2 SE). The
    margin decides; the recovery's low end, far from every threshold, never does."""
    m = rp.Measurement({"recovery": Estimate(0.3, 0.27, 0.33), "margin": Estimate(0.05, 0.004, 0.1)})
    assert rp.judge("patch_attn_out", m).verdict == rp.WEAKER
    spread = np.array([-1.0, 1.0] * 5)  # sd (ddof=1) of +-x over 10 draws is x * sqrt(10 / 9)
    runs = {"recovery": {"low": list(0.27 + 0.001 * spread), "high": list(0.33 + 0.001 * spread)},
            "margin": {"low": list(0.004 + 0.002 * spread), "high": list(0.1 + 0.002 * spread)}}
    d = mc.deciding_bound("patch_attn_out", _record("patch_attn_out", m, runs))
    assert d is not None and (d.statistic, d.side, d.threshold) == ("margin", "low", 0.0)
    assert d.mc_se == pytest.approx(0.002 * np.sqrt(10 / 9), rel=1e-12)
    assert d.z == pytest.approx(0.004 / d.mc_se, rel=1e-12) and d.z < mc.BOUNDARY_Z
    assert d.other == rp.NOT_SHOWN and d.reading() == f"on the boundary: {rp.WEAKER} / {rp.NOT_SHOWN}"


def test_no_single_end_decides_when_two_parts_both_contradict():
    """Both parts of a two-part claim contradicted: moving any one end leaves the other part contradicting."""
    m = rp.Measurement({"recovery": Estimate(0.63, 0.6, 0.66), "margin": Estimate(-0.1, -0.14, -0.07)})
    assert rp.judge("patch_attn_out", m).verdict == rp.CONTRADICTED
    runs = {"recovery": {"low": [0.6, 0.61], "high": [0.66, 0.67]}, "margin": {"low": [-0.14, -0.13],
                                                                               "high": [-0.07, -0.06]}}
    assert mc.deciding_bound("patch_attn_out", _record("patch_attn_out", m, runs)) is None


def test_the_boundary_rule_reads_both_verdicts_only_within_its_distance():
    assert mc.boundary_reading(rp.NOT_SHOWN, rp.WEAKER, 1.99) == f"on the boundary: {rp.NOT_SHOWN} / {rp.WEAKER}"
    assert mc.boundary_reading(rp.NOT_SHOWN, rp.WEAKER, 2.0) == rp.NOT_SHOWN
    assert mc.BOUNDARY_Z == 2.0


def test_every_interval_a_registered_rule_reads_has_its_thresholds():
    """A claim judged from an interval cannot be left out of the re-analysis: every estimate with an interval in
    the registrations' measurements is either read against thresholds or is one the rules never judge."""
    shown_only = {"recovery_ppl", "instances", "instance_sd"}
    for name in REGISTERED:
        claims = _data(name)["claims"]
        for key, record in claims.items():
            m = rp.measurement_from_dict(record["registered"])
            judged = {n for n, e in m.estimates.items() if e.has_interval} - shown_only
            if key == "patch_up":  # its rule reads the ordering alone; the recovery is shown
                judged.discard("recovery")
            assert judged <= set(mc.thresholds(key, m)), (name, key)
        # every verdict that concludes something is in the re-analysis, except the layer counts (no interval of
        # their own in the analysis: the per-layer intervals come from the run)
        table = pd.read_csv(DATA / name / "reproduction.csv")
        concluding = {k for k, c in rp.CLAIMS.items()
                      if table.set_index("claim").loc[c.claim, "verdict"] in rp.CONCLUDING} - {"reversal_h_mse"}
        assert concluding <= set(claims), (name, concluding - set(claims))


def test_the_measurements_are_read_without_leaving_the_rules_patched(tmp_path):
    """``measurements`` reads analyse's measurements by wrapping reproduction_frame; a refused analysis (here
    registration 1, whose fingerprint today's code does not match) leaves the module as it was."""
    original = rp.reproduction_frame
    p = confirm.Preregistration.load(confirm.PREREG_DIR / "smollm2-confirmatory-1.json")
    with pytest.raises(InterpError, match="changed after pre-registration"):
        mc.measurements(p, tmp_path)
    assert rp.reproduction_frame is original
    with pytest.raises(InterpError, match="at least 2 seeds"):
        mc.compute(confirm.PREREG_DIR / "smollm2-confirmatory-2.json", tmp_path, 1)
