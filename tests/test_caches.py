"""A cached result is reused only if everything it was computed from is identical (docs/reliability.md).

Two caches reuse results across calls: the report's finished stages (and its batch parts and scores), and the
token cache of :func:`interp.load_examples`. Both key them with :func:`interp.digests.cache_key`, from digests
of the inputs' content. Each input is changed here *at the same path* (with the file's modification time put
back, so nothing but the content differs): the weights, the ``--data`` file, the tokenizer, the code and a
setting. The rerun must compute again and give what a fresh run on the new inputs gives; with nothing changed
it must reuse. Each property is also run with its one place switched off, and must then fail.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

import interp
from interp import data as data_module
from interp import digests
from interp.report import context as report_context
from interp.report.context import ReportSettings
from interp.report.run import run_report

WORDS = "alpha beta gamma delta epsilon zeta theta kappa sigma omega".split()
CHANGES = ["weights", "data", "tokenizer", "code", "settings", "nothing"]


def write_documents(path: Path, seed: int = 0, n: int = 60) -> Path:
    rng = random.Random(seed)
    path.write_text("\n\n".join(" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(n)))
    return path


def keep_times(paths: list[Path]):
    """Put back the modification times of ``paths`` after they are rewritten: only the content differs."""
    times = {p: os.stat(p).st_mtime_ns for p in paths}

    def restore() -> None:
        for p, t in times.items():
            os.utime(p, ns=(t, t))
    return restore


def swap_tokens(folder: Path) -> None:
    """Give two byte tokens of the tokenizer each other's ids (same file size, same vocabulary size)."""
    path = folder / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["e"] = vocab["e"], vocab["a"]
    path.write_text(json.dumps(spec))


def change(kind: str, folder: Path, documents: Path, monkeypatch) -> dict:
    """Change one input in place; returns the settings overrides for the rerun."""
    files = [p for p in folder.iterdir()] + [documents]
    restore = keep_times(files)
    if kind == "weights":
        interp.models.export_hf(interp.tiny_model("llama", seed=1), folder)  # same files, other weights
    elif kind == "data":
        documents.write_text(documents.read_text().upper())  # same size, other text
    elif kind == "tokenizer":
        swap_tokens(folder)
    elif kind == "code":  # as if interp's source had been edited
        monkeypatch.setattr(digests, "code_fingerprint", lambda: "0" * 64)
    restore()
    return {"seed": 1} if kind == "settings" else {}


def report(out: Path, folder: Path, documents: Path, **overrides) -> dict:
    settings = ReportSettings.quick(model=str(folder), data=str(documents), n=8, seq_len=16, batch_size=4,
                                    **overrides)
    return run_report(out, settings, stages=["probes"], progress=False, static=False)


def rerun_problems(tmp: Path, kind: str, monkeypatch) -> list[str]:
    """A report, one input changed in place, the report rerun in the same folder: what went wrong."""
    folder, documents = tmp / "tiny", write_documents(tmp / "docs.txt")
    interp.models.export_hf(interp.tiny_model("llama", seed=0), folder)
    first = report(tmp / "out", folder, documents)
    done = tmp / "out" / "stages" / "probes" / "done.json"
    before = done.read_bytes()
    overrides = change(kind, folder, documents, monkeypatch)
    again = report(tmp / "out", folder, documents, **overrides)
    fresh = report(tmp / f"fresh-{kind}", folder, documents, **overrides)
    problems = []
    reused = again["provenance"]["stages"]["probes"]["reused"]
    if kind == "nothing":
        if not reused or done.read_bytes() != before:
            problems.append("recomputed with nothing changed")
        if again["numbers"] != first["numbers"]:
            problems.append("other numbers with nothing changed")
        return problems
    if reused or done.read_bytes() == before:
        problems.append(f"reused after the {kind} changed")
    if again["numbers"] != fresh["numbers"]:
        problems.append(f"numbers differ from a fresh run after the {kind} changed")
    if kind != "code" and again["numbers"] == first["numbers"]:  # an edit may leave the numbers as they were
        problems.append(f"the {kind} change did not change the numbers (the test shows nothing)")
    return problems


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INTERP_CACHE", str(tmp_path / "cache"))
    data_module._TOKEN_CACHE.clear()


@pytest.mark.parametrize("kind", CHANGES)
def test_a_report_rerun_recomputes_a_stage_exactly_when_an_input_changed(tmp_path, monkeypatch, kind):
    assert rerun_problems(tmp_path, kind, monkeypatch) == []


def test_a_report_reuses_stale_stages_when_keyed_by_settings_alone(tmp_path, monkeypatch):
    """The mutation check: with the report's inputs reduced to its settings (paths, not content: the rule
    before this change), a new --data file at the same path is silently reused."""
    monkeypatch.setattr(report_context, "report_inputs", lambda s: {"settings": s.key()})
    assert rerun_problems(tmp_path, "data", monkeypatch) == [
        "reused after the data changed", "numbers differ from a fresh run after the data changed",
        "the data change did not change the numbers (the test shows nothing)"]  # the old numbers came back


