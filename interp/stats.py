"""Small statistics used by the analyses: correlations with bootstrap intervals, set overlap, n-gram dedup.

- :func:`pearson`, :func:`spearman`: the point estimate (scipy) and a percentile bootstrap
  confidence interval over examples (resampled with replacement, seeded).
- :func:`correlation_matrix`: the same for every pair of columns of a table, with each
  bootstrap resample shared by all pairs (so the matrices of bounds are consistent).
- :func:`jaccard`, :func:`top_fraction_ids`, :func:`expected_random_jaccard`: top-k overlap
  and its chance level (exact, from the hypergeometric law of the intersection size).
- :func:`ngram_jaccard`, :func:`dedup`: near-duplicate removal on token ids.

Example:
    >>> import numpy as np
    >>> x = np.arange(20.0)
    >>> round(pearson(x, 2 * x + 1, n_boot=50).r, 6)
    1.0
    >>> round(expected_random_jaccard(1000, 100), 4)
    0.0529
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd
from scipy import stats as sps

Method = Literal["pearson", "spearman"]


@dataclass(frozen=True)
class Correlation:
    """A correlation coefficient with its bootstrap confidence interval.

    Attributes:
        r: the coefficient on all examples.
        low, high: percentile bootstrap bounds at ``level`` (NaN without resamples).
        p: two-sided p-value from scipy.
        n: number of examples.
        method: ``"pearson"`` or ``"spearman"``.
        level: confidence level of ``[low, high]``.
        n_boot, seed: bootstrap settings.
    """

    r: float
    low: float
    high: float
    p: float
    n: int
    method: str
    level: float = 0.95
    n_boot: int = 1000
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def _as_array(x: Any) -> np.ndarray:
    return np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x, dtype=np.float64).reshape(-1)


def bootstrap_indices(n: int, n_boot: int, seed: int = 0) -> np.ndarray:
    """``[n_boot, n]`` example indices drawn with replacement, from ``numpy.random.default_rng(seed)``."""
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def block_bootstrap_means(values: Any, block: int, n_boot: int, seed: int = 0) -> np.ndarray:
    """``[n_boot]`` means of a moving-block bootstrap of a series (neighbours are not independent).

    Each resample concatenates ``ceil(n / block)`` blocks of ``block`` consecutive values, with
    start positions drawn uniformly from ``0 .. n - block``, cut to ``n`` values. ``block=1`` is
    the ordinary bootstrap.
    """
    x = _as_array(values)
    n = x.size
    block = max(1, min(int(block), n))
    starts = np.random.default_rng(seed).integers(0, n - block + 1, size=(n_boot, -(-n // block)))
    index = (starts[:, :, None] + np.arange(block)).reshape(n_boot, -1)[:, :n]
    return x[index].mean(axis=1)


def _rowwise_pearson(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pearson r of each row pair of ``a`` and ``b`` (``[B, n]``); NaN for a constant row."""
    a = a - a.mean(axis=1, keepdims=True)
    b = b - b.mean(axis=1, keepdims=True)
    denominator = np.sqrt((a * a).sum(axis=1) * (b * b).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, (a * b).sum(axis=1) / np.where(denominator > 0, denominator, 1), np.nan)


def _interval(samples: np.ndarray, level: float) -> tuple[float, float]:
    samples = samples[np.isfinite(samples)]
    if samples.size == 0:
        return math.nan, math.nan
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail])
    return float(low), float(high)


