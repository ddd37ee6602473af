"""The offline HTML report: a --quick run, resume, escaping, and a real headless-Chromium check."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
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
    from interp.reproduction import CLAIMS, VERDICTS

    assert [row["claim"] for row in results["reproduction"]] == [c.claim for c in CLAIMS.values()]
    for row in results["reproduction"]:
        assert row["measured here"] not in ("", None)
        assert row["verdict"] in VERDICTS and row["why"] and row["criterion"]
    assert results["reference"].startswith("GGUF Q4_1 dequantized to fp32")
    assert "Reference model: GGUF Q4_1 dequantized to fp32" in page
    shown = {row["verdict"] for row in results["reproduction"]}
    css = {"holds": "verdict-holds", "partly": "verdict-partly", "does not hold": "verdict-fails",
           "not testable here": "verdict-untestable", "by construction": "verdict-construction"}
    assert all(f"class='verdict {css[v]}'" in page for v in shown)  # every verdict cell is coloured


def test_rerun_resumes_without_recomputing(quick_report):
    out, first_seconds = quick_report
    markers = {p: p.stat().st_mtime_ns for p in (out / "stages").glob("*/done.json")}
    began = time.time()
    proc = _run_report(out, "--no-static")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {p: p.stat().st_mtime_ns for p in markers} == markers  # no stage was recomputed
    assert time.time() - began < first_seconds


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


def _chromium_page(path: Path):
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
        "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--disable-quic"])
    return pw, browser


@pytest.mark.browser
def test_report_renders_in_headless_chromium(quick_report, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: run `make chromium` (the Makefile installs it).")
    from PIL import Image

    out, _ = quick_report
    pw, browser = _chromium_page(out / "index.html")
    try:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto((out / "index.html").resolve().as_uri())
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
                 return {id: el.id, svg: !!svg, canvas: !!canvas, w: box.width, h: box.height, marks: marks};
               })""")
        assert errors == [], errors
        n_figures = sum(1 for _ in (out / "stages").glob("*/*.plotly.json"))
        assert len(divs) == n_figures > 0
        for div in divs:
            assert (div["svg"] or div["canvas"]) and div["w"] > 100 and div["h"] > 100, div
            assert div["marks"] > 0, div
        assert page.evaluate("window.__pwned === undefined")
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=False)
        image = Image.open(io.BytesIO(shot.read_bytes())).convert("L")
        low, high = image.getextrema()
        assert high - low > 100  # not a blank page
        assert len(set(image.getdata())) > 20
    finally:
        browser.close()
        pw.stop()
    shutil.copy(shot, out / "screenshot.png")
