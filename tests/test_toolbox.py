"""The toolbox (docs/toolbox.md) against independent computations.

Each helper is checked against a computation that shares none of its code: raw PyTorch hooks on the
plain Hugging Face modules (``interp.runtime.hooks.native_model``: the same tensors, no bridge, no
hook points), Hugging Face's own ``output_hidden_states`` / ``output_attentions``, and a least-squares
solve. "Exact" comparisons run on the float64 tiny llama (``model64``), attention included
(tests/float64_attention.py).

Tolerances (tests/tolerances.py, Higham's first-order bound ``n * eps * scale``):

- ``EXACT = 1e-9`` for float64 logits of the tiny model: two evaluations of the same expression in
  another order differ by at most ``n * EPS64 * scale``; a logit chains about 10^3 roundings (2 layers of
  64-128-wide dot products, norms, softmax) of values summing to well under 10^2, so
  ``1e3 * 2.2e-16 * 1e2 = 2.2e-11``; 1e-9 leaves a factor 45.
- the patching metric (``LogitDiffMetric``) reads logits in float32 whatever the model's dtype: each of
  the two logits is rounded once (``EPS32 / 2`` relative), so a logit difference is within
  ``EPS32 * scale`` of the float64 one, ``scale`` the largest |logit| involved (a mean over prompts does
  not add to the worst case).
"""

from __future__ import annotations

import re

import pytest
import torch
from tolerances import EPS32

import interp
from interp.architecture import follow
from interp.data import examples_from_texts
from interp.errors import ComponentError, DataError, InterpError
from interp.localize.linear_probe import _control_labels, fit_probe
from interp.runtime import hooks as hk

EXACT = 1e-9
PROMPTS = ["When Mary and John", "the cat sat on a mat", "one two three four", "abcdefghijklmnopq"]


def _native(model):
    native = hk.native_model(model)
    return native, follow(native, model.info.layers_path)


def _rows(model, texts):
    return examples_from_texts(texts, model.tokenizer).tokens  # equal lengths below: no padding


def _same_length(n, width=12, seed=0):
    generator = torch.Generator().manual_seed(seed)
    body = torch.randint(0, 256, (n, width - 1), generator=generator)
    return torch.cat([torch.full((n, 1), 256), body], dim=1)


def _last_logits(native, tokens, hooks=()):
    handles = [module.register_forward_pre_hook(fn) if kind == "pre" else module.register_forward_hook(fn)
               for module, kind, fn in hooks]
    try:
        with torch.no_grad():
            return native(input_ids=tokens).logits[:, -1]
    finally:
        for handle in handles:
            handle.remove()


# -- ablation -------------------------------------------------------------------------------------


def test_zero_ablation_of_one_head_equals_a_raw_hook(model64):
    tokens = _same_length(3)
    res = interp.ablate(model64, tokens, "z", "zero", layers=[1], heads=[2])
    native, layers = _native(model64)
    d_head = int(model64.cfg.d_model) // int(model64.cfg.n_heads)

    def zero_head(module, args):
        x = args[0].clone()
        x[..., 2 * d_head : 3 * d_head] = 0
        return (x,)

    expected = _last_logits(native, tokens, [(layers[1].self_attn.o_proj, "pre", zero_head)])
    assert float((res.logits - expected).abs().max()) < EXACT
    assert float((res.clean_logits - _last_logits(native, tokens)).abs().max()) < EXACT
    assert float((res.logits - res.clean_logits).abs().max()) > 1e-3  # the ablation does something


def test_mean_ablation_of_the_mlp_at_one_position_equals_a_hand_mean(model64):
    tokens, reference = _same_length(2, seed=1), _same_length(5, width=9, seed=2)
    res = interp.ablate(model64, tokens, "down", "mean", layers=[0], positions=[-2], reference=reference)
    native, layers = _native(model64)
    outputs = []
    keep = layers[0].mlp.register_forward_hook(lambda m, a, out: outputs.append(out.detach()))
    _last_logits(native, reference)
    keep.remove()
    mean = outputs[0][:, 1:].reshape(-1, outputs[0].shape[-1]).mean(dim=0)  # every token but BOS

    def put_mean(module, args, out):
        out = out.clone()
        out[:, -2] = mean
        return out

    expected = _last_logits(native, tokens, [(layers[0].mlp, "out", put_mean)])
    assert float((res.logits - expected).abs().max()) < EXACT
    assert float((res.logits - res.clean_logits).abs().max()) > 1e-3


