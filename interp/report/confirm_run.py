"""The confirmatory run: every raw measurement of a pre-registered protocol, computed (or resumed) into a folder.

:func:`run` scores the reference and every quantized instance per token, picks D_large on instance 0 and
localizes on the others (patching, restoration, early exit, the reversal), writing each finished step as it goes
(:mod:`interp.report.confirm_raw`), so a killed run resumes at the granularity of one scored model or one
localization step. :func:`main` is ``python -m interp.report.confirm``: the run, then
:func:`~interp.report.confirm.analyse`. Both names are importable from :mod:`interp.report.confirm` too.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from interp.data import Examples, load_examples
from interp.errors import InterpError, exit_status
from interp.io import write_json
from interp.localize.patching import gate_input_vs_gate_weights, patching_table
from interp.localize.restoration import restoration_sweep
from interp.localize.tuned_lens import tuned_early_exit, tuned_lens_cached
from interp.models import cache_dir, load_model
from interp.probes import probe
from interp.quant.analysis import reversal, split_large_ctrl
from interp.quant.apply import quantize_cached
from interp.report.confirm import REPO, Preregistration, _errors, analyse, heldout_examples, write_results
from interp.report.confirm_raw import _arrays, _Folder, _label, _record_weights, _token_nll
from interp.runtime.batching import cpu_identity, kernels


def run(p: Preregistration, out: str | Path, progress: bool | None = None) -> Path:
    """Compute (or resume) every raw measurement of the confirmatory protocol into ``out``."""
    p.check_criteria()
    folder = _Folder(Path(out))
    model = load_model(p.model)
    examples = heldout_examples(model.tokenizer, p)
    start = {"commit": _commit(), "kernels": kernels("cpu"), "cpu": cpu_identity(), "threads": torch.get_num_threads(),
             "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "token_files_done": sorted(f.stem for f in (folder.out / "token_nll").glob("*.parquet")),
             "steps_done": sorted(f.stem for f in (folder.out / "localize").glob("*.json"))}
    earlier = _earlier_starts(folder.out / "examples.json", list(examples.ids), p)
    # kernels, threads and commit name the latest start; ``starts`` keeps every (re)start of a run resumed across
    # machines, with what was already done when it began
    write_json(folder.out / "examples.json", {"ids": list(examples.ids), "settings": examples.settings,
                                              "vocab": int(model.cfg.d_vocab), "kernels": start["kernels"],
                                              "threads": start["threads"], "commit": start["commit"],
                                              "preregistration": p.name,
                                              "preregistration_sha256": p.sha256, "starts": [*earlier, start]})
    bs = p.batch_size
    calibrations = [load_examples(p.data, model.tokenizer, n=p.calibration_n, seq_len=p.seq_len, seed=s,
                                  split="calibration") for s in p.calibration_seeds]
    todo: list[tuple[str, str, int | None]] = [("reference", "reference", None)]
    todo += [(_label(s, None), s, None) for s in p.free_specs]
    todo += [(_label(s, i), s, i) for i in range(len(p.calibration_seeds)) for s in p.calibrated_specs]
    for label, spec, instance in todo:
        if folder.token_path(label).exists():
            continue
        if spec == "reference":
            values = _token_nll(model, examples, bs)
        else:
            cal = calibrations[instance] if instance is not None else None
            quantized = quantize_cached(model, spec, cal, cache_dir=cache_dir() / "quantized", progress=progress,
                                        batch_size=bs)
            _record_weights(folder, "scored", label, quantized)
            values = _token_nll(quantized, examples, bs)
            del quantized
            gc.collect()
        folder.save_tokens(label, values, list(examples.ids))
    folder.step("norms", lambda: _norms(model, examples, bs, progress))
    errors = _errors(folder, p, examples)
    split = split_large_ctrl(errors[_label(p.patched_spec, 0)], examples, top=p.top, seed=p.seed)
    write_json(folder.out / "split.json", {"large": split.large_ids, "ctrl": split.ctrl_ids,
                                           "dropped": split.dropped_ids, "selected_on": _label(p.patched_spec, 0)})
    if len(split.large) < p.min_d_large:
        raise InterpError(f"D_large holds {len(split.large)} examples after deduplication; the pre-registration "
                          f"asks for at least {p.min_d_large}.")
    lens = tuned_lens_cached(model, calibrations[0], cache_dir() / "tuned_lens", batch_size=bs, progress=progress)
    for instance in range(1, len(p.calibration_seeds)):
        _localize(folder, p, model, split, calibrations[instance], instance, lens, progress,
                  everything=examples)
    return folder.out


def _earlier_starts(path: Path, ids: list[str], p: Preregistration) -> list[dict[str, Any]]:
    """The earlier starts recorded in a run folder; refuses a folder whose run drew other examples or another
    registration (resuming it would mix two runs)."""
    if not path.is_file():
        return []
    meta = json.loads(path.read_text())
    if meta.get("preregistration_sha256") != p.sha256 or meta.get("ids") != ids:
        raise InterpError(f"{path.parent} holds a run of another registration or of other held-out examples "
                          f"({meta.get('preregistration')}); give this run its own --out folder.")
    return list(meta.get("starts", [{k: meta.get(k) for k in ("commit", "kernels", "threads")}]))


def _commit() -> str:
    """The checkout's git commit (with ``+dirty`` when it has uncommitted changes), or why it is unknown."""
    import subprocess

    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return head + ("+dirty" if dirty else "")


