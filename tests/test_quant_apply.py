"""Whole-model quantization: interp.quant.apply (quantize, sequential calibration, save/load, cache)."""

from __future__ import annotations

import copy

import pytest
import torch

import interp
from interp.errors import ComponentError, InterpError, SpecError
from interp.models import canonical_state_dict
from interp.quant import apply as qa
from interp.quant import quantize_weight
from interp.runtime import hooks

SPEC_RTN = "rtn:bits=3,group=32"
SPEC_GPTQ = "gptq:bits=3,group=32"
EPS32 = torch.finfo(torch.float32).eps
U32 = EPS32 / 2


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


@pytest.fixture(scope="module")
def model64():
    return interp.tiny_model("llama", seed=0, n_layers=2).to(torch.float64)


def test_calibration_inputs_come_from_the_already_quantized_model(model64, calibration, monkeypatch):
    """GPTQ sees, for each layer and sub-layer group, the inputs the partially quantized model produces.

    In float64: the library runs the calibration rows in batches of 2, this test all 5 at once,
    so the forwards agree to float64 rounding (~1e-16 relative per operation over 2 layers),
    and the library keeps the inputs it hands GPTQ in float32 (one rounding, <= u32 relative).
    The tolerance is that rounding (rtol = u32) plus one float32 ulp of the largest input for
    the float64 reorderings, which leaves them some seven orders of magnitude.
    """
    model = model64
    seen = []
    real = qa.quantize_parsed  # the per-weight quantizer quantize calls (parsed spec)

    def recording(weight, spec, inputs=None):
        seen.append((weight.detach().clone(), inputs.X.clone()))  # the group's LayerInputs
        return real(weight, spec, inputs)

    monkeypatch.setattr(qa, "quantize_parsed", recording)
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
        atol = EPS32 * float(expected.abs().max())
        torch.testing.assert_close(inputs.double(), expected, rtol=U32, atol=atol)
    # and the later inputs really differ from the unquantized model's (the test can fail)
    plain = []
    name = hooks.linear_input_hook(model, 1, "down")
    with torch.no_grad(), model.hooks(fwd_hooks=[(name, lambda x, hook: plain.append(x))]):
        model.original_model(input_ids=calibration.tokens, use_cache=False)
    plain = plain[0].reshape(-1, plain[0].shape[-1])  # differ beyond the tolerance that means "equal" above
    assert not torch.allclose(seen[-1][1].double(), plain, rtol=U32, atol=EPS32 * float(plain.abs().max()))


def _block_weights(qmodel):
    return {f"{layer}.{role}": slot.read().detach().clone() for layer in range(hooks.n_layers(qmodel))
            for role, slot in hooks.linear_weights(qmodel, layer).items()}


@pytest.fixture
def feeder_modes(monkeypatch):
    """Record LayerFeeder.pauses as each block ends; ``force`` sets it before the first block instead."""
    from interp.quant import calibration as qc

    seen: list = []
    force: dict = {}
    original_init, original_advance = qc.LayerFeeder.__init__, qc.LayerFeeder.advance

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if "pauses" in force:
            self.pauses = force["pauses"]

    def advance(self, layer, outputs=None):
        seen.append(self.pauses)
        return original_advance(self, layer, outputs)

    monkeypatch.setattr(qc.LayerFeeder, "__init__", init)
    monkeypatch.setattr(qc.LayerFeeder, "advance", advance)
    return seen, force


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("spec", [SPEC_GPTQ, "awq:bits=3,group=32,grid=4"])
def test_paused_forward_gives_the_rerun_models_to_the_bit(kind, spec, calibration, feeder_modes):
    """One forward per block paused at each group's input = re-running the block for each group, exactly."""
    seen, force = feeder_modes
    model = interp.tiny_model(kind, seed=0, n_layers=3)
    paused = _block_weights(qa.quantize(model, spec, calibration=calibration, progress=False, batch_size=2))
    assert seen == [True, True, True]  # the first block's check passed, the others paused too
    seen.clear()
    force["pauses"] = False
    rerun = _block_weights(qa.quantize(model, spec, calibration=calibration, progress=False, batch_size=2))
    assert seen == [False, False, False]
    assert paused.keys() == rerun.keys() and all(torch.equal(paused[k], rerun[k]) for k in paused)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_paused_forward_runs_with_the_callers_thread_count(threads, model64, feeder_modes):
    """The paused block runs in threads of its own; they must use the caller's intra-op thread count, or
    a float reduction splits differently there and the first block's bit-for-bit check fails (it did
    under `torch.set_num_threads(1)` on a 2-core machine, where a new thread started with MKL's 2)."""
    from padding_rows import TEXTS

    seen, _ = feeder_modes
    calibration = interp.examples_from_texts(TEXTS, model64.tokenizer)  # float64 model, rows of 9 to 54 tokens
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        qa.quantize(model64, SPEC_GPTQ, calibration=calibration, progress=False, batch_size=1)
    finally:
        torch.set_num_threads(before)
    assert seen == [True] * len(seen) and seen  # the check passed: the fast path stayed on


