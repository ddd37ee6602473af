"""Cross-method agreement: do different quantizers break the same inputs?

Pearson and Spearman matrices of the per-example error vectors, with bootstrap intervals,
and the Jaccard overlap of their top-10% sets against the overlap two random sets would have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from interp import stats
from interp.display import ResultDisplay
from interp.errors import InterpError
from interp.io import sanitize
from interp.results import CheckedResult
from interp.validate import checked


@dataclass(frozen=True)
class AgreementResult(CheckedResult, ResultDisplay):
    """Agreement of per-example errors across quantized versions of one model.

    Attributes:
        pearson, spearman: correlation matrices with bootstrap bounds.
        jaccard: ``[k, k]`` Jaccard overlap of the top-``top`` error sets.
        chance_jaccard: expected overlap of two random top sets of the same size.
        chance_method: how ``chance_jaccard`` was computed.
        n: examples used (those with every spec scored).
        settings: top fraction, bootstrap settings.

    Made only finite: see :mod:`interp.results`.
    """

    # a correlation is NaN where it is undefined (a constant column, no bootstrap): interp.stats' convention
    allow_nan = ("pearson", "spearman")

    pearson: stats.CorrelationMatrix
    spearman: stats.CorrelationMatrix
    jaccard: pd.DataFrame
    chance_jaccard: float
    chance_method: str
    n: int
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def specs(self) -> list[str]:
        return list(self.jaccard.columns)

    def mean_off_diagonal(self, which: str = "pearson") -> dict[str, float]:
        """Mean over spec pairs, with the bootstrap interval of that mean (no interval for Jaccard)."""
        if which == "jaccard":
            return {"mean": float(stats.off_diagonal_mean(self.jaccard.to_numpy())), "low": math.nan,
                    "high": math.nan}
        matrix: stats.CorrelationMatrix = getattr(self, which)
        boot = stats.off_diagonal_mean(matrix.boot) if matrix.boot.size else np.array([])
        low, high = stats._interval(np.asarray(boot, dtype=float).reshape(-1), matrix.level)
        return {"mean": float(stats.off_diagonal_mean(matrix.r.to_numpy())), "low": low, "high": high}

    def to_frame(self) -> pd.DataFrame:
        """One row per unordered spec pair."""
        rows = []
        specs = self.specs
        for i, a in enumerate(specs):
            for b in specs[i + 1 :]:
                rows.append({
                    "spec_a": a, "spec_b": b,
                    "pearson": self.pearson.r.loc[a, b], "pearson_low": self.pearson.low.loc[a, b],
                    "pearson_high": self.pearson.high.loc[a, b],
                    "spearman": self.spearman.r.loc[a, b], "spearman_low": self.spearman.low.loc[a, b],
                    "spearman_high": self.spearman.high.loc[a, b],
                    "jaccard_top": self.jaccard.loc[a, b],
                })
        return pd.DataFrame(rows)

    def summary(self) -> pd.DataFrame:
        """One row per spec pair (as :meth:`AgreementResult.to_frame`)."""
        return self.to_frame()

    def to_dict(self) -> dict[str, Any]:
        return sanitize({
            "n": self.n, "specs": self.specs, "settings": self.settings,
            "mean_pearson": self.mean_off_diagonal("pearson"),
            "mean_spearman": self.mean_off_diagonal("spearman"),
            "mean_jaccard_top": self.mean_off_diagonal("jaccard")["mean"],
            "chance_jaccard": self.chance_jaccard, "chance_method": self.chance_method,
            "pairs": self.to_frame().to_dict(orient="records"),
        })

@checked
def agreement(errors: pd.DataFrame, n_boot: int = 1000, seed: int = 0, top: float = 0.10,
              level: float = 0.95) -> AgreementResult:
    """Cross-method agreement of per-example errors.

    Args:
        errors: index example id, one column per spec (rows with a NaN are dropped).
        n_boot: bootstrap resamples of the examples (shared by all pairs).
        seed: bootstrap seed.
        top: the fraction of highest-error examples compared by Jaccard.
        level: confidence level of the intervals.

    Returns:
        An :class:`interp.quant.analysis.AgreementResult`. The chance Jaccard is exact: the intersection of two
        independent random k-subsets of n is hypergeometric (see
        :func:`interp.stats.expected_random_jaccard`).

    Example:
        >>> import numpy as np, pandas as pd
        >>> from interp.quant import agreement
        >>> rng = np.random.default_rng(0)
        >>> shared = rng.normal(size=200)  # the part of the error both methods share
        >>> errors = pd.DataFrame({"a": shared + 0.3 * rng.normal(size=200), "b": shared + 0.3 * rng.normal(size=200)})
        >>> res = agreement(errors, n_boot=50)
        >>> res.specs, res.n, round(res.mean_off_diagonal("pearson")["mean"], 2)
        (['a', 'b'], 200, 0.91)
    """
    frame = errors.dropna()
    if frame.shape[1] < 2 or len(frame) < 3:
        raise InterpError(f"agreement needs at least 2 specs and 3 examples; got {frame.shape[1]} and {len(frame)}.")
    tops = {spec: set(stats.top_fraction_ids(frame[spec], top)) for spec in frame.columns}
    jac = pd.DataFrame([[stats.jaccard(tops[a], tops[b]) for b in frame.columns] for a in frame.columns],
                       index=frame.columns, columns=frame.columns)
    k = stats.top_count(len(frame), top)
    return AgreementResult(
        pearson=stats.correlation_matrix(frame, "pearson", n_boot, seed, level),
        spearman=stats.correlation_matrix(frame, "spearman", n_boot, seed, level),
        jaccard=jac,
        chance_jaccard=stats.expected_random_jaccard(len(frame), k),
        chance_method=f"exact: E[I/(2k-I)] with I ~ Hypergeometric(N={len(frame)}, k={k}, k={k})",
        n=len(frame),
        settings={"top": top, "top_count": k, "n_boot": n_boot, "seed": seed, "level": level},
    )
