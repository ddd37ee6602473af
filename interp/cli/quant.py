"""Quantization subcommands: ``interp quantize``, ``interp score``, ``interp errors``.

- ``quantize`` writes one quantized model (block weights as safetensors + JSON provenance).
- ``score`` computes per-example errors ``NLL(quantized) - NLL(reference)`` for several
  specs into a resumable SQLite store, and writes ``errors.csv`` and ``nll.csv``.
- ``errors`` reads a ``score`` folder (``--scores``) and runs the analyses (agreement,
  D_large/D_ctrl, residual norm vs error, reversal), writing tables (CSV/JSON) and figures
  (HTML, and PNG when a browser for static export is available) into its ``analysis/``.

Method specs are parsed by :func:`interp.quant.spec.parse_spec` while the options are
parsed, once (``--method`` becomes a :class:`SpecArg`, ``--methods`` a :class:`SpecList`, each
holding the parsed specs the command passes on), so a bad spec stops the command before any
model loads; the method names, bit widths and calibration needs come from the quantizer
registry (:data:`interp.quant.spec.METHODS`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from interp.cli.common import (
    DTYPES,
    add_checks,
    add_model_data,
    check_out,
    command,
    did_you_mean,
    int_at_least,
    load_model_from_args,
    set_threads,
    unknown_name,
)
from interp.errors import InterpError, SpecError
from interp.quant.export import EXPORT_FORMATS, check_exportable
from interp.quant.spec import METHODS, MethodSpec, parse_spec, report_specs, split_specs

DEFAULT_SPECS = ";".join(s for s in report_specs(quick=True) if parse_spec(s).bits == 3)  # from the registry


def check_spec(text: str) -> Any:
    """``parse_spec(text)``, with a "did you mean" when the method name is unknown."""
    method = text.split(":", 1)[0].strip().lower()
    if method not in METHODS and not method.startswith("@"):  # @DIR/plan.json: parse_spec reads the plan
        raise SpecError(unknown_name("quantization method", method, list(METHODS))
                        + " A spec looks like 'rtn:bits=3,group=64'.")
    return parse_spec(text)


def split_checkpoints(text: str) -> tuple[str, list[str]]:
    """``(specs, paths)``: the ``--methods`` items that name a quantized checkpoint (an existing folder, or a
    ``.gguf`` file) apart from the method specs, which stay in one text."""
    specs, paths = [], []
    for item in text.replace(";", " ").split():
        path = Path(item).expanduser()
        if path.is_dir() or item.endswith(".gguf"):
            if not path.exists():
                raise SpecError(f"checkpoint {item} does not exist.")
            paths.append(item)
        else:
            specs.append(item)
    return ";".join(specs), paths


def parse_spec_list(text: str) -> list[Any]:
    """Every spec of a list (see :func:`~interp.quant.spec.split_specs`), checked; at least one spec or checkpoint."""
    text, checkpoints = split_checkpoints(text)
    if checkpoints and not text.strip():
        return []
    for item in text.replace(";", " ").replace(",", " ").split():
        if ":" in item and item.split(":", 1)[0].strip().lower() not in METHODS:
            check_spec(item)  # an unknown method after a comma would otherwise read as an option
    specs = split_specs(text)
    if not specs:
        raise SpecError("give at least one method spec, e.g. 'rtn:bits=3,group=64;nf:bits=4'.")
    return [check_spec(s) for s in specs]


@dataclass(frozen=True)
class SpecArg:
    """``--method`` as parsed with the options: the text as given (what settings record) and its spec."""

    text: str
    spec: MethodSpec

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class SpecList:
    """``--methods`` as parsed with the options: the text as given, its method specs (each parsed once, in
    order) and the quantized checkpoints it names."""

    text: str
    specs: tuple[MethodSpec, ...]
    checkpoints: tuple[str, ...]

    def __str__(self) -> str:
        return self.text


def _spec_arg(text: str) -> SpecArg:
    return SpecArg(text.strip(), check_spec(text))


def _spec_list(text: str) -> SpecList:
    return SpecList(text.strip(), tuple(parse_spec_list(text)), tuple(split_checkpoints(text)[1]))


def _argparse_type(fn: Any, name: str) -> Any:
    def parse(text: str) -> Any:
        try:
            return fn(text)
        except SpecError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = name
    return parse


spec_type = _argparse_type(_spec_arg, "spec")
spec_list_type = _argparse_type(_spec_list, "spec list")


def _specs_help(example: str) -> str:
    methods = ", ".join(f"{name} (bits {record.bits_text()})" for name, record in METHODS.items())
    return f"{example}; methods: {methods}"


def _calibration(args: argparse.Namespace, model: Any, specs: list[Any]) -> Any:
    """The calibration examples the options describe, when a spec needs them (else None)."""
    from interp.quant.calibration import load_calibration

    return load_calibration(args.data, model.tokenizer, specs, n=args.calibration_n,
                            seq_len=args.calibration_seq_len or args.seq_len, seed=args.seed)


def _common_quant_args(p: argparse.ArgumentParser) -> None:
    calibrated = ", ".join(name for name, record in METHODS.items() if record.needs_calibration)
    p.add_argument("--calibration-n", type=int_at_least(1), default=128,
                   help=f"calibration examples (for {calibrated})")
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
    p.add_argument("--format", default="interp", choices=EXPORT_FORMATS,
                   help="interp: block weights + quant.json, for interp to reload; compressed-tensors: a "
                        "checkpoint plain transformers loads (rtn, or gptq with act_order=1)")
    add_checks(p, check_out, set_threads, _check_format)


def _check_format(args: argparse.Namespace) -> None:
    """A compressed-tensors export needs a spec with a recoverable integer grid: refused before the model loads."""
    if args.format == "compressed-tensors":
        check_exportable(args.method.spec)


@command("quantize", "quantize every block linear layer of a model and save the weights", _quantize_args)
def cmd_quantize(args: argparse.Namespace) -> int:
    from interp.io import ensure_writable_dir
    from interp.quant.apply import quantize, save_quantized
    from interp.quant.inplace import quantized_in_place

    spec = args.method.spec  # parsed with the options
    out = ensure_writable_dir(args.out)
    model = load_model_from_args(args)
    calibration = _calibration(args, model, [spec])
    progress = not args.quiet and None
    if args.format == "compressed-tensors":
        from interp.quant.export import export_compressed_tensors

        qmodel = quantize(model, spec, calibration=calibration, progress=progress, batch_size=args.batch_size)
        info = qmodel.quant_info
        export_compressed_tensors(qmodel, model, out)
        saved = "config.json with a compressed-tensors quantization_config, model.safetensors, tokenizer"
    else:  # one copy of the weights: quantized in place, saved, and the reference put back (interp.quant.inplace)
        with quantized_in_place(model, spec, calibration, progress=progress, batch_size=args.batch_size,
                                stash_dir=out.parent) as info:
            save_quantized(model, out, info=info)
        saved = "quantized.safetensors, quant.json"
    print(f"{info.spec}: {len(info.layer_seconds)} layers, {info.seconds_per_layer:.2f} s/layer. "
          f"Saved to {out}/ ({saved})")
    return 0


# ---------------------------------------------------------------------------------------


def _score_args(p: argparse.ArgumentParser) -> None:
    add_model_data(p, n=256)
    _common_quant_args(p)
    p.add_argument("--methods", default=DEFAULT_SPECS, type=spec_list_type,
                   help=_specs_help("method specs separated by ';' or spaces, or by ',' before a method name "
                                    "(e.g. 'rtn:bits=3,group=64,gptq:bits=3'), and/or paths of quantized "
                                    "checkpoints (compressed-tensors, GPTQ or AWQ folders, .gguf files) to score "
                                    "against --model"))
    p.add_argument("--kl", action="store_true", help="also store KL(p_ref || p_quant) (about 2x slower)")
    p.add_argument("--out", default="reports/quant", help="output folder (store, CSVs, quantized cache)")
    add_checks(p, check_out, _check_store, set_threads)


def _check_store(args: argparse.Namespace) -> None:
    """An existing ``--out/scores.sqlite`` is a score store (not a folder, another database or other bytes)."""
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    from interp.quant.store import ScoreStore

    if (Path(args.out) / "scores.sqlite").exists():
        ScoreStore(args.out).close()  # raises InterpError naming the file when it is not a store


@command("score", "per-example quantization error NLL(quant) - NLL(ref) for several specs (resumable)",
         _score_args)
def cmd_score(args: argparse.Namespace) -> int:
    from interp.runtime.torchrun import world

    if world()[2] > 1:  # under torchrun: see interp/quant/distributed.py
        from interp.quant.distributed import cli_score

        return cli_score(args)
    from interp.cli.common import load_model_and_examples
    from interp.io import ensure_writable_dir
    from interp.quant.outputs import score_summary, write_score_outputs
    from interp.quant.store import score

    specs, checkpoints = list(args.methods.specs), list(args.methods.checkpoints)  # parsed with the options
    out = ensure_writable_dir(args.out)
    start = time.time()
    model, examples = load_model_and_examples(args)
    calibration = _calibration(args, model, specs) if specs else None
    if specs:
        errors = score(model, specs, examples, store=out, calibration=calibration, batch_size=args.batch_size,
                       kl=args.kl, progress=not args.quiet and None)
    else:
        import pandas as pd

        errors = pd.DataFrame(index=pd.Index(examples.ids, name="example"))
    shipped = _score_checkpoints(model, examples, checkpoints, args.batch_size, errors)
    write_score_outputs(out, args.model, model, examples, calibration, specs, errors, args.batch_size, args.kl,
                        dtype=args.dtype, checkpoints=shipped)
    print(score_summary(out, errors, examples, len(specs), time.time() - start))
    return 0


def _score_checkpoints(model: Any, examples: Any, paths: list[str], batch_size: int, errors: Any) -> dict[str, Any]:
    """Add a column ``checkpoint:<folder name>`` to ``errors`` per checkpoint: NLL(checkpoint) - NLL(model).

    Not kept in the resumable store (its keys are method specs): a rerun recomputes these columns.
    """
    import interp

    if not paths:
        return {}
    reference = interp.nll(model, examples, batch_size=batch_size).double().numpy()
    described = {}
    for path in paths:
        shipped = interp.load_model(path)
        if shipped.tokenizer.get_vocab() != model.tokenizer.get_vocab():
            raise InterpError(f"checkpoint {path} has another tokenizer than --model {model.info.name}: its errors "
                              "against that reference would compare different token sequences.")
        name = f"checkpoint:{Path(path).name}"
        errors[name] = interp.nll(shipped, examples, batch_size=batch_size).double().numpy() - reference
        info = getattr(shipped, "checkpoint_info", None)
        described[name] = {"path": str(Path(path).resolve()),
                           **(info.to_dict() if info is not None else {"format": "gguf" if path.endswith(".gguf")
                                                                        else "dense"})}
    return described


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
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="model dtype for the analyses that run it (default: the one the scores were made in)")
    p.add_argument("--reference", metavar="MODEL", default=None,
                   help="the reference model the analyses rerun: the one the scores were made with. A bundled "
                        "model named in the folder's settings.json is loaded without it; a folder or .gguf "
                        "file is loaded only when named here too (settings.json is data, not an instruction)")
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
    from interp.io import check_complete

    check_complete(folder, "score output")  # a killed `interp score` left it part-written: resume it first
    args.settings = _read_settings(folder)


SETTINGS_TYPES = {"model": str, "model_info": dict, "examples": dict, "calibration": dict, "specs": list,
                  "dtype": str}
EXAMPLES_TYPES = {"source": str, "n": int, "seq_len": int, "seed": int, "split": str}


def _read_settings(folder: Path) -> dict[str, Any]:
    """A score folder's ``settings.json`` as data: bounded, a JSON object, each entry of the type `score` writes.

    A truncated, hand-broken or foreign file is a :class:`~interp.errors.DataError` here, before any analysis.
    """
    from interp.errors import DataError
    from interp.reading import read_json

    path = folder / "settings.json"
    if not path.exists() and not path.is_symlink():
        return {}
    settings = read_json(path, "the score settings", error=DataError)
    if not isinstance(settings, dict):
        raise DataError(f"{path} is not a JSON object: it is not the settings.json `interp score` writes.")
    for key, kind in SETTINGS_TYPES.items():
        if settings.get(key) is not None and not isinstance(settings[key], kind):
            raise DataError(f"{path}: '{key}' is {type(settings[key]).__name__}, not {kind.__name__}: the file was "
                            "edited or damaged. Rerun `interp score`, or pass --skip-norms.")
    for key, kind in EXAMPLES_TYPES.items() if settings.get("examples") is not None else ():
        value = settings["examples"].get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise DataError(f"{path}: the examples entry '{key}' is {value!r}, not {kind.__name__}: the file was "
                            "edited or damaged. Rerun `interp score`, or pass --skip-norms.")
    return settings


def _reference_model(args: argparse.Namespace, settings: dict[str, Any]) -> str:
    """The model the analyses rerun. settings.json is data: a model it names is loaded only when it is a bundled
    name, or when the user names it too (``--reference``); the choice is printed before anything loads."""
    from interp import models
    from interp.cli.common import check_model_source

    named = settings["model"]
    if args.reference is not None:
        check_model_source(args.reference)
        if args.reference != named:
            print(f"settings.json names the model {named}; the analyses rerun --reference {args.reference}.",
                  file=sys.stderr)
        return str(args.reference)
    check_model_source(named)
    if named not in models.BUNDLED:
        raise InterpError(f"{args.scores}/settings.json names the model {named!r}, and interp errors does not load a "
                          "model that only a results folder names. If it is the model you scored, pass "
                          f"--reference {named}; or pass --skip-norms to analyse without rerunning a model.")
    print(f"The analyses rerun the bundled model {named}, which settings.json names.", file=sys.stderr)
    return str(named)


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
    from interp.cli.common import check_cache_dir

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
    args.reference = _reference_model(args, settings)
    check_cache_dir()


@command("errors", "analyse a `score` folder: agreement, D_large/D_ctrl, norm vs error, reversal", _errors_args)
def cmd_errors(args: argparse.Namespace) -> int:
    from interp.figures.quant import folder_figures
    from interp.io import ensure_writable_dir
    from interp.quant import analysis

    folder = Path(args.scores)
    settings = args.settings
    errors = _read_errors(args, folder, settings)
    _check_errors_targets(args, errors, settings)
    if not args.skip_norms:  # the model the user named (or a bundled one), not whatever settings.json says
        settings = {**settings, "model": args.reference}
    tables = ensure_writable_dir(folder / "analysis")
    done = analysis.run_all(errors, settings, tables, n_boot=args.n_boot, seed=args.seed,
                            target=args.spec, batch_size=args.batch_size, run_models=not args.skip_norms,
                            reversal_specs=_reversal_specs(args.reversal_specs),
                            progress=not args.quiet and None, dtype=args.dtype or settings.get("dtype"))
    written = done.written + _write_figures(folder_figures(done.results), tables)
    print(f"{len(errors)} examples x {errors.shape[1]} specs. Wrote {len(written)} files to {tables}/:")
    for path in written:
        print("  " + os.path.relpath(path, tables))
    return 0


def _write_figures(figures: dict[str, Any], out: Path) -> list[Path]:
    """Each figure as ``<name>.html`` (plotly.min.js written once beside the pages: offline, and not copied
    into each file), and as PNG when ``BROWSER_PATH`` names an existing browser for static export."""
    from interp.figures import export_static
    from interp.figures.style import save_html

    written = save_html(figures, out)
    browser = os.environ.get("BROWSER_PATH", "")
    if browser and Path(browser).exists():
        written.extend(export_static(figures, out, formats=("png",)))
    return written


def _reversal_specs(text: str) -> list[str] | None:
    if not text:
        return None
    if text.strip().lower() == "none":
        return []
    return split_specs(text)
