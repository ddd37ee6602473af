"""The offline HTML report: a --quick run, resume, escaping, and a real headless-Chromium check."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("BROWSER_PATH", "/usr/bin/chromium")
HOSTILE = "</script><script>window.__pwned = 1</script><img src=x onerror='window.__pwned=2'>"

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _run_report(out: Path, *extra: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "interp", "report", "--quick", "--out", str(out), "--quiet", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory, smol):
    out = tmp_path_factory.mktemp("report") / "quick"
    began = time.time()
    proc = _run_report(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, time.time() - began


def test_report_outputs(quick_report):
    out, _ = quick_report
    results = json.loads((out / "results.json").read_text())
    assert set(results["stage_seconds"]) >= {"probes", "attention"}
    assert (out / "plotly.min.js").stat().st_size > 1_000_000  # plotly.js beside the page, no CDN
    page = (out / "index.html").read_text()
    assert "cdn.plot.ly" not in page and "<script src='plotly.min.js'>" in page
    pngs = sorted((out / "figures").glob("*.png"))
    svgs = sorted((out / "figures").glob("*.svg"))
    assert pngs and len(pngs) == len(svgs)
    assert all(p.stat().st_size > 5_000 for p in pngs)
    assert (out / "tables" / "reproduction.csv").is_file()
    from interp.report.reproduction import CLAIMS, VERDICTS

    assert [row["claim"] for row in results["reproduction"]] == [c.claim for c in CLAIMS.values()]
    for row in results["reproduction"]:
        assert row["measured here"] not in ("", None)
        assert row["verdict"] in VERDICTS and row["why"] and row["criterion"]
    assert results["reference"].startswith("GGUF Q4_1 dequantized to fp32")
    assert "Reference model: GGUF Q4_1 dequantized to fp32" in page
    from interp.report.html import VERDICT_CLASS

    shown = {row["verdict"] for row in results["reproduction"]}
    assert all(f"class='verdict {VERDICT_CLASS[v]}'" in page for v in shown)  # every verdict cell is coloured
    # a smoke run: the banner, and no verdict that judges the data (the measurements are still shown)
    assert results["smoke"] is True and "A smoke run: it concludes nothing." in page
    judging = {"as strong as the paper", "weaker than the paper", "not shown", "contradicted",
               "present; level not resolved"}
    assert not shown & judging and "too few examples for a verdict" in shown, shown
    # where it ran: the commit, torch's threads and kernels, in results.json and the page's footer
    run = results["provenance"]
    assert {"commit", "dirty", "threads", "cpu capability", "ATEN_CPU_CAPABILITY", "torch"} <= set(run)
    assert f"{run['threads']} thread(s), CPU kernels {run['cpu capability']}" in page


def test_rerun_resumes_without_recomputing(quick_report):
    out, first_seconds = quick_report
    from interp.report.stages import STAGES

    reused = {s.name for s in STAGES if s.reuse}  # the others re-read committed files each run
    markers = {p: p.stat().st_mtime_ns for p in (out / "stages").glob("*/done.json") if p.parent.name in reused}
    assert markers
    began = time.time()
    proc = _run_report(out, "--no-static")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {p: p.stat().st_mtime_ns for p in markers} == markers  # no stage was recomputed
    assert time.time() - began < first_seconds


@pytest.fixture(scope="module")
def single_file_report(quick_report) -> Path:
    """The quick report re-rendered with --single-file (every stage is cached: it only renders)."""
    out, _ = quick_report
    proc = _run_report(out, "--single-file", "--no-static", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out / "report.html"


def test_single_file_report(quick_report, single_file_report):
    from plotly.offline import get_plotlyjs

    out, _ = quick_report
    page = single_file_report.read_text(encoding="utf-8")
    plotly_js = get_plotlyjs()
    assert "src='plotly.min.js'" not in page and "plotly.min.js'></script>" not in page
    assert f"<script>{plotly_js}</script>" in page  # plotly.js inline
    rest = page.replace(plotly_js, "")  # plotly.js itself names cdn.plot.ly (for geo maps, unused here)
    assert "cdn.plot.ly" not in rest and "<script src=" not in rest  # nothing loaded from beside it or the web
    assert "href='figures/" not in page  # no links to files that stay behind
    size = single_file_report.stat().st_size
    index = (out / "index.html").stat().st_size
    # the page with plotly.js inside: plotly.js (~4.8 MB) plus the figures and tables of index.html, its CSV
    # links carrying the tables (data: links) instead of naming the files beside it
    csv_links = sum(len(p.read_bytes()) for p in (out / "tables").glob("*.csv"))
    assert size == pytest.approx(len(plotly_js.encode()) + index, abs=10_000 + 3 * csv_links), (size, index)
    assert "href='tables/" not in page and "href='data:text/csv" in page
    assert 4_000_000 < size < 8_000_000, size
    assert page.count("<figcaption>") == (out / "index.html").read_text().count("<figcaption>") > 0


def _numbers(report: Path) -> tuple[dict, dict[str, str]]:
    """Everything a report measured: results.json without wall times, and every table."""
    def drop_times(value):
        if isinstance(value, dict):
            return {k: drop_times(v) for k, v in value.items() if "second" not in k}
        if isinstance(value, list):
            return [drop_times(v) for v in value]
        return value

    def without_time_columns(path: Path) -> str:
        import pandas as pd

        frame = pd.read_csv(path, dtype=str, keep_default_na=False)  # text as written: an exact comparison
        return frame.drop(columns=[c for c in frame.columns if "second" in c.lower()]).to_csv(index=False)

    results = drop_times(json.loads((report / "results.json").read_text()))
    results.pop("provenance")  # where it ran (the commit moves while the shared checkout is edited), not a number
    tables = {str(p.relative_to(report)): without_time_columns(p) for p in sorted(report.glob("tables/**/*.csv"))}
    return results, tables


def test_two_fresh_reports_give_identical_numbers(quick_report, tmp_path):
    """A second run from scratch, in a fresh folder and with no cached quantized models,
    reproduces every number and table of the first exactly (not just within a tolerance)."""
    from interp import models

    out, _ = quick_report
    cache = tmp_path / "cache"
    cache.mkdir()
    for entry in models.cache_dir().iterdir():  # reuse the converted model, not the quantized copies
        if entry.name != "quantized":
            (cache / entry.name).symlink_to(entry)
    env = {**os.environ, "INTERP_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "interp", "report", "--quick", "--out", str(tmp_path / "again"), "--quiet",
           "--no-static"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (cache / "quantized").is_dir()  # the quantized models really were made again
    first, second = _numbers(out), _numbers(tmp_path / "again")
    assert first[1] and first[1].keys() == second[1].keys()
    for name in first[1]:
        assert first[1][name] == second[1][name], name
    assert first[0] == second[0]


def test_killed_report_resumes(tmp_path, smol):
    """kill -9 during the attention stage; the rerun keeps the finished probes stage."""
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "interp", "report", "--quick", "--out", str(out), "--quiet", "--no-static",
           "--stages", "probes,attention"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    done = out / "stages" / "probes" / "done.json"
    deadline = time.time() + 600
    while not done.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    proc.kill()
    proc.wait()
    assert done.exists()
    before = done.stat().st_mtime_ns
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-2000:]
    assert done.stat().st_mtime_ns == before
    assert (out / "stages" / "attention" / "done.json").exists()


def test_text_from_data_is_escaped(tmp_path, smol):
    doc = (HOSTILE + " ") * 40
    source = tmp_path / "hostile.txt"
    source.write_text("\n\n".join([doc] * 30))
    out = tmp_path / "hostile-report"
    proc = _run_report(out, "--data", str(source), "--stages", "attention", "--no-static", "--n", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    page = (out / "index.html").read_text()
    assert "<script>window.__pwned" not in page and "<img src=x" not in page
    assert "&lt;/script&gt;" in page or "\\u003c" in page


class _Structure(HTMLParser):
    """What the accessibility checks read from a page: each table's first child, figures and their
    captions, and the alt text of each role='img' element."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[str | None] = []  # the first tag inside each table
        self.figures = 0
        self.captions: list[str] = []  # figcaption text
        self.alt: list[str] = []  # aria-label of each role='img'
        self.viewport = False
        self._in_figcaption = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if self.tables and self.tables[-1] is None:
            self.tables[-1] = tag
        if tag == "table":
            self.tables.append(None)
        elif tag == "figure":
            self.figures += 1
        elif tag == "figcaption":
            self._in_figcaption = True
            self.captions.append("")
        elif tag == "meta" and a.get("name") == "viewport":
            self.viewport = "width=device-width" in (a.get("content") or "")
        if a.get("role") == "img":
            self.alt.append(a.get("aria-label") or "")

    def handle_endtag(self, tag):
        if tag == "figcaption":
            self._in_figcaption = False

    def handle_data(self, data):
        if self._in_figcaption:
            self.captions[-1] += data


