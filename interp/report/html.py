"""The report page: Jinja2 rendering of every stage's tables and figures, and a headless-Chromium screenshot.

The page opens with what the run found (:func:`synthesis`, generated from the verdicts and the
measurements, never typed), then a compact verdict table whose rows link to their figure and
table, then each section's figures, with its raw tables collapsed and downloadable as CSV.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import urllib.parse
from collections.abc import Callable, Mapping
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
from interp.report import reproduction as rp
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


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def provenance() -> dict[str, Any]:
    """Where the numbers were computed: the interp checkout's commit (``"unknown"`` outside a git checkout)
    and whether its tracked files differed from it, torch's version, threads and CPU kernels.

    Float32 sums, and calibrated quantizers above all, round differently under other kernels or thread
    counts, so a verdict whose interval touches its threshold can move with them.
    """
    import torch

    root = Path(__file__).resolve().parents[2]  # the checkout holding interp/, when there is one
    top = _git(root, "rev-parse", "--show-toplevel")
    commit = _git(root, "rev-parse", "HEAD") if top and Path(top).resolve() == root else None
    status = _git(root, "status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit or "unknown", "dirty": None if status is None else bool(status),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu capability": torch.backends.cpu.get_cpu_capability(),
            "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY", "")}


def provenance_text(p: Mapping[str, Any]) -> str:
    """One line for the page's footer."""
    commit = str(p.get("commit", "unknown"))
    tree = {True: " (with uncommitted changes)", False: "", None: ""}.get(p.get("dirty"), "")
    aten = p.get("ATEN_CPU_CAPABILITY") or "unset"
    return (f"commit {commit[:12]}{tree}; torch {p.get('torch', '?')}, {p.get('threads', '?')} thread(s), "
            f"CPU kernels {p.get('cpu capability', '?')} (ATEN_CPU_CAPABILITY {aten})")


def stage_origin(p: Mapping[str, Any]) -> str:
    """Where one stage's numbers were computed, for the settings table: a resumed report mixes stages of
    several runs, each with its own commit, machine, threads and kernels."""
    when = f", {p['computed']}" if p.get("computed") else ""
    reused = "; reused from an earlier run" if p.get("reused") else "; this run"
    return f"{provenance_text(p)} on {p.get('machine', '?')}{when}{reused}"


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


def _table_context(table: pd.DataFrame, caption: str, max_rows: int = 40, anchor: str = "",
                   csv: str = "") -> dict[str, Any]:
    """What the ``data_table`` macro needs: caption, column names, cell text (not yet escaped), rows left out,
    and, for a collapsed table, its anchor and the link to its CSV."""
    shown = table.head(max_rows)
    numeric = [pd.api.types.is_numeric_dtype(dtype) for dtype in shown.dtypes]
    floats = [pd.api.types.is_float_dtype(dtype) for dtype in shown.dtypes]
    mostly_text = bool(numeric) and numeric.count(False) > len(numeric) / 2  # sentences read better left-aligned
    rows = [[_cell(v, f) for v, f in zip(row, floats, strict=True)] for row in shown.itertuples(index=False)]
    return {"caption": caption, "columns": [str(c) for c in shown.columns], "rows": rows,
            "classes": "data text" if mostly_text else "data", "more": max(0, len(table) - max_rows),
            "anchor": anchor, "csv": csv, "shape": f"{len(table)} rows x {len(table.columns)} columns"}


def _table_html(table: pd.DataFrame, max_rows: int = 40, caption: str = "") -> Markup:
    """One data table with its ``<caption>`` (all text escaped); the first ``max_rows`` rows."""
    return _macros().data_table(_table_context(table, caption, max_rows))


CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#1f3b57;color:#fff;padding:18px 32px}header h1{margin:0 0 4px;font-size:24px}
main{max-width:1320px;margin:0 auto;padding:12px 32px 40px}
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
table.repro{width:100%;table-layout:fixed}table.repro td,table.repro th{vertical-align:top;text-align:left}
table.repro td.verdict{white-space:normal}table.repro .paper{display:block;font-size:11px;color:#777}
table.repro details{font-size:12px;color:#555;margin-top:3px}table.repro summary{cursor:pointer;color:#1f3b57}
table.data caption{caption-side:top;text-align:left;font-weight:600;font-size:14px;padding:10px 0 4px}
figure.fig{margin:14px 0}figure.fig figcaption{font-size:13px;color:#444;padding:2px 4px}
details.table{border:1px solid #eee;border-radius:4px;margin:8px 0;padding:2px 10px}
details.table>summary{cursor:pointer;font-size:14px;padding:6px 0}details.table>summary .more{margin-left:8px}
.scroll{overflow-x:auto;max-width:100%}.banner{background:#fff4d6;border:1px solid #e0b84c;color:#5c4300;
padding:10px 16px;border-radius:6px;margin:14px 0;font-weight:600}
#summary .para{margin:8px 0}#summary .para,#summary li{font-size:15px;line-height:1.5}#summary ul{margin:4px 0 10px}
footer{max-width:1320px;margin:0 auto;padding:0 32px 40px;color:#555;font-size:13px}
"""


VERDICT_CLASS = {rp.AS_STRONG: "verdict-strong", rp.CONSISTENT: "verdict-consistent", rp.WEAKER: "verdict-weaker",
                 rp.NOT_SHOWN: "verdict-notshown", rp.CONTRADICTED: "verdict-contradicted",
                 rp.NOT_TESTABLE: "verdict-untestable", rp.BY_CONSTRUCTION: "verdict-construction",
                 **{v: "verdict-untestable" for v in rp.VERDICTS if v not in (
                     rp.AS_STRONG, rp.CONSISTENT, rp.WEAKER, rp.NOT_SHOWN, rp.CONTRADICTED, rp.NOT_TESTABLE,
                     rp.BY_CONSTRUCTION)}}  # the verdicts that withhold one (too few examples, ...) look alike


# Where each claim's evidence is drawn: (figure, table) of the stage that measured it; a claim not
# listed, or whose figure or table a run did not make, links to the stage's first figure and table.
CLAIM_EVIDENCE = {
    "saobp_inference": ("entropy_by_layer", "by_layer"), "saobp_training_entropy": ("", "per_seed"),
    "saobp_training_loss": ("", "per_seed"), "saobp_training_gtd": ("", "per_seed"),
    "agreement": ("agreement", "paper_protocol"), "agreement_disattenuated": ("reliability", "disattenuated_pairs"),
    "jaccard_top10": ("agreement", "pairs"), "norm_error": ("norm_error_correlation", "norm_error_per_method"),
    "reversal_h_mse": ("reversal_mse_corr", "reversal_mse"), "kurtosis": ("reversal_kurtosis", "reversal_by_layer"),
    "outlier_gamma": ("reversal_outliers", "outlier_dims"), "early_exit_logit": ("early_exit_logit", "nll_by_layer"),
    "early_exit_tuned": ("early_exit_tuned", "nll_by_layer"), "restoration": ("restoration", "restoration"),
    **{f"patch_{c}": ("patching_upper_half", "patching_upper_half") for c in ("down", "gate", "up", "attn_out")},
    "gate_input": ("gate_input", "gate_input_vs_weights"),
}


def figure_anchor(stage: str, name: str) -> str:
    return f"figure-{stage}-{name}"


def table_anchor(stage: str, name: str) -> str:
    return f"table-{stage}-{name}"


def evidence_links(outputs: Mapping[str, StageOutput]) -> dict[str, dict[str, str]]:
    """Each measured claim's anchors on the page: ``{"figure": "#...", "table": "#...", "section": "#..."}``
    (a link only to what this run drew)."""
    links: dict[str, dict[str, str]] = {}
    for stage, output in outputs.items():
        for key in output.numbers.get("claims") or {}:
            figure, table = CLAIM_EVIDENCE.get(key, ("", ""))
            figure = figure if figure in output.figures else next(iter(output.figures), "")
            table = table if table in output.tables else next(iter(output.tables), "")
            links[key] = {"section": f"#{stage}"}
            if figure:
                links[key]["figure"] = "#" + figure_anchor(stage, figure)
            if table:
                links[key]["table"] = "#" + table_anchor(stage, table)
    return links


def _claim_keys(table: pd.DataFrame) -> list[str]:
    """The claim key of each row (the claim's text names it; a row of no known claim gets ``row-i``)."""
    by_text = {c.claim: key for key, c in rp.CLAIMS.items()}
    return [by_text.get(str(text), f"row-{i}") for i, text in enumerate(table["claim"])]


def reproduction_html(table: pd.DataFrame, caption: str = "The two papers' findings, reproduced here",
                      links: Mapping[str, Mapping[str, str]] | None = None, csv: str = "") -> Markup:
    """The compact verdict table: claim (its reason, statistic and criterion collapsed under it), the paper's
    value, the measurement, the verdict coloured by outcome, and links to the claim's figure and table."""
    rows = []
    keys = _claim_keys(table)
    for key, row in zip(keys, table.rename(columns=lambda c: c.replace(" ", "_")).itertuples(index=False),
                        strict=True):
        d = row._asdict()
        rows.append({**d, "key": key, "verdict_class": VERDICT_CLASS.get(d["verdict"], ""),
                     "links": dict((links or {}).get(key, {}))})
    return _macros().reproduction_table(rows, caption, csv)


# -- the synthesis: what this run found, in sentences generated from the verdicts ---------------

_REPRODUCED = "reproduced"
_WEAKER = "present but weaker than the paper"
_OTHER_WAY = "contradicted"
_NOT_SHOWN = "not shown"


def _outcome(verdict: str) -> str:
    """The synthesis' group of a verdict, read from what the verdict asserts (:data:`rp.CONCLUSIONS`)."""
    asserts = rp.CONCLUSIONS.get(verdict, frozenset())
    if "the other side" in asserts:
        return _OTHER_WAY
    if "below the paper's level" in asserts:
        return _WEAKER
    if "present" in asserts:
        return _REPRODUCED
    return _NOT_SHOWN if verdict == rp.NOT_SHOWN else "not judged"


def _claim_link(key: str, claim: str) -> Markup:
    return Markup("<a href='#claim-{}'>{}</a>").format(key, claim)


def _evidence(links: Mapping[str, str]) -> Markup:
    parts = [Markup("<a href='{}'>{}</a>").format(links[k], k) for k in ("figure", "table") if k in links]
    return Markup(" (") + Markup(", ").join(parts) + Markup(")") if parts else Markup("")


def _listing(rows: list[dict[str, Any]], links: Mapping[str, Mapping[str, str]], reason: bool) -> Markup:
    items = []
    for r in rows:
        said = Markup("{}: paper {}, here {}").format(_claim_link(r["key"], r["claim"]), r["paper value"],
                                                      r["measured here"])
        if reason:
            said += Markup("; {}").format(r["why"])
        items.append(Markup("<li>{}{}</li>").format(said, _evidence(links.get(r["key"], {}))))
    return Markup("<ul>") + Markup("").join(items) + Markup("</ul>")


def _names(rows: list[dict[str, Any]]) -> Markup:
    return Markup(", ").join(_claim_link(r["key"], r["claim"][:1].lower() + r["claim"][1:]) for r in rows)


def _meaning(paper: str, groups: dict[str, list[dict[str, Any]]], model: str) -> Markup:
    """One generated sentence per paper: how many of its judged findings carry over to ``model``, and which not."""
    judged = sum(len(groups[g]) for g in (_REPRODUCED, _WEAKER, _OTHER_WAY, _NOT_SHOWN))
    if judged == 0:
        return Markup("<b>{}</b>: none of its findings could be judged in this run.").format(paper)
    text = Markup("<b>{}</b>: {} of {} judged finding(s) reproduced on {}").format(
        paper, len(groups[_REPRODUCED]), judged, model)
    if len(groups[_REPRODUCED]) == judged:
        return text + Markup(": every finding this run could judge carries over.")
    clauses = []
    if groups[_OTHER_WAY]:
        clauses.append(Markup("the measurement points the other way for {}, so on this model those findings do "
                              "not carry over").format(_names(groups[_OTHER_WAY])))
    if groups[_WEAKER]:
        clauses.append(Markup("the effect is present but smaller than the paper reports for {}").format(
            _names(groups[_WEAKER])))
    if groups[_NOT_SHOWN]:
        clauses.append(Markup("{} cannot be told apart from no effect with this many examples").format(
            _names(groups[_NOT_SHOWN])))
    return text + Markup("; ") + Markup("; ").join(clauses) + Markup(".")


def synthesis(reproduction: pd.DataFrame, links: Mapping[str, Mapping[str, str]], model: str,
              smoke: str = "") -> list[Markup]:
    """What this run found, as paragraphs generated from the verdicts and the measurements (all text escaped).

    Args:
        reproduction: the reproduction table (:func:`interp.report.reproduction.reproduction_frame`).
        links: each claim key's figure and table anchors (:func:`evidence_links`).
        model: the model's name, as the sentences call it.
        smoke: why no verdict was given (a smoke run), or empty.
    """
    rows = [{**r, "key": k} for k, r in zip(_claim_keys(reproduction), reproduction.to_dict(orient="records"),
                                            strict=True)]
    groups: dict[str, list[dict[str, Any]]] = {g: [] for g in (_REPRODUCED, _WEAKER, _OTHER_WAY, _NOT_SHOWN,
                                                                "not judged")}
    for r in rows:
        groups[_outcome(str(r["verdict"]))].append(r)
    withheld = pd.Series([r["verdict"] for r in groups["not judged"]], dtype=object).value_counts()
    why_not = ", ".join(f"{count} {verdict}" for verdict, count in withheld.items())
    out = []
    if smoke:  # the banner above says why; the table below shows each measurement
        measured = sum(str(r["measured here"]) not in ("not run", "") for r in rows)
        out.append(Markup("No finding is judged in this run: {} of the {} findings were measured, and the table "
                          "below shows each measurement without a verdict. Run without <code>--quick</code> (the "
                          "default {} examples) for verdicts.").format(measured, len(rows), ReportSettings().n))
        return out
    counts = Markup(", ").join(Markup("{} {}").format(len(groups[g]), g) for g in
                               (_REPRODUCED, _WEAKER, _OTHER_WAY, _NOT_SHOWN) if groups[g])
    out.append(Markup("Of the {} findings of the two papers checked on {}: {}{}.").format(
        len(rows), model, counts or Markup("none could be judged"),
        Markup("; {} not judged here ({})").format(len(groups["not judged"]), why_not) if why_not else ""))
    for paper in dict.fromkeys(str(r["paper"]) for r in rows):
        mine = {g: [r for r in members if r["paper"] == paper] for g, members in groups.items()}
        out.append(_meaning(paper, mine, model))
    for group, reason in ((_REPRODUCED, False), (_WEAKER, True), (_OTHER_WAY, True), (_NOT_SHOWN, True)):
        if groups[group]:
            out.append(Markup("<b>{}</b> ({}):").format(group.capitalize(), len(groups[group]))
                       + _listing(groups[group], links, reason))
    if groups["not judged"]:  # each with its reason, collapsed: the first screen is for what was found
        out.append(Markup("<details><summary><b>Not judged</b> ({}): {}</summary>{}</details>").format(
            len(groups["not judged"]), why_not, _listing(groups["not judged"], links, True)))
    return out


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


def csv_data_uri(table: pd.DataFrame) -> str:
    """A table's CSV as a ``data:`` link: a page that travels alone (``report.html``) carries its tables."""
    return "data:text/csv;charset=utf-8," + urllib.parse.quote(table.to_csv(index=False))


def render_html(settings: ReportSettings, stages: list[Stage], outputs: dict[str, StageOutput],
                reproduction: pd.DataFrame, versions: dict[str, str], total_seconds: float,
                reference: str = "", plotly_js: str | None = None,
                static_pngs: Callable[[str], str | None] | None = None,
                csv_links: Callable[[str, pd.DataFrame], str] | None = None,
                run: Mapping[str, Any] | None = None, smoke: str = "") -> str:
    """The report page.

    Args:
        plotly_js: plotly.js source to inline in the page (a single file that travels alone); by
            default the page loads ``plotly.min.js`` from beside it.
        static_pngs: maps a figure's file stem (``<stage>__<figure>``) to the link of its static PNG, or
            None when there is none; by default no figure links a PNG.
        csv_links: maps a table's file stem (``<stage>__<table>``, ``reproduction``) and the table to the
            link of its CSV; by default ``tables/<stem>.csv``, which the report writes beside the page.
        run: where it ran (``provenance``), shown in the footer.
        smoke: why this run gives no verdict (a smoke run): a banner at the top says so.
    """
    reference = reference or settings.model
    csv_link = csv_links or (lambda stem, table: f"tables/{stem}.csv")
    counts = reproduction["verdict"].value_counts()
    tally = ", ".join(f"{counts[v]} {v}" for v in VERDICT_CLASS if v in counts)
    sections = []
    for stage in stages:
        output = outputs.get(stage.name)
        if output is None:
            continue
        figures = [_figure_context(stage.name, name, fig, static_pngs(f"{stage.name}__{name}") if static_pngs else None)
                   for name, fig in output.figures.items()]
        tables = [_table_context(table, f"{name} (tables/{stage.name}__{name}.csv)",
                                 anchor=table_anchor(stage.name, name),
                                 csv=csv_link(f"{stage.name}__{name}", table))
                  for name, table in output.tables.items()]
        sections.append({"name": stage.name, "title": stage.title, "intro": stage.intro, "notes": output.notes,
                         "figures": figures, "tables": tables, "seconds": output.seconds})
    rows = {**{k: v for k, v in asdict(settings).items()}, **{f"version {k}": v for k, v in versions.items()}}
    rows["reference"] = reference
    rows.update({f"time {s.name} (s)": f"{outputs[s.name].seconds:.1f}" for s in stages if s.name in outputs})
    rows.update({f"computed {s.name}": stage_origin(outputs[s.name].provenance) for s in stages
                 if s.name in outputs and outputs[s.name].provenance})
    settings_table = pd.DataFrame({"setting": list(rows), "value": [str(v) for v in rows.values()]})
    links = evidence_links(outputs)
    page = _templates().get_template("report.html.j2").render(
        settings=settings, reference=reference, timing=_timing(outputs, total_seconds), tally=tally,
        sections=sections, css=Markup(CSS), smoke=smoke,
        synthesis=synthesis(reproduction, links, settings.model, smoke),
        reproduction=reproduction_html(reproduction, f"The two papers' findings on {settings.model}, exploratory "
                                                     f"(examples and criteria not pre-registered; one quantized "
                                                     f"instance, CPU kernels {versions.get('cpu kernels', 'n/a')})",
                                       links, csv_link("reproduction", reproduction)),
        settings_table=_table_context(settings_table, "Settings, package versions and time per stage", 200,
                                      anchor="table-settings"),
        run=provenance_text(run) if run else "",
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
