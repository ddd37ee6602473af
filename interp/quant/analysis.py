"""Analyses of per-example quantization error (arXiv 2506.12044, sections 1-4 of the spec).

Each analysis is a function that returns a frozen result with ``to_frame()`` (a table),
``to_dict()`` (JSON-safe numbers) and ``figure()`` (a plotly figure, drawn by
:mod:`interp.quant_figures`).

1. :func:`agreement`: do different quantizers break the same inputs? Pearson and Spearman
   matrices of the per-example error vectors, with bootstrap intervals, and the Jaccard
   overlap of their top-10% sets against the overlap two random sets would have.
2. :func:`split_large_ctrl`: D_large (top 10% by error, near-duplicates removed by 5-gram
   Jaccard on token ids) and D_ctrl (as many, sampled from the bottom half, seeded).
3. :func:`norm_error_correlation`: per layer, the Pearson correlation across examples
   between the mean residual norm (``resid_mid``, and ``resid_post``; BOS excluded) of the
   *reference* model and the error.
4. :func:`reversal`: per layer, ``||r||`` against ``||h|| = ||RMSNorm2(r)||`` for D_large vs
   D_ctrl; the MSE between reference and quantized MLP outputs (each model on its own
   input) and its correlation with ``||h||``; the kurtosis of ``r``; and the top outlier
   dimensions of ``r`` against their norm gamma. The identity
   ``||h||^2 = d * sum_i (r_i^2 / sum_j r_j^2) gamma_i^2`` (eps aside) explains the link:
   ``||h||`` depends on how ``r``'s energy spreads over dimensions, not on its scale, so
   examples whose energy sits in the low-gamma outlier dims get a small ``||h||``.

:func:`run_all` runs all four on a folder written by ``interp score`` (used by
``interp errors``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from interp import hooks as hk
from interp import stats
from interp.data import Examples
from interp.display import ResultDisplay
from interp.errors import InterpError
from interp.probes import REDUCERS, batches, probe, show_progress

ErrorsLike = pd.Series | pd.DataFrame


def _series(errors: Any, ids: Sequence[str] | None = None) -> pd.Series:
    """One error per example: a Series as is, a DataFrame's mean over specs, or an array labelled by ``ids``."""
    if isinstance(errors, pd.DataFrame):
        return errors.mean(axis=1).rename("mean")
    if isinstance(errors, pd.Series):
        return errors
    values = np.asarray(errors.detach().cpu() if hasattr(errors, "detach") else errors, dtype=np.float64)
    if ids is None or len(ids) != values.size:
        raise InterpError("Per-example errors given as an array need the example ids (same length).")
    return pd.Series(values, index=list(ids), name="error")


def _ci(c: stats.Correlation) -> dict[str, Any]:
    return {"r": c.r, "low": c.low, "high": c.high, "n": c.n}


# ---------------------------------------------------------------------------------------
# 1. Cross-method agreement


@dataclass(frozen=True)
class AgreementResult(ResultDisplay):
    """Agreement of per-example errors across quantized versions of one model.

    Attributes:
        pearson, spearman: correlation matrices with bootstrap bounds.
        jaccard: ``[k, k]`` Jaccard overlap of the top-``top`` error sets.
        chance_jaccard: expected overlap of two random top sets of the same size.
        chance_method: how ``chance_jaccard`` was computed.
        n: examples used (those with every spec scored).
        settings: top fraction, bootstrap settings.
    """

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
        from interp.io import sanitize

        return sanitize({
            "n": self.n, "specs": self.specs, "settings": self.settings,
            "mean_pearson": self.mean_off_diagonal("pearson"),
            "mean_spearman": self.mean_off_diagonal("spearman"),
            "mean_jaccard_top": self.mean_off_diagonal("jaccard")["mean"],
            "chance_jaccard": self.chance_jaccard, "chance_method": self.chance_method,
            "pairs": self.to_frame().to_dict(orient="records"),
        })

    def figure(self) -> Any:
        from interp import quant_figures

        return quant_figures.agreement_heatmaps(self)


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


# ---------------------------------------------------------------------------------------
# 2. D_large / D_ctrl


