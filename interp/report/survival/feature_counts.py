"""The committed form of feature survival (registration ``survival-2.json``): per quantized instance and layer, the
per-latent totals over all held-out rows, and per registered bootstrap seed and row resample the number of judged
latents that survive under each definition the page shows.

The per (row, latent) sums (:class:`~interp.localize.sae_metrics.LatentRowStats`, up to 44 MB per instance and
layer) stay in the run's working folder; :meth:`SurvivalCounts.reduce` turns them into this form, which is exactly
what the registered intervals read: :func:`interp.stats.crossed_bootstrap` draws its resamples with
:func:`interp.stats.bootstrap_indices`, and :meth:`SurvivalCounts.counts_for` answers those resamples from the
committed counts (``tests/test_survival_features.py`` checks intervals from both forms are equal).

Example:
    >>> import numpy as np
    >>> from interp.report.survival.feature_counts import survive_counts
    >>> t = {"n": np.array([[4.0]]), "sum_a": np.array([[2.0]]), "sum_b": np.array([[2.0]]),
    ...      "sum_aa": np.array([[2.0]]), "sum_bb": np.array([[2.0]]), "sum_ab": np.array([[2.0]]),
    ...      "fire_a": np.array([[2.0]]), "fire_b": np.array([[2.0]])}
    >>> survive_counts(t, np.array([True])).tolist()  # one latent, identical in both models: survives every way
    [[1, 1, 1, 1, 1, 1]]
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from interp.display import ResultDisplay
from interp.errors import DataError
from interp.results import CheckedResult

__all__ = ["DEFINITIONS", "JUDGED_MIN_POSITIONS", "SUMS", "LatentReadings", "SurvivalCounts", "rho_and_ratio",
           "survive_counts", "survive_mask"]

#: survival-1 ``features.survival``: ``survives`` (the headline, first) and ``secondary`` (the other thresholds with
#: the rate condition, and the headline threshold alone): (name, rho threshold, rate condition 0.5 <= f'/f <= 2)
DEFINITIONS: tuple[tuple[str, float, bool], ...] = (
    ("rho >= 0.9, rate within 2x", 0.9, True), ("rho >= 0.5, rate within 2x", 0.5, True),
    ("rho >= 0.7, rate within 2x", 0.7, True), ("rho >= 0.8, rate within 2x", 0.8, True),
    ("rho >= 0.95, rate within 2x", 0.95, True), ("rho >= 0.9 alone", 0.9, False))
#: survival-1 ``features.survival.judged_latents``: latents firing at >= 20 held-out positions of the reference
JUDGED_MIN_POSITIONS = 20
#: the per (row, latent) sums of LatentRowStats that the totals keep
SUMS = ("sum_a", "sum_b", "sum_aa", "sum_bb", "sum_ab", "fire_a", "fire_b")


def rho_and_ratio(t: dict[str, np.ndarray], judged: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[boot, judged latents]`` twice, from totals ``t`` (``n`` ``[boot, 1]``, each sum ``[boot, d_sae]``): each
    ``judged`` latent's Pearson rho over positions (zeros included; NaN where either model never fires) and its
    firing-rate ratio f'/f (the quantized model's firing positions over the reference's)."""
    n = t["n"]
    a, b = t["sum_a"][:, judged], t["sum_b"][:, judged]
    cov = t["sum_ab"][:, judged] - a * b / n
    var_a = t["sum_aa"][:, judged] - a * a / n
    var_b = t["sum_bb"][:, judged] - b * b / n
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = np.where((var_a > 0) & (var_b > 0), cov / np.sqrt(var_a * var_b), np.nan)
        ratio = t["fire_b"][:, judged] / t["fire_a"][:, judged]
    return rho, ratio


def survive_mask(t: dict[str, np.ndarray], judged: np.ndarray) -> np.ndarray:
    """``[boot, definitions, judged latents]``: whether each ``judged`` latent survives, from totals ``t``
    (:func:`rho_and_ratio`; an undefined rho counts as not surviving), read under each of :data:`DEFINITIONS`."""
    rho, ratio = rho_and_ratio(t, judged)
    rho = np.nan_to_num(rho, nan=-1.0)
    rate_ok = (ratio >= 0.5) & (ratio <= 2.0)
    return np.stack([(rho >= r) & rate_ok if rate else rho >= r for _, r, rate in DEFINITIONS], axis=1)


def survive_counts(t: dict[str, np.ndarray], judged: np.ndarray) -> np.ndarray:
    """``[boot, definitions]`` numbers of ``judged`` latents that survive (:func:`survive_mask`)."""
    return survive_mask(t, judged).sum(axis=-1)


