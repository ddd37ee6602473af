"""Residual norm against error: per layer, the correlation across examples between the reference's mean
residual norm (BOS excluded) and the per-example error."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from interp import stats
from interp.data import Examples
from interp.display import ResultDisplay
from interp.io import sanitize
from interp.models import Model
from interp.probes import probe
from interp.quant.analysis.common import ErrorsLike, error_series
from interp.results import CheckedResult
from interp.validate import checked


@dataclass(frozen=True)
class NormCorrelationResult(CheckedResult, ResultDisplay):
    """Per-layer Pearson correlation between the reference's residual norm and the error.

    Attributes:
        table: columns component, layer, r, low, high, p, n, mean_norm.
        settings: components, bootstrap settings, examples' settings.

    Made only finite: see :mod:`interp.results`.
    """

    # a correlation, its interval and p are NaN where undefined (a constant vector, no bootstrap): interp.stats'
    allow_nan = ("table[r]", "table[low]", "table[high]", "table[p]")

    table: pd.DataFrame
    settings: dict[str, Any] = field(default_factory=dict)

    def to_frame(self) -> pd.DataFrame:
        return self.table.copy()

    def last_layer(self) -> dict[str, dict[str, float]]:
        last = self.table["layer"].max()
        rows = self.table[self.table["layer"] == last]
        return {row.component: {"layer": int(last), "r": row.r, "low": row.low, "high": row.high}
                for row in rows.itertuples()}

    def to_dict(self) -> dict[str, Any]:
        return sanitize({"settings": self.settings, "last_layer": self.last_layer(),
                         "rows": self.table.to_dict(orient="records")})

@checked
def norm_error_correlation(
    reference: Model,
    examples: Examples,
    errors: ErrorsLike,
    layers: Sequence[int] | None = None,
    components: Sequence[str] = ("resid_mid", "resid_post"),
    batch_size: int = 8,
    n_boot: int = 1000,
    seed: int = 0,
    progress: bool | None = None,
    probe_result: Any | None = None,
) -> NormCorrelationResult:
    """Pearson correlation, per layer, between mean ``||r_l||`` (BOS excluded) and the error.

    Args:
        reference: the full-precision model (its activations are measured).
        examples: the scored examples.
        errors: per-example error by id (Series, or a DataFrame whose row mean is used).
        layers: layers to measure (default all).
        components: residual components (``resid_mid`` is the paper's r_l).
        probe_result: a :class:`~interp.probes.ProbeResult` with ``{component}/norm`` for
            these examples, to skip the forward passes.

    Example:
        >>> import numpy as np, pandas as pd, torch
        >>> import interp
        >>> from interp.quant import norm_error_correlation
        >>> model = interp.tiny_model("llama")
        >>> rows = torch.randint(0, 256, (20, 16), generator=torch.Generator().manual_seed(0))
        >>> ex = interp.Examples.from_tokens(rows)
        >>> errors = pd.Series(np.linspace(0, 1, 20), index=ex.ids)
        >>> res = norm_error_correlation(model, ex, errors, n_boot=20, progress=False)
        >>> res.table[["component", "layer"]].values.tolist()
        [['resid_mid', 0], ['resid_mid', 1], ['resid_post', 0], ['resid_post', 1]]
    """
    series = error_series(errors).reindex(examples.ids)
    result = probe_result or probe(reference, examples, list(components), ["norm"], batch_size=batch_size,
                                   layers=layers, exclude_bos=True, progress=progress)
    rows = []
    for component in components:
        norms = result[component, "norm"].double().numpy()
        for li, layer in enumerate(result.layers):
            c = stats.pearson(norms[li], series.to_numpy(), n_boot=n_boot, seed=seed)
            rows.append({"component": component, "layer": layer, "r": c.r, "low": c.low, "high": c.high,
                         "p": c.p, "n": c.n, "mean_norm": float(np.mean(norms[li]))})
    settings = {"components": list(components), "n_boot": n_boot, "seed": seed, "exclude_bos": True,
                "error": str(series.name), "examples": dict(examples.settings)}
    return NormCorrelationResult(table=pd.DataFrame(rows), settings=settings)