def test_resample_ablation_takes_another_prompts_activation(model64):
    tokens = _same_length(4, seed=3)
    res = interp.ablate(model64, tokens, "attn_out", "resample", layers=[1], seed=5)
    drawn = res.settings["resampled_rows"]
    assert all(row != i for i, row in enumerate(drawn))  # the reference is the prompts: never a row's own
    native, layers = _native(model64)
    outputs = []
    keep = layers[1].self_attn.register_forward_hook(lambda m, a, out: outputs.append(out[0].detach()))
    _last_logits(native, tokens)
    keep.remove()

    def resampled(module, args, out):
        return (outputs[0][drawn], *out[1:])

    expected = _last_logits(native, tokens, [(layers[1].self_attn, "out", resampled)])
    assert float((res.logits - expected).abs().max()) < EXACT


def test_ablation_of_padded_prompts_equals_each_prompt_alone(model64):
    res = interp.ablate(model64, PROMPTS, "z", "zero", layers=[0], heads=[1], positions=[-1, 1])
    for i, text in enumerate(PROMPTS):
        alone = interp.ablate(model64, text, "z", "zero", layers=[0], heads=[1], positions=[-1, 1])
        assert float((res.logits[i] - alone.logits[0]).abs().max()) < EXACT


def test_ablation_refuses_bad_requests(tiny_llama):
    with pytest.raises(InterpError, match="how must be one of"):
        interp.ablate(tiny_llama, "abc", "z", "erase")
    with pytest.raises(ComponentError, match="heads= applies to the per-head"):
        interp.ablate(tiny_llama, "abc", "down", heads=[0])
    with pytest.raises(ComponentError, match="Cannot ablate 'pattern'"):
        interp.ablate(tiny_llama, "abc", "pattern")
    with pytest.raises(DataError, match="Position 9 is outside"):
        interp.ablate(tiny_llama, "abc", "down", positions=[9])
    with pytest.raises(DataError, match="at least as long"):
        interp.ablate(tiny_llama, "a long prompt", "down", "resample", reference="ab")
    with pytest.raises(DataError, match="is 2 tokens"):
        interp.ablate(tiny_llama, "abc", "down", answer="xy", wrong="z")


# -- patching heatmaps ----------------------------------------------------------------------------


def _logit_diff(logits, answer, wrong):
    return logits[:, answer] - logits[:, wrong]


def test_patch_heatmap_cells_equal_single_site_patches_by_hand(model64):
    clean, corrupt = _same_length(3, seed=4), _same_length(3, seed=6)
    answer, wrong = 65, 66
    heads = interp.patch_heatmap(model64, clean, corrupt, answer, wrong, over="head")
    positions = interp.patch_heatmap(model64, clean, corrupt, answer, wrong, over="position")
    native, layers = _native(model64)
    d_head = int(model64.cfg.d_model) // int(model64.cfg.n_heads)
    clean_z, clean_resid = {}, {}
    hooks = [(layers[1].self_attn.o_proj, "pre", lambda m, a: clean_z.update(z=a[0].detach())),
             (layers[1], "pre", lambda m, a: clean_resid.update(r=a[0].detach()))]
    clean_ld = _logit_diff(_last_logits(native, clean, hooks), answer, wrong)
    corrupt_ld = _logit_diff(_last_logits(native, corrupt), answer, wrong)

    def head_3(module, args):
        x = args[0].clone()
        x[..., 3 * d_head : 4 * d_head] = clean_z["z"][..., 3 * d_head : 4 * d_head]
        return (x,)

    def position_minus_2(module, args):
        x = args[0].clone()
        x[:, -2] = clean_resid["r"][:, -2]
        return (x, *args[1:])

    by_hand = {("head", 3): _last_logits(native, corrupt, [(layers[1].self_attn.o_proj, "pre", head_3)]),
               ("position", -2): _last_logits(native, corrupt, [(layers[1], "pre", position_minus_2)])}
    for (over, column), logits in by_hand.items():
        grid = heads if over == "head" else positions
        patched = _logit_diff(logits, answer, wrong)
        scale = float(logits.abs().max())
        assert abs(float(grid.logit_diff[1, column]) - float(patched.mean())) < EPS32 * scale
        recovery = (patched.mean() - corrupt_ld.mean()) / (clean_ld.mean() - corrupt_ld.mean())
        gap = float((clean_ld.mean() - corrupt_ld.mean()).abs())
        assert abs(float(grid.recovery[1, column]) - float(recovery)) < 4 * EPS32 * scale / gap
    assert positions.columns[-1].startswith(f"{clean.shape[1] - 1}:")  # labelled by position and token
    assert heads.columns == [f"H{h}" for h in range(int(model64.cfg.n_heads))]


