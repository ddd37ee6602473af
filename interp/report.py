"""``interp report``: one offline HTML report reproducing both papers' analyses.

The report runs in stages. Each stage computes tables, figures and numbers, and writes them
to ``OUT/stages/<stage>/`` (CSV, plotly JSON, ``numbers.json``) followed by a ``done.json``
marker holding the settings and the elapsed time. A rerun with the same settings loads
finished stages from disk instead of recomputing them, so a killed report resumes where it
stopped; per-example scoring inside a stage resumes from its SQLite store. Changing the
settings (model, data, N, T, seed, methods) starts the stages over.

Outputs:

- ``index.html`` with every figure, interactive; ``plotly.min.js`` sits beside it, so the
  page works offline with no CDN;
- with ``single_file``, ``report.html``: the same page with plotly.js inlined, one file that
  works when moved or mailed on its own;
- ``figures/*.png`` and ``figures/*.svg`` for papers (kaleido + headless Chromium);
- ``tables/*.csv``;
- ``results.json`` with every number, the settings, package versions and stage times.

The page is rendered from the Jinja2 templates in ``interp/templates`` with autoescaping on: all
text that comes from data (document titles, tokens, user file names) is HTML-escaped; only
plotly's own figure markup and plotly.js are inserted as trusted markup.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property, lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from markupsafe import Markup
from tqdm.auto import tqdm

from interp.io import atomic_write_bytes, ensure_writable_dir, write_json

DEFAULT_METHODS = (
    "rtn:bits=3,group=64", "rtn:bits=4,group=64", "nf:bits=3,group=64", "nf:bits=4,group=64",
    "gptq:bits=3,group=64", "gptq:bits=4,group=64", "awq:bits=3,group=64", "awq:bits=4,group=64",
    "hqq:bits=3,group=64",
)
QUICK_METHODS = ("rtn:bits=3,group=64", "nf:bits=3,group=64", "rtn:bits=4,group=64")  # calibration-free: fast


@dataclass(frozen=True)
class ReportSettings:
    """Everything that determines the report's numbers (hashed to decide what can be reused)."""

    model: str = "smollm2-135m"
    data: str = "wiki"
    n: int | None = 128
    seq_len: int = 128
    seed: int = 0
    methods: tuple[str, ...] = DEFAULT_METHODS
    calibration_n: int = 32
    batch_size: int = 8
    saobp_beta: float = 4.0
    attention_n: int = 16
    patch_method: str = "gptq:bits=3,group=64"
    device: str = "cpu"
    dtype: str = "float32"
    saobp_logs: str = ""  # per-seed SAOBP training logs (default: docs/data/saobp_seeds of this checkout)

    @classmethod
    def quick(cls, **overrides: Any) -> "ReportSettings":
        base = dict(n=20, seq_len=32, methods=QUICK_METHODS, calibration_n=8, attention_n=4,
                    patch_method="rtn:bits=3,group=64")
        return cls(**{**base, **overrides})

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class StageOutput:
    """What one stage produces."""

    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    figures: dict[str, go.Figure] = field(default_factory=dict)
    numbers: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(frozen=True)
class Stage:
    name: str
    title: str
    intro: str
    run: Callable[["ReportContext"], StageOutput]
    reuse: bool = True  # False: recomputed every run (cheap stages that read files outside the settings)


class ReportContext:
    """Lazily loaded shared state: the model, examples, scores and quantized copies."""

    def __init__(self, settings: ReportSettings, out: Path, progress: bool | None) -> None:
        self.settings = settings
        self.out = out
        self.progress = progress
        self.cache: dict[str, Any] = {}

    @cached_property
    def model(self) -> Any:
        import torch

        from interp.models import load_model

        return load_model(self.settings.model, dtype=getattr(torch, self.settings.dtype), device=self.settings.device)

    @cached_property
    def examples(self) -> Any:
        from interp.data import load_examples

        s = self.settings
        return load_examples(s.data, self.model.tokenizer, n=s.n, seq_len=s.seq_len, seed=s.seed, split="eval")

    @cached_property
    def calibration(self) -> Any:
        from interp.data import load_examples

        s = self.settings
        return load_examples(s.data, self.model.tokenizer, n=s.calibration_n, seq_len=s.seq_len, seed=s.seed,
                             split="calibration")

    @cached_property
    def reference_description(self) -> str:
        """What the "full-precision" reference is, read from its GGUF file (e.g. Q4_1 dequantized to fp32)."""
        from interp.reference import describe_reference

        return describe_reference(self.settings.model)

    def token_labels(self, row: int, length: int) -> list[str]:
        tokens = self.examples.tokens[row, :length]
        return [self.model.tokenizer.decode([int(t)]) for t in tokens]


# ---------------------------------------------------------------------------------------
# Stage persistence


