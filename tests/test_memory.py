"""One copy of the weights: quantized variants swapped into the reference in place (interp.quant.inplace,
interp.runtime.swap) instead of a deep copy beside it.

What is checked: the swapped-in weights are exactly quantize()'s (the same code on the same values,
so ``torch.equal``), the reference is bit-identical afterwards, even when the block inside fails, and
score / interp quantize / the restoration sweep never deep-copy the model. The peak memory itself
is measured by benchmarks/bench_memory.py (docs/benchmarks-memory.md), not here: a test process
shares its heap with everything pytest loaded before it.
"""

from __future__ import annotations

import copy

import pytest
import torch

import interp
from interp.quant import apply as qa
from interp.quant.inplace import SavedWeights, cached_variant, quantized_in_place, variant
from interp.runtime import hooks
from interp.runtime.swap import WeightStash


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.original_model.state_dict().items()}


def _same(model, state) -> bool:
    now = model.original_model.state_dict()
    return now.keys() == state.keys() and all(torch.equal(now[k], state[k]) for k in state)


def _linear(model, layer):
    return {role: slot.read().detach().clone() for role, slot in hooks.linear_weights(model, layer).items()}


@pytest.fixture(scope="module")
def model():
    return interp.tiny_model("llama", seed=0, n_layers=2)


@pytest.fixture(scope="module")
def rows():
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 256, (6, 16), generator=g)
    tokens[:, 0] = 256
    return interp.Examples.from_tokens(tokens, ids=[f"r{i}" for i in range(6)])


@pytest.fixture
def no_deepcopy(monkeypatch):
    """Fail the test if anything deep-copies a torch module (the second copy of the weights)."""
    original = copy.deepcopy

    def guarded(obj, *args, **kwargs):
        if isinstance(obj, torch.nn.Module):
            raise AssertionError(f"deep copy of a {type(obj).__name__}")
        return original(obj, *args, **kwargs)

    monkeypatch.setattr(copy, "deepcopy", guarded)


@pytest.mark.parametrize("spec", ["gptq:bits=3,group=32", "awq:bits=3,group=32", "nf:bits=3,group=32"])
def test_in_place_weights_are_quantize_s(model, rows, spec):
    before = _state(model)
    expected = qa.quantize(model, spec, calibration=rows, progress=False)
    with quantized_in_place(model, spec, rows, progress=False) as info:
        assert (info.spec, info.calibration, info.relative_errors) == (
            expected.quant_info.spec, expected.quant_info.calibration, expected.quant_info.relative_errors)
        for layer in range(2):
            got, want = _linear(model, layer), _linear(expected, layer)
            assert all(torch.equal(got[r], want[r]) for r in want)
    assert _same(model, before)


def test_the_reference_comes_back_when_the_block_fails(model, tmp_path):
    before = _state(model)
    with pytest.raises(RuntimeError, match="inside"), quantized_in_place(model, "rtn:bits=3,group=32",
                                                                         progress=False):
        assert not _same(model, before)
        raise RuntimeError("inside")
    assert _same(model, before)


def test_variant_equals_load_quantized_and_can_restore_layers(model, rows, tmp_path):
    before = _state(model)
    with WeightStash(model) as stash:
        folder = cached_variant(model, "rtn:bits=3,group=32", stash=stash, cache_dir=tmp_path, progress=False)
    assert _same(model, before)
    loaded = qa.load_quantized(model, folder)
    own_block0 = _linear(model, 0)
    with variant(model, folder):
        assert torch.equal(model(rows.tokens), loaded(rows.tokens))
    with variant(model, folder, layers=[1]):  # block 0 keeps the reference's weights
        assert all(torch.equal(_linear(model, 0)[r], w) for r, w in own_block0.items())
        assert all(torch.equal(_linear(model, 1)[r], w) for r, w in _linear(loaded, 1).items())
    assert _same(model, before)
    other = interp.tiny_model("llama", seed=1, n_layers=2)
    with pytest.raises(interp.errors.InterpError, match="made from model"):
        SavedWeights(folder, other)


def test_score_holds_one_copy_and_gives_the_two_copy_numbers(model, rows, tmp_path, no_deepcopy):
    from interp.quant.store import score

    before = _state(model)
    specs = ["rtn:bits=3,group=32", "nf:bits=3,group=32"]
    errors = score(model, specs, rows, store=tmp_path, batch_size=3, progress=False)
    assert _same(model, before)
    reference = interp.nll(model, rows, batch_size=3).double()
    with variant(model, next(p for p in (tmp_path / "quantized").glob("rtn3*") if p.is_dir())):  # not its .lock
        in_place = interp.nll(model, rows, batch_size=3).double()
    assert _same(model, before)
    # score keeps its NLLs from its own float32 scorer, interp.nll rounds each to float32 on its own path:
    # each NLL ~5.6 within 5.6 eps32 / 2 = 3.3e-7, a difference within 6.7e-7 (as in test_quant_score.py)
    torch.testing.assert_close(torch.tensor(errors.iloc[:, 0].to_numpy()), in_place - reference, atol=1e-6, rtol=0)


