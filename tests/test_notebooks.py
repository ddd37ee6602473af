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

import base64
import copy
import importlib.util
import math
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MAX_BYTES = 1_000_000
PLOTLY = "application/vnd.plotly.v1+json"
WIDGET = "application/vnd.jupyter.widget-view+json"
VARIES_TAG = "output-varies"

slow = [pytest.mark.notebook, pytest.mark.integration, pytest.mark.slow]


def _runner():
    """notebooks/execute.py, the refresh script, loaded by path (notebooks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("notebooks_execute", ROOT / "notebooks" / "execute.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the comparison rule ---------------------------------------------------------------------------

REL_TOL = 5e-3  # "about 3 significant digits"
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|\bnan\b|\bNaN\b|[-+]?\binf\b")
_TMP = "|".join(re.escape(t) for t in sorted({"/tmp", tempfile.gettempdir()}, key=len, reverse=True))
_MASKS = [
    # where the code lives, as a warning prints it: /work/main/interp/stats.py:172 -> <repo>/interp/stats.py:<line>
    # (first: a checkout under the temporary folder, /tmp/ci/interp/..., is still the repository)
    (re.compile(r"(?:/[^\s/:'\"]+)+/(?=(?:interp|tests|notebooks)/)"), "<repo>/"),
    # temporary folders (tempfile.mkdtemp names are random): /tmp/interp-byom-5ou8y9t2 -> <tmp>
    (re.compile(rf"(?:{_TMP})/[^\s'\",)\]}}]+"), "<tmp>"),
    (re.compile(r"(?:/[^\s/:'\"]+)+/site-packages/"), "<site-packages>/"),
    (re.compile(r"\.py:\d+"), ".py:<line>"),
    # timestamps: 2025-11-30 21:32:05.123, 21:32:05
    (re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?"), "<time>"),
    (re.compile(r"\b\d{1,2}:\d{2}:\d{2}(?:\.\d+)?\b"), "<time>"),
    # memory addresses: <object at 0x7f3a...>
    (re.compile(r"\b0x[0-9a-fA-F]{6,}\b"), "<address>"),
    # durations: 12 s, 0.35s, 120 ms, 3 min, 2.5 seconds
    (re.compile(r"[-+]?\d+(?:\.\d+)?\s?(?:ns|us|µs|ms|s|sec|secs|seconds?|min|minutes?|hours?)\b"), "<duration>"),
]
# a progress bar (tqdm): 42%|####      | 21/50 [00:03<00:04, 6.1it/s]
_PROGRESS = re.compile(r"\d+%\||\d+(?:\.\d+)?\s?(?:it|ex|s)/(?:s|it|ex)\b|\[\d+:\d+<")


def mask(text: str) -> str:
    """``text`` with progress-bar lines dropped and temporary paths, code locations, timestamps,
    durations and memory addresses replaced by placeholders (see :func:`normalise`)."""
    lines = []
    for line in text.replace("\r\n", "\n").split("\n"):
        line = line.rsplit("\r", 1)[-1]  # a line redrawn with \r: keep what it shows last
        if _PROGRESS.search(line):
            continue
        for pattern, placeholder in _MASKS:
            line = pattern.sub(placeholder, line)
        lines.append(line)
    return "\n".join(lines)


def _figure(spec: dict) -> tuple:
    """A plotly figure as (title, ((trace type, trace name, data lengths), ...)): its structure, not its values."""
    def length(value):
        if isinstance(value, dict) and "bdata" in value:  # plotly's typed array: dtype, base64, "rows, cols"
            if value.get("shape"):
                return tuple(int(n) for n in str(value["shape"]).split(","))
            return (len(base64.b64decode(value["bdata"])) // np.dtype(value["dtype"]).itemsize,)
        if isinstance(value, list):
            return (len(value),) + (length(value[0])[:1] if value and isinstance(value[0], list) else ())
        return ()

    layout = spec.get("layout", {})
    title = layout.get("title", "")
    title = title.get("text", "") if isinstance(title, dict) else title
    traces = tuple((t.get("type", "scatter"), str(t.get("name", "")),
                    tuple((k, length(t[k])) for k in ("x", "y", "z") if k in t))
                   for t in spec.get("data", []))
    return str(title), traces


def _text(value: str, varies: bool) -> str:
    value = mask(value)
    return _NUMBER.sub("<n>", value) if varies else value


def normalise(nb, png: bool = True) -> list[list[tuple]]:
    """Per code cell, its outputs in a form that is the same on every run and machine.

    The rule (what two executions of a notebook must agree on):

    * Stream outputs of one kind (stdout, stderr) that follow each other are joined (how a print
      is split into messages depends on timing). Rich outputs keep their order and their set of
      mimetypes (``image/png`` dropped with ``png=False``, for a run without Chromium).
    * Text (streams, ``text/plain``, figure titles and trace names) goes through :func:`mask`:
      progress-bar lines are dropped; temporary folders, the checkout's and site-packages' paths
      and line numbers (``<repo>/interp/stats.py:<line>`` in a warning), timestamps, durations and
      memory addresses become placeholders. ``text/html`` is not compared: it holds the same table as
      ``text/plain``. Progress-bar widgets are not compared (``notebooks/execute.py`` drops them).
    * Numbers in the text are compared by :func:`numbers_agree` in :func:`outputs_differ`, not
      here: to about 3 significant digits. Reductions in float32 (norms, means, matrix products)
      add in an order that depends on the CPU's vector width and the thread count, so the last
      digits of a printed float differ between machines; the suite must pass on any x86-64 CPU
      with 1 or 2 threads. A tolerance, rather than rounding both to 3 digits, because rounding
      splits neighbours (0.12349 and 0.12351).
    * A figure is compared by its structure (:func:`_figure`: title, trace types and names, data
      lengths), not by its values (those are in the tables) nor by its PNG (Chromium builds draw
      text and antialias differently, so the bytes differ).
    * A cell tagged ``output-varies`` (cell metadata ``tags``) shows something that is not a
      function of the inputs (a wall-clock time printed without unit, a cache state): its text is
      compared with every number masked.
    * Execution counts, cell and output metadata are ignored; an error is compared by its name.
    """
    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        varies = VARIES_TAG in cell.get("metadata", {}).get("tags", [])
        out: list[tuple] = []
        for o in cell.get("outputs", []):
            if o.output_type == "stream":
                if out and out[-1][0] == "stream" and out[-1][1] == o.name:
                    out[-1] = ("stream", o.name, out[-1][2] + o.text)
                else:
                    out.append(("stream", o.name, o.text))
            elif o.output_type == "error":
                out.append(("error", o.ename))
            else:
                data = o.get("data", {})
                if WIDGET in data:
                    continue
                keys = tuple(sorted(k for k in data if png or k != "image/png"))
                if PLOTLY in data:
                    title, traces = _figure(data[PLOTLY])
                    body = (_text(title, varies),
                            tuple((kind, _text(name, varies), shape) for kind, name, shape in traces))
                else:
                    body = _text(data.get("text/plain", ""), varies)
                out.append(("data", keys, body))
        cells.append([("stream", o[1], _text(o[2], varies)) if o[0] == "stream" else o for o in out])
    return cells


def _decimals(token: str) -> int | None:
    mantissa = re.split(r"[eE]", token)[0]
    return len(mantissa.split(".")[1]) if "." in mantissa else None


def numbers_agree(a: str, b: str) -> bool:
    """Two printed numbers agree to about 3 significant digits.

    ``|x - y| <= 5e-3 * max(|x|, |y|)``, plus one unit in the last printed place when both carry a
    decimal point (``0.123`` and ``0.124`` may be one value rounded on either side). Integers get
    no such unit: a layer index or a count must match exactly unless it is large.
    """
    if a == b:
        return True
    x, y = float(a), float(b)
    if math.isnan(x) or math.isnan(y) or math.isinf(x) or math.isinf(y):
        return (math.isnan(x) and math.isnan(y)) or x == y
    da, db = _decimals(a), _decimals(b)
    unit = 0.0
    if da is not None and db is not None:
        exponent = int(re.split(r"[eE]", a)[1]) if re.search(r"[eE]", a) else 0
        unit = 10.0 ** (exponent - min(da, db))
    return abs(x - y) <= REL_TOL * max(abs(x), abs(y)) + unit * (1 + 1e-9)


def _text_differs(old: str, new: str) -> str | None:
    """Why two masked texts differ (None when they agree): same words, numbers within tolerance."""
    words_old, words_new = _NUMBER.split(old), _NUMBER.split(new)
    squash = [" ".join(w.split()) for w in words_old], [" ".join(w.split()) for w in words_new]
    if squash[0] != squash[1]:
        for p, q in zip(*squash, strict=False):
            if p != q:
                return f"text differs: {p!r} became {q!r}"
        return f"text differs: {len(squash[0])} pieces became {len(squash[1])}"
    for p, q in zip(_NUMBER.findall(old), _NUMBER.findall(new), strict=True):
        if not numbers_agree(p, q):
            return f"number differs: {p} became {q}"
    return None


def _value_differs(old, new) -> str | None:
    if isinstance(old, str) and isinstance(new, str):
        return _text_differs(old, new)
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        for p, q in zip(old, new, strict=True):
            why = _value_differs(p, q)
            if why:
                return why
        return None
    return None if old == new else f"{old!r} became {new!r}"


def outputs_differ(stored, fresh, png: bool = True) -> list[str]:
    """Where the outputs of two executions of a notebook differ under the rule of :func:`normalise`:
    one line per differing code cell (an empty list when they agree)."""
    a, b = normalise(stored, png), normalise(fresh, png)
    if len(a) != len(b):
        return [f"{len(a)} code cells became {len(b)}"]
    problems = []
    for i, (old, new) in enumerate(zip(a, b, strict=True), start=1):
        if len(old) != len(new):
            problems.append(f"code cell {i}: {len(old)} outputs became {len(new)}")
            continue
        for j, (p, q) in enumerate(zip(old, new, strict=True)):
            why = _value_differs(p, q)
            if why:
                problems.append(f"code cell {i}, output {j}: {why}")
                break
    return problems


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


# -- execution (slow) ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
@pytest.mark.notebook
@pytest.mark.integration
@pytest.mark.slow
def test_notebook_outputs_are_current(path, smol):
    """Executes the notebook as notebooks/execute.py does and compares with the stored outputs."""
    runner = _runner()
    png = runner.browser_path() is not None  # without Chromium: executed and compared, PNGs aside
    n = os.environ.get("INTERP_NB_N", runner.QUICK_ENV["INTERP_NB_N"])  # a larger N: executed, not compared
    fresh = runner.execute(path, renderer=runner.RENDERER if png else "plotly_mimetype", INTERP_NB_N=n)
    code = [c for c in fresh.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert [o for c in code for o in c.get("outputs", []) if PLOTLY in o.get("data", {})], \
        "the notebook showed no figure"
    if n != runner.QUICK_ENV["INTERP_NB_N"]:
        pytest.skip("INTERP_NB_N is not the quick setting: executed, not compared with the stored outputs")
    problems = outputs_differ(_read(path), fresh, png=png)
    assert not problems, (f"{path.name}: the stored outputs are stale; refresh with `make notebooks` "
                          "(notebooks/execute.py):\n  " + "\n  ".join(problems))
