"""D_large (the highest-error examples, near-duplicates removed) and D_ctrl (low-error controls)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from interp import stats
from interp.data import Examples
from interp.display import ResultDisplay
from interp.errors import InterpError
from interp.io import sanitize
from interp.quant.analysis.common import ErrorsLike, error_series
from interp.results import CheckedResult
from interp.validate import checked


@dataclass(frozen=True)
class SplitResult(CheckedResult, ResultDisplay):
    """D_large (highest-error examples, deduplicated) and D_ctrl (low-error controls).

    Attributes:
        large, ctrl: the two subsets as Examples.
        errors: the error used to rank, for every example considered.
        dropped_ids: top examples removed as near-duplicates of a kept one.
        settings: top, dedup threshold, n-gram size, control pool, seed, counts.

    Made only finite: see :mod:`interp.results`.
    """

    large: Examples
    ctrl: Examples
    errors: pd.Series
    dropped_ids: list[str]
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def large_ids(self) -> list[str]:
        return list(self.large.ids)

    @property
    def ctrl_ids(self) -> list[str]:
        return list(self.ctrl.ids)

    def to_frame(self) -> pd.DataFrame:
        """Every considered example with its error and set (large, ctrl, duplicate, or empty)."""
        label = pd.Series("", index=self.errors.index, name="set")
        label[self.large_ids] = "large"
        label[self.ctrl_ids] = "ctrl"
        label[self.dropped_ids] = "duplicate"
        frame = pd.DataFrame({"error": self.errors, "set": label})
        frame.index.name = "example"
        return frame

    def summary(self) -> pd.DataFrame:
        """Size and mean error of D_large, D_ctrl and all examples considered."""
        sets = {"large": self.large_ids, "ctrl": self.ctrl_ids, "all": list(self.errors.index)}
        return pd.DataFrame({"set": list(sets), "n": [len(ids) for ids in sets.values()],
                             "mean_error": [float(self.errors[ids].mean()) for ids in sets.values()]})

    def to_dict(self) -> dict[str, Any]:
        return sanitize({
            "settings": self.settings, "large_ids": self.large_ids, "ctrl_ids": self.ctrl_ids,
            "dropped_ids": self.dropped_ids,
            "mean_error_large": float(self.errors[self.large_ids].mean()),
            "mean_error_ctrl": float(self.errors[self.ctrl_ids].mean()),
            "mean_error_all": float(self.errors.mean()),
        })

@checked
def split_large_ctrl(errors: ErrorsLike, examples: Examples, top: float = 0.10, dedup: float = 0.1,
                     ngram: int = 5, ctrl_pool: float = 0.5, seed: int = 0) -> SplitResult:
    """Pick D_large and D_ctrl from per-example errors.

    Args:
        errors: a Series by example id (one spec, or e.g. the mean over specs), or a
            DataFrame of specs (its row mean is used).
        examples: the scored examples; only those with an error are considered.
        top: fraction of examples in the top set before deduplication.
        dedup: an example is dropped when its ``ngram``-gram Jaccard similarity (token ids,
            BOS excluded) to an already kept, higher-error example exceeds this.
        ctrl_pool: D_ctrl is sampled from the lowest ``ctrl_pool`` fraction by error.
        seed: seed of the D_ctrl sample (``numpy.random.default_rng``).

    Example:
        >>> import numpy as np, pandas as pd, torch
        >>> import interp
        >>> from interp.quant import split_large_ctrl
        >>> rows = torch.randint(0, 256, (20, 16), generator=torch.Generator().manual_seed(0))
        >>> ex = interp.Examples.from_tokens(rows)
        >>> errors = pd.Series(np.linspace(0, 1, 20), index=ex.ids)
        >>> res = split_large_ctrl(errors, ex, top=0.1, seed=0)
        >>> res.large_ids, len(res.ctrl)  # the top 10%, and as many controls from the bottom half
        (['row19', 'row18'], 2)
    """
    series = error_series(errors)
    position = {eid: i for i, eid in enumerate(examples.ids)}
    series = series[[eid in position for eid in series.index]].dropna()
    if len(series) < 4:
        raise InterpError(f"split_large_ctrl needs errors for at least 4 of the examples; found {len(series)}.")
    candidates = stats.top_fraction_ids(series, top)
    rows = [examples.tokens[position[eid], 1:].tolist() for eid in candidates]
    kept = [candidates[i] for i in stats.dedup(rows, threshold=dedup, n=ngram)]
    dropped = [eid for eid in candidates if eid not in set(kept)]
    order = np.argsort(series.to_numpy(), kind="stable")
    pool = [series.index[i] for i in order[: stats.top_count(len(series), ctrl_pool)]]
    if len(kept) > len(pool):
        raise InterpError(f"D_large has {len(kept)} examples but the control pool only {len(pool)}.")
    chosen = np.random.default_rng(seed).choice(len(pool), size=len(kept), replace=False)
    ctrl = [pool[i] for i in sorted(chosen)]
    settings = {"top": top, "dedup": dedup, "ngram": ngram, "ctrl_pool": ctrl_pool, "seed": seed,
                "n_considered": len(series), "n_top": len(candidates), "n_large": len(kept),
                "n_dropped": len(dropped), "error": str(series.name)}
    return SplitResult(
        large=examples.subset([position[e] for e in kept]),
        ctrl=examples.subset([position[e] for e in ctrl]),
        errors=series, dropped_ids=dropped, settings=settings,
    )
