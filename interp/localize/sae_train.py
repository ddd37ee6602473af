"""Training a TopK sparse autoencoder on captured activations, by the rule registered for issue 48.

The rule (docs/preregistration/survival-1.json, ``features.sae``; Gao et al. 2024, arXiv 2406.04093):

- inputs scaled by ``c = sqrt(d / mean ||x||^2)`` over the training positions (:func:`input_scale`);
- ``z = ReLU(TopK_k(W_enc^T (c x - b_dec) + b_enc))``, reconstruction ``W_dec^T z + b_dec`` (divided by
  ``c`` outside training), decoder rows of unit norm;
- ``W_dec`` rows random unit directions (seeded), ``W_enc = W_dec^T``, ``b_enc = 0``, ``b_dec`` the
  mean training activation;
- Adam (0.9, 0.999, eps 1e-8, PyTorch's default) at ``2e-4 * sqrt(16384 / latents)``, batches of
  1024 positions in a seeded shuffle (seed 2036; a fresh permutation of all training positions
  each epoch, the e-th drawn from one generator);
- loss ``||x - x_hat||^2`` (summed over the width, mean over the batch) plus ``1/32`` of the AuxK
  loss: the latents that fired on none of the last 200 batches ("dead") reconstruct the error
  ``x - x_hat`` (held fixed) with their ``min(256, n_dead)`` largest pre-activations (ReLU), as
  ``||e - W_dec^T z_aux||^2``; both terms in the same units, neither normalised;
- after each step the decoder gradient's component along each decoder row is removed before
  Adam sees it, and after the step the rows are renormalised;
- epochs until one lowers the validation FVU by less than 1% (relative; the first is compared
  with the initial SAE), at most 10; the SAE after the last epoch run is the result.

**Speed on a CPU.** A TopK SAE reads only ``k`` of its ``d_sae`` latents per position, and so
does its gradient. The dense encoder product ``[B, d] x [d, d_sae]`` is the one full-size
operation; the decoder is a weighted sum of the ``k`` active rows (``embedding_bag``), the
gradient of the active latents is a sampled product at their ``B x k`` entries
(``torch.sparse.sampled_addmm``), and the weight gradients are sparse-dense products with
``B x k`` nonzeros. Against autograd through dense ``[B, d_sae]`` latents this removes four
of the five full-size products (tests/test_sae.py checks the gradients against autograd in float64).

**Resuming.** With ``checkpoint=folder``, the whole training state (weights, Adam moments,
dead-latent counters, the log) is written there after each epoch, atomically; a rerun with the
same data and settings continues after the last finished epoch and gives the same SAE.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from safetensors import safe_open
from torch import Tensor
from tqdm.auto import tqdm

from interp.errors import DataError, InterpError
from interp.io import claim_folder, read_safetensors, write_json, write_safetensors, writing
from interp.localize.sae import TopKSAE
from interp.runtime.batching import show_progress
from interp.validate import checked

__all__ = ["REGISTERED", "TrainingLog", "fvu", "input_scale", "train_sae"]

REGISTERED: dict[str, Any] = {
    "lr_base": 2e-4, "lr_reference_latents": 16384, "batch_size": 1024, "seed": 2036, "betas": (0.9, 0.999),
    "adam_eps": 1e-8, "k_aux": 256, "aux_coefficient": 1 / 32, "dead_after_batches": 200,
    "min_improvement": 0.01, "max_epochs": 10,
}
"""The registered training settings (docs/preregistration/survival-1.json, features.sae.training)."""

CHECKPOINT_KIND = "sae-training"
STATE_FILE = "state.safetensors"
LOG_FILE = "training_log.json"
_CHUNK = 8192  # positions per chunk when scanning a whole set (scale, validation FVU)


@dataclass
class TrainingLog:
    """What each epoch did: ``epochs`` holds per epoch ``epoch``, ``loss``, ``mse``, ``aux``
    (means over its batches, in scaled units), ``val_fvu``, ``dead`` (latents dead by the 200-batch
    rule at its end), ``val_dead`` (latents that fire on no validation position) and ``seconds``."""

    settings: dict[str, Any]
    initial_val_fvu: float
    epochs: list[dict[str, Any]] = field(default_factory=list)
    stopped: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"settings": self.settings, "initial_val_fvu": self.initial_val_fvu, "epochs": self.epochs,
                "stopped": self.stopped}

    def save(self, path: str | os.PathLike[str]) -> Path:
        write_json(Path(path), self.to_dict())
        return Path(path)


def _chunks(x: Tensor, device: torch.device, scale: float = 1.0) -> Iterator[Tensor]:
    for start in range(0, x.shape[0], _CHUNK):
        yield x[start : start + _CHUNK].to(device, torch.float32) * scale


def input_scale(train: Float[Tensor, "n d"]) -> float:
    """``c = sqrt(d / mean ||x||^2)`` over the rows of ``train`` (float64 sums), so ``c x`` has mean squared
    norm ``d``."""
    total = torch.zeros((), dtype=torch.float64, device=train.device)
    for chunk in _chunks(train, train.device):
        total += chunk.double().square().sum()
    mean = float(total) / train.shape[0]
    if not mean > 0:
        raise DataError("The training activations are all zero: there is nothing to scale or reconstruct.")
    return math.sqrt(train.shape[1] / mean)


def fvu(sae: TopKSAE, x: Float[Tensor, "n d"], chunk: int = _CHUNK) -> tuple[float, int]:
    """Fraction of variance unexplained by ``sae`` on the rows of ``x`` (about their own mean), and how many
    latents fire on none of them; float64 sums, ``chunk`` rows at a time."""
    device = sae.W_enc.device
    err = torch.zeros((), dtype=torch.float64, device=device)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    total = torch.zeros(x.shape[1], dtype=torch.float64, device=device)
    fired = torch.zeros(sae.d_sae, dtype=torch.bool, device=device)
    for start in range(0, x.shape[0], chunk):
        xb = x[start : start + chunk].to(device, torch.float32)
        values, indices = sae.encode_sparse(xb)
        err += (sae.decode_sparse(values, indices) - xb).double().square().sum()
        sq += xb.double().square().sum()
        total += xb.double().sum(0)
        fired[indices[values > 0]] = True
    variance = float(sq - total.square().sum() / x.shape[0])
    return (float(err) / variance if variance > 0 else math.nan), int((~fired).sum())


# ---------------------------------------------------------------------------------------
# One step, by hand


def _rows_matrix(indices: Tensor, values: Tensor, d_sae: int) -> Tensor:
    """``[d_sae, B]`` sparse: ``values[b, j]`` at ``(indices[b, j], b)``."""
    batch, k = indices.shape
    cols = torch.arange(batch, device=indices.device).repeat_interleave(k)
    return torch.sparse_coo_tensor(torch.stack([indices.reshape(-1), cols]), values.reshape(-1), (d_sae, batch),
                                   check_invariants=False)


def _sampled_dots(g: Tensor, W: Tensor, indices: Tensor) -> Tensor:
    """``[B, k]``: ``g[b] . W[indices[b, j]]``, computed at those entries only."""
    batch, k = indices.shape
    crow = torch.arange(0, batch * k + 1, k, device=g.device)
    with warnings.catch_warnings():  # "sparse CSR support is in beta": sampled_addmm is checked in tests/test_sae.py
        warnings.simplefilter("ignore", UserWarning)
        pattern = torch.sparse_csr_tensor(crow, indices.reshape(-1), torch.zeros(batch * k, device=g.device,
                                                                                 dtype=g.dtype),
                                          (batch, W.shape[0]), check_invariants=False)
    return torch.sparse.sampled_addmm(pattern, g, W.T).values().reshape(batch, k)


@dataclass
class _State:
    """Training-space tensors (unit-norm decoder rows, inputs scaled by ``c``) and the optimiser's."""

    W_encT: Tensor  # [d_sae, d]: W_enc transposed, so its rows are gathered like the decoder's
    b_enc: Tensor
    W_dec: Tensor  # [d_sae, d]
    b_dec: Tensor
    m: dict[str, Tensor]
    v: dict[str, Tensor]
    since_fired: Tensor  # [d_sae] int64: batches since each latent last fired
    step: int = 0

    def params(self) -> dict[str, Tensor]:
        return {"W_encT": self.W_encT, "b_enc": self.b_enc, "W_dec": self.W_dec, "b_dec": self.b_dec}

    def sae(self, k: int, scale: float, hook_name: str, settings: dict[str, Any]) -> TopKSAE:
        """The SAE on raw activations: ``c`` folded into the tensors (see interp.localize.sae)."""
        return TopKSAE(W_enc=(self.W_encT.T * scale).contiguous(), b_enc=self.b_enc.clone(),
                       W_dec=self.W_dec / scale, b_dec=self.b_dec / scale, k=k, scale=scale, hook_name=hook_name,
                       settings=settings)


