"""Results are checked before they are returned (issue 31): a saturated prediction, an attention mask with a
hole and a layer selected twice are refused with a clear error instead of returning a number.

The saturated case is the one the issue found: weights scaled to 1e30 are finite, yet the residual's
mean square overflows float32 in the final RMSNorm, which then returns zeros, so every logit is equal
and every NLL is exactly log V. Plain transformers is the independent witness: its own logits for that
model are equal across the vocabulary.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import interp
from interp.errors import ComponentError, DataError, NonFiniteError
from interp.localize.lens import early_exit
from interp.runtime.readout import SATURATED_ULPS, refuse_saturated
from interp.runtime.scoring import token_nll

V = interp.models.TINY_VOCAB


def _rows(n: int = 3, width: int = 8) -> interp.Examples:
    generator = torch.Generator().manual_seed(0)
    return interp.Examples.from_tokens(torch.randint(0, 256, (n, width), generator=generator))


@pytest.fixture(scope="module")
def scaled():
    """A tiny llama whose every weight is multiplied by 1e30: finite, and saturating."""
    model = interp.tiny_model("llama", seed=3)
    with torch.no_grad():
        for parameter in model.original_model.parameters():
            parameter.mul_(1e30)
    assert all(bool(torch.isfinite(p).all()) for p in model.original_model.parameters())
    return model


def test_the_scaled_model_really_predicts_uniformly(scaled):
    """The premise, from transformers alone: every logit of the scaled model is the same number."""
    with torch.no_grad():
        logits = scaled.original_model(input_ids=_rows().tokens).logits
    assert bool(torch.isfinite(logits).all()) and bool((logits.amax(-1) == logits.amin(-1)).all())


def test_nll_of_a_saturated_model_is_refused_and_says_where(scaled):
    with pytest.raises(NonFiniteError, match=r"uniform over all 259 tokens.*rows \[0, 1, 2\].*overflowed"):
        interp.nll(scaled, _rows())


def test_the_early_exit_lens_of_a_saturated_model_is_refused(scaled):
    with pytest.raises(NonFiniteError, match="uniform over all 259 tokens"):
        early_exit(scaled, _rows(), layers=[1])


def test_padded_rows_of_a_saturated_model_are_refused(scaled):
    rows = interp.examples_from_texts(["a short one", "a somewhat longer prompt"], scaled.tokenizer, padding="left")
    with pytest.raises(NonFiniteError, match="uniform"):
        interp.nll(scaled, rows)


def test_an_ordinary_model_passes_and_its_nll_is_far_from_the_uniform_value():
    model = interp.tiny_model("llama", seed=3)
    values = interp.nll(model, _rows()).double()
    with torch.no_grad():  # the same NLL from transformers' logits in float64, as an independent computation
        logits = model.original_model(input_ids=_rows().tokens).logits.double()
    tokens = _rows().tokens
    expected = -torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1).mean(1)
    # float32 forward vs float64 log-softmax: 1e-4 nats is ~1000 float32 ulps of a 5.6-nat value, far above
    # the rounding of a 2-layer forward, and far below the gap to log V the next line requires
    assert torch.allclose(values, expected, atol=1e-4, rtol=0)
    assert bool(((values - math.log(V)).abs() > 1e-3).all())


def test_the_threshold_is_float32_rounding_of_log_v():
    level = torch.tensor(math.log(V), dtype=torch.float32)  # log V rounded to float32: within half an ulp
    with pytest.raises(NonFiniteError):
        refuse_saturated(level.expand(2, 4).clone(), V)
    spacing = SATURATED_ULPS * torch.finfo(torch.float32).eps * math.log(V)
    near = level.double() + 4 * spacing  # four times the threshold away: a prediction, however flat
    refuse_saturated(near.expand(2, 4).clone(), V)
    one_real = level.expand(2, 4).clone()
    one_real[:, 2] = 4.0  # one target that is not uniform makes the row a measurement
    refuse_saturated(one_real, V)


def test_the_full_logits_scorer_refuses_equal_logits_too():
    tokens = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
    with pytest.raises(NonFiniteError, match="uniform"):
        token_nll(torch.full((2, 6, V), 7.5), tokens)
    values = token_nll(torch.randn(2, 6, V, generator=torch.Generator().manual_seed(2)), tokens)
    assert tuple(values.shape) == (2, 5)


# ---------------------------------------------------------------------------------------
# attention masks: one run of real tokens, padded on one side


@pytest.mark.parametrize("row", [[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 0, 1], [0, 0, 0, 0]])
def test_a_mask_with_a_hole_or_two_padded_sides_is_refused(row):
    rows = _rows(2, 4)
    mask = torch.tensor([[1, 1, 1, 1], row]).bool()
    with pytest.raises(DataError, match="'row1' has the attention mask"):
        dataclasses.replace(rows, attention_mask=mask)


def test_left_and_right_padding_pass():
    rows = _rows(4, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 0, 1]]).bool()
    assert torch.equal(dataclasses.replace(rows, attention_mask=mask).attention_mask, mask)
    for padding in ("left", "right"):
        texts = ["one", "a longer text here"]
        assert interp.examples_from_texts(texts, interp.models.tiny_tokenizer(), padding=padding).padded


# ---------------------------------------------------------------------------------------
# layers: each selected once


@pytest.mark.parametrize("layers", [[1, 1], [-1, 3], [0, -4]])
def test_a_layer_selected_twice_is_refused(layers):
    model = interp.tiny_model("llama", n_layers=4)
    with pytest.raises(ComponentError, match="selected twice"):
        early_exit(model, _rows(), layers=layers)
    with pytest.raises(ComponentError, match="selected twice"):
        interp.probe(model, _rows(), ["resid_post"], ["norm"], layers=layers)


def test_a_negative_layer_alone_is_the_layer_counted_from_the_end():
    model = interp.tiny_model("llama", n_layers=4)
    assert torch.equal(early_exit(model, _rows(), layers=[-1]).nll, early_exit(model, _rows(), layers=[3]).nll)
