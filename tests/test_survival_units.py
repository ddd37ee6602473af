"""The survival study's units (issue 48): induction scores against independent computations, the prompt sets."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from test_components import build_family

from interp.data import Examples
from interp.errors import DataError
from interp.localize.dla import logit_attribution
from interp.localize.patterns import attention_patterns
from interp.report.survival.induction import induction_scores
from interp.report.survival.units import reference_sets, repeated_sequences, token_set

SET = list(range(10, 60))


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tmp_path_factory):
    """A tiny Llama, and a tiny Gemma-3 (attention-output norms, norm offset, grouped keys), in float64 so that
    two orders of summation agree to ~1e-13 relative."""
    return build_family(request.param, tmp_path_factory.mktemp(f"survival_{request.param}"), torch.float64)


def test_sequences_repeat_distinct_tokens_from_the_set():
    seqs = repeated_sequences(SET, bos=1, r=8, n=5, seed=3)
    assert torch.equal(seqs[:, 1:9], seqs[:, 9:])
    assert all(len(set(row[1:9].tolist())) == 8 and set(row[1:9].tolist()) <= set(SET) for row in seqs)
    assert torch.equal(seqs, repeated_sequences(SET, bos=1, r=8, n=5, seed=3))  # seeded
    assert not torch.equal(seqs, repeated_sequences(SET, bos=1, r=8, n=5, seed=4))
    with pytest.raises(DataError, match="at least 80"):
        repeated_sequences(SET, bos=1, r=80, n=1, seed=0)


def test_token_set_ranks_by_count_then_id_and_drops_special_and_abnormal():
    counts = Counter({5: 3, 6: 3, 7: 10, 8: 1, 9: 99, 2: 50})
    types = [1] * 10
    types[9] = 3  # a control token
    assert token_set(counts, special=[2], types=types, size=3) == [7, 5, 6]
    with pytest.raises(DataError, match="only 4 distinct"):
        token_set(counts, special=[2], types=types, size=5)


def test_reference_sets_follow_the_registered_sizes():
    assert reference_sets(range(300))[2] == "measured"
    chosen, rest, reading = reference_sets(range(150))
    assert (len(chosen), len(rest), reading) == (64, 86, "short")
    assert reference_sets(range(127))[2] == "not measured"


def test_prefix_matching_is_the_pattern_entry_read_by_a_loop(model):
    seqs = repeated_sequences(SET, bos=1, r=6, n=2, seed=0)
    pm, _ = induction_scores(model, seqs, SET)
    for i in range(2):
        pattern = attention_patterns(model, seqs[i]).pattern.double()  # [layer, head, q, k]
        expected = np.zeros(pm.shape[1:])
        for t in range(7, 13):
            expected += pattern[:, :, t, t - 6 + 1].numpy() / 6
        # attention_patterns hands back float32: each weight <= 1 rounded by <= 2^-25, six of them averaged
        np.testing.assert_allclose(pm[i], expected, rtol=0, atol=2.0**-23)


def test_copying_is_dla_along_the_answer_minus_the_set_mean(model):
    """CP equals logit_attribution's head terms, target y minus the mean of the set's tokens, averaged over t."""
    small = SET[:6]
    seqs = repeated_sequences(small, bos=1, r=4, n=1, seed=0)
    _, cp = induction_scores(model, seqs, small)
    ex = Examples.from_tokens(seqs)
    expected = np.zeros(cp.shape[1:])
    for t in range(5, 8):
        y = int(seqs[0, t + 1])
        heads = logit_attribution(model, ex, y, positions=t).heads[0].double()
        mean = sum(logit_attribution(model, ex, v, positions=t).heads[0].double() for v in small) / len(small)
        expected += (heads - mean).numpy() / 3
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(cp[0], expected, rtol=0, atol=1e-9 * max(scale, 1.0))  # float64, ~100 terms
