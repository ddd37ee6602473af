"""The reference paper's protocol, with intervals, and this project's noise ceiling.

"Why Do Some Inputs Break Low-Bit LLM Quantization?" (arXiv 2506.12044) defines its
statistics more narrowly than a first reading suggests (see the protocol clarifications in
``docs/reproduction.md``). This module computes them exactly that way, each with a
bootstrap interval over examples:

- :func:`paper_pairs`: the method pairs the paper averages over: every pair of
  configurations except the same algorithm at two bit widths.
- :func:`pair_agreement`: mean Pearson and mean top-10% Jaccard over a set of pairs.
- :func:`mean_method_correlation`: Pearson(norm, error of method m) per method, averaged
  over a group of methods (the paper averages over its 3-bit methods).
- :func:`split_halves` and :func:`noise_ceiling`: the token-noise ceiling. A per-example
  error is a mean over T-1 target tokens, so it carries measurement noise. Splitting the
  targets into odd and even positions gives two half-length measurements of the same
  example; their correlation across examples is the half-length reliability. Two methods'
  errors share the reference's token noise, so the agreement is corrected on *disjoint*
  tokens only: ``r(a_odd, b_even)`` over ``sqrt(r(a_odd, a_even) r(b_odd, b_even))``.
- :func:`self_agreement`: the assumption-free ceiling, how well one calibrated method
  agrees with itself across instances (other calibration samples, other kernels).
- :func:`recovery_boot`: recovery ``(L_q - L_p) / (L_q - L_ref)`` on the NLL scale (the
  primary number) and on perplexity, with paired bootstrap samples so that differences
  between components get intervals too.

Everything here is pure numpy on per-example (or per-token) arrays.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import scipy.stats as sps

from interp import stats
from interp.errors import InterpError
from interp.quant.spec import parse_spec
from interp.stats import Estimate

LEVEL = 0.95


def interval(samples: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """Percentile interval of bootstrap samples (non-finite samples dropped)."""
    return stats._interval(np.asarray(samples, dtype=np.float64).reshape(-1), level)


def estimate(point: float, samples: np.ndarray, n: int | None = None, level: float = LEVEL) -> Estimate:
    low, high = interval(samples, level)
    return Estimate(float(point), low, high, n)


def t_estimate(values: Sequence[float], level: float = LEVEL) -> Estimate:
    """Mean with a Student-t interval (for a handful of independent runs, e.g. training seeds)."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return Estimate(math.nan, n=0)
    if x.size == 1:
        return Estimate(float(x[0]), n=1)
    half = float(sps.t.ppf(0.5 + level / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return Estimate(float(x.mean()), float(x.mean() - half), float(x.mean() + half), int(x.size))


# ---------------------------------------------------------------------------------------
# Pairs and agreement


def paper_pairs(specs: Sequence[str], bits: int | None = None) -> list[tuple[str, str]]:
    """Unordered pairs of specs, without same-algorithm pairs at different bit widths.

    Args:
        specs: canonical method specs.
        bits: keep only pairs where both specs have this many bits (None: all).
    """
    parsed = {s: parse_spec(s) for s in specs}
    pairs = []
    for i, a in enumerate(specs):
        for b in specs[i + 1:]:
            pa, pb = parsed[a], parsed[b]
            if pa.method == pb.method and pa.bits != pb.bits:
                continue
            if bits is not None and not (pa.bits == bits and pb.bits == bits):
                continue
            pairs.append((a, b))
    return pairs


def _pair_r(data: np.ndarray, pairs_idx: list[tuple[int, int]]) -> float:
    # a resample whose errors are constant for a method has no correlation: NaN, which the interval leaves out
    # (numpy would also print a RuntimeWarning per such resample into a notebook)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.corrcoef(data, rowvar=False)
    return float(np.mean([r[i, j] for i, j in pairs_idx]))


def _top_sets(data: np.ndarray, k: int) -> list[set[int]]:
    return [set(np.argsort(-data[:, m], kind="stable")[:k].tolist()) for m in range(data.shape[1])]


def pair_agreement(errors: pd.DataFrame, pairs: Sequence[tuple[str, str]], n_boot: int = 1000, seed: int = 0,
                   top: float = 0.10) -> dict[str, Estimate]:
    """Mean Pearson and mean top-``top`` Jaccard over ``pairs``, with bootstrap intervals.

    The bootstrap resamples examples (shared by every pair). In a resample, an example drawn
    twice counts once in a top set (sets hold example identities), so the resampled
    Jaccard is slightly conservative. ``chance`` is the exact expected Jaccard of two
    random top sets (no interval).
    """
    if not pairs:
        return {}
    frame = errors.dropna()
    cols = list(frame.columns)
    idx = [(cols.index(a), cols.index(b)) for a, b in pairs]
    data = frame.to_numpy(dtype=np.float64)
    n = data.shape[0]
    k = stats.top_count(n, top)

    def jac(sample_rows: np.ndarray) -> float:
        sub = data[sample_rows]
        ids = sample_rows  # example identities
        sets = [{int(ids[i]) for i in s} for s in _top_sets(sub, k)]
        return float(np.mean([stats.jaccard(sets[i], sets[j]) for i, j in idx]))

    rows = np.arange(n)
    boot = stats.bootstrap_indices(n, n_boot, seed)
    r_boot = np.array([_pair_r(data[b], idx) for b in boot])
    j_boot = np.array([jac(b) for b in boot])
    return {"pearson": estimate(_pair_r(data, idx), r_boot, n), "jaccard": estimate(jac(rows), j_boot, n),
            "chance": Estimate(stats.expected_random_jaccard(n, k), n=n)}


# ---------------------------------------------------------------------------------------
# Norm against error, per method


def mean_method_correlation(norms: np.ndarray, errors: pd.DataFrame, specs: Sequence[str], n_boot: int = 1000,
                            seed: int = 0) -> Estimate:
    """Pearson(norm, error of m) for each spec in ``specs``, averaged; bootstrap over examples.

    Args:
        norms: ``[N]`` per-example norm, in the row order of ``errors``.
        errors: per-example errors (rows = examples).
    """
    if not specs:
        return Estimate(math.nan)
    x = np.asarray(norms, dtype=np.float64)
    e = errors[list(specs)].to_numpy(dtype=np.float64)
    data = np.column_stack([x, e])
    keep = np.isfinite(data).all(axis=1)
    data = data[keep]
    n = data.shape[0]
    if n < 3:
        return Estimate(math.nan, n=n)

    def mean_r(d: np.ndarray) -> float:
        with np.errstate(invalid="ignore", divide="ignore"):
            r = np.corrcoef(d, rowvar=False)[0, 1:]
        return float(np.mean(r))

    boot = np.array([mean_r(data[b]) for b in stats.bootstrap_indices(n, n_boot, seed)])
    return estimate(mean_r(data), boot, n)


# ---------------------------------------------------------------------------------------
# Noise ceiling


def split_halves(token_errors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-example mean error over odd and over even target positions: ``[N, T-1] -> [N], [N]``."""
    values = np.asarray(token_errors, dtype=np.float64)
    if values.ndim != 2 or values.shape[1] < 2:
        raise InterpError("split-half reliability needs per-token errors of shape [N, T-1] with T-1 >= 2.")
    return values[:, 0::2].mean(axis=1), values[:, 1::2].mean(axis=1)


def spearman_brown(r_half: float | np.ndarray) -> float | np.ndarray:
    """Reliability of the full-length measurement from the correlation of its two halves."""
    return 2 * r_half / (1 + r_half)


def _corr(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson r without warnings: NaN for a constant vector."""
    x, y = x - x.mean(), y - y.mean()
    denominator = math.sqrt(float((x * x).sum() * (y * y).sum()))
    return float((x * y).sum() / denominator) if denominator > 0 else math.nan


@dataclass(frozen=True)
class NoiseCeiling:
    """Half-length reliability per spec and the disjoint-token disattenuated correlation per pair.

    Both errors of a pair are differences from the *same* reference NLL on the *same* tokens, so
    their token noise is shared, and the classical correction (full errors over the product of
    reliabilities) over-corrects: it gave values above 1. Here every correlation compares disjoint
    target tokens. ``r_cross`` is the mean of ``r(a_odd, b_even)`` and ``r(a_even, b_odd)``, the
    denominator ``sqrt(r(a_odd, a_even) r(b_odd, b_even))`` uses the same half lengths, so the
    ratio estimates the correlation of the two methods' noise-free errors under the classical
    model (independent noise on disjoint tokens). Adjacent tokens share context, so odd and even
    halves are not wholly independent; the correction is then conservative on the ceiling side.

    Attributes:
        reliability: one row per spec: ``r_half`` (odd against even), ``reliability`` (its
            Spearman-Brown full-length value, for display), their bootstrap interval, ``n``.
        pairs: one row per pair: ``r`` (observed, full errors), ``r_cross`` (disjoint tokens),
            ``ceiling`` and ``disattenuated`` (NaN, and ``valid`` False, where a half-reliability is <= 0).
        mean_disattenuated, mean_observed: means over *all* pairs with intervals; NaN when any pair
            has no valid ceiling (no pair is dropped).
        min_half_reliability: the smallest ``r_half`` over the specs, with its interval (a
            denominator whose interval includes 0 makes the correction invalid).
        invalid_pairs: how many pairs have no valid ceiling on all examples.
    """

    reliability: pd.DataFrame
    pairs: pd.DataFrame
    mean_disattenuated: Estimate
    mean_observed: Estimate
    min_half_reliability: Estimate
    invalid_pairs: int


def noise_ceiling(token_errors: Mapping[str, np.ndarray], pairs: Sequence[tuple[str, str]], n_boot: int = 1000,
                  seed: int = 0) -> NoiseCeiling:
    """Reliability of each spec's per-example error and the pairs' disjoint-token disattenuated agreement.

    Args:
        token_errors: spec -> ``[N, T-1]`` per-token error ``nll_quant - nll_ref`` (same example rows).
        pairs: spec pairs to correct (e.g. :func:`paper_pairs`).
    """
    specs = list(token_errors)
    halves = {s: split_halves(token_errors[s]) for s in specs}
    full = {s: np.asarray(token_errors[s], dtype=np.float64).mean(axis=1) for s in specs}
    n = len(next(iter(full.values())))

    def evaluate(rows: np.ndarray) -> tuple[dict[str, float], list[float], list[float], list[float]]:
        r_half = {s: _corr(halves[s][0][rows], halves[s][1][rows]) for s in specs}
        observed, cross, corrected = [], [], []
        for a, b in pairs:
            (a_odd, a_even), (b_odd, b_even) = halves[a], halves[b]
            r_cross = (_corr(a_odd[rows], b_even[rows]) + _corr(a_even[rows], b_odd[rows])) / 2
            ok = r_half[a] > 0 and r_half[b] > 0
            observed.append(_corr(full[a][rows], full[b][rows]))
            cross.append(r_cross)
            corrected.append(r_cross / math.sqrt(r_half[a] * r_half[b]) if ok else math.nan)
        return r_half, observed, cross, corrected

    def mean_all(values: list[float]) -> float:  # every pair counts: one undefined pair makes the mean undefined
        return float(np.mean(values)) if values and all(math.isfinite(v) for v in values) else math.nan

    everything = np.arange(n)
    r_point, obs_point, cross_point, cor_point = evaluate(everything)
    r_boot: dict[str, list[float]] = {s: [] for s in specs}
    mean_cor_boot, mean_obs_boot, min_rel_boot = [], [], []
    for rows in stats.bootstrap_indices(n, n_boot, seed):
        r_half, obs, _, cor = evaluate(rows)
        for s in specs:
            r_boot[s].append(r_half[s])
        mean_obs_boot.append(mean_all(obs))
        mean_cor_boot.append(mean_all(cor))
        min_rel_boot.append(min(r_half.values()))
    reliability = pd.DataFrame([{
        "spec": s, "r_half": r_point[s], "r_half_low": interval(np.array(r_boot[s]))[0],
        "r_half_high": interval(np.array(r_boot[s]))[1], "reliability": float(spearman_brown(r_point[s])),
        "low": float(spearman_brown(interval(np.array(r_boot[s]))[0])),
        "high": float(spearman_brown(interval(np.array(r_boot[s]))[1])), "n": n,
    } for s in specs])
    pair_rows = []
    for (a, b), r, rc, c in zip(pairs, obs_point, cross_point, cor_point, strict=True):
        ok = r_point[a] > 0 and r_point[b] > 0
        pair_rows.append({"spec_a": a, "spec_b": b, "r": r, "r_cross": rc,
                          "ceiling": math.sqrt(r_point[a] * r_point[b]) if ok else math.nan,
                          "disattenuated": c, "valid": bool(ok and math.isfinite(c) and c <= 1)})
    # an undefined resample is kept as NaN: the interval is then computed over the defined ones, and the
    # share of undefined resamples is what min_half_reliability's interval shows
    return NoiseCeiling(
        reliability=reliability, pairs=pd.DataFrame(pair_rows, columns=["spec_a", "spec_b", "r", "r_cross", "ceiling",
                                                                         "disattenuated", "valid"]),
        mean_disattenuated=estimate(mean_all(cor_point), np.array(mean_cor_boot), n),
        mean_observed=estimate(mean_all(obs_point), np.array(mean_obs_boot), n),
        min_half_reliability=estimate(min(r_point.values()) if specs else math.nan, np.array(min_rel_boot), n),
        invalid_pairs=sum(1 for a, b in pairs if not (r_point[a] > 0 and r_point[b] > 0)),
    )


def self_agreement(errors: Mapping[str, np.ndarray], n_boot: int = 1000, seed: int = 0) -> dict[str, Estimate]:
    """Across-instance self-agreement: mean Pearson and top-10% Jaccard between instances of one method.

    ``errors`` maps an instance label (the same spec quantized with another calibration sample, or on
    other kernels) to its ``[N]`` per-example error on the same examples. It is assumption-free: how
    well a method agrees with itself, the ceiling any other method can be expected to reach against it.
    """
    labels = list(errors)
    if len(labels) < 2:
        return {}
    frame = pd.DataFrame({k: np.asarray(v, dtype=np.float64) for k, v in errors.items()})
    pairs = [(a, b) for i, a in enumerate(labels) for b in labels[i + 1:]]
    return pair_agreement(frame, pairs, n_boot=n_boot, seed=seed)


# ---------------------------------------------------------------------------------------
# Recovery


@dataclass(frozen=True)
class RecoveryBoot:
    """Recovery of several interventions on one example set, with paired bootstrap samples.

    Attributes:
        point: name -> recovery on the NLL scale.
        samples: name -> ``[n_boot]`` bootstrap recoveries (same resamples for every name).
        point_ppl, samples_ppl: the same on the perplexity scale.
    """

    point: dict[str, float]
    samples: dict[str, np.ndarray]
    point_ppl: dict[str, float]
    samples_ppl: dict[str, np.ndarray]
    n: int

    def estimate(self, name: str, scale: str = "nll") -> Estimate:
        point, samples = (self.point, self.samples) if scale == "nll" else (self.point_ppl, self.samples_ppl)
        return estimate(point[name], samples[name], self.n)

    def margin(self, name: str, others: Sequence[str], stronger: bool) -> Estimate:
        """``recovery(name) - max(others)`` if ``stronger``, else ``min(others) - recovery(name)`` (paired)."""
        def diff(values: Mapping[str, Any]) -> Any:
            stack = np.stack([np.asarray(values[o], dtype=np.float64) for o in others])
            mine = np.asarray(values[name], dtype=np.float64)
            return mine - stack.max(axis=0) if stronger else stack.min(axis=0) - mine

        return estimate(float(diff(self.point)), diff(self.samples), self.n)


def recovery_boot(target: np.ndarray, source: np.ndarray, patched: Mapping[str, np.ndarray], n_boot: int = 1000,
                  seed: int = 0) -> RecoveryBoot:
    """Recovery ``(L_target - L_patched) / (L_target - L_source)`` of each intervention.

    ``L`` is the mean NLL over the examples (NLL scale) or its exponential (perplexity
    scale). Inputs are per-example NLLs in one example order.
    """
    t, s = np.asarray(target, dtype=np.float64), np.asarray(source, dtype=np.float64)
    p = {k: np.asarray(v, dtype=np.float64) for k, v in patched.items()}
    n = t.size

    def rec(rows: Any, ppl: bool) -> dict[str, Any]:
        f = np.exp if ppl else (lambda v: v)
        lt, ls = f(t[rows].mean(axis=-1)), f(s[rows].mean(axis=-1))
        with np.errstate(invalid="ignore", divide="ignore"):
            return {k: (lt - f(v[rows].mean(axis=-1))) / (lt - ls) for k, v in p.items()}

    boot = stats.bootstrap_indices(n, n_boot, seed)
    everything = np.arange(n)
    return RecoveryBoot(point={k: float(v) for k, v in rec(everything, False).items()}, samples=rec(boot, False),
                        point_ppl={k: float(v) for k, v in rec(everything, True).items()}, samples_ppl=rec(boot, True),
                        n=n)


def paired_mean_difference(a: np.ndarray, b: np.ndarray, n_boot: int = 1000, seed: int = 0) -> Estimate:
    """Mean of ``a - b`` over examples with a bootstrap interval."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    boot = d[stats.bootstrap_indices(d.size, n_boot, seed)].mean(axis=1)
    return estimate(float(d.mean()), boot, int(d.size))


# ---------------------------------------------------------------------------------------
# Early exit split


def split_index(gap: np.ndarray, fraction: float = 0.5) -> int:
    """Index of the first position from which ``gap`` stays >= ``fraction`` of its final value.

    ``gap`` runs over layers (bottom to top). A final gap <= 0 has no split: the last index.
    """
    final = float(gap[-1])
    if final <= 0:
        return len(gap) - 1
    split = len(gap) - 1
    for i in range(len(gap) - 1, -1, -1):
        if gap[i] < fraction * final:
            break
        split = i
    return split


def split_share(reference: np.ndarray, quantized: np.ndarray, layers: Sequence[int], n_layers: int,
                usable: np.ndarray, n_boot: int = 1000, seed: int = 0) -> tuple[Estimate, int]:
    """Share of the model's layers after the early-exit split, with a bootstrap interval.

    Args:
        reference, quantized: ``[n_layers_measured, N]`` per-example lens NLL.
        layers: the model layers of the first axis.
        n_layers: the model's depth.
        usable: ``[n_layers_measured]`` bool: the layers where the lens is informative; the
            split is searched only among them (fixed from the point estimate).

    Returns:
        (the estimate of ``(n_layers - split_layer) / n_layers``, the point split layer).
    """
    keep = np.flatnonzero(usable)
    if keep.size == 0:
        return Estimate(math.nan), -1
    ref, q = np.asarray(reference, dtype=np.float64)[keep], np.asarray(quantized, dtype=np.float64)[keep]
    kept_layers = [layers[int(i)] for i in keep]

    def share(rows: Any) -> float:
        gap = q[:, rows].mean(axis=1) - ref[:, rows].mean(axis=1)
        return (n_layers - kept_layers[split_index(gap)]) / n_layers

    n = ref.shape[1]
    everything = np.arange(n)
    boot = np.array([share(b) for b in stats.bootstrap_indices(n, n_boot, seed)])
    point = share(everything)
    split_layer = n_layers - round(point * n_layers)
    return estimate(point, boot, n), split_layer
