"""The registered analysis of llama-cpp-curve-1 (issue 47): interp's plans against llama.cpp's importance-matrix mixes.

Read with ``docs/preregistration/llama-cpp-curve-1.json``. Every file of a size is scored on the same
held-out examples; per file there is, for each example, its mean KL (float64, ``kl``) and, for each
position, its KL (float32 as stored, read back as float64) and whether its top token is the reference's.

- **R_B** = 1 - mean KL(plan) / mean KL(B) for each importance-matrix baseline B, the plan and B of the
  same calibration seed paired: :func:`interp.stats.crossed_bootstrap` over the seeds' pairs (the
  instances) and one shared resample of the examples.
- **Tails**, the same design: p99(plan)/p99(B), p99.9(plan)/p99.9(B), each percentile recomputed in every
  resample from the positions of the resampled examples (:func:`resampled_percentiles`, equal to
  ``numpy.percentile`` of the resample's positions, linear interpolation), and same_top(plan) - same_top(B).
- **Verdicts** exactly as registered (:func:`verdict`), and the deciding bound: among the interval ends whose
  mirror across a threshold changes the verdict, the one nearest its threshold in Monte Carlo standard errors
  (the sd of that end over re-analyses with bootstrap seeds 1-20), read by
  :func:`interp.report.mc_error.boundary_reading`.

Nothing here reads a file: :func:`analyse_model` takes the scores as :class:`FileScores`
(``benchmarks/llama_cpp_curve.py`` loads them), so ``tests/test_llama_cpp_curve.py`` checks it on synthetic
per-token data with known answers.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from interp.report.mc_error import boundary_reading
from interp.stats import Estimate, crossed_bootstrap

ARMS = ("plan_mean", "plan_tail")
BASELINES = {"interp": "mix_interp_imatrix", "llama": "mix_llama_imatrix"}  # short name -> file kind
PLAIN = "mix_plain"
KINDS = (PLAIN, *BASELINES.values(), *ARMS)
GOAL = "at least 30% below llama.cpp at its best (issue 47's goal)"
BEATS = "beats llama.cpp at its best"
LOSES = "loses to llama.cpp at its best"
UNRESOLVED = "not resolved"
VERDICTS = (GOAL, BEATS, LOSES, UNRESOLVED)
GOAL_REDUCTION = 0.30
PERCENTILES = {"p99": 99.0, "p999": 99.9}
TAILS = ("p99", "p999", "same_top")
NO_PLAN = "no plan fits"
NOT_JUDGED = "not judged (a diagnostic size: the plain mix is not smaller than the reference)"


def stem(kind: str, size: str, seed: int | None = None) -> str:
    """A file's name: ``mix_plain-Q4_K_M``, ``mix_interp_imatrix-Q4_K_M-41``, ``plan_tail-Q2_K-43``..."""
    return f"{kind}-{size}" if kind == PLAIN else f"{kind}-{size}-{seed}"


@dataclass(eq=False)
class FileScores:
    """One file's held-out scores: per-example mean KL ``kl`` [n] (float64), per-position KL ``tokens`` [n, T]
    and top-token agreement ``same`` [n, T] (bool), and the file's bytes."""

    kl: np.ndarray
    tokens: np.ndarray
    same: np.ndarray
    bytes: int
    _memo: dict[Any, np.ndarray] = field(default_factory=dict, repr=False)

    def percentiles(self, rows: np.ndarray) -> np.ndarray:
        """``[resamples, 2]``: p99 and p99.9 of the positions of each resample's examples (memoized per resample)."""
        key = _rows_key(rows)
        if key not in self._memo:
            self._memo[key] = resampled_percentiles(self.tokens, rows, tuple(PERCENTILES.values()))
        return self._memo[key]


def _rows_key(rows: np.ndarray) -> tuple[Any, ...]:
    sample = np.ascontiguousarray(rows.reshape(-1)[::61])  # every resample draws fresh rows: a sample tells them apart
    return rows.shape, int(rows.sum()), hashlib.blake2b(sample.tobytes(), digest_size=16).hexdigest()


