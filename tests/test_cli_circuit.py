"""`interp circuit` end to end: a prompt pair from the command line or a JSONL file gives the tables, the
figures and one offline HTML page; bad input is one line and exit 2, before any model loads."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pandas as pd
import pytest
from plotly.offline import get_plotlyjs
from test_cli_lens import model_folder  # noqa: F401  (a fixture: the tiny model folder)

import interp
from interp.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")  # one_thread: conftest.py

CLEAN, CORRUPT = "When Mary and John went, John gave it to", "When Mary and John went, Anna gave it to"
OUTPUTS = ["circuit.html", "settings.json", "figures/plotly.min.js",
           *(f"figures/{n}.html" for n in ("dla_heads", "edges", "confirmed", "attention")),
           *(f"tables/{n}.csv" for n in ("pairs", "dla_heads", "dla_layers", "edges", "confirmed", "attention"))]


@pytest.fixture(scope="module")
def model(model_folder):  # noqa: F811
    """test_cli_lens's tiny llama folder (byte tokenizer: one token a character, so answers are letters)."""
    return str(model_folder / "model")


def no_url_outside_plotly_js(page: str) -> list[str]:
    """Every http(s) or protocol-relative URL of the page once the inlined plotly.js is taken out, and every
    ``src=``/``href=`` attribute or CSS ``url(``/``@import`` that could fetch something (an offline page has none)."""
    js = get_plotlyjs()
    assert page.count(js) == 1  # plotly.js inlined once, as its own source
    rest = page.replace(js, "")
    found = re.findall(r"(?:https?:)?//[\w.-]+\.\w+[^\s\"'<>]*", rest)
    found += re.findall(r"\b(?:src|href)\s*=\s*[\"']?[^\s\"'>]+", rest)
    found += re.findall(r"url\(|@import", rest)
    return found


