"""Calibration for GPTQ and AWQ on padded examples: no pad position enters a statistic.

A padded calibration batch is left-aligned and cut to its longest row, and each linear
layer's inputs are read at the real positions only (:class:`interp.quant.calibration.LayerFeeder`).
The reference is every row run alone, unpadded: GPTQ's Hessian ``X^T X`` and AWQ's
``mean |x|`` are sums (means) over tokens, so they are well defined for rows of different
lengths.

The transformer-lens bridge computes the attention softmax in float32 whatever the model's
dtype (``AttentionBridge._masked_softmax(..., dtype=torch.float32)``), and a float32 softmax
over a row with extra masked keys rounds differently (measured: up to 4.8e-7 on the o, down
and next block's inputs between a 54-wide padded batch and a 9-token row alone). So that
"the same" can mean 1e-10, that softmax runs in float64 for float64 input here
(``tests/float64_attention.py``, installed by conftest.py); everything else is the library's
code as it runs.

Two levels, on a tiny llama in float64:

* statistics: the inputs of every linear layer of every block on the padded batch equal the
  concatenation of each row's inputs alone. Read in float64 (the feeder's float32 cast
  patched out), they agree to 1e-10 (EXACT, as in tests/test_padding.py: float64 forwards
  differ by ~1e-15 between batch shapes), and so do ``X^T X`` and ``mean |x|``.
* weights: ``quantize`` with the padded batch equals ``quantize`` with one row per batch,
  which with the cut is each row alone, unpadded (checked bit for bit below). The quantizers
  read the inputs cast to float32. Two float64 values ``delta`` apart (|delta| <= 1e-13
  relative here) cast to different float32 only when a float32 rounding midpoint lies
  between them: a chance of about ``2 delta / 2^-23`` ~ 2e-6 per entry. Where no entry flips,
  X is the same float32 matrix, every statistic and every rounding decision is computed by
  the same operations on the same numbers, and the quantized weights are identical to the bit;
  the tests check that the float32 inputs are identical (a flipped entry would fail them
  loudly rather than pass with a tolerance), then demand ``torch.equal`` of the weights.
"""

from __future__ import annotations

import pytest
import torch
from padding_rows import TEXTS, row_alone

from interp.data import Examples, examples_from_texts
from interp.quant import apply as qa
from interp.quant import calibration as qc
from interp.runtime import hooks

pytestmark = pytest.mark.numerical  # derived tolerances: CI reruns this file with one thread

EXACT = 1e-10  # float64 end to end, see the module docstring
SPECS = ["gptq:bits=4,group=32", "awq:bits=4,group=32,grid=5"]


def _groups(model) -> list[list[str]]:
    slots = hooks.linear_weights(model, 0)
    return [roles for group in qa.SHARED_INPUT_GROUPS if (roles := [r for r in group if r in slots])]


def _float64_rows(x, keep=None):
    """The feeder's row reader without its float32 cast (for the float64 statistic check)."""
    x = x.detach()
    real = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]) if keep is None else x[keep]
    return real.reshape(real.shape[0], -1).double().cpu()


def _all_inputs(feeder, model, paused: bool) -> list[torch.Tensor]:
    """Every group's inputs in every block, the weights left as they are, by re-running or by pausing."""
    out = []
    for layer in range(hooks.n_layers(model)):
        groups = _groups(model)
        if paused:
            with feeder.paused(layer, groups) as block:
                out += [block.inputs(index) for index in range(len(groups))]
                outputs = block.outputs()
        else:
            out += [feeder.inputs(layer, roles[0]) for roles in groups]
            outputs = None
        feeder.advance(layer, outputs)
    return out


