"""The result of a patching run: :class:`PatchResult` (values per patch and example) and its tables.

Its figures are drawn by :mod:`interp.figures.localize` (``interp.figures.draw(result)``).

Example:
    >>> import math, torch
    >>> from interp.localize.patching.patches import Patch
    >>> from interp.localize.patching.results import PatchResult
    >>> log = lambda *v: torch.log(torch.tensor(v, dtype=torch.float64))
    >>> res = PatchResult(values=log([8.0, 8.0]).reshape(1, 2), target=log(10.0, 10.0), source=log(5.0, 5.0),
    ...                   patches=[Patch("down", (1,))], ids=["a", "b"])
    >>> round(float(res.recovery()[0]), 6)  # (log 10 - log 8) / (log 10 - log 5) on perplexity: (10 - 8) / (10 - 5)
    0.4
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from interp.display import ResultDisplay
from interp.errors import InterpError
from interp.io import saving, write_csv, write_json
from interp.localize.patching.patches import PAPER_NAMES, Patch, span
from interp.results import CheckedResult
from interp.typing import PerExample

PatchValues = Float[Tensor, "n_patches n_examples"]


@dataclass(frozen=True)
class PatchResult(CheckedResult, ResultDisplay):
    """Per-patch, per-example metric values from :func:`~interp.localize.patching.engine.patch`.

    Attributes:
        values: ``[n_patches, N]`` metric with each patch applied.
        target: ``[N]`` the unpatched target run's metric.
        source: ``[N]`` the source run's metric.
        patches: the patch jobs, in the order of ``values``.
        ids: example ids.
        metric: ``"nll"`` (aggregated as perplexity) or ``"logit_diff"`` (mean).
        settings: models, batch size, examples' settings.

    Made only finite: see :mod:`interp.results`.
    """

    values: PatchValues
    target: PerExample
    source: PerExample
    patches: list[Patch]
    ids: list[str]
    metric: str = "nll"
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.ids)
        if tuple(self.values.shape) != (len(self.patches), n) or self.target.shape != (n,) or self.source.shape != (n,):
            raise InterpError(f"PatchResult shapes do not match: values {tuple(self.values.shape)}, "
                              f"{len(self.patches)} patches, {n} examples.")
        super().__post_init__()  # finite (CheckedResult), after the shapes

    def _aggregate(self, values: Tensor) -> Tensor:
        if self.metric == "nll":
            return torch.exp(values.double().mean(dim=-1))
        return values.double().mean(dim=-1)

    @property
    def target_value(self) -> float:
        """The unpatched target's aggregate (perplexity for NLL)."""
        return float(self._aggregate(self.target))

    @property
    def source_value(self) -> float:
        return float(self._aggregate(self.source))

    def aggregate(self) -> Float[Tensor, " n_patches"]:
        """Each patch's aggregate: perplexity for NLL, mean logit difference otherwise."""
        return self._aggregate(self.values)

    def recovery(self) -> Float[Tensor, " n_patches"]:
        """``(target - patched) / (target - source)`` on the aggregate (NaN when source == target)."""
        gap = self.target_value - self.source_value
        if gap == 0:
            return torch.full((len(self.patches),), math.nan, dtype=torch.float64, device=self.values.device)
        return (self.target_value - self.aggregate()) / gap

    def table(self) -> pd.DataFrame:
        """One row per patch: component, layers, value, target, source, recovery (fraction)."""
        unit = "perplexity" if self.metric == "nll" else "logit_diff"
        return pd.DataFrame({
            "patch": [p.label for p in self.patches],
            "component": [p.component for p in self.patches],
            "name": [PAPER_NAMES.get(p.component, p.component) for p in self.patches],
            "layers": [span(p.layers) for p in self.patches],
            "positions": [span(p.positions) if p.positions is not None else "all" for p in self.patches],
            "heads": [span(p.heads) if p.heads is not None else "all" for p in self.patches],
            unit: self.aggregate().numpy(),
            f"target_{unit}": self.target_value,
            f"source_{unit}": self.source_value,
            "recovery": self.recovery().numpy(),
        })

    def to_frame(self) -> pd.DataFrame:
        """Long table: ``patch``, ``example``, ``value``, ``target``, ``source``."""
        n_patches, n = self.values.shape
        return pd.DataFrame({
            "patch": [p.label for p in self.patches for _ in range(n)],
            "example": self.ids * n_patches,
            "value": self.values.double().flatten().numpy(),
            "target": self.target.double().repeat(n_patches).numpy(),
            "source": self.source.double().repeat(n_patches).numpy(),
        })

    def save(self, folder: str | Path, name: str = "patching") -> Path:
        """``{name}.csv`` (table), ``{name}_examples.csv`` (per example) and ``{name}.json`` (settings)."""
        own = (f"{name}.csv", f"{name}_examples.csv", f"{name}.json")
        with saving(folder, "patch-result", own=own) as out:  # INCOMPLETE until the last file is in
            write_csv(out / f"{name}.csv", self.table(), index=False)
            write_csv(out / f"{name}_examples.csv", self.to_frame(), index=False)
            write_json(out / f"{name}.json", {"metric": self.metric, "settings": self.settings,
                                               "target": self.target_value, "source": self.source_value})
        return out