@dataclass(frozen=True)
class SurvivalCounts:
    """One quantized instance at one layer, as committed.

    Attributes:
        totals: ``n`` (positions) and each of :data:`SUMS` per latent ``[d_sae]`` over all held-out rows.
        counts: ``[seeds, n_boot, definitions]`` surviving judged latents in each registered row resample.
        seeds: the bootstrap seeds of ``counts``' first axis. n_rows: held-out rows. settings: what it came from.
        broken, repaired: a restored variant of the localization tie only (survival-3): the number of its
        instance's broken latents, and ``[seeds, n_boot]`` how many of them survive (headline definition) in the
        variant in each resample; ``-1`` and None otherwise.
    """

    totals: dict[str, np.ndarray]
    counts: np.ndarray
    seeds: tuple[int, ...]
    n_rows: int
    settings: dict[str, Any] = field(default_factory=dict)
    broken: int = -1
    repaired: np.ndarray | None = None

    @classmethod
    def reduce(cls, stats: Any, seeds: list[int], n_boot: int, broken: np.ndarray | None = None) -> SurvivalCounts:
        """From a :class:`~interp.localize.sae_metrics.LatentRowStats`: its totals, and the counts in each of the
        ``n_boot`` resamples :func:`interp.stats.bootstrap_indices` draws for each seed; with ``broken`` (``[d_sae]``
        bool, the instance's broken latents, for a restored variant), how many of them survive in each resample."""
        from interp.localize.sae_metrics import _weights
        from interp.stats import bootstrap_indices

        per_row = {}
        for name in SUMS:  # dense [rows, d_sae]: the resamples are then one BLAS product each
            dense = np.zeros((stats.n_rows, stats.d_sae))
            np.add.at(dense, (stats.row, stats.latent), getattr(stats, name).astype(np.float64))
            per_row[name] = dense
        positions = stats.positions.astype(np.float64)

        def totals(w: np.ndarray) -> dict[str, np.ndarray]:
            return {"n": (w @ positions)[:, None], **{name: w @ per_row[name] for name in SUMS}}

        everything = totals(np.ones((1, stats.n_rows)))
        judged = everything["fire_a"][0] >= JUDGED_MIN_POSITIONS
        if broken is not None and (broken.shape != judged.shape or (broken & ~judged).any()):
            raise DataError("the broken latents must be judged latents of the same SAE (the instance's and its "
                            "variant's reference is the same)")
        counts, repaired = [], []
        for s in seeds:
            mask = survive_mask(totals(_weights(bootstrap_indices(stats.n_rows, n_boot, s), stats.n_rows)), judged)
            counts.append(mask.sum(axis=-1))
            if broken is not None:
                repaired.append(mask[:, 0, broken[judged]].sum(axis=-1))
        return cls({"n": everything["n"][0], **{name: everything[name][0] for name in SUMS}},
                   np.stack(counts).astype(np.int32), tuple(int(s) for s in seeds), stats.n_rows,
                   dict(stats.settings), -1 if broken is None else int(broken.sum()),
                   None if broken is None else np.stack(repaired).astype(np.int32))

    def _all_rows(self) -> dict[str, np.ndarray]:
        """The totals over all held-out rows in the form of one resample (``n`` ``[1, 1]``, sums ``[1, d_sae]``)."""
        t = {name: value[None] for name, value in self.totals.items()}
        t["n"] = np.asarray(self.totals["n"]).reshape(1, 1)
        return t

    def _survives_all_rows(self) -> np.ndarray:
        """``[definitions, judged latents]`` survival on all held-out rows, from the totals."""
        return survive_mask(self._all_rows(), self.judged)[0]

    def readings(self) -> LatentReadings:
        """Each judged latent's reading on all held-out rows (:class:`LatentReadings`)."""
        import pandas as pd

        t = self._all_rows()
        judged = self.judged
        rho, ratio = rho_and_ratio(t, judged)
        n = float(t["n"][0, 0])
        return LatentReadings(pd.DataFrame({
            "latent": np.flatnonzero(judged), "rho": rho[0], "rate_ratio": ratio[0],
            "rate_reference": self.totals["fire_a"][judged] / n, "rate_quantized": self.totals["fire_b"][judged] / n,
            "survives": self._survives_all_rows()[0]}), dict(self.settings))

    def broken_latents(self) -> np.ndarray:
        """``[d_sae]`` the judged latents that do not survive (headline definition) on all held-out rows."""
        out = np.zeros(self.judged.shape, dtype=bool)
        out[self.judged] = ~self._survives_all_rows()[0]
        return out

    def repaired_for(self, rows: np.ndarray, broken: np.ndarray) -> np.ndarray:
        """``[boot]`` how many of ``broken`` (``[d_sae]``, the instance's broken latents, which this variant's counts
        were reduced with) survive in this variant (headline definition), in the resamples ``rows``."""
        if self.repaired is None or int(broken.sum()) != self.broken:
            raise DataError("these survival counts are not of a restored variant of this instance (no repaired "
                            f"counts, or {self.broken} broken latents where the instance has {int(broken.sum())})")
        return self._pick(rows, self.repaired, lambda: self._survives_all_rows()[0, broken[self.judged]].sum()[None])

    @property
    def judged(self) -> np.ndarray:
        """``[d_sae]`` the latents judged: those firing at >= 20 held-out positions of the reference."""
        return self.totals["fire_a"] >= JUDGED_MIN_POSITIONS

    def point(self) -> np.ndarray:
        """``[definitions]`` surviving judged latents on all held-out rows."""
        return survive_counts(self._all_rows(), self.judged)[0]

    def counts_for(self, rows: np.ndarray) -> np.ndarray:
        """``[boot, definitions]`` counts of the resamples ``rows`` (``[boot, n_rows]``): all rows once, or the
        resamples of one committed seed; any other rows are refused (the per-row sums are not committed)."""
        return self._pick(rows, self.counts, lambda: self.point()[None])

    def _pick(self, rows: np.ndarray, committed: np.ndarray, all_rows: Any) -> np.ndarray:
        from interp.stats import bootstrap_indices

        rows = np.asarray(rows)
        if rows.shape == (1, self.n_rows) and np.array_equal(rows[0], np.arange(self.n_rows)):
            return np.asarray(all_rows())
        for i, seed in enumerate(self.seeds):
            if rows.shape == (self.counts.shape[1], self.n_rows) and np.array_equal(
                    rows, bootstrap_indices(self.n_rows, self.counts.shape[1], seed)):
                return committed[i]
        raise DataError(f"the committed survival counts hold the resamples of bootstrap seeds {list(self.seeds)} "
                        f"({self.counts.shape[1]} each) only; other resamples need the per-row sums in the run's "
                        "working folder.")

    def save(self, path: str | os.PathLike[str]) -> Path:
        import torch

        from interp.io import write_safetensors

        # host: numpy arrays written to a file
        arrays = {f"totals.{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in self.totals.items()}
        arrays["counts"] = torch.from_numpy(np.ascontiguousarray(self.counts))  # host: written to a file
        if self.repaired is not None:
            arrays["repaired"] = torch.from_numpy(np.ascontiguousarray(self.repaired))  # host: written to a file
        meta = {"broken": str(self.broken), "seeds": json.dumps(list(self.seeds)), "n_rows": str(self.n_rows),
                "definitions": json.dumps([d[0] for d in DEFINITIONS]),
                "settings": json.dumps(self.settings, default=str)}
        write_safetensors(Path(path), arrays, meta)
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SurvivalCounts:
        from safetensors import safe_open

        from interp.io import read_safetensors
        from interp.reading import regular_file

        regular_file(path, "feature survival counts")
        tensors = read_safetensors(path, "feature survival counts")
        with safe_open(str(path), framework="pt") as fh:
            meta = dict(fh.metadata() or {})
        want = {"counts", "totals.n", *(f"totals.{k}" for k in SUMS)}
        definitions = json.loads(meta.get("definitions", "[]"))
        if set(tensors) - {"repaired"} != want or definitions != [d[0] for d in DEFINITIONS]:
            raise DataError(f"{path} is not feature survival counts of this code's definitions (it holds "
                            f"{sorted(tensors)}); reduce the run's per-row sums again.")
        counts = tensors["counts"].numpy()
        seeds = tuple(json.loads(meta["seeds"]))
        if counts.ndim != 3 or counts.shape[0] != len(seeds) or counts.shape[2] != len(DEFINITIONS):
            raise DataError(f"{path}: counts of shape {list(counts.shape)} do not match {len(seeds)} seeds and "
                            f"{len(DEFINITIONS)} definitions.")
        repaired = tensors["repaired"].numpy() if "repaired" in tensors else None
        if repaired is not None and repaired.shape != counts.shape[:2]:
            raise DataError(f"{path}: repaired counts of shape {list(repaired.shape)} do not match the counts'.")
        return cls({k.removeprefix("totals."): v.numpy() for k, v in tensors.items() if k.startswith("totals.")},
                   counts, seeds, int(meta["n_rows"]), json.loads(meta.get("settings", "{}")),
                   int(meta.get("broken", "-1")), repaired)


@dataclass(frozen=True)
class LatentReadings(CheckedResult, ResultDisplay):
    """One quantized model's judged latents at one layer, on all held-out rows.

    Attributes:
        table: one row per judged latent: ``latent``, ``rho`` and ``rate_ratio`` (:func:`rho_and_ratio`), the firing
            rates ``rate_reference`` and ``rate_quantized`` (shares of positions), and ``survives`` (the headline
            definition, the first of :data:`DEFINITIONS`).
        settings: what the committed counts were computed from.

    Made only finite: see :mod:`interp.results`.
    """

    # rho is undefined (NaN) where the quantized model never fires on the held-out rows (no variance); the registered
    # definitions count such a latent as not surviving
    allow_nan = ("table[rho]",)

    table: Any
    settings: dict[str, Any] = field(default_factory=dict)

    def to_frame(self) -> Any:
        return self.table.copy()
