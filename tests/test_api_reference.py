"""The API reference builds, every public name carries a runnable example, and results
show themselves in notebooks (``summary()`` DataFrames, ``_repr_html_``, progress bars)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import sys
import types
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import interp
from interp.display import ResultDisplay

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_PACKAGES = ("interp", "interp.attention", "interp.quant")
RESULT_MODULES = ("interp.probes", "interp.attention.analysis", "interp.localize.lens", "interp.localize.restoration",
                  "interp.localize.patching.results", "interp.localize.patching.attribution",
                  "interp.localize.patching.experiments", "interp.quant.analysis.agreement",
                  "interp.quant.analysis.split", "interp.quant.analysis.norms", "interp.quant.analysis.reversal")


def _build_api():
    spec = importlib.util.spec_from_file_location("build_api", ROOT / "docs" / "build_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def restored_packages():
    """The build binds each lazily exported name on its package; undo that after the test, or a later
    test's ``monkeypatch.setattr(interp.models, "load_model", ...)`` would miss ``interp.load_model``."""
    before = {name: set(vars(importlib.import_module(name))) for name in PUBLIC_PACKAGES}
    yield
    for name, keys in before.items():
        module = importlib.import_module(name)
        for added in set(vars(module)) - keys:
            if added in getattr(module, "__all__", []) and not isinstance(getattr(module, added), type(module)):
                delattr(module, added)


@pytest.mark.slow
def test_api_reference_builds_with_every_reference_resolved(tmp_path, restored_packages):
    problems = _build_api().build(tmp_path)
    assert problems == []
    for page in ("index.html", "interp.html", "interp/quant/apply.html", "interp/attention/metrics.html"):
        assert (tmp_path / page).is_file(), page
    # The lazily exported names are documented on the package page.
    assert 'id="load_examples"' in (tmp_path / "interp.html").read_text()


def test_unresolved_finds_a_reference_left_as_code(tmp_path):
    build_api = _build_api()
    page = tmp_path / "interp" / "probes.html"
    page.parent.mkdir()
    page.write_text('<div class="docstring"><p>See <code><a href="lens.html">interp.localize.lens</a></code>, '
                    "<code>interp.no_such_module</code>, <code>probe()</code> and <code>x + 1</code>.</p></div>")
    found = build_api.unresolved(tmp_path)
    # interp.no_such_module is a project path; probe() is a :func: role target somewhere in the package.
    assert found == ["interp/probes.html: interp.no_such_module", "interp/probes.html: probe()"]


def _public_objects():
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if not inspect.ismodule(obj):
                yield f"{package}.{name}", obj