def test_restoration_sweep_in_place_holds_one_copy(model, rows, tmp_path, no_deepcopy):
    from interp.localize.restoration import restoration_sweep

    before = _state(model)
    with WeightStash(model) as stash:
        folder = cached_variant(model, "rtn:bits=3,group=32", stash=stash, cache_dir=tmp_path, progress=False)
    sweep = restoration_sweep(SavedWeights(folder, model), model, rows, batch_size=3)
    assert _same(model, before)
    assert torch.equal(sweep.nll[-1], sweep.reference_nll)  # every block restored: the reference, same forwards
    assert sweep.table()["restored"].tolist() == ["", "1", "0-1"]


def test_restoration_in_place_equals_the_two_copy_sweep(model, rows, tmp_path):
    """Any order of restoration (here bottom-up, so each set adds a lower block), one stash shared by
    two calls: the same values as restoring blocks of a quantized copy, bit for bit."""
    from interp.localize.restoration import restoration_sweep
    from interp.quant.apply import quantize_cached

    before = _state(model)
    with WeightStash(model, tmp_path) as stash:
        folder = cached_variant(model, "rtn:bits=3,group=32", stash=stash, cache_dir=tmp_path, progress=False)
        weights = SavedWeights(folder, model)
        quantized = quantize_cached(model, "rtn:bits=3,group=32", cache_dir=tmp_path, progress=False)
        for order in (None, [0, 1]):
            one = restoration_sweep(weights, model, rows, order=order, batch_size=3, stash=stash)
            two = restoration_sweep(quantized, model, rows, order=order, batch_size=3)
            assert torch.equal(one.nll, two.nll) and torch.equal(one.reference_nll, two.reference_nll), order
            assert _same(model, before)
        assert float((one.nll[0] - one.nll[-1]).abs().min()) > 0  # restoring changed every example


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("spec", ["gptq:bits=3,group=64", "awq:bits=3,group=64"])
def test_bundled_model_layers_quantize_in_place_to_quantize_s_weights(smol, wiki_small, spec):
    """SmolLM2's first block (a 1-layer model with the bundled weights): in place equals the copy.
    The whole model's GPTQ-3 is compared in benchmarks/bench_memory.py (--check-weights)."""
    from transformers import AutoModelForCausalLM

    config = copy.copy(smol.original_model.config)
    config.num_hidden_layers = 1
    hf = AutoModelForCausalLM.from_config(config).eval()
    hf.load_state_dict(interp.models.canonical_state_dict(smol), strict=False)
    one_block = interp.load_model(hf, tokenizer=smol.tokenizer, name="smol-1-block")
    calibration = interp.Examples.from_tokens(wiki_small.tokens[:4, :32], ids=[f"c{i}" for i in range(4)])
    expected = qa.quantize(one_block, spec, calibration=calibration, progress=False)
    before = _state(one_block)
    with quantized_in_place(one_block, spec, calibration, progress=False):
        got, want = _linear(one_block, 0), _linear(expected, 0)
        assert all(torch.equal(got[r], want[r]) for r in want), spec
    assert _same(one_block, before)


def test_reversal_with_the_weights_alone_equals_the_copy(model, rows, tmp_path):
    """One copy: the quantized model's MLP outputs come from the reference carrying its weights."""
    import numpy as np
    import pandas as pd

    from interp.quant.analysis import reversal, split_large_ctrl

    before = _state(model)
    with WeightStash(model, tmp_path) as stash:
        folder = cached_variant(model, "rtn:bits=3,group=32", stash=stash, cache_dir=tmp_path, progress=False)
    split = split_large_ctrl(pd.Series(np.linspace(0, 1, len(rows)), index=rows.ids), rows, top=0.34)
    one = reversal(model, {"rtn3": SavedWeights(folder, model)}, split.large, split.ctrl, batch_size=2, n_boot=20,
                   progress=False)
    assert _same(model, before)
    quantized = qa.quantize_cached(model, "rtn:bits=3,group=32", cache_dir=tmp_path, progress=False)  # the copy
    two = reversal(model, {"rtn3": quantized}, split.large, split.ctrl, batch_size=2, n_boot=20, progress=False)
    pd.testing.assert_frame_equal(one.mse, two.mse, check_exact=True)
    pd.testing.assert_frame_equal(one.per_example, two.per_example, check_exact=True)
    assert float(one.mse["mse_large"].min()) > 0  # the quantized weights were really in place
