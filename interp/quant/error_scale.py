"""At what scale do quantization errors agree? Agreement by window width and the error's autocorrelation by lag.

The agreement-by-length runs (:mod:`interp.quant.length`) found that cross-method agreement does not rise
with row length. Two explanations make different predictions about shorter windows of the same rows:

- **Token noise.** Each method's error is a row-level signal shared with the other methods plus independent
  per-token noise. Then agreement between window means is the window's reliability, and it rises with the
  window width by the Spearman-Brown prophecy, ``k r / (1 + (k - 1) r)`` for ``k`` times the width.
- **A scale of its own.** If the part the methods share and the part that is each method's own vary along the
  text in the same way, agreement is about the same at every width, and length cannot raise it.

:func:`by_window` measures agreement (mean Pearson over the paper's pairs) between window means at several
widths, pooling every window of every row as one unit (each window position centered on its own mean, so
that position effects do not count as agreement), beside the token-noise prediction from the narrowest width,
and the correlation of one method's error between adjacent windows of a row. :func:`autocorrelation` gives the
per-token error's autocorrelation by lag, pooled over rows, centered on each method's overall mean error, so a
row-level component shows as a plateau at long lags and a local one as a decay.

Every interval is a percentile bootstrap over rows (the rows are the independent units; a row's windows and
tokens stay together), with one set of resamples shared by every width and lag, so changes are paired.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from interp.errors import InterpError
from interp.quant import protocol as pr
from interp.quant.length import REFERENCE
from interp.stats import bootstrap_indices


def token_errors(token_nll: Mapping[str, np.ndarray]) -> tuple[list[str], np.ndarray]:
    """The methods and their per-token errors, ``[methods, rows, targets]`` (float64): NLL minus the reference's."""
    if REFERENCE not in token_nll:
        raise InterpError(f"the per-token NLL holds no '{REFERENCE}' entry to take the errors against.")
    ref = np.asarray(token_nll[REFERENCE], dtype=np.float64)
    specs = [s for s in token_nll if s != REFERENCE]
    return specs, np.stack([np.asarray(token_nll[s], dtype=np.float64) - ref for s in specs])


def _counts(n: int, n_boot: int, seed: int) -> np.ndarray:
    """``[1 + n_boot, n]`` row weights: all ones (the point estimate), then each bootstrap resample's counts."""
    draws = bootstrap_indices(n, n_boot, seed)
    counts = np.stack([np.bincount(d, minlength=n) for d in draws]).astype(np.float64)
    return np.vstack([np.ones((1, n)), counts])


def _summary(values: np.ndarray) -> tuple[float, float, float]:
    """Point (row 0) and the percentile interval of the resamples (rows 1...)."""
    low, high = pr.interval(values[1:])
    return float(values[0]), low, high


def autocorrelation(token_nll: Mapping[str, np.ndarray], lags: Sequence[int], n_boot: int = 1000,
                    seed: int = 0) -> pd.DataFrame:
    """The per-token error's autocorrelation at each lag (within rows), mean over methods, with its interval and
    the range over methods.

    For method m with errors ``e`` and overall mean ``mu``: ``rho(k) = mean[(e_t - mu)(e_{t+k} - mu)] /
    mean[(e_t - mu)^2]``, the means over every row and every pair of targets ``k`` apart.
    """
    specs, err = token_errors(token_nll)
    _, n, length = err.shape
    bad = [k for k in lags if not 0 < k < length]
    if bad:
        raise InterpError(f"lags {bad} do not fit rows of {length} targets (each lag must be 1 to {length - 1}).")
    weights = _counts(n, n_boot, seed)
    total = weights.sum(axis=1)
    per_method = []
    for e in err:
        mu = (weights @ e.sum(axis=1)) / (total * length)
        var = (weights @ (e * e).sum(axis=1)) / (total * length) - mu**2
        rho = []
        for k in lags:
            cross = weights @ (e[:, :-k] * e[:, k:]).sum(axis=1)
            ends = weights @ (e[:, :-k].sum(axis=1) + e[:, k:].sum(axis=1))
            pairs = total * (length - k)
            rho.append((cross - mu * ends + pairs * mu**2) / pairs / var)
        per_method.append(np.stack(rho, axis=1))  # [1 + n_boot, lags]
    stacked = np.stack(per_method)  # [methods, 1 + n_boot, lags]
    mean = stacked.mean(axis=0)
    rows = []
    for j, k in enumerate(lags):
        value, low, high = _summary(mean[:, j])
        rows.append({"lag": int(k), "autocorrelation": value, "low": low, "high": high,
                     "method_min": float(stacked[:, 0, j].min()), "method_max": float(stacked[:, 0, j].max())})
    return pd.DataFrame(rows)


