"""Quantization subcommands: ``interp quantize``, ``interp score``, ``interp errors``.

- ``quantize`` writes one quantized model (block weights as safetensors + JSON provenance).
- ``score`` computes per-example errors ``NLL(quantized) - NLL(reference)`` for several
  specs into a resumable SQLite store, and writes ``errors.csv`` and ``nll.csv``.
- ``errors`` reads a ``score`` folder (``--scores``) and runs the analyses (agreement,
  D_large/D_ctrl, residual norm vs error, reversal), writing tables (CSV/JSON) and figures
  (HTML, and PNG when a browser for static export is available) into its ``analysis/``.

Method specs are checked by :func:`interp.quant.spec.parse_spec` while the options are
parsed, so a bad spec stops the command before any model loads.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from interp.cli import (
    add_checks,
    add_model_data,
    check_out,
    command,
    did_you_mean,
    int_at_least,
    set_threads,
    unknown_name,
)
from interp.errors import InterpError, SpecError

DEFAULT_SPECS = "rtn:bits=3,nf:bits=3"


def check_spec(text: str) -> Any:
    """``parse_spec(text)``, with a "did you mean" when the method name is unknown."""
    from interp.quant.spec import METHODS, parse_spec

    method = text.split(":", 1)[0].strip().lower()
    if method not in METHODS:
        raise SpecError(unknown_name("quantization method", method, list(METHODS))
                        + " A spec looks like 'rtn:bits=3,group=64'.")
    return parse_spec(text)


def parse_spec_list(text: str) -> list[Any]:
    """Every spec of a list (see :func:`split_specs`), checked; at least one."""
    from interp.quant.spec import METHODS

    for item in text.replace(";", " ").replace(",", " ").split():
        if ":" in item and item.split(":", 1)[0].strip().lower() not in METHODS:
            check_spec(item)  # an unknown method after a comma would otherwise read as an option
    specs = split_specs(text)
    if not specs:
        raise SpecError("give at least one method spec, e.g. 'rtn:bits=3,group=64;nf:bits=4'.")
    return [check_spec(s) for s in specs]


def _argparse_type(fn: Any, name: str) -> Any:
    def parse(text: str) -> str:
        try:
            fn(text)
        except SpecError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text.strip()

    parse.__name__ = name
    return parse


spec_type = _argparse_type(check_spec, "spec")
spec_list_type = _argparse_type(parse_spec_list, "spec list")


def _specs_help(example: str) -> str:
    from interp.quant.spec import METHODS

    methods = ", ".join(f"{name} (bits {syntax.bits_text()})" for name, syntax in METHODS.items())
    return f"{example}; methods: {methods}"


def _calibration(args: argparse.Namespace, model: Any, specs: list[Any]) -> Any:
    import interp

    if not any(s.needs_calibration for s in specs):
        return None
    return interp.load_examples(args.data, model.tokenizer, n=args.calibration_n,
                                seq_len=args.calibration_seq_len or args.seq_len, seed=args.seed,
                                split="calibration")


def _common_quant_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibration-n", type=int_at_least(1), default=128, help="calibration examples (gptq, awq)")
    p.add_argument("--calibration-seq-len", type=int_at_least(2), default=None,
                   help="tokens per calibration example (default: --seq-len)")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads")


# ---------------------------------------------------------------------------------------


def _quantize_args(p: argparse.ArgumentParser) -> None:
    add_model_data(p, n=128)
    _common_quant_args(p)
    p.add_argument("--method", required=True, type=spec_type,
                   help=_specs_help("method spec, e.g. gptq:bits=3,group=64"))
    p.add_argument("--out", required=True, help="output folder for the quantized weights")
    add_checks(p, check_out, set_threads)


@command("quantize", "quantize every block linear layer of a model and save the weights", _quantize_args)
def cmd_quantize(args: argparse.Namespace) -> int:
    import torch

    import interp
    from interp.io import ensure_writable_dir
    from interp.quant import parse_spec
    from interp.quant.apply import quantize, save_quantized

    spec = parse_spec(args.method)
    out = ensure_writable_dir(args.out)
    model = interp.load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    calibration = _calibration(args, model, [spec])
    qmodel = quantize(model, spec, calibration=calibration, progress=not args.quiet and None,
                      batch_size=args.batch_size)
    save_quantized(qmodel, out)
    info = qmodel.quant_info
    print(f"{info.spec}: {len(info.layer_seconds)} layers, {info.seconds_per_layer:.2f} s/layer. "
          f"Saved to {out}/ (quantized.safetensors, quant.json)")
    return 0


# ---------------------------------------------------------------------------------------


def _score_args(p: argparse.ArgumentParser) -> None:
    add_model_data(p, n=256)
    _common_quant_args(p)
    p.add_argument("--methods", default=DEFAULT_SPECS, type=spec_list_type,
                   help=_specs_help("method specs separated by ';' or spaces, or by ',' before a method name "
                                    "(e.g. 'rtn:bits=3,group=64,gptq:bits=3')"))
    p.add_argument("--kl", action="store_true", help="also store KL(p_ref || p_quant) (about 2x slower)")
    p.add_argument("--out", default="reports/quant", help="output folder (store, CSVs, quantized cache)")
    add_checks(p, check_out, set_threads)


def split_specs(text: str) -> list[str]:
    """Split a list of specs: ``;``/whitespace separate them, and so does a ``,`` before a method name.

    >>> split_specs("rtn:bits=3,group=64,gptq:bits=3;nf:bits=4")
    ['rtn:bits=3,group=64', 'gptq:bits=3', 'nf:bits=4']
    """
    from interp.quant.spec import METHODS

    specs: list[str] = []
    for chunk in text.replace(";", " ").split():
        for item in chunk.split(","):
            head = item.split(":", 1)[0].strip().lower()
            if not specs or (":" in item and head in METHODS):
                specs.append(item)
            else:
                specs[-1] += "," + item
    return [s for s in specs if s]


@command("score", "per-example quantization error NLL(quant) - NLL(ref) for several specs (resumable)",
         _score_args)
def cmd_score(args: argparse.Namespace) -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: see interp/distributed.py
        from interp.distributed import cli_score

        return cli_score(args)
    from interp.cli import load_model_and_examples
    from interp.io import ensure_writable_dir
    from interp.quant import parse_spec
    from interp.quant.store import score

    specs = [parse_spec(s) for s in split_specs(args.methods)]
    out = ensure_writable_dir(args.out)
    start = time.time()
    model, examples = load_model_and_examples(args)
    calibration = _calibration(args, model, specs)
    errors = score(model, specs, examples, store=out, calibration=calibration, batch_size=args.batch_size,
                   kl=args.kl, progress=not args.quiet and None)
    save_score_outputs(out, args, model, examples, calibration, specs, errors, start)
    return 0


def _timings(cache: Path) -> dict[str, Any]:
    """Per-spec quantizer timing from the cached quantized models' JSON records."""
    from interp.quant.apply import read_quant_info

    timings: dict[str, Any] = {}
    for folder in sorted(cache.glob("*")) if cache.is_dir() else []:
        record = read_quant_info(folder)
        if record is not None:
            layers = record["layer_seconds"]
            timings[record["spec"]] = {
                "seconds_per_layer": sum(layers) / max(1, len(layers)),
                "total_seconds": sum(layers),
                "calibration_seconds": record["calibration_seconds"],
                "role_seconds": record["role_seconds"],
            }
    return timings


