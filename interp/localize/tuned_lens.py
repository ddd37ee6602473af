"""A tuned lens: one affine translator per layer, so early layers can be read at all.

The logit lens decodes a layer's residual ``r_l`` with the model's own head,
``unembed(final_norm(r_l))``. In early layers that is often worse than a uniform guess
(NLL above ``log |V|``): the residual is not yet in the basis the head reads, so a
difference between two models there says nothing. The tuned lens (Belrose et al., 2023,
arXiv 2303.08112) learns an affine map per layer that carries ``r_l`` into that basis.

This implementation fits each translator in closed form rather than by gradient descent
on the KL to the final layer:

    A_l, b_l = argmin  sum_t || N(r_L,t) - (A_l r_l,t + b_l) ||^2  +  lam ||A_l||^2

where ``N(r_L)`` is the final normalised hidden state (the head's input, gamma included)
and ``r_l`` is the block output of layer ``l``. ``lam`` is a tiny stabiliser (1e-4 of the
mean diagonal of the input Gram matrix). The prediction ``A_l r_l + b_l`` is decoded
with the head directly. It is a
linear least-squares translator to the head's input: cheap (one ``d x d`` solve per
layer, seconds on a CPU), deterministic, and with no vocabulary-sized cost while fitting.
Fitted on the calibration split (disjoint from the evaluation examples), with BOS
positions excluded, and cached as safetensors.

The quantized model is read with the *reference's* translators, the usual convention: the
lens belongs to the model being explained, and the question is where the quantized
model's computation departs from it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from interp.data import Examples, aligned_rows, counted_positions
from interp.errors import InterpError
from interp.io import read_safetensors, write_file
from interp.localize.lens import EarlyExitResult
from interp.models import Model, model_hash, model_name
from interp.runtime import hooks as hk
from interp.runtime.batching import batches, check_context, show_progress
from interp.runtime.capture import capture as capture_residuals
from interp.runtime.readout import Readout

RIDGE = 1e-4  # lam relative to mean diagonal of the input Gram matrix: a tiny stabiliser only


@dataclass(frozen=True)
class TunedLens:
    """Per-layer affine translators ``r_l -> A_l r_l + b_l`` into the head's input space.

    Attributes:
        weight: ``[n_layers, d_model, d_model]`` (float32; ``y = r @ weight[l] + bias[l]``).
        bias: ``[n_layers, d_model]``.
        layers: the model layers of the first axis.
        settings: what it was fitted on (model hash, examples, ridge, fit R^2 per layer).
    """

    weight: torch.Tensor
    bias: torch.Tensor
    layers: list[int]
    settings: dict[str, Any] = field(default_factory=dict)

    def translate(self, index: int, resid: torch.Tensor) -> torch.Tensor:
        return resid @ self.weight[index].to(resid.dtype) + self.bias[index].to(resid.dtype)

    def save(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        tensors = {"weight": self.weight.contiguous(), "bias": self.bias.contiguous()}
        metadata = {"layers": json.dumps(self.layers), "settings": json.dumps(self.settings)}
        write_file(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TunedLens:
        tensors = read_safetensors(path, "tuned lens")  # a truncated cache gets interp's error, not safetensors'
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata()
        return cls(tensors["weight"], tensors["bias"], json.loads(meta["layers"]), json.loads(meta["settings"]))


def capture_layers(model: Model, tokens: torch.Tensor, layers: Sequence[int]
                   ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Block outputs of ``layers`` and the final normalised hidden state (the head's input), for one batch.

    One forward through the runtime's capture (any family's decoder body), then the
    model's own final norm on its last residual.
    """
    with torch.no_grad():
        saved, final = capture_residuals(model, tokens, [("resid_post", layer) for layer in layers])
        normed = hk.final_norm(model)(final)
    return [saved[("resid_post", layer)] for layer in layers], normed.detach()


