"""Hostile command lines: every one exits with status 2, one line in interp's words, no traceback, no model.

The table below is grouped by category (bad integers, out-of-range numbers, booleans, unknown
names, bad method specs, bad layers, devices, data files, output paths, the model cache, the
``errors`` input folder, and argparse misuse). Each case runs in-process through
``interp.cli.main(argv)``. Everything that starts real work is replaced by a function that raises
:class:`WorkStarted` (a ``BaseException``, so no ``except Exception`` in the CLI can swallow it):
loading a model (``interp.models.load_model``/``tiny_model``), the SAOBP training run and the
``errors`` analyses. A hostile case that gets that far has failed: it was not validated first.

The hypothesis test builds command lines from fragments, each marked valid or not, and checks:

- if any fragment is invalid, the CLI exits with status 2, prints no traceback and starts no work;
- if every fragment is valid, the CLI starts work (``WorkStarted`` is raised) and prints nothing
  on stderr before it.
"""

from __future__ import annotations

import json
import shlex
import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


class WorkStarted(BaseException):
    """Raised instead of loading a model (or starting other heavy work) in these tests."""


def _refuse(*args, **kwargs):
    raise WorkStarted


def intercept_work(monkeypatch) -> None:
    """Replace every entry point that loads a model or starts heavy work by :func:`_refuse`."""
    import interp
    import interp.attention.train
    import interp.models
    import interp.quant.analysis

    monkeypatch.setattr(interp.models, "load_model", _refuse)
    # the package resolves interp.load_model lazily from interp.models (patched here and by the tests
    # below); a tool that materialised the lazy names would leave a bound copy that hides the patch
    if "load_model" in vars(interp):
        monkeypatch.delattr(interp, "load_model")
    monkeypatch.setattr(interp.models, "tiny_model", _refuse)
    monkeypatch.setattr(interp.attention.train, "run", _refuse)
    monkeypatch.setattr(interp.quant.analysis, "run_all", _refuse)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on CPU and GPU machines


@dataclass(frozen=True)
class Outcome:
    kind: str  # "exit" (main returned or raised SystemExit), "work" (WorkStarted) or "traceback"
    code: int | None
    err: str


def run_cli(argv: list[str], capsys) -> Outcome:
    """Run ``interp.cli.main(argv)`` and classify what a user would have seen."""
    from interp.cli.main import main

    capsys.readouterr()
    try:
        result = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return Outcome("exit", code, capsys.readouterr().err)
    except WorkStarted:
        return Outcome("work", None, capsys.readouterr().err)
    except Exception as exc:  # noqa: BLE001 - an uncaught exception is a traceback for the user
        return Outcome("traceback", None, capsys.readouterr().err + f"Traceback: {type(exc).__name__}: {exc}")
    return Outcome("exit", int(result), capsys.readouterr().err)


# ---------------------------------------------------------------------------------------
# Files the cases refer to as {d}/name


STORE_SPEC = "rtn:bits=3,group=64,zero=float"


def _store(folder: Path, models: list[str]) -> None:
    """A score store written through the store's own API, so it follows the current schema."""
    from interp.quant.store import REFERENCE, ScoreStore

    ids = [f"doc{i}" for i in range(4)]
    with ScoreStore(folder) as store:
        for k, model in enumerate(models):  # model k's error is 0.5 + 0.25 k on every example
            store.write_batch(model, REFERENCE, ids, [2.0 + i for i in range(4)])
            store.write_batch(model, STORE_SPEC, ids, [2.5 + 0.25 * k + i for i in range(4)])
    (folder / "settings.json").write_text(json.dumps({
        "model": "smollm2-135m", "specs": [STORE_SPEC],
        "examples": {"source": "wiki", "n": 4, "seq_len": 16, "seed": 0, "split": "eval"}}))


