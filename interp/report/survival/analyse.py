"""The survival study's registered statistics and verdicts, computed from the committed raw data only.

Every rule is ``survival-1.json``'s: thresholds and bands are read from the file. Intervals are
:func:`interp.stats.crossed_bootstrap` (rows shared by the reference and every instance; the instance component
from the spread over instances). A verdict reads interval ends against thresholds; its **deciding bound** is the end,
among those whose crossing would change the verdict, nearest its threshold in Monte Carlo standard errors (the sd of
that end over re-analyses with bootstrap seeds 1-20); within 2 of them the verdict reads "on the boundary: A / B"
(:func:`interp.report.mc_error.boundary_reading`).

Example:
    >>> import numpy as np
    >>> from interp.report.survival.analyse import ratio_of_means
    >>> ref = np.ones((4, 1, 1)); q = [np.full((4, 1, 1), 0.5)]
    >>> ratio_of_means(q, ref, (0, 0), n_boot=50, seed=0).estimate.value
    0.5
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from interp.stats import Crossed, Estimate, crossed_bootstrap

__all__ = ["Interval", "band_verdict", "decide", "edge_verdict", "head_verdict", "ratio_of_means"]

Interval = Estimate


def _ratio(data: tuple[np.ndarray, np.ndarray], rows: np.ndarray) -> np.ndarray:
    q, ref = data
    return q[rows].mean(axis=-1) / ref[rows].mean(axis=-1)


def ratio_of_means(instances: Sequence[np.ndarray], reference: np.ndarray, unit: tuple[int, ...], n_boot: int,
                   seed: int) -> Crossed:
    """``mean_rows(q) / mean_rows(reference)`` for one unit (an index into the per-row arrays' trailing axes),
    crossed over rows and instances."""
    ref = reference[(slice(None), *unit)]
    return crossed_bootstrap([(q[(slice(None), *unit)], ref) for q in instances], _ratio, len(ref), n_boot, seed)


def head_verdict(pm: Estimate, cp: Estimate, threshold: float) -> str:
    """Induction survival: ``keeps its role`` (both lower ends >= threshold), ``loses its role`` (an upper end below
    it), ``not resolved`` otherwise."""
    if pm.low >= threshold and cp.low >= threshold:
        return "keeps its role"
    if pm.high < threshold or cp.high < threshold:
        return "loses its role"
    return "not resolved"


def edge_verdict(ratio: Estimate, kept: float = 0.8, broken: float = 0.5) -> str:
    """Edge survival bands read from the interval (the registration's six readings)."""
    low, high = ratio.low, ratio.high
    if low >= kept:
        return "kept"
    if low >= broken and high < kept:
        return "weakened"
    if high < broken:
        return "broken"
    if low >= broken:
        return "kept or weakened"
    if high < kept:
        return "weakened or broken"
    return "not resolved"


def band_verdict(estimate: Estimate, low_rule: str, high_rule: str, neither: str, threshold: float,
                 above: bool = True) -> str:
    """A one-threshold reading: ``low_rule`` when the interval lies above ``threshold`` (lower end > it),
    ``high_rule`` when below (upper end < it), ``neither`` otherwise."""
    if estimate.low > threshold:
        return low_rule
    if estimate.high < threshold:
        return high_rule
    return neither


@dataclass(frozen=True)
class Decision:
    """A verdict with its deciding bound: the interval end, its threshold and its distance in Monte Carlo SEs."""

    verdict: str
    reading: str  # the verdict, or "on the boundary: verdict / other"
    bound: str | None = None
    distance_se: float = float("nan")


def decide(verdict_of: Callable[[dict[str, Estimate]], str], estimates: dict[str, Estimate],
           replicas: Sequence[dict[str, Estimate]], thresholds: dict[str, Sequence[float]], z: float = 2.0
           ) -> Decision:
    """The verdict of ``estimates`` and, from the re-analyses ``replicas`` (same data, other bootstrap seeds), its
    deciding bound: among interval ends whose mirror across a threshold changes the verdict, the one nearest its
    threshold in units of its sd over the replicas."""
    from interp.report.mc_error import boundary_reading

    verdict = verdict_of(estimates)
    best: tuple[float, str, str] | None = None
    for name, limits in thresholds.items():
        est = estimates.get(name)
        if est is None or not est.has_interval:
            continue
        for side in ("low", "high"):
            end = getattr(est, side)
            spread = np.std([getattr(r[name], side) for r in replicas if name in r], ddof=1) if len(replicas) > 1 \
                else float("nan")
            for t in limits:
                mirrored = 2 * t - end
                lo, hi = (mirrored, est.high) if side == "low" else (est.low, mirrored)
                moved = {**estimates, name: Estimate(est.value, min(lo, hi), max(lo, hi), est.n)}
                other = verdict_of(moved)
                if other == verdict:
                    continue
                distance = abs(end - t) / spread if spread > 0 else float("inf")
                if best is None or distance < best[0]:
                    best = (distance, f"{name}.{side} vs {t:g}", other)
    if best is None:
        return Decision(verdict, verdict)
    distance, bound, other = best
    return Decision(verdict, boundary_reading(verdict, other, distance, z), bound, distance)


def share_statistic(keeps: Callable[[Any, np.ndarray], np.ndarray]) -> Callable[[Any, np.ndarray], np.ndarray]:
    """A crossed-bootstrap statistic: the share of units a rule ``keeps(data, rows) -> [boot, units]`` keeps."""
    def statistic(data: Any, rows: np.ndarray) -> np.ndarray:
        return keeps(data, rows).mean(axis=-1)
    return statistic


# ---------------------------------------------------------------------------------------
# Induction heads


def _load(path: Any) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def method_instances(folder: Any, family: str, model: str, suffix: str = "") -> dict[str, list[tuple[str, Any]]]:
    """Per roster label, the raw files of its instances that exist under ``folder/family`` (a partial run lists
    fewer instances; the tables say how many)."""
    from pathlib import Path

    from interp.report.survival.registration import file_name
    from interp.report.survival.roster import roster

    out: dict[str, list[tuple[str, Any]]] = {}
    for entry in roster(model):
        found = [(uid, Path(folder) / family / f"{file_name(uid)}{suffix}.safetensors") for uid in entry.ids()]
        found = [(uid, p) for uid, p in found if p.is_file()]
        if found:
            out[entry.label] = found
    return out


def reference_heads(ref: dict[str, np.ndarray], rules: dict[str, Any], n_boot: int, seed: int
                    ) -> tuple[list[tuple[int, int]], list[dict[str, Any]], bool]:
    """The reference's induction heads on the selection sequences (PM >= bar and CP's interval above 0), every head
    with PM >= bar listed, and whether the rule met its minimum (else the top-4-by-PM heads, 'below the bar')."""
    pm, cp = ref["pm_selection"], ref["cp_selection"]
    bar = float(rules["pm_threshold"])
    mean_pm = pm.mean(axis=0)
    rows: list[dict[str, Any]] = []
    heads: list[tuple[int, int]] = []
    for layer, head in zip(*np.nonzero(mean_pm >= bar), strict=True):
        c = crossed_bootstrap([cp[:, layer, head]], lambda d, r: d[r].mean(axis=-1), len(cp), n_boot, seed).estimate
        induction = bool(c.low > 0)
        rows.append({"head": f"{layer}.{head}", "layer": int(layer), "index": int(head),
                     "pm": float(mean_pm[layer, head]),
                     "cp": c.value, "cp_low": c.low, "cp_high": c.high, "induction head": induction})
        if induction:
            heads.append((int(layer), int(head)))
    if len(heads) >= 2:
        return heads, rows, True
    order = np.argsort(-mean_pm, axis=None, kind="stable")[:4]
    return [tuple(int(i) for i in np.unravel_index(k, mean_pm.shape)) for k in order], rows, False  # type: ignore[misc]


def _share_kept(threshold: float) -> Callable[[Any, np.ndarray], np.ndarray]:
    def statistic(data: Any, rows: np.ndarray) -> np.ndarray:
        pm_q, pm_r, cp_q, cp_r = data
        r_pm = pm_q[rows].mean(axis=1) / pm_r[rows].mean(axis=1)
        r_cp = cp_q[rows].mean(axis=1) / cp_r[rows].mean(axis=1)
        return ((r_pm >= threshold) & (r_cp >= threshold)).mean(axis=-1)
    return statistic


def _d_statistic(data: Any, rows: np.ndarray) -> np.ndarray:
    pm_g, pm_rtn, pm_ref = data
    ref = pm_ref[rows].mean(axis=1)
    return (pm_g[rows].mean(axis=1) / ref - pm_rtn[rows].mean(axis=1) / ref).mean(axis=-1)


def induction_analysis(folder: Any, model: str, reg: dict[str, Any], seeds: Sequence[int] | None = None
                       ) -> dict[str, Any]:
    """Every induction table and verdict of the registration for ``model`` from ``folder`` (the raw data)."""
    from pathlib import Path

    import pandas as pd

    rules, iv = reg["induction"], reg["intervals"]
    n_boot, seed = int(iv["n_boot"]), int(iv["seed"])
    mc = list(seeds if seeds is not None else iv["boundary"]["mc_seeds"])
    threshold = float(rules["survival"]["threshold"])
    ref = _load(Path(folder) / "induction" / "reference.safetensors")
    heads, listed, met = reference_heads(ref, rules["reference_induction_heads"], n_boot, seed)
    methods = method_instances(folder, "induction", model)
    survival, summary = [], []
    for label, files in methods.items():
        data = [_load(p) for _, p in files]
        for layer, head in heads:
            def stats(s: int, layer: int = layer, head: int = head, data: list[Any] = data) -> dict[str, Estimate]:
                return {k: ratio_of_means([d[k] for d in data], ref[k], (layer, head), n_boot, s).estimate
                        for k in ("pm", "cp")}
            est = stats(seed)
            replicas = [stats(s) for s in mc]
            decision = decide(lambda e: head_verdict(e["pm"], e["cp"], threshold), est, replicas,
                              {"pm": (threshold,), "cp": (threshold,)}) if met else None
            survival.append({"method": label, "instances": len(data), "head": f"{layer}.{head}",
                             "r_pm": est["pm"].value, "r_pm_low": est["pm"].low, "r_pm_high": est["pm"].high,
                             "r_cp": est["cp"].value, "r_cp_low": est["cp"].low, "r_cp_high": est["cp"].high,
                             "verdict": decision.reading if decision else "below the registered bar",
                             "deciding_bound": decision.bound if decision else None,
                             "distance_se": decision.distance_se if decision else None})
        index = tuple(np.array(heads).T)
        share = crossed_bootstrap([(d["pm"][(slice(None), *index)], ref["pm"][(slice(None), *index)],
                                    d["cp"][(slice(None), *index)], ref["cp"][(slice(None), *index)]) for d in data],
                                  _share_kept(threshold), len(ref["pm"]), n_boot, seed)
        verdicts = [r["verdict"] for r in survival if r["method"] == label]
        summary.append({"method": label, "instances": len(data), "heads": len(heads),
                        "share_kept": share.estimate.value, "share_low": share.estimate.low,
                        "share_high": share.estimate.high,
                        **{v: sum(x == v or x.startswith(f"on the boundary: {v} /") for x in verdicts)
                           for v in ("keeps its role", "loses its role", "not resolved")}})
    contrast = []
    for bits in (3, 4):
        rtn, gptq = f"rtn:bits={bits},group=64", f"gptq:bits={bits},group=64"
        if rtn not in methods or gptq not in methods or not met:
            continue
        index = tuple(np.array(heads).T)
        rtn_pm = _load(methods[rtn][0][1])["pm"][(slice(None), *index)]
        gptq_pm = [_load(p)["pm"][(slice(None), *index)] for _, p in methods[gptq]]
        ref_pm = ref["pm"][(slice(None), *index)]

        inputs = [(g, rtn_pm, ref_pm) for g in gptq_pm]

        def d_est(s: int, inputs: list[Any] = inputs, n: int = len(ref_pm)) -> dict[str, Estimate]:
            return {"D": crossed_bootstrap(inputs, _d_statistic, n, n_boot, s).estimate}
        rows = {r["head"]: r["verdict"] for r in survival if r["method"] == rtn}
        rows_g = {r["head"]: r["verdict"] for r in survival if r["method"] == gptq}
        as_gpt2 = all(v == "loses its role" for v in rows.values()) and all(v == "keeps its role"
                                                                             for v in rows_g.values())

        def verdict(e: dict[str, Estimate], as_gpt2: bool = as_gpt2) -> str:
            if as_gpt2:
                return "holds as in GPT-2"
            return band_verdict(e["D"], "holds in direction", "reversed", "not shown", 0.0)
        est = d_est(seed)
        decision = decide(verdict, est, [d_est(s) for s in mc], {"D": (0.0,)})
        contrast.append({"bits": bits, "headline": bits == 3, "gptq_instances": len(gptq_pm), "D": est["D"].value,
                         "D_low": est["D"].low, "D_high": est["D"].high, "verdict": decision.reading,
                         "deciding_bound": decision.bound, "distance_se": decision.distance_se})
    return {"reference_heads": pd.DataFrame(listed), "judged_heads": [f"{a}.{b}" for a, b in heads],
            "bar_met": met, "survival": pd.DataFrame(survival), "summary": pd.DataFrame(summary),
            "rtn_vs_gptq": pd.DataFrame(contrast)}


# ---------------------------------------------------------------------------------------
# Circuit edges


def _mean(data: Any, rows: np.ndarray) -> np.ndarray:
    return data[rows].mean(axis=-1)


def _band_shares(kept: float, broken: float) -> Callable[[Any, np.ndarray], np.ndarray]:
    def statistic(data: Any, rows: np.ndarray) -> np.ndarray:
        q, ref, band = data  # [pairs, edges] each
        ratio = q[rows].mean(axis=1) / ref[rows].mean(axis=1)
        inside = {"kept": ratio >= kept, "weakened": (ratio >= broken) & (ratio < kept), "broken": ratio < broken}
        return inside[band].mean(axis=-1)
    return statistic


def _lost(data: Any, rows: np.ndarray) -> np.ndarray:
    q, ref = data
    return (ref[rows] - q[rows]).mean(axis=-1)


def _band_edge(text: str) -> float:
    """The number in a registered band (``"ratio >= 0.8"`` -> 0.8, ``"ratio < 0.5 (...)"`` -> 0.5)."""
    import re

    found = re.search(r"[<>]=?\s*([0-9.]+)", text)
    if found is None:
        from interp.errors import DataError

        raise DataError(f"the registered band {text!r} names no threshold")
    return float(found.group(1))


def circuit_analysis(folder: Any, model: str, task: str, reg: dict[str, Any], seeds: Sequence[int] | None = None
                     ) -> dict[str, Any] | None:
    """Every circuit table and verdict of ``task`` for ``model`` from the raw data (None when the task was not
    measured on the model)."""
    from pathlib import Path

    import pandas as pd

    root = Path(folder) / "circuits"
    if not (root / task / "reference.safetensors").is_file():
        return None
    iv, rules = reg["intervals"], reg["circuits"]["edge_survival"]
    n_boot, seed = int(iv["n_boot"]), int(iv["seed"])
    mc = list(seeds if seeds is not None else iv["boundary"]["mc_seeds"])
    kept_at, broken_at = _band_edge(rules["bands"]["kept"]), _band_edge(rules["bands"]["broken"])
    table = pd.read_parquet(root / f"{task}-reference.parquet")
    ref = _load(root / task / "reference.safetensors")
    effects, clean = ref["effects"], ref["clean"]  # [edges, pairs], [pairs]
    n = effects.shape[1]
    edges = []
    for i, row in table.reset_index(drop=True).iterrows():
        e = crossed_bootstrap([effects[i]], _mean, n, n_boot, seed).estimate
        sign = np.sign(row["selection_effect"])
        is_judged = bool((e.low > 0 and sign > 0) or (e.high < 0 and sign < 0))
        edges.append({"edge": row["edge"], "sender": row["sender"], "receiver": row["receiver"], "eap": row["eap"],
                      "selection_effect": row["selection_effect"], "effect": e.value, "effect_low": e.low,
                      "effect_high": e.high, "judged": is_judged})
    edges_frame = pd.DataFrame(edges)
    judged = [i for i, e in enumerate(edges) if e["judged"]]
    per_edge, per_method, lost_rows = [], [], []
    for label, files in method_instances(folder, f"circuits/{task}", model).items():
        data = [_load(p) for _, p in files]
        verdicts = []
        for i in judged:
            def est(s: int, i: int = i, data: list[Any] = data) -> dict[str, Estimate]:
                return {"ratio": crossed_bootstrap([(d["effects"][i], effects[i]) for d in data], _ratio, n, n_boot,
                                                   s).estimate}
            point = est(seed)
            decision = decide(lambda e: edge_verdict(e["ratio"], kept_at, broken_at), point, [est(s) for s in mc],
                              {"ratio": (broken_at, kept_at)})
            part = crossed_bootstrap([(d["effects"][i], effects[i]) for d in data],
                                     lambda dd, r: (dd[0][r] - dd[1][r]).mean(axis=-1), n, n_boot, seed).estimate
            verdicts.append(decision.verdict)
            per_edge.append({"method": label, "instances": len(data), "edge": edges[i]["edge"],
                             "ratio": point["ratio"].value, "ratio_low": point["ratio"].low,
                             "ratio_high": point["ratio"].high, "verdict": decision.reading,
                             "deciding_bound": decision.bound, "distance_se": decision.distance_se,
                             "lost_part": part.value, "lost_part_low": part.low, "lost_part_high": part.high})
        shares = {}
        for band in ("kept", "weakened", "broken"):
            s = crossed_bootstrap([(d["effects"][judged].T, effects[judged].T, band) for d in data],
                                  _band_shares(kept_at, broken_at), n, n_boot, seed).estimate if judged else None
            shares.update({f"share_{band}": s.value if s else np.nan, f"share_{band}_low": s.low if s else np.nan,
                           f"share_{band}_high": s.high if s else np.nan})
        total = crossed_bootstrap([(d["clean"], clean) for d in data], _lost, n, n_boot, seed).estimate
        bad = sum(v in ("broken", "weakened or broken", "not resolved") for v in verdicts)
        reading = ("circuit intact" if bad == 0 else "circuit broken" if sum(v == "broken" for v in verdicts)
                   >= len(verdicts) / 2 else "partly broken") if verdicts else "no judged edge"
        counts = {v: verdicts.count(v) for v in ("kept", "weakened", "broken", "kept or weakened",
                                                 "weakened or broken", "not resolved")}
        per_method.append({"method": label, "instances": len(data), "judged_edges": len(judged), **shares,
                           **counts, "reading": reading, "ld_lost": total.value, "ld_lost_low": total.low,
                           "ld_lost_high": total.high})
        carried = sum(r["lost_part"] for r in per_edge if r["method"] == label)
        lost_rows.append({"method": label, "total": total.value, "carried_by_judged_edges": carried,
                          "not_carried": total.value - carried})
    sets = Path(folder) / "circuits" / f"{task}-sets.json"
    import json

    reading = json.loads(sets.read_text())["reading"] if sets.is_file() else "unknown"
    return {"edges": edges_frame, "per_edge": pd.DataFrame(per_edge), "per_method": pd.DataFrame(per_method),
            "lost": pd.DataFrame(lost_rows), "sets_reading": reading, "pairs": n}
