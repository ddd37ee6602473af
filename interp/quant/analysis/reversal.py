"""Reversal and amplification: ``||r||`` against ``||h|| = ||RMSNorm2(r)||`` for D_large vs D_ctrl.

Per layer: the two norms by set, the MSE between reference and quantized MLP outputs (each
model on its own input) and its correlation with ``||h||``, the kurtosis of ``r``, and the
top outlier dimensions of ``r`` against their norm gamma. The identity
``||h||^2 = d * sum_i (r_i^2 / sum_j r_j^2) gamma_i^2`` (eps aside) explains the link:
``||h||`` depends on how ``r``'s energy spreads over dimensions, not on its scale, so
examples whose energy sits in the low-gamma outlier dims get a small ``||h||``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from interp import stats
from interp.data import Examples
from interp.display import ResultDisplay
from interp.io import sanitize
from interp.models import Model
from interp.probes import REDUCERS
from interp.results import CheckedResult
from interp.runtime import hooks as hk
from interp.runtime import placement
from interp.runtime.batching import batches, show_progress
from interp.runtime.swap import WeightStash, is_block_weights, swapped
from interp.validate import checked


class _Stop(Exception):
    pass


@dataclass(frozen=True)
class ReversalResult(CheckedResult, ResultDisplay):
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

    Made only finite: see :mod:`interp.results`.
    """

    # corr(||h||, MSE) is NaN where it is undefined (an MSE of 0 at every example: a layer a spec leaves alone)
    allow_nan = ("mse[corr_*]",)

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
        return sanitize({"settings": self.settings, "summary": self.headline(),
                         "by_layer": self.by_layer.to_dict(orient="records"),
                         "mse": self.mse.to_dict(orient="records"),
                         "outliers": self.outliers.to_dict(orient="records")})

def _capture_pass(model: Model, tokens: torch.Tensor, layers: list[int], components: Sequence[str]
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


def _reversal_batch(reference: Model, quantized: Mapping[str, Any], tokens: torch.Tensor,
                    layers: list[int], stash: WeightStash | None) -> tuple[dict[str, np.ndarray], np.ndarray]:
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
        if is_block_weights(qmodel):  # one copy: the quantized weights in the reference for this pass
            with swapped(reference, qmodel, stash=stash):
                q = _capture_pass(reference, tokens, layers, ("down",))
        else:
            q = _capture_pass(qmodel, tokens, layers, ("down",))
        for layer in layers:
            diff = (q["down", layer] - ref["down", layer])[:, 1:]  # BOS excluded
            out[f"mse[{spec}]"].append(diff.pow(2).mean(dim=(1, 2)).double().numpy())
    return {k: np.stack(v) for k, v in out.items()}, np.stack(abs_dims)


@checked
def reversal(
    reference: Model,
    quantized_models: Mapping[str, Any],
    d_large: Examples,
    d_ctrl: Examples,
    layers: Sequence[int] | None = None,
    batch_size: int = 8,
    n_boot: int = 1000,
    seed: int = 0,
    n_outliers: int = 5,
    progress: bool | None = None,
    stash: WeightStash | None = None,
) -> ReversalResult:
    """Residual vs MLP-input norms, MLP output error, kurtosis and outlier dims, D_large vs D_ctrl.

    Args:
        reference: the full-precision model.
        quantized_models: spec -> quantized model (each run on its own activations), or its block
            weights alone (:class:`~interp.quant.inplace.SavedWeights`): then they are swapped into
            ``reference`` for that model's pass of each batch, and no second copy is held.
        d_large, d_ctrl: the two example sets (see :func:`~interp.quant.analysis.split.split_large_ctrl`).
        layers: layers to measure (default all).
        n_outliers: outlier dimensions reported per layer.
        stash: with block weights, the :class:`~interp.runtime.swap.WeightStash` that keeps the
            reference's own weights meanwhile (shared by every batch; default: one of its own).

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
    layer_list = hk.check_layers(reference, layers)
    sets = {"large": d_large, "ctrl": d_ctrl}
    per_set: dict[str, dict[str, np.ndarray]] = {}
    abs_sum = np.zeros((len(layer_list), int(reference.cfg.d_model)))
    total = sum(math.ceil(len(ex) / batch_size) for ex in sets.values())
    bar = tqdm(total=total, desc="reversal", unit="batch", disable=not show_progress(progress))
    with contextlib.ExitStack() as scope:
        in_place = any(is_block_weights(q) for q in quantized_models.values())
        kept = stash if stash is not None or not in_place else scope.enter_context(WeightStash(reference))
        for name, ex in sets.items():
            chunks = []
            for start, end in batches(len(ex), batch_size):
                values, abs_dims = _reversal_batch(reference, quantized_models, ex.tokens[start:end], layer_list, kept)
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


def _outlier_table(reference: Model, layers: list[int], mean_abs: np.ndarray, n_outliers: int) -> pd.DataFrame:
    rows = []
    for li, layer in enumerate(layers):
        with placement.onloaded(reference, [layer]):  # a block offloaded by a device map: its weights, not meta
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