def _norms(model: Any, examples: Examples, bs: int, progress: bool | None) -> dict[str, Any]:
    result = probe(model, examples, ["resid_mid"], ["norm"], batch_size=bs, exclude_bos=True, progress=progress)
    norms = result["resid_mid", "norm"].double().numpy()
    return {"layers": [int(x) for x in result.layers], "norms": norms.tolist()}


def _localize(folder: _Folder, p: Preregistration, model: Any, split: Any, calibration: Examples, instance: int,
              lens: Any, progress: bool | None, everything: Examples | None = None) -> None:
    bs = p.batch_size
    loaded: dict[str, Any] = {}

    def quantized() -> Any:
        if "model" not in loaded:
            loaded["model"] = quantize_cached(model, p.patched_spec, calibration, cache_dir=cache_dir() / "quantized",
                                              progress=progress, batch_size=bs)
            _record_weights(folder, "localized", _label(p.patched_spec, instance), loaded["model"])
        return loaded["model"]

    def patching() -> dict[str, Any]:
        result = patching_table(model, quantized(), split.large, batch_size=bs, progress=progress)
        gate = gate_input_vs_gate_weights(model, quantized(), split.large, batch_size=bs, progress=progress)
        return {"target": _arrays(result.target), "source": _arrays(result.source),
                "patched": {pt.component: _arrays(result.values[i]) for i, pt in enumerate(result.patches)},
                "gate_input": _arrays(gate.patched.values[0]), "gate_weights_restored": _arrays(gate.restored_nll)}

    def restoration() -> dict[str, Any]:
        n_layers = model.info.n_layers
        k = max(1, round(n_layers * 7 / 40))
        rng = np.random.default_rng(p.seed + instance)
        orders = {"top": list(range(n_layers - 1, -1, -1)), "bottom": list(range(n_layers))}
        orders.update({f"random{d}": [int(x) for x in rng.permutation(n_layers)]
                       for d in range(p.restoration_null_draws)})
        out: dict[str, Any] = {"k": k}
        for name, order in orders.items():
            result = restoration_sweep(quantized(), model, split.large, ks=[0, k], order=order, batch_size=bs,
                                       progress=progress)
            out[name] = {"layers": result.restored[1], "nll_k": _arrays(result.nll[1])}
            out["quantized"], out["reference"] = _arrays(result.nll[0]), _arrays(result.reference_nll)
        return out

    def early_exit() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, m in (("reference", model), ("quantized", quantized())):
            for set_name, ex in (("large", split.large), ("ctrl", split.ctrl)):
                r = tuned_early_exit(m, lens, ex, batch_size=bs)
                out[f"{name}/{set_name}"] = r.nll.double().numpy().tolist()
                out["layers"] = [int(x) for x in r.layers]
        return out

    def reversal_step() -> dict[str, Any]:
        rev = reversal(model, {p.patched_spec: quantized()}, split.large, split.ctrl, batch_size=bs, n_boot=p.n_boot,
                       seed=p.seed, progress=progress)
        return {"mse": rev.mse.to_dict(orient="list"), "per_example": rev.per_example.to_dict(orient="list"),
                "outliers": rev.outliers.to_dict(orient="list")}

    def reversal_all() -> dict[str, Any]:  # corr(||h||, MSE) over every example, not only the selected sets
        assert everything is not None
        half = len(everything) // 2
        rev = reversal(model, {p.patched_spec: quantized()}, everything.subset(range(half)),
                       everything.subset(range(half, len(everything))), batch_size=bs, n_boot=p.n_boot, seed=p.seed,
                       progress=progress)
        return {"mse": rev.mse.to_dict(orient="list")}

    folder.step(f"patching#{instance}", patching)
    folder.step(f"restoration#{instance}", restoration)
    folder.step(f"early_exit#{instance}", early_exit)
    folder.step(f"reversal#{instance}", reversal_step)
    if everything is not None:
        folder.step(f"reversal_all#{instance}", reversal_all)
    loaded.clear()
    gc.collect()


def main(argv: list[str] | None = None) -> int:
    """``python -m interp.report.confirm PREREG.json --out RUN_DIR [--write DOCS_DATA_DIR]``."""
    parser = argparse.ArgumentParser(description="Run (or resume) a pre-registered confirmatory reproduction.")
    parser.add_argument("prereg", help="the pre-registration JSON file (docs/preregistration/)")
    parser.add_argument("--out", required=True, help="folder for the raw per-example data (resumable)")
    parser.add_argument("--write", help="also write the analysis tables here (e.g. docs/data/reproduction/...)")
    parser.add_argument("--analyse-only", action="store_true", help="skip the run; analyse the raw data in --out")
    args = parser.parse_args(argv)
    def body() -> None:
        p = Preregistration.load(args.prereg)
        if not args.analyse_only:
            run(p, args.out, progress=True)
        elif not (Path(args.out) / "examples.json").is_file():
            raise InterpError(f"{args.out} holds no run of {p.name} (no examples.json): run it first, without "
                              "--analyse-only.")
        try:
            result = analyse(p, args.out)
        except FileNotFoundError as exc:
            raise InterpError(f"the run in {args.out} is incomplete ({exc.filename} is missing): run it again "
                              "without --analyse-only to resume.") from None
        if args.write:
            write_results(result, args.write, raw_from=args.out)
        print(result["reproduction"][["claim", "measured here", "verdict"]].to_string())

    return exit_status(body)