def test_patch_heatmap_positions_line_up_at_the_end_for_prompts_of_other_lengths(tiny_llama):
    grid = interp.patch_heatmap(tiny_llama, ["a cat", "the cat"], ["a dog", "the dog"], "s", "!", over="position")
    assert grid.columns == ["0:<bos>", "1:a", "2: ", "3:c", "4:a", "5:t"]  # the shortest pair's width
    with pytest.raises(InterpError, match="over must be"):
        interp.patch_heatmap(tiny_llama, "a", "b", "s", "!", over="neuron")


# -- lens top tokens ------------------------------------------------------------------------------


def test_lens_top_tokens_last_layer_is_the_models_own_and_a_middle_layer_is_by_hand(model64):
    text = "the cat sat on"
    top = interp.lens_top_tokens(model64, text, k=4)
    tokens = examples_from_texts([text], model64.tokenizer).tokens
    native, _ = _native(model64)
    with torch.no_grad():
        out = native(input_ids=tokens, output_hidden_states=True)
    own = torch.softmax(out.logits[0], dim=-1).topk(4, dim=-1)
    assert torch.equal(top.ids[-1], own.indices)
    assert float((top.probs[-1].double() - own.values).abs().max()) < EPS32  # probs stored as float32
    by_hand = torch.softmax(native.lm_head(native.model.norm(out.hidden_states[1]))[0], dim=-1).topk(4, dim=-1)
    assert torch.equal(top.ids[0], by_hand.indices)
    assert top.labels[1] == "1:t" and top.strings[0][1][0] == model64.tokenizer.decode([int(by_hand.indices[1, 0])])


def test_tuned_lens_top_tokens_decode_the_translated_residual(model64):
    from interp.localize.tuned_lens import fit_tuned_lens

    lens = fit_tuned_lens(model64, interp.Examples.from_tokens(_same_length(12, width=16, seed=7)))
    text = "one two"
    top = interp.lens_top_tokens(model64, text, k=3, lens=lens, layers=[0])
    tokens = examples_from_texts([text], model64.tokenizer).tokens
    native, _ = _native(model64)
    with torch.no_grad():
        resid = native(input_ids=tokens, output_hidden_states=True).hidden_states[1][0]
        translated = resid.float() @ lens.weight[0] + lens.bias[0]
        logits = native.lm_head(translated.to(torch.float64))
    assert torch.equal(top.ids[0], torch.softmax(logits, dim=-1).topk(3, dim=-1).indices)
    assert top.lens == "tuned"


# -- attention view -------------------------------------------------------------------------------


def test_attention_view_draws_the_captured_pattern_with_token_labels(model64):
    from interp.figures.toolbox import standalone_html

    text = "abcab"
    fig = interp.attention_view(model64, text, layers=[1])
    tokens = examples_from_texts([text], model64.tokenizer).tokens
    native, _ = _native(model64)
    with torch.no_grad():
        hf = native(input_ids=tokens, output_attentions=True).attentions[1][0]  # transformers' own pattern
    n_heads = int(model64.cfg.n_heads)
    assert len(fig.data) == n_heads
    labels = ("0:<bos>", "1:a", "2:b", "3:c", "4:a", "5:b")
    for h, trace in enumerate(fig.data):
        assert trace.x == labels and trace.y == labels
        assert float(abs(torch.as_tensor(trace.z) - hf[h].float()).max()) < EPS32  # the pattern is stored as float32
    menu = fig.layout.updatemenus[0].buttons
    assert [b.label for b in menu] == [f"layer 1 head {h}" for h in range(n_heads)]
    assert [b.args[0]["visible"] for b in menu][2] == [h == 2 for h in range(n_heads)]
    html = standalone_html(fig)
    assert not re.search(r"<script[^>]*\bsrc=", html) and "Plotly.newPlot" in html  # plotly.js inlined: nothing fetched


