"""Analyses of per-example quantization error (interp.quant.analysis), checked against direct computations."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch
from scipy import stats as sps
from tolerances import rounding_tol

import interp
from interp import stats as istats
from interp.errors import InterpError
from interp.figures import draw
from interp.quant import analysis
from interp.quant import apply as qa
from interp.runtime import hooks

EPS64 = float(np.finfo(np.float64).eps)
EPS32 = float(np.finfo(np.float32).eps)
U32 = EPS32 / 2

# The float32 model's activations are read twice, by the library (batched its own way) and by
# capture() below. A row's forward does not depend on the other rows of its batch (the same
# kernels reduce over the same features in the same order), so both read the same float32
# activations; what may differ is how they are reduced, which the tolerances below bound.


def _tol(n_terms, scale, eps=EPS64):
    """:func:`tolerances.rounding_tol` with this file's working precision."""
    return rounding_tol(n_terms, scale, eps)


def _corr_tol(n):
    """Two float64 evaluations of a Pearson r of n pairs (e.g. numpy's corrcoef and scipy's pearsonr).

    Centring rounds each deviation once (an error in the mean cancels to first order because the
    deviations sum to 0); the covariance then takes a product and n - 1 additions of terms whose
    magnitudes add up to <= n sd_x sd_y (Cauchy-Schwarz), each variance the same, and the square
    root and quotient a few more: at most 3 n + 9 roundings relative to |r| <= 1.
    """
    return _tol(3 * n + 9, 1.0)


def _json_safe(obj) -> None:
    json.dumps(obj, allow_nan=False)


@pytest.fixture(scope="module")
def model():
    return interp.tiny_model("llama", seed=0, n_layers=2)


@pytest.fixture(scope="module")
def examples():
    g = torch.Generator().manual_seed(3)
    return interp.Examples.from_tokens(torch.randint(0, 256, (24, 16), generator=g), ids=[f"e{i}" for i in range(24)])


# ---------------------------------------------------------------------------------------
# agreement


def _synthetic_errors(n=200, seed=0):
    rng = np.random.default_rng(seed)
    hardness = rng.gamma(2.0, size=n)
    cols = {"a": hardness + rng.normal(0, 0.2, n), "b": hardness + rng.normal(0, 0.5, n),
            "c": rng.normal(size=n)}
    return pd.DataFrame(cols, index=[f"x{i}" for i in range(n)])


def test_agreement_matches_direct_computations():
    errors = _synthetic_errors()
    result = analysis.agreement(errors, n_boot=200, seed=1)
    for a in errors:
        for b in errors:
            n = len(errors)
            assert result.pearson.r.loc[a, b] == pytest.approx(sps.pearsonr(errors[a], errors[b]).statistic,
                                                               abs=_corr_tol(n))
            assert result.spearman.r.loc[a, b] == pytest.approx(sps.spearmanr(errors[a], errors[b]).statistic,
                                                                abs=_corr_tol(n))
            top_a = set(errors[a].nlargest(20).index)
            top_b = set(errors[b].nlargest(20).index)
            # one division of the same two integers: the same double
            assert result.jaccard.loc[a, b] == len(top_a & top_b) / len(top_a | top_b)
    pairs = [("a", "b"), ("a", "c"), ("b", "c")]
    mean_r = np.mean([sps.pearsonr(errors[x], errors[y]).statistic for x, y in pairs])
    summary = result.mean_off_diagonal("pearson")
    # three r's, each within _corr_tol(200) of scipy's, averaged (3 more roundings of values <= 1)
    assert summary["mean"] == pytest.approx(mean_r, abs=_corr_tol(200) + _tol(3, 1.0))
    assert summary["low"] < mean_r < summary["high"]
    # the same function of the same arguments (top 10% of 200 is 20): the same double
    assert result.chance_jaccard == istats.expected_random_jaccard(200, 20)
    assert result.pearson.r.loc["a", "b"] > 0.8 and abs(result.pearson.r.loc["a", "c"]) < 0.2
    frame = result.to_frame()
    assert len(frame) == 3 and set(frame.columns) >= {"pearson_low", "spearman_high", "jaccard_top"}
    _json_safe(result.to_dict())
    fig = draw(result)
    assert isinstance(fig, go.Figure) and sum(isinstance(t, go.Heatmap) for t in fig.data) == 3


