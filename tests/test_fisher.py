"""The Fisher-weighted output error against an independent computation.

The implementation captures each linear's output gradient with a tensor hook during one backward
per batch and sums ``1/2 g² (ΔW x)²`` with one matrix product per option. Here the gradient comes
another way (a zero leaf added to one weight's output, differentiated with ``torch.autograd.grad``)
and the sum is a plain loop over examples and positions, in float64 throughout; the labels are the
same draws (same generator, same probabilities), so the two agree to float64 rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from interp.errors import InterpError
from interp.quant.fisher import fisher_sensitivity
from interp.runtime import hooks


def _options(layer, role, W):
    noise = torch.randn(W.shape, generator=torch.Generator().manual_seed(7 * layer + len(role)), dtype=W.dtype)
    return {"noise": W + 0.01 * noise, "grid": (W * 8).round() / 8}


def _naive(model, rows, layer, role, option, seed):
    native = hooks.native_model(model)
    module = next(m for m in native.modules() if isinstance(m, torch.nn.Linear)
                  and m.weight is hooks.linear_weights(model, layer)[role].module.weight)
    W = module.weight.detach()
    delta = _options(layer, role, W)[option] - W
    seen = {}

    def hook(mod, args, output):
        seen["x"] = args[0].detach()
        seen["z"] = torch.zeros_like(output, requires_grad=True)
        return output + seen["z"]

    handle = module.register_forward_hook(hook)
    try:
        embed = native.get_input_embeddings()(rows.tokens).detach().requires_grad_(True)
        logits = native(inputs_embeds=embed).logits[:, :-1]
    finally:
        handle.remove()
    probs = torch.softmax(logits.detach().reshape(-1, logits.shape[-1]), -1)
    drawn = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))
    logp = torch.log_softmax(logits, -1).reshape(-1, logits.shape[-1]).gather(1, drawn).sum()
    (grad,) = torch.autograd.grad(logp, seen["z"])
    total, count = 0.0, 0
    for b in range(rows.tokens.shape[0]):
        for t in range(rows.tokens.shape[1] - 1):
            error = delta @ seen["x"][b, t]
            total += 0.5 * float((grad[b, t] ** 2 * error ** 2).sum())
            count += 1
    return total / count


def test_fisher_score_equals_a_loop_over_tokens_with_autograd_gradients(model64, rows):
    result = fisher_sensitivity(model64, rows, _options, chunks=1, batch_size=len(rows), seed=3, progress=False)
    scores = result.scores()
    assert result.options[0] == ["noise", "grid"] and len(result.names) == 7 * hooks.n_layers(model64)
    for index in (0, 4, len(result.names) - 1):
        for o, option in enumerate(("noise", "grid")):
            want = _naive(model64, rows, result.layers[index], result.roles[index], option, seed=3)
            assert scores[index, o] == pytest.approx(want, rel=1e-10)
    assert (scores > 0).all()
    assert result.tokens.sum() == len(rows) * (rows.seq_len - 1)


def test_chunks_add_up_and_zero_error_scores_zero(model64, rows):
    def same(layer, role, W):
        return {"same": W.clone(), **_options(layer, role, W)}

    result = fisher_sensitivity(model64, rows, same, chunks=2, batch_size=2, seed=0, progress=False)
    assert (result.per_chunk[:, 0] == 0).all()  # no quantization error: nothing to pay
    np.testing.assert_allclose(result.scores(), result.per_chunk.sum(axis=2) / result.tokens.sum(), rtol=0)
    table = result.table()
    assert len(table) == 3 * len(result.names) and set(table.option) == {"same", "noise", "grid"}


def test_options_of_the_wrong_shape_and_too_few_examples_are_refused(model64, rows):
    with pytest.raises(InterpError, match="has shape"):
        fisher_sensitivity(model64, rows, lambda layer, role, W: {"bad": W[:, :-1]}, chunks=1, progress=False)
    with pytest.raises(InterpError, match="at least 8"):
        fisher_sensitivity(model64, rows, _options, chunks=8, progress=False)
