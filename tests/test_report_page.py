"""The report page says what it found: a synthesis generated from the verdicts, verdict rows that link to
their figure and table, collapsed tables with their CSV, the smoke-run banner, the run's provenance, and
``interp lens`` saying where a lens is uninformative. No model: fake stage outputs and constructed curves."""

from __future__ import annotations

import math
import urllib.parse
from html.parser import HTMLParser
from io import StringIO

import pandas as pd
import plotly.graph_objects as go
import pytest
import scipy.stats as sps
import torch
from test_cli_lens import model_folder  # noqa: F401  (a fixture: a tiny random Llama folder)

from interp.report import reproduction as rp
from interp.report.context import ReportSettings, Stage, StageOutput
from interp.report.html import csv_data_uri, provenance, provenance_text, render_html, synthesis
from interp.report.stages.reproduction_table import reproduction_table
from interp.stats import Estimate

# verdicts that judge the data (a smoke run and a small n must show none of them)
JUDGING = (rp.AS_STRONG, rp.CONSISTENT, rp.WEAKER, rp.NOT_SHOWN, rp.CONTRADICTED)


def _measured(n: int) -> dict[str, StageOutput]:
    """Two fake stages that measured five claims on ``n`` examples, each with its figure and table."""
    def est(value: float, low: float, high: float) -> list:
        return [value, low, high, n]

    claims_a = {"agreement": {"estimates": {"pearson": est(0.9, 0.85, 0.95)}, "text": "0.90 [0.85, 0.95]",
                              "untestable": None},
                "norm_error": {"estimates": {"r_3bit": est(0.3, 0.2, 0.4)}, "text": "0.30 [0.20, 0.40]",
                               "untestable": None}}
    claims_b = {"restoration": {"estimates": {"recovery": est(0.1, 0.05, 0.15)}, "text": "10% [5%, 15%]",
                                "untestable": None},
                "gate_input": {"estimates": {"diff": est(0.2, 0.1, 0.3)}, "text": "NLL difference 0.2",
                               "untestable": None},
                "kurtosis": {"estimates": {"diff": est(0.0, -0.1, 0.1)}, "text": "0.0 [-0.1, 0.1]",
                             "untestable": None}}
    fig = go.Figure(go.Scatter(x=[0, 1], y=[1, 2]))
    table = pd.DataFrame({"layer": [0, 1], "value": [0.5, 0.25], "note": ["a, b", 'quote "x"']})
    agreement = StageOutput(tables={"paper_protocol": table, "pairs": table}, figures={"agreement": fig},
                            numbers={"claims": claims_a})
    restoration = StageOutput(tables={"restoration": table}, figures={"restoration": fig, "other": fig},
                              numbers={"claims": claims_b})
    return {"agreement": agreement, "restoration": restoration}


def _stages(outputs: dict[str, StageOutput]) -> list[Stage]:
    return [Stage(name, name.title(), "intro", run=lambda ctx, o=o: o) for name, o in outputs.items()]


def _page(n: int = 50, smoke: str = "") -> tuple[str, pd.DataFrame]:
    outputs = _measured(n)
    settings = ReportSettings.quick()
    table = reproduction_table(outputs, settings, smoke)
    run = {"commit": "a" * 40, "dirty": True, "torch": "2.x", "threads": 2, "cpu capability": "AVX2",
           "ATEN_CPU_CAPABILITY": "avx2"}
    page = render_html(settings, _stages(outputs), outputs, table, {"python": "3"}, 1.0, run=run, smoke=smoke)
    return page, table


