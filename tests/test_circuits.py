"""Circuits on every family the tests know (tiny random models, float64): direct logit attribution
(interp.localize.dla), path patching (interp.localize.paths) and edge attribution patching, EAP and
EAP-IG (interp.localize.eap).

The identities tested: with the final norm's scale frozen at its value in the forward, the
contributions of the embedding, every head, every MLP and the bias terms add up to the logit
difference the model's own output head produced in the same forward; the batched path patching
equals the textbook three-step loop; an EAP score is the derivative of the path-patching metric
along its edge; EAP-IG averages gradients that a plain Hugging Face forward gives.
"""

from __future__ import annotations

import pytest
import torch
from padding_rows import TEXTS, row_alone
from test_components import build_family
from test_families import FAMILIES

import interp
from interp.errors import ComponentError, DataError
from interp.figures import draw
from interp.localize import patching
from interp.localize.dla import FrozenNorm, logit_attribution
from interp.localize.eap import edge_attribution
from interp.localize.patching import LogitDiffMetric
from interp.localize.paths import Sender, path_patch, path_patch_naive
from interp.runtime import hooks as hk

pytestmark = [pytest.mark.numerical, pytest.mark.usefixtures("one_thread")]  # conftest's one_thread
U64, U32 = 2.0**-53, 2.0**-24
LAYER_NORM_FAMILIES = ("gpt2", "gpt_neox")  # the others' RMSNorms compute in float32 whatever the input dtype


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
    with pytest.raises(DataError, match="holds token id 1000000, but the model's vocabulary has ids 0..258"):
        logit_attribution(model, rows, target=10**6)
    with pytest.raises(DataError, match="outside example"):
        logit_attribution(model, rows, target=1, positions=9)


# ---------------------------------------------------------------------------------------
# Path patching


# Every RMSNorm class of the families the tests build, with the offset its scale adds to gamma
RMS_NORMS = {"llama": ("LlamaRMSNorm", 0.0), "mistral": ("MistralRMSNorm", 0.0), "qwen2": ("Qwen2RMSNorm", 0.0),
             "qwen3": ("Qwen3RMSNorm", 0.0), "phi3": ("Phi3RMSNorm", 0.0), "olmo2": ("Olmo2RMSNorm", 0.0),
             "gemma2": ("Gemma2RMSNorm", 1.0), "gemma3": ("Gemma3RMSNorm", 1.0)}


@pytest.fixture
def float64_norms(monkeypatch):
    """RMSNorms that stay in float64 for float64 inputs (transformers' compute in float32 whatever the
    input: a 1e-16 difference between two float64 computations could then flip a float32 rounding and
    show up as 1e-8). Other dtypes take transformers' own forward unchanged. Qwen-3's and OLMo-2's
    query/key norms are instances of the same classes."""
    import importlib

    def faithful(cls, offset):
        original = cls.forward

        def forward(self, x):
            if x.dtype != torch.float64:
                return original(self, x)
            eps = getattr(self, "variance_epsilon", None) or self.eps
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + self.weight)

        monkeypatch.setattr(cls, "forward", forward)

    for family, (name, offset) in RMS_NORMS.items():
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        faithful(getattr(module, name), offset)


class LogitDiff64(LogitDiffMetric):
    """The logit-difference metric without its float32 step (test-only)."""

    def from_logits(self, logits, tokens, index, lengths=None):
        at = self._at(logits, lengths)
        rows = torch.arange(at.shape[0])
        pick = (lambda t: t.expand(len(index)) if len(t) == 1 else t[index])
        return (at[rows, pick(self.answers)] - at[rows, pick(self.wrongs)]).double()


# Exactness: both sides run float64 end to end (float64 attention softmax: conftest; float64 norms:
# the fixture above) on the same values, and differ only in how float64 sums are associated (the
# residual built as target + delta, against the model re-adding frozen outputs): ~1e-15 relative
# per layer on O(1) logits. EXACT sits far above that and below the smallest path effect here
# (~1e-7: tiny random models move little).
EXACT = 1e-10
SENDERS = [Sender("head", 0, 1), Sender("mlp", 0), Sender("head", 0, 3), Sender("head", 1, 0)]