def test_a_pair_from_the_command_line_writes_the_page_tables_and_figures(model, tmp_path, capsys,
                                                                         no_network, monkeypatch):
    monkeypatch.delenv("BROWSER_PATH", raising=False)  # PNG export (seconds of Chromium): the SmolLM2 test's
    out = tmp_path / "circuit"
    code = main(["circuit", "--model", model, "--clean", CLEAN, "--corrupt", CORRUPT, "--answer", "M",
                 "--wrong", "J", "--top", "3", "--movers", "1", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    for name in OUTPUTS:
        assert (out / name).is_file(), name
    page = (out / "circuit.html").read_text(encoding="utf-8")
    assert no_url_outside_plotly_js(page) == []
    assert "<code>&#x27;M&#x27;</code>" in page  # the answers as typed, escaped
    confirmed = pd.read_csv(out / "tables" / "confirmed.csv")
    assert len(confirmed) == 3 and list(confirmed["rank"]) == [1, 2, 3]
    attention = pd.read_csv(out / "tables" / "attention.csv", keep_default_na=False)
    tokenizer = interp.load_model(model).tokenizer
    assert list(attention["token"]) == [tokenizer.decode([t]) for t in
                                        interp.examples_from_texts([CLEAN], tokenizer).tokens[0].tolist()]
    assert json.loads((out / "settings.json").read_text())["pairs"][0]["answer"] == "M"
    assert "EAP's top edges against exact path patching" in capsys.readouterr().out


def test_pairs_from_a_jsonl_file(model, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"clean": CLEAN, "corrupt": CORRUPT, "answer": "M", "wrong": "J"},
            {"clean": "Then Tom and Ann ate, Ann passed it to", "corrupt": "Then Tom and Ann ate, Bob passed it to",
             "answer": "T", "wrong": 65}]  # an answer may be a token id
    pairs.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    out = tmp_path / "out"
    assert main(["circuit", "--model", model, "--pairs", str(pairs), "--top", "2", "--movers", "0",
                 "--out", str(out)]) == 0
    assert len(pd.read_csv(out / "tables" / "pairs.csv")) == 2
    assert not (out / "figures" / "attention.html").exists()  # no movers: no attention figure
    assert set(pd.read_csv(out / "tables" / "edges.csv")["receiver"]) == {"logits"}


BAD = [
    (["--clean", CLEAN, "--corrupt", CORRUPT, "--answer", "M"], "Missing --wrong"),
    (["--clean", CLEAN, "--corrupt", "  ", "--answer", "M", "--wrong", "J"], "--corrupt is empty"),
    (["--clean", CLEAN, "--corrupt", CORRUPT, "--answer", "", "--wrong", "J"], "--answer is empty"),
    (["--pairs", "PAIRS", "--clean", CLEAN], "either --pairs FILE or"),
    (["--pairs", "missing.jsonl"], "no such file"),
]
BAD_FILES = [
    ("{not json}\n", "line 1 is not JSON"),
    ('["a", "b"]\n', "line 1 is a JSON list"),
    ('{"clean": "a b", "corrupt": "a c", "answer": " x"}\n', "line 1 lacks wrong"),
    ('\n{"clean": "a b", "corrupt": "a c", "answer": " x", "wrong": 3.5}\n', "line 2: field 'wrong' must be a string"),
    ("\n\n", "holds no prompt pairs"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[m for _, m in BAD])
def test_bad_arguments_are_one_line_before_the_model_loads(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(interp.models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "PAIRS").write_text(json.dumps({"clean": "a", "corrupt": "b", "answer": " a", "wrong": " b"}))
    argv = [str(tmp_path / a) if a in ("PAIRS", "missing.jsonl") else a for a in argv]
    assert main(["circuit", *argv, "--model", "smollm2-135m", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("text, message", BAD_FILES, ids=[m for _, m in BAD_FILES])
def test_a_bad_pairs_file_is_one_line_before_the_model_loads(text, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(interp.models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(text)
    assert main(["circuit", "--pairs", str(pairs), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_a_multi_token_answer_is_one_line_that_shows_its_tokens(model, tmp_path, capsys):
    assert main(["circuit", "--model", model, "--clean", CLEAN, "--corrupt", CORRUPT, "--answer",
                 " Mary", "--wrong", "J", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "answer ' Mary' is 5 tokens" in err and "' ', 'M', 'a', 'r', 'y'" in err and err.count("\n") == 1


@pytest.mark.slow
@pytest.mark.integration
def test_smollm2_on_an_ioi_pair(smol, tmp_path, monkeypatch, capsys, no_network):
    """The bundled model (the session's copy, not loaded again) on the notebook-07 prompt: the head with the
    largest direct effect is the name mover the notebook finds, 23.3, and path patching confirms EAP's top edge
    in sign."""
    asked = []
    monkeypatch.setattr(interp.models, "load_model", lambda name, **k: asked.append(name) or smol)
    out = tmp_path / "smol"
    assert main(["circuit", "--clean", "When Mary and John went to the store, John gave a drink to",
                 "--corrupt", "When Mary and John went to the store, Anna gave a drink to", "--answer", " Mary",
                 "--wrong", " John", "--top", "3", "--movers", "1", "--out", str(out)]) == 0, capsys.readouterr().err
    assert asked == ["smollm2-135m"]
    for name in OUTPUTS:
        assert (out / name).is_file(), name
    assert no_url_outside_plotly_js((out / "circuit.html").read_text(encoding="utf-8")) == []
    confirmed = pd.read_csv(out / "tables" / "confirmed.csv")
    assert bool(confirmed.loc[0, "agree"])
    browser = os.environ.get("BROWSER_PATH", "")
    if browser and Path(browser).exists():  # static figures beside the pages when a Chromium is named
        assert all((out / "figures" / f"{n}.png").is_file() for n in ("dla_heads", "edges", "confirmed", "attention"))
    assert json.loads((out / "settings.json").read_text())["movers_found"] == ["head 23.3"]
    labels = pd.read_csv(out / "tables" / "attention.csv")["token"].tolist()
    assert labels.count(" John") == 2  # the repeated name: figures label it John·k (tests/test_circuit_api.py)
