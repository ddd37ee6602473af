"""SAOBP as a transformers attention implementation: equivalence, gradients, settings."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tolerances import EPS32, rounding_tol

from interp.attention import saobp
from interp.attention.trainable import (
    SAOBPConfig,
    build_llama,
    capture_prior_patterns,
    saobp_betas,
)
from interp.errors import InterpError

TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention: 2 query heads per KV head
    "max_position_embeddings": 32,
}


U32 = EPS32 / 2


def _tol(n_terms, scale, eps=EPS32):
    """:func:`tolerances.rounding_tol` with this file's working precision."""
    return rounding_tol(n_terms, scale, eps)


def _score_bound(model, layer=0):
    """An upper bound on |S| = |q . k| * scaling in ``layer``, from the weights.

    The RMSNorm output has norm <= sqrt(d) max|gamma|, rotary embeddings are rotations, and
    ``||W x|| <= ||W||_F ||x||`` for each head's rows of W_q and W_k.
    """
    block = model.model.layers[layer]
    attn, d = block.self_attn, model.config.hidden_size
    head = attn.head_dim
    q = torch.linalg.matrix_norm(attn.q_proj.weight.detach().double().reshape(-1, head, d)).max()
    k = torch.linalg.matrix_norm(attn.k_proj.weight.detach().double().reshape(-1, head, d)).max()
    return float(attn.scaling * d * block.input_layernorm.weight.detach().double().abs().max() ** 2 * q * k)


def _first_order_scores_rtol(prior, s_max, beta):
    """Relative gap between first-order SAOBP fed the scores S (the model) and fed log A (the test).

    In units of u: A is the float32 softmax of S, so log A_k = S_k - (a per-row constant) + t_k with
    |t_k| <= u (|S_k - max S| + 3) (shift, exp, product; the sum and its reciprocal are common to
    the row and cancel), and the test's log adds 2 u |log A_k|; with L = max|log A| and
    |S_k - max S| <= L + log n that is <= u (3 L + log n + 3). Both sides then subtract the same
    beta (A_offdiag @ A) (the same computation on the same bits), rounding u |S_k| + 2 u beta and u L + 2 u beta.
    A logit gap d moves each probability by a relative <= 2 d, and each softmax adds
    u (|l_k - max l| + n + 3) <= u (L + log n + 2 beta + n + 3).
    """
    n = prior.shape[-1]
    big_l = float(-prior[prior > 0].log().min())
    logit_gap = 3 * big_l + math.log(n) + 3 + s_max + big_l + 4 * beta
    return U32 * (2 * logit_gap + 2 * (big_l + math.log(n) + 2 * beta + n + 3))


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def baseline():
    return build_llama(TINY, None, seed=0).eval()


def test_beta_zero_gives_identical_logits_to_eager(baseline, tokens):
    for mode in ("exact", "first_order"):
        model = build_llama(TINY, SAOBPConfig(mode=mode, beta=0.0, learnable=False), seed=0).eval()
        assert model.config._attn_implementation == "saobp"
        with torch.no_grad():
            assert torch.equal(model(tokens).logits, baseline(tokens).logits)


def test_beta_zero_identical_with_padding(baseline, tokens):
    mask = torch.ones_like(tokens)
    mask[0, :3] = 0
    model = build_llama(TINY, SAOBPConfig(beta=0.0, learnable=False), seed=0).eval()
    with torch.no_grad():
        assert torch.equal(model(tokens, attention_mask=mask).logits, baseline(tokens, attention_mask=mask).logits)


@pytest.mark.parametrize("mode", ["exact", "first_order"])
def test_refined_layer_uses_saobp_of_the_eager_pattern(baseline, tokens, mode):
    model = build_llama(TINY, SAOBPConfig(layers=[0], mode=mode, beta=2.0, learnable=False), seed=0).eval()
    with torch.no_grad():
        eager = baseline(tokens, output_attentions=True).attentions
        with capture_prior_patterns(model) as priors:
            refined = model(tokens, output_attentions=True).attentions
    # Layer 0 sees the same input in both models, so its prior is the eager pattern: the same
    # float32 operations on the same bits (transformers' eager attention and ours), hence equal.
    torch.testing.assert_close(priors[0][0], eager[0], rtol=0, atol=0)
    expected = saobp(eager[0], 2.0, mode=mode)
    if mode == "exact":  # the model calls this very function on this very input
        torch.testing.assert_close(refined[0], expected, rtol=0, atol=0)
    else:  # the model passes the scores, this call log A: they differ by the softmax's rounding
        rtol = _first_order_scores_rtol(eager[0], _score_bound(model), 2.0)
        torch.testing.assert_close(refined[0], expected, rtol=rtol, atol=0)
    assert not torch.allclose(refined[1], eager[1])  # layer 1 gets a different input
    assert list(priors) == [0]  # layer 1 is not refined: eager attention, nothing captured


def test_layers_outside_the_list_run_eager(baseline, tokens):
    model = build_llama(TINY, SAOBPConfig(layers=[1], beta=3.0, learnable=False), seed=0).eval()
    with torch.no_grad():
        ours = model(tokens, output_attentions=True).attentions
        eager = baseline(tokens, output_attentions=True).attentions
    assert torch.equal(ours[0], eager[0])
    assert not torch.allclose(ours[1], eager[1])