def _window_means(err: np.ndarray, width: int) -> np.ndarray:
    """``[methods, rows, windows]``: each method's mean error over consecutive windows of ``width`` targets."""
    methods, n, length = err.shape
    count = length // width
    if count < 2:
        raise InterpError(f"windows of {width} targets need rows of at least {2 * width} targets; these have "
                          f"{length}.")
    return err[:, :, : count * width].reshape(methods, n, count, width).mean(axis=3)


def _pooled_cov(weights: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per resample: the covariance of ``a`` and ``b`` (``[rows, windows]``) over every window of every row, each
    window position centered on its own (weighted) mean."""
    total = weights.sum(axis=1)
    mean_a, mean_b = (weights @ a) / total[:, None], (weights @ b) / total[:, None]
    return ((weights @ (a * b).sum(axis=1)) - total * (mean_a * mean_b).sum(axis=1)) / (total * a.shape[1])


def _agreement(weights: np.ndarray, means: np.ndarray, pairs: list[tuple[int, int]]) -> np.ndarray:
    var = [_pooled_cov(weights, m, m) for m in means]
    return np.mean([_pooled_cov(weights, means[i], means[j]) / np.sqrt(var[i] * var[j]) for i, j in pairs], axis=0)


def _adjacent(weights: np.ndarray, means: np.ndarray) -> np.ndarray:
    """Per resample: the correlation of one method's error in window j and window j + 1 of the same row, mean over
    methods."""
    out = []
    for m in means:
        first, second = m[:, :-1], m[:, 1:]
        cov = _pooled_cov(weights, first, second)
        out.append(cov / np.sqrt(_pooled_cov(weights, first, first) * _pooled_cov(weights, second, second)))
    return np.mean(out, axis=0)


def spearman_brown(r: float, factor: float) -> float:
    """The reliability of a mean over ``factor`` times as many units: ``k r / (1 + (k - 1) r)``."""
    return factor * r / (1 + (factor - 1) * r)


def by_window(token_nll: Mapping[str, np.ndarray], widths: Sequence[int], n_boot: int = 1000,
              seed: int = 0) -> pd.DataFrame:
    """Agreement between window means at each width (every window of every row pooled), its paired change from
    the narrowest width, the token-noise prediction (Spearman-Brown from the narrowest width), and the
    correlation of one method's error between adjacent windows."""
    specs, err = token_errors(token_nll)
    pairs = [(specs.index(a), specs.index(b)) for a, b in pr.paper_pairs(specs)]
    if not pairs:
        raise InterpError("agreement needs at least two methods that the paper would pair.")
    widths = sorted(int(w) for w in widths)
    weights = _counts(err.shape[1], n_boot, seed)
    agree, adjacent, windows = {}, {}, {}
    for w in widths:
        means = _window_means(err, w)
        windows[w] = means.shape[2]
        agree[w], adjacent[w] = _agreement(weights, means, pairs), _adjacent(weights, means)
    first = widths[0]
    rows = []
    for w in widths:
        value, low, high = _summary(agree[w])
        _, change_low, change_high = _summary(agree[w] - agree[first])
        adj, adj_low, adj_high = _summary(adjacent[w])
        rows.append({"width": w, "windows_per_row": windows[w], "rows": err.shape[1], "agreement": value,
                     "low": low, "high": high, "change": value - float(agree[first][0]), "change_low": change_low,
                     "change_high": change_high, "token_noise_prediction": spearman_brown(float(agree[first][0]),
                                                                                          w / first),
                     "adjacent": adj, "adjacent_low": adj_low, "adjacent_high": adj_high})
    return pd.DataFrame(rows)
