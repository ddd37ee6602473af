"""non_finite_weights checks each weight a slice at a time (isfinite of a whole bfloat16 embedding took 0.47 GiB of
temporaries on a 1B model, the peak of ``interp circuit``); it must still find a NaN or inf anywhere in a weight."""

from __future__ import annotations

import pytest
import torch

import interp
import interp.runtime.batching as batching
from interp.runtime.batching import non_finite_weights


@pytest.mark.parametrize("chunk", [1, 5, 1 << 22])
@pytest.mark.parametrize("where", [0, -1, 1234])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_anywhere_in_a_weight_is_found(monkeypatch: pytest.MonkeyPatch, chunk: int, where: int,
                                                           value: float) -> None:
    monkeypatch.setattr(batching, "_FINITE_CHUNK", chunk)
    model = interp.tiny_model("llama", seed=0)
    assert non_finite_weights(model) == []
    weight = model.original_model.model.layers[1].mlp.down_proj.weight
    assert weight.numel() % 5 != 0  # the last slice of 5 is a short one
    weight.data.view(-1)[where] = value
    assert non_finite_weights(model) == ["model.layers.1.mlp.down_proj.weight"]


def test_bfloat16_weights() -> None:
    model = interp.tiny_model("llama", seed=0)
    model.original_model.to(torch.bfloat16)
    assert non_finite_weights(model) == []
    model.original_model.model.layers[0].self_attn.q_proj.weight.data.view(-1)[-1] = float("inf")
    assert non_finite_weights(model) == ["model.layers.0.self_attn.q_proj.weight"]