# -- linear probes --------------------------------------------------------------------------------


def test_ridge_probe_is_the_least_squares_solution():
    """The closed form against an independent solver: ridge = least squares on [Xc; sqrt(lam) I]."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(60, 5, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (60,), generator=generator)
    probe = fit_probe(x, y, 3, ridge=0.1)
    xc = x - x.mean(0)
    targets = -torch.ones(60, 3, dtype=torch.float64)
    targets[torch.arange(60), y] = 1
    lam = 0.1 * float(torch.diagonal(xc.T @ xc).mean())
    stacked = torch.cat([xc, lam ** 0.5 * torch.eye(5, dtype=torch.float64)])
    rhs = torch.cat([targets - targets.mean(0), torch.zeros(5, 3, dtype=torch.float64)])
    solution = torch.linalg.lstsq(stacked, rhs).solution
    assert float((probe.weight - solution).abs().max()) < 1e-10  # a 5 x 5 solve of O(1) values: 1e5 eps
    assert float((probe.bias - (targets.mean(0) - x.mean(0) @ solution)).abs().max()) < 1e-10


def test_probe_reads_a_linear_label_and_the_control_task_stays_at_chance():
    """Synthetic, linearly separable activations whose token types carry no information: held-out accuracy
    ~1, control ~1/2. With 400 held-out points a chance accuracy has sd 0.025; 0.12 is 4.8 sd."""
    generator = torch.Generator().manual_seed(1)
    n, d = 1600, 16
    y = torch.randint(0, 2, (n,), generator=generator)
    x = torch.randn(n, d, generator=generator) + 4.0 * (2 * y[:, None] - 1) * torch.eye(d)[0]
    types = torch.randint(0, 5000, (n,), generator=generator)
    train = torch.arange(n) < 1200
    control = _control_labels(types, y, train, 2, seed=0)
    probe, shadow = fit_probe(x[train], y[train], 2), fit_probe(x[train], control[train], 2)
    accuracy = float((probe.predict(x[~train]) == y[~train]).double().mean())
    chance = float((shadow.predict(x[~train]) == control[~train]).double().mean())
    assert accuracy > 0.98  # the classes sit 8 sd apart along one axis
    assert abs(chance - 0.5) < 0.12


def test_linear_probe_on_a_model_reports_selectivity(tiny_llama):
    """Labels that are the token itself: perfect accuracy, but the control task (one random label per token
    type) is as easy, so selectivity is zero: the Hewitt & Liang warning, reproduced."""
    prompts = [f"{w} {i}" for i in range(10) for w in ("cat", "dog")]
    res = interp.linear_probe(tiny_llama, prompts, [p[:3] for p in prompts], layers=[0, 1], position=1)
    table = res.summary()
    assert table["accuracy"].tolist() == [1.0, 1.0]
    assert table["control accuracy"].tolist() == [1.0, 1.0] and table["selectivity"].tolist() == [0.0, 0.0]
    per_token = torch.full((len(prompts), 6), -1)
    per_token[:, 1] = torch.tensor([int(p.startswith("c")) for p in prompts])
    tokens = interp.linear_probe(tiny_llama, prompts, per_token, layers=[1])
    assert tokens.n_train + tokens.n_test == len(prompts) and tokens.settings["per_token"]
    with pytest.raises(DataError, match="at least two distinct labels"):
        interp.linear_probe(tiny_llama, prompts, ["x"] * len(prompts))


# -- steering -------------------------------------------------------------------------------------


def _hand_steered(model, tokens, vector, layer, steps, prompt_only=False):
    """Greedy decoding without a cache, the addition made by a raw hook on every position (or, the bug
    class, on the prompt's positions only)."""
    native, layers = _native(model)
    n_prompt = tokens.shape[0]

    def add(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        extra = vector.to(hidden.dtype).expand_as(hidden).clone()
        if prompt_only:
            extra[:, n_prompt:] = 0
        hidden = hidden + extra
        return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

    handle = layers[layer].register_forward_pre_hook(add, with_kwargs=True)
    rows, sequence = [], tokens[None]
    try:
        with torch.no_grad():
            for _ in range(steps):
                logits = native(input_ids=sequence, use_cache=False).logits[0, -1]
                rows.append(logits)
                sequence = torch.cat([sequence, logits.argmax().reshape(1, 1)], dim=1)
    finally:
        handle.remove()
    return torch.stack(rows)


def test_steering_with_the_cache_equals_adding_at_every_position_by_hand(model64):
    vector = interp.steering_vector(model64, "happy", "sad", layer=1)
    cached = interp.steer(model64, "I feel", vector, layer=1, alpha=6.0, max_new_tokens=6)
    uncached = interp.steer(model64, "I feel", vector, layer=1, alpha=6.0, max_new_tokens=6, use_cache=False)
    by_hand = _hand_steered(model64, cached.prompt_tokens, 6.0 * vector, 1, 6)
    assert cached.new_tokens == uncached.new_tokens
    assert float((cached.logits - uncached.logits).abs().max()) < EXACT
    assert float((cached.logits - by_hand).abs().max()) < EXACT
    # the bug class this guards against: steering the prompt only parts from it after the first token
    buggy = _hand_steered(model64, cached.prompt_tokens, 6.0 * vector, 1, 6, prompt_only=True)
    assert float((buggy[1:] - by_hand[1:]).abs().max()) > 1e-3
    plain = interp.steer(model64, "I feel", vector, layer=1, alpha=0.0, max_new_tokens=6)
    assert float((plain.logits[0] - cached.logits[0]).abs().max()) > 1e-3


def test_steering_refuses_a_vector_of_the_wrong_size(tiny_llama):
    with pytest.raises(InterpError, match=r"tensor \[d_model\] = \[64\]"):
        interp.steer(tiny_llama, "ab", torch.zeros(65), layer=0)
    with pytest.raises(DataError, match="one prompt"):
        interp.steer(tiny_llama, ["ab", "cd"], torch.zeros(64), layer=0)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("variant", ["reference", "rtn3", "gguf"])
def test_steering_cache_agreement_on_smollm2_reference_quantized_and_gguf(variant):
    """The bundled SmolLM2 (float32 weights), its 3-bit RTN copy and the same checkpoint loaded from its .gguf
    file, each run in float64 (the weights cast exactly): with and without the KV cache the steered logits
    agree to 1e-8. A logit is a chain of about 30 layers x 5 dot products of up to 1,536 terms of values whose
    magnitudes sum to at most ~1e4 (SmolLM2's residual norm); first order, 3e5 roundings x 1.1e-16 x 1e4 is
    3e-7 in the very worst case and ~1e-10 typically (random-walk rounding, sqrt of the count); 1e-8 sits
    between, and an unsteered generated position (the bug class) moves logits by more than 0.1."""
    from interp.models import _bundled_gguf

    model = interp.load_model(str(_bundled_gguf("smollm2-135m")) if variant == "gguf" else "smollm2-135m")
    if variant == "rtn3":
        model = interp.quantize(model, "rtn:bits=3,group=64", progress=False)
    model.original_model.to(torch.float64)
    vector = interp.steering_vector(model, " love", " hate", layer=6)
    kwargs = {"layer": 6, "alpha": 4.0, "max_new_tokens": 3}
    cached = interp.steer(model, "I think you", vector, **kwargs)
    uncached = interp.steer(model, "I think you", vector, use_cache=False, **kwargs)
    assert cached.new_tokens == uncached.new_tokens
    assert float((cached.logits - uncached.logits).abs().max()) < 1e-8
    buggy = _hand_steered(model, cached.prompt_tokens, 4.0 * vector, 6, 3, prompt_only=True)
    assert float((buggy[1:] - cached.logits[1:]).abs().max()) > 0.1
