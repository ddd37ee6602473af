"""Every ``interp`` command line shown in the docs parses and passes its checks.

The command lines are extracted from the ``bash``/``sh`` blocks of README.md and docs/*.md (line
continuations joined, comments, pipes and redirections cut off), in every form the docs use:
``interp ...``, ``python -m interp ...``, ``torchrun ... -m interp -- ...`` and
``python -m interp.attention.train ...``. Each runs in-process with its heavy work intercepted (as in
``tests/test_cli_hostile.py``: loading a model, the training run and the ``errors`` analyses raise
``WorkStarted``), in a fresh folder that holds what the docs' earlier steps would have written (a
plan, a score folder, the data files they name). The command must exit 0 or reach that work: an
argparse error, a refusal or a traceback fails the test. The ``<!-- runnable -->`` blocks run in
full in ``tests/test_docs.py``; this test covers the rest, which would take minutes to hours.

Placeholders the docs write for the reader's own values (``PATH``, ``OUT``, a 70B model's name)
are replaced by bundled or local stand-ins (:data:`STAND_INS`); ``...`` (elided options) is dropped.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from test_cli_hostile import WorkStarted, intercept_work, run_cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^(`{3,})\s*(\w*)\s*$")
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")
_CUT = {"|", ">", ">>", "2>", "&&", "||", ";", "&"}
STAND_INS = {"PATH": "smollm2-135m", "llama-2-7b": "smollm2-135m", "llama-3-70b": "smollm2-135m",
             "gemma3-270m": "gemma3-270m", "OUT": "out", "Q": "q"}
PLAN_SPEC = "gptq:bits=3,group=64,damp=0.01,act_order=1,block=128|0.v=4"


def shell_lines(page: Path) -> list[tuple[int, str]]:
    """``(line number, command)`` for each command of the page's shell blocks, continuations joined."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i].strip())
        if not match:
            i += 1
            continue
        fence, language = match.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), len(lines))
        if language in ("bash", "sh", "shell"):
            pending, start = "", 0
            for k in range(i + 1, end):
                text = lines[k].rstrip()
                start = start or k + 1
                if text.endswith("\\"):
                    pending += text[:-1] + " "
                    continue
                if (pending + text).strip():
                    out.append((start, pending + text))
                pending, start = "", 0
        i = end + 1
    return out


def interp_argv(command: str) -> tuple[str, list[str]] | None:
    """``(program, argv)`` of an interp invocation (program ``interp`` or ``train``), or None for other tools."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    cut = next((i for i, w in enumerate(words) if w in _CUT), len(words))
    words = _drop_elided(words[:cut])
    while words and _ENV.match(words[0]):
        words = words[1:]
    if words[:1] == ["interp"]:
        argv = words[1:]
    elif "-m" in words and words.index("-m") + 1 < len(words):
        module = words[words.index("-m") + 1]
        argv = words[words.index("-m") + 2:]
        if module == "interp.attention.train":
            return "train", argv
        if module != "interp":
            return None
    else:
        return None
    return "interp", argv[1:] if argv[:1] == ["--"] else argv


def _drop_elided(words: list[str]) -> list[str]:
    """Without ``...``: an elided value drops its option too (``--methods ...``), an elided list item its separator."""
    out: list[str] = []
    for word in words:
        if word == "...":
            if out and out[-1].startswith("--") and "=" not in out[-1]:
                out.pop()
            continue
        out.append(word.replace(";...", "").replace(",...", ""))
    return out


def documented_commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for page in PAGES:
        for line, command in shell_lines(page):
            parsed = interp_argv(command)
            if parsed is not None:
                found.append((f"{page.relative_to(ROOT)}:{line}", *parsed))
    return found


COMMANDS = documented_commands()


def test_the_documented_commands_are_found():
    where = {name.split(":")[0] for name, *_ in COMMANDS}
    assert {"docs/cli.md", "docs/prescribe.md", "docs/scaling.md", "README.md"} <= where
    assert len(COMMANDS) >= 40


SETTINGS = {"model": "smollm2-135m", "specs": ["rtn:bits=3,group=64"], "dtype": "float32",
            "examples": {"source": "wiki", "n": 2, "seq_len": 8, "seed": 0, "split": "eval"}}


def _inputs(folder: Path, argv: list[str]) -> None:
    """What the docs' earlier steps would have written for this command to read, and the data files it names."""
    for word in argv:
        if word.startswith("@"):
            plan = folder / word[1:]
            plan.parent.mkdir(parents=True, exist_ok=True)
            plan.write_text(json.dumps({"spec": PLAN_SPEC}))
    if argv[:1] == ["errors"]:
        scores = folder / next(argv[i + 1] for i, w in enumerate(argv) if w in ("--scores", "--out"))
        scores.mkdir(parents=True, exist_ok=True)
        (scores / "errors.csv").write_text("example,rtn:bits=3,group=64\na,0.5\nb,0.25\n")
        (scores / "settings.json").write_text(json.dumps(SETTINGS))
    if argv[:1] == ["tensor-types"]:  # the tensor-type file an earlier `prescribe --format llama.cpp` wrote
        types = folder / argv[1]
        types.parent.mkdir(parents=True, exist_ok=True)
        types.write_text("blk\\.0\\.ffn_down\\.weight=q6_k\n")
    text = "\n".join(json.dumps({"text": f"Document {i} holds a few plain words of text."}) for i in range(8))
    for data in ("fineweb.jsonl", "my_docs.jsonl"):
        (folder / data).write_text(text + "\n")
    (folder / "pairs.jsonl").write_text(json.dumps({"clean": "When Mary and John went out, John gave it to",
                                                    "corrupt": "When Mary and John went out, Anna gave it to",
                                                    "answer": " Mary", "wrong": " John"}) + "\n")
    for device_map in ("map.json", "map70.json"):
        (folder / device_map).write_text(json.dumps({"": "cpu"}))


@pytest.mark.parametrize("where, program, argv", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_documented_command_passes_its_checks(where, program, argv, tmp_path, monkeypatch, capsys):
    intercept_work(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("INTERP_CACHE", str(tmp_path / "cache"))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    if any(word.startswith("cuda") for word in argv):  # a GPU command: checked as on a machine with 8 GPUs
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    argv = [STAND_INS.get(word, word) for word in argv]
    _inputs(tmp_path, argv)
    if program == "train":
        import interp.attention.train as train

        try:
            code = train.main(argv)
        except WorkStarted:
            return
        assert code in (0, None), f"{where}: {' '.join(argv)} exited {code}"
        return
    outcome = run_cli(argv, capsys)
    ok = outcome.kind == "work" or (outcome.kind == "exit" and outcome.code == 0)
    assert ok, f"{where}: interp {' '.join(argv)}\n{outcome}"
