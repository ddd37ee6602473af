"""The survival study's registered statistics (issue 48) on synthetic raw data whose answers are known."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import save_file

from interp.report.survival.analyse import (
    circuit_analysis,
    decide,
    edge_verdict,
    head_verdict,
    induction_analysis,
    ratio_of_means,
)
from interp.report.survival.registration import registration
from interp.report.survival.run import file_name
from interp.stats import Estimate

MODEL = "smollm2-135m"
SEEDS = [1, 2, 3]  # three re-analyses keep the test fast; the page uses the registered twenty


def _save(path, **arrays):
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: torch.as_tensor(np.ascontiguousarray(v)) for k, v in arrays.items()}, str(path))


def test_verdict_rules_read_the_interval_ends():
    e = lambda lo, hi: Estimate((lo + hi) / 2, lo, hi)  # noqa: E731
    assert head_verdict(e(0.6, 0.9), e(0.5, 0.7), 0.5) == "keeps its role"
    assert head_verdict(e(0.6, 0.9), e(0.1, 0.49), 0.5) == "loses its role"
    assert head_verdict(e(0.4, 0.9), e(0.6, 0.7), 0.5) == "not resolved"
    readings = [edge_verdict(e(lo, hi)) for lo, hi in
                [(0.8, 1.2), (0.5, 0.79), (-0.3, 0.49), (0.6, 0.9), (0.3, 0.7), (0.3, 0.9)]]
    assert readings == ["kept", "weakened", "broken", "kept or weakened", "weakened or broken", "not resolved"]


def test_ratio_of_means_is_the_ratio_and_its_interval_covers_it():
    rng = np.random.default_rng(0)
    ref = 1 + 0.1 * rng.standard_normal((200, 2, 3))
    q = [0.5 * ref + 0.01 * rng.standard_normal(ref.shape) for _ in range(3)]
    c = ratio_of_means(q, ref, (1, 2), n_boot=400, seed=0)
    expected = np.mean([qi[:, 1, 2].mean() / ref[:, 1, 2].mean() for qi in q])
    assert c.estimate.value == pytest.approx(expected, rel=1e-12)
    assert c.estimate.low < expected < c.estimate.high and c.instances == 3


def test_decide_flags_a_bound_within_two_monte_carlo_errors():
    e = {"x": Estimate(0.6, 0.501, 0.7)}
    replicas = [{"x": Estimate(0.6, 0.501 + d, 0.7)} for d in (-0.01, 0.0, 0.01)]
    d = decide(lambda est: edge_verdict(est["x"]), e, replicas, {"x": (0.5, 0.8)})
    assert d.verdict == "weakened" and d.reading.startswith("on the boundary: weakened /") and d.bound == "x.low vs 0.5"
    far = decide(lambda est: edge_verdict(est["x"]), {"x": Estimate(0.65, 0.6, 0.7)}, replicas, {"x": (0.5, 0.8)})
    assert far.reading == "weakened"


@pytest.fixture
def induction_raw(tmp_path):
    """Two induction heads (PM ~0.8, copying > 0), one prefix-matcher without copying; RTN halves nothing but kills
    head 1.1's prefix matching, GPTQ keeps both."""
    rng = np.random.default_rng(1)
    pm = 0.05 + 0.01 * rng.random((128, 2, 2))
    cp = 0.0 + 0.01 * rng.standard_normal((128, 2, 2))
    pm[:, 1, 0], pm[:, 1, 1], pm[:, 0, 1] = 0.8, 0.7, 0.6
    cp[:, 1, 0] += 2.0
    cp[:, 1, 1] += 1.0
    meas_pm = np.concatenate([pm, pm]) + 0.01 * rng.random((256, 2, 2))
    meas_cp = np.concatenate([cp, cp])
    _save(tmp_path / "induction" / "reference.safetensors", pm_selection=pm, cp_selection=cp, pm=meas_pm, cp=meas_cp)
    rtn_pm = meas_pm.copy()
    rtn_pm[:, 1, 1] *= 0.1
    _save(tmp_path / "induction" / f"{file_name('rtn:bits=3,group=64')}.safetensors", pm=rtn_pm, cp=meas_cp * 0.95)
    for s in (61, 62, 63):
        _save(tmp_path / "induction" / f"{file_name(f'gptq:bits=3,group=64@seed{s}')}.safetensors",
              pm=meas_pm * (0.97 + 0.001 * s - 0.06), cp=meas_cp * 0.9)
    return tmp_path


