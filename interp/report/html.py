"""The report page: Jinja2 rendering of every stage's tables and figures, and a headless-Chromium screenshot."""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Callable
from dataclasses import asdict
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from markupsafe import Markup

from interp.errors import ResourceError
from interp.report.context import ReportSettings, Stage, StageOutput
from interp.runtime.batching import kernels


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for package in ("interp", "torch", "transformers", "transformer-lens", "plotly", "hqq", "bitsandbytes"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "not installed"
    out["cpu kernels"] = kernels("cpu")  # calibrated quantizers' results depend on them (docs/reproduction.md)
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
td.verdict{font-weight:600;white-space:nowrap}.verdict-strong{color:#1a7f37;background:#e6f4ea}
.verdict-consistent{color:#2e7d32;background:#f1f8e9}.verdict-weaker{color:#9a6700;background:#fff4d6}
.verdict-notshown{color:#6d4c41;background:#f5f0eb}.verdict-contradicted{color:#b42318;background:#fde8e7}
.verdict-untestable{color:#555;background:#f0f0f0}.verdict-construction{color:#3949ab;background:#e8eaf6}
table.repro td,table.repro th{vertical-align:top;text-align:left}
table.repro td.small{font-size:12px;color:#555;max-width:320px}
table.data caption{caption-side:top;text-align:left;font-weight:600;font-size:14px;padding:10px 0 4px}
figure.fig{margin:14px 0}figure.fig figcaption{font-size:13px;color:#444;padding:2px 4px}
"""


VERDICT_CLASS = {"as strong as the paper": "verdict-strong", "present; level not resolved": "verdict-consistent",
                 "weaker than the paper": "verdict-weaker", "not shown": "verdict-notshown",
                 "contradicted": "verdict-contradicted", "not testable here": "verdict-untestable",
                 "by construction": "verdict-construction"}


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
        reproduction=reproduction_html(reproduction, f"The two papers' findings on {settings.model}, exploratory "
                                                     f"(examples and criteria not pre-registered; one quantized "
                                                     f"instance, CPU kernels {versions.get('cpu kernels', 'n/a')}): "
                                                     f"paper value, measurement here and verdict"),
        settings_table=_table_context(settings_table, "Settings, package versions and time per stage", 200),
        plotly_js=None if plotly_js is None else Markup(_script_safe(plotly_js)))
    return page


def _script_safe(js: str) -> str:
    """JavaScript to inline in a ``<script>`` element: it must not close the element early."""
    if "</script" in js.lower() or "<!--" in js:
        raise ValueError("this plotly.js cannot be inlined: it contains '</script' or '<!--'")
    return js


CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]


def screenshot(folder: str | Path, path: str | Path | None = None, width: int = 1280, height: int = 900,
               full_page: bool = False) -> Path:
    """Open ``folder/index.html`` in headless Chromium (Playwright) and save a PNG screenshot.

    Returns the PNG path (default ``folder/screenshot.png``). Needs Chromium at ``BROWSER_PATH``
    (default ``/usr/bin/chromium``; ``make chromium`` installs it).
    """
    try:  # an optional dependency (the 'browser' extra): imported only when a screenshot is asked for
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