def test_agreement_needs_two_specs():
    with pytest.raises(InterpError, match="at least 2 specs"):
        analysis.agreement(_synthetic_errors()[["a"]])


# ---------------------------------------------------------------------------------------
# D_large / D_ctrl


def test_split_dedups_the_top_set_and_samples_controls_from_the_bottom_half():
    rng = np.random.default_rng(0)
    n = 50
    tokens = torch.tensor(rng.integers(0, 5000, size=(n, 40)))
    tokens[:, 0] = 1  # BOS
    tokens[1, 1:] = tokens[0, 1:]  # e1 duplicates e0 (a higher-error example)
    tokens[3, 1:36] = tokens[2, 1:36]  # e3 shares most 5-grams with e2
    ids = [f"e{i}" for i in range(n)]
    ex = interp.Examples.from_tokens(tokens, ids=ids)
    errors = pd.Series(np.linspace(1.0, 0.0, n), index=ids)  # e0 highest
    result = analysis.split_large_ctrl(errors, ex, top=0.10, dedup=0.1, seed=3)
    assert result.large_ids == ["e0", "e2", "e4"] and result.dropped_ids == ["e1", "e3"]
    assert len(result.ctrl_ids) == 3 and len(set(result.ctrl_ids)) == 3
    bottom = set(errors.nsmallest(25).index)
    assert set(result.ctrl_ids) <= bottom
    assert torch.equal(result.large.tokens, tokens[[0, 2, 4]])
    assert result.ctrl.ids == result.ctrl_ids
    again = analysis.split_large_ctrl(errors, ex, top=0.10, dedup=0.1, seed=3)
    assert again.ctrl_ids == result.ctrl_ids
    other = {tuple(analysis.split_large_ctrl(errors, ex, seed=s).ctrl_ids) for s in range(6)}
    assert len(other) > 1  # the seed matters
    frame = result.to_frame()
    assert (frame["set"] == "large").sum() == 3 and (frame["set"] == "duplicate").sum() == 2
    _json_safe(result.to_dict())
    assert isinstance(draw(result), go.Figure)


def test_split_uses_the_row_mean_of_a_frame(examples):
    frame = pd.DataFrame({"s1": np.arange(24.0), "s2": -np.arange(24.0) * 0.5}, index=examples.ids)
    result = analysis.split_large_ctrl(frame, examples, top=0.25, dedup=1.0)
    assert result.large_ids == ["e23", "e22", "e21", "e20", "e19", "e18"]


# ---------------------------------------------------------------------------------------
# residual norm vs error


def capture(model, tokens, names):
    kept = {}

    def keeper(name):
        def keep(x, hook):
            kept[name] = x.detach().clone()

        return keep

    with torch.no_grad(), model.hooks(fwd_hooks=[(n, keeper(n)) for n in names]):
        model.original_model(input_ids=tokens)
    return kept


