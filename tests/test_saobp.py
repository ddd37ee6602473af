"""SAOBP on patterns: naive-loop agreement, beta = 0 identity, repulsion, modes, hook."""

from __future__ import annotations

import math

import pytest
import torch
from attention_helpers import random_causal, sink_pattern
from hypothesis import given, settings
from hypothesis import strategies as st

from interp.attention import entropy, masked_mean, saobp, saobp_hook, valid_query_mask
from interp.errors import InterpError


def naive_saobp(pattern, betas, key_mask=None, mode="exact", scores=None):
    """Per-element loops over [batch, head, query, key] (betas: one float per head)."""
    batch, heads, n, _ = pattern.shape
    out = torch.zeros_like(pattern, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            a = pattern[b, h].tolist()
            beta = betas[h]
            for i in range(n):
                logits = []
                for k in range(n):
                    usable = a[i][k] > 0 and (key_mask is None or bool(key_mask[b, k]))
                    if not usable:
                        logits.append(-math.inf)
                        continue
                    if mode == "exact":
                        value = math.log(a[i][k])
                        for j in range(n):
                            if j != i:
                                c = 1.0 - math.exp(-beta * a[i][j])
                                value += math.log(1.0 - c * a[j][k])
                    else:
                        value = math.log(a[i][k]) if scores is None else float(scores[b, h, i, k])
                        value -= beta * sum(a[i][j] * a[j][k] for j in range(n) if j != i)
                    logits.append(value)
                top = max(logits)
                if top == -math.inf:
                    continue  # no usable key: the row stays zero
                weights = [math.exp(v - top) for v in logits]
                total = sum(weights)
                for k in range(n):
                    out[b, h, i, k] = weights[k] / total
    return out


@pytest.mark.parametrize("mode", ["exact", "first_order"])
def test_matches_naive_loop_with_padding_and_per_head_beta(mode):
    pattern, key_mask = random_causal(2, 3, 7, seed=11, pad_max=3)
    betas = [0.3, 1.5, 4.0]
    got = saobp(pattern, torch.tensor(betas, dtype=torch.float64), mode=mode, key_mask=key_mask[:, None, :])
    torch.testing.assert_close(got, naive_saobp(pattern, betas, key_mask, mode), rtol=1e-9, atol=1e-12)


def test_first_order_with_scores_matches_naive_loop():
    gen = torch.Generator().manual_seed(12)
    scores = torch.randn(1, 2, 6, 6, generator=gen, dtype=torch.float64)
    scores = scores.masked_fill(~torch.tril(torch.ones(6, 6, dtype=torch.bool)), -1e9)
    pattern = scores.softmax(-1)
    got = saobp(pattern, 2.0, mode="first_order", scores=scores)
    torch.testing.assert_close(got, naive_saobp(pattern, [2.0, 2.0], mode="first_order", scores=scores))


@pytest.mark.parametrize("chunk", [1, 2, 5, 64])
def test_exact_chunking_does_not_change_result(chunk):
    pattern, _ = random_causal(2, 2, 9, seed=13)
    torch.testing.assert_close(saobp(pattern, 3.0, chunk=chunk), saobp(pattern, 3.0, chunk=9))


def test_non_causal_pattern_matches_naive_loop():
    gen = torch.Generator().manual_seed(14)
    pattern = torch.randn(1, 2, 5, 5, generator=gen, dtype=torch.float64).softmax(-1)
    torch.testing.assert_close(saobp(pattern, 2.0, chunk=2), naive_saobp(pattern, [2.0, 2.0]))


@pytest.mark.parametrize("mode", ["exact", "first_order"])
def test_beta_zero_returns_input_bitwise(mode):
    pattern, key_mask = random_causal(2, 3, 8, seed=15, pad_max=2)
    pattern = pattern.float()
    assert torch.equal(saobp(pattern, 0.0, mode=mode), pattern)
    assert torch.equal(saobp(pattern, torch.zeros(3), mode=mode), pattern)
    partial = saobp(pattern, torch.tensor([0.0, 2.0, 0.0]), mode=mode, key_mask=key_mask[:, None])
    assert torch.equal(partial[:, 0], pattern[:, 0]) and torch.equal(partial[:, 2], pattern[:, 2])
    assert not torch.equal(partial[:, 1], pattern[:, 1])


@pytest.mark.parametrize("mode", ["exact", "first_order"])
def test_zeros_stay_zero_and_rows_sum_to_one(mode):
    pattern, key_mask = random_causal(3, 2, 8, seed=16, pad_max=4)
    refined = saobp(pattern, 5.0, mode=mode)
    assert (refined[pattern == 0] == 0).all()
    real_rows = pattern.sum(-1) > 0
    torch.testing.assert_close(refined.sum(-1)[real_rows], torch.ones_like(refined.sum(-1)[real_rows]))
    assert (refined.sum(-1)[~real_rows] == 0).all() and torch.isfinite(refined).all()


def test_key_mask_removes_mass_from_masked_keys():
    pattern = torch.tril(torch.ones(1, 1, 4, 4))
    pattern = pattern / pattern.sum(-1, keepdim=True)
    key_mask = torch.tensor([[[False, True, True, True]]])
    refined = saobp(pattern, 1.0, key_mask=key_mask)
    assert (refined[..., 0] == 0).all()
    assert (refined[..., 0, :] == 0).all()  # query 0 sees only the masked key


def test_first_order_close_to_exact_at_small_beta():
    for seed in range(3):
        pattern, key_mask = random_causal(2, 4, 24, seed=seed, pad_max=4)
        pattern = pattern.float()
        exact = saobp(pattern, 0.05, mode="exact")
        first = saobp(pattern, 0.05, mode="first_order")
        total_variation = 0.5 * (exact - first).abs().sum(-1)
        assert total_variation.max() < 1e-3


def test_first_order_departs_from_exact_at_large_beta():
    # Not a requirement, a documented limit: the approximation is for small beta.
    pattern, _ = random_causal(1, 2, 16, seed=3, sharpness=4.0)
    exact = saobp(pattern, 20.0, mode="exact")
    first = saobp(pattern, 20.0, mode="first_order")
    assert 0.5 * (exact - first).abs().sum(-1).max() > 1e-2


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([8, 16, 32]))
def test_entropy_grows_with_beta_on_sink_dominated_patterns(seed, length):
    pattern = sink_pattern(1, 2, length, seed)
    valid = valid_query_mask(length)
    previous = entropy(pattern)
    previous_mean = masked_mean(previous, valid, dim=-1)
    for beta in (0.25, 0.5, 1.0, 2.0, 4.0):
        refined = saobp(pattern, beta)
        current = entropy(refined)
        still_sink = refined[..., 0] >= refined[..., 1:].amax(-1)
        # Repulsion moves mass off the sink; it can only lower entropy once the sink is no
        # longer the heaviest key (then mass concentrates on the others).
        assert (current[still_sink] >= previous[still_sink] - 1e-9).all()
        if bool(still_sink[..., 1:].all()):
            assert (masked_mean(current, valid, dim=-1) >= previous_mean - 1e-9).all()
        previous, previous_mean = current, masked_mean(current, valid, dim=-1)
    assert (previous_mean > masked_mean(entropy(pattern), valid, dim=-1)).all()


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 8), st.sampled_from(["exact", "first_order"]))
def test_beta_zero_identity_property(seed, length, mode):
    pattern, _ = random_causal(1, 2, length, seed=seed, pad_max=min(2, length - 1))
    assert torch.equal(saobp(pattern, 0.0, mode=mode), pattern)