def _gradients(state: _State, x: Tensor, k: int, dead: Tensor | None, k_aux: int, aux_coefficient: float
               ) -> tuple[dict[str, Tensor], float, float, Tensor]:
    """Gradients of ``mse + aux_coefficient * aux`` for the batch ``x`` (scaled), the two losses, and the
    latents that fired. ``dead``: the latents the AuxK term may use (None or none: no AuxK term)."""
    batch, d_sae = x.shape[0], state.W_dec.shape[0]
    centred = x - state.b_dec
    pre = torch.addmm(state.b_enc, centred, state.W_encT.T)  # [B, d_sae]: the one dense product
    values, indices = pre.topk(k, dim=1, sorted=False)
    indices, order = indices.sort(dim=1)
    values = values.gather(1, order)
    z = values.clamp_min(0)
    recon = torch.nn.functional.embedding_bag(indices, state.W_dec, per_sample_weights=z, mode="sum") + state.b_dec
    err = recon - x
    mse = float(err.square().sum()) / batch
    g = err * (2.0 / batch)  # d mse / d recon
    sites = [(indices, z, values > 0, g)]  # (latents, their activations, where ReLU passes, d loss / d their output)
    aux = 0.0
    n_dead = 0 if dead is None else int(dead.sum())
    if dead is not None and n_dead:
        a_values, a_indices = _dead_top(pre, dead, k_aux)
        a_z = a_values.clamp_min(0)
        a_err = torch.nn.functional.embedding_bag(a_indices, state.W_dec, per_sample_weights=a_z, mode="sum") + err
        aux = float(a_err.square().sum()) / batch  # || W_dec^T z_aux - (x - x_hat) ||^2, x - x_hat held fixed
        sites.append((a_indices, a_z, a_values > 0, a_err * (2.0 * aux_coefficient / batch)))
    grads = {"b_enc": torch.zeros_like(state.b_enc), "b_dec": g.sum(0)}
    for idx, act, passes, grad_out in sites:
        d_pre = _sampled_dots(grad_out, state.W_dec, idx) * passes  # d loss / d pre-activation, at the kept entries
        for name, weights, by in (("W_dec", act, grad_out), ("W_encT", d_pre, centred)):
            product = torch.sparse.mm(_rows_matrix(idx, weights, d_sae), by)  # [d_sae, d], rows idx only nonzero
            grads[name] = grads[name].add_(product) if name in grads else product
        grads["b_enc"].index_add_(0, idx.reshape(-1), d_pre.reshape(-1))
        grads["b_dec"] -= torch.nn.functional.embedding_bag(idx, state.W_encT, per_sample_weights=d_pre,
                                                             mode="sum").sum(0)
    along = (grads["W_dec"] * state.W_dec).sum(1, keepdim=True)
    grads["W_dec"] -= along * state.W_dec  # no step along a decoder row: the renormalisation would undo it
    fired = torch.zeros(d_sae, dtype=torch.bool, device=x.device)
    fired[indices[z > 0]] = True
    return grads, mse, aux, fired


