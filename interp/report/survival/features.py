"""The survival study's features: SmolLM2's SAEs, their quality, and each latent's survival in a quantized model.

Stage ``features`` of the run (SmolLM2 only, as registered):

1. the packed 512-token rows (seed from the registration): eval rows 0-191 held out, 192-255 validation, the other
   eval rows and every calibration row for training;
2. the reference's residuals after blocks 5, 15 and 25 at every position but BOS and the separators, captured once
   (resumable, float16 for training; :func:`interp.localize.sae_data.capture_activations`), in the cache;
3. one TopK SAE per layer (:func:`interp.localize.sae_train.train_sae`, the registered rule), saved in SAELens's
   layout under ``features/sae-L<layer>/``, with its quality on the held-out rows (``features/quality-L<layer>``);
   when an SAE misses the bar on validation, the registered search over latents x k;
4. per quantized model, each latent's per-row correlation sums and firing counts against the reference
   (``features/<id>-L<layer>``, :class:`interp.localize.sae_metrics.LatentRowStats`).

The analysis (:func:`feature_analysis`) reads only those files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from interp.stats import Estimate, crossed_bootstrap

__all__ = ["feature_analysis", "feature_rows", "latent_survival", "prepare_saes"]

BAR_METRICS = {"FVU": ("fvu", "<="), "CE loss recovered": ("ce_recovered", ">="), "dead latents": ("dead_share", "<=")}


def feature_rows(tokenizer: Any, reg: dict[str, Any]) -> dict[str, Any]:
    """The registered rows: ``held_out``, ``validation`` and the two training parts, as Examples."""
    import re

    from interp.data import load_packed_examples

    text = reg["features"]["text"]["rows"]
    seq_len = int(re.search(r"seq_len=(\d+)", text).group(1))  # type: ignore[union-attr]
    seed = int(re.search(r"seed=(\d+)", text).group(1))  # type: ignore[union-attr]
    ev = load_packed_examples("wiki", tokenizer, n=None, seq_len=seq_len, seed=seed, split="eval")
    cal = load_packed_examples("wiki", tokenizer, n=None, seq_len=seq_len, seed=seed, split="calibration")
    n = len(ev)
    return {"held_out": ev.subset(list(range(0, 192))), "validation": ev.subset(list(range(192, 256))),
            "train_eval": ev.subset(list(range(256, n))), "train_calibration": cal}


def _hook(layer: int) -> str:
    return f"blocks.{layer}.hook_resid_post"


def prepare_saes(reference: Any, raw: Path, cache: Path, reg: dict[str, Any], progress: bool | None = None
                 ) -> dict[int, Any]:
    """Train (or load) the registered SAE of each layer and write its quality rows; returns ``{layer: SAE}``."""
    import torch

    from interp.localize.sae import load_sae
    from interp.localize.sae_data import capture_activations, load_activations
    from interp.localize.sae_metrics import sae_quality
    from interp.localize.sae_train import train_sae

    spec = reg["features"]["sae"]
    layers = [int(v) for v in spec["layers"].values()]
    rows = feature_rows(reference.tokenizer, reg)
    saes: dict[int, Any] = {}
    for layer in layers:
        folder = raw / "features" / f"sae-L{layer}"
        if (folder / "cfg.json").is_file() and (raw / "features" / f"quality-L{layer}.safetensors").is_file():
            saes[layer] = load_sae(folder)
            continue
        parts = {}
        for part in ("train_eval", "train_calibration", "validation"):
            where = cache / f"capture-{part}"
            capture_activations(reference, rows[part], layers, where, dtype="float32" if part == "validation"
                                else "float16", progress=progress)
            parts[part] = load_activations(where, layer).values
        train = torch.cat([parts["train_eval"], parts["train_calibration"]])
        sae, _ = train_sae(train, parts["validation"].float(), int(spec["latents"]), int(spec["k"]),
                           hook_name=_hook(layer), checkpoint=cache / f"train-L{layer}",
                           settings={"model": "smollm2-135m", "registration": reg["name"]}, progress=progress)
        del train, parts
        sae.save(folder)
        sae_quality(reference, sae, rows["held_out"], progress=progress).save(
            raw / "features" / f"quality-L{layer}.safetensors")
        saes[layer] = sae
    return saes


def latent_survival(reference: Any, other: Any, saes: dict[int, Any], held_out: Any, raw: Path, unit: str) -> None:
    """Each layer's :class:`~interp.localize.sae_metrics.LatentRowStats` of ``other`` against the reference."""
    from interp.localize.sae_metrics import latent_stats
    from interp.report.survival.registration import file_name

    for layer, sae in saes.items():
        path = raw / "features" / f"{file_name(unit)}-L{layer}.safetensors"
        if not path.is_file():
            latent_stats(sae, reference, other, held_out).save(path)


