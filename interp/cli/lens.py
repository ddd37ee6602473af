"""Early-exit, restoration and patching subcommands: ``interp lens`` and ``interp patch``.

Both start the same way: load the reference model and eval examples, quantize a copy with
``--method`` (cached on disk), score both models on the examples, and pick D_large (the
highest-error examples, deduplicated) and D_ctrl with
:func:`interp.quant.analysis.split_large_ctrl`. Then:

- ``interp lens`` runs early exit for {reference, quantized} x {D_large, D_ctrl} (through the
  logit lens, or with ``--lens tuned`` through a tuned lens fitted on the calibration split and
  cached) and the top-k layer restoration curve on D_large. It says at which layers the lens is
  uninformative (the reference's NLL no better than a uniform guess, ``ln |V|``): a gap there says
  nothing, and the split is read only where the lens is informative;
- ``interp patch`` runs the paper's patching table (upper half, all positions), gate input
  against gate weights, and optionally the per-layer sweep, with one copy of the weights: the
  quantized block weights (the cache folder, ``ErrorSplit.weights``) are swapped into the
  reference per batch instead of loading the copy (``attribution`` alone still loads it).

Every experiment writes ``<name>.csv`` and ``<name>.html`` into ``--out``, plus ``split.csv``
(the per-example errors and sets) and ``settings.json``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from interp.cli.common import (
    add_checks,
    add_model_data,
    check_out,
    command,
    float_in,
    int_at_least,
    int_list,
    name_list,
    parse_ints,
)
from interp.cli.quant import spec_type
from interp.quant.spec import report_specs

DEFAULT_METHOD = report_specs(quick=True)[0]  # the registry's simplest 3-bit spec
LENS_EXPERIMENTS = ("early-exit", "restoration")
PATCH_EXPERIMENTS = ("table", "gate-input", "sweep", "attribution")
LAYER_SETS = ("upper_half", "lower_half", "all")
LENSES = ("logit", "tuned")


def _common(p: argparse.ArgumentParser, out: str) -> None:
    add_model_data(p, n=64, seq_len=128)
    p.add_argument("--method", default=DEFAULT_METHOD, type=spec_type,
                   help="quantization method spec, e.g. gptq:bits=3,group=64")
    p.add_argument("--calibration-n", type=int_at_least(1), default=64, help="calibration examples (gptq, awq)")
    p.add_argument("--top", type=float_in(0, 1, low_open=True), default=0.10,
                   help="D_large: this fraction (0 < top <= 1) of the highest-error examples")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads")
    p.add_argument("--out", default=out, help="output folder")
    add_checks(p, check_out)


def _experiments(text: str) -> list[str]:
    return text.split(",")


def _error_setup(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """Reference, :class:`~interp.quant.analysis.error_split.ErrorSplit`, parsed spec and eval examples."""
    import interp
    from interp.cli.common import load_model_and_examples
    from interp.quant import error_split
    from interp.runtime.distributed import pin_threads, world

    pin_threads(args.threads)
    spec = args.method.spec  # parsed with the options (interp.cli.quant.SpecArg)
    reference, examples = load_model_and_examples(args)
    calibration = None
    if spec.needs_calibration:
        calibration = interp.load_examples(args.data, reference.tokenizer, n=args.calibration_n,
                                           seq_len=args.seq_len, seed=args.seed, split="calibration")
    store, cache = Path(args.out) / "scores", interp.models.cache_dir() / "quantized"
    common = dict(calibration=calibration, split_on=str(spec), cache_dir=cache, top=args.top, seed=args.seed,
                  batch_size=args.batch_size, progress=not args.quiet and None)
    if world()[2] > 1:  # torchrun: each rank scores its batches, then every rank reads the merged store
        from interp.quant.apply import model_hash
        from interp.quant.distributed import score_distributed
        from interp.quant.store import ScoreStore

        score_distributed(reference, [spec], examples, store, calibration=calibration, cache_dir=cache,
                          batch_size=args.batch_size, progress=(not args.quiet and None) if world()[0] == 0 else False)
        with ScoreStore(store) as scores:
            errors = scores.errors_frame(model_hash(reference), [str(spec)], examples.ids, complete=False)
        setup = error_split(reference, [spec], examples, errors=errors, **common)
    else:
        setup = error_split(reference, [spec], examples, store=store, **common)
    return reference, setup, spec, examples


def _write(out: Path, name: str, table: Any, figure: Any) -> None:
    from interp.figures.style import save_html
    from interp.io import write_csv

    write_csv(out / f"{name}.csv", table, index=False)
    save_html({name: figure}, out)


def _show(title: str, table: Any) -> None:
    import pandas as pd

    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_rows", 40,
                           "display.float_format", "{:.3f}".format):
        print(f"\n{title}\n{table}")


def _save_settings(out: Path, args: argparse.Namespace, reference: Any, examples: Any, split: Any,
                   seconds: float, extra: dict[str, Any] | None = None) -> None:
    from interp.io import write_csv, write_json

    write_csv(out / "split.csv", split.to_frame())
    write_json(out / "settings.json", {
        "command": args.command, "model": args.model, "method": str(args.method), "examples": examples.settings,
        "split": split.to_dict(), "model_info": reference.info.to_dict(), "seconds": seconds,
        "batch_size": args.batch_size, "experiments": args.experiments, **(extra or {}),
    })


# ---------------------------------------------------------------------------------------


def _lens_args(p: argparse.ArgumentParser) -> None:
    _common(p, "reports/lens")
    p.add_argument("--experiments", default=",".join(LENS_EXPERIMENTS),
                   type=name_list("experiment", lambda: LENS_EXPERIMENTS),
                   help=f"comma-separated, from: {', '.join(LENS_EXPERIMENTS)}")
    p.add_argument("--at", default="resid_post", choices=_exit_points(), help="residual to decode")
    p.add_argument("--ks", default=None, type=int_list(low=0),
                   help="restoration: comma-separated numbers (>= 0) of top blocks (default 0..L)")
    p.add_argument("--lens", default="logit", choices=LENSES,
                   help="early exit through the model's own head (logit) or an affine translator per layer fitted "
                        "on --calibration-n calibration-split examples (tuned; fitted once, then cached)")
    add_checks(p, _check_lens)


def _check_lens(args: argparse.Namespace) -> None:
    """The tuned lens reads the block outputs in one process: refused before any model loads otherwise."""
    from interp.errors import InterpError
    from interp.runtime.distributed import world

    if args.lens == "tuned" and args.at != "resid_post":
        raise InterpError(f"--lens tuned decodes the block outputs (resid_post); drop --at {args.at} or use "
                          "--lens logit.")
    if args.lens == "tuned" and world()[2] > 1:
        raise InterpError("--lens tuned runs in one process; run it without torchrun (or use --lens logit).")


def uninformative_layers(curves: Any, vocab: int, dataset: str = "D_large") -> list[int]:
    """The layers where the reference's lens does no better than a uniform guess on ``dataset``:
    mean NLL at or above ``ln vocab``. A gap between two models' curves there says nothing."""
    ref = curves.results[f"{curves.models[0]} / {dataset}"]
    means = ref.layer_mean().double().tolist()
    return [int(layer) for layer, value in zip(ref.layers, means, strict=True) if value >= math.log(vocab)]