# ---------------------------------------------------------------------------------------


def _errors_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scores", metavar="FOLDER", default=None,
                   help="the folder written by `interp score` (read; the analyses go into its analysis/ subfolder)")
    p.add_argument("--out", dest="deprecated_out", metavar="FOLDER", default=None,
                   help="deprecated name of --scores (the folder is the input, not an output)")
    p.add_argument("--model", default=None,
                   help="the model whose scores to analyse, when the store holds several (the ids "
                        "`interp score` stored; default: the only one)")
    p.add_argument("--spec", default="mean", help="error used to pick D_large/D_ctrl: 'mean' over specs or one spec")
    p.add_argument("--n-boot", type=int_at_least(1), default=1000, help="bootstrap resamples")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed for the bootstrap and D_ctrl")
    p.add_argument("--batch-size", type=int_at_least(1), default=8, help="examples per forward pass")
    p.add_argument("--reversal-specs", default="", type=_reversal_type,
                   help="specs for the reversal analysis (default: all scored specs; 'none' to skip)")
    p.add_argument("--skip-norms", action="store_true", help="skip the analyses that run the model")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_checks(p, _check_scores_folder, set_threads)


def _reversal_type(text: str) -> str:
    return text if text.strip().lower() in ("", "none") else spec_list_type(text)


def _check_scores_folder(args: argparse.Namespace) -> None:
    """Resolve --scores (or the deprecated --out) and check that it holds scores."""
    if args.deprecated_out is not None:
        print("interp errors: warning: --out is deprecated for `errors` (it names the input folder); "
              "use --scores.", file=sys.stderr)
        if args.scores is not None and Path(args.scores) != Path(args.deprecated_out):
            raise InterpError(f"--scores {args.scores} and --out {args.deprecated_out} name different folders; "
                              "give only --scores.")
        args.scores = args.deprecated_out
    if args.scores is None:
        raise InterpError("give the folder written by `interp score` with --scores FOLDER.")
    folder = Path(args.scores)
    if not (folder / "scores.sqlite").is_file() and not (folder / "errors.csv").is_file():
        raise InterpError(f"{folder} has no scores.sqlite or errors.csv: run `interp score --out {folder}` first.")


