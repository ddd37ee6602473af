"""weights_digest hashes each weight a slice at a time (one float32 copy of a whole embedding was the peak
memory of every command on a 1B bfloat16 model); the digest must stay the whole tensors' float32 bytes."""

from __future__ import annotations

import hashlib

import pytest
import torch

import interp
import interp.models as models
from interp.models import canonical_state_dict, weights_digest


def _whole_tensor_digest(model: object) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(canonical_state_dict(model).items()):
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("elements", [1, 5, 7, 64, 1 << 22])  # 5, 7 and 64 cut rows; 1 << 22 is the default
def test_sliced_digest_is_the_whole_tensors_digest(monkeypatch: pytest.MonkeyPatch, elements: int) -> None:
    model = interp.tiny_model("llama", seed=0)
    monkeypatch.setattr(models, "_DIGEST_ELEMENTS", elements)
    assert weights_digest(model) == _whole_tensor_digest(model)


def test_sliced_digest_sees_the_last_value_of_a_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    model = interp.tiny_model("llama", seed=0)
    monkeypatch.setattr(models, "_DIGEST_ELEMENTS", 5)
    before = weights_digest(model)
    weight = model.original_model.lm_head.weight.data
    weight.view(-1)[-1] += 1.0  # the tail of the last slice of a weight whose size is no multiple of 5
    assert weight.numel() % 5 != 0
    assert weights_digest(model) != before


def test_bfloat16_weights_hash_as_their_float32_values() -> None:
    model = interp.tiny_model("llama", seed=0)
    model.original_model.to(torch.bfloat16)
    assert weights_digest(model) == _whole_tensor_digest(model)
