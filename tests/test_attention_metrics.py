"""Entropy, GTD, sink share, effective span: checked against naive per-element loops."""

from __future__ import annotations

import math

import pytest
import torch
from attention_helpers import random_causal
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import EPS32, EPS64, U_BF16, rounding_tol

from interp.attention import (
    effective_span,
    entropy,
    gtd,
    keys_per_query,
    masked_mean,
    sink_share,
    valid_query_mask,
)
from interp.errors import InterpError

pytestmark = pytest.mark.numerical  # derived tolerances: CI reruns this file with one thread



def _tol(n_terms, scale, eps=EPS64):
    """:func:`tolerances.rounding_tol` with this file's working precision."""
    return rounding_tol(n_terms, scale, eps)


def _entropy_tol(n_keys, normalized=False, eps=EPS64):
    """Two evaluations of entropy (ours and the naive loop) over rows of ``n_keys`` keys.

    Each term ``a log a`` takes a log (2 roundings) and a product (1); ``n_keys - 1`` additions
    sum terms of one sign, so their magnitudes add up to H <= log n_keys. Normalising divides by
    a computed ``log n`` (3 more roundings) and gives a value <= 1.
    """
    n_keys = torch.as_tensor(n_keys, dtype=torch.float64)
    scale = torch.ones_like(n_keys) if normalized else n_keys.clamp_min(1).log()
    return _tol(n_keys + 5, scale, eps)


def _gtd_tol(n, hops):
    """Two evaluations of GTD on n x n row-stochastic patterns.

    Each of the ``hops - 1`` matrix products of non-negative matrices is off by <= n roundings
    relative to each entry (Higham 3.5); weighting, adding and dividing the powers takes
    ``hops - 1 + hops - 2 + 1`` more; rows of the mixture sum to <= 1. The ``n`` differences
    ``A - W`` (one rounding each), whose magnitudes sum to <= 2, are summed with ``n - 1``
    additions: ``2n`` roundings of size <= 1 in all.
    """
    return _tol((hops - 1) * (n + 2) + 2 * n, 1.0)