def test_induction_analysis_finds_the_heads_and_judges_them(induction_raw):
    r = induction_analysis(induction_raw, MODEL, registration(), seeds=SEEDS)
    assert r["bar_met"] and r["judged_heads"] == ["1.0", "1.1"]
    listed = r["reference_heads"].set_index("head")
    assert not listed.loc["0.1", "induction head"]  # prefix matching without copying: listed, not judged
    v = r["survival"].set_index(["method", "head"])["verdict"]
    assert v[("rtn:bits=3,group=64", "1.0")] == "keeps its role"
    assert v[("rtn:bits=3,group=64", "1.1")] == "loses its role"
    assert (v.loc["gptq:bits=3,group=64"] == "keeps its role").all()
    summary = r["summary"].set_index("method")
    assert summary.loc["rtn:bits=3,group=64", "share_kept"] == pytest.approx(0.5)
    assert summary.loc["gptq:bits=3,group=64", "instances"] == 3
    contrast = r["rtn_vs_gptq"].set_index("bits")
    assert contrast.loc[3, "verdict"] == "holds in direction" and contrast.loc[3, "D"] > 0


@pytest.fixture
def circuit_raw(tmp_path):
    rng = np.random.default_rng(2)
    folder = tmp_path / "circuits"
    table = pd.DataFrame({"edge": ["head 1.0 -> logits", "mlp 1 -> logits", "head 0.1 -> q 1.0"],
                          "sender": ["head 1.0", "mlp 1", "head 0.1"], "receiver": ["logits", "logits", "q 1.0"],
                          "eap": [-1.0, -0.5, 0.01], "selection_effect": [-1.0, -0.5, 0.02]})
    folder.mkdir(parents=True)
    table.to_parquet(folder / "ioi-reference.parquet")
    ref = np.stack([-1 + 0.1 * rng.standard_normal(128), -0.5 + 0.05 * rng.standard_normal(128),
                    0.3 * rng.standard_normal(128)])
    clean = 3 + 0.2 * rng.standard_normal(128)
    _save(folder / "ioi" / "reference.safetensors", effects=ref, clean=clean)
    q = ref.copy()
    q[1] *= 0.2  # the MLP edge breaks
    _save(folder / "ioi" / f"{file_name('rtn:bits=3,group=64')}.safetensors", effects=q, clean=clean - 1.0)
    return tmp_path


def test_circuit_analysis_judges_edges_bands_and_the_lost_logit_difference(circuit_raw):
    r = circuit_analysis(circuit_raw, MODEL, "ioi", registration(), seeds=SEEDS)
    assert r["edges"]["judged"].tolist() == [True, True, False]  # the third edge's interval covers 0
    per_edge = r["per_edge"].set_index("edge")
    assert per_edge.loc["head 1.0 -> logits", "verdict"] == "kept"
    assert per_edge.loc["mlp 1 -> logits", "verdict"] == "broken"
    assert per_edge.loc["mlp 1 -> logits", "lost_part"] == pytest.approx(0.8 * 0.5, rel=0.1)
    method = r["per_method"].set_index("method").loc["rtn:bits=3,group=64"]
    assert (method["share_kept"], method["share_broken"], method["reading"]) == (0.5, 0.5, "circuit broken")
    assert (method["kept"], method["broken"]) == (1, 1)
    assert method["ld_lost"] == pytest.approx(1.0, rel=1e-9)
    assert circuit_analysis(circuit_raw, MODEL, "capitals", registration()) is None


def test_tie_reads_which_restoration_repairs_the_broken_edges(tmp_path):
    from interp.report.survival.tie import tie_analysis

    rng = np.random.default_rng(3)
    folder = tmp_path / "circuits" / "ioi"
    ref = -1 + 0.1 * rng.standard_normal((4, 128))
    _save(folder / "reference.safetensors", effects=ref, clean=np.full(128, 3.0))
    broken = ref.copy()
    broken[:3] *= 0.1  # three of four edges broken under RTN
    rtn = "rtn:bits=3,group=64"
    _save(folder / f"{file_name(rtn)}.safetensors", effects=broken, clean=np.full(128, 2.0))
    _save(folder / f"{file_name(rtn + '#named')}.safetensors", effects=ref * 0.95, clean=np.full(128, 3.0))
    _save(folder / f"{file_name(rtn + '#control')}.safetensors", effects=broken, clean=np.full(128, 2.0))
    rows = tie_analysis(tmp_path, MODEL, "circuits/ioi", np.ones(4, dtype=bool), registration(), seeds=SEEDS)
    (row,) = rows
    assert (row["broken_units"], row["T"], row["verdict"]) == (3, 1.0, "gate and down carry it")
    # the same data with the variants swapped reads the other way
    _save(folder / f"{file_name(rtn + '#named')}.safetensors", effects=broken, clean=np.full(128, 2.0))
    _save(folder / f"{file_name(rtn + '#control')}.safetensors", effects=ref, clean=np.full(128, 3.0))
    (row,) = tie_analysis(tmp_path, MODEL, "circuits/ioi", np.ones(4, dtype=bool), registration(), seeds=SEEDS)
    assert (row["T"], row["verdict"]) == (-1.0, "the other weights carry more")