def _dead_top(pre: Tensor, dead: Tensor, k_aux: int) -> tuple[Tensor, Tensor]:
    """The ``min(k_aux, n_dead)`` largest pre-activations of each row among the ``dead`` latents, and which
    latents (ascending): every dead latent when there are at most ``k_aux``."""
    columns = dead.nonzero().squeeze(1)  # ascending
    among = pre[:, columns]
    if columns.numel() <= k_aux:
        return among, columns.expand(pre.shape[0], -1).contiguous()
    values, where = among.topk(k_aux, dim=1, sorted=False)
    where, order = where.sort(dim=1)
    return values.gather(1, order), columns[where]


def _adam(state: _State, grads: dict[str, Tensor], lr: float, betas: tuple[float, float], eps: float) -> None:
    state.step += 1
    b1, b2 = betas
    correction1, correction2 = 1 - b1 ** state.step, 1 - b2 ** state.step
    for name, p in state.params().items():
        m, v, g = state.m[name], state.v[name], grads[name]
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        p.addcdiv_(m, (v / correction2).sqrt_().add_(eps), value=-lr / correction1)
    state.W_dec.div_(state.W_dec.norm(dim=1, keepdim=True))


def _initial(train: Tensor, d_sae: int, scale: float, seed: int, device: torch.device) -> _State:
    generator = torch.Generator().manual_seed(seed)  # host: the same draw on every device
    W_dec = torch.nn.functional.normalize(torch.randn(d_sae, train.shape[1], generator=generator), dim=1).to(device)
    mean = torch.zeros(train.shape[1], dtype=torch.float64, device=device)
    for chunk in _chunks(train, device, scale):
        mean += chunk.double().sum(0)
    params: dict[str, Any] = {"W_encT": W_dec.clone(), "b_enc": torch.zeros(d_sae, device=device), "W_dec": W_dec,
              "b_dec": (mean / train.shape[0]).float()}
    return _State(**params, m={n: torch.zeros_like(p) for n, p in params.items()},
                  v={n: torch.zeros_like(p) for n, p in params.items()},
                  since_fired=torch.zeros(d_sae, dtype=torch.long, device=device))