def _fake_report(hostile: str):
    """A tiny report with no model: one stage, two figures (one titled with hostile text, one untitled),
    one table with hostile cells and column name, and a reproduction table with all five verdicts."""
    import pandas as pd
    import plotly.graph_objects as go

    from interp.report.context import ReportSettings, Stage, StageOutput

    titled = go.Figure(go.Scatter(x=[0, 1, 2], y=[1, 3, 2], text=[hostile] * 3), layout={"title": {"text": hostile}})
    untitled = go.Figure(go.Bar(x=["a", "b"], y=[1, 2]))
    table = pd.DataFrame({"token": [hostile, "plain"], hostile: [0.123456789, float("nan")], "count": [3, 4]})
    output = StageOutput(tables={"tokens": table}, figures={"titled": titled, "untitled_key": untitled},
                         numbers={"x": 1.0}, notes=[hostile], seconds=1.5)
    stage = Stage(name="fake", title=f"Fake stage {hostile}", intro=hostile, run=lambda ctx: output)
    from interp.report.reproduction import VERDICTS

    k = len(VERDICTS)
    reproduction = pd.DataFrame({"paper": ["P"] * k, "claim": [f"claim {i} {hostile}" for i in range(k)],
                                 "paper value": ["1"] * k, "measured here": ["2 [1, 3]"] * k,
                                 "verdict": list(VERDICTS), "why": [hostile] * k, "statistic": ["s"] * k,
                                 "criterion": [hostile] * k})
    settings = ReportSettings.quick(data=hostile)
    return settings, [stage], {"fake": output}, reproduction


