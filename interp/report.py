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
- ``figures/*.png`` and ``figures/*.svg`` for papers (kaleido + headless Chromium);
- ``tables/*.csv``;
- ``results.json`` with every number, the settings, package versions and stage times.

All text that comes from data (document titles, tokens, user file names) is HTML-escaped.
"""

from __future__ import annotations

import hashlib
import html
import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
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


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _timing(outputs: dict[str, StageOutput], this_run: float) -> str:
    """Compute time of all stages (across resumed runs), and this run's wall time if it differs."""
    computed = sum(o.seconds for o in outputs.values())
    if abs(computed - this_run) < max(5.0, 0.05 * computed):
        return f"computed in {computed:.0f} s"
    return f"stages computed in {computed:.0f} s; this run took {this_run:.0f} s (finished stages were reused)"


def _table_html(table: pd.DataFrame, max_rows: int = 40) -> str:
    shown = table.head(max_rows)
    numeric = [pd.api.types.is_numeric_dtype(dtype) for dtype in shown.dtypes]
    mostly_text = bool(numeric) and numeric.count(False) > len(numeric) / 2  # sentences read better left-aligned
    body = shown.to_html(index=False, escape=True, float_format=lambda v: f"{v:.4g}", border=0,
                         classes="data text" if mostly_text else "data")
    more = f"<p class='more'>{len(table) - max_rows} more rows in the CSV.</p>" if len(table) > max_rows else ""
    return body + more


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
table.repro td{vertical-align:top;text-align:left}table.repro td.small{font-size:12px;color:#555;max-width:320px}
"""


VERDICT_CLASS = {"holds": "verdict-holds", "partly": "verdict-partly", "does not hold": "verdict-fails",
                 "not testable here": "verdict-untestable", "by construction": "verdict-construction"}


def reproduction_html(table: pd.DataFrame) -> str:
    """The reproduction table with each verdict cell coloured by outcome (all text escaped)."""
    head = ("<tr><th>paper</th><th>claim</th><th>paper value</th><th>measured here (95% CI)</th><th>verdict</th>"
            "<th>why</th><th>statistic and criterion (fixed before measuring)</th></tr>")
    body = []
    for row in table.rename(columns=lambda c: c.replace(" ", "_")).itertuples(index=False):
        d = row._asdict()
        body.append(
            f"<tr><td>{_esc(d['paper'])}</td><td>{_esc(d['claim'])}</td><td>{_esc(d['paper_value'])}</td>"
            f"<td>{_esc(d['measured_here'])}</td>"
            f"<td class='verdict {VERDICT_CLASS.get(d['verdict'], '')}'>{_esc(d['verdict'])}</td>"
            f"<td class='small'>{_esc(d['why'])}</td>"
            f"<td class='small'><b>statistic:</b> {_esc(d['statistic'])}<br><b>criterion:</b> "
            f"{_esc(d['criterion'])}</td></tr>")
    return f"<table class='data repro'>{head}{''.join(body)}</table>"


def render_html(settings: ReportSettings, stages: list[Stage], outputs: dict[str, StageOutput],
                reproduction: pd.DataFrame, versions: dict[str, str], total_seconds: float,
                reference: str = "") -> str:
    parts = ["<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
             "<meta name='viewport' content='width=device-width, initial-scale=1'>",
             "<title>interp report</title><script src='plotly.min.js'></script>",
             f"<style>{CSS}</style></head><body>",
             f"<header><h1>interp report: {_esc(settings.model)} on {_esc(settings.data)}</h1>",
             f"<div>{_esc(settings.n)} examples x {settings.seq_len} tokens, seed {settings.seed}; "
             f"{_timing(outputs, total_seconds)}</div>",
             f"<div>Reference model: {_esc(reference or settings.model)}</div></header><main>"]
    parts.append("<nav>" + "".join(f"<a href='#{s.name}'>{_esc(s.title)}</a>" for s in stages if s.name in outputs)
                 + "<a href='#reproduction'>Reproduction table</a><a href='#settings'>Settings</a></nav>")
    counts = reproduction["verdict"].value_counts()
    tally = ", ".join(f"{counts[v]} {v}" for v in VERDICT_CLASS if v in counts)
    parts.append("<section id='reproduction'><h2>Reproduction table</h2><p class='note'>Each finding of the two "
                 "papers, the paper's number, and the statistic measured here with its 95% interval. Every criterion "
                 "was fixed in code (interp/reproduction.py) before the measurement; the verdict is read from the "
                 f"interval, never from the point estimate. The reference is {_esc(reference or settings.model)}. "
                 f"Verdicts: {_esc(tally)}.</p>")
    parts.append(reproduction_html(reproduction) + "</section>")
    for stage in stages:
        output = outputs.get(stage.name)
        if output is None:
            continue
        parts.append(f"<section id='{stage.name}'><h2>{_esc(stage.title)}</h2><p class='note'>{_esc(stage.intro)}</p>")
        for note in output.notes:
            parts.append(f"<p class='note'>{_esc(note)}</p>")
        for name, fig in output.figures.items():
            div = pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=f"fig-{stage.name}-{name}",
                              config={"displaylogo": False})
            parts.append(f"<div class='fig'>{div}</div>")
        for name, table in output.tables.items():
            parts.append(f"<h3>{_esc(name)}</h3>" + _table_html(table))
        parts.append(f"<p class='more'>stage time: {output.seconds:.1f} s</p></section>")
    rows = {**{k: v for k, v in asdict(settings).items()}, **{f"version {k}": v for k, v in versions.items()}}
    rows["reference"] = reference or settings.model
    rows.update({f"time {s.name} (s)": f"{outputs[s.name].seconds:.1f}" for s in stages if s.name in outputs})
    settings_table = pd.DataFrame({"setting": list(rows), "value": [str(v) for v in rows.values()]})
    parts.append("<section id='settings'><h2>Settings</h2>" + _table_html(settings_table, 200) + "</section>")
    parts.append("</main></body></html>")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------
# Driver


def run_report(out: str | Path, settings: ReportSettings | None = None, stages: list[str] | None = None,
               progress: bool | None = None, static: bool = True) -> dict[str, Any]:
    """Run (or resume) the report into ``out`` and return the ``results.json`` content.

    Args:
        out: output folder.
        settings: :class:`ReportSettings` (``ReportSettings.quick()`` for a fast smoke run).
        stages: names of the stages to run (default: all).
        progress: progress bars (default: when stderr is a terminal).
        static: also export PNG and SVG copies of every figure.
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
        cached = load_stage(stage_dir, key)
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
    _write_outputs(folder, settings, chosen, outputs, reproduction, versions, total, static, reference)
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
                   reference: str = "") -> None:
    from plotly.offline import get_plotlyjs

    from interp.figures import export_static

    atomic_write_bytes(folder / "plotly.min.js", get_plotlyjs().encode())
    page = render_html(settings, stages, outputs, reproduction, versions, total, reference)
    atomic_write_bytes(folder / "index.html", page.encode("utf-8"))
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
