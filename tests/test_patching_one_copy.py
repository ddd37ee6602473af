"""Cross-model patching with one copy of the weights: the quantized model given as its block weights
alone (interp.quant.inplace.SavedWeights), swapped into the reference per batch (interp.runtime.swap).

What is checked, each against an independent computation:

- the values equal the two-model path's (``patch(quantized_model, reference, ...)``) with
  ``torch.equal``: both run the same forwards, in the same order of operations, on weights that are
  equal bit for bit (SavedWeights holds the bytes ``save_quantized`` wrote from the quantized copy,
  and the copy's own weights are those bytes too), so there is no rounding to allow for. Float64 on
  the tiny model (as the engine's exactness tests), float32 on the bundled SmolLM2;
- the reference is bit-identical afterwards (``torch.equal`` on its whole state_dict), also when
  the run fails inside, with the variant's weights in place;
- ``swapped(..., roles=...)`` changes only the named roles (fused weights included) and refuses
  unknown roles before anything changes; the gate-restored NLL in place equals ``restore_layers``;
- nothing deep-copies a module, a shared stash writes each block once, and ``interp patch`` runs
  the table, gate-input and sweep experiments holding one copy.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import interp
from interp.errors import ComponentError, NonFiniteError
from interp.localize import patching as P
from interp.localize.patching import gate_restored_nll
from interp.localize.restoration import restore_layers
from interp.quant.apply import quantize, save_quantized
from interp.quant.inplace import SavedWeights
from interp.runtime import hooks, swap
from interp.runtime.swap import WeightStash, swapped

pytestmark = pytest.mark.usefixtures("one_thread")
SPEC = "rtn:bits=3,group=64"


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.original_model.state_dict().items()}


def _same(model, state) -> bool:
    now = model.original_model.state_dict()
    return now.keys() == state.keys() and all(torch.equal(now[k], state[k]) for k in state)


def _equal_results(a: P.PatchResult, b: P.PatchResult) -> None:
    assert torch.equal(a.values, b.values)
    assert torch.equal(a.target, b.target) and torch.equal(a.source, b.source)
    assert a.patches == b.patches and a.settings == b.settings


@pytest.fixture(scope="module")
def trio(one_thread, tmp_path_factory):
    """(reference, its quantized copy, the copy's block weights alone), tiny llama of 4 layers in float64."""
    reference = interp.tiny_model("llama", seed=0, n_layers=4).to(torch.float64)
    quantized = quantize(reference, SPEC, progress=False)
    folder = save_quantized(quantized, tmp_path_factory.mktemp("saved"))
    return reference, quantized, SavedWeights(folder, reference)


@pytest.fixture(scope="module")
def rows():
    tokens = torch.randint(0, 256, (5, 12), generator=torch.Generator().manual_seed(0))
    return interp.Examples.from_tokens(tokens, ids=[f"r{i}" for i in range(5)])


@contextlib.contextmanager
def one_copy(modules: bool = True) -> Iterator[None]:
    """Fail if anything deep-copies a torch module (the second copy of the weights) inside the block;
    ``modules=False``: only a whole model (a bridge), since loading a model copies its block bridges."""
    original = copy.deepcopy

    def guarded(obj, *args, **kwargs):
        if isinstance(obj, torch.nn.Module) and (modules or hasattr(obj, "original_model")):
            raise AssertionError(f"deep copy of a {type(obj).__name__}")
        return original(obj, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(copy, "deepcopy", guarded)
        yield


# ---------------------------------------------------------------------------------------
# The same values as two models


def test_block_weights_are_told_from_models(trio):
    reference, quantized, weights = trio
    assert swap.is_block_weights(weights) and not swap.is_block_weights(quantized)
    assert not swap.is_block_weights(reference)


def test_paper_experiments_equal_the_two_model_path(trio, rows):
    reference, quantized, weights = trio
    before = _state(reference)
    # batch_size 2 over 5 rows: three batches, the last one short, each swapping the weights in and out;
    # 4 rows a forward: the 5 joint patches need three windows
    engine = {"batch_size": 2, "max_rows": 4}
    sweep = {"components": ["down", "gate", "attn_out"], "layers": [0, 2, 3], **engine}

    def experiments(q):
        return (P.patching_table(reference, q, rows, **engine), P.layer_sweep(reference, q, rows, **sweep),
                P.gate_input_vs_gate_weights(reference, q, rows, layers=[1, 3], batch_size=2))

    two = experiments(quantized)
    with one_copy():
        one = experiments(weights)
    assert _same(reference, before)
    _equal_results(one[0], two[0])
    _equal_results(one[1], two[1])
    _equal_results(one[2].patched, two[2].patched)
    assert torch.equal(one[2].restored_nll, two[2].restored_nll) and one[2].layers == two[2].layers == [1, 3]
    assert one[2].table().equals(two[2].table())


def test_full_forwards_and_padded_rows_equal_the_two_model_path(trio, rows):
    """The engine's other two paths: full forwards (fast=False) and left-aligned padded rows."""
    reference, quantized, weights = trio
    before = _state(reference)
    jobs = P.single_layer_patches(["resid_pre", "head", "up"], [1, 2])
    slow = [P.patch(q, reference, rows, jobs, batch_size=3, fast=False) for q in (weights, quantized)]
    _equal_results(*slow)
    mask = torch.ones_like(rows.tokens, dtype=torch.bool)
    mask[1, :4] = False  # left padding in row 1, right padding in row 3
    mask[3, -3:] = False
    padded = dataclasses.replace(rows, attention_mask=mask)
    aligned = [P.patch(q, reference, padded, jobs, source_examples=rows, batch_size=2, metric="nll")
               for q in (weights, quantized)]
    _equal_results(*aligned)
    assert _same(reference, before)


@pytest.mark.integration
def test_bundled_model_float32_equals_the_two_model_path(smol, tmp_path):
    """SmolLM2 in float32 (its own dtype), 3 examples x 32 tokens: the same bits either way."""
    before = _state(smol)
    examples = interp.load_examples("wiki", smol.tokenizer, n=3, seq_len=32, seed=0)
    quantized = quantize(smol, SPEC, progress=False)
    weights = SavedWeights(save_quantized(quantized, tmp_path / "q"), smol)
    layers = [26, 28]
    one, two = (P.patching_table(smol, q, examples, layers=layers, components=["gate", "down"], batch_size=2)
                for q in (weights, quantized))
    _equal_results(one, two)
    del quantized
    assert _same(smol, before)


# ---------------------------------------------------------------------------------------
# The reference afterwards, and failures inside


class _FailingNLL(P.NLLMetric):
    """The NLL metric, failing on its ``fail_at``-th call (after the source's: the variant is in place)."""

    def __init__(self, model, reference_state, fail_at: int) -> None:
        self.model, self.reference_state, self.fail_at, self.calls = model, reference_state, fail_at, 0
        self.swapped_in = False

    def from_resid(self, readout, resid, tokens, index, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            self.swapped_in = not _same(self.model, self.reference_state)
            raise RuntimeError("inside the patched run")
        return super().from_resid(readout, resid, tokens, index, **kwargs)


@pytest.mark.parametrize("fail_at", [2, 4])  # the unpatched target metric of batch 1; a patched window of batch 1
def test_the_reference_comes_back_bit_for_bit_when_the_run_fails_inside(trio, rows, fail_at, tmp_path):
    reference, _, weights = trio
    before = _state(reference)
    metric = _FailingNLL(reference, before, fail_at)
    with WeightStash(reference, tmp_path) as stash:
        with pytest.raises(RuntimeError, match="inside the patched run"):
            P.patch(weights, reference, rows, P.single_layer_patches(["down"], [0, 3]), metric=metric,
                    batch_size=2, max_rows=2, stash=stash)
        assert metric.swapped_in  # it failed with the quantized weights in place
        assert _same(reference, before)
    with pytest.raises(RuntimeError, match="inside the patched run"):  # the call's own stash: deleted too
        P.patch(weights, reference, rows, P.single_layer_patches(["down"], [0]),
                metric=_FailingNLL(reference, before, fail_at), batch_size=2)
    assert _same(reference, before)


def test_non_finite_target_weights_are_refused_and_the_reference_restored(trio, rows):
    reference, _, weights = trio
    before = _state(reference)

    class Broken:
        def block(self, layer):
            values = weights.block(layer)
            if layer == 2:
                values["up"] = values["up"].clone()
                values["up"][0, 0] = float("nan")
            return values

    with pytest.raises(NonFiniteError, match=r"target's block weights have NaN/inf \(block 2 up\)"):
        P.patch(Broken(), reference, rows, [P.Patch("down", (3,))])
    assert _same(reference, before)


def test_a_shared_stash_writes_each_block_once(trio, rows, monkeypatch, tmp_path):
    reference, quantized, weights = trio
    written: list[str] = []
    real = swap.write_safetensors
    monkeypatch.setattr(swap, "write_safetensors",
                        lambda path, tensors, **kw: (written.append(Path(path).name), real(path, tensors, **kw)))
    jobs = P.single_layer_patches(["gate"], [2])
    with WeightStash(reference, tmp_path) as stash:
        # three batches in each call, two calls (as interp patch calls patch once per batch)
        results = [P.patch(weights, reference, rows, jobs, batch_size=2, stash=stash) for _ in range(2)]
    assert sorted(written) == [f"block{layer}.safetensors" for layer in range(4)]
    _equal_results(results[0], P.patch(quantized, reference, rows, jobs, batch_size=2))


# ---------------------------------------------------------------------------------------
# swapped(..., roles=...)


def test_swapping_some_roles_leaves_the_others(trio):
    reference, quantized, weights = trio
    before = _state(reference)
    own = {layer: {r: s.read().clone() for r, s in hooks.linear_weights(reference, layer).items()} for layer in (0, 1)}
    theirs = {r: s.read() for r, s in hooks.linear_weights(quantized, 1).items()}
    with swapped(reference, weights, layers=[1], roles=["up", "q"]):
        now = {layer: {r: s.read() for r, s in hooks.linear_weights(reference, layer).items()} for layer in (0, 1)}
        assert all(torch.equal(now[0][r], own[0][r]) for r in own[0])  # block 0 not named
        assert {r for r in now[1] if torch.equal(now[1][r], theirs[r])} == {"up", "q"}
        assert all(torch.equal(now[1][r], own[1][r]) for r in now[1] if r not in ("up", "q"))
    assert _same(reference, before)
    with pytest.raises(ComponentError, match="Unknown linear roles"), swapped(reference, weights, roles=["gate", "w"]):
        pass
    assert _same(reference, before)


def test_swapping_one_role_of_a_fused_weight_writes_its_rows_only():
    reference = interp.tiny_model("gpt2", seed=0)  # q, k and v in one Conv1D
    quantized = quantize(reference, "rtn:bits=3,group=32", progress=False)
    before = _state(reference)

    class Quantized:
        def block(self, layer):
            return {r: s.read() for r, s in hooks.linear_weights(quantized, layer).items()}

    with swapped(reference, Quantized(), layers=[0], roles=["k"]):
        now, theirs, own = (hooks.linear_weights(m, 0) for m in (reference, quantized, interp.tiny_model("gpt2")))
        assert torch.equal(now["k"].read(), theirs["k"].read())
        assert torch.equal(now["q"].read(), own["q"].read()) and torch.equal(now["v"].read(), own["v"].read())
    assert _same(reference, before)


def test_gate_restored_in_place_equals_restore_layers(trio, rows, tmp_path):
    reference, quantized, weights = trio
    before = _state(reference)
    copied = interp.nll(restore_layers(quantized, reference, [0, 2], roles=["gate"]), rows).double()
    with WeightStash(reference, tmp_path) as stash:
        in_place = gate_restored_nll(reference, weights, rows, [0, 2], stash=stash)
    assert torch.equal(in_place, copied)
    assert _same(reference, before)


# ---------------------------------------------------------------------------------------
# The command


def test_interp_patch_holds_one_copy(tmp_path, monkeypatch):
    """table, gate-input and sweep with no deep copy of a model (loading a quantized copy makes one)."""
    from interp.cli.main import main

    folder = tmp_path / "tiny"
    interp.models.export_hf(interp.tiny_model("llama", seed=0), folder)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi pi rho sigma tau".split()
    rng = random.Random(0)
    (tmp_path / "docs.txt").write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(40)) for _ in range(20)))
    monkeypatch.setenv("INTERP_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    with one_copy(modules=False):
        assert main(["patch", "--model", str(folder), "--data", str(tmp_path / "docs.txt"), "--n", "8", "--seq-len",
                     "16", "--batch-size", "4", "--top", "0.5", "--layers", "all", "--quiet",
                     "--experiments", "table,gate-input,sweep", "--out", str(out)]) == 0
    for name in ("patching_table.csv", "gate_input_vs_weights.csv", "layer_sweep.csv"):
        assert (out / name).stat().st_size > 0
    assert not list(out.glob("interp-stash-*"))  # the stash is gone