def _read_errors(args: argparse.Namespace, folder: Path, settings: dict[str, Any]) -> Any:
    """The per-example errors of the chosen model (``--model``) and the scored specs."""
    import pandas as pd

    from interp.quant.store import ScoreStore

    if not (folder / "scores.sqlite").is_file():
        if args.model is not None:
            raise InterpError(f"{folder} holds only errors.csv (no store), so --model cannot choose a model.")
        return pd.read_csv(folder / "errors.csv", index_col="example").dropna()
    with ScoreStore(folder) as st:
        models = st.models()
        if args.model is not None and args.model not in models:
            raise InterpError(f"the store has no model {args.model!r}{did_you_mean(args.model, models)} "
                              f"It holds: {', '.join(models) or 'nothing yet'}.")
        if args.model is None and len(models) > 1:
            raise InterpError(f"the store holds {len(models)} models ({', '.join(models)}); choose one with --model.")
        return st.errors_frame(model=args.model, specs=settings.get("specs"))


def _scored_spec(text: str, columns: Any) -> str:
    """The canonical name of ``text``, which must be one of the scored specs."""
    name = str(check_spec(text))
    if name not in columns:
        raise InterpError(f"spec {name} is not in this store{did_you_mean(name, columns)} "
                          f"Scored specs: {', '.join(columns)}.")
    return name


def _check_errors_targets(args: argparse.Namespace, errors: Any, settings: dict[str, Any]) -> None:
    """--spec and --reversal-specs are scored specs; the model-running analyses can load their model."""
    from interp.cli import check_cache_dir, check_model_source

    if args.spec != "mean":
        _scored_spec(args.spec, errors.columns)
    for spec in _reversal_specs(args.reversal_specs) or []:
        _scored_spec(spec, errors.columns)
    if args.skip_norms:
        return
    if "model" not in settings or "examples" not in settings:
        raise InterpError(f"{args.scores}/settings.json is missing, so the model cannot be rerun; pass --skip-norms.")
    stored = str(settings.get("model_info", {}).get("source_hash", ""))[:16]
    if args.model is not None and stored and stored != args.model:
        raise InterpError(f"settings.json describes model {stored}, not {args.model}: the analyses that run the "
                          "model need that model's settings; pass --skip-norms.")
    check_model_source(settings["model"])
    check_cache_dir()


@command("errors", "analyse a `score` folder: agreement, D_large/D_ctrl, norm vs error, reversal", _errors_args)
def cmd_errors(args: argparse.Namespace) -> int:
    import json

    from interp.io import ensure_writable_dir
    from interp.quant import analysis

    folder = Path(args.scores)
    settings = json.loads((folder / "settings.json").read_text()) if (folder / "settings.json").is_file() else {}
    errors = _read_errors(args, folder, settings)
    _check_errors_targets(args, errors, settings)
    tables = ensure_writable_dir(folder / "analysis")
    written = analysis.run_all(errors, settings, tables, n_boot=args.n_boot, seed=args.seed,
                               target=args.spec, batch_size=args.batch_size, run_models=not args.skip_norms,
                               reversal_specs=_reversal_specs(args.reversal_specs),
                               progress=not args.quiet and None)
    print(f"{len(errors)} examples x {errors.shape[1]} specs. Wrote {len(written)} files to {tables}/:")
    for path in written:
        print("  " + os.path.relpath(path, tables))
    return 0


def _reversal_specs(text: str) -> list[str] | None:
    if not text:
        return None
    if text.strip().lower() == "none":
        return []
    return split_specs(text)


def save_score_outputs(out: Any, args: argparse.Namespace, model: Any, examples: Any, calibration: Any,
                       specs: list[Any], errors: Any, start: float, **extra: Any) -> None:
    """What ``interp score`` leaves in ``out`` (errors/nll/kl CSVs, settings.json) and prints.

    ``extra`` goes into settings.json (e.g. ``world_size`` for the torchrun version).
    """
    from interp.io import write_json
    from interp.quant.store import ScoreStore

    errors.to_csv(out / "errors.csv")
    with ScoreStore(out) as st:
        st.nll_frame(ids=examples.ids).to_csv(out / "nll.csv")
        if args.kl:
            st.kl_frame(ids=examples.ids).to_csv(out / "kl.csv")
    write_json(out / "settings.json", {
        "model": args.model, "model_info": model.info.to_dict(), "examples": examples.settings,
        "calibration": None if calibration is None else {**calibration.settings, "ids": calibration.ids},
        "specs": [str(s) for s in specs], "batch_size": args.batch_size, "kl": args.kl,
        **extra, "quantizer_timing": _timings(out / "quantized"),
    })
    print(errors.describe().T.to_string(float_format="{:.4f}".format))
    ranks = f", {extra['world_size']} ranks" if "world_size" in extra else ""
    print(f"\n{len(examples)} examples x {examples.seq_len} tokens, {len(specs)} specs{ranks}, "
          f"{time.time() - start:.0f} s. Saved to {out}/ (scores.sqlite, errors.csv, nll.csv, settings.json)")
