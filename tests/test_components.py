"""The component registry (interp.runtime.hooks.COMPONENT_RECORDS) on every family the tests know.

Each family's tiny random model (test_families.CONFIGS: 2 layers, d_model 64, d_mlp 128, 4 heads)
is probed with a ``full`` capture of every component it has, and the probe's memory estimate
(read from the component's record) must equal the bytes the capture really takes: this is the
check that caught ``mlp_pre`` sized at d_model instead of d_mlp. The per-head components are
checked against the attention output projection's own output, read at a different hook point.
"""

from __future__ import annotations

import typing

import pytest
import torch
import transformers as tf
from test_families import CONFIGS, FAMILIES

import interp
from interp.errors import ComponentError
from interp.localize.patching import patches as P
from interp.models import tiny_tokenizer
from interp.probes import _full_bytes
from interp.runtime import hooks as hk

pytestmark = [pytest.mark.numerical, pytest.mark.usefixtures("one_thread")]  # conftest's one_thread


def build_family(family: str, folder, dtype: torch.dtype = torch.float32):
    """The family's tiny random model saved to ``folder`` and loaded with interp (``dtype`` after loading)."""
    config_class, kwargs = CONFIGS[family]
    config = config_class(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):  # make norm scales and biases visible (Gemma inits gamma = 0)
                param.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    loaded = interp.load_model(folder)
    if dtype != torch.float32:
        loaded.original_model.to(dtype)
    return loaded


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("component_families")
    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            cache[family] = build_family(family, root / family, torch.float64)
        return cache[family]

    return get


@pytest.fixture(scope="module")
def rows():
    tokens = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    tokens[:, 0] = 256
    return interp.Examples.from_tokens(tokens)


def test_literals_list_the_records():
    assert typing.get_args(hk.Component) == hk.COMPONENTS
    assert typing.get_args(P.PatchComponent) == P.PATCHABLE
    assert set(P.NOT_PATCHABLE) == {"h", "pattern", "gate_pre", "result"}
    assert P.PAPER_NAMES["mlp_pre"] == "MLP pre-activation" and P.PAPER_NAMES["down"] == "down (MLP out)"


def test_heads_only_on_per_head_components():
    assert P.Patch("z", (0,), heads=(1,)).label == "z@0 h1"
    with pytest.raises(ComponentError, match="per-head"):
        P.Patch("down", (0,), heads=(1,))


@pytest.mark.parametrize("family", FAMILIES)
def test_full_capture_size_matches_the_record(family, family_models, rows):
    """For every component the family has, the memory estimate is the capture's real size."""
    model = family_models(family)
    have = hk.components(model)
    assert ("mlp_pre" in have) == (family in ("gpt2", "gpt_neox"))  # plain MLPs, written down from transformers
    res = interp.probe(model, rows, have, ["full"], progress=False, native=False)
    n, seq_len = rows.tokens.shape
    for component in have:
        captured = res[component, "full"]
        assert captured.shape[:3] == (2, n, seq_len if component != "pattern" else captured.shape[2])
        assert not torch.isnan(captured).any(), component
        per_head = hk.record(component).per_head
        if per_head:  # [layer, N, pos, head, ...]: the head axis where heads= patches select
            heads = model.cfg.n_heads if per_head[0] == "head" else model.info.n_kv_heads or model.cfg.n_heads
            assert captured.shape[3] == heads, component
        # the estimate assumes 4-byte values; these captures are float64, hence the factor 2
        assert _full_bytes(model, component, n, seq_len, 2) * 2 == captured.numel() * captured.element_size(), component
    cfg = model.cfg
    if "mlp_pre" in have:  # the old estimate sized it at d_model, 1/2 of d_mlp here (1/4 on GPT-2)
        assert res["mlp_pre", "full"].shape[-1] == cfg.d_mlp != cfg.d_model


@pytest.mark.parametrize("family", FAMILIES)
def test_per_head_result_sums_to_o_proj_output(family, family_models, rows):
    """``result`` summed over heads plus the o_proj bias equals o_proj's output (read at its own hook)."""
    model = family_models(family)
    o_out: dict[int, torch.Tensor] = {}

    def keep(layer):
        def fn(x, hook):
            o_out[layer] = x.detach()
        return fn

    res = interp.probe(model, rows, ["z", "result", "head"], ["full"], progress=False, native=False)
    hooks = [(f"blocks.{layer}.attn.o.hook_out", keep(layer)) for layer in range(2)]
    with model.hooks(fwd_hooks=hooks), torch.no_grad():
        model.original_model(input_ids=rows.tokens)
    for layer in range(2):
        result, z = res["result", "full"][layer], res["z", "full"][layer]
        assert torch.equal(z, res["head", "full"][layer])
        bias = getattr(hk.linear_weights(model, layer)["o"].module, "bias", None)
        total = result.sum(dim=2) + (bias.detach() if bias is not None else 0)
        # float64: each output is a dot product over n_heads * d_head = 64 terms, computed in two
        # orders (per head then summed, and all at once); each is off by at most n*u*sum|z_i w_i|
        # (u = 2^-53, n = 64 + 4 for the head sum and bias), so their difference by twice that
        w_o = hk.per_head_w_o(model, layer)  # [head, d_model, d_head]
        magnitude = torch.einsum("bphd,hmd->bpm", z.abs(), w_o.abs()) + (bias.abs() if bias is not None else 0)
        bound = 2 * 68 * 2.0**-53 * magnitude
        assert ((total - o_out[layer]).abs() <= bound).all()


def test_unknown_and_missing_components_are_refused(family_models):
    model = family_models("gpt_neox")
    with pytest.raises(ComponentError, match="gated MLP"):
        hk.hook_point(model, "gate", 0)
    with pytest.raises(ComponentError, match="parallel residual"):
        hk.hook_point(model, "resid_mid", 0)
    with pytest.raises(ComponentError, match="Valid components"):
        hk.record("nope")