def test_norm_error_correlation_matches_direct_norms(model, examples):
    names = [f"blocks.{layer}.hook_resid_mid" for layer in range(2)] + ["blocks.1.hook_resid_post"]
    acts = capture(model, examples.tokens, names)
    norms = {name: acts[name][:, 1:].norm(dim=-1).mean(dim=1).double().numpy() for name in names}
    rng = np.random.default_rng(0)
    last = norms["blocks.1.hook_resid_mid"]
    errors = pd.Series(-last + rng.normal(0, 0.2 * last.std(), 24), index=examples.ids)
    result = analysis.norm_error_correlation(model, examples, errors[::-1], n_boot=100, progress=False)
    table = result.to_frame().set_index(["component", "layer"])
    # The probe reduces the same float32 activations with the same ops (norm over d, mean over
    # positions), so the norms agree and r differs only by two float64 evaluations (_corr_tol);
    # the mean norm by two float64 means of 24 values.
    for layer in range(2):
        expected = sps.pearsonr(norms[f"blocks.{layer}.hook_resid_mid"], errors.to_numpy()).statistic
        assert table.loc[("resid_mid", layer), "r"] == pytest.approx(expected, abs=_corr_tol(24))
        assert table.loc[("resid_mid", layer), "mean_norm"] == pytest.approx(
            norms[f"blocks.{layer}.hook_resid_mid"].mean(), rel=_tol(24 + 1, 1.0))
    post = sps.pearsonr(norms["blocks.1.hook_resid_post"], errors.to_numpy()).statistic
    assert table.loc[("resid_post", 1), "r"] == pytest.approx(post, abs=_corr_tol(24))
    assert table.loc[("resid_mid", 1), "r"] < -0.9
    assert result.last_layer()["resid_mid"]["layer"] == 1
    _json_safe(result.to_dict())
    assert isinstance(draw(result), go.Figure)


# ---------------------------------------------------------------------------------------
# reversal


@pytest.fixture(scope="module")
def reversal_result(model, examples):
    quantized = {"rtn3": qa.quantize(model, "rtn:bits=3,group=32", progress=False),
                 "rtn4": qa.quantize(model, "rtn:bits=4,group=32", progress=False)}
    large, ctrl = examples.subset(range(0, 8)), examples.subset(range(8, 14))
    result = analysis.reversal(model, quantized, large, ctrl, batch_size=3, n_boot=100, n_outliers=3,
                               progress=False)
    return result, quantized, large, ctrl


