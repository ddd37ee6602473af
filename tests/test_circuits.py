"""Circuits: direct logit attribution (interp.localize.dla) on every family the tests know.

The identity tested: with the final norm's scale frozen at its value in the forward, the
contributions of the embedding, every head, every MLP and the bias terms add up to the logit
difference the model's own output head produced in the same forward. Models in float64.
"""

from __future__ import annotations

import pytest
import torch
from padding_rows import TEXTS, row_alone
from test_components import build_family
from test_families import FAMILIES

import interp
from interp.errors import DataError
from interp.figures import draw
from interp.localize.dla import FrozenNorm, logit_attribution
from interp.runtime import hooks as hk

pytestmark = pytest.mark.numerical
U64, U32 = 2.0**-53, 2.0**-24
LAYER_NORM_FAMILIES = ("gpt2", "gpt_neox")  # the others' RMSNorms compute in float32 whatever the input dtype


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("circuit_families")
    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            cache[family] = build_family(family, root / family, torch.float64)
        return cache[family]

    return get


@pytest.fixture(scope="module")
def rows():
    tokens = torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(5))
    tokens[:, 0] = 256
    return interp.Examples.from_tokens(tokens)


def magnitude(model, rows, target, versus):
    """``sum_i |d_i gamma_i / s| (sum over terms |c_i|)`` at the last position: the size of the terms
    whose roundings the decomposition and the forward make in different orders (per example)."""
    n_layers = hk.n_layers(model)
    res = interp.probe(model, rows, ["resid_pre", "resid_post", "result", "down"], ["full"], progress=False,
                       native=False, exclude_bos=False)
    w_u = hk.unembed_weight(model).detach()
    direction = (w_u[target] - w_u[versus]).abs()  # [N, d]
    x = res["resid_post", "full"][n_layers - 1][:, -1]
    offset = float(model.info.norm_offset)
    final = FrozenNorm.at(hk.final_norm(model), x, offset)
    weight = direction * final.gamma.abs() / final.scale
    terms = res["resid_pre", "full"][0][:, -1].abs()
    for layer in range(n_layers):
        heads = res["result", "full"][layer][:, -1]  # [N, head, d]
        bias = getattr(hk.linear_weights(model, layer)["o"].module, "bias", None)
        o_bias = bias.detach().abs() if bias is not None else 0
        if model.info.post_norms:
            post = FrozenNorm.at(hk.blocks(model)[layer].post_attention_layernorm, heads.sum(1) + (
                bias.detach() if bias is not None else 0), offset)
            heads = heads * post.gamma.abs() / post.scale[:, None]
            o_bias = o_bias * post.gamma.abs() / post.scale
        terms = terms + heads.abs().sum(dim=1) + o_bias + res["down", "full"][layer][:, -1].abs()
    if final.centred:  # |c_i - mean(c)| <= |c_i| + mean|c|
        terms = terms + terms.mean(dim=-1, keepdim=True)
    total = (weight * terms).sum(dim=-1)
    if final.beta is not None:
        total = total + (final.beta.abs() * direction).sum(dim=-1)
    return total


@pytest.mark.parametrize("family", FAMILIES)
def test_contributions_sum_to_the_models_logit_difference(family, family_models, rows):
    model = family_models(family)
    target, versus = torch.tensor([65, 66, 67]), torch.tensor([70, 71, 72])
    res = logit_attribution(model, rows, target=target, versus=versus)
    assert res.heads.dtype == torch.float64 and res.heads.shape == (3, 2, 4)
    # the logit difference the result carries is the model's own: its output head, in a separate forward
    with torch.no_grad():
        logits = model.original_model(input_ids=rows.tokens).logits[:, -1].double()
    cap = getattr(model.original_model.config, "final_logit_softcapping", None)
    if cap:  # Gemma-2 soft-caps its logits; DLA explains the logits before the cap
        logits = cap * torch.atanh(logits / cap)
    own = logits.gather(1, target[:, None])[:, 0] - logits.gather(1, versus[:, None])[:, 0]
    d, n_heads, d_head = model.cfg.d_model, model.cfg.n_heads, hk._dims(model)["d_head"]
    # Error argument. Both sides start from the same captured activations (z, MLP outputs, the
    # embedding, the final residual). They differ in (a) float64 re-association: the per-head
    # W_O products (n_heads*d_head terms), the residual sum (n_layers*(n_heads+2)+3 terms) and
    # the unembedding dot product (d terms), each off by at most n*u64 relative to the magnitude
    # A of its terms (magnitude() above); twice that for two orders; and (b) the RMSNorms of the
    # llama-style families, which compute in float32: a per-element relative error of at most
    # (d/2 + 3) u32 (cast, mean of d squares, rsqrt, product), in the final norm and in the
    # attention output norm where there is one: twice that. Plus the soft cap's inversion
    # (a few u64 relative to the logits) where there is one.
    k64 = 2 * (n_heads * d_head + 2 * (n_heads + 2) + 3 + d + 8)
    k32 = 0 if family in LAYER_NORM_FAMILIES else 2 * 2 * (d / 2 + 3)
    bound = (k64 * U64 + k32 * U32) * magnitude(model, rows, target, versus) + 8 * U64 * logits.abs().amax(dim=1)
    assert ((res.logit - own).abs() <= bound).all(), (res.logit - own, bound)
    assert (res.residual.abs() <= bound).all(), (res.residual, bound)
    assert res.heads.abs().amax() > 1e3 * bound.max()  # the heads' terms are not vanishingly small
    if family == "gpt2":  # learned positions: their term is there and separate from the tokens'
        assert (res.pos_embed.abs() > 0).all() and (res.final_bias.abs() > 0).all()
    else:
        assert torch.equal(res.pos_embed, torch.zeros(3, dtype=torch.float64))


def test_padded_prompts_equal_each_prompt_alone(family_models):
    model = family_models("llama")
    tokenizer = interp.models.tiny_tokenizer()
    ex = interp.examples_from_texts(TEXTS, tokenizer, padding="left")
    target, versus = [ord("e"), ord("a"), ord("o"), ord("n")], ord(" ")
    padded = logit_attribution(model, ex, target=target, versus=versus, positions=-2, batch_size=4)
    for i in range(len(TEXTS)):
        alone = logit_attribution(model, row_alone(ex, i), target=target[i], versus=versus, positions=-2)
        # the row runs left-aligned, as it does alone: the same float64 operations on the same values,
        # except that a batch of 4 may block its matrix products differently (re-association,
        # ~1e-15 relative to the logit's terms, O(1) here); 1e-10 is far below any indexing error
        for part in ("heads", "mlp", "embed", "logit"):
            assert (getattr(padded, part)[i] - getattr(alone, part)[0]).abs().max() < 1e-10, part
    frame = padded.to_frame()
    assert set(frame["component"]) == {"head", "attn_bias", "mlp", "embed", "pos_embed", "final_bias"}
    assert len(padded.summary()) == 2
    grid = draw(padded).data[0].z  # the layer x head heatmap holds the heads' means
    assert torch.allclose(torch.as_tensor(grid), padded.heads.mean(dim=0), rtol=0, atol=0)


def test_bad_targets_and_positions_are_refused(family_models, rows):
    model = family_models("llama")
    with pytest.raises(DataError, match="one per example"):
        logit_attribution(model, rows, target=[1, 2])
    with pytest.raises(DataError, match="token ids must lie"):
        logit_attribution(model, rows, target=10**6)
    with pytest.raises(DataError, match="outside example"):
        logit_attribution(model, rows, target=1, positions=9)
