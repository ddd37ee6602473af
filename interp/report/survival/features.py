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
   (:class:`interp.localize.sae_metrics.LatentRowStats`, in the cache: up to 44 MB each), reduced to the form
   registration ``survival-2.json`` commits (``features/<id>-L<layer>``,
   :class:`~interp.report.survival.feature_counts.SurvivalCounts`: per-latent totals, and the surviving counts
   in every registered row resample).

The analysis (:func:`feature_analysis`) reads only the committed files.
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
        sae = _search(reference, train, parts["validation"].float(), rows["validation"], layer, cache, raw, reg,
                      progress)
        del train, parts
        sae.save(folder)
        sae_quality(reference, sae, rows["held_out"], progress=progress).save(
            raw / "features" / f"quality-L{layer}.safetensors")
        saes[layer] = sae
    return saes


#: survival-1 features.sae.search: the candidates (latents, k) tried when the registered SAE misses the bar
SEARCH = ((4096, 32), (4096, 64), (8192, 32), (8192, 64))


def _search(reference: Any, train: Any, validation: Any, validation_rows: Any, layer: int, cache: Path, raw: Path,
            reg: dict[str, Any], progress: bool | None = None) -> Any:
    """The registered SAE of one layer (latents and k from the registration); only if it misses the bar on the
    validation rows, every candidate of :data:`SEARCH`, keeping the least validation FVU among those meeting the
    bar (or the least of all, if none does). Every candidate trained is reported in
    ``features/candidates-L<layer>.json``; the held-out rows are not read here."""
    from interp.io import write_json
    from interp.localize.sae_metrics import sae_quality
    from interp.localize.sae_train import train_sae

    spec = reg["features"]["sae"]
    registered = (int(spec["latents"]), int(spec["k"]))
    report: list[dict[str, Any]] = []
    trained: dict[tuple[int, int], Any] = {}
    for latents, k in [registered] + [c for c in SEARCH if c != registered]:
        sae, log = train_sae(train, validation, latents, k, hook_name=_hook(layer),
                             checkpoint=cache / f"train-L{layer}" if (latents, k) == registered
                             else cache / f"train-L{layer}-{latents}x{k}",
                             settings={"model": "smollm2-135m", "registration": reg["name"]}, progress=progress)
        readings, met = bar_readings(sae_quality(reference, sae, validation_rows, progress=progress), reg)
        trained[(latents, k)] = sae
        report.append({"latents": latents, "k": k, "validation": readings, "meets the bar on validation": met,
                       "training": log.to_dict()})
        if (latents, k) == registered and met:
            break  # the registered SAE meets the bar: no search
    meeting = [r for r in report if r["meets the bar on validation"]]
    chosen = min(meeting or report, key=lambda r: r["validation"]["fvu"])
    for r in report:
        r["chosen"] = r is chosen
    write_json(raw / "features" / f"candidates-L{layer}.json",
               {"layer": layer, "searched": len(report) > 1, "candidates": report,
                "rule": "survival-1 features.sae.search"})
    return trained[(chosen["latents"], chosen["k"])]