@dataclass(frozen=True)
class SplitResult(ResultDisplay):
    """D_large (highest-error examples, deduplicated) and D_ctrl (low-error controls).

    Attributes:
        large, ctrl: the two subsets as Examples.
        errors: the error used to rank, for every example considered.
        dropped_ids: top examples removed as near-duplicates of a kept one.
        settings: top, dedup threshold, n-gram size, control pool, seed, counts.
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
        from interp.io import sanitize

        return sanitize({
            "settings": self.settings, "large_ids": self.large_ids, "ctrl_ids": self.ctrl_ids,
            "dropped_ids": self.dropped_ids,
            "mean_error_large": float(self.errors[self.large_ids].mean()),
            "mean_error_ctrl": float(self.errors[self.ctrl_ids].mean()),
            "mean_error_all": float(self.errors.mean()),
        })

    def figure(self) -> Any:
        from interp import quant_figures

        return quant_figures.split_histogram(self)


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
    series = _series(errors)
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


# ---------------------------------------------------------------------------------------
# 3. Residual norm against error


@dataclass(frozen=True)
class NormCorrelationResult(ResultDisplay):
    """Per-layer Pearson correlation between the reference's residual norm and the error.

    Attributes:
        table: columns component, layer, r, low, high, p, n, mean_norm.
        settings: components, bootstrap settings, examples' settings.
    """

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
        from interp.io import sanitize

        return sanitize({"settings": self.settings, "last_layer": self.last_layer(),
                         "rows": self.table.to_dict(orient="records")})

    def figure(self) -> Any:
        from interp import quant_figures

        return quant_figures.norm_correlation_lines(self)


def norm_error_correlation(
    reference: Any,
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
    series = _series(errors).reindex(examples.ids)
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


# ---------------------------------------------------------------------------------------
# 4. Reversal and amplification


class _Stop(Exception):
    pass


@dataclass(frozen=True)
class ReversalResult(ResultDisplay):
    """Residual and MLP-input norms, MLP output error and outlier dimensions, per layer.

    Attributes:
        by_layer: one row per layer: ``r_norm_{large,ctrl}``, ``h_norm_{large,ctrl}``,
            ``kurtosis_{large,ctrl}`` (means over the set's examples).
        mse: one row per (spec, layer): ``mse_large``, ``mse_ctrl`` (mean per-example MSE of
            the MLP output, quantized vs reference) and the Pearson correlation across all
            examples of D_large and D_ctrl between the reference ``||h||`` and that MSE
            (``corr_h_mse`` with ``corr_low``/``corr_high``).
        outliers: one row per (layer, rank): the dimensions of largest mean ``|r|`` over
            both sets, with ``|gamma|`` and its percentile among all dimensions.
        per_example: long table (set, example, layer, r_norm, h_norm, kurtosis, and
            ``mse[spec]`` columns) for further analysis.
        settings: layers, specs, counts.
    """

    by_layer: pd.DataFrame
    mse: pd.DataFrame
    outliers: pd.DataFrame
    per_example: pd.DataFrame
    settings: dict[str, Any] = field(default_factory=dict)

    def to_frame(self) -> pd.DataFrame:
        """``by_layer`` joined with the MSE table in wide form (``mse_large[spec]``, ``corr_h_mse[spec]``...)."""
        wide = self.mse.pivot(index="layer", columns="spec")
        wide.columns = [f"{name}[{spec}]" for name, spec in wide.columns]
        return self.by_layer.set_index("layer").join(wide).reset_index()

    def summary(self) -> pd.DataFrame:
        """The headline numbers as a table, one row per spec (see :meth:`headline`)."""
        head = self.headline()
        shared = {k: v for k, v in head.items() if not isinstance(v, dict)}
        rows = [{"spec": spec, **shared, "corr_h_mse_upper_above_0.6": count,
                 "corr_h_mse_upper_mean": head["corr_h_mse_upper_mean"][spec]}
                for spec, count in head["corr_h_mse_upper_above_0.6"].items()]
        return pd.DataFrame(rows)

    def headline(self) -> dict[str, Any]:
        """Headline numbers: where D_large has smaller ||r|| / ||h|| / kurtosis, how many upper
        layers have corr(||h||, MSE) > 0.6, and whether the outliers get small gammas."""
        b = self.by_layer
        n = len(b)
        upper = b["layer"] >= b["layer"].min() + n // 2
        out: dict[str, Any] = {
            "layers": n,
            "r_norm_large_below_ctrl": int((b["r_norm_large"] < b["r_norm_ctrl"]).sum()),
            "h_norm_large_below_ctrl": int((b["h_norm_large"] < b["h_norm_ctrl"]).sum()),
            "h_norm_large_above_ctrl": int((b["h_norm_large"] > b["h_norm_ctrl"]).sum()),
            "kurtosis_large_below_ctrl": int((b["kurtosis_large"] < b["kurtosis_ctrl"]).sum()),
            "corr_h_mse_upper_above_0.6": {}, "corr_h_mse_upper_mean": {},
            "outlier_gamma_percentile_mean": float(self.outliers["gamma_percentile"].mean()),
            "last_layer": b.iloc[-1].to_dict(),
        }
        upper_layers = set(b.loc[upper, "layer"])
        for spec, rows in self.mse.groupby("spec"):
            top = rows[rows["layer"].isin(upper_layers)]
            out["corr_h_mse_upper_above_0.6"][spec] = f"{int((top['corr_h_mse'] > 0.6).sum())}/{len(top)}"
            out["corr_h_mse_upper_mean"][spec] = float(top["corr_h_mse"].mean())
        return out

    def to_dict(self) -> dict[str, Any]:
        from interp.io import sanitize

        return sanitize({"settings": self.settings, "summary": self.headline(),
                         "by_layer": self.by_layer.to_dict(orient="records"),
                         "mse": self.mse.to_dict(orient="records"),
                         "outliers": self.outliers.to_dict(orient="records")})

    def figure(self, kind: str = "norms") -> Any:
        """``kind``: ``"norms"`` (||r||, ||h|| by set), ``"mse_corr"``, ``"kurtosis"`` or ``"outliers"``."""
        from interp import quant_figures

        builders = {"norms": quant_figures.reversal_norms, "mse_corr": quant_figures.reversal_mse_corr,
                    "kurtosis": quant_figures.reversal_kurtosis, "outliers": quant_figures.reversal_outliers}
        if kind not in builders:
            raise InterpError(f"Unknown reversal figure {kind!r}; choose one of {', '.join(builders)}.")
        return builders[kind](self)


def _capture_pass(model: Any, tokens: torch.Tensor, layers: list[int], components: Sequence[str]
                  ) -> dict[tuple[str, int], torch.Tensor]:
    """One forward of ``model`` on ``tokens``, keeping ``components`` at ``layers`` (stops after the last)."""
    # Hook points can carry an alias name (resid_post fires as blocks.{l}.hook_out), so each
    # hook knows its key through its closure, not through hook.name.
    kept: dict[tuple[str, int], torch.Tensor] = {}
    last = (components[-1], layers[-1])

    def keeper(key: tuple[str, int]) -> Any:
        def keep(x: torch.Tensor, hook: Any) -> None:
            kept[key] = x.detach().float()
            if key == last:
                raise _Stop

        return keep

    fwd_hooks = [(hk.hook_point(model, c, layer), keeper((c, layer))) for layer in layers for c in components]
    device = next(model.original_model.parameters()).device
    with torch.no_grad(), model.hooks(fwd_hooks=fwd_hooks):
        try:
            model.original_model(input_ids=tokens.to(device), use_cache=False)
        except _Stop:
            pass
    return kept


def _reversal_batch(reference: Any, quantized: Mapping[str, Any], tokens: torch.Tensor,
                    layers: list[int]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per-example stats ``[layers, B]`` for one batch, and the mean |r| per dim ``[layers, B, D]``."""
    ref = _capture_pass(reference, tokens, layers, ("resid_mid", "h", "down"))
    out: dict[str, list[np.ndarray]] = {"r_norm": [], "h_norm": [], "kurtosis": []}
    out.update({f"mse[{spec}]": [] for spec in quantized})
    abs_dims = []
    for layer in layers:
        r, h = ref["resid_mid", layer], ref["h", layer]
        out["r_norm"].append(REDUCERS["norm"](r).numpy())
        out["h_norm"].append(REDUCERS["norm"](h).numpy())
        out["kurtosis"].append(REDUCERS["kurtosis"](r).numpy())
        abs_dims.append(REDUCERS["abs_mean_dims"](r).numpy())
    for spec, qmodel in quantized.items():
        q = _capture_pass(qmodel, tokens, layers, ("down",))
        for layer in layers:
            diff = (q["down", layer] - ref["down", layer])[:, 1:]  # BOS excluded
            out[f"mse[{spec}]"].append(diff.pow(2).mean(dim=(1, 2)).double().numpy())
    return {k: np.stack(v) for k, v in out.items()}, np.stack(abs_dims)


def reversal(
    reference: Any,
    quantized_models: Mapping[str, Any],
    d_large: Examples,
    d_ctrl: Examples,
    layers: Sequence[int] | None = None,
    batch_size: int = 8,
    n_boot: int = 1000,
    seed: int = 0,
    n_outliers: int = 5,
    progress: bool | None = None,
) -> ReversalResult:
    """Residual vs MLP-input norms, MLP output error, kurtosis and outlier dims, D_large vs D_ctrl.

    Args:
        reference: the full-precision model.
        quantized_models: spec -> quantized model (each run on its own activations).
        d_large, d_ctrl: the two example sets (see :func:`split_large_ctrl`).
        layers: layers to measure (default all).
        n_outliers: outlier dimensions reported per layer.

    Example:
        >>> import numpy as np, pandas as pd, torch
        >>> import interp
        >>> from interp.quant import quantize, reversal, split_large_ctrl
        >>> model = interp.tiny_model("llama")
        >>> rows = torch.randint(0, 256, (20, 16), generator=torch.Generator().manual_seed(0))
        >>> ex = interp.Examples.from_tokens(rows)
        >>> split = split_large_ctrl(pd.Series(np.linspace(0, 1, 20), index=ex.ids), ex, top=0.2)
        >>> q = quantize(model, "rtn:bits=3,group=32", progress=False)
        >>> res = reversal(model, {"rtn3": q}, split.large, split.ctrl, n_boot=20, n_outliers=2, progress=False)
        >>> res.by_layer["layer"].tolist(), res.mse["spec"].unique().tolist()
        ([0, 1], ['rtn3'])
    """
    from tqdm.auto import tqdm

    layer_list = hk.check_layers(reference, layers)
    sets = {"large": d_large, "ctrl": d_ctrl}
    per_set: dict[str, dict[str, np.ndarray]] = {}
    abs_sum = np.zeros((len(layer_list), int(reference.cfg.d_model)))
    total = sum(math.ceil(len(ex) / batch_size) for ex in sets.values())
    bar = tqdm(total=total, desc="reversal", unit="batch", disable=not show_progress(progress))
    for name, ex in sets.items():
        chunks = []
        for start, end in batches(len(ex), batch_size):
            values, abs_dims = _reversal_batch(reference, quantized_models, ex.tokens[start:end], layer_list)
            chunks.append(values)
            abs_sum += abs_dims.sum(axis=1)
            bar.update(1)
        per_set[name] = {k: np.concatenate([c[k] for c in chunks], axis=1) for k in chunks[0]}
    bar.close()
    n_total = len(d_large) + len(d_ctrl)
    by_layer = pd.DataFrame({"layer": layer_list})
    for stat in ("r_norm", "h_norm", "kurtosis"):
        for name in sets:
            by_layer[f"{stat}_{name}"] = per_set[name][stat].mean(axis=1)
    mse_rows = []
    for spec in quantized_models:
        key = f"mse[{spec}]"
        both_mse = np.concatenate([per_set["large"][key], per_set["ctrl"][key]], axis=1)
        both_h = np.concatenate([per_set["large"]["h_norm"], per_set["ctrl"]["h_norm"]], axis=1)
        for li, layer in enumerate(layer_list):
            c = stats.pearson(both_h[li], both_mse[li], n_boot=n_boot, seed=seed)
            mse_rows.append({"spec": spec, "layer": layer, "mse_large": per_set["large"][key][li].mean(),
                             "mse_ctrl": per_set["ctrl"][key][li].mean(), "corr_h_mse": c.r,
                             "corr_low": c.low, "corr_high": c.high})
    outliers = _outlier_table(reference, layer_list, abs_sum / n_total, n_outliers)
    per_example = _per_example_table(per_set, sets, layer_list)
    settings = {"layers": layer_list, "specs": list(quantized_models), "n_large": len(d_large),
                "n_ctrl": len(d_ctrl), "n_boot": n_boot, "seed": seed, "exclude_bos": True,
                "mse": "mean over positions (BOS excluded) and d_model of (mlp_out_quant - mlp_out_ref)^2"}
    return ReversalResult(by_layer=by_layer, mse=pd.DataFrame(mse_rows), outliers=outliers,
                          per_example=per_example, settings=settings)


def _outlier_table(reference: Any, layers: list[int], mean_abs: np.ndarray, n_outliers: int) -> pd.DataFrame:
    rows = []
    for li, layer in enumerate(layers):
        gamma = hk.norm2_gamma(reference, layer).abs().double().cpu().numpy()
        top = np.argsort(-mean_abs[li], kind="stable")[:n_outliers]
        for rank, dim in enumerate(top):
            rows.append({"layer": layer, "rank": rank + 1, "dim": int(dim), "mean_abs_r": float(mean_abs[li, dim]),
                         "gamma_abs": float(gamma[dim]),
                         # share of dimensions whose |gamma| is strictly smaller
                         "gamma_percentile": float((gamma < gamma[dim]).mean()),
                         "gamma_abs_median": float(np.median(gamma))})
    return pd.DataFrame(rows)


def _per_example_table(per_set: dict[str, dict[str, np.ndarray]], sets: Mapping[str, Examples],
                       layers: list[int]) -> pd.DataFrame:
    frames = []
    for name, ex in sets.items():
        n = len(ex)
        frame = pd.DataFrame({"set": name, "example": np.tile(np.asarray(ex.ids, dtype=object), len(layers)),
                              "layer": np.repeat(layers, n)})
        for key, values in per_set[name].items():
            frame[key] = values.reshape(-1)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


# ---------------------------------------------------------------------------------------
# Everything, for a `score` folder


def run_all(
    errors: pd.DataFrame,
    settings: Mapping[str, Any],
    folder: str | os.PathLike[str],
    n_boot: int = 1000,
    seed: int = 0,
    target: str = "mean",
    batch_size: int = 8,
    run_models: bool = True,
    reversal_specs: Sequence[str] | None = None,
    progress: bool | None = None,
    export_png: bool | None = None,
    score_folder: str | os.PathLike[str] | None = None,
) -> list[Path]:
    """Run the four analyses on a ``score`` folder's errors; write CSV/JSON tables and figures.

    Args:
        errors: the folder's per-example errors (index example id, one column per spec).
        settings: the folder's ``settings.json`` (model, examples, calibration, specs).
        folder: where tables and figures go.
        target: ``"mean"`` (mean error over specs) or a spec: the error that picks
            D_large/D_ctrl and is correlated with the norms.
        run_models: also run the analyses that need the model (norms, reversal).
        reversal_specs: specs whose quantized models enter :func:`reversal` (default all).
        export_png: write PNGs (default: when ``BROWSER_PATH`` names an existing browser).
        score_folder: the ``score`` folder whose ``quantized/`` cache holds the models
            (default: the parent of ``folder``).
    """
    from interp.io import write_json

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    figures: dict[str, Any] = {}

    def save(name: str, result: Any) -> None:
        result.to_frame().to_csv(out / f"{name}.csv", index=name == "split")
        write_json(out / f"{name}.json", result.to_dict())
        written.extend([out / f"{name}.csv", out / f"{name}.json"])

    agree = agreement(errors, n_boot=n_boot, seed=seed)
    save("agreement", agree)
    figures["agreement"] = agree.figure()
    target_errors = errors.mean(axis=1).rename("mean") if target == "mean" else errors[_match_spec(target, errors)]
    if run_models:
        import interp

        model = interp.load_model(settings["model"])
        ex_settings = settings["examples"]
        examples = interp.load_examples(ex_settings["source"], model.tokenizer, n=ex_settings["n"],
                                        seq_len=ex_settings["seq_len"], seed=ex_settings["seed"],
                                        split=ex_settings["split"])
        split = split_large_ctrl(target_errors, examples, seed=seed)
        save("split", split)
        figures["split"] = split.figure()
        measured = probe(model, examples, ["resid_mid", "resid_post"], ["norm"], batch_size=batch_size,
                         exclude_bos=True, progress=progress)
        norms = norm_error_correlation(model, examples, target_errors, n_boot=n_boot, seed=seed,
                                       probe_result=measured)
        save("norm_correlation", norms)
        figures["norm_correlation"] = norms.figure()
        # the same norms against each spec's own error (the paper correlates per quantized model)
        per_spec = [norm_error_correlation(model, examples, errors[spec], n_boot=n_boot, seed=seed,
                                           probe_result=measured).table.assign(spec=spec) for spec in errors.columns]
        pd.concat(per_spec, ignore_index=True).to_csv(out / "norm_correlation_by_spec.csv", index=False)
        written.append(out / "norm_correlation_by_spec.csv")
        specs = list(errors.columns) if reversal_specs is None else [_match_spec(s, errors) for s in reversal_specs]
        if specs:
            source = Path(score_folder) if score_folder else out.parent
            rev = _reversal_for_folder(model, settings, source, specs, split, batch_size, n_boot, seed, progress)
            save("reversal", rev)
            rev.outliers.to_csv(out / "reversal_outliers.csv", index=False)
            rev.per_example.to_parquet(out / "reversal_per_example.parquet", index=False)
            written.extend([out / "reversal_outliers.csv", out / "reversal_per_example.parquet"])
            for kind in ("norms", "mse_corr", "kurtosis", "outliers"):
                figures[f"reversal_{kind}"] = rev.figure(kind)
    for name, fig in figures.items():
        # plotly.min.js is written once beside the pages: offline, and not copied into each file
        fig.write_html(out / f"{name}.html", include_plotlyjs="directory", full_html=True)
        written.append(out / f"{name}.html")
    if export_png is None:
        browser = os.environ.get("BROWSER_PATH", "")
        export_png = bool(browser) and Path(browser).exists()
    if export_png:
        from interp.figures import export_static

        written.extend(export_static(figures, out, formats=("png",)))
    return written


def _match_spec(text: str, errors: pd.DataFrame) -> str:
    from interp.quant.spec import parse_spec

    name = str(parse_spec(text))
    if name not in errors.columns:
        raise InterpError(f"Spec {name} is not in this store; scored specs: {', '.join(errors.columns)}.")
    return name


def _reversal_for_folder(model: Any, settings: Mapping[str, Any], folder: Path, specs: Sequence[str],
                         split: SplitResult, batch_size: int, n_boot: int, seed: int,
                         progress: bool | None) -> ReversalResult:
    """Reversal with the quantized models of a ``score`` folder (loaded from its cache)."""
    import interp
    from interp.quant.apply import quantize_cached
    from interp.quant.spec import parse_spec

    calibration = None
    cal = settings.get("calibration")
    if cal and any(parse_spec(s).needs_calibration for s in specs):
        calibration = interp.load_examples(cal["source"], model.tokenizer, n=cal["n"], seq_len=cal["seq_len"],
                                           seed=cal["seed"], split="calibration")
    quantized = {s: quantize_cached(model, s, calibration if parse_spec(s).needs_calibration else None,
                                    cache_dir=folder / "quantized", progress=progress) for s in specs}
    return reversal(model, quantized, split.large, split.ctrl, batch_size=batch_size, n_boot=n_boot, seed=seed,
                    progress=progress)


def load_json(path: str | os.PathLike[str]) -> Any:
    return json.loads(Path(path).read_text())