def test_render_html_escapes_and_captions_without_a_model():
    """The rendering functions alone, on a fake stage: hostile text in titles, notes, cells, column names
    and captions is escaped; every table has a <caption>, every figure a <figcaption> and alt text."""
    from interp.report.html import VERDICT_CLASS, _script_safe, _table_html, render_html

    settings, stages, outputs, reproduction = _fake_report(HOSTILE)
    page = render_html(settings, stages, outputs, reproduction, {"python": "3"}, 1.5, reference=HOSTILE,
                       static_pngs=lambda stem: f"figures/{stem}.png" if stem == "fake__titled" else None)
    assert "<script>window.__pwned" not in page and "<img src=x" not in page
    assert "&lt;/script&gt;&lt;script&gt;window.__pwned" in page  # shown as text, not dropped
    structure = _Structure()
    structure.feed(page)
    assert structure.viewport
    assert len(structure.tables) == 3 and all(first == "caption" for first in structure.tables), structure.tables
    assert structure.figures == 2 and len(structure.captions) == 2
    assert structure.captions[0].startswith(HOSTILE)  # the title, decoded back to the text it was
    assert structure.captions[0].endswith("(static PNG)") and "href='figures/fake__titled.png'" in page
    assert structure.captions[1] == "untitled_key"  # no title: the figure's key
    assert structure.alt == [HOSTILE, "untitled_key"]  # alt text = the caption
    assert page.count("class='plotly-graph-div'") + page.count('class="plotly-graph-div"') == 2
    for verdict, css in VERDICT_CLASS.items():
        assert f"<td class='verdict {css}'>{verdict}</td>" in page
    assert "0.1235" in page and "NaN" in page  # floats as before: 4 significant digits
    assert "<script src='plotly.min.js'></script>" in page

    single = render_html(settings, stages, outputs, reproduction, {"python": "3"}, 1.5, plotly_js="var plotly=1;")
    assert "<script>var plotly=1;</script>" in single and "plotly.min.js" not in single
    assert "href='figures/" not in single
    one = str(_table_html(outputs["fake"].tables["tokens"], max_rows=1, caption=HOSTILE))
    assert one.startswith("<table class='data'><caption>&lt;/script&gt;") and "<script>" not in one
    assert "1 more rows in the CSV." in one
    with pytest.raises(ValueError, match="cannot be inlined"):
        _script_safe("x = '</script>';")


def _chromium_page(path: Path):
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
        "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--disable-quic"])
    return pw, browser


