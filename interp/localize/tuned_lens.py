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
from interp.errors import DataError, InterpError
from interp.io import read_safetensors, write_file
from interp.localize.lens import EarlyExitResult
from interp.models import Model, model_hash, model_name
from interp.runtime import hooks as hk
from interp.runtime.batching import batches, check_context, show_progress
from interp.runtime.capture import capture as capture_residuals
from interp.runtime.readout import Readout
from interp.schema import conform
from interp.validate import checked, checked_class

RIDGE = 1e-4  # lam relative to mean diagonal of the input Gram matrix: a tiny stabiliser only


@checked_class
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
        """Layer ``index``'s translator (an index into its ``layers``) applied to ``resid``."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < int(self.weight.shape[0]):
            raise InterpError(f"This tuned lens holds {int(self.weight.shape[0])} translators (indices "
                              f"0..{int(self.weight.shape[0]) - 1}, for layers {self.layers}); got index {index!r}")
        return resid @ self.weight[index].to(resid.device, resid.dtype) + self.bias[index].to(resid.device, resid.dtype)

    def check_fits(self, model: Model) -> None:
        """Refuse reading ``model`` with a lens fitted on another model: its translators' shapes, its layers and the
        fingerprint it recorded (:func:`lens_fingerprint`) must be this model's.

        Raises:
            InterpError: naming what differs, before the model runs.
        """
        d, n_layers = int(model.cfg.d_model), hk.n_layers(model)
        shape = tuple(self.weight.shape)
        fitting = len(shape) == 3 and shape[1:] == (d, d) and tuple(self.bias.shape) == (shape[0], d)
        if not fitting or len(self.layers) != shape[0]:
            raise InterpError(f"This tuned lens's translators are {list(shape)} for layers {self.layers}, but the "
                              f"model needs [layers, {d}, {d}]: it was fitted on another model. Fit one on this model "
                              "(interp.localize.tuned_lens.fit_tuned_lens).")
        if self.layers and max(self.layers) >= n_layers:
            raise InterpError(f"This tuned lens has translators for layers up to {max(self.layers)}; the model has "
                              f"{n_layers} layers: it was fitted on another model. Fit one on this model.")
        saved = self.settings.get("fingerprint")
        if isinstance(saved, dict):
            now = lens_fingerprint(model)
            differ = [key for key in now if key in saved and saved[key] != now[key]]
            if differ:
                shown = "; ".join(f"{key} {saved[key]!r} (this model: {now[key]!r})" for key in differ)
                raise InterpError(f"This tuned lens was fitted on another model ({self.settings.get('model', '?')}): "
                                  f"its {shown}. Fit one on this model (fit_tuned_lens).")

    def save(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        tensors = {"weight": self.weight.contiguous(), "bias": self.bias.contiguous()}
        metadata = {"layers": json.dumps(self.layers), "settings": json.dumps(self.settings)}
        write_file(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TunedLens:
        from interp.reading import regular_file

        regular_file(path, "a saved tuned lens")  # a pipe or device is refused before anything reads it
        tensors = read_safetensors(path, "tuned lens")  # a truncated cache gets interp's error, not safetensors'
        with safe_open(str(path), framework="pt") as fh:
            meta = dict(fh.metadata() or {})
        record: dict[str, Any] = {}
        for key in ("layers", "settings"):
            if key in meta:
                try:
                    record[key] = json.loads(meta[key])
                except ValueError:
                    record[key] = meta[key]  # not JSON: the schema names it
        record = conform(record, {"layers": "list[int]", "settings": "dict"}, f"{path} (a tuned lens's metadata)")
        weight, bias, layers = tensors.get("weight"), tensors.get("bias"), record["layers"]
        if (weight is None or bias is None or not weight.is_floating_point() or weight.ndim != 3
                or weight.shape[1] != weight.shape[2] or tuple(bias.shape) != (weight.shape[0], weight.shape[1])
                or len(layers) != weight.shape[0] or len(set(layers)) != len(layers) or min(layers, default=0) < 0):
            shapes = {k: list(v.shape) for k, v in tensors.items()}
            raise DataError(f"{path} is not a tuned lens: it needs weight [layers, d, d] and bias [layers, d] and one "
                            f"distinct layer per translator; it holds {shapes} for layers {layers}.")
        if not (bool(weight.isfinite().all()) and bool(bias.isfinite().all())):
            raise DataError(f"{path} holds NaN or inf translators: fit the tuned lens again.")
        return cls(weight, bias, layers, record["settings"])


def lens_fingerprint(model: Model) -> dict[str, Any]:
    """What a tuned lens records of the model it was fitted on, and :meth:`TunedLens.check_fits` compares: the
    architecture, the sizes, and a digest of every 1/256th row of the token embedding (quantization leaves the
    embedding alone, so a quantized copy, read with its reference's lens by convention, fits that lens).
    """
    info = getattr(model, "info", None)
    embedding = model.original_model.get_input_embeddings().weight
    digest = ""
    if not embedding.is_meta:
        rows = embedding.detach()[:: max(1, embedding.shape[0] // 256)].float().cpu().contiguous()
        digest = hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:16]
    return {"architecture": getattr(info, "architecture", type(model.original_model).__name__),
            "n_layers": hk.n_layers(model), "d_model": int(model.cfg.d_model),
            "d_vocab": int(embedding.shape[0]), "embedding": digest}


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


@checked
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
    device = next(model.original_model.parameters()).device
    # float64 sums on the model's device: no layer's activations leave it (moved only between a device_map's devices)
    gram = torch.zeros(len(layers), d + 1, d + 1, dtype=torch.float64, device=device)
    cross = torch.zeros(len(layers), d + 1, d, dtype=torch.float64, device=device)
    target_sq = torch.zeros((), dtype=torch.float64, device=device)
    target_sum = torch.zeros(d, dtype=torch.float64, device=device)
    rows = 0
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
        y = final[keep.to(final.device)].double().to(device)
        target_sq += (y * y).sum()
        target_sum += y.sum(0)
        rows += y.shape[0]
        for i, r in enumerate(resids):
            x = torch.cat([r[keep.to(r.device)].double().to(device),
                           torch.ones(y.shape[0], 1, dtype=torch.float64, device=device)], dim=1)
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
                "model": model_name(model), "fingerprint": lens_fingerprint(model)}
    return TunedLens(torch.stack(weights).cpu(), torch.stack(biases).cpu(), layers, settings)  # saved from the host


@checked
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


@checked
def tuned_early_exit(model: Model, lens: TunedLens, examples: Examples, batch_size: int = 8,
                     progress: bool | None = None) -> EarlyExitResult:
    """Per-layer, per-example NLL decoding ``A_l r_l + b_l`` with ``model``'s head (``at="resid_post"``).

    The mean runs over the positions the translators were fitted on: every target but the first,
    whose prediction is read at the BOS position (excluded from the fit, see
    :func:`fit_tuned_lens`). The logit lens, which has no fit, keeps every target.
    """
    check_context(model, examples.tokens)
    layers = lens.layers
    lens.check_fits(model)  # a lens fitted on another model is refused before the model runs
    readout = Readout(model)
    device = next(model.original_model.parameters()).device
    nll = torch.empty(len(layers), len(examples), dtype=torch.float64, device=device)  # to the host once, at the end
    lens = TunedLens(lens.weight.to(device), lens.bias.to(device), lens.layers, lens.settings)  # once, not per layer
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
                nll[i, start:end] = readout.mean_nll(pred, tokens[:, 1:], kept, normed=True)
        bar.update(end - start)
    bar.close()
    settings = {"model": model_name(model), "lens": "tuned",
                "batch_size": batch_size, "examples": dict(examples.settings)}
    return EarlyExitResult(nll=nll.float().cpu(), layers=list(layers), ids=list(examples.ids), at="resid_post",
                           settings=settings)
