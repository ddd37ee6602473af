"""The notebooks: each runs top to bottom on the real model (quick settings), and the outputs stored
with it in the repository are what it prints and draws today.

The notebooks are stored executed (``notebooks/execute.py``, ``make notebooks``) so that a code host
shows their tables and figures. ``test_notebook_outputs_are_current`` executes each one as that script
does and compares the fresh outputs with the stored ones under :func:`normalise` and
:func:`outputs_differ`, a rule that ignores what legitimately changes between runs and machines.
The fast tests check the stored files (executed, a PNG beside every figure, small) and that the rule
does catch a changed output.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MAX_BYTES = 1_000_000
PLOTLY = "application/vnd.plotly.v1+json"
WIDGET = "application/vnd.jupyter.widget-view+json"
VARIES_TAG = "output-varies"

slow = [pytest.mark.notebook, pytest.mark.integration, pytest.mark.slow]


def _load(name: str, file: str):
    """A module of notebooks/ loaded by path (notebooks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "notebooks" / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runner():
    """notebooks/execute.py, the refresh script."""
    return _load("notebooks_execute", "execute.py")


# -- the comparison rule (notebooks/rule.py, shared with the refresh script) ------------------------

_rule = _load("notebooks_rule", "rule.py")
mask, normalise, numbers_agree, outputs_differ, differ = (_rule.mask, _rule.normalise, _rule.numbers_agree,
                                                           _rule.outputs_differ, _rule.differ)
noise_numbers = _rule.noise_numbers
_text_differs = _rule._text_differs


# -- the stored notebooks (fast) -------------------------------------------------------------------


def _read(path):
    import nbformat

    return nbformat.read(path, as_version=4)


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_probes.ipynb", "02_attention_entropy_gtd.ipynb", "03_saobp.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_notebook_is_executed_and_small(path):
    """Executed top to bottom in one kernel, a PNG beside every figure, no plotly.js, under 1 MB."""
    nb = _read(path)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), \
        f"{path.name} is not stored executed top to bottom: run `make notebooks`"
    outputs = [o for c in code for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    figures = [o for o in outputs if PLOTLY in o.get("data", {})]
    assert figures, f"{path.name} stores no figure"
    assert all("image/png" in o.data for o in figures), "a figure without its PNG (GitHub shows only the PNG)"
    assert not [o for o in outputs if WIDGET in o.get("data", {})]
    html = "".join(str(o.get("data", {}).get("text/html", "")) for o in outputs)
    assert "plotly.js" not in html and "Plotly.newPlot" not in html, "plotly.js embedded: use the execute.py renderer"
    assert path.stat().st_size < MAX_BYTES, f"{path.name} is {path.stat().st_size} bytes"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_notebook_prints_a_rounding_residual(path):
    """By construction, not by list: no stored output (full size or quick record) prints a number that can
    only be float32 rounding (nonzero, below notebooks/rule.py's NOISE_FLOOR). Such a number differs on
    every CPU, so no record could pin it; a check prints "within its bound" instead."""
    runner = _runner()
    stored = noise_numbers(normalise(_read(path), png=False))
    assert not stored, f"{path.name} prints rounding residuals {stored[:3]}: print whether they are within a bound"
    record = runner.record_path(path)
    if record.exists():  # a missing record fails test_stored_outputs_mean_something
        import json

        quick = noise_numbers(json.loads(record.read_text()))
        assert not quick, f"{record.name} holds rounding residuals {quick[:3]}"


def test_noise_guard_catches_a_printed_residual():
    assert noise_numbers([[("stream", "stdout", "largest |residual| 1.9e-06, mean 3.529")]]) == ["1.9e-06"]
    assert noise_numbers([[("data", ("text/plain",), "lr 0.000203 loss 0.0 gap 1e-4")]]) == []


def test_rule_ignores_what_changes_between_runs():
    assert mask("scored in 183 s at 0x7f3a2c0d1e50") == mask("scored in 7 s at 0x55d1c0ffee00")
    assert mask("name='/tmp/interp-byom-5ou8y9t2'") == mask("name='/tmp/interp-byom-x1y2z3w4'")
    assert mask("run 2025-11-30 21:32:05.123 took 120 ms") == mask("run 2026-01-02 08:00:00.5 took 3 min")
    warning = "{}/interp/stats.py:{}: RuntimeWarning: Mean of empty slice"
    assert mask(warning.format("/work/main", 172)) == mask(warning.format("/home/ci/src", 180))
    assert mask("/usr/lib/python3/site-packages/torch/x.py:9: W") == "<site-packages>/torch/x.py:<line>: W"
    assert mask("probe:  40%|####      | 2/5 [00:01<00:02, 1.2ex/s]\nresult 1") == "result 1"
    assert numbers_agree("133.794006", "133.794113")  # float32 noise
    assert numbers_agree("0.123", "0.124")  # one rounding unit
    assert numbers_agree("5.54606819152832", "5.546071")
    assert numbers_agree("1076679.734", "1076681.12")
    assert numbers_agree("nan", "NaN") and numbers_agree("-0.000", "0.000")
    assert not numbers_agree("22", "23")  # a layer index
    assert not numbers_agree("0.123", "0.126")
    assert not numbers_agree("2.997", "3.120")
    assert _text_differs("   a   1.000\n0  b  22.5", "  a 1.0001\n0 b 22.50") is None
    assert _text_differs("split from layer 22", "split from layer 21")
    assert _text_differs("gate 0.85", "gate 0.85 extra")


def _alter_number(o) -> bool:  # one printed number 10% larger
    text = o.get("data", {}).get("text/plain") if o.output_type == "execute_result" else None
    match = re.search(r"\d+\.\d+", text or "")
    if not match:
        return False
    o.data["text/plain"] = text[:match.start()] + f"{float(match.group()) * 1.1:.3f}" + text[match.end():]
    return True


def _alter_word(o) -> bool:
    if o.output_type != "stream" or "layer" not in o.text:
        return False
    o.text = o.text.replace("layer", "block", 1)
    return True


def _alter_trace_name(o) -> bool:
    if PLOTLY not in o.get("data", {}):
        return False
    o.data[PLOTLY]["data"][0]["name"] = "renamed"
    return True


def _alter_trace_length(o) -> bool:
    if PLOTLY not in o.get("data", {}):
        return False
    o.data[PLOTLY]["data"][0]["x"] = list(o.data[PLOTLY]["data"][0]["x"])[:-1]
    return True


def _drop_png(o) -> bool:
    return o.get("data", {}).pop("image/png", None) is not None


def _other_png(o) -> bool:  # other PNG bytes: not compared
    if "image/png" not in o.get("data", {}):
        return False
    o.data["image/png"] = o.data["image/png"][::-1]
    return True


def _altered(nb, change):
    """A copy of ``nb`` with the first output that ``change`` accepts changed by it."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if change(output):
                return nb
    raise AssertionError(f"nothing for {change.__name__} to alter")


@pytest.mark.parametrize("change", [_alter_number, _alter_word, _alter_trace_name, _alter_trace_length, _drop_png],
                         ids=lambda f: f.__name__.strip("_"))
def test_rule_detects_a_changed_stored_output(change):
    """The comparison can fail: each kind of alteration of a stored notebook is caught."""
    stored = _read(next(p for p in NOTEBOOKS if p.name.startswith("05")))
    assert outputs_differ(stored, copy.deepcopy(stored)) == []
    assert outputs_differ(stored, _altered(stored, change)), f"{change.__name__} went unnoticed"


def test_rule_detects_a_missing_output_and_ignores_png_bytes():
    stored = _read(next(p for p in NOTEBOOKS if p.name.startswith("05")))
    cut = copy.deepcopy(stored)
    next(c for c in cut.cells if c.cell_type == "code" and c.outputs).outputs.pop()
    assert outputs_differ(stored, cut)
    assert outputs_differ(stored, _altered(stored, _other_png)) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_outputs_mean_something(path):
    """Stored at the notebook's own size (at least 32 examples where it takes examples), said in its first
    cell, with no warning printed, and belonging to its code and its quick record (the fingerprint)."""
    runner = _runner()
    nb = _read(path)
    n = runner.default_n(nb)
    assert n is None or n >= 32, f"{path.name} stores results on {n} examples; use at least 32"
    assert nb.metadata.get("interp", {}).get("examples") == n
    first = next(c for c in nb.cells if c.cell_type == "markdown")
    assert runner.settings_line(nb) in first.source, f"{path.name}'s first cell does not say its settings"
    streams = [o.text for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if o.output_type == "stream"]
    warned = [line for text in streams for line in text.splitlines() if re.search(r"\w+Warning\b", line)]
    assert not warned, f"{path.name} stores warnings: {warned[:2]}"
    record = runner.record_path(path)
    assert record.exists(), f"{path.name} has no quick record: run `make notebooks`"
    assert nb.metadata["interp"]["fingerprint"] == runner.fingerprint(nb, record.read_text()), \
        f"{path.name}: its code or its quick record changed since its outputs were stored: run `make notebooks`"


def test_fingerprint_changes_with_the_code_and_the_record():
    runner = _runner()
    nb = _read(NOTEBOOKS[0])
    record = runner.record_path(NOTEBOOKS[0]).read_text()
    base = runner.fingerprint(nb, record)
    edited = copy.deepcopy(nb)
    next(c for c in edited.cells if c.cell_type == "code").source += "\n# edited"
    assert runner.fingerprint(edited, record) != base
    assert runner.fingerprint(nb, record.replace("1", "2", 1)) != base


def test_stream_interleaving_does_not_matter():
    """The flake of the previous round: the same prints and warnings, interleaved differently."""
    import nbformat

    def cell(*outputs):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell("x", outputs=[nbformat.v4.new_output("stream", name=n, text=t)
                                                            for n, t in outputs])]
        return nb

    a = cell(("stdout", "a 1\n"), ("stderr", "note\n"), ("stdout", "b 2\n"))
    b = cell(("stderr", "note\n"), ("stdout", "a 1\nb 2\n"))
    assert outputs_differ(a, b) == []
    assert outputs_differ(a, cell(("stdout", "a 1\nb 3\n"), ("stderr", "note\n"))) != []


# -- execution (slow) ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
@pytest.mark.notebook
@pytest.mark.integration
@pytest.mark.slow
def test_notebook_outputs_are_current(path, smol):
    """Executes the notebook at the quick size, as notebooks/execute.py does for its record, and compares with
    the stored record (notebooks/quick/); the stored full-size outputs are tied to that record by the
    fingerprint (test_stored_outputs_mean_something)."""
    import json

    runner = _runner()
    fresh = runner.execute(path)
    code = [c for c in fresh.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}" if errors else ""
    assert [o for c in code for o in c.get("outputs", []) if PLOTLY in o.get("data", {})], \
        "the notebook showed no figure"
    record = json.loads(runner.record_path(path).read_text())
    problems = differ(record, normalise(fresh, png=False))
    assert not problems, (f"{path.name}: the stored outputs are stale; refresh with `make notebooks` "
                          "(notebooks/execute.py):\n  " + "\n  ".join(problems))


@pytest.mark.notebook
@pytest.mark.integration
@pytest.mark.slow
def test_record_holds_with_two_threads_and_the_cpus_own_kernels(smol):
    """The records are made with one thread and torch/MKL/oneDNN pinned to AVX2; CI's CPU may run two
    threads and its own (AVX-512) kernels. The circuits notebook (many float32 reductions; the one whose
    printed residual broke the suite on an AVX-512 machine) executed that way must still agree with its
    record under the same rule. test_notebook_outputs_are_current covers one thread and AVX2."""
    import json

    runner = _runner()
    path = next(p for p in NOTEBOOKS if p.name.startswith("07"))
    native = {name: None for name in runner.KERNELS}
    fresh = runner.execute(path, OMP_NUM_THREADS="2", INTERP_NB_THREADS="2", **native)
    record = json.loads(runner.record_path(path).read_text())
    problems = differ(record, normalise(fresh, png=False))
    assert not problems, f"{path.name} with 2 threads and native kernels:\n  " + "\n  ".join(problems)
