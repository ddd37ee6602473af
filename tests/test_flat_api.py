"""The common verbs one dot away: each flat name is the function at its deep path, and deep paths still work."""

from __future__ import annotations

import importlib

import pytest

import interp

FLAT = {
    "quantize": ("interp.quant.apply", "quantize"),
    "score": ("interp.quant.store", "score"),
    "patch": ("interp.localize.patching.engine", "patch"),
    "logit_lens": ("interp.localize.lens", "early_exit"),
    "analyze_attention": ("interp.attention.analysis", "analyze"),
    "probe": ("interp.probes", "probe"),
    "nll": ("interp.runtime.scoring", "nll"),
    "load_model": ("interp.models", "load_model"),
}


@pytest.mark.parametrize("name", sorted(FLAT))
def test_flat_name_is_the_deep_function(name):
    module, attribute = FLAT[name]
    assert getattr(interp, name) is getattr(importlib.import_module(module), attribute)
    assert name in interp.__all__


def test_report_is_callable_and_still_the_package(tmp_path, monkeypatch):
    import interp.report.run  # a deep import rebinds interp.report to the package: it must stay callable

    assert interp.report.run_report is interp.report.run.run_report
    seen = {}

    def fake_run(out, settings, progress=None, static=True):
        seen.update(out=out, settings=settings, static=static)
        return {"ok": True}

    monkeypatch.setattr(interp.report, "run_report", fake_run)
    assert interp.report(tmp_path, quick=True, n=12, static=False) == {"ok": True}
    assert seen["settings"].n == 12 and seen["settings"].seq_len == 32 and seen["static"] is False


def test_report_rejects_an_unknown_setting_before_running(tmp_path):
    from interp.errors import InterpError

    with pytest.raises(InterpError, match="Unknown report setting.*nn"):
        interp.report(tmp_path, nn=3)
    assert not any(tmp_path.iterdir())


def test_unknown_flat_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'quantise'"):
        interp.quantise  # noqa: B018
