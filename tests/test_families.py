"""Every common decoder family, end to end, on small random models saved as folders.

Each family's model is built from its transformers config class (2 layers, d_model 64,
vocabulary 259), saved with ``save_pretrained`` and loaded back with
``interp.load_model(folder)``. Then: NLL against a plain Hugging Face computation, the
layout ``ModelInfo`` reads from the modules, a probe of every component the family has
(gate / MLP pre-activation checked against the weights), attention analysis with SAOBP,
the logit lens, one patch, quantization (checked slice by slice) and scoring, and the
error for a component the family lacks.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf

import interp
from interp.errors import ComponentError, ModelLoadError
from interp.localize import lens, patching
from interp.models import TINY_VOCAB, tiny_tokenizer
from interp.runtime import hooks as hk

SPECIAL = {"vocab_size": TINY_VOCAB, "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}
LLAMA_LIKE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 128, **SPECIAL}
GEMMA = {**LLAMA_LIKE, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8}
CONFIGS = {
    "llama": (tf.LlamaConfig, LLAMA_LIKE),
    "mistral": (tf.MistralConfig, {**LLAMA_LIKE, "sliding_window": 8}),
    "qwen2": (tf.Qwen2Config, LLAMA_LIKE),
    "qwen3": (tf.Qwen3Config, {**LLAMA_LIKE, "head_dim": 16}),
    "gemma2": (tf.Gemma2Config, GEMMA),
    "gemma3": (tf.Gemma3TextConfig, GEMMA),
    "gpt2": (tf.GPT2Config, {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128, **SPECIAL}),
    "gpt_neox": (tf.GPTNeoXConfig, {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                    "num_attention_heads": 4, "max_position_embeddings": 128, **SPECIAL}),
    "phi3": (tf.Phi3Config, LLAMA_LIKE),
    "olmo2": (tf.Olmo2Config, LLAMA_LIKE),
}
FAMILIES = list(CONFIGS)

# What each family is, written down from the transformers source (not from interp's code):
# (gated, fused gate_up, fused q/k/v, norm, norm offset, post norms, parallel residual)
LAYOUT = {
    "llama": (True, False, "", "rmsnorm", 0.0, False, False),
    "mistral": (True, False, "", "rmsnorm", 0.0, False, False),
    "qwen2": (True, False, "", "rmsnorm", 0.0, False, False),
    "qwen3": (True, False, "", "rmsnorm", 0.0, False, False),
    "gemma2": (True, False, "", "rmsnorm", 1.0, True, False),
    "gemma3": (True, False, "", "rmsnorm", 1.0, True, False),
    "gpt2": (False, False, "blocked", "layernorm", 0.0, False, False),
    "gpt_neox": (False, False, "per_head", "layernorm", 0.0, False, True),
    "phi3": (True, True, "blocked", "rmsnorm", 0.0, False, False),
    "olmo2": (True, False, "", "rmsnorm", 0.0, True, False),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: thread hand-offs cost more than they save
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    tokenizer = tiny_tokenizer()
    out = {}
    for family, (config_class, kwargs) in CONFIGS.items():
        config = config_class(**kwargs)
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(config)
        if family in ("gemma2", "gemma3"):  # Gemma norms init gamma = 0 (scale 1); make 1 + gamma visible
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "norm" in name:
                        param.normal_(0.0, 0.3)
        folder = root / family
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        out[family] = folder
    return out


@pytest.fixture(scope="module")
def models(folders):
    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            cache[family] = interp.load_model(folders[family])
        return cache[family]

    return get


@pytest.fixture(scope="module")
def examples():
    tokens = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(0))
    tokens[:, 0] = 256  # BOS
    return interp.Examples.from_tokens(tokens)


def _plain_nll(folder, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL per row from a freshly loaded plain Hugging Face model, in float64."""
    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.double()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    return -logp.gather(-1, tokens[:, 1:, None]).squeeze(-1).mean(dim=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_nll_matches_plain_hf(family, folders, models, examples):
    model = models(family)
    ours = interp.nll(model, examples).double()
    # same float32 weights and ops in both; the bridge-free body and vocabulary-sliced
    # log-sum-exp reorder sums of ~64 terms (~1e-6 relative on logits of size ~1) and
    # 11 positions are averaged: well under 1e-4 nats
    assert torch.allclose(ours, _plain_nll(folders[family], examples.tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_layout_read_from_modules(family, models):
    info = models(family).info
    got = (info.gated_mlp, info.fused_gate_up, info.fused_qkv, info.norm, info.norm_offset, info.post_norms,
           info.parallel_residual)
    assert got == LAYOUT[family]
    assert (info.n_layers, info.d_model, info.n_heads) == (2, 64, 4)
    gamma = hk.norm2_gamma(models(family), 1) if info.mlp_norm else None
    if family == "gemma2":  # the MLP-input scale is 1 + gamma, exactly
        norm = hk.blocks(models(family))[1].pre_feedforward_layernorm
        assert torch.equal(gamma, norm.weight.detach() + 1.0)
    if family == "olmo2":  # post-norm only: the MLP reads resid_mid as it is
        with pytest.raises(ComponentError, match="no norm in front of its MLP"):
            hk.norm2_gamma(models(family), 1)


def _first_projection(model, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W [d_mlp, d_model], b)`` of the MLP's gate (gated) or input projection (plain), from the HF modules."""
    mlp = hk._unwrap(hk.mlp_module(model, layer))
    if hasattr(mlp, "gate_up_proj"):  # Phi-3: rows [gate | up]
        weight = hk._unwrap(mlp.gate_up_proj).weight
        return weight[: weight.shape[0] // 2], None
    if hasattr(mlp, "gate_proj"):
        return hk._unwrap(mlp.gate_proj).weight, None
    if hasattr(mlp, "c_fc"):  # GPT-2 Conv1D: [in, out]
        conv = hk._unwrap(mlp.c_fc)
        return conv.weight.T, conv.bias
    linear = hk._unwrap(mlp.dense_h_to_4h)
    return linear.weight, linear.bias


@pytest.mark.parametrize("family", FAMILIES)
def test_probe_every_component(family, models, examples):
    model = models(family)
    have = hk.components(model)
    vectors = [c for c in have if c != "pattern"]
    res = interp.probe(model, examples, components=vectors, reducers=["norm"], progress=False)
    for component in vectors:
        assert torch.isfinite(res[component, "norm"]).all(), component
    attn = interp.probe(model, examples, components=["pattern"], reducers=["entropy"], progress=False)
    assert torch.isfinite(attn["pattern", "entropy"]).all()
    # the gate (or plain MLP) pre-activation is the first projection of h, computed here from the weights
    pre = "gate_pre" if model.info.gated_mlp else "mlp_pre"
    full = interp.probe(model, examples, components=["h", pre], reducers=["full"], layers=[1], progress=False)
    weight, bias = _first_projection(model, 1)
    expected = torch.nn.functional.linear(full["h", "full"][0].double(), weight.double().detach(),
                                          None if bias is None else bias.double().detach())
    # float32 matmul over d_model = 64 terms of size ~1: error ~1e-6, far below 1e-4
    assert torch.allclose(full[pre, "full"][0].double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_missing_component_names_family(family, models):
    model = models(family)
    missing = "mlp_pre" if model.info.gated_mlp else "gate"
    with pytest.raises(ComponentError, match=rf"family {family}\) has .*resid_post"):
        hk.hook_point(model, missing, 0)
    if model.info.parallel_residual:
        with pytest.raises(ComponentError, match="parallel residual"):
            interp.probe(model, interp.Examples.from_tokens(torch.zeros(1, 4, dtype=torch.long)), ["resid_mid"])


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_analysis_with_saobp(family, models, examples):
    result = interp.attention.analyze(models(family), examples, saobp_beta=0.5, progress=False)
    assert set(result.table["variant"]) >= {"reference", "saobp"} or len(result.table["variant"].unique()) == 2
    assert result.delta_nll is not None and torch.isfinite(result.delta_nll).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_logit_lens_last_layer_is_the_model(family, models, examples):
    model = models(family)
    res = lens.early_exit(model, examples, at="resid_post")
    # the last exit decodes the same final residual with the same norm and head as nll():
    # only the summation order of the log-sum-exp differs (~1e-6)
    assert torch.allclose(res.nll[-1].double(), interp.nll(model, examples).double(), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def quantized(models):
    from interp.quant.apply import quantize

    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            cache[family] = quantize(models(family), "rtn:bits=3,group=16", progress=False)
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_quantize_slices_and_score(family, models, quantized, examples, tmp_path):
    from interp.quant.methods import quantize_weight
    from interp.quant.store import score
    from interp.runtime.scoring import model_logits, token_nll

    model, qmodel = models(family), quantized(family)
    for role, slot in hk.linear_weights(model, 0).items():
        # each logical [out, in] matrix quantized on its own, groups along the input dim
        # (for GPT-2's Conv1D that is the stored weight's first axis)
        expected = quantize_weight(slot.read().detach(), "rtn:bits=3,group=16")
        assert torch.equal(hk.linear_weights(qmodel, 0)[role].read(), expected), role
    # the bridge's hooked forward (split q/k/v copies) and the bridge-free one (fused weight) agree
    with torch.no_grad():  # a forward with gradients leaves graph tensors in state the bridges share
        hooked = token_nll(model_logits(qmodel, examples.tokens), examples.tokens).double().mean(dim=1)
    assert torch.allclose(hooked, interp.nll(qmodel, examples).double(), atol=1e-4, rtol=0)  # as in the nll test
    table = score(model, ["rtn:bits=3,group=16"], examples, tmp_path / "store", cache_dir=tmp_path / "q")
    assert len(table) >= len(examples)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_patch(family, models, quantized, examples):
    model, qmodel = models(family), quantized(family)
    mlp_in = "gate" if model.info.gated_mlp else "mlp_pre"
    jobs = patching.single_layer_patches(["attn_out", mlp_in, "down"], [1]) + [patching.Patch("resid_post", (0, 1))]
    res = patching.patch(qmodel, model, examples, jobs)
    naive = patching.patch_naive(qmodel, model, examples, jobs)
    # engine and textbook loop compute the same runs; only decoding order differs (~1e-6)
    assert torch.allclose(res.values, naive.values, atol=1e-4, rtol=0)
    # every block output patched from the reference: the reference's own NLL (same argument)
    assert torch.allclose(res.values[-1], res.source, atol=1e-4, rtol=0)
    assert all(math.isfinite(float(v)) for v in res.recovery()[:-1]) or res.target_value == res.source_value


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3"])
def test_model_in_memory_same_info_and_nll(family, folders, models, examples):
    from transformer_lens.model_bridge import TransformerBridge

    folder = folders[family]
    tokenizer = tf.AutoTokenizer.from_pretrained(folder)
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    adopted = interp.load_model(hf, tokenizer=tokenizer, name=str(folder))
    assert adopted.info == models(family).info
    assert torch.equal(interp.nll(adopted, examples), interp.nll(models(family), examples))
    hf2 = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    bridge = TransformerBridge.boot_transformers(str(folder), hf_model=hf2, tokenizer=tokenizer, device="cpu")
    from_bridge = interp.load_model(bridge, name=str(folder))
    assert from_bridge is bridge and from_bridge.info == models(family).info
    assert torch.equal(interp.nll(from_bridge, examples), interp.nll(models(family), examples))


def test_in_memory_needs_tokenizer_and_a_known_dtype(folders):
    hf = tf.AutoModelForCausalLM.from_pretrained(folders["llama"])
    with pytest.raises(ModelLoadError, match="tokenizer="):
        interp.load_model(hf)
    with pytest.raises(ModelLoadError, match="dtype must be one of"):
        interp.load_model(folders["llama"], dtype=torch.int8)
    with pytest.raises(ModelLoadError, match="PreTrainedModel"):
        interp.load_model(torch.nn.Linear(2, 2), tokenizer=tiny_tokenizer())
    half = interp.load_model(hf, tokenizer=tiny_tokenizer(), dtype="bfloat16")
    assert next(half.original_model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_prompts_equal_each_prompt_alone(family, folders):
    """Left padding shifts nothing in any family: nll, a probe and the logit lens of a padded batch
    equal each prompt run alone, unpadded.

    The model runs in float64, but some families' eager attention (Gemma-2/3, GPT-NeoX) keeps a
    float32 softmax (tests/float64_attention.py wraps the llama-style ones only). A float32 softmax
    over K <= 40 keys puts a relative error of at most (K + 2) * eps32 on each probability; through
    2 layers that bounds a per-example value of size ``scale`` by 2 * (K + 2) * eps32 * scale, plus
    one float32 rounding of the stored result. Measured differences are far below it; a pad leaking
    into a statistic moves values by 1e-2 or more.
    """
    from padding_rows import TEXTS, row_alone
    from tolerances import EPS32, rounding_tol

    model = interp.load_model(folders[family])
    model.original_model.to(torch.float64)
    padded = interp.examples_from_texts(TEXTS, model.tokenizer, padding="left")
    keys = padded.tokens.shape[1]

    def per_example(ex):
        return torch.cat([interp.nll(model, ex).double()[None],
                          interp.probe(model, ex, ["resid_post"], ["norm"], progress=False)["resid_post", "norm"]
                          .double(),
                          lens.early_exit(model, ex, progress=False).nll.double()])

    batched = per_example(padded)
    alone = torch.cat([per_example(row_alone(padded, i)) for i in range(len(TEXTS))], dim=1)
    bound = rounding_tol(2 * (keys + 2) + 1, alone.abs().amax(dim=1, keepdim=True), EPS32)
    assert torch.isfinite(batched).all()
    assert bool(((batched - alone).abs() <= bound).all()), float((batched - alone).abs().max())
