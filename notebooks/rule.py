"""The rule by which two executions of a notebook must agree, shared by ``notebooks/execute.py`` (which
stores a quick execution's normalised outputs as a record) and ``tests/test_notebooks.py`` (which
executes again and compares).

:func:`normalise` turns a notebook's outputs into a form that is the same on every run and machine;
:func:`differ` lists where two normalised forms disagree (numbers to about 3 significant digits).
"""

from __future__ import annotations

import base64
import math
import re
import tempfile

import numpy as np

PLOTLY = "application/vnd.plotly.v1+json"
WIDGET = "application/vnd.jupyter.widget-view+json"
VARIES_TAG = "output-varies"

REL_TOL = 5e-3  # "about 3 significant digits"
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|\bnan\b|\bNaN\b|[-+]?\binf\b")
_TMP = "|".join(re.escape(t) for t in sorted({"/tmp", tempfile.gettempdir()}, key=len, reverse=True))
_MASKS = [
    # where the code lives, as a warning prints it: /work/main/interp/stats.py:172 -> <repo>/interp/stats.py:<line>
    # (first: a checkout under the temporary folder, /tmp/ci/interp/..., is still the repository)
    (re.compile(r"(?:/[^\s/:'\"]+)+/(?=(?:interp|tests|notebooks)/)"), "<repo>/"),
    # installed packages, before temporary folders: a venv under /tmp (/tmp/ci/.venv/...) is still site-packages
    (re.compile(r"(?:/[^\s/:'\"]+)+/site-packages/"), "<site-packages>/"),
    # temporary folders (tempfile.mkdtemp names are random): /tmp/interp-byom-5ou8y9t2 -> <tmp>
    (re.compile(rf"(?:{_TMP})/[^\s'\",)\]}}]+"), "<tmp>"),
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

    * All stream outputs of one kind (stdout, stderr) in a cell are joined into one, and the cell's
      streams come first, by name: how prints are split into messages, and how stdout, stderr and
      displayed objects interleave, depend on timing, not on the code. Rich outputs keep their
      order and their set of mimetypes (``image/png`` dropped with ``png=False``, for a run without
      Chromium).
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
        streams: dict[str, str] = {}  # stream name -> everything it printed in this cell
        for o in cell.get("outputs", []):
            if o.output_type == "stream":
                streams[o.name] = streams.get(o.name, "") + o.text
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
        joined = [("stream", name, _text(streams[name], varies)) for name in sorted(streams)]
        cells.append(joined + out)
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
    return differ(normalise(stored, png), normalise(fresh, png))


def as_tuples(value):
    """A normalised form read back from JSON (lists) as the tuples :func:`normalise` makes."""
    if isinstance(value, list):
        return tuple(as_tuples(v) for v in value)
    return value


NOISE_FLOOR = 1e-4


def noise_numbers(form) -> list[str]:
    """Printed numbers in a normalised form (:func:`normalise`) that can only be rounding residuals.

    A notebook computes in float32 on values of order 1 to 1e3, so a difference it prints below
    ``NOISE_FLOOR`` (about 1e3 float32 units of a value of order 1) is the order in which a CPU added,
    not a property of the model: another CPU prints another one (1.9e-06 became 2.9e-06 on an AVX-512
    machine), and no record can pin it. Such a check prints whether it is within its bound instead.
    Exact zeros and numbers of 1e-4 or more pass.
    """
    found: list[str] = []

    def walk(value) -> None:
        if isinstance(value, str):
            for token in _NUMBER.findall(value):
                try:
                    x = abs(float(token))
                except ValueError:
                    continue
                if 0 < x < NOISE_FLOOR:
                    found.append(token)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(form)
    return found


def differ(a, b) -> list[str]:
    """Where two normalised forms (:func:`normalise`) differ: one line per differing code cell."""
    a = [[as_tuples(o) for o in cell] for cell in a]
    b = [[as_tuples(o) for o in cell] for cell in b]
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