def naive_entropy(pattern, key_mask=None, normalized=False):
    *lead, n_q, n_k = pattern.shape
    flat = pattern.reshape(-1, n_q, n_k).tolist()
    masks = None if key_mask is None else key_mask.reshape(-1, n_k).tolist()
    heads_per_mask = 1 if key_mask is None else len(flat) // len(masks)
    out = []
    for index, matrix in enumerate(flat):
        row_values = []
        for i in range(n_q):
            h = 0.0
            for k in range(n_k):
                a = matrix[i][k]
                if a > 0:
                    h -= a * math.log(a)
            if normalized:
                if masks is None:
                    n = i + 1 + (n_k - n_q)
                else:
                    mask = masks[index // heads_per_mask]
                    n = sum(1 for k in range(i + 1 + (n_k - n_q)) if mask[k])
                h = h / math.log(n) if n > 1 else 0.0
            row_values.append(h)
        out.append(row_values)
    return torch.tensor(out, dtype=torch.float64).reshape(*lead, n_q)


def naive_matmul(x, y):
    n = len(x)
    return [[sum(x[i][j] * y[j][k] for j in range(n)) for k in range(n)] for i in range(n)]


def naive_gtd(pattern, hops=2, alpha=1.0):
    *lead, n, _ = pattern.shape
    out = []
    for matrix in pattern.reshape(-1, n, n).tolist():
        walk = [[0.0] * n for _ in range(n)]
        power = matrix
        total_weight = 0.0
        for m in range(2, hops + 1):
            power = naive_matmul(power, matrix)
            weight = alpha ** (m - 2)
            total_weight += weight
            walk = [[walk[i][k] + weight * power[i][k] for k in range(n)] for i in range(n)]
        out.append([0.5 * sum(abs(matrix[i][k] - walk[i][k] / total_weight) for k in range(n)) for i in range(n)])
    return torch.tensor(out, dtype=torch.float64).reshape(*lead, n)


@pytest.mark.parametrize("normalized", [False, True])
def test_entropy_matches_naive_loop_with_padding(normalized):
    pattern, key_mask = random_causal(3, 2, 7, seed=1, pad_max=3)
    expected = naive_entropy(pattern, key_mask.unsqueeze(1).expand(3, 2, 7), normalized)
    got = entropy(pattern, normalized=normalized, key_mask=key_mask[:, None, :])
    torch.testing.assert_close(got, expected, rtol=0, atol=float(_entropy_tol(7, normalized)))


def test_entropy_default_mask_is_causal_without_padding():
    pattern, _ = random_causal(2, 3, 6, seed=2)
    torch.testing.assert_close(entropy(pattern, normalized=True), naive_entropy(pattern, normalized=True),
                               rtol=0, atol=float(_entropy_tol(6, normalized=True)))


def test_entropy_with_cached_prefix_counts_earlier_keys():
    pattern, _ = random_causal(1, 1, 6, seed=3)
    last_rows = pattern[..., 4:, :]  # 2 queries over 6 keys: query i sees keys 0..4+i
    torch.testing.assert_close(
        entropy(last_rows, normalized=True), naive_entropy(last_rows, normalized=True),
        rtol=0, atol=float(_entropy_tol(6, normalized=True)),
    )


@pytest.mark.parametrize(("hops", "alpha"), [(2, 1.0), (3, 1.0), (4, 0.5)])
def test_gtd_matches_naive_loop(hops, alpha):
    pattern, _ = random_causal(2, 2, 6, seed=4, pad_max=2)
    torch.testing.assert_close(gtd(pattern, hops=hops, alpha=alpha), naive_gtd(pattern, hops, alpha),
                               rtol=0, atol=_gtd_tol(6, hops))


def test_sink_share_and_effective_span_match_naive():
    pattern, _ = random_causal(2, 2, 5, seed=5)
    torch.testing.assert_close(sink_share(pattern), pattern[..., :, 0], rtol=0, atol=0)  # a slice: bitwise
    torch.testing.assert_close(sink_share(pattern, sink=2), pattern[..., :, 2], rtol=0, atol=0)
    # exp turns an error e in H into a relative error e (+ 2 roundings for exp) of a span <= 5
    span_tol = 5 * (float(_entropy_tol(5)) + _tol(2, 1.0))
    torch.testing.assert_close(effective_span(pattern), naive_entropy(pattern).exp(), rtol=0, atol=span_tol)


def test_known_values():
    sink = torch.zeros(4, 4)
    sink[:, 0] = 1.0
    assert torch.equal(gtd(sink), torch.zeros(4))  # A @ A == A: multi-hop adds nothing
    chain = torch.tensor([[1.0, 0, 0], [1.0, 0, 0], [0, 1.0, 0]])
    assert gtd(chain).tolist() == [0.0, 0.0, 1.0]  # 2 -> 1 -> 0: the two-hop target is new
    uniform = torch.tril(torch.ones(5, 5, dtype=torch.float64))
    uniform = uniform / uniform.sum(-1, keepdim=True)
    # Against the closed forms log k and k: besides the two evaluations' rounding (_entropy_tol),
    # 1/k is stored rounded (relative u), which moves H_k by <= u (log k + 1) <= eps log 5.
    h_tol = float(_entropy_tol(5)) + _tol(1, math.log(5))
    torch.testing.assert_close(entropy(uniform), torch.log(torch.arange(1.0, 6.0, dtype=torch.float64)),
                               rtol=0, atol=h_tol)
    torch.testing.assert_close(effective_span(uniform), torch.arange(1.0, 6.0, dtype=torch.float64),
                               rtol=0, atol=5 * (h_tol + _tol(2, 1.0)))


def test_padded_rows_give_zero_not_nan():
    pattern, key_mask = random_causal(2, 2, 6, seed=6, pad_max=4)
    pattern = pattern.float()
    pattern[0, :, :3] = 0.0  # make sure some rows are entirely zero
    for values in (entropy(pattern), entropy(pattern, True, key_mask[:, None]), gtd(pattern), gtd(pattern, 3)):
        assert torch.isfinite(values).all()
        assert (values[0, :, :3] == 0).all()
    assert (effective_span(pattern)[0, :, :3] == 1).all()


def test_valid_query_mask_and_counts_match_naive():
    key_mask = torch.tensor([[True, True, True, True], [False, False, True, True], [False, True, True, True]])
    expected_counts = [[1, 2, 3, 4], [0, 0, 1, 2], [0, 1, 2, 3]]
    assert keys_per_query(4, key_mask).tolist() == expected_counts
    expected = [[c >= 2 and key_mask[r, i].item() for i, c in enumerate(row)] for r, row in enumerate(expected_counts)]
    assert valid_query_mask(4, key_mask).tolist() == expected
    assert valid_query_mask(3).tolist() == [False, True, True]
    assert valid_query_mask(3, min_keys=1).tolist() == [True, True, True]


def test_masked_mean_ignores_masked_nan():
    values = torch.tensor([[1.0, float("nan"), 3.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([True, False, True])
    # (1 + 3) / 2 and (2 + 2 + 2) / 3: small integers, exact in binary floating point
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([2.0, 2.0]), rtol=0, atol=0)
    assert masked_mean(values, torch.zeros(3, dtype=torch.bool), dim=-1).isnan().all()


def test_half_precision_is_upcast():
    pattern, _ = random_causal(1, 2, 8, seed=7)
    got = entropy(pattern.to(torch.bfloat16))
    assert got.dtype == torch.float32
    # Storing p in bfloat16 multiplies each entry by (1 + d), |d| <= u = 2**-8, which moves
    # H = -sum p log p by -sum p d (log p + 1) + O(d**2): at most u (H + 1) <= u (log 8 + 1), plus
    # u**2 for the second-order terms; the float32 entropy and the float64 loop add their rounding.
    bound = U_BF16 * (math.log(8) + 1) + U_BF16**2 + float(_entropy_tol(8, eps=EPS32))
    torch.testing.assert_close(got.double(), naive_entropy(pattern), rtol=0, atol=bound)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: gtd(torch.rand(2, 3)), "square"),
        (lambda: entropy(torch.rand(4, 3)), "more queries"),
        (lambda: gtd(torch.eye(3), hops=1), "hops"),
        (lambda: gtd(torch.eye(3), alpha=-1.0), "alpha"),
        (lambda: sink_share(torch.eye(3), sink=3), "out of range"),
        (lambda: entropy(torch.eye(3, dtype=torch.long)), "floating point"),
        (lambda: entropy(torch.rand(3)), "shape"),
        (lambda: entropy(torch.eye(3), True, key_mask=torch.ones(3)), "bool"),
    ],
)
def test_bad_input_raises_interp_error(call, message):
    with pytest.raises(InterpError, match=message):
        call()


