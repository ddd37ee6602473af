"""The localization tie: are the broken units repaired more by putting back gate and down than the other weights?

Per instance of a registered method, its **broken units** are fixed once on all measurement rows (induction heads
with r_PM or r_CP < 0.5; judged edges with ratio < 0.5). In the ``named`` variant (the reference's gate and down
weights restored in every layer) and the ``control`` variant (up, q, k, v, o restored), a broken unit is
**repaired** when its point criterion is met again. ``T`` = share repaired by ``named`` - share repaired by
``control``, averaged over instances with at least one broken unit; its interval is crossed (rows resampled, the
broken sets fixed). Lower end > 0: "gate and down carry it"; upper end < 0: "the other weights carry more"; fewer
than 3 broken units in all: no verdict.

Example:
    >>> import numpy as np
    >>> from interp.report.survival.tie import repaired_share
    >>> ref = np.ones((10, 2)); variant = np.stack([np.array([0.9, 0.2])] * 10)
    >>> float(repaired_share([variant], [ref], np.array([True, True]), 0.5, np.arange(10)[None])[0])
    0.5
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from interp.report.survival.analyse import _load, band_verdict, decide
from interp.report.survival.registration import file_name
from interp.report.survival.run import VARIANTS, tie_labels
from interp.stats import Estimate, crossed_bootstrap

__all__ = ["concentration_analysis", "feature_tie_analysis", "layer_shares", "repaired_share", "tie_analysis"]


def repaired_share(variants: Sequence[np.ndarray], references: Sequence[np.ndarray], broken: np.ndarray,
                   threshold: float, rows: np.ndarray) -> np.ndarray:
    """The share of ``broken`` units (``[units]`` bool) repaired in a variant: every criterion's ratio of means over
    ``rows`` (``[boot, n]``), variant (``[n, units]``) against reference, reaches ``threshold``. Returns ``[boot]``."""
    ok = None
    for variant, reference in zip(variants, references, strict=True):
        ratio = variant[rows][..., broken].mean(axis=1) / reference[rows][..., broken].mean(axis=1)
        ok = ratio >= threshold if ok is None else ok & (ratio >= threshold)
    assert ok is not None
    return ok.mean(axis=-1)


def _broken(criteria: Sequence[tuple[np.ndarray, np.ndarray]], rows: np.ndarray, threshold: float) -> np.ndarray:
    """``[boot, units]``: a unit is broken in a resample ``rows`` (``[boot, n]``) when any criterion's ratio of means,
    quantized (``[n, units]``) over reference, is < ``threshold`` (the registered point criteria)."""
    broken = np.zeros((len(rows), criteria[0][0].shape[1]), dtype=bool)
    for values, reference in criteria:
        broken |= values[rows].mean(axis=1) / reference[rows].mean(axis=1) < threshold
    return broken


def _t_statistic(threshold: float) -> Any:
    def statistic(data: Any, rows: np.ndarray) -> np.ndarray:
        named, control, references, broken = data
        return (repaired_share(named, references, broken, threshold, rows)
                - repaired_share(control, references, broken, threshold, rows))
    return statistic


def _family_arrays(folder: Path, family: str, uid: str, ref: dict[str, np.ndarray]
                   ) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Per criterion of the family, ``(values [n, units], reference [n, units])`` of instance ``uid``, or None."""
    path = folder / family / f"{file_name(uid)}.safetensors"
    if not path.is_file():
        return None
    d = _load(path)
    if family == "induction":
        return [(d[k].reshape(len(d[k]), -1), ref[k].reshape(len(ref[k]), -1)) for k in ("pm", "cp")]
    return [(d["effects"].T, ref["effects"].T)]