def latent_survival(reference: Any, other: Any, saes: dict[int, Any], held_out: Any, raw: Path, unit: str,
                    captured: dict[str, Any] | None = None, working: Path | None = None,
                    reg: dict[str, Any] | None = None, again: bool = False) -> None:
    """Each layer's feature survival of ``other`` against the reference, in the committed form of survival-2
    (:class:`~interp.report.survival.feature_counts.SurvivalCounts`, ``raw/features/<id>-L<layer>``), reduced from
    the per-row sums (:class:`~interp.localize.sae_metrics.LatentRowStats`), which stay in ``working`` (default: the
    cache). One forward of ``other`` for all layers; the reference's activations are captured once per run and
    kept in ``captured`` (the run's context), since they are the same for every quantized model. With ``again``,
    nothing already written is read: the rows and the counts are measured again and replace their files."""
    from interp.localize.sae_metrics import LatentRowStats, held_out_activations, latent_stats_layers
    from interp.models import cache_dir
    from interp.report.survival.feature_counts import SurvivalCounts
    from interp.report.survival.registration import file_name, registration

    reg = reg or registration()
    iv = reg["intervals"]
    seeds = [int(iv["seed"]), *(int(s) for s in iv["boundary"]["mc_seeds"])]
    working = working or cache_dir() / "survival-sae" / "latent-rows"
    out = {layer: raw / "features" / f"{file_name(unit)}-L{layer}.safetensors" for layer in saes}
    if not again and all(path.is_file() for path in out.values()):
        return
    # the per-row sums are reused only for the same weights: keyed by the weights' digest, not by the instance's
    # name alone, since an instance made again (GPTQ on another CPU) has other weights under the same name
    from interp.models import weights_digest

    key = weights_digest(other)[:16]
    rows = {layer: working / f"{file_name(unit)}-{key}-L{layer}.safetensors" for layer in saes}
    if again or not all(path.is_file() for path in rows.values()):
        ordered = [saes[layer] for layer in sorted(saes)]
        if captured is None:
            captured = {}
        if "reference_activations" not in captured:
            captured["reference_activations"] = held_out_activations(reference, ordered, held_out)
        stats = latent_stats_layers(ordered, captured["reference_activations"], other, held_out)
        for layer, stat in zip(sorted(saes), stats, strict=True):
            stat.save(rows[layer])
    for layer, path in out.items():
        if path.is_file() and not again:
            continue
        broken = None
        if "#" in unit:  # a restored variant of the tie: its instance's broken latents (survival-3)
            base = raw / "features" / f"{file_name(unit.split('#')[0])}-L{layer}.safetensors"
            broken = SurvivalCounts.load(base).broken_latents()
        SurvivalCounts.reduce(LatentRowStats.load(rows[layer]), seeds, int(iv["n_boot"]), broken).save(path)


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


