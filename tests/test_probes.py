"""Probes: hook names, streaming reducers against manual computations, errors."""

from __future__ import annotations

import pytest
import torch

import interp
from interp.data import Examples
from interp.errors import ComponentError, NonFiniteError
from interp.probes import ProbeResult, probe, reduce_kurtosis, reduce_norm
from interp.runtime import hooks as hk


def _tokens(n=6, t=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (n, t), generator=g)
    tokens[:, 0] = 256
    return Examples.from_tokens(tokens)


def test_reducers_match_naive_loops():
    x = torch.randn(3, 5, 7, dtype=torch.float64)
    norm = reduce_norm(x)
    kurt = reduce_kurtosis(x)
    for b in range(3):
        norms, kurts = [], []
        for t in range(1, 5):  # BOS excluded
            v = x[b, t]
            norms.append(sum(float(e) ** 2 for e in v) ** 0.5)
            mu = sum(float(e) for e in v) / 7
            m2 = sum((float(e) - mu) ** 2 for e in v) / 7
            m4 = sum((float(e) - mu) ** 4 for e in v) / 7
            kurts.append(m4 / m2**2)
        assert norm[b].item() == pytest.approx(sum(norms) / 4, rel=1e-12)
        assert kurt[b].item() == pytest.approx(sum(kurts) / 4, rel=1e-9)
    import scipy.stats

    ref = scipy.stats.kurtosis(x[0, 1:].numpy(), axis=-1, fisher=False).mean()
    assert kurt[0].item() == pytest.approx(ref, rel=1e-9)


def test_probe_equals_run_with_cache_on_tiny(tiny_llama):
    ex = _tokens()
    res = probe(tiny_llama, ex, ["resid_mid", "resid_post", "h", "gate", "up", "down"], ["norm", "mean"],
                batch_size=4, progress=False)
    _, cache = tiny_llama.run_with_cache(ex.tokens)
    for layer in range(2):
        mlp = tiny_llama.original_model.model.layers[layer].mlp
        manual = {
            "resid_mid": cache[f"blocks.{layer}.hook_resid_mid"],
            "resid_post": cache[f"blocks.{layer}.hook_resid_post"],
            "h": tiny_llama.original_model.model.layers[layer].post_attention_layernorm(
                cache[f"blocks.{layer}.hook_resid_mid"]),
        }
        manual["gate"] = torch.nn.functional.silu(manual["h"] @ hk.gate_weight(tiny_llama, layer).T)
        manual["up"] = manual["h"] @ mlp.up_proj.weight.T
        manual["down"] = (manual["gate"] * manual["up"]) @ mlp.down_proj.weight.T
        for name, act in manual.items():
            expected = act[:, 1:].norm(dim=-1).mean(dim=1)
            # float32, 2 layers of width 64 and norms ~8: the native tree and the bridge differ by reordering
            # only, ~depth * sqrt(d) * eps32 ~ 2e-6 relative; 1e-5 leaves a factor 5
            torch.testing.assert_close(res[name, "norm"][layer], expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(res[name, "mean"][layer], act[:, 1:].mean(dim=(1, 2)), atol=1e-5, rtol=1e-5)


def test_probe_result_is_batch_invariant_and_round_trips(tiny_llama, tmp_path):
    ex = _tokens(n=7)
    a = probe(tiny_llama, ex, ["resid_post"], ["norm", "kurtosis"], batch_size=1, progress=False)
    b = probe(tiny_llama, ex, ["resid_post"], ["norm", "kurtosis"], batch_size=3, progress=False)
    # batch 1 vs 3 changes only GEMM blocking: float32 reordering, ~depth * sqrt(d) * eps32 ~ 2e-6 relative
    torch.testing.assert_close(a["resid_post", "norm"], b["resid_post", "norm"], atol=1e-5, rtol=1e-5)
    a.save(tmp_path)
    loaded = ProbeResult.load(tmp_path)
    assert loaded.ids == a.ids and torch.equal(loaded["resid_post", "norm"], a["resid_post", "norm"])
    frame = loaded.to_frame()
    assert len(frame) == 2 * 2 * 7 and set(frame["reducer"]) == {"norm", "kurtosis"}


def test_gate_on_gpt2_names_the_architecture(tiny_gpt2):
    with pytest.raises(ComponentError, match=r"plain MLP: GPT2LMHeadModel \(family gpt2\) has"):
        probe(tiny_gpt2, _tokens(), ["gate"], ["norm"], progress=False)
    res = probe(tiny_gpt2, _tokens(), ["resid_mid", "h", "down"], ["norm"], progress=False)
    assert res["h", "norm"].shape == (2, 6)


def test_bad_component_reducer_and_layer(tiny_llama):
    with pytest.raises(ComponentError, match="Unknown component 'resid_middle'"):
        probe(tiny_llama, _tokens(), ["resid_middle"], ["norm"], progress=False)
    with pytest.raises(ComponentError, match="Unknown reducer"):
        probe(tiny_llama, _tokens(), ["resid_mid"], ["median"], progress=False)
    with pytest.raises(ComponentError, match="out of range"):
        probe(tiny_llama, _tokens(), ["resid_mid"], ["norm"], layers=[5], progress=False)


def test_nan_weights_are_reported_with_the_layer():
    model = interp.tiny_model("llama", seed=1)
    with torch.no_grad():
        model.original_model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="at layer 1"):
        probe(model, _tokens(), ["down"], ["norm"], progress=False)


