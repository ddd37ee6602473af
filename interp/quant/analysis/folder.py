"""All four analyses on a folder written by ``interp score`` (used by ``interp errors``).

:func:`run_all` computes them and writes their tables (CSV/JSON, and parquet for the long
per-example table); it returns the results, which the caller may draw
(:func:`interp.figures.quant.folder_figures`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from interp import models
from interp.data import load_examples
from interp.errors import InterpError
from interp.io import write_csv, write_json, write_parquet
from interp.probes import probe
from interp.quant.analysis.agreement import agreement
from interp.quant.analysis.error_split import error_split
from interp.quant.analysis.norms import norm_error_correlation
from interp.quant.analysis.reversal import reversal
from interp.quant.calibration import calibration_from_settings
from interp.quant.spec import parse_spec


@dataclass(frozen=True)
class FolderAnalyses:
    """What :func:`run_all` computed and wrote.

    Attributes:
        results: ``"agreement"`` always; ``"split"``, ``"norm_correlation"`` and ``"reversal"``
            when the model was run (the last one only when some spec entered the reversal).
        written: every file written.
    """

    results: dict[str, Any] = field(default_factory=dict)
    written: list[Path] = field(default_factory=list)


def run_all(
    errors: pd.DataFrame,
    settings: Mapping[str, Any],
    folder: str | os.PathLike[str],
    n_boot: int = 1000,
    seed: int = 0,
    target: str = "mean",
    batch_size: int = 8,
    run_models: bool = True,
    reversal_specs: Sequence[str] | None = None,
    progress: bool | None = None,
    score_folder: str | os.PathLike[str] | None = None,
    dtype: str | None = None,
) -> FolderAnalyses:
    """Run the four analyses on a ``score`` folder's errors and write their tables into ``folder``.

    Args:
        errors: the folder's per-example errors (index example id, one column per spec).
        settings: the folder's ``settings.json`` (model, examples, calibration, specs).
        folder: where the tables go.
        target: ``"mean"`` (mean error over specs) or a spec: the error that picks
            D_large/D_ctrl and is correlated with the norms.
        run_models: also run the analyses that need the model (split, norms, reversal).
        reversal_specs: specs whose quantized models enter
            :func:`~interp.quant.analysis.reversal.reversal` (default all).
        score_folder: the ``score`` folder whose ``quantized/`` cache holds the models
            (default: the parent of ``folder``).
        dtype: the model's dtype for those analyses (None: float32); use the one the scores
            were made in (``settings["dtype"]``), since the cached quantized copies are in it.
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    done = FolderAnalyses()

    def save(name: str, result: Any) -> None:
        write_csv(out / f"{name}.csv", result.to_frame(), index=name == "split")
        write_json(out / f"{name}.json", result.to_dict())
        done.results[name] = result
        done.written.extend([out / f"{name}.csv", out / f"{name}.json"])

    if target != "mean":
        target = _scored(target, errors)
    specs = list(errors.columns) if reversal_specs is None else [_scored(s, errors) for s in reversal_specs]
    save("agreement", agreement(errors, n_boot=n_boot, seed=seed))
    if not run_models:
        return done
    model = models.load_model(settings["model"], dtype=dtype)
    ex = settings["examples"]
    examples = load_examples(ex["source"], model.tokenizer, n=ex["n"], seq_len=ex["seq_len"], seed=ex["seed"],
                             split=ex["split"])
    source = Path(score_folder) if score_folder else out.parent
    setup = error_split(model, list(errors.columns), examples, errors=errors, split_on=target,
                        calibration=calibration_from_settings(settings, model.tokenizer, specs),
                        cache_dir=source / "quantized", seed=seed, batch_size=batch_size, progress=progress)
    save("split", setup.split)
    measured = probe(model, examples, ["resid_mid", "resid_post"], ["norm"], batch_size=batch_size,
                     exclude_bos=True, progress=progress)
    target_errors = errors.mean(axis=1).rename("mean") if target == "mean" else errors[target]
    save("norm_correlation", norm_error_correlation(model, examples, target_errors, n_boot=n_boot, seed=seed,
                                                    probe_result=measured))
    # the same norms against each spec's own error (the paper correlates per quantized model)
    per_spec = [norm_error_correlation(model, examples, errors[spec], n_boot=n_boot, seed=seed,
                                       probe_result=measured).table.assign(spec=spec) for spec in errors.columns]
    write_csv(out / "norm_correlation_by_spec.csv", pd.concat(per_spec, ignore_index=True), index=False)
    done.written.append(out / "norm_correlation_by_spec.csv")
    if specs:
        rev = reversal(model, {s: setup.quantized(s) for s in specs}, setup.split.large, setup.split.ctrl,
                       batch_size=batch_size, n_boot=n_boot, seed=seed, progress=progress)
        save("reversal", rev)
        write_csv(out / "reversal_outliers.csv", rev.outliers, index=False)
        write_parquet(out / "reversal_per_example.parquet", rev.per_example, index=False)
        done.written.extend([out / "reversal_outliers.csv", out / "reversal_per_example.parquet"])
    return done


def _scored(spec: str, errors: pd.DataFrame) -> str:
    name = str(parse_spec(spec))
    if name not in errors.columns:
        raise InterpError(f"Spec {name} is not in this store; scored specs: {', '.join(errors.columns)}.")
    return name