def tie_analysis(folder: Any, model: str, family: str, units: np.ndarray, reg: dict[str, Any],
                 seeds: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """``T`` per registered method for one family of units (``family`` "induction" with ``units`` a flat mask over
    layer x head, or "circuits/<task>" with a mask over the reference's edges)."""
    from interp.report.survival.analyse import method_instances

    folder = Path(folder)
    iv, rules = reg["intervals"], reg["localization_tie"]
    n_boot, seed = int(iv["n_boot"]), int(iv["seed"])
    mc = list(seeds if seeds is not None else iv["boundary"]["mc_seeds"])
    threshold = 0.5  # the registered point criteria: r_PM, r_CP and edge ratio >= 0.5
    ref = _load(folder / family / "reference.safetensors")
    out = []
    for label, files in method_instances(folder, family, model).items():
        if label not in tie_labels():
            continue
        per_instance, broken_total, used, measured = [], 0, 0, 0
        for uid, _ in files:
            base = _family_arrays(folder, family, uid, ref)
            variants = {v: _family_arrays(folder, family, f"{uid}#{v}", ref) for v in VARIANTS}
            if base is None or any(v is None for v in variants.values()):
                continue
            measured += 1
            everything = np.arange(len(base[0][0]))[None]
            broken = _broken([(v[:, units], r[:, units]) for v, r in base], everything, threshold)[0]
            broken_total += int(broken.sum())
            if not broken.any():
                continue
            used += 1
            named = [v[0][:, units] for v in variants["named"]]  # type: ignore[union-attr]
            control = [v[0][:, units] for v in variants["control"]]  # type: ignore[union-attr]
            per_instance.append((named, control, [b[1][:, units] for b in base], broken))
        if not measured:
            continue  # no instance of this method has its restored variants yet
        n = len(per_instance[0][2][0]) if per_instance else 0
        out.append(_tie_row(label, family, per_instance, _t_statistic(threshold), n, broken_total, used, n_boot, seed,
                            mc))
    del rules
    return out


def _feature_t(data: Any, rows: np.ndarray) -> np.ndarray:
    named, control, broken = data
    return (named.repaired_for(rows, broken) - control.repaired_for(rows, broken)) / broken.sum()


def _tie_row(label: str, family: str, per_instance: list[Any], statistic: Any, n: int, broken_total: int, used: int,
             n_boot: int, seed: int, mc: Sequence[int]) -> dict[str, Any]:
    row: dict[str, Any] = {"method": label, "family": family, "instances_used": used, "broken_units": broken_total}
    if broken_total < 3 or not per_instance:
        row.update({"T": np.nan, "T_low": np.nan, "T_high": np.nan, "verdict": "too few broken units"})
        return row

    def est(s: int) -> dict[str, Estimate]:
        return {"T": crossed_bootstrap(per_instance, statistic, n, n_boot, s).estimate}
    point = est(seed)
    decision = decide(lambda e: band_verdict(e["T"], "gate and down carry it", "the other weights carry more",
                                             "not shown", 0.0), point, [est(s) for s in mc], {"T": (0.0,)})
    row.update({"T": point["T"].value, "T_low": point["T"].low, "T_high": point["T"].high,
                "verdict": decision.reading, "deciding_bound": decision.bound})
    return row


def feature_tie_analysis(folder: Any, model: str, layer: int, reg: dict[str, Any], seeds: Sequence[int] | None = None
                         ) -> list[dict[str, Any]]:
    """``T`` per registered method for the latents of one layer, from the committed counts (survival-3): per
    instance its broken latents (fixed on all rows), and per resample how many survive in each restored variant."""
    from interp.report.survival.feature_counts import SurvivalCounts
    from interp.report.survival.roster import roster

    folder = Path(folder)
    iv = reg["intervals"]
    n_boot, seed = int(iv["n_boot"]), int(iv["seed"])
    mc = list(seeds if seeds is not None else iv["boundary"]["mc_seeds"])
    out = []
    for entry in roster(model):
        if entry.label not in tie_labels():
            continue
        per_instance, broken_total, used, measured, n = [], 0, 0, 0, 0
        for uid in entry.ids():
            paths = {v: folder / "features" / f"{file_name(u)}-L{layer}.safetensors"
                     for v, u in (("base", uid), *((v, f"{uid}#{v}") for v in VARIANTS))}
            if not all(p.is_file() for p in paths.values()):
                continue
            measured += 1
            base = SurvivalCounts.load(paths["base"])
            broken = base.broken_latents()
            broken_total += int(broken.sum())
            n = base.n_rows
            if broken.any():
                used += 1
                per_instance.append((SurvivalCounts.load(paths["named"]), SurvivalCounts.load(paths["control"]),
                                     broken))
        if measured:
            out.append(_tie_row(entry.label, f"latents L{layer}", per_instance, _feature_t, n, broken_total, used,
                                n_boot, seed, mc))
    return out


# ---------------------------------------------------------------------------------------
# The tie's secondary statistics (survival-1, localization_tie.secondary): where the broken units sit


def _e_statistic(threshold: float) -> Any:
    """``E`` for one instance: (share of its broken units inside the region) / (share of all judged units inside
    it), the broken set recomputed on each resample of the rows; NaN on a resample with no broken unit."""
    def statistic(data: Any, rows: np.ndarray) -> np.ndarray:
        criteria, region = data
        broken = _broken(criteria, rows, threshold)
        count = broken.sum(axis=-1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(count > 0, (broken & region).sum(axis=-1) / np.maximum(count, 1), np.nan) / region.mean()
    return statistic


def concentration_analysis(folder: Any, model: str, family: str, units: np.ndarray, region: np.ndarray,
                           reg: dict[str, Any], seeds: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """``E`` per quantized model for one family (``units`` the judged units' mask, ``region`` which of the judged
    units lie in the registered region: an MLP sender in the upper half of the layers for edges, the upper half for
    induction heads). An instance with no broken unit on all rows has no ``E`` and is left out (as for ``T``); a
    resample with no broken unit has none either and is dropped, and ``defined`` says what share of resamples had
    one. Verdict from the interval against 1: "concentrate there", "avoid it", "not shown". With no judged unit in
    the region E is undefined (as registered); with every judged unit there it is 1 by construction, and says so;
    with fewer than 3 broken units (summed over instances) it gets no verdict, as T does."""
    from interp.report.survival.analyse import method_instances
    from interp.stats import bootstrap_indices

    folder = Path(folder)
    iv = reg["intervals"]
    n_boot, seed = int(iv["n_boot"]), int(iv["seed"])
    mc = list(seeds if seeds is not None else iv["boundary"]["mc_seeds"])
    threshold = 0.5  # the registered point criteria, as for T: r_PM, r_CP and edge ratio >= 0.5
    statistic = _e_statistic(threshold)
    ref = _load(folder / family / "reference.safetensors")
    out = []
    for label, files in method_instances(folder, family, model).items():
        per_instance, broken_total = [], 0
        for uid, _ in files:
            base = _family_arrays(folder, family, uid, ref)
            assert base is not None  # method_instances lists existing files only
            data = ([(values[:, units], reference[:, units]) for values, reference in base], region)
            n = len(base[0][1])
            point_broken = _broken(data[0], np.arange(n)[None], threshold)[0]
            broken_total += int(point_broken.sum())
            if point_broken.any():
                per_instance.append(data)
        row: dict[str, Any] = {"method": label, "family": family, "instances": len(files),
                               "instances_used": len(per_instance), "broken_units": broken_total,
                               "judged_units": int(units.sum()), "in_region": int(region.sum())}
        # every broken unit is in the region too when all judged units are: E is then 1 on every resample
        unread = ("undefined: no judged unit in the region" if not region.any() else
                  "uninformative: every judged unit is in the region (E = 1 by construction)" if region.all() else
                  "no broken unit" if not per_instance else
                  "too few broken units" if broken_total < 3 else None)  # T's registered minimum, applied to E
        if unread is not None:
            row.update(E=np.nan, E_low=np.nan, E_high=np.nan, defined=np.nan, verdict=unread)
        else:
            rows = bootstrap_indices(n, n_boot, seed)
            boot = np.mean([statistic(d, rows) for d in per_instance], axis=0)

            def est(s: int, data: list[Any] = per_instance, n: int = n) -> dict[str, Estimate]:
                return {"E": crossed_bootstrap(data, statistic, n, n_boot, s).estimate}
            point = est(seed)
            decision = decide(lambda e: band_verdict(e["E"], "concentrate there", "avoid it", "not shown", 1.0),
                              point, [est(s) for s in mc], {"E": (1.0,)})
            row.update(E=point["E"].value, E_low=point["E"].low, E_high=point["E"].high,
                       defined=float(np.isfinite(boot).mean()), verdict=decision.reading)
        out.append(row)
    return out


def layer_shares(folder: Any, model: str, layers: Sequence[int]) -> list[dict[str, Any]]:
    """Descriptive only (survival-1: a later layer inherits every earlier layer's error): per quantized model and
    layer, that layer's share of the model's non-surviving judged latents (headline definition, all held-out rows,
    summed over the method's instances) beside its share of the judged latents."""
    from interp.report.survival.feature_counts import SurvivalCounts
    from interp.report.survival.roster import roster

    folder = Path(folder)
    out = []
    for entry in roster(model):
        judged, lost, used = np.zeros(len(layers)), np.zeros(len(layers)), 0
        for uid in entry.ids():
            paths = [folder / "features" / f"{file_name(uid)}-L{layer}.safetensors" for layer in layers]
            if not all(p.is_file() for p in paths):
                continue
            used += 1
            for k, p in enumerate(paths):
                counts = SurvivalCounts.load(p)
                judged[k] += counts.judged.sum()
                lost[k] += counts.broken_latents().sum()
        if not used:
            continue
        for k, layer in enumerate(layers):
            out.append({"method": entry.label, "instances": used, "layer": int(layer),
                        "share_of_judged": judged[k] / judged.sum(),
                        "share_of_not_surviving": lost[k] / lost.sum() if lost.sum() else np.nan})
    return out