@pytest.mark.parametrize("paused", [False, True])
@pytest.mark.parametrize("side", ["right", "left"])
def test_calibration_statistics_of_padded_rows_equal_each_row_alone(model64, tok, side, paused, monkeypatch):
    ex = examples_from_texts(TEXTS, tok, padding=side)
    assert ex.padded
    lengths = ex.attention_mask.sum(dim=1)
    monkeypatch.setattr(qc, "_rows", _float64_rows)
    batched = _all_inputs(qc.LayerFeeder(model64, ex.tokens, 3, mask=ex.attention_mask), model64, paused)
    alone = [_all_inputs(qc.LayerFeeder(model64, row_alone(ex, i).tokens, 1), model64, paused) for i in range(len(ex))]
    worst = {"X": 0.0, "gram": 0.0, "abs_mean": 0.0}
    for index, X in enumerate(batched):
        reference = torch.cat([rows[index] for rows in alone])
        assert X.shape == reference.shape and X.shape[0] == int(lengths.sum())  # real tokens only, in row order
        worst["X"] = max(worst["X"], float((X - reference).abs().max()))
        gram, gram_ref = X.T @ X, reference.T @ reference
        worst["gram"] = max(worst["gram"], float(((gram - gram_ref).abs() / gram_ref.abs().max()).max()))
        worst["abs_mean"] = max(worst["abs_mean"], float((X.abs().mean(0) - reference.abs().mean(0)).abs().max()))
    assert max(worst.values()) < EXACT, worst


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_one_row_batch_is_the_row_alone(model64, tok, side):
    """Cut to its longest row, a padded one-row batch is exactly the unpadded row: the weight-level reference."""
    ex = examples_from_texts(TEXTS, tok, padding=side)
    padded = _all_inputs(qc.LayerFeeder(model64, ex.tokens, 1, mask=ex.attention_mask), model64, paused=False)
    alone = [_all_inputs(qc.LayerFeeder(model64, row_alone(ex, i).tokens, 1), model64, paused=False)
             for i in range(len(ex))]
    for index, X in enumerate(padded):
        assert torch.equal(X, torch.cat([rows[index] for rows in alone]))


def _weights(qmodel) -> dict[str, torch.Tensor]:
    return {f"{layer}.{role}": slot.read().detach().clone() for layer in range(hooks.n_layers(qmodel))
            for role, slot in hooks.linear_weights(qmodel, layer).items()}


def _recording(monkeypatch) -> list[torch.Tensor]:
    """Record every group's float32 inputs as quantize hands them to the quantizers."""
    seen: list[torch.Tensor] = []
    original = qa._layer_inputs

    def record(X, spec):
        seen.append(X.clone())
        return original(X, spec)

    monkeypatch.setattr(qa, "_layer_inputs", record)
    return seen


@pytest.mark.parametrize("spec", SPECS)
def test_quantized_weights_from_padded_calibration_equal_rows_alone(model64, tok, spec, monkeypatch):
    seen = _recording(monkeypatch)
    reference = qa.quantize(model64, spec, calibration=examples_from_texts(TEXTS, tok, padding="right"),
                            progress=False, batch_size=1)  # one row per batch: each row alone, unpadded
    expected_inputs, expected = list(seen), _weights(reference)
    for side in ("right", "left"):
        seen.clear()
        ex = examples_from_texts(TEXTS, tok, padding=side)
        got = _weights(qa.quantize(model64, spec, calibration=ex, progress=False, batch_size=3))
        # the float32 inputs are the same matrices (see the module docstring), so the weights are the same bits
        assert len(seen) == len(expected_inputs)
        assert all(torch.equal(a, b) for a, b in zip(seen, expected_inputs, strict=True))
        assert all(torch.equal(got[k], expected[k]) for k in expected), side
    # the same ids without the mask (pads counted as tokens) give other weights: the mask matters here
    seen.clear()
    unmasked = _weights(qa.quantize(model64, spec, calibration=Examples.from_tokens(ex.tokens), progress=False,
                                    batch_size=3))
    assert any(not torch.equal(unmasked[k], expected[k]) for k in expected)


@pytest.mark.parametrize("spec", SPECS)
def test_left_and_right_padding_quantize_alike(model64, tok, spec):
    """Left-aligned, a left- and a right-padded batch are the same token rows: the same weights, with the
    bridge's float32 softmax as it is."""
    weights = [_weights(qa.quantize(model64, spec, calibration=examples_from_texts(TEXTS, tok, padding=side),
                                    progress=False, batch_size=3)) for side in ("left", "right")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_padded_calibration_has_its_own_cache_key(model64, tok):
    right = examples_from_texts(TEXTS, tok, padding="right")
    unmasked = Examples.from_tokens(right.tokens)
    assert qa.examples_hash(right) != qa.examples_hash(unmasked)
    assert qa.cache_key(model64, SPECS[0], right) != qa.cache_key(model64, SPECS[0], unmasked)
    same = examples_from_texts(["abcd", "efgh"], tok)  # equal lengths: no padding, hashed as plain token rows
    assert qa.examples_hash(same) == qa.examples_hash(Examples.from_tokens(same.tokens))