class _Page(HTMLParser):
    """Ids, in-page links, the verdict cells' text, and each table's enclosing <details> (or None)."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.verdicts: list[str] = []
        self.tables: list[tuple[str, bool]] = []  # (class, inside a <details>)
        self._open: list[str] = []
        self._verdict = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "a" and (a.get("href") or "").startswith("#"):
            self.links.append(a["href"][1:])
        if tag == "table":
            self.tables.append((a.get("class") or "", "details" in self._open))
        if tag == "td" and "verdict" in (a.get("class") or "").split():
            self._verdict = True
            self.verdicts.append("")
        if tag not in ("br", "meta", "col", "img", "input", "link"):
            self._open.append(tag)

    def handle_endtag(self, tag):
        if tag == "td":
            self._verdict = False
        if tag in self._open:
            while self._open and self._open.pop() != tag:
                pass

    def handle_data(self, data):
        if self._verdict:
            self.verdicts[-1] += data


def _parsed(page: str) -> _Page:
    parsed = _Page()
    parsed.feed(page)
    return parsed


def test_every_in_page_link_has_a_target_and_every_row_links_its_figure_and_table():
    page, table = _page()
    parsed = _parsed(page)
    assert parsed.links and all(target in parsed.ids for target in parsed.links), \
        [t for t in parsed.links if t not in parsed.ids]
    for key, figure, data in (("agreement", "agreement-agreement", "agreement-paper_protocol"),
                              ("restoration", "restoration-restoration", "restoration-restoration"),
                              ("gate_input", "restoration-restoration", "restoration-restoration")):
        row = page[page.index(f"<tr id='claim-{key}'>"):]
        row = row[:row.index("</tr>")]
        assert f"href='#figure-{figure}'" in row and f"href='#table-{data}'" in row, key
    measured = {"agreement", "norm_error", "restoration", "gate_input", "kurtosis"}
    assert {f"claim-{k}" for k in rp.CLAIMS} <= parsed.ids  # every row has its anchor for the synthesis
    assert sum(f"claim-{k}" in parsed.links for k in measured) == len(measured)


def test_raw_tables_are_collapsed_and_link_their_csv():
    page, _ = _page()
    parsed = _parsed(page)
    raw = [(cls, inside) for cls, inside in parsed.tables if "repro" not in cls]
    assert raw and all(inside for _, inside in raw), parsed.tables
    assert [inside for cls, inside in parsed.tables if "repro" in cls] == [False]  # the verdicts stay open
    for name in ("agreement__paper_protocol", "agreement__pairs", "restoration__restoration", "reproduction"):
        assert f"href='tables/{name}.csv' download" in page
    assert "class='scroll'" in page


def test_a_csv_data_link_carries_the_table_exactly():
    table = pd.DataFrame({"token": ["a, b", 'say "hi"', "é\nnewline"], "value": [0.1, float("nan"), 3.0]})
    uri = csv_data_uri(table)
    assert uri.startswith("data:text/csv;charset=utf-8,") and "\n" not in uri and "'" not in uri
    back = pd.read_csv(StringIO(urllib.parse.unquote(uri.split(",", 1)[1])))
    pd.testing.assert_frame_equal(back, table)


def test_the_synthesis_is_generated_from_the_verdicts():
    """Changing one verdict in the results changes the sentences: the claim moves between groups."""
    _, table = _page()
    links = {"agreement": {"figure": "#figure-agreement-agreement"}}
    claim = rp.CLAIMS["agreement"].claim
    table = table.copy()
    row = table.index[table["claim"] == claim][0]
    table.loc[row, "verdict"] = rp.AS_STRONG
    before = "\n".join(synthesis(table, links, "M"))
    table.loc[row, "verdict"] = rp.CONTRADICTED
    table.loc[row, "why"] = "the whole interval lies on the other side of 0"
    after = "\n".join(synthesis(table, links, "M"))
    assert before != after

    def group_of(text: str, group: str) -> str:
        start = text.index(f"<b>{group}</b>")
        return text[start:text.index("</ul>", start)]

    assert claim in group_of(before, "Reproduced") and "Contradicted" not in before.split("<ul>")[0]
    assert claim in group_of(after, "Contradicted") and "the other side of 0" in group_of(after, "Contradicted")
    assert "href='#figure-agreement-agreement'" in group_of(after, "Contradicted")
    reproduced = int((table["verdict"].isin([rp.AS_STRONG, rp.CONSISTENT])).sum())
    assert f"{reproduced} reproduced" in after and f"{reproduced + 1} reproduced" in before
    other_way = "points the other way for <a href='#claim-agreement'>"
    assert other_way in after and other_way not in before  # the per-paper meaning follows the verdict


def test_below_the_minimum_n_the_row_shows_the_measurement_and_no_verdict():
    page, table = _page(n=rp.MIN_EXAMPLES - 1)
    measured = table[table["measured here"] != "not run"]
    assert set(measured["verdict"]) <= {rp.TOO_FEW, rp.NOT_TESTABLE}, measured[["claim", "verdict"]]
    assert (measured["verdict"] == rp.TOO_FEW).sum() == 5  # all five measured claims count examples
    assert "10% [5%, 15%]" in page  # the measurement is still shown
    assert not set(_parsed(page).verdicts) & set(JUDGING)
    _, enough = _page(n=2 * rp.MIN_EXAMPLES)
    assert rp.TOO_FEW not in set(enough["verdict"])


def test_the_minimum_n_is_where_a_bootstrap_interval_covers_90_percent():
    """MIN_EXAMPLES against the coverage of a nominal 95% percentile bootstrap interval of a normal mean,
    computed independently: half-width z sqrt((n-1)/n) s/sqrt(n), so coverage P(|t_{n-1}| <= z sqrt((n-1)/n))."""
    def coverage(n: int) -> float:
        return float(2 * sps.t.cdf(sps.norm.ppf(0.975) * math.sqrt((n - 1) / n), n - 1) - 1)

    assert coverage(rp.MIN_EXAMPLES) >= 0.90 > coverage(rp.MIN_EXAMPLES - 1)
    j = rp.judge("restoration", rp.Measurement({"recovery": Estimate(0.1, 0.05, 0.15, 2)}))
    assert j.verdict == rp.TOO_FEW and "2 examples" in j.reason


def test_a_smoke_run_has_the_banner_and_no_verdict():
    page, table = _page(n=200, smoke="It ran 20 examples.")
    assert "A smoke run: it concludes nothing." in page and "id='smoke'" in page
    assert page.index("id='smoke'") < page.index("id='summary'") < page.index("id='reproduction'")
    verdicts = set(_parsed(page).verdicts)
    assert verdicts and not verdicts & set(JUDGING), verdicts
    assert set(table["verdict"]) <= {rp.TOO_FEW, rp.NOT_TESTABLE, rp.BY_CONSTRUCTION, rp.DIAGNOSTIC}
    plain, _ = _page(n=200)
    assert "A smoke run" not in plain and set(_parsed(plain).verdicts) & set(JUDGING)


def test_the_page_opens_with_the_synthesis_and_names_the_run_in_its_footer():
    page, _ = _page()
    assert page.index("What this run found</h2>") < page.index("id='reproduction'") < page.index("<figure")
    assert "commit aaaaaaaaaaaa (with uncommitted changes)" in page
    assert "2 thread(s), CPU kernels AVX2 (ATEN_CPU_CAPABILITY avx2)" in page


def test_provenance_records_commit_threads_and_kernels(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    run = provenance()
    assert set(run) == {"commit", "dirty", "torch", "threads", "cpu capability", "ATEN_CPU_CAPABILITY"}
    assert run["threads"] == torch.get_num_threads() and run["torch"] == torch.__version__
    assert run["cpu capability"] == torch.backends.cpu.get_cpu_capability()
    assert run["ATEN_CPU_CAPABILITY"] == "avx2"
    assert run["commit"] == "unknown" or (len(run["commit"]) == 40 and isinstance(run["dirty"], bool))
    assert "unknown" in provenance_text({**run, "commit": "unknown", "dirty": None})


def _curves(ref_means: list[float], vocab: int):
    """Constructed early-exit curves: the reference's per-layer NLL (two identical examples) and a quantized
    curve 0.5 nats above it."""
    from interp.localize.lens import EarlyExitCurves, EarlyExitResult

    layers = list(range(len(ref_means)))

    def result(shift: float) -> EarlyExitResult:
        nll = torch.tensor([[m + shift] * 2 for m in ref_means], dtype=torch.float32)
        return EarlyExitResult(nll=nll, layers=layers, ids=["a", "b"], at="resid_post", settings={})

    return EarlyExitCurves(results={"reference / D_large": result(0.0), "quantized / D_large": result(0.5),
                                    "reference / D_ctrl": result(0.0), "quantized / D_ctrl": result(0.5)},
                           models=["reference", "quantized"], sets=["D_large", "D_ctrl"])


def test_lens_says_where_the_logit_lens_is_uninformative():
    from interp.cli.lens import lens_verdict, uninformative_layers

    vocab = 1000  # ln V = 6.91
    curves = _curves([17.5, 12.0, 7.0, 6.0, 3.0, 2.0], vocab)
    assert uninformative_layers(curves, vocab) == [0, 1, 2]
    text = lens_verdict(curves, vocab, "logit")
    assert "uninformative at 3 of 6 layers (layers 0-2)" in text and "17.5 nats" in text
    assert "ln |V| = 6.9" in text and "--lens tuned" in text
    assert "--lens tuned" not in lens_verdict(curves, vocab, "tuned")
    good = _curves([6.0, 5.0, 3.0], vocab)
    assert uninformative_layers(good, vocab) == [] and "at every layer" in lens_verdict(good, vocab, "logit")


def test_lens_tuned_is_refused_before_a_model_loads_where_it_cannot_run(monkeypatch):
    import argparse

    from interp.cli.lens import _check_lens
    from interp.errors import InterpError

    with pytest.raises(InterpError, match="--lens tuned decodes the block outputs"):
        _check_lens(argparse.Namespace(lens="tuned", at="resid_mid"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")  # torchrun sets both (one without the other is refused)
    with pytest.raises(InterpError, match="one process"):
        _check_lens(argparse.Namespace(lens="tuned", at="resid_post"))
    _check_lens(argparse.Namespace(lens="logit", at="resid_mid"))  # the logit lens runs anywhere


@pytest.mark.slow
def test_lens_cli_reads_a_tuned_lens_and_flags_the_uninformative_layers(
        model_folder, tmp_path, monkeypatch, capsys, one_thread):  # noqa: F811
    """`interp lens --lens tuned` end to end on a tiny random Llama folder: the tuned lens is fitted once into
    the cache and reused by a rerun; the logit lens of a random model is no better than uniform somewhere,
    and the command says so and offers the tuned lens."""
    import json

    from interp.cli.main import main
    from interp.models import TINY_VOCAB

    monkeypatch.setenv("INTERP_CACHE", str(tmp_path / "cache"))
    docs = [f"Document {i}: " + " ".join(f"word{(i * 7 + j) % 23}" for j in range(12)) for i in range(200)]
    (tmp_path / "docs.txt").write_text("\n\n".join(docs) + "\n")

    def run(lens: str, out: str) -> tuple[dict, str]:
        args = ["lens", "--model", str(model_folder / "model"), "--data", str(tmp_path / "docs.txt"), "--n", "10",
                "--seq-len", "16", "--method", "rtn:bits=3,group=32", "--top", "0.2", "--calibration-n", "8",
                "--experiments", "early-exit", "--lens", lens, "--out", str(tmp_path / out), "--quiet"]
        assert main(args) == 0
        return json.loads((tmp_path / out / "settings.json").read_text()), capsys.readouterr().out

    logit, said = run("logit", "logit")
    assert logit["lens"] == "logit" and logit["log_vocab"] == pytest.approx(math.log(TINY_VOCAB))
    table = pd.read_csv(tmp_path / "logit" / "early_exit.csv")
    worse = [int(layer) for layer, nll in zip(table["layer"], table["reference / D_large"], strict=True)
             if nll >= math.log(TINY_VOCAB)]
    assert logit["uninformative_layers"] == worse  # recomputed from the written curve
    if worse:
        assert "uninformative" in said and "--lens tuned" in said
    tuned, said = run("tuned", "tuned")
    fits = sorted((tmp_path / "cache" / "tuned_lens").glob("*.safetensors"))
    assert tuned["lens"] == "tuned" and len(fits) == 1 and "Early exit, tuned lens" in said
    stamp = fits[0].stat().st_mtime_ns
    run("tuned", "tuned-again")
    assert fits[0].stat().st_mtime_ns == stamp  # the rerun read the cached fit
    assert not pd.read_csv(tmp_path / "tuned" / "early_exit.csv").equals(table)
