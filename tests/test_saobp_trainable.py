"""SAOBP as a transformers attention implementation: equivalence, gradients, settings."""

from __future__ import annotations

import json

import pytest
import torch

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
    # Layer 0 sees the same input in both models, so its prior is the eager pattern.
    torch.testing.assert_close(priors[0][0], eager[0])
    torch.testing.assert_close(refined[0], saobp(eager[0], 2.0, mode=mode), rtol=1e-5, atol=1e-6)
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
    torch.testing.assert_close(saobp_betas(model)[0], torch.full((4,), 0.5))
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