def test_reversal_norms_kurtosis_and_mse_match_direct_computation(model, reversal_result):
    result, quantized, large, ctrl = reversal_result
    names = [f"blocks.{layer}.{p}" for layer in range(2) for p in ("hook_resid_mid", "mlp.hook_in", "hook_mlp_out")]
    for set_name, ex in (("large", large), ("ctrl", ctrl)):
        ref = capture(model, ex.tokens, names)
        for layer in range(2):
            r = ref[f"blocks.{layer}.hook_resid_mid"][:, 1:]
            h = ref[f"blocks.{layer}.mlp.hook_in"][:, 1:]
            row = result.by_layer.set_index("layer").loc[layer]
            # The same float32 norms of the same rows; the library means them over the T positions
            # in float32 (T roundings of positive values) and over examples in float64, this test in
            # float64.
            n_pos, d = r.shape[1], r.shape[2]
            mean_rel = _tol(n_pos, 1.0, EPS32) + _tol(r.shape[0] * n_pos, 1.0)
            assert row[f"r_norm_{set_name}"] == pytest.approx(r.norm(dim=-1).double().mean().item(), rel=mean_rel)
            assert row[f"h_norm_{set_name}"] == pytest.approx(h.norm(dim=-1).double().mean().item(), rel=mean_rel)
            kurt = sps.kurtosis(r.double().numpy(), axis=-1, fisher=False, bias=True).mean(axis=1).mean()
            # The library's float32 kurtosis m4 / m2^2 per position: m2 and m4 take d + 3 and d + 7
            # roundings, the ratio 3 more (3 d + 15 in all, relative); the float32 mean's error
            # (<= (d + 1) u mean|x|) moves m4 by <= 4 |d mean| / sd relative to first order (Hoelder;
            # m2 only to second order), so (d + 1) 4 a with a = max mean|x| / sd over positions; then
            # T roundings for its float32 mean over positions. scipy works in float64 (negligible: 2).
            a = float((r.abs().mean(-1) / r.std(-1, unbiased=False)).max())
            kurt_rel = U32 * (3 * d + 15 + 4 * (d + 1) * a + n_pos + 2)
            assert row[f"kurtosis_{set_name}"] == pytest.approx(kurt, rel=kurt_rel)
            # ||h||^2 = d * sum_i (r_i^2 / sum_j r_j^2) gamma_i^2 (RMSNorm, eps aside)
            gamma = hooks.norm2_gamma(model, layer)
            share = r.pow(2) / r.pow(2).sum(-1, keepdim=True)
            predicted = (r.shape[-1] * (share * gamma.pow(2)).sum(-1)).sqrt()
            eps = model.original_model.config.rms_norm_eps  # with eps the relation is exact
            exact = ((r.pow(2) * gamma.pow(2)).sum(-1) / (r.pow(2).mean(-1) + eps)).sqrt()
            # Rounding, float32 both: the model's RMSNorm (mean of d squares, + eps, rsqrt, two
            # products) and the norm of h (d squares and sums, sqrt halving their error) take
            # <= (d + 6) u relative; `exact` (d + 4) u: (2 d + 10) u = (d + 5) eps in all.
            exact_rtol = _tol(d + 5, 1.0, EPS32)
            torch.testing.assert_close(h.norm(dim=-1), exact, rtol=exact_rtol, atol=0)
            # Dropping eps (not rounding) scales the norm by sqrt((ms + eps) / ms), ms = mean r^2.
            eps_gap = math.sqrt(1 + eps / float(r.pow(2).mean(-1).min())) - 1
            torch.testing.assert_close(h.norm(dim=-1), predicted, rtol=eps_gap + exact_rtol, atol=0)
        for spec, qmodel in quantized.items():
            quant = capture(qmodel, ex.tokens, names)
            for layer in range(2):
                diff = quant[f"blocks.{layer}.hook_mlp_out"][:, 1:] - ref[f"blocks.{layer}.hook_mlp_out"][:, 1:]
                expected = diff.pow(2).mean(dim=(1, 2)).double().mean().item()
                row = result.mse.set_index(["spec", "layer"]).loc[(spec, layer)]
                # the library's per-example float32 means are these (same op, same rows); only the
                # float64 means over the examples may sum in another order
                assert row[f"mse_{set_name}"] == pytest.approx(expected, rel=_tol(len(ex) + 1, 1.0))
    assert (result.mse["mse_large"] > 0).all()


def test_reversal_correlation_and_outliers(model, reversal_result):
    result, quantized, large, ctrl = reversal_result
    per = result.per_example
    for (spec, layer), row in result.mse.set_index(["spec", "layer"]).iterrows():
        rows = per[per["layer"] == layer]
        expected = sps.pearsonr(rows["h_norm"], rows[f"mse[{spec}]"]).statistic
        assert row["corr_h_mse"] == pytest.approx(expected, abs=_corr_tol(len(rows)))
    both = torch.cat([large.tokens, ctrl.tokens])
    acts = capture(model, both, [f"blocks.{layer}.hook_resid_mid" for layer in range(2)])
    for layer in range(2):
        mean_abs = acts[f"blocks.{layer}.hook_resid_mid"][:, 1:].abs().mean(dim=1).mean(dim=0)
        top = torch.argsort(mean_abs, descending=True)[:3].tolist()
        rows = result.outliers[result.outliers["layer"] == layer].sort_values("rank")
        assert rows["dim"].tolist() == top
        gamma = hooks.norm2_gamma(model, layer).abs()
        for dim, pct in zip(rows["dim"], rows["gamma_percentile"], strict=True):
            # count / d, one correctly rounded division of the same integers: the same double
            assert pct == (gamma < gamma[dim]).double().mean().item()
    wide = result.to_frame()
    assert len(wide) == 2 and "corr_h_mse[rtn3]" in wide.columns
    _json_safe(result.to_dict())
    for kind in ("norms", "mse_corr", "kurtosis", "outliers"):
        assert isinstance(draw(result, kind=kind), go.Figure)
    with pytest.raises(InterpError, match="Unknown reversal figure"):
        draw(result, kind="nope")