def fit_tuned_lens(model: Model, examples: Examples, batch_size: int = 8, ridge: float = RIDGE,
                   progress: bool | None = None) -> TunedLens:
    """Fit one affine translator per layer by ridge-stabilised least squares (float64 normal equations).

    Args:
        model: the reference bridge.
        examples: calibration token rows (BOS positions are excluded from the fit; padded
            rows are left-aligned and only their real positions enter it).
        ridge: the ridge weight relative to the mean diagonal of each layer's Gram matrix.
    """
    layers = hk.check_layers(model, None)
    check_context(model, examples.tokens)
    d = int(model.cfg.d_model)
    gram = torch.zeros(len(layers), d + 1, d + 1, dtype=torch.float64)
    cross = torch.zeros(len(layers), d + 1, d, dtype=torch.float64)
    target_sq = torch.zeros((), dtype=torch.float64)
    target_sum = torch.zeros(d, dtype=torch.float64)
    rows = 0
    device = next(model.original_model.parameters()).device
    bar = tqdm(total=len(examples), desc="tuned lens", unit="ex", disable=not show_progress(progress))
    for start, end in batches(len(examples), batch_size):
        tokens, lengths = aligned_rows(examples, start, end, device)
        resids, final = capture_layers(model, tokens, layers)
        if lengths is None:
            keep = torch.ones(final.shape[:2], dtype=torch.bool, device=final.device)
            keep[:, 0] = False
        else:  # real positions only, BOS out
            keep = counted_positions(lengths, tokens.shape[1], skip_first=True)
            keep[:, 0] = False
        y = final[keep].double().cpu()
        target_sq += (y * y).sum()
        target_sum += y.sum(0)
        rows += y.shape[0]
        for i, r in enumerate(resids):
            x = torch.cat([r[keep].double().cpu(), torch.ones(y.shape[0], 1, dtype=torch.float64)],
                          dim=1)
            gram[i] += x.T @ x
            cross[i] += x.T @ y
        bar.update(end - start)
    bar.close()
    if rows <= d + 1:
        raise InterpError(f"The tuned lens needs more than {d + 1} calibration tokens; got {rows}. "
                          "Use more calibration examples.")
    weights, biases, r2 = [], [], []
    total_ss = float(target_sq - (target_sum * target_sum).sum() / rows)
    for i in range(len(layers)):
        lam = ridge * float(torch.diagonal(gram[i])[:d].mean())
        reg = gram[i].clone()
        reg.diagonal()[:d] += lam  # the bias is not penalised
        solution = torch.linalg.solve(reg, cross[i])  # [d + 1, d]
        weights.append(solution[:d].float())
        biases.append(solution[d].float())
        # residual sum of squares from the normal equations: ||y||^2 - 2 w.Xy + w.XX w
        rss = float(target_sq - 2 * (solution * cross[i]).sum() + (solution * (gram[i] @ solution)).sum())
        r2.append(1 - rss / total_ss if total_ss > 0 else float("nan"))
    settings = {"fit": "ridge least squares to the final normalised hidden state", "ridge": ridge,
                "tokens": rows, "r2_by_layer": r2, "examples": dict(examples.settings),
                "model": model_name(model)}
    return TunedLens(torch.stack(weights), torch.stack(biases), layers, settings)


def tuned_lens_cached(model: Model, calibration: Examples, cache_dir: str | os.PathLike[str], batch_size: int = 8,
                      progress: bool | None = None) -> TunedLens:
    """:func:`fit_tuned_lens`, cached as safetensors by (model hash, calibration rows, ridge)."""
    hashed = calibration.tokens.numpy().tobytes()
    if calibration.padded and calibration.attention_mask is not None:
        hashed += calibration.attention_mask.numpy().tobytes()
    digest = hashlib.sha256(hashed).hexdigest()[:12]
    path = Path(cache_dir) / f"tuned_lens-{model_hash(model)}-{digest}-r{RIDGE:g}.safetensors"
    if path.is_file():
        try:
            return TunedLens.load(path)
        except Exception:  # noqa: BLE001 - a damaged cache file is refitted (and replaced whole by save)
            pass
    lens = fit_tuned_lens(model, calibration, batch_size=batch_size, progress=progress)
    lens.save(path)
    return lens


def tuned_early_exit(model: Model, lens: TunedLens, examples: Examples, batch_size: int = 8,
                     progress: bool | None = None) -> EarlyExitResult:
    """Per-layer, per-example NLL decoding ``A_l r_l + b_l`` with ``model``'s head (``at="resid_post"``).

    The mean runs over the positions the translators were fitted on: every target but the first,
    whose prediction is read at the BOS position (excluded from the fit, see
    :func:`fit_tuned_lens`). The logit lens, which has no fit, keeps every target.
    """
    check_context(model, examples.tokens)
    layers = lens.layers
    if max(layers) >= hk.n_layers(model):
        raise InterpError(f"This tuned lens has {len(layers)} layers; the model has {hk.n_layers(model)}.")
    readout = Readout(model)
    nll = torch.empty(len(layers), len(examples), dtype=torch.float64)
    device = next(model.original_model.parameters()).device
    bar = tqdm(total=len(examples), desc="tuned lens exit", unit="ex", disable=not show_progress(progress))
    for start, end in batches(len(examples), batch_size):
        tokens, lengths = aligned_rows(examples, start, end, device)
        resids, _ = capture_layers(model, tokens, layers)
        # The translators were fitted without BOS positions, so BOS is not decoded either: from
        # about layer 10 SmolLM2's BOS residual has norm ~25,000 against ~130 elsewhere, far
        # outside the fit, and its one prediction cost 800-1,900 nats, 6-14 nats of a 127-target mean.
        with torch.no_grad():
            for i, r in enumerate(resids):
                pred = lens.translate(i, r[:, 1:].float()).to(readout.weight.dtype)
                kept = None if lengths is None else lengths - 1
                nll[i, start:end] = readout.mean_nll(pred, tokens[:, 1:], kept, normed=True).cpu()
        bar.update(end - start)
    bar.close()
    settings = {"model": model_name(model), "lens": "tuned",
                "batch_size": batch_size, "examples": dict(examples.settings)}
    return EarlyExitResult(nll=nll.float(), layers=list(layers), ids=list(examples.ids), at="resid_post",
                           settings=settings)
