"""With every socket blocked, the whole pipeline runs: load, probe, quantize, score, patch, report.
Also: the same seed gives the same examples, calibration set and D_large/D_ctrl."""

from __future__ import annotations

import json

import pytest
import torch

import interp

pytestmark = pytest.mark.integration


def test_pipeline_runs_with_sockets_blocked(no_network, tmp_path):
    from interp.localize.patching import patch_component
    from interp.quant.apply import quantize
    from interp.quant.store import score
    from interp.report.run import ReportSettings, run_report

    model = interp.load_model("smollm2-135m")
    ex = interp.load_examples("wiki", model.tokenizer, n=4, seq_len=24)
    res = interp.probe(model, ex, ["resid_mid", "pattern"], ["norm", "entropy"], layers=[0, 29], progress=False)
    assert torch.isfinite(res["resid_mid", "norm"]).all()
    qmodel = quantize(model, "rtn:bits=3,group=64", progress=False)
    errors = score(model, ["rtn:bits=3,group=64"], ex, store=tmp_path / "s.sqlite", progress=False)
    assert errors.shape == (4, 1) and (errors.iloc[:, 0] > 0).mean() >= 0.5
    patched = patch_component(qmodel, model, ex, layers=[28, 29], component="down", batch_size=4, progress=False)
    assert patched.table().shape[0] == 2  # one row per patched layer
    settings = ReportSettings.quick(n=8, seq_len=24, attention_n=2)
    results = run_report(tmp_path / "report", settings, stages=["probes", "attention"], progress=False, static=False)
    assert set(results["stage_seconds"]) == {"probes", "attention"}
    assert (tmp_path / "report" / "index.html").is_file()


def test_same_seed_same_selection(smol):
    from interp.quant.analysis import split_large_ctrl

    a = interp.load_examples("wiki", smol.tokenizer, n=40, seq_len=32, seed=3)
    b = interp.load_examples("wiki", smol.tokenizer, n=40, seq_len=32, seed=3)
    assert a.ids == b.ids and torch.equal(a.tokens, b.tokens)
    cal_a = interp.load_examples("wiki", smol.tokenizer, n=16, seq_len=32, seed=3, split="calibration")
    cal_b = interp.load_examples("wiki", smol.tokenizer, n=16, seq_len=32, seed=3, split="calibration")
    assert cal_a.ids == cal_b.ids
    import pandas as pd

    errors = pd.Series(torch.linspace(0, 1, 40).tolist(), index=a.ids)
    s1 = split_large_ctrl(errors, a, seed=11)
    s2 = split_large_ctrl(errors, b, seed=11)
    assert s1.large.ids == s2.large.ids and s1.ctrl.ids == s2.ctrl.ids
    assert json.dumps(s1.to_dict(), sort_keys=True) == json.dumps(s2.to_dict(), sort_keys=True)
