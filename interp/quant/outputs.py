"""What ``interp score`` leaves in its folder besides the store, and its one-paragraph summary.

A score folder holds ``scores.sqlite`` (:class:`~interp.quant.store.ScoreStore`), the
quantized models' cache ``quantized/``, and the files written here: ``errors.csv``,
``nll.csv`` (and ``kl.csv``), and ``settings.json``, which records the model, the example
and calibration settings and the specs, so that ``interp errors``
(:func:`interp.quant.analysis.run_all`) can rebuild the same examples and models.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from interp.data import Examples
from interp.io import write_csv, write_json
from interp.models import Model
from interp.quant.apply import read_quant_info
from interp.quant.spec import MethodSpec
from interp.quant.store import ScoreStore


def quantizer_timings(cache: Path) -> dict[str, Any]:
    """Per-spec quantizer timing from the JSON records of the quantized models cached in ``cache``.

    Example:
        >>> import pathlib, tempfile
        >>> quantizer_timings(pathlib.Path(tempfile.mkdtemp()) / "absent")
        {}
    """
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


def write_score_outputs(out: Path, model_source: str, model: Model, examples: Examples, calibration: Examples | None,
                        specs: Sequence[MethodSpec], errors: pd.DataFrame, batch_size: int, kl: bool,
                        **extra: Any) -> dict[str, Any]:
    """Write ``errors.csv``, ``nll.csv`` (``kl.csv`` with ``kl``) and ``settings.json`` into ``out``.

    Args:
        model_source: what the model was loaded from (a bundled name or a path), for reloading it.
        extra: more entries for settings.json (e.g. ``world_size`` for the torchrun version).

    Returns:
        The settings written.
    """
    write_csv(out / "errors.csv", errors)
    with ScoreStore(out) as st:
        write_csv(out / "nll.csv", st.nll_frame(ids=examples.ids))
        if kl:
            write_csv(out / "kl.csv", st.kl_frame(ids=examples.ids))
    settings = {
        "model": model_source, "model_info": model.info.to_dict(), "examples": examples.settings,
        "calibration": None if calibration is None else {**calibration.settings, "ids": calibration.ids},
        "specs": [str(s) for s in specs], "batch_size": batch_size, "kl": kl,
        **extra, "quantizer_timing": quantizer_timings(out / "quantized"),
    }
    write_json(out / "settings.json", settings)
    return settings


def score_summary(out: Path, errors: pd.DataFrame, examples: Examples, n_specs: int, seconds: float,
                  world_size: int | None = None) -> str:
    """The text ``interp score`` prints at the end: the errors' description and what was saved where."""
    ranks = f", {world_size} ranks" if world_size else ""
    return (errors.describe().T.to_string(float_format="{:.4f}".format)
            + f"\n\n{len(examples)} examples x {examples.seq_len} tokens, {n_specs} specs{ranks}, {seconds:.0f} s. "
            f"Saved to {out}/ (scores.sqlite, errors.csv, nll.csv, settings.json)")