# ---------------------------------------------------------------------------------------
# Analysis


def _bar_reading(est: Estimate, bar: float, good: str) -> str:
    low_good = est.low <= bar if good == "<=" else est.low >= bar
    high_good = est.high <= bar if good == "<=" else est.high >= bar
    if low_good and high_good:
        return "met"
    if not low_good and not high_good:
        return "not met"
    return "on the bar"


def quality_table(raw: Path, reg: dict[str, Any]) -> list[dict[str, Any]]:
    """Per layer: each quality metric with its interval over held-out rows and its reading against the bar."""
    from interp.localize.sae_metrics import QualityRows

    iv = reg["intervals"]
    bar = reg["features"]["quality"]["bar"]
    out = []
    for layer in [int(v) for v in reg["features"]["sae"]["layers"].values()]:
        path = raw / "features" / f"quality-L{layer}.safetensors"
        if not path.is_file():
            continue
        q = QualityRows.load(path)
        row: dict[str, Any] = {"layer": layer}
        met = True
        for label, (name, good) in BAR_METRICS.items():
            est = crossed_bootstrap([None], q.statistic(name), q.n_rows, int(iv["n_boot"]), int(iv["seed"])).estimate
            threshold = float(str(bar[label]).split()[-1].rstrip("%")) / (100 if "%" in str(bar[label]) else 1)
            reading = _bar_reading(est, threshold, good)
            met &= reading == "met"
            row.update({name: est.value, f"{name}_low": est.low, f"{name}_high": est.high, f"{name}_bar": reading})
        row["l0"] = float(q.metric("l0")[0])
        row["ce_increase"] = float(q.metric("ce_increase")[0])
        row["meets the bar"] = met
        out.append(row)
    return out


def _rate(rho_min: float, judged: np.ndarray, require_rate: bool = True) -> Any:
    def statistic(stats: Any, rows: np.ndarray) -> np.ndarray:
        rho = stats.correlation(rows)[:, judged]
        f_ref, f_q = stats.firing_rates(rows)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = f_q[:, judged] / f_ref[:, judged]
        ok = np.nan_to_num(rho, nan=-1.0) >= rho_min
        if require_rate:
            ok &= (ratio >= 0.5) & (ratio <= 2.0)
        return ok.mean(axis=-1)
    return statistic


def feature_analysis(raw: Path, model: str, reg: dict[str, Any], thresholds: Sequence[float] = (0.9,)
                     ) -> dict[str, Any]:
    """The quality table and, per quantized model and layer, the share of judged latents that survive."""
    import pandas as pd

    from interp.localize.sae_metrics import LatentRowStats
    from interp.report.survival.registration import file_name
    from interp.report.survival.roster import roster

    raw = Path(raw)
    iv = reg["intervals"]
    quality = quality_table(raw, reg)
    rows = []
    for entry in roster(model):
        for q in quality:
            layer = q["layer"]
            found = [raw / "features" / f"{file_name(u)}-L{layer}.safetensors" for u in entry.ids()]
            stats = [LatentRowStats.load(p) for p in found if p.is_file()]
            if not stats:
                continue
            f_ref, _ = stats[0].firing_rates()
            fired_positions = f_ref[0] * stats[0].totals()["n"][0, 0]
            judged = fired_positions >= 20
            for rho_min in thresholds:
                est = crossed_bootstrap(stats, _rate(rho_min, judged), stats[0].n_rows, int(iv["n_boot"]),
                                        int(iv["seed"])).estimate
                rows.append({"method": entry.label, "layer": layer, "instances": len(stats),
                             "judged_latents": int(judged.sum()), "rho_min": rho_min, "rate": est.value,
                             "rate_low": est.low, "rate_high": est.high,
                             "sae_meets_bar": q["meets the bar"]})
    return {"quality": pd.DataFrame(quality), "survival": pd.DataFrame(rows)}