def bar_readings(q: Any, reg: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Each bar metric of quality rows ``q`` with its interval over rows and its reading against the registered bar
    ('met' when the interval lies wholly on the good side); and whether all three are met."""
    iv = reg["intervals"]
    bar = reg["features"]["quality"]["bar"]
    row: dict[str, Any] = {}
    met = True
    for label, (name, good) in BAR_METRICS.items():
        est = crossed_bootstrap([None], q.statistic(name), q.n_rows, int(iv["n_boot"]), int(iv["seed"])).estimate
        threshold = float(str(bar[label]).split()[-1].rstrip("%")) / (100 if "%" in str(bar[label]) else 1)
        reading = _bar_reading(est, threshold, good)
        met &= reading == "met"
        row.update({name: est.value, f"{name}_low": est.low, f"{name}_high": est.high, f"{name}_bar": reading})
    return row, met


def quality_table(raw: Path, reg: dict[str, Any]) -> list[dict[str, Any]]:
    """Per layer: each quality metric with its interval over held-out rows and its reading against the bar."""
    from interp.localize.sae_metrics import QualityRows

    out = []
    for layer in [int(v) for v in reg["features"]["sae"]["layers"].values()]:
        path = raw / "features" / f"quality-L{layer}.safetensors"
        if not path.is_file():
            continue
        q = QualityRows.load(path)
        readings, met = bar_readings(q, reg)
        row: dict[str, Any] = {"layer": layer, **readings}
        row["l0"] = float(q.metric("l0")[0])
        row["ce_increase"] = float(q.metric("ce_increase")[0])
        row["meets the bar"] = met
        out.append(row)
    return out


def _share(definition: int) -> Any:
    """Crossed-bootstrap statistic: surviving judged latents over judged latents, summed over the layers of one
    instance (``data``: its :class:`SurvivalCounts` per layer; the layers share the held-out rows)."""
    def statistic(layers: Any, rows: np.ndarray) -> np.ndarray:
        judged = sum(int(layer.judged.sum()) for layer in layers)
        return sum(layer.counts_for(rows)[:, definition] for layer in layers) / judged
    return statistic


def _anchor_verdict(est: Estimate, anchor: float) -> str:
    from interp.report.survival.analyse import band_verdict

    return band_verdict(est, "above the anchor", "below the anchor", "not distinguishable from the anchor", anchor)


def feature_analysis(raw: Path, model: str, reg: dict[str, Any], seeds: Sequence[int] | None = None
                     ) -> dict[str, Any]:
    """The quality table; per quantized model, layer and definition the share of judged latents that survive; the
    pooled share over the layers whose SAE meets the bar, beside both anchors with its verdict and deciding bound."""
    import pandas as pd

    from interp.report.survival.analyse import decide
    from interp.report.survival.feature_counts import DEFINITIONS, SurvivalCounts
    from interp.report.survival.registration import file_name
    from interp.report.survival.roster import roster

    raw = Path(raw)
    iv = reg["intervals"]
    n_boot, seed = int(iv["n_boot"]), int(iv["seed"])
    mc = list(seeds if seeds is not None else iv["boundary"]["mc_seeds"])
    anchors = {name: float(v) for name, v in reg["features"]["anchors"]["values"].items()}
    quality = quality_table(raw, reg)
    meets = {q["layer"]: bool(q["meets the bar"]) for q in quality}
    per_layer, pooled = [], []
    for entry in roster(model):
        found: dict[int, list[Any]] = {}
        for layer in meets:
            paths = [raw / "features" / f"{file_name(u)}-L{layer}.safetensors" for u in entry.ids()]
            if any(p.is_file() for p in paths):
                found[layer] = [SurvivalCounts.load(p) for p in paths if p.is_file()]
        for layer, data in found.items():
            for k, (name, _, _) in enumerate(DEFINITIONS):
                est = crossed_bootstrap([(d,) for d in data], _share(k), data[0].n_rows, n_boot, seed).estimate
                per_layer.append({"method": entry.label, "layer": layer, "instances": len(data),
                                  "judged_latents": int(data[0].judged.sum()), "definition": name, "rate": est.value,
                                  "rate_low": est.low, "rate_high": est.high, "sae_meets_bar": meets[layer]})
        good = sorted(layer for layer in found if meets[layer])
        counts = {len(found[layer]) for layer in good}
        if not good or len(counts) != 1:  # pooled only over the same instances at every layer
            continue
        instances = [tuple(found[layer][i] for layer in good) for i in range(counts.pop())]
        for k, (name, _, _) in enumerate(DEFINITIONS):
            def estimates(s: int, k: int = k, data: list[Any] = instances) -> dict[str, Estimate]:
                return {"rate": crossed_bootstrap(data, _share(k), data[0][0].n_rows, n_boot, s).estimate}
            pooled_est = estimates(seed)
            replicas = [estimates(s) for s in mc]
            row: dict[str, Any] = {"method": entry.label, "instances": len(instances), "layers": good,
                                   "definition": name, "rate": pooled_est["rate"].value,
                                   "rate_low": pooled_est["rate"].low, "rate_high": pooled_est["rate"].high}
            for anchor, value in anchors.items():
                def verdict(e: dict[str, Estimate], v: float = value) -> str:
                    return _anchor_verdict(e["rate"], v)
                decision = decide(verdict, pooled_est, replicas, {"rate": (value,)})
                row[f"vs {anchor}"] = decision.reading
                row[f"vs {anchor} deciding bound"] = decision.bound
                row[f"vs {anchor} distance_se"] = decision.distance_se
            pooled.append(row)
    return {"quality": pd.DataFrame(quality), "survival": pd.DataFrame(per_layer), "pooled": pd.DataFrame(pooled)}