def _naive_e(values, reference, region, rows):
    """E on one set of rows, by a loop over units: (broken share in the region) / (judged share in the region)."""
    broken = [values[rows, u].mean() / reference[rows, u].mean() < 0.5 for u in range(values.shape[1])]
    if not any(broken):
        return np.nan
    inside = sum(b and r for b, r in zip(broken, region, strict=True)) / sum(broken)
    return inside / (sum(region) / len(region))


def test_where_the_broken_edges_sit_matches_a_loop_over_units(tmp_path):
    from interp.report.survival.tie import _e_statistic, concentration_analysis

    rng = np.random.default_rng(5)
    folder = tmp_path / "circuits" / "ioi"
    n, units = 96, 6
    ref = -1 + 0.3 * rng.standard_normal((units, n))
    q = ref.copy()
    q[[0, 1, 3, 4]] *= np.array([[0.3], [0.45], [0.4], [0.55]]) + 0.2 * rng.standard_normal((4, n))  # near 0.5
    _save(folder / "reference.safetensors", effects=ref, clean=np.full(n, 3.0))
    rtn = "rtn:bits=3,group=64"
    _save(folder / f"{file_name(rtn)}.safetensors", effects=q, clean=np.full(n, 2.0))
    judged = np.array([True, True, True, True, True, False])
    region = np.array([True, True, False, False, False])  # among the judged: the first two
    # the vectorised statistic against the loop, on all rows and on a few resamples
    from interp.stats import bootstrap_indices

    rows = np.concatenate([np.arange(n)[None], bootstrap_indices(n, 25, 7)])
    got = _e_statistic(0.5)(([(q.T[:, judged], ref.T[:, judged])], region), rows)
    want = [_naive_e(q.T[:, judged], ref.T[:, judged], region, r) for r in rows]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    (row,) = concentration_analysis(tmp_path, MODEL, "circuits/ioi", judged, region, registration(), seeds=SEEDS)
    assert row["E"] == pytest.approx(want[0], rel=1e-12)
    assert (row["broken_units"], row["judged_units"], row["in_region"]) == (sum(
        q[u].mean() / ref[u].mean() < 0.5 for u in range(5)), 5, 2)
    # the degenerate regions are named, not read
    (none,) = concentration_analysis(tmp_path, MODEL, "circuits/ioi", judged, np.zeros(5, dtype=bool),
                                     registration(), seeds=SEEDS)
    (every,) = concentration_analysis(tmp_path, MODEL, "circuits/ioi", judged, np.ones(5, dtype=bool),
                                      registration(), seeds=SEEDS)
    assert none["verdict"].startswith("undefined") and every["verdict"].startswith("uninformative")


def test_broken_edges_all_in_the_region_concentrate_there(tmp_path):
    from interp.report.survival.tie import concentration_analysis

    rng = np.random.default_rng(8)
    folder = tmp_path / "circuits" / "ioi"
    ref = -1 + 0.1 * rng.standard_normal((6, 128))
    q = ref.copy()
    q[:3] *= 0.1  # the three region edges broken, the rest intact
    _save(folder / "reference.safetensors", effects=ref, clean=np.full(128, 3.0))
    _save(folder / f"{file_name('rtn:bits=3,group=64')}.safetensors", effects=q, clean=np.full(128, 2.0))
    region = np.array([True, True, True, False, False, False])
    (row,) = concentration_analysis(tmp_path, MODEL, "circuits/ioi", np.ones(6, dtype=bool), region,
                                    registration(), seeds=SEEDS)
    assert (row["E"], row["verdict"]) == (2.0, "concentrate there")  # all broken in half of the units
    q = ref.copy()
    q[:2] *= 0.1  # two broken units: below T's minimum of 3, which E shares
    _save(folder / f"{file_name('rtn:bits=3,group=64')}.safetensors", effects=q, clean=np.full(128, 2.0))
    (row,) = concentration_analysis(tmp_path, MODEL, "circuits/ioi", np.ones(6, dtype=bool), region,
                                    registration(), seeds=SEEDS)
    assert (row["broken_units"], row["verdict"]) == (2, "too few broken units")
    q = ref.copy()
    q[3:6] *= 0.1  # now the broken edges avoid the region
    _save(folder / f"{file_name('rtn:bits=3,group=64')}.safetensors", effects=q, clean=np.full(128, 2.0))
    (row,) = concentration_analysis(tmp_path, MODEL, "circuits/ioi", np.ones(6, dtype=bool), region,
                                    registration(), seeds=SEEDS)
    assert (row["E"], row["verdict"]) == (0.0, "avoid it")