# ---------------------------------------------------------------------------------------
# Checkpoints


def data_digest(x: Tensor) -> str:
    """SHA-256 (16 hex digits) of a tensor's shape, dtype and bytes: a checkpoint resumes only on the same data."""
    host = x.detach().to("cpu").contiguous()
    hashed = hashlib.sha256(f"{list(host.shape)} {host.dtype}".encode())
    hashed.update(host.view(torch.uint8).numpy().data if host.numel() else b"")
    return hashed.hexdigest()[:16]


def _save_state(folder: Path, state: _State, log: TrainingLog, epoch: int) -> None:
    tensors = {**{f"param.{n}": p for n, p in state.params().items()}, **{f"m.{n}": t for n, t in state.m.items()},
               **{f"v.{n}": t for n, t in state.v.items()}, "since_fired": state.since_fired}
    meta = {"epoch": str(epoch), "step": str(state.step), "log": json.dumps(log.to_dict())}
    write_safetensors(folder / STATE_FILE, {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, meta)
    log.save(folder / LOG_FILE)


def _load_state(folder: Path, settings: dict[str, Any], device: torch.device) -> tuple[_State, TrainingLog, int] | None:
    path = folder / STATE_FILE
    if not path.is_file():
        return None
    tensors = read_safetensors(path, "SAE training checkpoint")
    with safe_open(str(path), framework="pt") as fh:
        meta = dict(fh.metadata() or {})
    try:
        saved = json.loads(meta["log"])
        epoch, step = int(meta["epoch"]), int(meta["step"])
    except (KeyError, ValueError):
        raise DataError(f"{path} is not an SAE training checkpoint written by interp: choose another folder.") from None
    if saved.get("settings") != json.loads(json.dumps(settings)):
        differ = sorted(k for k in settings if saved.get("settings", {}).get(k) != json.loads(json.dumps(settings[k])))
        raise DataError(f"{folder} holds the training of another SAE or data (it differs in {', '.join(differ)}); a "
                        "rerun resumes only the same training. Choose another checkpoint folder.")
    on = {n: t.to(device) for n, t in tensors.items()}
    names = ("W_encT", "b_enc", "W_dec", "b_dec")
    state = _State(**{n: on[f"param.{n}"] for n in names}, m={n: on[f"m.{n}"] for n in names},
                   v={n: on[f"v.{n}"] for n in names}, since_fired=on["since_fired"], step=step)
    log = TrainingLog(saved["settings"], saved["initial_val_fvu"], saved["epochs"], saved.get("stopped", ""))
    return state, log, epoch


# ---------------------------------------------------------------------------------------
# The loop


def _check(train: Tensor, validation: Tensor, latents: int, k: int) -> None:
    if train.ndim != 2 or validation.ndim != 2 or train.shape[1] != validation.shape[1]:
        raise DataError(f"train and validation must be [positions, d] of one width; got {list(train.shape)} and "
                        f"{list(validation.shape)}.")
    if not train.is_floating_point() or not validation.is_floating_point():
        raise DataError("train and validation must hold floating-point activations.")
    if isinstance(latents, bool) or not isinstance(latents, int) or latents < 1:
        raise InterpError(f"latents must be a positive integer; got {latents!r}.")
    if k > latents:
        raise InterpError(f"k ({k}) cannot exceed the number of latents ({latents}).")


def _epoch(state: _State, train: Tensor, order: Tensor, scale: float, k: int, lr: float, cfg: dict[str, Any],
           bar: Any) -> dict[str, float]:
    sums = {"loss": 0.0, "mse": 0.0, "aux": 0.0}
    batch_size, device, n = cfg["batch_size"], state.W_dec.device, 0
    for start in range(0, order.numel(), batch_size):
        x = train[order[start : start + batch_size]].to(device, torch.float32) * scale
        dead = state.since_fired >= cfg["dead_after_batches"]
        grads, mse, aux, fired = _gradients(state, x, k, dead, cfg["k_aux"], cfg["aux_coefficient"])
        _adam(state, grads, lr, tuple(cfg["betas"]), cfg["adam_eps"])
        state.since_fired += 1
        state.since_fired[fired] = 0
        sums["mse"] += mse
        sums["aux"] += aux
        sums["loss"] += mse + cfg["aux_coefficient"] * aux
        n += 1
        bar.update(x.shape[0])
    return {name: value / max(n, 1) for name, value in sums.items()}


@checked
def train_sae(train: Float[Tensor, "n d"], validation: Float[Tensor, "m d"], latents: int = 4096, k: int = 32,
              seed: int = 2036, *, hook_name: str = "", checkpoint: str | os.PathLike[str] | None = None,
              device: str | torch.device | None = None, max_epochs: int = 10, batch_size: int = 1024,
              settings: dict[str, Any] | None = None, progress: bool | None = None) -> tuple[TopKSAE, TrainingLog]:
    """Train a TopK SAE on ``train`` by the registered rule (module docstring); stop on ``validation``.

    Args:
        train: ``[N, d]`` training activations (any float dtype, any device; batches are moved to ``device``).
        validation: ``[M, d]`` activations for the stopping rule only.
        latents: ``d_sae``. k: latents kept per position.
        seed: seeds both the decoder's initial directions and the shuffle (2036, registered).
        hook_name: what the activations are (``blocks.5.hook_resid_post``), recorded in the SAE.
        checkpoint: a folder to write the training state into after each epoch, and to resume from.
        device: where to train (default: ``train``'s device).
        max_epochs, batch_size: the registered 10 and 1024 unless changed (tests shorten them).
        settings: recorded with the SAE (model, rows...).

    Returns:
        The SAE on raw activations (input scale folded in) and its :class:`TrainingLog`, which a checkpoint
        folder also holds as ``training_log.json``.
    """
    _check(train, validation, latents, k)
    where = torch.device(device) if device is not None else train.device
    cfg = {**REGISTERED, "batch_size": batch_size, "max_epochs": max_epochs, "seed": seed}
    lr = cfg["lr_base"] * math.sqrt(cfg["lr_reference_latents"] / latents)
    scale = input_scale(train)
    run = {**json.loads(json.dumps(cfg)), "latents": latents, "k": k, "lr": lr, "input_scale": scale,
           "train_positions": int(train.shape[0]), "validation_positions": int(validation.shape[0]),
           "train_digest": data_digest(train), "validation_digest": data_digest(validation), "hook_name": hook_name}
    folder = None if checkpoint is None else claim_folder(checkpoint, CHECKPOINT_KIND)
    resumed = None if folder is None else _load_state(folder, run, where)
    if resumed is None:
        state = _initial(train, latents, scale, seed, where)
        log, done = TrainingLog(run, fvu(state.sae(k, scale, hook_name, {}), validation)[0]), 0
    else:
        state, log, done = resumed
    with writing(folder) if folder is not None else contextlib.nullcontext():
        _loop(state, log, done, train, validation, scale, k, lr, cfg, folder, progress)
    sae = state.sae(k, scale, hook_name, {**(settings or {}), "training": log.to_dict()})
    return sae, log


def _loop(state: _State, log: TrainingLog, done: int, train: Tensor, validation: Tensor, scale: float, k: int,
          lr: float, cfg: dict[str, Any], folder: Path | None, progress: bool | None) -> None:
    generator = torch.Generator().manual_seed(cfg["seed"])  # host: the shuffle is the same on every device
    orders = (torch.randperm(train.shape[0], generator=generator) for _ in range(cfg["max_epochs"]))
    for _ in range(done):
        next(orders)  # the permutations of the epochs already run
    previous = log.epochs[-1]["val_fvu"] if log.epochs else log.initial_val_fvu
    for epoch in range(done, cfg["max_epochs"]):
        if log.stopped:
            return
        started = time.perf_counter()
        bar = tqdm(total=train.shape[0], desc=f"SAE epoch {epoch + 1}", unit="pos", disable=not show_progress(progress))
        means = _epoch(state, train, next(orders).to(train.device), scale, k, lr, cfg, bar)
        bar.close()
        val_fvu, val_dead = fvu(state.sae(k, scale, "", {}), validation)
        log.epochs.append({"epoch": epoch + 1, **means, "val_fvu": val_fvu, "val_dead": val_dead,
                           "dead": int((state.since_fired >= cfg["dead_after_batches"]).sum()),
                           "seconds": time.perf_counter() - started})
        gain = (previous - val_fvu) / previous if previous > 0 else 0.0
        if gain < cfg["min_improvement"]:
            log.stopped = (f"epoch {epoch + 1} lowered the validation FVU by {100 * gain:.2f}% "
                           f"(< {100 * cfg['min_improvement']:g}%)")
        elif epoch + 1 == cfg["max_epochs"]:
            log.stopped = f"reached {cfg['max_epochs']} epochs"
        previous = val_fvu
        if folder is not None:
            _save_state(folder, state, log, epoch + 1)