@pytest.mark.integration
def test_real_probe_norms_equal_manual_cache(smol, wiki_small):
    ex = wiki_small.subset(range(4))
    layers = [0, 14, 29]
    res = probe(smol, ex, ["resid_mid", "resid_post", "h", "gate"], ["norm"], layers=layers, progress=False)
    names = [f"blocks.{i}.{p}" for i in layers for p in ("hook_resid_mid", "hook_resid_post")]
    with torch.no_grad():
        _, cache = smol.run_with_cache(ex.tokens, names_filter=lambda n: n in names)
    for li, layer in enumerate(layers):
        block = smol.original_model.model.layers[layer]
        r = cache[f"blocks.{layer}.hook_resid_mid"]
        # h by hand: RMSNorm with gamma, as the model defines it
        var = r.pow(2).mean(-1, keepdim=True)
        norm = block.post_attention_layernorm
        h = r * torch.rsqrt(var + norm.variance_epsilon) * norm.weight
        gate = torch.nn.functional.silu(h @ block.mlp.gate_proj.weight.T)
        for name, act in [("resid_mid", r), ("resid_post", cache[f"blocks.{layer}.hook_resid_post"]),
                          ("h", h), ("gate", gate)]:
            # float32 over 30 layers of width 576: reordering ~30 * sqrt(576) * 6e-8 ~ 4e-5 relative < 1e-4
            torch.testing.assert_close(res[name, "norm"][li], act[:, 1:].norm(dim=-1).mean(1), rtol=1e-4, atol=1e-4)