@pytest.mark.parametrize("family", FAMILIES)
def test_path_patching_equals_the_textbook_loop(family, family_models, float64_norms):
    model = family_models(family)
    tokenizer = model.tokenizer  # the byte tokenizer as saved and loaded back (Qwen-2's adds a token)
    clean = interp.examples_from_texts(["Anna gave Bob a cup", "So Tim told me", "Eve saw Ian"], tokenizer)
    corrupt = interp.examples_from_texts(["Anna gave Ann a cup", "So Ken told me", "Bob saw Ian"], tokenizer)
    metric = LogitDiff64([ord("e"), ord("a"), ord("o")], ord(" "))
    kv_last = (model.info.n_kv_heads or model.cfg.n_heads) - 1
    for receivers in ("logits", [(1, 2, "q"), (1, 0, "k"), (1, kv_last, "v")]):
        fast = path_patch(model, clean, SENDERS, receivers, source_examples=corrupt, metric=metric, batch_size=2,
                          max_rows=4)
        naive = path_patch_naive(model, clean, SENDERS, receivers, source_examples=corrupt, metric=metric)
        assert (fast.target - naive.target).abs().max() < EXACT
        assert (fast.values - naive.values).abs().max() < EXACT, receivers
        moved = (naive.values - naive.target).abs().amax(dim=1)
        if receivers == "logits":
            # every head reaches the logits directly; so does MLP 0, except in GPT-NeoX's parallel block,
            # where it reads only the last token's own embedding, the same in both prompts
            assert (moved[[0, 2, 3]] > 1e-8).all() and (moved[1] > 1e-8) == (family != "gpt_neox"), moved
        else:  # senders in layer 1 have no receiver after them: untouched
            assert (moved[:3] > 1e-8).all() and torch.equal(fast.values[3], fast.target), moved


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_direct_path_of_the_last_layer_is_activation_patching(family, family_models, float64_norms):
    """Nothing reads the last MLP's output but the logits, so its direct path is all of its effect: path
    patching equals the engine's activation patching (an independent implementation). The last layer's
    heads too in GPT-NeoX's parallel block; in a serial block their output also feeds the last MLP."""
    model = family_models(family)
    g = torch.Generator().manual_seed(1)
    clean = interp.Examples.from_tokens(torch.randint(0, 256, (3, 8), generator=g))
    corrupt = interp.Examples.from_tokens(torch.randint(0, 256, (3, 8), generator=g))
    metric = LogitDiff64(65, 66)
    senders, jobs = [Sender("mlp", 1)], [patching.Patch("down", (1,))]
    if family == "gpt_neox":
        senders, jobs = [*senders, Sender("head", 1, 2)], [*jobs, patching.Patch("z", (1,), heads=(2,))]
    paths = path_patch(model, clean, senders, "logits", source_examples=corrupt, metric=metric)
    exact = patching.patch_naive(model, model, clean, jobs, source_examples=corrupt, metric=metric)
    assert (paths.values - exact.values).abs().max() < EXACT
    assert (paths.values - paths.target).abs().amax(dim=1).min() > 1e-8
    if family == "llama":  # the serial block's last head: the direct path is not the whole effect
        head = path_patch(model, clean, [Sender("head", 1, 2)], "logits", source_examples=corrupt, metric=metric)
        whole = patching.patch_naive(model, model, clean, [patching.Patch("z", (1,), heads=(2,))],
                                     source_examples=corrupt, metric=metric)
        assert (head.values - whole.values).abs().max() > 1e3 * EXACT


