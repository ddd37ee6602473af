"""The ``interp`` command line.

Each subcommand is a thin wrapper over the Python API: it parses options, calls one
function, and writes tables (CSV/parquet), JSON and figures into ``--out``.

Every argument is checked before a model loads: numbers are parsed and range-checked by
their argparse ``type``, name lists are checked against the registries that define the
names (with a "did you mean"), and each command's ``checks`` (model source, model cache,
``--data`` file, output folders) run before the command itself. Errors in interp's own
words are printed as one line and exit with status 2; an unexpected exception prints one
line and the path of a log file holding its traceback, and exits with status 1.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sqlite3
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from interp import __version__
from interp.cli import attention, circuit, lens, prescribe, probe, quant, report, survive
from interp.cli.common import COMMANDS, HelpFormatter, refuse_unsharded, unknown_name, writing_out
from interp.errors import InterpError

DESCRIPTION = (
    "Attention localization (entropy, GTD, SAOBP) and low-bit quantization error analysis of small "
    "language models, offline. Each command loads a model and text, runs one analysis, and writes "
    "tables, JSON and figures into --out. Run 'interp COMMAND --help' for a command's options. "
    "Bad input exits with status 2 and one line saying what to fix."
)


# ---------------------------------------------------------------------------------------
# Argument types: each parses one value or raises ArgumentTypeError (argparse: exit 2)


# ---------------------------------------------------------------------------------------
# Checks that run after parsing and before any model loads


# ---------------------------------------------------------------------------------------
# Shared options


# ---------------------------------------------------------------------------------------
# interp probe

# The command groups, in the order ``interp --help`` lists them; importing each registers its commands.
GROUPS = (probe, attention, quant, lens, circuit, prescribe, report, survive)


def _ordered() -> list[str]:
    order = [group.__name__ for group in GROUPS]
    return sorted(COMMANDS, key=lambda name: order.index(COMMANDS[name][2].__module__))


# ---------------------------------------------------------------------------------------
# The parser and main()


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that subcommand gets its options (``""``: none), so the others'
    option lists, which import the registries of valid names, are not built."""
    parser = argparse.ArgumentParser(prog="interp", description=DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"interp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _ordered():
        help_text, configure, fn = COMMANDS[name]
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        if only is None or only == name:
            configure(p)
        p.set_defaults(func=fn)
    return parser


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is not an option)."""
    return next((a for a in argv if not a.startswith("-")), None)


# A value such as ``-4,-3,-2,-1`` or ``-0.5``: argparse reads a word that starts with ``-`` as an option
# unless it is a single negative number, so the documented ``--layers -4,-3,-2,-1`` was refused.
_NEGATIVE_NUMBERS = re.compile(r"^-\.?\d[\d.eE+\-]*(\s*,\s*-?\.?\d[\d.eE+\-]*)*,?$")


def _value_options(parser: argparse.ArgumentParser, name: str | None) -> dict[str, argparse.Action]:
    """Option string -> action, for the options of command ``name`` that take exactly one value."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    command = sub.choices.get(name) if sub is not None and name else None
    if command is None:
        return {}
    return {option: action for action in command._actions if action.nargs is None and action.option_strings
            and not isinstance(action, argparse._HelpAction) for option in action.option_strings}


