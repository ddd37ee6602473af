"""Whole-model quantization: interp.quant.apply (quantize, sequential calibration, save/load, cache)."""

from __future__ import annotations

import copy

import pytest
import torch

import interp
from interp import hooks
from interp.errors import ComponentError, InterpError, SpecError
from interp.models import canonical_state_dict
from interp.quant import apply as qa
from interp.quant import quantize_weight

SPEC_RTN = "rtn:bits=3,group=32"
SPEC_GPTQ = "gptq:bits=3,group=32"


@pytest.fixture(scope="module")
def model():
    return interp.tiny_model("llama", seed=0, n_layers=2)


@pytest.fixture(scope="module")
def calibration():
    g = torch.Generator().manual_seed(1)
    return interp.Examples.from_tokens(torch.randint(0, 256, (5, 24), generator=g), ids=[f"c{i}" for i in range(5)])


def _snapshot(model):
    return {k: v.detach().clone() for k, v in canonical_state_dict(model).items()}


def _is_block_linear(name: str) -> bool:
    return "layers." in name and name.endswith("proj.weight")


@pytest.mark.parametrize("spec", [SPEC_RTN, SPEC_GPTQ, "awq:bits=3,group=32,grid=4"])
def test_reference_is_bitwise_unchanged(model, calibration, spec):
    before = _snapshot(model)
    qmodel = qa.quantize(model, spec, calibration=calibration, progress=False)
    after = canonical_state_dict(model)
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name
        assert tensor.data_ptr() != canonical_state_dict(qmodel)[name].data_ptr()


def test_only_block_linears_change_and_each_is_quantize_weight(model):
    qmodel = qa.quantize(model, SPEC_RTN, progress=False)
    ref, quant = canonical_state_dict(model), canonical_state_dict(qmodel)
    changed = {name for name in ref if not torch.equal(ref[name], quant[name])}
    expected = {name for name in ref if _is_block_linear(name)}
    assert changed == expected and len(expected) == 2 * 7
    for layer in range(2):
        ref_mods, q_mods = hooks.linear_modules(model, layer), hooks.linear_modules(qmodel, layer)
        for role in qa.ROLES:
            assert torch.equal(q_mods[role].weight, quantize_weight(ref_mods[role].weight, SPEC_RTN))
    info = qmodel.quant_info
    assert info.spec == "rtn:bits=3,group=32,zero=float" and info.calibration is None
    assert len(info.layer_seconds) == 2 and set(info.role_seconds) == set(qa.ROLES)
    assert len(info.relative_errors) == 14 and all(0 < e < 1 for e in info.relative_errors.values())
    assert qmodel.info.source_hash != getattr(model.info, "source_hash", "")


def test_calibration_inputs_come_from_the_already_quantized_model(model, calibration, monkeypatch):
    """GPTQ sees, for each layer and sub-layer group, the inputs the partially quantized model produces."""
    seen = []
    real = qa.quantize_weight

    def recording(weight, spec, inputs=None):
        seen.append((weight.detach().clone(), inputs.clone()))
        return real(weight, spec, inputs)

    monkeypatch.setattr(qa, "quantize_weight", recording)
    qmodel = qa.quantize(model, SPEC_GPTQ, calibration=calibration, progress=False, batch_size=2)
    assert len(seen) == 2 * 7
    order = [(layer, role) for layer in range(2) for group in qa.SHARED_INPUT_GROUPS for role in group]
    for step, (layer, role) in enumerate(order):
        # a model whose first `step` linear layers (in quantization order) are quantized
        partial = copy.deepcopy(model)
        with torch.no_grad():
            for ql, qr in order[:step]:
                hooks.linear_modules(partial, ql)[qr].weight.copy_(hooks.linear_modules(qmodel, ql)[qr].weight)
        captured = []
        name = hooks.linear_input_hook(partial, layer, role)
        with torch.no_grad(), partial.hooks(fwd_hooks=[(name, lambda x, hook, out=captured: out.append(x))]):
            partial.original_model(input_ids=calibration.tokens, use_cache=False)
        expected = captured[0].reshape(-1, captured[0].shape[2:].numel())
        weight, inputs = seen[step]
        assert torch.equal(weight, hooks.linear_modules(model, layer)[role].weight), (layer, role)
        torch.testing.assert_close(inputs, expected, atol=1e-5, rtol=1e-5)
    # and the later inputs really differ from the unquantized model's (the test can fail)
    plain = []
    name = hooks.linear_input_hook(model, 1, "down")
    with torch.no_grad(), model.hooks(fwd_hooks=[(name, lambda x, hook: plain.append(x))]):
        model.original_model(input_ids=calibration.tokens, use_cache=False)
    assert not torch.allclose(seen[-1][1], plain[0].reshape(-1, plain[0].shape[-1]), atol=1e-6)