def test_path_patching_refuses_what_it_cannot_do(family_models):
    model = family_models("llama")
    rows = interp.Examples.from_tokens(torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0)))
    short = interp.examples_from_texts(["ab", "abcdef"], interp.models.tiny_tokenizer())
    with pytest.raises(ComponentError, match="No sender has a receiver after"):
        path_patch(model, rows, [Sender("head", 1, 0)], [(1, 0, "q")], source_examples=rows)
    with pytest.raises(ComponentError, match="heads lie in"):
        path_patch(model, rows, [Sender("head", 0, 0)], [(1, 3, "k")], source_examples=rows)
    with pytest.raises(ComponentError, match="needs head"):
        path_patch(model, rows, [Sender("head", 0)], "logits", source_examples=rows)
    with pytest.raises(DataError, match="same real length"):
        path_patch(model, short, [Sender("mlp", 0)], "logits", source_examples=interp.examples_from_texts(
            ["abc", "abcdef"], interp.models.tiny_tokenizer()))


# ---------------------------------------------------------------------------------------
# Edge attribution patching


@pytest.mark.parametrize("family", FAMILIES)
def test_eap_is_the_derivative_of_path_patching(family, family_models, float64_norms):
    """EAP's score of an edge is d/d(eps) of the path-patching metric with the sender's change ``delta``
    (where it enters the residual stream) scaled by eps: checked by central differences, GQA keys and
    values included. ``delta`` is read here from a forward with only the sender patched (through the
    attention output norm where the family has one), and scaled by eps in the sender's residual slot:
    an MLP at the sender's layer, whose output, set to its target value plus ``eps * delta``, changes
    the residual by exactly that (the slot writes into the same residual as the head does)."""
    from interp.localize.paths import _capture, _window

    model = family_models(family)  # llama-like: 4 query heads, 2 key/value heads
    g = torch.Generator().manual_seed(2)
    clean = interp.Examples.from_tokens(torch.randint(0, 256, (2, 8), generator=g))
    corrupt = interp.Examples.from_tokens(torch.randint(0, 256, (2, 8), generator=g))
    metric = LogitDiff64(65, 66)
    senders, receivers = [Sender("head", 0, 1), Sender("mlp", 0)], [(1, 3, "q"), (1, 1, "k"), (1, 0, "v")]
    res = edge_attribution(model, clean, senders, receivers, source_examples=corrupt, metric=metric)
    points = [("z", 0), ("down", 0), ("attn_out", 0), ("resid_pre", 0), ("resid_pre", 1), ("resid_post", 1)]
    target, _ = _capture(model, clean.tokens, points)
    source, _ = _capture(model, corrupt.tokens, [("z", 0), ("down", 0)])

    def head_patched(x, hook):  # head 0.1's z from the source run, every other head's from the target
        z = hk.reader(model, "z", 0)(x).clone()
        z[:, :, 1] = source[("z", 0)][:, :, 1]
        return z.reshape(x.shape)

    seen = {}
    with torch.no_grad(), model.hooks(fwd_hooks=[(hk.hook_point(model, "z", 0), head_patched),
                                                 (hk.hook_point(model, "attn_out", 0),
                                                  lambda x, hook: seen.__setitem__("attn_out", x.detach()))]):
        model.original_model(input_ids=clean.tokens)
    deltas = [seen["attn_out"] - target[("attn_out", 0)], source[("down", 0)] - target[("down", 0)]]

    def moved(delta, receiver, eps):
        slot = {("down", 0): target[("down", 0)] + eps * delta}
        logits = _window(model, clean.tokens, [Sender("mlp", 0)], [receiver], target, slot)
        return metric.from_logits(logits, clean.tokens, torch.arange(2))

    eps = 1e-3
    for i, sender in enumerate(senders):
        for j, receiver in enumerate(receivers):
            d1 = (moved(deltas[i], receiver, eps) - moved(deltas[i], receiver, -eps)) / (2 * eps)
            d2 = (moved(deltas[i], receiver, 2 * eps) - moved(deltas[i], receiver, -2 * eps)) / (4 * eps)
            # central differences: D(e) = M' + c e^2 + O(e^4), so D(2e) - D(e) = 3 c e^2 estimates the
            # truncation error (|D(2e) - D(e)| / 3, doubled for the O(e^4) rest), plus rounding:
            # metric values (|M| < 1) each off by a few u, divided by 2e
            bound = 2 * (d2 - d1).abs() / 3 + 8 * U64 / eps
            assert ((res.scores[i, j] - d1).abs() <= bound).all(), (sender, receiver, res.scores[i, j], d1, bound)
            # not vacuous: the score is at least 100 times the bound (agreement to 1% or better)
            assert (res.scores[i, j].abs() > 1e2 * bound).any(), (sender, receiver, res.scores[i, j], bound)
    if family == "llama":  # the default figure: one bar per edge, the mean scores, largest on top
        bars = draw(res).data[0]
        assert sorted(bars.x) == sorted(res.edge_scores().flatten().tolist())
        assert bars.y[-1] == res.top(1)["edge"].item()