def join_negative_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``["--layers", "-4,-3"]`` -> ``["--layers=-4,-3"]``, for every option that takes one value.

    No interp option starts with a digit, so a word like ``-4,-3`` after an option that expects a
    value can only be that value; joining it with ``=`` (a spelling argparse always accepts) makes
    ``--layers -4,-3``, ``--layers=-4,-3`` and an abbreviated ``--lay -4,-3`` mean the same.
    """
    options = _value_options(parser, _command_of(argv))
    out: list[str] = []
    words = list(argv)
    i = 0
    while i < len(words):
        word = words[i]
        action = options.get(word) or _unique_prefix(options, word)
        if action is not None and i + 1 < len(words) and _NEGATIVE_NUMBERS.match(words[i + 1]):
            out.append(f"{word}={words[i + 1]}")
            i += 2
            continue
        out.append(word)
        if word == "--":
            out += words[i + 1:]
            break
        i += 1
    return out


def _unique_prefix(options: dict[str, argparse.Action], word: str) -> argparse.Action | None:
    """The action an abbreviated long option (``--lay``) stands for, when exactly one matches."""
    if not word.startswith("--") or "=" in word:
        return None
    matches = {id(a): a for option, a in options.items() if option.startswith(word)}
    return next(iter(matches.values())) if len(matches) == 1 else None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (argparse's own errors raise SystemExit(2))."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = _command_of(argv)
    label = "interp"
    try:
        label = f"interp {name}" if name in COMMANDS else label
        parser = build_parser(only=name if name in COMMANDS else "")  # --version/--help need no options
        if name is not None and name not in COMMANDS:
            parser.error(unknown_name("command", name, list(COMMANDS)))
        args = parser.parse_args(join_negative_values(parser, argv))
        if not getattr(args, "func", None):
            parser.print_help()
            return 0
        refuse_unsharded(args.command)
        for check in getattr(args, "checks", ()):
            check(args)
        with writing_out(args):  # --out says INCOMPLETE until the command has written all of it
            return int(args.func(args) or 0)
    # One clause per failure family, each of the same shape (one line, exit 2): deliberate, so that
    # each can say what to do in its own words.
    except InterpError as exc:
        print(f"{label}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{label}: interrupted; rerun the same command to resume (finished work is kept).", file=sys.stderr)
        return 130
    except sqlite3.DatabaseError as exc:
        print(f"{label}: error: {_sqlite_message(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{label}: error: {_os_error_message(exc)}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"{label}: error: out of memory. Lower --batch-size (or --n, --seq-len) and rerun.", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line and a log, never a traceback
        if type(exc).__name__ == "OutOfMemoryError":  # torch.cuda.OutOfMemoryError, without importing torch
            print(f"{label}: error: the accelerator ran out of memory. Lower --batch-size and rerun.",
                  file=sys.stderr)
            return 2
        log = write_crash_log(exc)
        where = f"the full traceback is in {log}" if log else "no log file could be written"
        print(f"{label}: internal error ({type(exc).__name__}: {_first_line(exc)}). This is a bug in interp; "
              f"{where}. Please include it in a bug report.", file=sys.stderr)
        return 1


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else "no message"


def _os_error_message(exc: OSError) -> str:
    where = f" ({exc.filename})" if exc.filename else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"the disk is full{where}. Free some space and rerun the same command: finished work is kept "
                "and reused.")
    if exc.errno == errno.EROFS:
        return (f"the file system is read-only{where}. Choose a writable folder with --out (and INTERP_CACHE "
                "for the model cache).")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied{where}. Choose a folder you can write to with --out, or fix its permissions."
    return f"{exc.strerror or _first_line(exc)}{where}. Check the path and rerun."


def _sqlite_message(exc: sqlite3.DatabaseError) -> str:
    text = _first_line(exc)
    if "locked" in text or "busy" in text:
        return (f"the score store is locked ({text}): another interp run is writing the same folder. Wait for it "
                "to finish, or use another --out.")
    if "full" in text:
        return f"the disk is full ({text}). Free some space and rerun the same command: finished work is kept."
    return (f"the score store could not be used ({text}). If scores.sqlite is damaged, move it aside and rerun "
            "(it is rebuilt), or use another --out.")


def write_crash_log(exc: BaseException) -> Path | None:
    """Write the traceback under ``$INTERP_CACHE/logs`` (or the temp folder); return the file."""
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    import tempfile
    import traceback

    text = (f"interp {__version__}\nargv: {sys.argv}\npython: {sys.version}\n\n"
            + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    home = os.environ.get("HOME")  # not Path.home(): without HOME it may raise, here of all places
    cache = os.environ.get("INTERP_CACHE") or (Path(home) / ".cache" / "interp" if home else None)
    stamp = f"crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    folders = [Path(cache) / "logs"] if cache else []
    from interp.io import write_text

    for folder in (*folders, Path(tempfile.gettempdir()) / "interp-logs"):
        try:
            return write_text(folder / stamp, text)
        except (OSError, InterpError):
            continue
    return None


if __name__ == "__main__":  # pragma: no cover - run as a module: delegate to the registered copy
    from interp.cli.main import main as registered_main

    sys.exit(registered_main())


