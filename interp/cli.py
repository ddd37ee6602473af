"""The ``interp`` command line.

Each subcommand is a thin wrapper over the Python API: it parses options, calls one
function, and writes tables (CSV/parquet), JSON and figures into ``--out``. Errors in
interp's own words are printed without a traceback and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from interp.errors import InterpError

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help_text: str, configure: Callable[[argparse.ArgumentParser], None]):
    def register(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = (help_text, configure, fn)
        return fn

    return register


def add_model_data(p: argparse.ArgumentParser, n: int = 64, seq_len: int = 128) -> None:
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, gemma3-270m, an HF folder or a .gguf")
    p.add_argument("--data", default="wiki", help="'wiki', a .txt/.jsonl file, or a saved datasets folder")
    p.add_argument("--n", type=int, default=n, help="number of examples")
    p.add_argument("--seq-len", type=int, default=seq_len, help="tokens per example, BOS included")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def load_model_and_examples(args: argparse.Namespace, split: str = "eval") -> tuple[Any, Any]:
    import torch

    import interp

    model = interp.load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    examples = interp.load_examples(args.data, model.tokenizer, n=args.n, seq_len=args.seq_len,
                                    seed=args.seed, split=split)
    return model, examples


def _probe_args(p: argparse.ArgumentParser) -> None:
    add_model_data(p)
    p.add_argument("--components", default="resid_mid,resid_post,h,gate", help="comma-separated components")
    p.add_argument("--reducers", default="norm,mean,kurtosis", help="comma-separated reducers")
    p.add_argument("--out", default="reports/probe", help="output folder")


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


def build_parser() -> argparse.ArgumentParser:
    _register_optional_commands()
    parser = argparse.ArgumentParser(prog="interp", description=__doc__.split("\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, configure, fn) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except InterpError as exc:
        print(f"interp {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interp {args.command}: interrupted; finished work is saved and a rerun resumes.", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover - run as a module: delegate to the registered copy
    from interp.cli import main as registered_main

    sys.exit(registered_main())


def default_out(name: str) -> str:
    return str(Path("reports") / name)
