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
- :func:`split_halves`, :func:`spearman_brown` and :func:`noise_ceiling`: the noise ceiling.
  A per-example error is a mean over T-1 target tokens, so it carries measurement noise.
  Splitting the targets into odd and even positions gives two half-length measurements of
  the same example; their correlation across examples, stepped up to full length with the
  Spearman-Brown formula ``rel = 2 r / (1 + r)``, is the reliability of the error. Two
  methods' errors cannot correlate above ``sqrt(rel_a rel_b)``, and ``r_ab / sqrt(rel_a
  rel_b)`` is their agreement with the noise removed (Spearman's disattenuation).
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


def _rel(odd: np.ndarray, even: np.ndarray) -> float:
    with np.errstate(invalid="ignore", divide="ignore"):
        r = float(np.corrcoef(odd, even)[0, 1])
    return float(spearman_brown(r))


@dataclass(frozen=True)
class NoiseCeiling:
    """Split-half reliability per spec and disattenuated correlation per pair.

    Attributes:
        reliability: one row per spec: ``r_half``, ``reliability`` (Spearman-Brown) and its
            bootstrap interval, ``n``.
        pairs: one row per pair: ``r`` (observed Pearson of the full errors), ``ceiling``
            ``sqrt(rel_a rel_b)``, ``disattenuated`` ``r / ceiling``.
        mean_disattenuated: the mean of ``disattenuated`` over the pairs, with its interval.
    """

    reliability: pd.DataFrame
    pairs: pd.DataFrame
    mean_disattenuated: Estimate
    mean_observed: Estimate


def noise_ceiling(token_errors: Mapping[str, np.ndarray], pairs: Sequence[tuple[str, str]], n_boot: int = 1000,
                  seed: int = 0) -> NoiseCeiling:
    """Reliability of each spec's per-example error and the pairs' disattenuated agreement.

    Args:
        token_errors: spec -> ``[N, T-1]`` per-token error ``nll_quant - nll_ref`` (same example rows).
        pairs: spec pairs to correct (e.g. :func:`paper_pairs`).
    """
    specs = list(token_errors)
    halves = {s: split_halves(token_errors[s]) for s in specs}
    full = {s: np.asarray(token_errors[s], dtype=np.float64).mean(axis=1) for s in specs}
    n = len(next(iter(full.values())))
    boot = stats.bootstrap_indices(n, n_boot, seed)

    def rels(rows: np.ndarray) -> dict[str, float]:
        return {s: _rel(halves[s][0][rows], halves[s][1][rows]) for s in specs}

    def pair_values(rows: np.ndarray, rel: Mapping[str, float]) -> tuple[list[float], list[float]]:
        observed, corrected = [], []
        for a, b in pairs:
            with np.errstate(invalid="ignore", divide="ignore"):
                r = float(np.corrcoef(full[a][rows], full[b][rows])[0, 1])
                ceiling = math.sqrt(rel[a] * rel[b]) if rel[a] > 0 and rel[b] > 0 else math.nan
            observed.append(r)
            corrected.append(r / ceiling if ceiling else math.nan)
        return observed, corrected

    all_rows = np.arange(n)
    rel_point = rels(all_rows)
    obs_point, cor_point = pair_values(all_rows, rel_point)
    rel_boot = {s: [] for s in specs}  # type: dict[str, list[float]]
    mean_cor_boot, mean_obs_boot = [], []
    for rows in boot:
        rel = rels(rows)
        for s in specs:
            rel_boot[s].append(rel[s])
        obs, cor = pair_values(rows, rel)
        mean_obs_boot.append(np.nanmean(obs) if pairs else math.nan)
        mean_cor_boot.append(np.nanmean(cor) if pairs and np.isfinite(cor).any() else math.nan)
    reliability = pd.DataFrame([{
        "spec": s, "r_half": float(np.corrcoef(*halves[s])[0, 1]), "reliability": rel_point[s],
        "low": interval(np.array(rel_boot[s]))[0], "high": interval(np.array(rel_boot[s]))[1], "n": n,
    } for s in specs])
    pair_rows = []
    for (a, b), r, c in zip(pairs, obs_point, cor_point, strict=True):
        ceiling = math.sqrt(rel_point[a] * rel_point[b]) if rel_point[a] > 0 and rel_point[b] > 0 else math.nan
        pair_rows.append({"spec_a": a, "spec_b": b, "r": r, "ceiling": ceiling, "disattenuated": c})
    mean_cor = float(np.nanmean(cor_point)) if pairs and np.isfinite(cor_point).any() else math.nan
    return NoiseCeiling(
        reliability=reliability, pairs=pd.DataFrame(pair_rows),
        mean_disattenuated=estimate(mean_cor, np.array(mean_cor_boot), n),
        mean_observed=estimate(float(np.nanmean(obs_point)) if pairs else math.nan, np.array(mean_obs_boot), n),
    )


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
