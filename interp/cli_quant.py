"""Quantization subcommands: ``interp quantize``, ``interp score``, ``interp errors``.

- ``quantize`` writes one quantized model (block weights as safetensors + JSON provenance).
- ``score`` computes per-example errors ``NLL(quantized) - NLL(reference)`` for several
  specs into a resumable SQLite store, and writes ``errors.csv`` and ``nll.csv``.
- ``errors`` reads a ``score`` folder and runs the analyses (agreement, D_large/D_ctrl,
  residual norm vs error, reversal), writing tables (CSV/JSON) and figures (HTML, and PNG
  when a browser for static export is available).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from interp.cli import add_model_data, command
from interp.errors import InterpError

DEFAULT_SPECS = "rtn:bits=3,nf:bits=3"


def _threads(args: argparse.Namespace) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def _calibration(args: argparse.Namespace, model: Any, specs: list[Any]) -> Any:
    import interp

    if not any(s.needs_calibration for s in specs):
        return None
    return interp.load_examples(args.data, model.tokenizer, n=args.calibration_n,
                                seq_len=args.calibration_seq_len or args.seq_len, seed=args.seed,
                                split="calibration")


def _common_quant_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibration-n", type=int, default=128, help="calibration examples (gptq, awq)")
    p.add_argument("--calibration-seq-len", type=int, default=None, help="default: --seq-len")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


# ---------------------------------------------------------------------------------------


def _quantize_args(p: argparse.ArgumentParser) -> None:
    add_model_data(p, n=128)
    _common_quant_args(p)
    p.add_argument("--method", required=True, help="method spec, e.g. gptq:bits=3,group=64")
    p.add_argument("--out", required=True, help="output folder for the quantized weights")


@command("quantize", "quantize every block linear layer of a model and save the weights", _quantize_args)
def cmd_quantize(args: argparse.Namespace) -> int:
    import interp
    from interp.io import ensure_writable_dir
    from interp.quant import parse_spec
    from interp.quant.apply import quantize, save_quantized

    _threads(args)
    spec = parse_spec(args.method)
    out = ensure_writable_dir(args.out)
    model = interp.load_model(args.model, device=args.device)
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
    p.add_argument("--methods", default=DEFAULT_SPECS,
                   help="method specs separated by ';' or spaces, or by ',' before a method name "
                        "(e.g. 'rtn:bits=3,group=64,gptq:bits=3')")
    p.add_argument("--kl", action="store_true", help="also store KL(p_ref || p_quant) (about 2x slower)")
    p.add_argument("--out", default="reports/quant", help="output folder (store, CSVs, quantized cache)")


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

    _threads(args)
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
    p.add_argument("--out", required=True, help="a folder written by `interp score`")
    p.add_argument("--spec", default="mean", help="error used to pick D_large/D_ctrl: 'mean' over specs or one spec")
    p.add_argument("--n-boot", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--reversal-specs", default="",
                   help="specs for the reversal analysis (default: all scored specs; 'none' to skip)")
    p.add_argument("--skip-norms", action="store_true", help="skip the analyses that run the model")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quiet", action="store_true")


@command("errors", "analyse a `score` folder: agreement, D_large/D_ctrl, norm vs error, reversal", _errors_args)
def cmd_errors(args: argparse.Namespace) -> int:
    import json

    import pandas as pd

    from interp.quant import analysis
    from interp.quant.store import ScoreStore

    _threads(args)
    out = Path(args.out)
    if not (out / "scores.sqlite").is_file() and not (out / "errors.csv").is_file():
        raise InterpError(f"{out} has no scores.sqlite or errors.csv: run `interp score --out {out}` first.")
    settings = json.loads((out / "settings.json").read_text()) if (out / "settings.json").is_file() else {}
    if (out / "scores.sqlite").is_file():
        with ScoreStore(out) as st:
            errors = st.errors_frame(specs=settings.get("specs"))
    else:
        errors = pd.read_csv(out / "errors.csv", index_col="example").dropna()
    tables = out / "analysis"
    tables.mkdir(exist_ok=True)
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