def test_learnable_beta_gets_gradients_and_stays_non_negative(tokens):
    model = build_llama(TINY, SAOBPConfig(beta=0.5, learnable=True), seed=0)
    # softplus(float32(log(expm1(0.5)))): the stored raw (1 rounding), exp (2) and log1p (2) of
    # values <= 1, moving 0.5 by far less than _tol(5, 0.5)
    torch.testing.assert_close(saobp_betas(model)[0], torch.full((4,), 0.5), rtol=0, atol=_tol(5, 0.5))
    raws = {n: p for n, p in model.named_parameters() if n.endswith("saobp_beta_raw")}
    assert sorted(raws) == [f"model.layers.{i}.self_attn.saobp_beta_raw" for i in (0, 1)]
    model(tokens, labels=tokens).loss.backward()
    for raw in raws.values():
        assert raw.grad is not None and torch.isfinite(raw.grad).all() and (raw.grad != 0).any()
    optimizer = torch.optim.SGD(model.parameters(), lr=50.0)
    for _ in range(5):  # push beta down hard
        optimizer.zero_grad()
        loss = model(tokens, labels=tokens).loss + 100 * sum(b.sum() for b in _live_betas(model))
        loss.backward()
        optimizer.step()
    for betas in saobp_betas(model).values():
        assert (betas >= 0).all()
        assert (betas < 0.5).all()


def _live_betas(model):
    return [torch.nn.functional.softplus(p) for n, p in model.named_parameters() if n.endswith("saobp_beta_raw")]


def test_exact_and_first_order_models_agree_at_small_beta(tokens):
    exact = build_llama(TINY, SAOBPConfig(mode="exact", beta=0.05, learnable=False), seed=0).eval()
    first = build_llama(TINY, SAOBPConfig(mode="first_order", beta=0.05, learnable=False), seed=0).eval()
    # Not a rounding bound: the modes differ by the first-order approximation's dropped terms,
    # a total variation <= 1.6e-4 per attention row at beta = 0.05 (test_saobp._first_order_gap),
    # which two layers carry to logits whose spread is ~0.1 here. The 1e-3 is a semantic threshold
    # ("agree": 1% of that spread), not derived through the network (measured gap ~3e-6).
    with torch.no_grad():
        torch.testing.assert_close(exact(tokens).logits, first(tokens).logits, atol=1e-3, rtol=0)


def test_same_seed_same_weights_and_settings_saved(baseline, tmp_path):
    model = build_llama(TINY, SAOBPConfig(layers=[1], beta=0.7), seed=0)
    ours = model.state_dict()
    for name, weight in baseline.state_dict().items():
        assert torch.equal(ours[name], weight), name
    assert set(ours) - set(baseline.state_dict()) == {"model.layers.1.self_attn.saobp_beta_raw"}
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["saobp"] == {"layers": [1], "mode": "first_order", "beta": 0.7, "learnable": True, "chunk": None}


def test_baseline_has_no_betas(baseline):
    assert saobp_betas(baseline) == {}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SAOBPConfig(mode="second"), "mode"),
        (lambda: SAOBPConfig(beta=-1.0), ">= 0"),
        (lambda: SAOBPConfig(beta=0.0, learnable=True), "cannot start at exactly 0"),
        (lambda: SAOBPConfig(layers=[-1]), "non-negative"),
        (lambda: build_llama(TINY, SAOBPConfig(layers=[5])), "do not exist"),
        (lambda: build_llama({**TINY, "attn_implementation": "sdpa"}, None), "attn_implementation"),
        (lambda: build_llama({**TINY, "num_attention_heads": "four"}, None), "Invalid LlamaConfig"),
    ],
)
def test_bad_settings_raise_interp_error(make, message):
    with pytest.raises(InterpError, match=message):
        make()


def test_a_float64_saobp_model_runs_in_float64(tokens):
    """A float64 model keeps its softmax in float64 (transformers' eager attention rounds it through
    float32), so saobp's float64 row-sum check accepts the prior and the refined layer is saobp()
    of that prior; the prior itself is the eager pattern to float32 rounding (entries <= 1)."""
    model = build_llama(TINY, SAOBPConfig(layers=[0], mode="exact", beta=2.0, learnable=False), seed=0)
    model = model.to(torch.float64).eval()
    eager = build_llama(TINY, None, seed=0).to(torch.float64).eval()
    with torch.no_grad():
        pattern = eager(tokens, output_attentions=True).attentions[0]
        with capture_prior_patterns(model) as priors:
            refined = model(tokens, output_attentions=True).attentions[0]
    prior = priors[0][0]
    assert refined.dtype == prior.dtype == torch.float64
    assert float((prior.sum(-1) - 1).abs().max()) < 64 * torch.finfo(torch.float64).eps
    torch.testing.assert_close(refined, saobp(prior, 2.0, mode="exact"), rtol=0, atol=0)
    torch.testing.assert_close(prior, pattern, rtol=0, atol=torch.finfo(torch.float32).eps)
