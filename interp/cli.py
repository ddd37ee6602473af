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
import difflib
import errno
import math
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from interp import __version__
from interp.errors import InterpError, ModelLoadError, ResourceError

DESCRIPTION = (
    "Attention localization (entropy, GTD, SAOBP) and low-bit quantization error analysis of small "
    "language models, offline. Each command loads a model and text, runs one analysis, and writes "
    "tables, JSON and figures into --out. Run 'interp COMMAND --help' for a command's options. "
    "Bad input exits with status 2 and one line saying what to fix."
)
DTYPES = ("float32", "bfloat16", "float16")
Check = Callable[[argparse.Namespace], None]

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help_text: str, configure: Callable[[argparse.ArgumentParser], None]):
    def register(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = (help_text, configure, fn)
        return fn

    return register


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except for flags and options whose default is 'not given'."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action) or ""


# ---------------------------------------------------------------------------------------
# Argument types: each parses one value or raises ArgumentTypeError (argparse: exit 2)


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``choices``, or ``"."``: ends a sentence either way."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else "."


def unknown_name(what: str, name: str, choices: Sequence[str]) -> str:
    """``unknown component 'x'; did you mean 'y'? Valid components: a, b.``"""
    return f"unknown {what} {name!r}{did_you_mean(name, choices)} Valid {what}s: {', '.join(choices)}."


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number (at least {low}), got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def float_in(low: float, high: float, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in ``[low, high]`` (``(low, high]`` with ``low_open``; ``high`` may be inf)."""
    if math.isinf(high):
        interval = f"{'>' if low_open else '>='} {low:g} (finite)"
    else:
        interval = f"in {'(' if low_open else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number {interval}, got {text!r}") from None
        if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
            raise argparse.ArgumentTypeError(f"must be a number {interval}, got {text!r}")
        return value

    return parse


def split_names(text: str, what: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    if not text.strip() or not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}s without empty entries, got {text!r}")
    return names


def name_list(what: str, valid: Callable[[], Sequence[str]]) -> Callable[[str], str]:
    """An argparse type: comma-separated names, each one of ``valid()``; returns the cleaned text."""

    def parse(text: str) -> str:
        names = split_names(text, what)
        choices = list(valid())
        for name in names:
            if name not in choices:
                raise argparse.ArgumentTypeError(unknown_name(what, name, choices))
        return ",".join(names)

    return parse


def int_list(low: int | None = None, keywords: Sequence[str] = ()) -> Callable[[str], str]:
    """An argparse type: one of ``keywords``, or comma-separated whole numbers (each >= ``low``)."""

    def parse(text: str) -> str:
        if text.strip() in keywords:
            return text.strip()
        items = split_names(text, "whole number")
        for item in items:
            try:
                value = int(item)
            except ValueError:
                hint = did_you_mean(item, keywords) if keywords else "."
                words = f"{', '.join(keywords)} or " if keywords else ""
                raise argparse.ArgumentTypeError(
                    f"expected {words}comma-separated whole numbers like 0,5,-1; {item!r} is not one{hint}") from None
            if low is not None and value < low:
                raise argparse.ArgumentTypeError(f"each number must be at least {low}, got {value}")
        return ",".join(items)

    return parse


def parse_ints(text: str) -> list[int]:
    """The numbers of a value already checked by :func:`int_list`."""
    return [int(x) for x in text.split(",")]


def device_type(text: str) -> str:
    """An argparse type: ``cpu``, or an accelerator that this machine has."""
    text = text.strip()
    if text == "cpu":
        return text
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r} asked for, but CUDA is not available here (torch.cuda.is_available() is False); "
                "use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise argparse.ArgumentTypeError(f"{text!r} asked for, but MPS is not available here; use --device cpu")
    else:
        raise argparse.ArgumentTypeError(f"unsupported device {text!r}; use cpu, cuda, cuda:N or mps")
    return text


# ---------------------------------------------------------------------------------------
# Checks that run after parsing and before any model loads


def check_model_source(name: str) -> None:
    """The model is a bundled name, an existing .gguf file or a Hugging Face folder."""
    from interp import models

    if name in models.BUNDLED:
        return
    path = Path(name).expanduser()
    if name.endswith(".gguf") or path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist. Give --model an existing .gguf file.")
        return
    if path.is_dir():
        return
    raise ModelLoadError(
        f"Unknown model {name!r}{did_you_mean(name, models.BUNDLED)} Use one of {sorted(models.BUNDLED)}, "
        "a Hugging Face model folder, or a path to a .gguf file."
    )


def check_cache_dir() -> None:
    """The model cache (``$INTERP_CACHE`` or ``~/.cache/interp``) is a writable folder."""
    from interp.io import ensure_writable_dir
    from interp.models import cache_dir

    root = cache_dir()
    try:
        ensure_writable_dir(root)
    except ResourceError:
        why = "it is a file" if root.is_file() else "it cannot be created or written"
        where = "INTERP_CACHE" if os.environ.get("INTERP_CACHE") else "the default model cache"
        raise ResourceError(
            f"{where} {root} is not a usable folder ({why}). Point INTERP_CACHE at a writable folder "
            "(e.g. export INTERP_CACHE=$HOME/.cache/interp)."
        ) from None


def check_writable_file(path: str, option: str) -> None:
    """``path`` is not a folder and its parent folder can be written (created if needed)."""
    from interp.io import ensure_writable_dir

    target = Path(path)
    if target.is_dir():
        raise ResourceError(f"{option} {path} is a folder; give a file name such as page.png.")
    try:
        ensure_writable_dir(target.parent)
    except ResourceError:
        raise ResourceError(f"Cannot write {option} {path}: its folder {target.parent} is not writable.") from None


def check_loads_model(args: argparse.Namespace) -> None:
    """Model source and model cache (only needed when the model comes from a file to convert)."""
    check_model_source(args.model)
    if args.model.endswith(".gguf") or args.model in _bundled():
        check_cache_dir()


def check_data(args: argparse.Namespace) -> None:
    """``--data`` can be read and holds text (the rows' length is checked once a tokenizer exists)."""
    from interp.data import read_documents

    read_documents(args.data)


def check_out(args: argparse.Namespace) -> None:
    from interp.io import ensure_writable_dir

    ensure_writable_dir(args.out)


def set_threads(args: argparse.Namespace) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def _bundled() -> Sequence[str]:
    from interp.models import BUNDLED

    return tuple(BUNDLED)


def add_checks(p: argparse.ArgumentParser, *checks: Check) -> None:
    """Run ``checks`` (in order, after those added before) before the command."""
    p.set_defaults(checks=(*(p.get_default("checks") or ()), *checks))


# ---------------------------------------------------------------------------------------
# Shared options


def add_model_data(p: argparse.ArgumentParser, n: int = 64, seq_len: int = 128) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="bundled model (smollm2-135m, gemma3-270m), a Hugging Face folder, or a .gguf file")
    p.add_argument("--data", default="wiki",
                   help="'wiki' (bundled), a .txt file (documents separated by blank lines), a .jsonl file "
                        "or a .csv file with a 'text' field, or a saved datasets folder")
    p.add_argument("--n", type=int_at_least(1), default=n, help="number of examples")
    p.add_argument("--seq-len", type=int_at_least(2), default=seq_len, help="tokens per example, BOS included")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed for which documents are chosen")
    p.add_argument("--batch-size", type=int_at_least(1), default=8, help="examples per forward pass")
    p.add_argument("--device", type=device_type, default="cpu", help="cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="model parameter dtype")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_checks(p, check_loads_model, check_data)


def load_model_and_examples(args: argparse.Namespace, split: str = "eval") -> tuple[Any, Any]:
    import torch

    import interp

    model = interp.load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    examples = interp.load_examples(args.data, model.tokenizer, n=args.n, seq_len=args.seq_len,
                                    seed=args.seed, split=split)
    return model, examples


# ---------------------------------------------------------------------------------------
# interp probe


def _components() -> Sequence[str]:
    from interp.hooks import COMPONENTS

    return COMPONENTS


def _reducers() -> Sequence[str]:
    from interp.probes import REDUCERS

    return tuple(REDUCERS)


def _check_probe_pairs(args: argparse.Namespace) -> None:
    """Every component has a reducer that applies to it (``_pairs`` with no layers touches no model)."""
    from interp.probes import _pairs

    _pairs(None, args.components.split(","), args.reducers.split(","), [])


def _probe_args(p: argparse.ArgumentParser) -> None:
    add_model_data(p)
    p.add_argument("--components", default="resid_mid,resid_post,h,gate",
                   type=name_list("component", _components),
                   help=f"comma-separated components, from: {', '.join(_components())}")
    p.add_argument("--reducers", default="norm,mean,kurtosis", type=name_list("reducer", _reducers),
                   help=f"comma-separated reducers, from: {', '.join(_reducers())} (entropy, gtd, sink_share, "
                        "effective_span and entropy_norm apply to 'pattern' only)")
    p.add_argument("--out", default="reports/probe", help="output folder")
    add_checks(p, _check_probe_pairs, check_out)


@command("probe", "capture per-layer statistics (norms, gate stats, attention entropy) and save them", _probe_args)
def cmd_probe(args: argparse.Namespace) -> int:
    import pandas as pd

    from interp.io import ensure_writable_dir
    from interp.probes import probe

    out = ensure_writable_dir(args.out)
    start = time.time()
    model, examples = load_model_and_examples(args)
    result = probe(model, examples, args.components.split(","), args.reducers.split(","),
                   batch_size=args.batch_size, progress=not args.quiet and None)
    result.save(out)
    summary = result.summary()
    summary.to_csv(out / "summary.csv")
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.float_format", "{:.3f}".format):
        print(summary)
    print(f"\n{len(examples)} examples x {examples.seq_len} tokens, {model.info.n_layers} layers, "
          f"{time.time() - start:.1f} s. Saved to {out}/ (summary.csv, probe.parquet, stats.safetensors)")
    return 0


# ---------------------------------------------------------------------------------------
# The parser and main()


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that subcommand gets its options (``""``: none), so the others'
    option lists, which import the registries of valid names, are not built."""
    _register_optional_commands()
    parser = argparse.ArgumentParser(prog="interp", description=DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"interp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, configure, fn) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        if only is None or only == name:
            configure(p)
        p.set_defaults(func=fn)
    return parser


def _register_optional_commands() -> None:
    """Import the modules that register more subcommands (they add themselves to COMMANDS)."""
    import importlib

    for module in ("interp.cli_attention", "interp.cli_quant", "interp.cli_lens", "interp.cli_report"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is not an option)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (argparse's own errors raise SystemExit(2))."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = _command_of(argv)
    label = "interp"
    try:
        _register_optional_commands()
        label = f"interp {name}" if name in COMMANDS else label
        parser = build_parser(only=name if name in COMMANDS else "")  # --version/--help need no options
        if name is not None and name not in COMMANDS:
            parser.error(unknown_name("command", name, list(COMMANDS)))
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 0
        for check in getattr(args, "checks", ()):
            check(args)
        return int(args.func(args) or 0)
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
    import tempfile
    import traceback

    text = (f"interp {__version__}\nargv: {sys.argv}\npython: {sys.version}\n\n"
            + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    cache = os.environ.get("INTERP_CACHE") or Path.home() / ".cache" / "interp"
    stamp = f"crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    for folder in (Path(cache) / "logs", Path(tempfile.gettempdir()) / "interp-logs"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / stamp).write_text(text)
            return folder / stamp
        except OSError:
            continue
    return None


if __name__ == "__main__":  # pragma: no cover - run as a module: delegate to the registered copy
    from interp.cli import main as registered_main

    sys.exit(registered_main())


def default_out(name: str) -> str:
    return str(Path("reports") / name)