def make_files(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "good.txt").write_text("A first document with enough words.\n\nA second document, also fine.\n")
    (d / "empty.txt").write_text("")
    (d / "blank.txt").write_text("  \n\n \t\n")
    (d / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (d / "bad.jsonl").write_text('{"text": "ok"}\n{"text": unquoted}\n')
    (d / "notext.jsonl").write_text('{"id": "a", "body": "no text field"}\n')
    (d / "null.jsonl").write_text('{"id": "a", "text": null}\n')
    (d / "number.jsonl").write_text('{"id": "a", "text": 5}\n')
    (d / "list.jsonl").write_text("[1, 2, 3]\n")
    (d / "empty.csv").write_text("")
    (d / "nocol.csv").write_text("body\nhello world\n")
    (d / "header_only.csv").write_text("text\n")
    (d / "data.parquet").write_bytes(b"PAR1")
    (d / "emptydir").mkdir(exist_ok=True)
    (d / "afile").write_text("a file, not a folder\n")
    (d / "types.txt").write_text("ffn_down=q6_k\n")
    (d / "badtype.txt").write_text("blk\\.0\\.ffn_down\\.weight=q7_k\n")
    (d / "badregex.txt").write_text("blk(=q4_k\n")
    (d / "corrupt").mkdir(exist_ok=True)
    (d / "noquant").mkdir(exist_ok=True)  # a llama.cpp build with llama-perplexity but no llama-quantize
    (d / "noquant" / "llama-perplexity").write_text("#!/bin/sh\nexit 1\n")
    (d / "noquant" / "llama-perplexity").chmod(0o755)
    (d / "corrupt" / "scores.sqlite").write_bytes(b"this is not a database" * 100)
    _store(d / "store1", ["m1"])
    _store(d / "store2", ["model-a", "model-b"])
    return d


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    return make_files(tmp_path_factory.mktemp("hostile"))


# ---------------------------------------------------------------------------------------
# The table: (category, command line with {d} for the files folder, fragment expected on stderr, env)


@dataclass(frozen=True)
class Case:
    category: str
    line: str
    fragment: str = ""
    env: dict[str, str] = field(default_factory=dict)

    def argv(self, d: Path) -> list[str]:
        return shlex.split(self.line.format(d=d))


Q = "--method rtn:bits=3 --out {d}/q"  # the required options of `quantize`

CASES = [
    # -- integers that are not integers
    Case("bad int", "probe --n abc", "--n"),
    Case("bad int", "probe --n 1.5", "--n"),
    Case("bad int", "probe --seq-len x", "--seq-len"),
    Case("bad int", "attention --batch-size ''", "--batch-size"),
    Case("bad int", "score --calibration-n foo", "--calibration-n"),
    Case("bad int", "lens --threads two", "--threads"),
    Case("bad int", "train-saobp --steps 1e3", "--steps"),
    Case("bad int", "errors --scores {d}/store1 --n-boot many", "--n-boot"),
    Case("bad int", "patch --max-rows 2.0", "--max-rows"),
    Case("bad int", "probe --seed x", "--seed"),
    # -- numbers out of range
    Case("out of range", "probe --n 0", "at least 1"),
    Case("out of range", "probe --n -5", "at least 1"),
    Case("out of range", "probe --seq-len 1", "at least 2"),
    Case("out of range", "report --seq-len 0", "at least 2"),
    Case("out of range", "probe --batch-size 0", "at least 1"),
    Case("out of range", "attention --batch-size -1", "at least 1"),
    Case("out of range", "lens --top 0", "--top"),
    Case("out of range", "lens --top 1.5", "--top"),
    Case("out of range", "lens --top nan", "--top"),
    Case("out of range", "patch --max-rows 0", "at least 1"),
    Case("out of range", "train-saobp --steps 0", "at least 1"),
    Case("out of range", "train-saobp --steps -3", "at least 1"),
    Case("out of range", "train-saobp --threads 0", "at least 1"),
    Case("out of range", "score --threads -1", "at least 1"),
    Case("out of range", f"quantize {Q} --calibration-n 0", "at least 1"),
    Case("out of range", "score --calibration-seq-len 1", "at least 2"),
    Case("out of range", "errors --scores {d}/store1 --n-boot 0", "at least 1"),
    Case("out of range", "report --n 0", "at least 1"),
    Case("out of range", "attention --beta nan", "--beta"),
    Case("out of range", "attention --beta inf", "--beta"),
    # -- booleans where numbers or flags belong
    Case("bool", "probe --n true", "--n"),
    Case("bool", "report --n True", "--n"),
    Case("bool", "probe --quiet yes", "unrecognized"),
    Case("bool", "train-saobp --fresh=1", "--fresh"),
    # -- unknown names
    Case("unknown name", "probe --components resid_mdi", "did you mean 'resid_mid'"),
    Case("unknown name", "probe --reducers kurt", "did you mean 'kurtosis'"),
    Case("unknown name", "probe --components ''", "--components"),
    Case("unknown name", "probe --components pattern --reducers norm", "pattern"),
    Case("unknown name", "probe --reducers entropy", "entropy"),
    Case("unknown name", "report --stages bogus", "--stages"),
    Case("unknown name", "report --stages probes,atention", "did you mean 'attention'"),
    Case("unknown name", "patch --components gate,upp", "did you mean 'up'"),
    Case("unknown name", "lens --experiments early_exit", "did you mean 'early-exit'"),
    Case("unknown name", "patch --experiments tabel", "did you mean 'table'"),
    Case("unknown name", "lens --at resid_pre", "--at"),
    Case("unknown name", "attention --mode exakt", "--mode"),
    Case("unknown name", "probe --dtype float64", "--dtype"),
    Case("unknown name", "probe --dtype fp16", "--dtype"),
    Case("unknown name", "prob --n 4", "did you mean"),
    Case("unknown name", "probe --model smollm2", "did you mean 'smollm2-135m'"),
    Case("unknown name", "probe --bogus-flag", "unrecognized"),
    # -- quantization method specs
    Case("bad spec", "quantize --method zzz:bits=3 --out {d}/q", "zzz"),
    Case("bad spec", "quantize --method rtn:bits=99 --out {d}/q", "bits"),
    Case("bad spec", "quantize --method rtn --out {d}/q", "bits"),
    Case("bad spec", "quantize --method rtn:bits=3,grp=4 --out {d}/q", "grp"),
    Case("bad spec", "quantize --method gptq:bits=3,damp=-1 --out {d}/q", "damp"),
    Case("bad spec", "score --methods 'rtn:bits=3;gptk:bits=4'", "did you mean 'gptq'"),
    Case("bad spec", "score --methods ''", "--methods"),
    Case("bad spec", "score --methods rtn:bits=3,zzz:bits=3", "zzz"),
    Case("bad spec", "lens --method nf:bits=5", "bits"),
    Case("bad spec", "patch --method awq:bits=3,grid=0", "grid"),
    Case("bad spec", "report --methods 'rtn:bits=3;hqq:bits=7'", "bits"),
    Case("bad spec", "errors --scores {d}/store1 --reversal-specs rtn:bits=99", "bits"),
    # -- layer lists
    Case("bad layers", "attention --layers a,b", "--layers"),
    Case("bad layers", "attention --layers 1,,2", "--layers"),
    Case("bad layers", "attention --layers 1.5", "--layers"),
    Case("bad layers", "attention --map-layers x", "--map-layers"),
    Case("bad layers", "patch --layers upper", "did you mean 'upper_half'"),
    Case("bad layers", "patch --layers 1-3", "--layers"),
    Case("bad layers", "lens --ks a", "--ks"),
    Case("bad layers", "lens --ks 3,-1", "--ks"),
    # -- devices
    Case("device", "probe --device cuda", "CUDA"),
    Case("device", "probe --device cuda:0", "CUDA"),
    Case("device", "probe --device tpu", "--device"),
    Case("device", "report --device gpu", "--device"),
    Case("device", f"quantize {Q} --device cuda", "CUDA"),
    Case("device", "attention --device ''", "--device"),
    Case("device", "score --device mps", "--device"),
    # -- --data files and --model paths
    Case("data file", "probe --data {d}/missing.txt", "not found"),
    Case("data file", "probe --data {d}/empty.txt", "no text"),
    Case("data file", "probe --data {d}/blank.txt", "no text"),
    Case("data file", "probe --data {d}/latin1.txt", "UTF-8"),
    Case("data file", "probe --data {d}/bad.jsonl", "not valid JSON"),
    Case("data file", "probe --data {d}/notext.jsonl", "'text'"),
    Case("data file", "probe --data {d}/null.jsonl", "string"),
    Case("data file", "probe --data {d}/number.jsonl", "string"),
    Case("data file", "probe --data {d}/list.jsonl", "'text'"),
    Case("data file", "score --data {d}/empty.csv", "empty"),
    Case("data file", "score --data {d}/nocol.csv", "'text' column"),
    Case("data file", "lens --data {d}/header_only.csv", "no text"),
    Case("data file", "report --data {d}/data.parquet", ".csv"),
    Case("data file", "attention --data {d}/emptydir", "save_to_disk"),
    Case("data file", "probe --model {d}/missing.gguf", "does not exist"),
    # -- output paths
    Case("output path", "probe --out /proc/interp-out", "/proc/interp-out"),
    Case("output path", "probe --out {d}/afile", "afile"),
    Case("output path", "report --out {d}/afile", "afile"),
    Case("output path", "imatrix --out {d}/afile", "afile"),
    Case("output path", "tensor-types {d}/types.txt --out {d}/afile", "afile"),
    # -- tensor-type files (what llama-quantize --tensor-type-file reads)
    Case("tensor-type file", "tensor-types {d}/missing.txt", "cannot read"),
    Case("tensor-type file", "tensor-types {d}/good.txt", "PATTERN=TYPE"),
    Case("tensor-type file", "tensor-types {d}/badtype.txt", "q7_k"),
    Case("tensor-type file", "tensor-types {d}/badregex.txt", "regular expression"),
    Case("tensor-type file", "tensor-types {d}/types.txt --mix Q2_K", "--mix"),
    Case("tensor-type file", "tensor-types {d}/types.txt --model {d}/missing.gguf", "does not exist"),
    Case("output path", "report --screenshot /proc/nowhere/shot.png", "screenshot"),
    Case("output path", "quantize --method rtn:bits=3 --out /proc/q", "/proc/q"),
    Case("output path", "train-saobp --out {d}/afile", "afile"),
    Case("output path", "attention --out {d}/afile/sub", "afile"),
    # -- the model cache
    Case("model cache", "probe", "INTERP_CACHE", {"INTERP_CACHE": "{d}/afile"}),
    Case("model cache", "report", "INTERP_CACHE", {"INTERP_CACHE": "{d}/afile/sub"}),
    Case("model cache", f"quantize {Q}", "INTERP_CACHE", {"INTERP_CACHE": "/proc/interp-cache"}),
    # -- the input folder of `errors`
    Case("errors folder", "errors", "--scores"),
    Case("errors folder", "errors --scores {d}/missing", "interp score"),
    Case("errors folder", "errors --scores {d}/emptydir", "interp score"),
    Case("errors folder", "errors --scores {d}/store2", "--model"),
    Case("errors folder", "errors --scores {d}/store2 --model model-c", "did you mean"),
    Case("errors folder", "errors --scores {d}/store1 --spec zzz:bits=3", "zzz"),
    Case("errors folder", "errors --scores {d}/store1 --spec rtn:bits=4", "not in"),
    Case("errors folder", "errors --scores {d}/corrupt", "score store"),
    Case("errors folder", "errors --scores {d}/store1 --out {d}/store2", "--out"),
    # -- argparse misuse
    Case("argparse", "probe --n", "expected one argument"),
    Case("argparse", "report --quick --full", "not allowed"),
    Case("argparse", "probe --n 4 extra", "unrecognized"),
    # -- prescribe: the budget and the bit widths, before any model loads
    Case("prescribe", "prescribe --method gptq --bits 3,4 --budget 3.5 --out {d}/plan", "strictly between"),
    Case("prescribe", "prescribe --method gptq --bits 3,9 --budget 4.0 --out {d}/plan", "supports bits"),
    Case("prescribe", "prescribe --method zzz --bits 3,4 --budget 4.0 --out {d}/plan", "unknown method"),
    # -- a llama.cpp plan (prescribe --gguf): the build, the paths and the size, before any model loads
    Case("llama.cpp plan", "prescribe --target-bpw 5.5 --llama-cpp {d}/missing --gguf {d}/p.gguf --out {d}/plan",
         "does not exist"),
    Case("llama.cpp plan", "prescribe --target-bpw 5.5 --llama-cpp {d}/afile --gguf {d}/p.gguf --out {d}/plan",
         "not a folder"),
    Case("llama.cpp plan", "prescribe --target-bpw 5.5 --llama-cpp {d}/emptydir --gguf {d}/p.gguf --out {d}/plan",
         "has no llama-quantize"),
    Case("llama.cpp plan", "prescribe --target-bpw 5.5 --gguf {d}/p.gguf --out {d}/plan", "has no llama-quantize",
         env={"LLAMA_CPP_BIN": "{d}/noquant"}),
    Case("llama.cpp plan", "prescribe --target-bpw 2 --gguf {d}/p.gguf --out {d}/plan", "outside what widths"),
    Case("llama.cpp plan", "prescribe --target-bpw 3 --types q4_0,q8_0 --out {d}/plan", "outside what types"),
    Case("llama.cpp plan", "prescribe --target-size 50000000 --gguf {d}/p.gguf --out {d}/plan",
         "below the smallest file"),
    Case("llama.cpp plan", "prescribe --target-size Q2_K --out {d}/plan", "--target-size"),
    Case("llama.cpp plan", "prescribe --target-bpw 5.5 --gguf {d}/emptydir --out {d}/plan", "ending in .gguf"),
    Case("llama.cpp plan", "prescribe --target-bpw 5.5 --model {d}/emptydir --gguf {d}/p.gguf --out {d}/plan",
         "needs the model as a GGUF file"),
    Case("llama.cpp plan", "prescribe --target-bpw 5.5 --types q4_0,q9_k --out {d}/plan", "q9_k"),
    Case("llama.cpp plan", "prescribe --target-bpw 5.5 --exclude-types q3_k,q4_0,q4_1,q4_k,q5_0,q5_1,q5_k,q6_k,q8_0 "
         "--out {d}/plan", "leaves no candidate"),
    Case("llama.cpp plan", "prescribe --format interp --budget 4 --gguf {d}/p.gguf --out {d}/plan",
         "drop --format interp"),
    # -- circuit: the prompt pair and the pairs file, before any model loads
    Case("circuit", "circuit --clean 'a b' --corrupt 'a c' --answer ' b' --out {d}/c", "Missing --wrong"),
    Case("circuit", "circuit --pairs {d}/good.txt --clean 'a b' --out {d}/c", "either --pairs FILE or"),
    Case("circuit", "circuit --pairs {d}/notext.jsonl --out {d}/c", "lacks clean, corrupt, answer, wrong"),
    Case("survive", "survive --model gpt2 --out {d}/s", "registers smollm2-135m, gemma3-270m only"),
    Case("survive", "survive --methods 'rtn:bits=9' --out {d}/s", "not in smollm2-135m's registered roster"),
    Case("survive", "survive --stages induction,sae --out {d}/s", "choose from induction, circuits, features"),
    Case("survive", "survive --methods 'llama.cpp Q3_K_M' --llama-cpp {d}/nowhere --out {d}/s", "does not exist"),
    Case("circuit", "circuit --clean 'a b' --corrupt 'a c' --answer ' b' --wrong ' c' --top 0 --out {d}/c", "--top"),
]


def _env(case: Case, d: Path) -> dict[str, str]:
    return {k: v.format(d=d) for k, v in case.env.items()}


@pytest.fixture
def hostile_env(monkeypatch, tmp_path):
    """Work intercepted, a private cwd (default --out folders land there) and model cache."""
    intercept_work(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("INTERP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)  # a llama.cpp build named by the caller's environment
    return monkeypatch


@pytest.mark.parametrize("case", CASES, ids=[f"{c.category}: {c.line}" for c in CASES])
def test_hostile_command_line(case, files, hostile_env, capsys):
    for key, value in _env(case, files).items():
        hostile_env.setenv(key, value)
    outcome = run_cli(case.argv(files), capsys)
    assert outcome.kind == "exit", f"{outcome.kind}: {outcome.err}"
    assert outcome.code == 2, outcome.err
    assert "Traceback" not in outcome.err
    assert case.fragment.lower() in outcome.err.lower(), outcome.err
    lines = [line for line in outcome.err.splitlines() if line.strip()]
    assert lines and "error" in lines[-1], outcome.err


def test_table_size_and_categories():
    """The table keeps at least 60 cases, and docs/reliability.md quotes its category counts."""
    counts = Counter(c.category for c in CASES)
    assert len(CASES) >= 60
    doc = (Path(__file__).resolve().parents[1] / "docs" / "reliability.md").read_text()
    assert f"{len(CASES)} hostile command lines" in doc
    for category, count in counts.items():
        assert f"| {category} | {count} |" in doc, (category, count)


def test_every_command_appears_in_the_table():
    from interp.cli.main import build_parser

    parser = build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    used = {c.line.split()[0] for c in CASES}
    assert commands <= used, commands - used


# ---------------------------------------------------------------------------------------
# Property test: command lines assembled from valid and invalid fragments

# option -> [(value, valid)], per command; {d} is the files folder
COMMON = {
    "--n": [("4", True), ("0", False), ("-1", False), ("x", False)],
    "--seq-len": [("16", True), ("1", False), ("2.5", False)],
    "--batch-size": [("2", True), ("0", False), ("true", False)],
    "--seed": [("3", True), ("s", False)],
    "--device": [("cpu", True), ("cuda", False), ("gpu", False)],
    "--dtype": [("bfloat16", True), ("float16", True), ("float64", False)],
    "--data": [("wiki", True), ("{d}/good.txt", True), ("{d}/empty.txt", False), ("{d}/null.jsonl", False),
               ("{d}/nocol.csv", False), ("{d}/missing.txt", False)],
    "--model": [("smollm2-135m", True), ("smollm", False), ("{d}/missing.gguf", False)],
}
QUANT = {"--calibration-n": [("8", True), ("0", False)], "--threads": [("1", True), ("0", False)]}
FRAGMENTS: dict[str, dict[str, list[tuple[str, bool]]]] = {
    "probe": {**COMMON, "--components": [("resid_mid,h", True), ("resid", False)],
              "--reducers": [("norm", True), ("kurtosis,mean", True), ("nrm", False)],
              "--out": [("{d}/out", True), ("{d}/afile", False)]},
    "attention": {**COMMON, "--layers": [("0,1", True), ("a", False)], "--beta": [("0", True), ("nan", False)],
                  "--map-layers": [("-1", True), ("x", False)], "--mode": [("first_order", True), ("xx", False)]},
    "lens": {**COMMON, **QUANT, "--method": [("nf:bits=4", True), ("nf:bits=5", False)],
             "--top": [("0.2", True), ("0", False)], "--experiments": [("restoration", True), ("lens", False)],
             "--ks": [("0,1", True), ("a", False)]},
    "patch": {**COMMON, **QUANT, "--layers": [("all", True), ("15,16", True), ("upper", False)],
              "--components": [("gate,up", True), ("gatee", False)], "--max-rows": [("8", True), ("0", False)],
              "--experiments": [("sweep", True), ("sweeps", False)]},
    "score": {**COMMON, **QUANT, "--methods": [("rtn:bits=4;nf:bits=4", True), ("rtn:bits=1", False)],
              "--calibration-seq-len": [("8", True), ("1", False)]},
    "quantize": {**COMMON, **QUANT, "--method": [("hqq:bits=4", True), ("hqq:bits=7", False)],
                 "--out": [("{d}/qout", True), ("/proc/qout", False)]},
    "report": {**{k: v for k, v in COMMON.items() if k != "--n"}, "--n": [("8", True), ("0", False)],
               "--stages": [("probes", True), ("probe", False)],
               "--methods": [("rtn:bits=3,group=64;nf:bits=4", True), ("xyz:bits=3", False)]},
    "train-saobp": {"--steps": [("3", True), ("0", False)], "--threads": [("1", True), ("-2", False)],
                    "--seed": [("1", True), ("one", False)], "--out": [("{d}/train", True), ("{d}/afile", False)]},
    "errors": {"--scores": [("{d}/store1", True), ("{d}/emptydir", False)],
               "--n-boot": [("10", True), ("0", False)], "--spec": [("mean", True), ("zzz:bits=3", False)],
               "--threads": [("1", True), ("0", False)]},
}
REQUIRED = {"quantize": {"--method": "hqq:bits=4", "--out": "{d}/qout"}, "errors": {"--scores": "{d}/store1"}}


@st.composite
def command_lines(draw):
    command = draw(st.sampled_from(sorted(FRAGMENTS)))
    options = FRAGMENTS[command]
    chosen = draw(st.lists(st.sampled_from(sorted(options)), unique=True, max_size=4))
    picked = {name: draw(st.sampled_from(options[name])) for name in chosen}
    for name, value in REQUIRED.get(command, {}).items():
        picked.setdefault(name, (value, True))
    argv = [command]
    for name, (value, _) in picked.items():
        argv += [name, value]
    return argv, all(valid for _, valid in picked.values())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(line=command_lines())
def test_fragments_property(line, files, hostile_env, capsys):
    argv, valid = line
    argv = [a.format(d=files) for a in argv]
    outcome = run_cli(argv, capsys)
    assert "Traceback" not in outcome.err
    if valid:
        assert outcome.kind == "work", (argv, outcome)
        assert "error" not in outcome.err, (argv, outcome)
    else:
        assert (outcome.kind, outcome.code) == ("exit", 2), (argv, outcome)


# ---------------------------------------------------------------------------------------
# What main() does with failures that are not bad arguments


def test_unexpected_error_gives_one_line_and_a_log(files, hostile_env, capsys, tmp_path):
    import interp.models

    def crash(*args, **kwargs):
        raise RuntimeError("boom inside a library")

    hostile_env.setattr(interp.models, "load_model", crash)
    outcome = run_cli(["probe", "--n", "2", "--seq-len", "8"], capsys)
    assert (outcome.kind, outcome.code) == ("exit", 1), outcome
    lines = outcome.err.strip().splitlines()
    assert len(lines) == 1 and "internal error (RuntimeError: boom inside a library)" in lines[0]
    log = Path(lines[0].split("the full traceback is in ", 1)[1].split(". Please", 1)[0])
    assert log.parent == tmp_path / "cache" / "logs"
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "boom inside a library" in text


@pytest.mark.parametrize("error,code,fragment", [
    (OSError(28, "No space left on device", "/data/out/x.csv"), 2, "disk is full (/data/out/x.csv)"),
    (OSError(30, "Read-only file system", "/ro/out"), 2, "read-only"),
    (PermissionError(13, "Permission denied", "/root/x"), 2, "permission denied (/root/x)"),
    (sqlite3.OperationalError("database is locked"), 2, "another interp run"),
    (sqlite3.DatabaseError("database disk image is malformed"), 2, "move it aside"),
    (MemoryError(), 2, "--batch-size"),
    (KeyboardInterrupt(), 130, "interrupted; rerun the same command to resume"),
], ids=["ENOSPC", "EROFS", "EACCES", "sqlite locked", "sqlite corrupt", "memory", "ctrl-c"])
def test_system_failures_give_one_line(error, code, fragment, files, hostile_env, capsys):
    import interp.models

    def fail(*args, **kwargs):
        raise error

    hostile_env.setattr(interp.models, "load_model", fail)
    outcome = run_cli(["probe", "--n", "2", "--seq-len", "8"], capsys)
    assert (outcome.kind, outcome.code) == ("exit", code), outcome
    assert len(outcome.err.strip().splitlines()) == 1 and fragment in outcome.err, outcome.err
    assert "Traceback" not in outcome.err


def _record_run_all(monkeypatch) -> dict:
    import interp.quant.analysis

    seen: dict = {}

    def record(errors, settings, folder, **kwargs):
        seen.update(errors=errors, folder=folder, **kwargs)
        raise WorkStarted

    monkeypatch.setattr(interp.quant.analysis, "run_all", record)
    return seen


def test_errors_out_is_a_deprecated_alias_of_scores(files, hostile_env, capsys):
    seen = _record_run_all(hostile_env)
    outcome = run_cli(["errors", "--out", str(files / "store1"), "--skip-norms"], capsys)
    assert outcome.kind == "work"
    assert "--out is deprecated" in outcome.err and "use --scores" in outcome.err
    assert Path(seen["folder"]) == files / "store1" / "analysis"


def test_errors_model_picks_one_model_of_a_store(files, hostile_env, capsys):
    seen = _record_run_all(hostile_env)
    for model, error in [("model-a", 0.5), ("model-b", 0.75)]:  # see _store: 0.5 + 0.25 k
        outcome = run_cli(["errors", "--scores", str(files / "store2"), "--model", model, "--skip-norms"], capsys)
        assert outcome.kind == "work", outcome
        assert seen["errors"][STORE_SPEC].tolist() == [error] * 4  # exact: sums of binary fractions


def test_errors_runs_models_only_with_a_loadable_model(files, hostile_env, capsys, tmp_path):
    """Without --skip-norms the model named in settings.json is checked before the analyses start."""
    folder = tmp_path / "store"
    _store(folder, ["m1"])
    settings = json.loads((folder / "settings.json").read_text())
    (folder / "settings.json").write_text(json.dumps({**settings, "model": "no-such-model"}))
    outcome = run_cli(["errors", "--scores", str(folder)], capsys)
    assert (outcome.kind, outcome.code) == ("exit", 2) and "Unknown model 'no-such-model'" in outcome.err


# ---------------------------------------------------------------------------------------
# --data formats


def test_txt_jsonl_and_csv_give_the_same_documents(tmp_path):
    import pandas as pd

    from interp.data import read_documents

    texts = ["First document, with a comma.", 'Second "quoted" document\nover two lines.', "Third."]
    (tmp_path / "d.txt").write_text("\n\n".join(texts))
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    pd.DataFrame({"id": ["a", "b", "c"], "text": texts}).to_csv(tmp_path / "d.csv", index=False)
    for name in ("d.txt", "d.jsonl", "d.csv"):
        assert [d.text for d in read_documents(tmp_path / name)] == texts, name
    assert [d.id for d in read_documents(tmp_path / "d.csv")] == ["a", "b", "c"]


def test_rows_shorter_than_the_request_are_a_data_error(tmp_path):
    from interp.data import load_examples
    from interp.errors import DataError
    from interp.models import tiny_tokenizer

    (tmp_path / "short.csv").write_text("text\nshort\ntiny\n")
    with pytest.raises(DataError, match="only 0 documents have at least 63 tokens"):
        load_examples(tmp_path / "short.csv", tiny_tokenizer(), n=1, seq_len=64, split="all")


def test_train_saobp_threads_are_set_before_training(files, hostile_env, capsys, tmp_path):
    before = torch.get_num_threads()
    try:
        outcome = run_cli(["train-saobp", "--threads", "1", "--out", str(tmp_path / "run"), "--quick"], capsys)
        assert outcome.kind == "work" and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
