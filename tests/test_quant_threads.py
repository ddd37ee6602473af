"""No quantized weight depends on the torch thread count.

The quantized-model cache key (interp.quant.apply.cache_key) holds the CPU kernels but not the
thread count, so a model quantized on a one-core machine is served on a sixteen-core one. That is
right only if one thread and two make the same weights, bit for bit. HQQ's optimiser did not: with
two threads 14 of SmolLM2-135M's 210 block weights came out different (2,621 values, 2.5e-5 of
them); it now runs on one thread. Checked on the real model: every block weight for the
calibration-free methods, and GPTQ and AWQ on layer 0's q and down projections with their real
inputs on 8 x 128 calibration tokens.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

import interp
from interp.quant import quantize_weight
from interp.runtime import hooks
from interp.runtime.batching import torch_threads

pytestmark = pytest.mark.integration


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def test_one_thread_and_two_make_the_same_weights(smol):
    cal = interp.load_examples("wiki", smol.tokenizer, n=8, seq_len=128, seed=0, split="calibration")
    names = {role: hooks.linear_input_hook(smol, 0, role) for role in ("q", "down")}
    _, cache = smol.run_with_cache(cal.tokens, names_filter=list(names.values()))
    inputs = {role: cache[name].reshape(-1, cache[name].shape[-1]) for role, name in names.items()}
    slots = [(layer, role, slot) for layer in range(smol.info.n_layers)
             for role, slot in hooks.linear_weights(smol, layer).items()]

    def work() -> dict:
        out = {}
        for spec in ("rtn:bits=3,group=64", "nf:bits=3,group=64", "hqq:bits=3,group=64"):
            for layer, role, slot in slots:
                out[spec, layer, role] = _digest(quantize_weight(slot.read(), spec))
        for spec in ("gptq:bits=3,group=64", "awq:bits=3,group=64"):
            for role in inputs:
                out[spec, 0, role] = _digest(quantize_weight(hooks.linear_weights(smol, 0)[role].read(), spec,
                                                              inputs[role]))
        return out

    with torch_threads(1):
        assert torch.get_num_threads() == 1
        one = work()
    with torch_threads(2):
        assert torch.get_num_threads() == 2
        two = work()
    assert len(one) == 3 * len(slots) + 4
    assert [key for key in one if one[key] != two[key]] == []
