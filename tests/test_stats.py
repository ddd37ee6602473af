"""interp.stats against scipy and naive reimplementations."""

from __future__ import annotations

import itertools
import math
from math import comb

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from interp import stats


def _data(n=60, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    y = 0.6 * x + rng.normal(size=n)
    return x, y


def test_pearson_and_spearman_point_estimates_match_scipy():
    x, y = _data()
    p = stats.pearson(x, y, n_boot=200)
    s = stats.spearman(x, y, n_boot=200)
    assert p.r == pytest.approx(sps.pearsonr(x, y).statistic, abs=1e-12)
    assert p.p == pytest.approx(sps.pearsonr(x, y).pvalue, rel=1e-9)
    assert s.r == pytest.approx(sps.spearmanr(x, y).statistic, abs=1e-12)
    assert p.low <= p.r <= p.high and s.low <= s.r <= s.high


def test_bootstrap_interval_matches_a_naive_loop():
    x, y = _data(40, seed=1)
    result = stats.spearman(x, y, n_boot=300, seed=7, level=0.9)
    idx = np.random.default_rng(7).integers(0, 40, size=(300, 40))
    naive = [sps.spearmanr(x[i], y[i]).statistic for i in idx]
    low, high = np.percentile(naive, [5, 95])
    assert result.low == pytest.approx(low, abs=1e-12)
    assert result.high == pytest.approx(high, abs=1e-12)


def test_bootstrap_interval_covers_the_true_correlation_usually():
    # 40 datasets with true rho = 0.6 / sqrt(1.36); a 90% interval should miss only a few times.
    true_r = 0.6 / math.sqrt(1.36)
    misses = 0
    for seed in range(40):
        x, y = _data(200, seed=seed)
        c = stats.pearson(x, y, n_boot=300, seed=seed, level=0.9)
        misses += not (c.low <= true_r <= c.high)
    assert misses <= 10


def test_correlation_handles_nan_and_constant_input():
    x, y = _data(30)
    x[3] = np.nan
    assert stats.pearson(x, y, n_boot=0).n == 29
    constant = stats.pearson(np.ones(10), np.arange(10.0), n_boot=10)
    assert math.isnan(constant.r) and constant.to_dict()["r"] is None


def test_correlation_matrix_matches_pairwise_and_pandas():
    rng = np.random.default_rng(3)
    base = rng.normal(size=80)
    scales = zip("abcd", [0.3, 0.6, 1.0, 2.0], strict=True)
    frame = pd.DataFrame({c: base + rng.normal(scale=s, size=80) for c, s in scales})
    for method in ("pearson", "spearman"):
        m = stats.correlation_matrix(frame, method, n_boot=100, seed=2)
        expected = frame.corr(method=method)
        np.testing.assert_allclose(m.r.to_numpy(), expected.to_numpy(), atol=1e-12)
        single = stats.correlation(frame["a"], frame["c"], method, n_boot=100, seed=2)
        assert m.low.loc["a", "c"] == pytest.approx(single.low, abs=1e-12)
        assert m.high.loc["a", "c"] == pytest.approx(single.high, abs=1e-12)
        assert m.boot.shape == (100, 4, 4)
    pearson_matrix = frame.corr()
    naive_mean = np.mean([pearson_matrix.loc[a, b] for a, b in itertools.combinations("abcd", 2)])
    assert stats.off_diagonal_mean(frame.corr().to_numpy()) == pytest.approx(naive_mean)


def test_jaccard_and_top_fraction():
    assert stats.jaccard({1, 2, 3}, {2, 3, 4}) == pytest.approx(2 / 4)
    assert stats.jaccard([], []) == 0.0
    values = pd.Series([0.1, 0.9, 0.5, 0.9, -1.0, 0.3, 0.2, 0.0, 0.8, 0.4], index=list("abcdefghij"))
    assert stats.top_fraction_ids(values, 0.2) == ["b", "d"]  # tie kept in order
    assert stats.top_fraction_ids(values, 0.3) == ["b", "d", "i"]
    assert stats.top_count(1000, 0.1) == 100 and stats.top_count(5, 0.1) == 1


def test_expected_random_jaccard_exact_against_enumeration_and_simulation():
    n, k = 8, 3
    subsets = list(itertools.combinations(range(n), k))
    enumerated = np.mean([stats.jaccard(a, b) for a in subsets for b in subsets])
    assert stats.expected_random_jaccard(n, k) == pytest.approx(enumerated, abs=1e-12)
    # and the paper-scale value, by simulation
    rng = np.random.default_rng(0)
    sims = [stats.jaccard(rng.choice(1000, 100, replace=False), rng.choice(1000, 100, replace=False))
            for _ in range(3000)]
    assert stats.expected_random_jaccard(1000, 100) == pytest.approx(np.mean(sims), abs=0.002)
    assert abs(stats.expected_random_jaccard(10000, 1000) - 0.1 / 1.9) < 0.001
    assert comb(n, k) == len(subsets)


def _naive_ngram_jaccard(a, b, n):
    ga = {tuple(a[i : i + n]) for i in range(len(a) - n + 1)}
    gb = {tuple(b[i : i + n]) for i in range(len(b) - n + 1)}
    return len(ga & gb) / len(ga | gb) if ga | gb else 0.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=20), st.lists(st.integers(0, 4), max_size=20), st.integers(1, 5))
def test_ngram_jaccard_matches_naive(a, b, n):
    assert stats.ngram_jaccard(a, b, n) == pytest.approx(_naive_ngram_jaccard(a, b, n))


def test_dedup_drops_near_duplicates_greedily():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 1000, size=60).tolist()
    near = base[:55] + rng.integers(0, 1000, size=5).tolist()  # shares most 5-grams with base
    other = rng.integers(0, 1000, size=60).tolist()
    rows = [base, other, near, list(other)]
    assert stats.ngram_jaccard(base, near) > 0.5
    assert stats.dedup(rows, threshold=0.1) == [0, 1]
    # naive: keep i if no kept j has similarity above the threshold
    kept = []
    for i, row in enumerate(rows):
        if all(_naive_ngram_jaccard(row, rows[j], 5) <= 0.1 for j in kept):
            kept.append(i)
    assert kept == [0, 1]
    assert stats.dedup(rows, threshold=1.0) == [0, 1, 2, 3]