@pytest.mark.parametrize("failure", ["inputs differ", "hooks out of order"])
def test_a_failed_first_block_check_falls_back_to_rerunning(model, calibration, feeder_modes, monkeypatch, failure):
    """A block that computed a group before reaching its input hook would fail the check: the first block is
    quantized again from its original weights by re-running, and so are the others."""
    from interp.quant import calibration as qc

    seen, _ = feeder_modes
    expected = _block_weights(qa.quantize(model, SPEC_GPTQ, calibration=calibration, progress=False, batch_size=2))
    if failure == "inputs differ":
        monkeypatch.setattr(qa, "_replays", lambda *args: False)
    else:
        real_inputs = qc.PausedBlock.inputs

        def out_of_order(self, group):
            if group == 2:  # after two groups were quantized and written
                raise qc.OutOfOrder("simulated")
            return real_inputs(self, group)

        monkeypatch.setattr(qc.PausedBlock, "inputs", out_of_order)
    seen.clear()
    fallback = _block_weights(qa.quantize(model, SPEC_GPTQ, calibration=calibration, progress=False, batch_size=2))
    assert seen == [False, False]
    assert all(torch.equal(fallback[k], expected[k]) for k in expected)


def test_an_error_while_paused_ends_the_threads(model, calibration, monkeypatch):
    import threading

    def refuse(weight, spec, inputs=None):
        raise SpecError("stop here")

    before = threading.active_count()
    monkeypatch.setattr(qa, "quantize_parsed", refuse)
    with pytest.raises(SpecError, match="stop here"):
        qa.quantize(model, SPEC_GPTQ, calibration=calibration, progress=False, batch_size=2)
    assert threading.active_count() == before  # every paused forward unwound and its thread ended


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
        # the same weights (checked bitwise above) and the same forward: the same bits
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
    # other kernels are another cache entry: a GPTQ model made under AVX2 kernels is not what an
    # AVX-512 run would make (28% of SmolLM2's GPTQ-3 weights differ), so it is never reused there
    key = qa.cache_key(model, SPEC_GPTQ, calibration)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "SOME-OTHER-ISA")
    assert qa.cache_key(model, SPEC_GPTQ, calibration) != key


def test_algorithm_versions_enter_the_cache_key(model, calibration, monkeypatch):
    """A changed quantizer or calibration feeder bumps its version, and the cache no longer serves
    the old weights; the version is recorded in the quant info too."""
    import dataclasses

    from interp.quant import calibration as qcal
    from interp.quant.spec import METHODS

    gptq, rtn = qa.cache_key(model, SPEC_GPTQ, calibration), qa.cache_key(model, SPEC_RTN, None)
    record = METHODS["gptq"]
    bumped = dataclasses.replace(record, version=record.version + 1)
    monkeypatch.setattr(qa, "METHODS", {**dict(METHODS), "gptq": bumped})
    assert qa.cache_key(model, SPEC_GPTQ, calibration) != gptq
    assert qa.cache_key(model, SPEC_RTN, None) == rtn  # another method's version is not this one's
    monkeypatch.setattr(qa, "METHODS", METHODS)
    monkeypatch.setattr(qa, "FEEDER_VERSION", qcal.FEEDER_VERSION + 1)
    assert qa.cache_key(model, SPEC_GPTQ, calibration) != gptq  # the calibration forwards changed
    assert qa.cache_key(model, SPEC_RTN, None) == rtn  # a calibration-free method does not use them
    info = qa.quantize(model, SPEC_RTN, progress=False).quant_info
    assert info.algorithm == f"rtn-v{METHODS['rtn'].version}"


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