@pytest.mark.parametrize("family", FAMILIES)
def test_eap_ig_averages_gradients_along_the_embedding_path(family, family_models, float64_norms):
    """EAP-IG to the logits, against an independent computation: the plain Hugging Face model run on
    interpolated input embeddings, the gradient read at the final norm's input."""
    model = family_models(family)
    g = torch.Generator().manual_seed(3)
    clean = interp.Examples.from_tokens(torch.randint(0, 256, (2, 8), generator=g))
    corrupt = interp.Examples.from_tokens(torch.randint(0, 256, (2, 8), generator=g))
    metric = LogitDiff64(65, 66)
    steps = 3
    res = edge_attribution(model, clean, [Sender("mlp", 0)], "logits", source_examples=corrupt, metric=metric,
                           ig_steps=steps)
    plain = edge_attribution(model, clean, [Sender("mlp", 0)], "logits", source_examples=corrupt, metric=metric)
    hf = model.original_model
    embed = hf.get_input_embeddings()
    norm = hk.final_norm(model)  # the module the forward calls (GPT-2's bridge computes its LayerNorm itself)
    with torch.no_grad():
        e_clean, e_corrupt = embed(clean.tokens), embed(corrupt.tokens)
    total = torch.zeros_like(e_clean)
    seen = {}

    def grab(module, args):
        x = args[0]
        x.retain_grad()
        seen["x"] = x

    for k in range(steps):
        handle = norm.register_forward_pre_hook(grab)
        try:
            logits = hf(inputs_embeds=e_clean + k / steps * (e_corrupt - e_clean)).logits
            (logits[:, -1, 65] - logits[:, -1, 66]).sum().backward()
        finally:
            handle.remove()
        total += seen["x"].grad.detach()
    hf.zero_grad(set_to_none=True)  # the backward passes left gradients on the shared model's weights
    with torch.no_grad():  # the MLP's change, from the two runs' own MLP outputs
        outs = {}
        hooks = [(hk.hook_point(model, "down", 0), lambda x, hook, key=key: outs.__setitem__(key, x.detach()))
                 for key in ("clean",)]
        with model.hooks(fwd_hooks=hooks):
            hf(input_ids=clean.tokens)
        clean_down = outs["clean"]
        with model.hooks(fwd_hooks=[(hk.hook_point(model, "down", 0),
                                     lambda x, hook: outs.__setitem__("corrupt", x.detach()))]):
            hf(input_ids=corrupt.tokens)
    expected = ((outs["corrupt"] - clean_down) * total / steps).flatten(1).sum(1)
    # float64 throughout: the two sides differ by re-association in the backward passes and sums over
    # 8 x 64 terms, ~1e-15 relative to O(1) gradients; 1e-10 is far above that
    assert (res.scores[0, 0] - expected).abs().max() < 1e-10
    assert (res.scores[0, 0] - plain.scores[0, 0]).abs().max() > 1e-6  # IG does move away from plain EAP