@pytest.mark.integration
@pytest.mark.gemma
def test_gemma_h_and_gate_match_manual(gemma):
    """Gemma's RMSNorm scales by (1 + gamma) and its MLP is GELU(tanh)-gated."""
    ex = interp.load_examples("wiki", gemma.tokenizer, n=2, seq_len=24)
    layer = 5
    res = probe(gemma, ex, ["h", "gate", "up"], ["norm"], layers=[layer], progress=False)
    with torch.no_grad():
        _, cache = gemma.run_with_cache(ex.tokens, names_filter=lambda n: n == f"blocks.{layer}.hook_resid_mid")
    block = gemma.original_model.model.layers[layer]
    norm = block.pre_feedforward_layernorm
    r = cache[f"blocks.{layer}.hook_resid_mid"].float()
    h = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + norm.eps) * (1.0 + norm.weight.float())
    gate = torch.nn.functional.gelu(h @ block.mlp.gate_proj.weight.T, approximate="tanh")
    up = h @ block.mlp.up_proj.weight.T
    # float32 over 18 layers of width 640: reordering ~18 * sqrt(640) * 6e-8 ~ 3e-5 relative < 1e-4
    torch.testing.assert_close(res["h", "norm"][0], h[:, 1:].norm(dim=-1).mean(1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(res["gate", "norm"][0], gate[:, 1:].norm(dim=-1).mean(1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(res["up", "norm"][0], up[:, 1:].norm(dim=-1).mean(1), rtol=1e-4, atol=1e-4)
    assert torch.allclose(hk.norm2_gamma(gemma, layer), 1.0 + norm.weight)


# ---------------------------------------------------------------------------------------
# The bridge-free path must give exactly the bridge's numbers


def _both_paths(model, ex, layers):
    tree = hk.native_model(model)
    # the per-head components (z, result, q, k, v) are read on the bridge only: no native tap to compare
    tapped = [c for c in hk.components(model) if hk.native_tap(model, tree, c, 0) is not None]
    assert {"resid_pre", "resid_mid", "resid_post", "pattern"} <= set(tapped)
    for component in tapped:
        reducers = ["entropy", "gtd", "sink_share", "full"] if component == "pattern" else ["norm", "kurtosis", "full"]
        fast = probe(model, ex, [component], reducers, batch_size=2, layers=layers, native=True, progress=False)
        hooked = probe(model, ex, [component], reducers, batch_size=2, layers=layers, native=False, progress=False)
        assert fast.stats.keys() == hooked.stats.keys()
        for key in fast.stats:
            assert torch.equal(fast.stats[key], hooked.stats[key]), (component, key)


def test_native_path_equals_bridge_path_tiny(tiny_llama):
    _both_paths(tiny_llama, _tokens(n=5, t=10), None)


@pytest.mark.integration
def test_native_path_equals_bridge_path_smollm2(smol, wiki_small):
    _both_paths(smol, Examples.from_tokens(wiki_small.tokens[:3, :24]), [0, 17, 29])


@pytest.mark.gemma
def test_native_path_equals_bridge_path_gemma(gemma):
    ex = interp.load_examples("wiki", gemma.tokenizer, n=3, seq_len=24, seed=0)
    _both_paths(gemma, ex, [0, 5, 17])  # layer 5 is a global-attention layer, 0 and 17 sliding


def test_native_path_only_without_hooks_and_leaves_no_hooks_behind(tiny_llama):
    def hook_counts():
        return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in tiny_llama.original_model.modules()]

    ex = _tokens(n=4, t=10)
    with torch.no_grad():
        tiny_llama.original_model(input_ids=ex.tokens)  # the bridge adds norm pre-hooks of its own on first use
    before = hook_counts()
    seen = []
    point = hk.hook_point(tiny_llama, "resid_post", 0)
    doubled = probe(tiny_llama, ex, ["resid_post"], ["norm"], extra_hooks=[(point, lambda x, hook: x * 2)],
                    progress=False)  # extra hooks: must run on the bridge, and change what is measured
    plain = probe(tiny_llama, ex, ["resid_post"], ["norm"], progress=False)
    torch.testing.assert_close(doubled["resid_post", "norm"][0], 2 * plain["resid_post", "norm"][0])
    with tiny_llama.hooks(fwd_hooks=[(point, lambda x, hook: seen.append(1))]):
        probe(tiny_llama, ex, ["resid_post"], ["norm"], progress=False)
        assert seen  # the caller's hook fired: the bridge path was taken
        with pytest.raises(interp.errors.InterpError, match="native=True"):
            probe(tiny_llama, ex, ["resid_post"], ["norm"], native=True, progress=False)
    assert not hk.hooks_active(tiny_llama)
    assert hook_counts() == before  # the native taps went on the clones only, and are gone