def resampled_percentiles(values: np.ndarray, rows: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """``numpy.percentile(values[r].ravel(), q)`` for every resample ``r`` of ``rows`` ([resamples, n] example
    indices) and every ``q``, without building the resamples: ``[resamples, len(qs)]``.

    A resample holds example ``e`` ``c_e`` times, so its sorted positions are the sorted values of all examples,
    each repeated ``c_e`` times. A high percentile sits near the top: the values are sorted once, largest first,
    each resample's counts are accumulated over the top ones, and the two order statistics numpy's linear
    interpolation needs are read where that sum passes their rank from the top. The index and the interpolation
    are numpy's own formulas (virtual index ``(N - 1) q``, ``_lerp``), so the result is numpy's to the bit
    (tests/test_llama_cpp_curve.py)."""
    values = np.asarray(values, dtype=np.float64)
    n, width = values.shape
    rows = np.asarray(rows)
    boots = rows.shape[0]
    total = rows.shape[1] * width
    flat = values.reshape(-1)
    order = np.argsort(flat, kind="stable")[::-1]  # largest first
    ranked, owner = flat[order], order // width
    counts = np.bincount((rows + n * np.arange(boots)[:, None]).ravel(), minlength=boots * n).reshape(boots, n)
    wanted = []
    for q in qs:
        virtual = (total - 1) * np.true_divide(q, 100)
        lower = math.floor(virtual)
        upper = min(lower + 1, total - 1)
        wanted.append((total - 1 - lower, total - 1 - upper, float(virtual - lower)))
    deepest = max(w[0] for w in wanted)
    depth = min(order.size, 4 * (deepest + 1) + 64)
    while True:
        cumulative = np.cumsum(counts[:, owner[:depth]], axis=1)
        if depth == order.size or (cumulative[:, -1] > deepest).all():
            break
        depth = order.size  # a resample holding few of the top values: read them all
    out = np.empty((boots, len(qs)))
    for k, (from_top_low, from_top_high, gamma) in enumerate(wanted):
        a = ranked[(cumulative <= from_top_low).sum(axis=1)]  # the value at ascending position floor(virtual)
        b = ranked[(cumulative <= from_top_high).sum(axis=1)]
        diff = b - a
        out[:, k] = b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma  # numpy's _lerp
    return out


# ---------------------------------------------------------------------------------------
# Crossed statistics over the seeds' (plan, baseline) pairs


Pair = tuple[FileScores, FileScores]


def _reduction(pair: Pair, rows: np.ndarray) -> np.ndarray:
    a, b = pair[0].kl[rows], pair[1].kl[rows]
    return 1 - a.mean(-1) / b.mean(-1)


def _ratio(which: int) -> Callable[[Pair, np.ndarray], np.ndarray]:
    def statistic(pair: Pair, rows: np.ndarray) -> np.ndarray:
        return pair[0].percentiles(rows)[:, which] / pair[1].percentiles(rows)[:, which]
    return statistic


def _same_top_difference(pair: Pair, rows: np.ndarray) -> np.ndarray:
    a, b = pair[0].same.mean(axis=1), pair[1].same.mean(axis=1)  # each example has the same positions
    return a[rows].mean(-1) - b[rows].mean(-1)


def _mean_difference(pair: Pair, rows: np.ndarray) -> np.ndarray:
    return pair[0].kl[rows].mean(-1) - pair[1].kl[rows].mean(-1)


STATISTICS: dict[str, Callable[[Pair, np.ndarray], np.ndarray]] = {
    "R": _reduction, "p99": _ratio(0), "p999": _ratio(1), "same_top": _same_top_difference}


def crossed(pairs: Sequence[Pair], statistic: Callable[[Pair, np.ndarray], np.ndarray], n_boot: int, seed: int
            ) -> dict[str, Any]:
    result = crossed_bootstrap(list(pairs), statistic, len(pairs[0][0].kl), n_boot=n_boot, seed=seed)
    est = result.estimate
    return {"estimate": est.value, "low": est.low, "high": est.high, "per_seed": list(result.per_instance),
            "between_seed_sd": result.between_sd}


def estimates(pairs_by_baseline: dict[str, Sequence[Pair]], n_boot: int, seed: int, tails: bool = True
              ) -> dict[str, dict[str, Any]]:
    """``R_B`` (and with ``tails`` each tail statistic) against every baseline, e.g. ``R_interp``, ``p99_llama``."""
    names = STATISTICS if tails else {"R": _reduction}
    return {f"{name}_{b}": crossed(pairs, statistic, n_boot, seed) for b, pairs in pairs_by_baseline.items()
            for name, statistic in names.items()}


# ---------------------------------------------------------------------------------------
# Verdicts, as registered


def tail_worse(est: dict[str, Estimate], baseline: str) -> list[str]:
    """The tail metrics 'worse' against ``baseline``: a KL percentile ratio whose lower end is above 1, or a
    same-top-token difference whose upper end is below 0."""
    worse = [name for name in ("p99", "p999") if est[f"{name}_{baseline}"].low > 1]
    return worse + (["same_top"] if est[f"same_top_{baseline}"].high < 0 else [])


def verdict(est: dict[str, Estimate], baselines: Sequence[str] = tuple(BASELINES), tails: bool = True) -> str:
    """The registered verdict from the intervals (``est``: ``R_B`` and, with ``tails``, ``p99_B``, ``p999_B``,
    ``same_top_B`` for each baseline ``B``)."""
    reductions = [est[f"R_{b}"] for b in baselines]
    worse = tails and any(tail_worse(est, b) for b in baselines)
    if all(r.low >= GOAL_REDUCTION for r in reductions) and not worse:
        return GOAL
    if all(r.low > 0 for r in reductions):
        return BEATS
    if any(r.high < 0 for r in reductions):
        return LOSES
    return UNRESOLVED


def thresholds(names: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """The thresholds each interval is read against by :func:`verdict`."""
    by_kind = {"R": (GOAL_REDUCTION, 0.0), "p99": (1.0,), "p999": (1.0,), "same_top": (0.0,)}
    return {name: by_kind[name.rsplit("_", 1)[0]] for name in names}


def _as_estimates(record: dict[str, dict[str, Any]]) -> dict[str, Estimate]:
    return {name: Estimate(v["estimate"], v["low"], v["high"]) for name, v in record.items()}


def deciding_bound(judge: Callable[[dict[str, Estimate]], str], registered: dict[str, dict[str, Any]],
                   replicas: Sequence[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The verdict, its deciding bound and the reading (:func:`~interp.report.mc_error.boundary_reading`).

    Among the interval ends whose mirror across one of its thresholds changes the verdict, the deciding bound
    is the one nearest its threshold in Monte Carlo standard errors: the sd of that end over ``replicas``
    (the same analysis with bootstrap seeds 1-20)."""
    est = _as_estimates(registered)
    found = judge(est)
    best: dict[str, Any] | None = None
    for name, limits in thresholds(list(est)).items():
        e = est[name]
        for side in ("low", "high"):
            end = getattr(e, side)
            se = float(np.std([r[name][side] for r in replicas], ddof=1)) if len(replicas) > 1 else math.nan
            for t in limits:
                mirrored = 2 * t - end
                low, high = (mirrored, e.high) if side == "low" else (e.low, mirrored)
                other = judge({**est, name: Estimate(e.value, min(low, high), max(low, high))})
                if other == found:
                    continue
                distance = abs(end - t) / se if se > 0 else math.inf
                if best is None or distance < best["distance_se"]:
                    best = {"bound": f"{name}.{side}", "threshold": t, "value": end, "mc_se": se,
                            "distance_se": distance, "other": other}
    if best is None:
        return {"verdict": found, "reading": found, "deciding_bound": None}
    return {"verdict": found, "reading": boundary_reading(found, best["other"], best["distance_se"]),
            "deciding_bound": best}


# ---------------------------------------------------------------------------------------
# One model


@dataclass(frozen=True)
class Design:
    """What the analysis needs beyond the scores: the sizes (in order), which are judged, the seeds, ``n_boot``,
    the bootstrap seeds of the Monte Carlo re-analyses, and the sizes where no plan fits."""

    sizes: Sequence[str]
    judged: dict[str, bool]
    seeds: Sequence[int]
    n_boot: int = 2000
    mc_seeds: Sequence[int] = tuple(range(1, 21))
    no_plan: dict[str, Sequence[str]] = field(default_factory=dict)  # size -> arms with no fitting plan


def judged_comparison(pairs: dict[str, Sequence[Pair]], design: Design, tails: bool = True) -> dict[str, Any]:
    """The registered estimates (bootstrap seed 0), the verdict and its deciding bound over ``design.mc_seeds``."""
    baselines = list(pairs)

    def judge(est: dict[str, Estimate]) -> str:
        return verdict(est, baselines, tails)

    registered = estimates(pairs, design.n_boot, 0, tails)
    replicas = [estimates(pairs, design.n_boot, s, tails) for s in design.mc_seeds]
    decided = deciding_bound(judge, registered, replicas)
    worse = {b: tail_worse(_as_estimates(registered), b) for b in baselines} if tails else {}
    return {"estimates": registered, **decided, "tails_worse": worse}


def interval(per_seed: Sequence[FileScores], n_boot: int) -> dict[str, Any]:
    """Mean KL of a kind's files (seeds as instances; one file: the examples alone), with its interval."""
    result = crossed_bootstrap(list(per_seed), lambda f, rows: f.kl[rows].mean(-1), len(per_seed[0].kl),
                               n_boot=n_boot, seed=0)
    est = result.estimate
    return {"estimate": est.value, "low": est.low, "high": est.high, "per_seed": list(result.per_instance)}


def tail_values(files: Sequence[FileScores]) -> dict[str, list[float]]:
    everything = np.arange(len(files[0].kl))[None]
    p = [f.percentiles(everything)[0] for f in files]
    return {"p99": [float(x[0]) for x in p], "p999": [float(x[1]) for x in p],
            "same_top": [float(f.same.mean()) for f in files]}


def analyse_model(scores: dict[str, FileScores], design: Design, predicted: dict[str, float] | None = None
                  ) -> dict[str, Any]:
    """Every registered reading of one model: primary verdicts per size and arm, secondary rows, the Pareto
    table and the headline counts. ``predicted``: file name -> summed sensitivity of its types (additivity)."""
    primary: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    choice: dict[str, Any] = {}
    pareto = []
    seeds = list(design.seeds)
    for size in design.sizes:
        base = {b: [scores[stem(kind, size, s)] for s in seeds] for b, kind in BASELINES.items()}
        mix = scores[stem(PLAIN, size)]
        primary[size], plain[size] = {}, {}
        for arm in ARMS:
            if arm in design.no_plan.get(size, ()):
                primary[size][arm] = {"status": NO_PLAN}
                plain[size][arm] = {"status": NO_PLAN}
                continue
            plans = [scores[stem(arm, size, s)] for s in seeds]
            pairs = {b: list(zip(plans, files, strict=True)) for b, files in base.items()}
            if design.judged[size]:
                primary[size][arm] = {"status": "judged", **judged_comparison(pairs, design)}
            else:  # drawn and scored as a diagnostic, not judged: the seed-0 estimates only
                primary[size][arm] = {"status": NOT_JUDGED, "estimates": estimates(pairs, design.n_boot, 0)}
            primary[size][arm]["tail_values"] = tail_values(plans)
            plain[size][arm] = judged_comparison({"plain": [(p, mix) for p in plans]}, design, tails=False)
        baseline_pairs = list(zip(base["interp"], base["llama"], strict=True))
        diff = crossed(baseline_pairs, _mean_difference, design.n_boot, 0)
        diff["better"] = "interp" if diff["high"] < 0 else "llama" if diff["low"] > 0 else "neither (interval holds 0)"
        choice[size] = {**diff, "tail_values": {b: tail_values(files) for b, files in base.items()}}
        for kind in KINDS:
            names = [stem(kind, size)] if kind == PLAIN else [stem(kind, size, s) for s in seeds]
            if not all(n in scores for n in names):
                continue
            files = [scores[n] for n in names]
            pareto.append({"size": size, "kind": kind, "bytes": [f.bytes for f in files],
                           "mean_kl": interval(files, design.n_boot), **tail_values(files)})
    headline = {arm: {v: sum(1 for size in design.sizes if primary[size][arm].get("verdict") == v
                             and primary[size][arm]["status"] == "judged") for v in VERDICTS} for arm in ARMS}
    for arm in ARMS:
        headline[arm][NO_PLAN] = sum(1 for size in design.sizes if primary[size][arm]["status"] == NO_PLAN)
    additivity = []
    for name, value in sorted((predicted or {}).items()):
        realized = float(scores[name].kl.mean())
        ratio = realized / value if value > 0 else math.nan
        additivity.append({"file": name, "predicted_kl": value, "realized_kl": realized, "ratio": ratio,
                           "within_10_percent": bool(0.9 <= ratio <= 1.1)})
    return {"primary": primary, "headline": headline,
            "secondary": {"against_plain": plain, "imatrix_choice": choice, "additivity": additivity},
            "pareto": pareto}