def test_calibrated_method_without_calibration_is_a_clear_error(model):
    with pytest.raises(SpecError, match="calibration"):
        qa.quantize(model, SPEC_GPTQ, progress=False)
    with pytest.raises(SpecError, match="group"):
        qa.quantize(model, "rtn:bits=3,group=48", progress=False)


def test_plain_mlp_model_quantizes_without_a_gate(tiny_gpt2):
    # GPT-2: Conv1D weights, fused q/k/v, no gate (every family: tests/test_families.py)
    qmodel = qa.quantize(tiny_gpt2, SPEC_RTN, progress=False)
    assert "gate" not in hooks.linear_weights(qmodel, 0) and {"q", "k", "v", "up", "down"} <= set(
        hooks.linear_weights(qmodel, 0))


def test_linear_input_hook_names(model):
    assert hooks.linear_input_hook(model, 1, "down") == "blocks.1.mlp.out.hook_in"
    with pytest.raises(ComponentError, match="Valid roles"):
        hooks.linear_input_hook(model, 0, "lm_head")


def test_save_and_load_round_trip(model, calibration, tmp_path):
    qmodel = qa.quantize(model, SPEC_GPTQ, calibration=calibration, progress=False)
    qa.save_quantized(qmodel, tmp_path / "q")
    loaded = qa.load_quantized(model, tmp_path / "q")
    for name, tensor in canonical_state_dict(qmodel).items():
        assert torch.equal(tensor, canonical_state_dict(loaded)[name]), name
    tokens = calibration.tokens[:2]
    with torch.no_grad():
        torch.testing.assert_close(loaded.original_model(input_ids=tokens).logits,
                                   qmodel.original_model(input_ids=tokens).logits, atol=0, rtol=0)
    assert loaded.quant_info.spec == qmodel.quant_info.spec
    assert loaded.quant_info.calibration == qmodel.quant_info.calibration
    other = interp.tiny_model("llama", seed=1, n_layers=2)
    with pytest.raises(InterpError, match="not from this reference"):
        qa.load_quantized(other, tmp_path / "q")
    (tmp_path / "q" / qa.WEIGHTS_FILE).write_bytes(b"truncated")
    assert qa.read_quant_info(tmp_path / "q") is None
    with pytest.raises(InterpError, match="no complete"):
        qa.load_quantized(model, tmp_path / "q")


def test_quantize_cached_loads_without_requantizing(model, calibration, tmp_path, monkeypatch):
    first = qa.quantize_cached(model, SPEC_GPTQ, calibration, cache_dir=tmp_path, progress=False)

    def refuse(*args, **kwargs):
        raise AssertionError("quantized again")

    monkeypatch.setattr(qa, "quantize", refuse)
    second = qa.quantize_cached(model, SPEC_GPTQ, calibration, cache_dir=tmp_path, progress=False)
    for name, tensor in canonical_state_dict(first).items():
        assert torch.equal(tensor, canonical_state_dict(second)[name])
    # another calibration set or spec is another cache entry
    other_cal = calibration.subset([0, 1, 2])
    assert qa.cache_key(model, SPEC_GPTQ, other_cal) != qa.cache_key(model, SPEC_GPTQ, calibration)
    assert qa.cache_key(model, "gptq:bits=4,group=32", calibration) != qa.cache_key(model, SPEC_GPTQ, calibration)
    # calibration does not enter the key of a calibration-free method
    assert qa.cache_key(model, SPEC_RTN, other_cal) == qa.cache_key(model, SPEC_RTN, None)


@pytest.mark.integration
def test_smollm2_rtn4_costs_a_little_nll(smol):
    """Real model: 4-bit RTN raises NLL slightly on average; 3-bit more than 4-bit."""
    ex = interp.load_examples("wiki", smol.tokenizer, n=4, seq_len=32, seed=0)
    before = _snapshot(smol)
    q4 = qa.quantize(smol, "rtn:bits=4,group=64", progress=False)
    ref_nll, q4_nll = interp.nll(smol, ex), interp.nll(q4, ex)
    del q4
    assert 0 < float((q4_nll - ref_nll).mean()) < 0.5
    for name, tensor in canonical_state_dict(smol).items():
        assert torch.equal(tensor, before[name]), name