@pytest.mark.parametrize("mode", ["exact", "first_order"])
def test_gradients_are_finite_and_reach_beta(mode):
    pattern, key_mask = random_causal(2, 3, 6, seed=17, pad_max=2)
    logits = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    allowed = pattern > 0
    prior = logits.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    raw_beta = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    beta = torch.nn.functional.softplus(raw_beta) * 4
    refined = saobp(prior, beta, mode=mode)
    (refined * torch.randn_like(refined)).sum().backward()
    assert torch.isfinite(logits.grad).all() and torch.isfinite(raw_beta.grad).all()
    assert (raw_beta.grad != 0).all()


def test_exact_stays_finite_at_huge_beta():
    pattern = torch.zeros(1, 1, 3, 3)
    pattern[..., 0] = 1.0  # every query on key 0: 1 - c * A underflows without the floor
    pattern[..., 2, :] = torch.tensor([0.99, 0.0, 0.01])
    refined = saobp(pattern, 1e4)
    assert torch.isfinite(refined).all()
    assert refined[0, 0, 2, 2] > 0.99  # the sink is pushed out


def test_half_precision_keeps_dtype():
    pattern, _ = random_causal(1, 2, 8, seed=18)
    half = pattern.to(torch.bfloat16)
    out = saobp(half, 1.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), saobp(pattern, 1.0), atol=2e-2, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beta": -1.0}, ">= 0"),
        ({"beta": torch.tensor([1.0, -1.0])}, ">= 0"),
        ({"beta": torch.ones(3)}, "3 heads"),
        ({"beta": torch.ones(2, 5)}, "size-1"),
        ({"beta": "big"}, "float"),
        ({"beta": 1.0, "mode": "second_order"}, "mode"),
        ({"beta": 1.0, "chunk": 0}, "chunk"),
        ({"beta": 1.0, "scores": torch.zeros(4, 4)}, "scores"),
        ({"beta": 1.0, "key_mask": torch.ones(1, 4, dtype=torch.bool)}, "key_mask"),
        ({"beta": 1.0, "key_mask": torch.ones(1, 5)}, "key_mask"),
    ],
)
def test_bad_arguments_raise_interp_error(kwargs, message):
    pattern, _ = random_causal(1, 2, 5, seed=19)
    with pytest.raises(InterpError, match=message):
        saobp(pattern, **kwargs)


def test_non_square_pattern_raises():
    with pytest.raises(InterpError, match="square"):
        saobp(torch.rand(1, 2, 3, 5), 1.0)


def test_hook_function_applies_saobp():
    pattern, _ = random_causal(2, 3, 6, seed=20)
    beta = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(saobp_hook(beta)(pattern, None), naive_saobp(pattern, [0.5, 1.0, 2.0]))
    with pytest.raises(InterpError, match="mode"):
        saobp_hook(1.0, mode="nope")
    with pytest.raises(InterpError, match=">= 0"):
        saobp_hook(-2.0)


def test_hook_changes_the_bridge_forward(tiny_llama):
    from interp.hooks import hook_point

    tokens = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    name = hook_point(tiny_llama, "pattern", 1)
    seen = {}

    def record(pattern, hook):
        seen[hook.name] = pattern.detach().clone()

    with torch.no_grad():
        plain = tiny_llama(tokens)
        _, cache = tiny_llama.run_with_cache(tokens, names_filter=[name])
        same = tiny_llama.run_with_hooks(tokens, fwd_hooks=[(name, saobp_hook(0.0))])
        refined = tiny_llama.run_with_hooks(tokens, fwd_hooks=[(name, saobp_hook(4.0)), (name, record)])
    assert torch.equal(same, plain)
    assert not torch.allclose(refined, plain)
    torch.testing.assert_close(seen[name], saobp(cache[name], 4.0))