@pytest.mark.parametrize("name, obj", list(_public_objects()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_public_name_has_a_docstring_example(name, obj):
    assert ">>>" in (inspect.getdoc(obj) or ""), f"{name} has no runnable example in its docstring"


def _result_classes():
    for module_name in RESULT_MODULES:
        module = importlib.import_module(module_name)
        for name, cls in vars(module).items():
            if (inspect.isclass(cls) and dataclasses.is_dataclass(cls) and cls.__module__ == module_name
                    and name.endswith(("Result", "Curves", "Comparison"))):
                yield cls


def test_every_result_class_has_summary_and_html():
    classes = list(_result_classes())
    assert len(classes) >= 12
    for cls in classes:
        assert issubclass(cls, ResultDisplay), cls.__name__
        annotation = inspect.signature(cls.summary).return_annotation
        assert annotation in ("pd.DataFrame", pd.DataFrame), (cls.__name__, annotation)


def _small_results():
    from interp.attention.analysis import AttentionResult
    from interp.localize.lens import EarlyExitResult
    from interp.localize.restoration import RestorationResult
    from interp.quant.analysis import NormCorrelationResult, ReversalResult, SplitResult

    ids = ["a", "b", "c"]
    yield EarlyExitResult(torch.ones(2, 3), [0, 1], ids, "resid_post", {"model": "tiny"})
    yield RestorationResult([0, 1], [[], [1]], torch.ones(2, 3), torch.zeros(3), ids)
    metrics = {"entropy": 1.0, "entropy_norm": 0.5, "gtd": 0.2, "sink_share": 0.1, "effective_span": 2.7}
    yield AttentionResult(pd.DataFrame([{"variant": "reference", "layer": layer, "head": head, **metrics}
                                        for layer in (0, 1) for head in (0, 1)]))
    yield NormCorrelationResult(pd.DataFrame({"component": ["resid_post"], "layer": [0], "r": [0.3]}))
    examples = interp.Examples.from_tokens(torch.arange(12).reshape(3, 4), ids=ids)
    yield SplitResult(examples.subset([0]), examples.subset([2]), pd.Series([3.0, 2.0, 1.0], index=ids), [])
    by_layer = pd.DataFrame({"layer": [0, 1], "r_norm_large": [1.0, 2.0], "r_norm_ctrl": [2.0, 1.0],
                             "h_norm_large": [1.0, 1.0], "h_norm_ctrl": [2.0, 2.0],
                             "kurtosis_large": [3.0, 3.0], "kurtosis_ctrl": [4.0, 4.0]})
    mse = pd.DataFrame({"spec": ["rtn3"] * 2, "layer": [0, 1], "mse_large": [0.1, 0.2], "mse_ctrl": [0.1, 0.1],
                        "corr_h_mse": [0.7, 0.9], "corr_low": [0.5, 0.8], "corr_high": [0.8, 0.95]})
    outliers = pd.DataFrame({"layer": [1], "rank": [0], "gamma_percentile": [0.2]})
    yield ReversalResult(by_layer, mse, outliers, pd.DataFrame())


@pytest.mark.parametrize("result", list(_small_results()), ids=lambda r: type(r).__name__)
def test_summary_is_a_dataframe_and_html_is_an_offline_table(result):
    summary = result.summary()
    assert isinstance(summary, pd.DataFrame) and len(summary) > 0
    html = result._repr_html_()
    assert type(result).__name__ in html and "<table" in html
    assert "<script" not in html and "http" not in html  # offline: nothing fetched, no JavaScript


def test_reversal_summary_table_and_headline_agree():
    result = list(_small_results())[-1]
    row = result.summary().iloc[0]
    head = result.headline()
    assert row["spec"] == "rtn3" and row["corr_h_mse_upper_above_0.6"] == head["corr_h_mse_upper_above_0.6"]["rtn3"]
    assert row["r_norm_large_below_ctrl"] == 1 and np.isclose(row["corr_h_mse_upper_mean"], 0.9)  # one upper layer


def test_progress_bars_on_in_a_jupyter_kernel(monkeypatch):
    from interp.runtime.batching import in_notebook, show_progress

    class NoTerminal:
        def isatty(self) -> bool:
            return False

    monkeypatch.setattr(sys, "stderr", NoTerminal())
    fake = types.ModuleType("IPython")
    monkeypatch.setitem(sys.modules, "IPython", fake)
    fake.get_ipython = lambda: None  # type: ignore[attr-defined]  # plain Python with IPython importable
    assert not in_notebook() and not show_progress(None)
    fake.get_ipython = lambda: types.SimpleNamespace(kernel=object())  # type: ignore[attr-defined]
    assert in_notebook() and show_progress(None)
    assert not show_progress(False)  # an explicit choice wins
    fake.get_ipython = lambda: types.SimpleNamespace()  # type: ignore[attr-defined]  # terminal IPython
    assert not show_progress(None)


def test_attention_package_names_match_the_trainable_module():
    """interp.attention lists the trainable module's names without importing it (transformers is
    slow to load); the copy must stay equal to the module's own __all__."""
    import interp.attention as attention
    from interp.attention import trainable

    assert set(attention._TRAINABLE) | {"ATTN_IMPLEMENTATION"} == set(trainable.__all__)
