"""The survival study's features stage (issue 48) on a tiny model: quality read against the registered bar, and the
survival rate against a naive per-latent count."""

from __future__ import annotations

import numpy as np
import torch

import interp
from interp.localize.sae import TopKSAE
from interp.localize.sae_metrics import latent_stats, sae_quality
from interp.quant.apply import quantize
from interp.report.survival.features import _bar_reading, feature_analysis
from interp.report.survival.registration import registration
from interp.report.survival.run import file_name
from interp.stats import Estimate

MODEL = "smollm2-135m"  # the roster's labels; the data below come from a tiny model


def _sae(d: int = 64, d_sae: int = 96, k: int = 8) -> TopKSAE:
    g = torch.Generator().manual_seed(0)
    w_dec = torch.randn(d_sae, d, generator=g)
    w_dec = w_dec / w_dec.norm(dim=1, keepdim=True)
    return TopKSAE(W_enc=w_dec.T.clone(), b_enc=torch.zeros(d_sae), W_dec=w_dec, b_dec=torch.zeros(d), k=k,
                   hook_name="blocks.1.hook_resid_post")


def test_bar_reading_uses_both_interval_ends():
    assert _bar_reading(Estimate(0.1, 0.05, 0.15), 0.2, "<=") == "met"
    assert _bar_reading(Estimate(0.3, 0.25, 0.35), 0.2, "<=") == "not met"
    assert _bar_reading(Estimate(0.2, 0.15, 0.25), 0.2, "<=") == "on the bar"
    assert _bar_reading(Estimate(0.9, 0.85, 0.95), 0.8, ">=") == "met"


def test_feature_analysis_counts_surviving_latents_as_a_naive_loop_does(tmp_path):
    model = interp.tiny_model("llama")
    tokens = torch.randint(0, 256, (12, 24), generator=torch.Generator().manual_seed(1))
    tokens[:, 0] = 256
    rows = interp.Examples.from_tokens(tokens)
    sae = _sae()
    folder = tmp_path / "features"
    folder.mkdir()
    for layer in (5, 15, 25):  # the registered layers name the files; the tiny SAE reads block 1 each time
        sae_quality(model, sae, rows).save(folder / f"quality-L{layer}.safetensors")
    label = "rtn:bits=3,group=64"
    quantized = quantize(model, "rtn:bits=3,group=32", progress=False)
    stats = latent_stats(sae, model, quantized, rows)
    stats.save(folder / f"{file_name(label)}-L5.safetensors")
    result = feature_analysis(tmp_path, MODEL, registration())
    assert len(result["quality"]) == 3 and set(result["quality"]["fvu_bar"]) <= {"met", "not met", "on the bar"}
    row = result["survival"].set_index(["method", "layer"]).loc[(label, 5)]
    # naive: per latent, over every position, correlation and firing rates from the two models' activations
    with torch.no_grad():
        _, a = model.run_with_cache(tokens, names_filter="blocks.1.hook_resid_post")
        _, b = quantized.run_with_cache(tokens, names_filter="blocks.1.hook_resid_post")
    za = sae.encode(a["blocks.1.hook_resid_post"][:, 1:].reshape(-1, 64)).double().numpy()
    zb = sae.encode(b["blocks.1.hook_resid_post"][:, 1:].reshape(-1, 64)).double().numpy()
    judged = (za > 0).sum(0) >= 20
    survive = []
    for j in np.flatnonzero(judged):
        fa, fb = (za[:, j] > 0).mean(), (zb[:, j] > 0).mean()
        rho = np.corrcoef(za[:, j], zb[:, j])[0, 1] if zb[:, j].std() > 0 else -1.0
        survive.append(rho >= 0.9 and 0.5 <= fb / fa <= 2)
    assert row["judged_latents"] == int(judged.sum()) > 0
    assert row["rate"] == np.mean(survive)
    assert row["rate_low"] <= row["rate"] <= row["rate_high"]