def test_each_stage_records_where_it_was_computed(tmp_path, monkeypatch):
    """A resumed report shows which stages came from which run: each stage keeps its own provenance."""
    folder, documents = tmp_path / "tiny", write_documents(tmp_path / "docs.txt")
    interp.models.export_hf(interp.tiny_model("llama", seed=0), folder)
    settings = ReportSettings.quick(model=str(folder), data=str(documents), n=8, seq_len=16, batch_size=4)
    run_report(tmp_path / "out", settings, stages=["probes"], progress=False, static=False)
    import interp.report.html as html

    monkeypatch.setattr(html, "provenance", lambda: {"commit": "f" * 40, "dirty": False, "torch": "x",
                                                     "threads": 7, "cpu capability": "K", "ATEN_CPU_CAPABILITY": ""})
    import interp.report.run as run

    monkeypatch.setattr(run, "provenance", html.provenance)
    results = run_report(tmp_path / "out", settings, stages=["probes", "attention"], progress=False, static=False)
    stages = results["provenance"]["stages"]
    assert stages["probes"]["reused"] and stages["probes"]["commit"] != "f" * 40  # from the first run
    assert not stages["attention"]["reused"] and stages["attention"]["threads"] == 7  # this run
    assert stages["probes"]["inputs"] == stages["attention"]["inputs"] and stages["probes"]["machine"]
    page = (tmp_path / "out" / "index.html").read_text()
    assert "reused from an earlier run" in page and "7 thread(s)" in page


# ---------------------------------------------------------------------------------------
# The token cache of load_examples


def token_cache_problems(tmp: Path, kind: str) -> list[str]:
    """Rows from a data file and a tokenizer folder; one of them changed at the same path; rows again."""
    from transformers import AutoTokenizer

    from interp.loading import pretrained

    documents = write_documents(tmp / "docs.txt")
    folder = tmp / "tokenizer"
    interp.models.tiny_tokenizer().save_pretrained(folder)
    first_tokenizer = pretrained(AutoTokenizer, folder)
    interp.load_examples(documents, first_tokenizer, n=6, seq_len=12, split="all")
    restore = keep_times([documents, *folder.iterdir()])
    if kind == "data":
        documents.write_text(documents.read_text().upper())
    else:
        swap_tokens(folder)
    restore()
    tokenizer = pretrained(AutoTokenizer, folder)
    again = interp.load_examples(documents, tokenizer, n=6, seq_len=12, split="all")
    data_module._TOKEN_CACHE.clear()
    fresh = interp.load_examples(documents, tokenizer, n=6, seq_len=12, split="all")
    return [] if torch.equal(again.tokens, fresh.tokens) else [f"stale token ids after the {kind} changed"]


@pytest.mark.parametrize("kind", ["data", "tokenizer"])
def test_the_token_cache_never_serves_ids_of_another_text_or_tokenizer(tmp_path, kind):
    assert token_cache_problems(tmp_path, kind) == []


@pytest.mark.parametrize(("kind", "digest", "unsafe"), [
    ("data", "texts_digest", lambda texts: str(len(texts))),
    ("tokenizer", "tokenizer_digest", lambda tokenizer: f"{tokenizer.name_or_path}|{len(tokenizer)}")])
def test_the_token_cache_serves_stale_ids_when_keyed_by_name(tmp_path, monkeypatch, kind, digest, unsafe):
    """The mutation check: with a key made of the path and sizes (the rule before this change), the same
    calls get the old ids."""
    monkeypatch.setattr(data_module, digest, unsafe)
    assert token_cache_problems(tmp_path, kind) == [f"stale token ids after the {kind} changed"]


def test_cache_key_needs_every_input_as_a_digest():
    with pytest.raises(ValueError, match="digest"):
        digests.cache_key(settings="")
    assert digests.cache_key(a="1") != digests.cache_key(a="1", b="2")


def test_scores_kept_by_a_report_go_when_the_weights_change(tmp_path):
    """The per-example scores a report keeps (``scores.sqlite``) are reused only with the same inputs: after
    new weights at the same path the rerun scores again (before, the store refused the second model)."""
    folder, documents = tmp_path / "tiny", write_documents(tmp_path / "docs.txt")
    interp.models.export_hf(interp.tiny_model("llama", seed=0), folder)
    settings = ReportSettings.quick(model=str(folder), data=str(documents), n=8, seq_len=16, batch_size=4)
    first = run_report(tmp_path / "out", settings, stages=["quantization"], progress=False, static=False)
    interp.models.export_hf(interp.tiny_model("llama", seed=1), folder)
    again = run_report(tmp_path / "out", settings, stages=["quantization"], progress=False, static=False)
    fresh = run_report(tmp_path / "fresh", settings, stages=["quantization"], progress=False, static=False)
    assert again["numbers"] == fresh["numbers"] != first["numbers"]
    inputs = json.loads((tmp_path / "out" / "inputs.json").read_text())
    assert inputs == again["provenance"]["stages"]["quantization"]["inputs"]