# ----------------------------------------------------------------------- properties

patterns = st.builds(
    random_causal,
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    length=st.integers(1, 9),
    seed=st.integers(0, 10_000),
    pad_max=st.integers(0, 3),
    sharpness=st.floats(0.1, 8.0),
)


@settings(max_examples=25, deadline=None)
@given(patterns)
def test_entropy_lies_in_zero_log_n(case):
    pattern, key_mask = case
    mask = key_mask[:, None, :]
    h = entropy(pattern)
    n = keys_per_query(pattern.shape[-1], mask).double()
    assert (h >= 0).all()  # entropy clamps at 0: exact
    # A row of the float64 softmax sums to 1 only within n + 2 roundings, which can lift the
    # exact H of the stored row above log n by (n + 2) u log n; the evaluation adds its own.
    log_n = torch.log(n.clamp_min(1))
    assert (h <= log_n + _entropy_tol(n) + _tol(n + 2, log_n)).all()
    normalized = entropy(pattern, normalized=True, key_mask=mask)
    assert ((normalized >= 0) & (normalized <= 1 + _entropy_tol(n, normalized=True) + _tol(n + 2, 1.0))).all()


@settings(max_examples=25, deadline=None)
@given(patterns, st.integers(2, 4), st.floats(0.0, 2.0))
def test_gtd_lies_in_unit_interval(case, hops, alpha):
    values = gtd(case[0], hops=hops, alpha=alpha)
    assert ((values >= 0) & (values <= 1)).all()


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 8), st.integers(1, 4), st.integers(0, 10_000))
def test_left_padding_does_not_change_real_positions(length, pad, seed):
    pattern, _ = random_causal(1, 2, length, seed=seed)
    padded = torch.zeros(1, 2, length + pad, length + pad, dtype=pattern.dtype)
    padded[..., pad:, pad:] = pattern
    key_mask = (torch.arange(length + pad) >= pad)[None, None, :]
    # the padded rows add exact zeros (0 log 0 = 0, 0 * x = 0) but may sum in another order
    n = length + pad
    torch.testing.assert_close(entropy(padded)[..., pad:], entropy(pattern), rtol=0, atol=float(_entropy_tol(n)))
    torch.testing.assert_close(entropy(padded, True, key_mask)[..., pad:], entropy(pattern, True),
                               rtol=0, atol=float(_entropy_tol(n, normalized=True)))
    torch.testing.assert_close(gtd(padded, hops=3)[..., pad:], gtd(pattern, hops=3), rtol=0, atol=_gtd_tol(n, 3))
    assert (entropy(padded)[..., :pad] == 0).all()
    assert not valid_query_mask(length + pad, key_mask)[..., :pad].any()
