"""The least-squares tuned lens: the closed-form fit against numpy's solver, caching, and decoding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tolerances import EPS32

from interp.data import Examples
from interp.localize.tuned_lens import RIDGE, TunedLens, capture_layers, fit_tuned_lens, tuned_early_exit


@pytest.fixture(scope="module")
def rows(tiny_llama):
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 256, (12, 24), generator=generator)
    tokens[:, 0] = tiny_llama.info.bos_id
    return Examples.from_tokens(tokens)


def test_fit_matches_numpy_ridge_solution(tiny_llama, rows) -> None:
    lens = fit_tuned_lens(tiny_llama, rows, batch_size=5, progress=False)
    d = tiny_llama.cfg.d_model
    resids, final = capture_layers(tiny_llama, rows.tokens, lens.layers)
    y = final[:, 1:].reshape(-1, d).double().numpy()
    for i, r in enumerate(resids):
        x = np.concatenate([r[:, 1:].reshape(-1, d).double().numpy(), np.ones((y.shape[0], 1))], axis=1)
        gram = x.T @ x
        lam = RIDGE * np.diag(gram)[:d].mean()
        reg = gram + np.diag(np.r_[np.full(d, lam), 0.0])
        naive = np.linalg.solve(reg, x.T @ y)
        # the fit accumulates the Gram matrix in float64 over batches and stores float32: agreement to
        # float32 rounding of the solution (2^-24 relative) times the system's conditioning, well under 1e-4
        scale = np.abs(naive).max()
        assert np.abs(lens.weight[i].double().numpy() - naive[:d]).max() < 1e-4 * scale
        assert np.abs(lens.bias[i].double().numpy() - naive[d]).max() < 1e-4 * scale
    assert len(lens.settings["r2_by_layer"]) == len(lens.layers)
    assert all(r2 <= 1 + 1e-9 for r2 in lens.settings["r2_by_layer"])


def test_round_trip_and_decoding(tiny_llama, rows, tmp_path) -> None:
    lens = fit_tuned_lens(tiny_llama, rows, progress=False)
    path = lens.save(tmp_path / "lens.safetensors")
    back = TunedLens.load(path)
    assert torch.equal(back.weight, lens.weight) and torch.equal(back.bias, lens.bias)
    assert back.layers == lens.layers and back.settings == lens.settings
    result = tuned_early_exit(tiny_llama, back, rows, batch_size=4)
    assert tuple(result.nll.shape) == (len(lens.layers), len(rows))
    assert torch.isfinite(result.nll).all()
    # every decoding is a proper distribution over the vocabulary: NLL is positive
    assert float(result.nll.min()) > 0
    assert math.isfinite(float(result.layer_mean().mean()))


def test_too_few_tokens_is_a_clear_error(tiny_llama) -> None:
    from interp.errors import InterpError

    few = Examples.from_tokens(torch.randint(2, 256, (2, 8)))
    with pytest.raises(InterpError, match="calibration tokens"):
        fit_tuned_lens(tiny_llama, few, progress=False)


def test_exit_decodes_the_fitted_positions_only(tiny_llama, rows) -> None:
    """tuned_early_exit against a naive float64 loop: the mean over targets 2..T-1, read at the
    positions the fit used (BOS, excluded from the fit, is not decoded: on SmolLM2 its residual
    is ~200x larger from layer 10 on and its single prediction cost 800-1,900 nats)."""
    lens = fit_tuned_lens(tiny_llama, rows, progress=False)
    result = tuned_early_exit(tiny_llama, lens, rows, batch_size=5)
    resids, _ = capture_layers(tiny_llama, rows.tokens, lens.layers)
    W = tiny_llama.original_model.get_output_embeddings().weight.detach().double()
    T, d = rows.tokens.shape[1], tiny_llama.cfg.d_model
    for i, r in enumerate(resids):
        for b in range(len(rows)):
            total, largest = 0.0, 0.0
            for t in range(1, T - 1):
                y = r[b, t].double() @ lens.weight[i].double() + lens.bias[i].double()
                logits = W @ y
                largest = max(largest, float(logits.abs().max()))
                total += float(torch.logsumexp(logits, 0) - logits[rows.tokens[b, t + 1]])
            naive = total / (T - 2)
            # The exit runs in float32: two chained d-term products (translator, head), each off by
            # at most d * EPS32 relative to the sum of |terms|, bounded here by the largest logit, and
            # the log-sum-exp moves by at most the largest logit error, twice (it and the target's);
            # the stored NLL is float32 too (EPS32 relative).
            tol = 2 * 2 * d * EPS32 * max(1.0, largest) + EPS32 * abs(naive)
            assert abs(float(result.nll[i, b]) - naive) <= tol, (i, b)