def correlation(x: Any, y: Any, method: Method = "pearson", n_boot: int = 1000, seed: int = 0,
                level: float = 0.95) -> Correlation:
    """Pearson or Spearman correlation of two per-example vectors, with a bootstrap CI.

    Pairs with a NaN in either vector are dropped. With fewer than 3 pairs, or a constant
    vector, ``r`` is NaN.
    """
    a, b = _as_array(x), _as_array(y)
    if a.shape != b.shape:
        raise ValueError(f"correlation needs vectors of equal length; got {a.shape[0]} and {b.shape[0]}.")
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    n = int(a.size)
    if n < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return Correlation(math.nan, math.nan, math.nan, math.nan, n, method, level, n_boot, seed)
    test = sps.pearsonr(a, b) if method == "pearson" else sps.spearmanr(a, b)
    low = high = math.nan
    if n_boot > 0:
        idx = bootstrap_indices(n, n_boot, seed)
        ra, rb = a[idx], b[idx]
        if method == "spearman":
            ra, rb = sps.rankdata(ra, axis=1), sps.rankdata(rb, axis=1)
        low, high = _interval(_rowwise_pearson(ra, rb), level)
    return Correlation(float(test.statistic), low, high, float(test.pvalue), n, method, level, n_boot, seed)


def pearson(x: Any, y: Any, n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> Correlation:
    """Pearson correlation with a percentile bootstrap CI (see :func:`correlation`)."""
    return correlation(x, y, "pearson", n_boot, seed, level)


def spearman(x: Any, y: Any, n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> Correlation:
    """Spearman rank correlation with a percentile bootstrap CI (see :func:`correlation`)."""
    return correlation(x, y, "spearman", n_boot, seed, level)


@dataclass(frozen=True)
class CorrelationMatrix:
    """Correlations between every pair of columns, with bootstrap bounds.

    Attributes:
        r, low, high: ``[k, k]`` DataFrames labelled by the columns.
        boot: ``[n_boot, k, k]`` bootstrap matrices (for intervals of derived numbers).
    """

    r: pd.DataFrame
    low: pd.DataFrame
    high: pd.DataFrame
    boot: np.ndarray
    method: str
    level: float


def correlation_matrix(frame: pd.DataFrame, method: Method = "pearson", n_boot: int = 1000, seed: int = 0,
                       level: float = 0.95) -> CorrelationMatrix:
    """Pairwise correlation of the columns of ``frame`` (rows with any NaN dropped)."""
    data = frame.dropna().to_numpy(dtype=np.float64)
    labels = list(frame.columns)

    def corr(x: np.ndarray) -> np.ndarray:
        if method == "spearman":
            x = sps.rankdata(x, axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.corrcoef(x, rowvar=False).reshape(len(labels), len(labels))

    point = corr(data)
    idx = bootstrap_indices(data.shape[0], n_boot, seed)
    boot = np.stack([corr(data[i]) for i in idx]) if n_boot > 0 else np.empty((0, len(labels), len(labels)))
    tail = (1 - level) / 2 * 100
    with np.errstate(invalid="ignore"):
        bounds = np.nanpercentile(boot, [tail, 100 - tail], axis=0) if n_boot > 0 else np.full((2, *point.shape),
                                                                                                 np.nan)

    def table(values: np.ndarray) -> pd.DataFrame:
        return pd.DataFrame(values, index=labels, columns=labels)

    return CorrelationMatrix(table(point), table(bounds[0]), table(bounds[1]), boot, method, level)


def off_diagonal_mean(matrix: np.ndarray) -> float | np.ndarray:
    """Mean of the strictly upper triangle of ``[..., k, k]`` (each unordered pair once)."""
    k = matrix.shape[-1]
    rows, cols = np.triu_indices(k, 1)
    if not rows.size:
        return math.nan
    return nan_mean(matrix[..., rows, cols], axis=-1)


def nan_mean(values: np.ndarray, axis: int = -1) -> float | np.ndarray:
    """Mean of the finite entries along ``axis``; NaN where there are none.

    Unlike ``np.nanmean`` it warns about nothing: a slice with no finite value (every
    correlation of a resample undefined) is an expected case, not a runtime warning.
    """
    values = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(values)
    count = finite.sum(axis=axis)
    total = np.where(finite, values, 0.0).sum(axis=axis)
    mean = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    return float(mean) if np.ndim(mean) == 0 else mean


# ---------------------------------------------------------------------------------------
# Sets


def jaccard(a: Iterable[Hashable], b: Iterable[Hashable]) -> float:
    """``|A & B| / |A | B|``; 0.0 when both sets are empty."""
    sa, sb = set(a), set(b)
    union = len(sa | sb)
    return len(sa & sb) / union if union else 0.0


def top_count(n: int, fraction: float) -> int:
    """How many of ``n`` items the top ``fraction`` holds: ``round(fraction * n)``, at least 1."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1]; got {fraction}.")
    return max(1, int(math.floor(fraction * n + 0.5)))


def top_fraction_ids(values: pd.Series, fraction: float = 0.10) -> list[Any]:
    """Index labels of the largest ``fraction`` of ``values`` (NaN dropped), largest first.

    Ties keep the order of ``values`` (stable sort).
    """
    clean = values.dropna()
    k = top_count(len(clean), fraction)
    order = np.argsort(-clean.to_numpy(dtype=np.float64), kind="stable")[:k]
    return [clean.index[i] for i in order]


def expected_random_jaccard(n: int, k: int) -> float:
    """Expected Jaccard of two independent uniformly random ``k``-subsets of ``n`` items, exactly.

    The intersection size ``I`` is hypergeometric (population n, k marked, k drawn), and
    ``J = I / (2k - I)``, so ``E[J] = sum_i P(I = i) i / (2k - i)``. For k = n/10 and
    large n this tends to ``0.1 / 1.9 = 0.0526``.
    """
    if not 0 < k <= n:
        raise ValueError(f"need 0 < k <= n; got k={k}, n={n}.")
    support = np.arange(max(0, 2 * k - n), k + 1)
    pmf = sps.hypergeom(n, k, k).pmf(support)
    return float(np.sum(pmf * support / (2 * k - support)))


# ---------------------------------------------------------------------------------------
# n-gram near-duplicates


def ngrams(tokens: Sequence[int], n: int = 5) -> set[tuple[int, ...]]:
    """The set of contiguous ``n``-grams of a token sequence (empty if shorter than n)."""
    seq = [int(t) for t in tokens]
    return {tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)}


def ngram_jaccard(a: Sequence[int], b: Sequence[int], n: int = 5) -> float:
    """Jaccard similarity of the ``n``-gram sets of two token sequences."""
    return jaccard(ngrams(a, n), ngrams(b, n))


def dedup(rows: Sequence[Sequence[int]], threshold: float = 0.1, n: int = 5) -> list[int]:
    """Greedy near-duplicate removal: indices of the rows kept, in order.

    Rows are visited in the given order (put the most important first); a row is dropped
    when its ``n``-gram Jaccard similarity to a row already kept exceeds ``threshold``.
    """
    kept: list[int] = []
    kept_grams: list[set[tuple[int, ...]]] = []
    for i, row in enumerate(rows):
        grams = ngrams(row, n)
        if all(jaccard(grams, other) <= threshold for other in kept_grams):
            kept.append(i)
            kept_grams.append(grams)
    return kept


# ---------------------------------------------------------------------------------------
# Estimates


@dataclass(frozen=True)
class Estimate:
    """A statistic with its 95% interval (``low``/``high`` NaN when no interval exists)."""

    value: float
    low: float = math.nan
    high: float = math.nan
    n: int | None = None

    @property
    def has_interval(self) -> bool:
        return math.isfinite(self.low) and math.isfinite(self.high)

    def text(self, digits: int = 2, percent: bool = False) -> str:
        def fmt(v: float) -> str:
            return f"{100 * v:.0f}%" if percent else f"{v:.{digits}f}"

        if not math.isfinite(self.value):
            return "n/a"
        body = fmt(self.value)
        if self.has_interval:
            body += f" [{fmt(self.low)}, {fmt(self.high)}]"
        return body


# ---------------------------------------------------------------------------------------
# Crossed designs: instances x examples


MIN_INSTANCES = 3  # fewer calibrated instances than this: the instance component is not estimable


@dataclass(frozen=True)
class Crossed:
    """A statistic averaged over instances that were all measured on the same examples (a crossed design).

    Attributes:
        estimate: the mean over instances, with its interval (both components, see :func:`crossed_bootstrap`).
        instances: how many instances were measured.
        per_instance: the statistic of each instance on all examples.
        between_sd: the standard deviation of ``per_instance`` (the instance component; NaN for one instance).
        examples_sd: the bootstrap standard deviation from the shared example resample (the example component).
        df: the Welch-Satterthwaite degrees of freedom of the interval.
    """

    estimate: Estimate
    instances: int
    per_instance: tuple[float, ...]
    between_sd: float
    examples_sd: float
    df: float

    @property
    def instance_limited(self) -> bool:
        """True when the instance component rests on fewer than :data:`MIN_INSTANCES` instances."""
        return self.instances < MIN_INSTANCES

    def instance_text(self) -> str:
        spread = "n/a" if not math.isfinite(self.between_sd) else f"{self.between_sd:.3g}"
        return f"{self.instances} instance(s), between-instance sd {spread}"


def crossed_bootstrap(per_instance: Sequence[Any], statistic: Any, n_rows: int, n_boot: int = 1000, seed: int = 0,
                      level: float = 0.95) -> Crossed:
    """Interval for the mean over instances of ``statistic`` when every instance is measured on the same examples.

    The design is crossed: instance i and instance j share the example j effect, so one resample of
    the examples is drawn and shared by every instance (``statistic(data, rows)`` gets ``rows`` of
    shape ``[n_boot, n_rows]`` and returns ``[n_boot]``). Its spread is the example component
    ``V_e``. The instance component is ``V_i = s^2 / I``, with ``s`` the standard deviation of the
    per-instance statistics on all examples. The interval is ``mean +- t_df sqrt(V_e + V_i)``, with
    Welch-Satterthwaite ``df = V^2 / (V_i^2 / (I - 1))`` (``V_e`` counted with infinite df). Each
    instance-by-example residual enters both components once, so the variance errs on the wide
    side by ``sigma_res^2 / (I n)``.

    With one instance there is no instance component: the interval covers the examples only, and
    :attr:`Crossed.instance_limited` says so. A percentile bootstrap that also resamples the
    instances cannot extend past the observed instances and under-covers with a handful of them;
    one that draws fresh examples for each drawn instance (a nested design) under-covers when
    examples differ (``tests/test_bootstrap_design.py``).
    """
    count = len(per_instance)
    if count == 0:
        raise ValueError("crossed_bootstrap needs at least one instance.")
    everything = np.arange(n_rows)[None]
    points = np.array([float(np.asarray(statistic(d, everything)).reshape(-1)[0]) for d in per_instance])
    rows = bootstrap_indices(n_rows, n_boot, seed)
    boot = np.mean([np.asarray(statistic(d, rows), dtype=np.float64).reshape(-1) for d in per_instance], axis=0)
    boot = boot[np.isfinite(boot)]
    point = float(points.mean())
    v_e = float(boot.var(ddof=1)) if boot.size > 1 else math.nan
    between = float(points.std(ddof=1)) if count > 1 else math.nan
    v_i = between ** 2 / count if count > 1 else 0.0
    total = v_e + v_i
    df = math.inf if v_i == 0 else total ** 2 / (v_i ** 2 / (count - 1))
    if not math.isfinite(total) or not math.isfinite(point):
        return Crossed(Estimate(point, n=n_rows), count, tuple(points), between, math.sqrt(v_e), df)
    half = float(sps.t.ppf(0.5 + level / 2, df) if math.isfinite(df) else sps.norm.ppf(0.5 + level / 2)) * \
        math.sqrt(total)
    return Crossed(Estimate(point, point - half, point + half, n_rows), count, tuple(float(p) for p in points),
                   between, math.sqrt(v_e), df)
