"""The module commands (``python -m interp.report.survival.run`` and the others docs name) turn a user's mistake
into ``error: ...`` on stderr and exit status 2, through one place (``interp.errors.exit_status``), before any
model loads; with that place switched off, the same mistakes escape as tracebacks."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import interp.errors
from interp.errors import InterpError

# (module, argv of a mistake a user makes, words the message must contain); each fails before any model loads
MISTAKES = [
    ("interp.report.survival.run", ["--model", "smollm2-135m", "--out", "{tmp}/out", "--stages", "induction,bogus"],
     "unknown stage(s) bogus"),
    ("interp.report.survival.run", ["--model", "gemma3-270m", "--out", "{tmp}/out", "--only", "rtn:bits=2"],
     "--only names rtn:bits=2, not in the roster"),
    ("interp.report.survival.run", ["--model", "smollm2-135m", "--out", "{tmp}/out", "--only",
                                    "rtn:bits=3,group=64;llama.cpp Q3_K_M"],
     "llama.cpp Q3_K_M is made by llama-quantize"),
    ("interp.report.survival.run", ["--model", "gemma3-270m", "--out", "{tmp}/out", "--only", "plan Q3_K_M@99"],
     "--only names plan Q3_K_M@99, not in the roster"),
    ("interp.report.survival.run", ["--model", "gemma3-270m", "--out", "{tmp}/out", "--only", "plan Q3_K_M@33"],
     "plan Q3_K_M is made by llama-quantize"),
    ("interp.report.survival.page", ["--raw", "{tmp}/missing", "--page", "{tmp}/page.md"], "is not a folder"),
    ("interp.report.mc_error", ["{tmp}/missing.json", "--raw", "{tmp}", "--out", "{tmp}/x.json"],
     "cannot be read"),
    ("interp.report.confirm_run", ["{tmp}/missing.json", "--out", "{tmp}/run"], "cannot be read"),
    ("interp.quant.length", ["--out", "{tmp}/run", "--analyse-only"], "holds no token_nll.safetensors"),
    ("interp.quant.length", ["--out", "{tmp}/run", "--lengths", "128,x"], "--lengths takes comma-separated"),
]


def _argv(argv: list[str], tmp: Path) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in argv]


@pytest.mark.parametrize(("module", "argv", "words"), MISTAKES, ids=[f"{m}-{i}" for i, (m, _, _) in
                                                                    enumerate(MISTAKES)])
def test_mistake_is_an_error_line_and_status_2(module: str, argv: list[str], words: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    import interp.models

    def no_load(*_: object, **__: object) -> None:
        raise AssertionError("a model was loaded before the mistake was refused")

    monkeypatch.setattr(interp.models, "load_model", no_load)
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)  # no build named: a llama.cpp row is a mistake
    status = importlib.import_module(module).main(_argv(argv, tmp_path))
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("error: ") and words in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "page.md").exists() and not (tmp_path / "x.json").exists()  # nothing written


def test_switched_off_the_mistakes_escape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one place: with exit_status passing errors through, every mistake above raises instead."""
    def passthrough(body):  # type: ignore[no-untyped-def]
        body()
        return 0

    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    escaped = 0
    for module, argv, _ in MISTAKES:
        loaded = importlib.import_module(module)
        monkeypatch.setattr(loaded, "exit_status", passthrough)
        with pytest.raises(InterpError):
            loaded.main(_argv(argv, tmp_path))
        escaped += 1
    assert escaped == len(MISTAKES)
    assert interp.errors.exit_status(lambda: None) == 0