def lens_verdict(curves: Any, vocab: int, lens: str, dataset: str = "D_large") -> str:
    """One paragraph on whether the lens can be read: every layer informative, or which are not and what to do."""
    ref = curves.results[f"{curves.models[0]} / {dataset}"]
    bad = uninformative_layers(curves, vocab, dataset)
    uniform = math.log(vocab)
    if not bad:
        return f"The {lens} lens beats a uniform guess (ln |V| = {uniform:.1f} nats) at every layer on {dataset}."
    worst = float(ref.layer_mean().max())
    text = (f"The {lens} lens is uninformative at {len(bad)} of {len(ref.layers)} layers ({_spans(bad)}): there the "
            f"reference's NLL on {dataset} (up to {worst:.1f} nats) is worse than a uniform guess (ln |V| = "
            f"{uniform:.1f}), so a gap between the curves there says nothing.")
    if lens == "logit":
        text += (" Try --lens tuned: an affine translator per layer, fitted on the calibration split and cached, "
                 "reads the early layers too.")
    return text


def _spans(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"layers 0-2, 5"``."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return "layers " + ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _informative_split(curves: Any, bad: list[int], dataset: str = "D_large") -> int | None:
    """The split layer (:meth:`EarlyExitCurves.split_layer`) when it lies where the lens is informative."""
    layer = curves.split_layer(dataset)
    return None if layer in bad else layer


@command("lens", "early exit (logit or tuned lens) per layer and top-k layer restoration, reference vs quantized",
         _lens_args)
def cmd_lens(args: argparse.Namespace) -> int:
    from interp.cli import shard
    from interp.figures import draw
    from interp.io import ensure_writable_dir
    from interp.runtime.distributed import process_group
    from interp.runtime.swap import WeightStash

    experiments = _experiments(args.experiments)
    out = ensure_writable_dir(args.out)
    start = time.time()
    # one copy of the weights: the quantized block weights (the cache folder) are swapped into the
    # reference for the quantized model's early exit and for each restored set, the reference's own
    # kept in one stash under --out meanwhile (written once, deleted at the end)
    with process_group(_group_device(args)):  # torchrun: whole batches per rank, merged on rank 0
        reference, setup, spec, examples = _error_setup(args)
        split = setup.split
        curves = restored = None
        with WeightStash(reference, out) as stash:
            weights = setup.weights(spec, stash)
            if "early-exit" in experiments:
                sets = {"D_large": split.large, "D_ctrl": split.ctrl}
                curves = (_tuned_early_exit(args, reference, weights, sets, stash) if args.lens == "tuned"
                          else _early_exit_one_copy(args, reference, weights, sets, stash))
            if "restoration" in experiments:
                restored = shard.sharded_restoration(args, weights, reference, split.large,
                                                     parse_ints(args.ks) if args.ks else None, stash=stash)
    if not shard.is_main():  # a rank other than 0: its batches are in --out/parts
        return 0
    lens_note: dict[str, Any] = {}
    if curves is not None:
        table = curves.table().reset_index()
        _write(out, "early_exit", table, draw(curves))
        vocab = int(reference.cfg.d_vocab)
        bad = uninformative_layers(curves, vocab)
        split_layer = _informative_split(curves, bad)
        where = (f"split layer on D_large: {split_layer}" if split_layer is not None
                 else "no split layer where the lens is informative")
        _show(f"Early exit, {args.lens} lens ({args.at}); {where}", table)
        print("\n" + lens_verdict(curves, vocab, args.lens))
        lens_note = {"lens": args.lens, "uninformative_layers": bad, "split_layer": split_layer,
                     "log_vocab": math.log(vocab)}
    if restored is not None:
        _write(out, "restoration", restored.table(), draw(restored))
        _show("Layer restoration on D_large", restored.table())
    _save_settings(out, args, reference, examples, split, time.time() - start, lens_note)
    print(f"\nD_large {len(split.large)} / D_ctrl {len(split.ctrl)} of {len(examples)} examples, "
          f"{time.time() - start:.0f} s. Saved to {out}/")
    return 0


def _early_exit_one_copy(args: argparse.Namespace, reference: Any, weights: Any, sets: dict[str, Any],
                         stash: Any) -> Any:
    """Early exit of the reference, then of the quantized model as the reference carrying ``weights``
    (all blocks swapped in, :func:`interp.runtime.swap.swapped`), over the batches; ``None`` off rank 0.
    The curves are those of :func:`~interp.localize.lens.early_exit_curves` on the two models."""
    from interp.cli import shard
    from interp.localize.lens import EarlyExitCurves
    from interp.runtime.swap import swapped

    ref = shard.sharded_early_exit(args, {"reference": reference}, sets)
    with swapped(reference, weights, stash=stash):
        quant = shard.sharded_early_exit(args, {"quantized": reference}, sets)
    if ref is None or quant is None:
        return None
    return EarlyExitCurves(results={**ref.results, **quant.results}, models=["reference", "quantized"],
                           sets=list(sets))


def _tuned_early_exit(args: argparse.Namespace, reference: Any, weights: Any, sets: dict[str, Any],
                      stash: Any) -> Any:
    """Early exit through a tuned lens (:mod:`interp.localize.tuned_lens`), fitted on ``--calibration-n``
    calibration-split examples and cached under ``$INTERP_CACHE/tuned_lens``; the quantized model is read
    with the reference's translators (the reference carrying ``weights``). One process."""
    import interp
    from interp.localize.lens import EarlyExitCurves
    from interp.localize.tuned_lens import tuned_early_exit, tuned_lens_cached
    from interp.runtime.swap import swapped

    progress = False if args.quiet else None
    calibration = interp.load_examples(args.data, reference.tokenizer, n=args.calibration_n, seq_len=args.seq_len,
                                       seed=args.seed, split="calibration")
    lens = tuned_lens_cached(reference, calibration, interp.models.cache_dir() / "tuned_lens",
                             batch_size=args.batch_size, progress=progress)
    bs = args.batch_size
    results = {f"reference / {s}": tuned_early_exit(reference, lens, ex, bs, progress) for s, ex in sets.items()}
    with swapped(reference, weights, stash=stash):
        results.update({f"quantized / {s}": tuned_early_exit(reference, lens, ex, bs, progress)
                        for s, ex in sets.items()})
    return EarlyExitCurves(results=results, models=["reference", "quantized"], sets=list(sets))


# ---------------------------------------------------------------------------------------


def _patch_args(p: argparse.ArgumentParser) -> None:
    _common(p, "reports/patch")
    p.add_argument("--experiments", default="table,gate-input",
                   type=name_list("experiment", lambda: PATCH_EXPERIMENTS),
                   help=f"comma-separated, from: {', '.join(PATCH_EXPERIMENTS)}")
    p.add_argument("--layers", default="upper_half", type=int_list(keywords=LAYER_SETS),
                   help="table, gate-input and sweep layers: upper_half, lower_half, all, or e.g. 15,16,17")
    p.add_argument("--components", default="attn_out,gate,up,down,gate_input",
                   type=name_list("component", _patchable),
                   help=f"table and sweep components, comma-separated, from: {', '.join(_patchable())}")
    p.add_argument("--max-rows", type=int_at_least(1), default=64,
                   help="most rows (examples x stacked patches) per forward")


def _patchable() -> tuple[str, ...]:
    from interp.localize.patching import PATCHABLE

    return PATCHABLE


def _exit_points() -> tuple[str, ...]:
    from typing import get_args

    from interp.localize.lens import ExitPoint

    return tuple(get_args(ExitPoint))


def _layers(text: str) -> Any:
    return text if text in LAYER_SETS else parse_ints(text)


@command("patch", "cross-model activation patching: reference components into the quantized model", _patch_args)
def cmd_patch(args: argparse.Namespace) -> int:
    from interp.figures import draw
    from interp.io import ensure_writable_dir
    from interp.localize import patching
    from interp.runtime.distributed import process_group
    from interp.runtime.swap import WeightStash

    experiments = _experiments(args.experiments)
    out = ensure_writable_dir(args.out)
    start = time.time()
    # one copy of the weights: the quantized block weights are swapped into the reference per batch,
    # the reference's own kept in a stash under --out meanwhile (written once, deleted at the end);
    # attribution alone still loads the quantized copy (it differentiates through both models)
    with process_group(_group_device(args)):  # torchrun: whole batches per rank, merged on rank 0
        reference, setup, spec, examples = _error_setup(args)
        split = setup.split
        with WeightStash(reference, out) as stash:
            weights = setup.weights(spec, stash)
            results = _patch_experiments(args, experiments, reference, weights, split.large, stash,
                                         lambda: setup.quantized(spec))
    if results is None:  # a rank other than 0: its batches are in --out/parts
        return 0
    d_large = split.large
    if "table" in results:
        _write(out, "patching_table", results["table"].table(), draw(results["table"]))
        _show("Patching table (recovery = fraction of the perplexity gap closed)", results["table"].table())
    if "gate-input" in results:
        comparison = results["gate-input"]
        _write(out, "gate_input_vs_weights", comparison.table(), draw(comparison))
        _show("Gate input vs gate weights", comparison.table())
    sweep = results.get("sweep")
    if sweep is not None:
        _write(out, "layer_sweep", sweep.table(), draw(sweep))
        _show("Per-layer sweep", sweep.table())
    if "attribution" in results:
        estimate = results["attribution"]
        _write(out, "attribution", estimate.table(), draw(estimate))
        if sweep is not None:
            rho = patching.rank_agreement(estimate, sweep)
            print(f"\nAttribution vs exact sweep, Spearman rank correlation: {rho:.3f}")
    _save_settings(out, args, reference, examples, split, time.time() - start)
    print(f"\nD_large {len(d_large)} of {len(examples)} examples, {time.time() - start:.0f} s. Saved to {out}/")
    return 0


def _world_size() -> int:
    from interp.runtime.distributed import world

    return world()[2]


def _group_device(args: argparse.Namespace) -> str:
    """The device this rank's model goes on (as :func:`interp.cli.common.load_model_from_args` picks it)."""
    from interp.runtime.distributed import local_device

    return local_device(args.device) if args.device == "cuda" else args.device


def _patch_experiments(args: argparse.Namespace, experiments: list[str], reference: Any, weights: Any,
                       d_large: Any, stash: Any, load_quantized: Any) -> dict[str, Any] | None:
    """Each chosen experiment over the batches of D_large (:mod:`interp.cli.shard`); ``None`` off rank 0.

    Every experiment is the library function run on one batch at a time (the same batches as one
    process runs), so each example's values are those :func:`~interp.localize.patching.patching_table`
    and the others give on the whole set; rank 0 rebuilds the results from them. ``weights`` are the
    quantized block weights (swapped into ``reference`` per batch, its own kept in ``stash``, written
    once for all batches); ``load_quantized()`` loads the quantized copy, for attribution alone.
    """
    from types import SimpleNamespace

    from interp.cli import shard
    from interp.localize import patching
    from interp.localize.patching.patches import joint_patches, resolve_layers

    components = [c.strip() for c in args.components.split(",") if c.strip()]
    # a bar per patched run inside each batch (one process, in a terminal): a D_large of a few examples is one
    # batch, so the batches' bar alone would sit at 0/1 for the whole experiment
    progress = False if args.quiet or not shard.is_main() or _world_size() > 1 else None
    engine = {"batch_size": args.batch_size, "max_rows": args.max_rows, "progress": progress, "stash": stash}
    layers = _layers(args.layers)
    # the parts folders are fingerprinted by the quantized copy's identity, as when it was loaded
    quantized_id = SimpleNamespace(info=weights.model_info) if weights.model_info is not None else load_quantized()
    results: dict[str, Any] = {}
    if "table" in experiments:
        results["table"] = shard.sharded_patch(
            args, "table", lambda sub: patching.patching_table(reference, weights, sub, layers, components, **engine),
            quantized_id, d_large)
    if "gate-input" in experiments:  # gate_input_vs_gate_weights, batch by batch
        chosen = resolve_layers(reference, layers)

        def gate_input(sub: Any) -> Any:
            patched = patching.patch(weights, reference, sub, joint_patches(["gate_input"], chosen), **engine)
            restored = patching.gate_restored_nll(reference, weights, sub, chosen, args.batch_size, stash)
            return patching.GateInputComparison(patched=patched, layers=chosen, restored_nll=restored)

        results["gate-input"] = shard.sharded_gate_input(args, gate_input, quantized_id, d_large)
    if "sweep" in experiments:
        results["sweep"] = shard.sharded_patch(
            args, "sweep", lambda sub: patching.layer_sweep(reference, weights, sub, components, layers, **engine),
            quantized_id, d_large)
    if "attribution" in experiments:  # gradients through both models at once: this one loads the quantized copy
        quantized = load_quantized()
        half = max(1, args.batch_size // 2)
        results["attribution"] = shard.sharded_attribution(
            args, lambda sub: patching.attribution(quantized, reference, sub, components, batch_size=half,
                                                   progress=progress), quantized, d_large, half)
    return results if shard.is_main() else None