def _check_page_in_chromium(html_file: Path, n_figures: int, shot: Path) -> None:
    """Open one report page in headless Chromium: no console errors, every figure drawn with marks and
    captioned, nothing from the data ran, and a screenshot that is not blank."""
    from PIL import Image

    pw, browser = _chromium_page(html_file)
    try:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(html_file.resolve().as_uri())
        page.wait_for_load_state("load")
        page.wait_for_timeout(1500)
        divs = page.eval_on_selector_all(
            "div.plotly-graph-div",
            """els => els.map(el => {
                 const svg = el.querySelector('svg.main-svg');
                 const canvas = el.querySelector('canvas');
                 const box = el.getBoundingClientRect();
                 const marks = el.querySelectorAll('g.trace path, g.trace image, .heatmaplayer image, .hm image,'
                                                  + ' .boxlayer path, .barlayer path, .scatterlayer path').length;
                 const labelled = el.closest('[role=img]');
                 const caption = el.closest('figure') && el.closest('figure').querySelector('figcaption');
                 return {id: el.id, svg: !!svg, canvas: !!canvas, w: box.width, h: box.height, marks: marks,
                         label: labelled ? labelled.getAttribute('aria-label') : '',
                         caption: caption ? caption.textContent : ''};
               })""")
        assert errors == [], errors
        assert len(divs) == n_figures > 0
        for div in divs:
            assert (div["svg"] or div["canvas"]) and div["w"] > 100 and div["h"] > 100, div
            assert div["marks"] > 0, div
            assert div["label"] and div["caption"].startswith(div["label"]), div  # alt text = the caption
        assert page.evaluate("window.__pwned === undefined")
        assert page.evaluate("[...document.querySelectorAll('table')].every(t => t.caption && t.caption.textContent)")
        page.screenshot(path=str(shot), full_page=False)
        image = Image.open(io.BytesIO(shot.read_bytes())).convert("L")
        low, high = image.getextrema()
        assert high - low > 100, (low, high)  # not a blank page
        assert len(set(image.getdata())) > 20
    finally:
        browser.close()
        pw.stop()


@pytest.mark.browser
def test_report_renders_in_headless_chromium(quick_report, single_file_report, tmp_path):
    """Both pages render: index.html beside plotly.min.js, and report.html copied alone into an empty
    folder (it travels: plotly.js is inside it)."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: run `make chromium` (the Makefile installs it).")
    out, _ = quick_report
    n_figures = sum(1 for _ in (out / "stages").glob("*/*.plotly.json"))
    shot = tmp_path / "report.png"
    _check_page_in_chromium(out / "index.html", n_figures, shot)
    shutil.copy(shot, out / "screenshot.png")
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(single_file_report, alone / "report.html")
    assert [p.name for p in alone.iterdir()] == ["report.html"]
    _check_page_in_chromium(alone / "report.html", n_figures, tmp_path / "single.png")


def test_precision_check_compares_the_report_dtype_with_float32(monkeypatch):
    """A bf16 report shows how far bf16 moves the reference's per-example NLL, beside the smallest
    quantization effect; checked against two independent nll() runs of the same tiny model."""
    import copy
    from types import SimpleNamespace

    import pandas as pd
    import torch

    import interp
    from interp.report.stages import quantization

    full = interp.tiny_model("llama", seed=3)
    half = copy.deepcopy(full)  # the same weights, in bf16
    half.original_model.to(torch.bfloat16)
    rows = interp.Examples.from_tokens(torch.randint(0, 256, (6, 12), generator=torch.Generator().manual_seed(0)))
    monkeypatch.setattr(quantization.models, "load_model", lambda *a, **k: full)
    ctx = SimpleNamespace(settings=SimpleNamespace(dtype="bfloat16", model="tiny", device="cpu", batch_size=4),
                          examples=rows, progress=False)
    reference = interp.nll(half, rows, batch_size=4)
    errors = pd.DataFrame({"a": [0.5] * 6, "b": [-0.01, 0.03, 0.02, 0.0, 0.01, 0.01]})
    table = quantization._precision_check(ctx, reference, errors)
    expected = (reference.double() - interp.nll(full, rows, batch_size=4).double()).abs()
    row = table.iloc[0]
    assert row["mean |difference| (nats)"] == pytest.approx(float(expected.mean()), rel=0, abs=1e-12)
    assert row["max |difference| (nats)"] == pytest.approx(float(expected.max()), rel=0, abs=1e-12)
    assert row["mean |difference| (nats)"] > 0  # bf16 really moved the NLL
    assert row["smallest method"] == "b"
    assert row["ratio"] == pytest.approx(0.01 / float(expected.mean()), rel=1e-9)


def test_saobp_training_stage_finds_the_committed_seed_logs():
    """The default log folder is this checkout's docs/data/saobp_seeds (a path relative to the stage's
    module, which moved in the restructure: the report then silently said "not measured")."""
    from interp.report.stages.saobp_training import saobp_log_folder, saobp_seed_table

    folder = saobp_log_folder("")
    assert folder == Path(__file__).resolve().parents[1] / "docs" / "data" / "saobp_seeds"
    table = saobp_seed_table(folder)
    assert len(table) == len(list(folder.glob("seed*/log.csv"))) >= 3
    assert table["loss_diff"].notna().all()