def _figure_from_json(text: str) -> go.Figure:
    return pio.from_json(text)


def save_stage(folder: Path, output: StageOutput, settings_key: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, table in output.tables.items():
        atomic_write_bytes(folder / f"{name}.csv", table.to_csv(index=False).encode())
    for name, fig in output.figures.items():
        atomic_write_bytes(folder / f"{name}.plotly.json", fig.to_json().encode())
    write_json(folder / "numbers.json", {"numbers": output.numbers, "notes": output.notes,
                                         "tables": list(output.tables), "figures": list(output.figures)})
    write_json(folder / "done.json", {"settings": settings_key, "seconds": output.seconds})


def load_stage(folder: Path, settings_key: str) -> StageOutput | None:
    done = folder / "done.json"
    if not done.is_file():
        return None
    try:
        marker = json.loads(done.read_text())
        if marker.get("settings") != settings_key:
            return None
        meta = json.loads((folder / "numbers.json").read_text())
        tables = {name: pd.read_csv(folder / f"{name}.csv") for name in meta["tables"]}
        figures = {name: _figure_from_json((folder / f"{name}.plotly.json").read_text()) for name in meta["figures"]}
    except (OSError, json.JSONDecodeError, ValueError, KeyError):
        return None  # a damaged stage is simply recomputed
    return StageOutput(tables=tables, figures=figures, numbers=meta["numbers"], notes=meta["notes"],
                       seconds=float(marker.get("seconds", 0.0)))


# ---------------------------------------------------------------------------------------
# Rendering


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for package in ("interp", "torch", "transformers", "transformer-lens", "plotly", "hqq", "bitsandbytes"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out


@lru_cache(maxsize=1)
def _templates() -> jinja2.Environment:
    """The report's Jinja2 templates (``interp/templates``), autoescaping every value that is not Markup."""
    return jinja2.Environment(loader=jinja2.PackageLoader("interp", "templates"), autoescape=True,
                              undefined=jinja2.StrictUndefined)


def _macros() -> Any:
    return _templates().get_template("macros.html.j2").module


def _timing(outputs: dict[str, StageOutput], this_run: float) -> str:
    """Compute time of all stages (across resumed runs), and this run's wall time if it differs."""
    computed = sum(o.seconds for o in outputs.values())
    if abs(computed - this_run) < max(5.0, 0.05 * computed):
        return f"computed in {computed:.0f} s"
    return f"stages computed in {computed:.0f} s; this run took {this_run:.0f} s (finished stages were reused)"


def _cell(value: Any, is_float: bool) -> str:
    if is_float and isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool):
        return "NaN" if pd.isna(value) else f"{value:.4g}"
    return "NaN" if value is None or (isinstance(value, float) and pd.isna(value)) else str(value)


def _table_context(table: pd.DataFrame, caption: str, max_rows: int = 40) -> dict[str, Any]:
    """What the ``data_table`` macro needs: caption, column names, cell text (not yet escaped), rows left out."""
    shown = table.head(max_rows)
    numeric = [pd.api.types.is_numeric_dtype(dtype) for dtype in shown.dtypes]
    floats = [pd.api.types.is_float_dtype(dtype) for dtype in shown.dtypes]
    mostly_text = bool(numeric) and numeric.count(False) > len(numeric) / 2  # sentences read better left-aligned
    rows = [[_cell(v, f) for v, f in zip(row, floats, strict=True)] for row in shown.itertuples(index=False)]
    return {"caption": caption, "columns": [str(c) for c in shown.columns], "rows": rows,
            "classes": "data text" if mostly_text else "data", "more": max(0, len(table) - max_rows)}


def _table_html(table: pd.DataFrame, max_rows: int = 40, caption: str = "") -> Markup:
    """One data table with its ``<caption>`` (all text escaped); the first ``max_rows`` rows."""
    return _macros().data_table(_table_context(table, caption, max_rows))


CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#1f3b57;color:#fff;padding:18px 32px}header h1{margin:0 0 4px;font-size:24px}
main{max-width:1180px;margin:0 auto;padding:12px 32px 60px}
section{background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:8px 20px 16px;margin:18px 0}
h2{border-bottom:1px solid #eee;padding-bottom:6px}nav a{margin-right:12px;color:#1f3b57}
table.data{border-collapse:collapse;font-size:13px;margin:8px 0}table.data td,table.data th{padding:3px 8px;
border-bottom:1px solid #eee;text-align:right}table.data th{background:#f3f5f7}
table.data.text td,table.data.text th{text-align:left}
.note{color:#555;font-size:14px}.more{color:#777;font-size:12px}.fig{margin:10px 0}
td.verdict{font-weight:600;white-space:nowrap}.verdict-holds{color:#1a7f37;background:#e6f4ea}
.verdict-fails{color:#b42318;background:#fde8e7}.verdict-partly{color:#9a6700;background:#fff4d6}
.verdict-untestable{color:#555;background:#f0f0f0}.verdict-construction{color:#3949ab;background:#e8eaf6}
table.repro td,table.repro th{vertical-align:top;text-align:left}
table.repro td.small{font-size:12px;color:#555;max-width:320px}
table.data caption{caption-side:top;text-align:left;font-weight:600;font-size:14px;padding:10px 0 4px}
figure.fig{margin:14px 0}figure.fig figcaption{font-size:13px;color:#444;padding:2px 4px}
"""


VERDICT_CLASS = {"holds": "verdict-holds", "partly": "verdict-partly", "does not hold": "verdict-fails",
                 "not testable here": "verdict-untestable", "by construction": "verdict-construction"}


def reproduction_html(table: pd.DataFrame, caption: str = "The two papers' findings, reproduced here") -> Markup:
    """The reproduction table with each verdict cell coloured by outcome (all text escaped)."""
    rows = []
    for row in table.rename(columns=lambda c: c.replace(" ", "_")).itertuples(index=False):
        d = row._asdict()
        rows.append({**d, "verdict_class": VERDICT_CLASS.get(d["verdict"], "")})
    return _macros().reproduction_table(rows, caption)


def _figure_caption(fig: go.Figure, key: str) -> str:
    """The figure's title (line breaks as spaces), or its key when it has none; escaped where it is used."""
    title = fig.layout.title.text if fig.layout.title is not None else None
    title = re.sub(r"<br\s*/?>", " ", str(title)).strip() if title else ""
    return title or key


def _figure_context(stage: str, name: str, fig: go.Figure, png: str | None) -> dict[str, Any]:
    div_id = f"fig-{stage}-{name}"
    div = pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=div_id, config={"displaylogo": False})
    return {"id": f"{stage}-{name}", "caption": _figure_caption(fig, name), "png": png,
            "div": Markup(div)}  # plotly's own markup: its JSON escapes '<' and '/' in data text


def render_html(settings: ReportSettings, stages: list[Stage], outputs: dict[str, StageOutput],
                reproduction: pd.DataFrame, versions: dict[str, str], total_seconds: float,
                reference: str = "", plotly_js: str | None = None,
                static_pngs: Callable[[str], str | None] | None = None) -> str:
    """The report page.

    Args:
        plotly_js: plotly.js source to inline in the page (a single file that travels alone); by
            default the page loads ``plotly.min.js`` from beside it.
        static_pngs: maps a figure's file stem (``<stage>__<figure>``) to the link of its static PNG, or
            None when there is none; by default no figure links a PNG.
    """
    reference = reference or settings.model
    counts = reproduction["verdict"].value_counts()
    tally = ", ".join(f"{counts[v]} {v}" for v in VERDICT_CLASS if v in counts)
    sections = []
    for stage in stages:
        output = outputs.get(stage.name)
        if output is None:
            continue
        figures = [_figure_context(stage.name, name, fig, static_pngs(f"{stage.name}__{name}") if static_pngs else None)
                   for name, fig in output.figures.items()]
        tables = [_table_context(table, f"{name} (tables/{stage.name}__{name}.csv)")
                  for name, table in output.tables.items()]
        sections.append({"name": stage.name, "title": stage.title, "intro": stage.intro, "notes": output.notes,
                         "figures": figures, "tables": tables, "seconds": output.seconds})
    rows = {**{k: v for k, v in asdict(settings).items()}, **{f"version {k}": v for k, v in versions.items()}}
    rows["reference"] = reference
    rows.update({f"time {s.name} (s)": f"{outputs[s.name].seconds:.1f}" for s in stages if s.name in outputs})
    settings_table = pd.DataFrame({"setting": list(rows), "value": [str(v) for v in rows.values()]})
    page = _templates().get_template("report.html.j2").render(
        settings=settings, reference=reference, timing=_timing(outputs, total_seconds), tally=tally,
        sections=sections, css=Markup(CSS),
        reproduction=reproduction_html(reproduction, f"The two papers' findings on {settings.model}: "
                                                     f"paper value, measurement here and verdict"),
        settings_table=_table_context(settings_table, "Settings, package versions and time per stage", 200),
        plotly_js=None if plotly_js is None else Markup(_script_safe(plotly_js)))
    return page


def _script_safe(js: str) -> str:
    """JavaScript to inline in a ``<script>`` element: it must not close the element early."""
    if "</script" in js.lower() or "<!--" in js:
        raise ValueError("this plotly.js cannot be inlined: it contains '</script' or '<!--'")
    return js


# ---------------------------------------------------------------------------------------
# Driver


def run_report(out: str | Path, settings: ReportSettings | None = None, stages: list[str] | None = None,
               progress: bool | None = None, static: bool = True, single_file: bool = False) -> dict[str, Any]:
    """Run (or resume) the report into ``out`` and return the ``results.json`` content.

    Args:
        out: output folder.
        settings: :class:`ReportSettings` (``ReportSettings.quick()`` for a fast smoke run).
        stages: names of the stages to run (default: all).
        progress: progress bars (default: when stderr is a terminal).
        static: also export PNG and SVG copies of every figure.
        single_file: also write ``report.html``, one page with plotly.js inlined that works when moved
            on its own (about 5 MB).
    """
    from interp.report_stages import _all_stages, reproduction_table

    STAGES = _all_stages()

    settings = settings or ReportSettings()
    folder = ensure_writable_dir(out)
    key = settings.key()
    context = ReportContext(settings, folder, progress)
    chosen = [s for s in STAGES if stages is None or s.name in stages]
    outputs: dict[str, StageOutput] = {}
    began = time.time()
    bar = tqdm(chosen, desc="report", unit="stage", disable=progress is False)
    for stage in bar:
        bar.set_postfix_str(stage.name)
        stage_dir = folder / "stages" / stage.name
        cached = load_stage(stage_dir, key) if stage.reuse else None
        if cached is not None:
            outputs[stage.name] = cached
            continue
        tick = time.time()
        output = stage.run(context)
        output.seconds = time.time() - tick
        save_stage(stage_dir, output, key)
        outputs[stage.name] = output
    total = time.time() - began
    reproduction = reproduction_table(outputs, settings)
    versions = _versions()
    reference = context.reference_description
    _write_outputs(folder, settings, chosen, outputs, reproduction, versions, total, static, reference,
                   single_file)
    results = {
        "settings": asdict(settings), "versions": versions, "reference": reference,
        "stage_seconds": {name: o.seconds for name, o in outputs.items()},
        "numbers": {name: o.numbers for name, o in outputs.items()},
        "reproduction": reproduction.to_dict(orient="records"),
    }
    write_json(folder / "results.json", results)
    return results


def _write_outputs(folder: Path, settings: ReportSettings, stages: list[Stage], outputs: dict[str, StageOutput],
                   reproduction: pd.DataFrame, versions: dict[str, str], total: float, static: bool,
                   reference: str = "", single_file: bool = False) -> None:
    """Write ``index.html`` + ``plotly.min.js``, the CSV tables, the static figures and, with
    ``single_file``, ``report.html`` (plotly.js inlined, no links to files beside it)."""
    from plotly.offline import get_plotlyjs

    from interp.figures import export_static

    plotly_js = get_plotlyjs()
    atomic_write_bytes(folder / "plotly.min.js", plotly_js.encode())

    def png_link(stem: str) -> str | None:  # the PNG this run exports, or one a previous run left
        return f"figures/{stem}.png" if static or (folder / "figures" / f"{stem}.png").is_file() else None

    args = (settings, stages, outputs, reproduction, versions, total, reference)
    atomic_write_bytes(folder / "index.html", render_html(*args, static_pngs=png_link).encode("utf-8"))
    if single_file:
        atomic_write_bytes(folder / "report.html", render_html(*args, plotly_js=plotly_js).encode("utf-8"))
    tables_dir = folder / "tables"
    tables_dir.mkdir(exist_ok=True)
    reproduction.to_csv(tables_dir / "reproduction.csv", index=False)
    for name, output in outputs.items():
        for table_name, table in output.tables.items():
            table.to_csv(tables_dir / f"{name}__{table_name}.csv", index=False)
    if static:
        figures = {f"{name}__{fig_name}": fig for name, o in outputs.items() for fig_name, fig in o.figures.items()}
        export_static(figures, folder / "figures")


CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]


def screenshot(folder: str | Path, path: str | Path | None = None, width: int = 1280, height: int = 900,
               full_page: bool = False) -> Path:
    """Open ``folder/index.html`` in headless Chromium (Playwright) and save a PNG screenshot.

    Returns the PNG path (default ``folder/screenshot.png``). Needs Chromium at ``BROWSER_PATH``
    (default ``/usr/bin/chromium``; ``make chromium`` installs it).
    """
    import os

    from interp.errors import ResourceError

    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise ResourceError("The report screenshot needs playwright, in the 'browser' extra: "
                            "pip install -e '.[browser]' (make test and make demo install it).") from None

    folder = Path(folder)
    target = Path(path) if path else folder / "screenshot.png"
    browser_path = os.environ.get("BROWSER_PATH", "/usr/bin/chromium")
    if not Path(browser_path).exists():
        raise ResourceError(f"Chromium not found at {browser_path}: run `make chromium` or set BROWSER_PATH.")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto((folder / "index.html").resolve().as_uri())
            page.wait_for_load_state("load")
            page.wait_for_timeout(1500)
            page.screenshot(path=str(target), full_page=full_page)
        finally:
            browser.close()
    return target
