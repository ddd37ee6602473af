"""The command line explains itself: every option has help, defaults and valid names are shown.

The valid names in the help come from the registries that define them (hook components, probe
reducers, patchable components, report stages, quantization methods), so the tests compare the
help with those registries rather than with a list written here.
"""

from __future__ import annotations

import argparse
import re

import pytest

import interp
from interp.cli.main import COMMANDS, build_parser, main


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(actions) == 1
    return dict(actions[0].choices)


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


def test_every_command_is_listed(parser):
    assert set(_subparsers(parser)) == set(COMMANDS)
    assert {"probe", "attention", "train-saobp", "quantize", "score", "errors", "lens", "patch", "report"} <= set(
        COMMANDS)


def test_every_option_has_help(parser):
    missing = []
    for name, sub in _subparsers(parser).items():
        options = [a for a in sub._actions if a.option_strings and "-h" not in a.option_strings]
        assert options, name
        missing += [f"{name} {a.option_strings[0]}" for a in options
                    if not (a.help or "").strip() or a.help == argparse.SUPPRESS]
    assert not missing, missing


def test_defaults_are_shown(parser):
    """Every option with a real default shows it (flags and 'not given' defaults have none to show)."""
    for name, sub in _subparsers(parser).items():
        text = " ".join(sub.format_help().split())
        for action in sub._actions:
            if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                assert f"default: {action.default}" in text, (name, action.option_strings[0], action.default)


def _help_of(parser, command: str, option: str) -> str:
    sub = _subparsers(parser)[command]
    action = next(a for a in sub._actions if option in a.option_strings)
    return " ".join((action.help or "").split())


def test_valid_names_come_from_their_registries(parser):
    from interp.localize.patching import PATCHABLE
    from interp.probes import REDUCERS
    from interp.quant.spec import METHODS
    from interp.report.stages import STAGES
    from interp.runtime.hooks import COMPONENTS

    expectations = [
        ("probe", "--components", list(COMPONENTS)),
        ("probe", "--reducers", list(REDUCERS)),
        ("patch", "--components", list(PATCHABLE)),
        ("report", "--stages", [s.name for s in STAGES]),
        ("score", "--methods", list(METHODS)),
        ("quantize", "--method", list(METHODS)),
    ]
    for command, option, names in expectations:
        text = _help_of(parser, command, option)
        assert names and all(re.search(rf"\b{re.escape(n)}\b", text) for n in names), (command, option, text)


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"interp {interp.__version__}"


def test_top_level_help_is_plain_text(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out and ":mod:" not in out
    assert "COMMAND" in out and all(name in out for name in COMMANDS)


def test_no_arguments_prints_help(capsys):
    assert main([]) == 0
    assert "usage: interp" in capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_help_exits_zero(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: interp {command}") and "``" not in out


def test_report_methods_split_through_the_spec_registry():
    """The report's --methods list is split and checked by the quant spec code, not by a regex of names."""
    from interp.cli.quant import parse_spec_list, split_specs

    text = "rtn:bits=3,group=64,gptq:bits=3;nf:bits=4 awq:bits=4,grid=10"
    assert split_specs(text) == ["rtn:bits=3,group=64", "gptq:bits=3", "nf:bits=4", "awq:bits=4,grid=10"]
    assert [str(s) for s in parse_spec_list(text)][-1] == "awq:bits=4,group=64,grid=10"


def test_version_and_help_do_not_import_torch():
    """`interp --version` and `interp --help` build no subcommand options, so they stay instant."""
    import subprocess
    import sys

    code = ("import sys\nfrom interp.cli.main import main\n"
            "for argv in (['--version'], ['--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
