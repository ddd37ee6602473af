"""Negative number lists parse in every spelling, for every option that takes a list of whole numbers.

argparse reads a word that starts with ``-`` as an option unless it is one negative number, so
``interp attention --layers -4,-3,-2,-1`` (docs/cli.md) was refused with "expected one argument".
:func:`interp.cli.main.join_negative_values` joins such a value to its option. The options are
enumerated from the parsers (every option whose type is an ``int_list``), not listed here.
"""

from __future__ import annotations

import argparse

import pytest

from interp.cli.common import COMMANDS
from interp.cli.main import build_parser, join_negative_values

# as a shell passes them: "--layers -4,-3" (two words) and "--layers=-4,-3" (one)
SPELLINGS = (lambda opt, value: [opt, value], lambda opt, value: [f"{opt}={value}"])


def list_options() -> list[tuple[str, str, argparse.Action]]:
    """``(command, option, action)`` for every option of every command whose type parses a list of whole numbers."""
    found = []
    for command in sorted(COMMANDS):
        parser = build_parser(only=command)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for action in sub.choices[command]._actions:
            if action.option_strings and getattr(action.type, "__qualname__", "").startswith("int_list."):
                found.append((command, max(action.option_strings, key=len), action))
    return found


OPTIONS = list_options()


def test_the_list_options_are_found():
    assert ("attention", "--layers") in {(c, o) for c, o, _ in OPTIONS}
    assert len(OPTIONS) >= 4  # attention --layers/--map-layers, lens --ks/--layers


def _parse(command: str, words: list[str]):
    parser = build_parser(only=command)
    return parser.parse_args(join_negative_values(parser, [command, *words]))


@pytest.mark.parametrize("command, option, action", OPTIONS, ids=[f"{c} {o}" for c, o, _ in OPTIONS])
@pytest.mark.parametrize("value", ["-4,-3,-2,-1", "-1", "0,-1", "-2, -1"])
def test_every_spelling_of_a_negative_list_means_the_same(command, option, action, value, capsys):
    outcomes = set()
    for spelling in SPELLINGS:
        words = spelling(option, value)
        try:
            outcomes.add(("ok", getattr(_parse(command, words), action.dest)))
        except SystemExit as exc:  # an option whose numbers must be >= 0: the same refusal either way
            err = capsys.readouterr().err
            assert "expected one argument" not in err, err
            outcomes.add(("refused", exc.code, err.strip().splitlines()[-1]))
    assert len(outcomes) == 1, outcomes
    kind, *rest = outcomes.pop()
    if kind == "ok" and action.type(value) is not None:
        assert rest[0] == action.type(value)  # the value the documented --opt=VALUE spelling gives


def test_an_abbreviated_option_takes_a_negative_list_too():
    assert _parse("attention", ["--lay", "-4,-3"]).layers == "-4,-3"


def test_a_negative_word_is_not_joined_to_a_flag_or_after_a_double_dash():
    parser = build_parser(only="attention")
    assert join_negative_values(parser, ["attention", "--quiet", "-1"]) == ["attention", "--quiet", "-1"]
    assert join_negative_values(parser, ["attention", "--", "--layers", "-1"]) == ["attention", "--", "--layers",
                                                                                 "-1"]
    assert join_negative_values(parser, ["attention", "--layers", "-x"]) == ["attention", "--layers", "-x"]
