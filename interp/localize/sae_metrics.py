"""How good an SAE is, and how its latents move under another model: per-row sums, any resample recomputed.

**Quality** (:func:`sae_quality`), the metrics SAELens users read, on held-out token rows at
the SAE positions (:func:`interp.localize.sae_data.sae_positions`: not BOS, not separators):

- FVU: ``sum ||x - x_hat||^2 / sum ||x - x_bar||^2``, ``x_bar`` the mean over the positions;
- L0: the mean number of nonzero latents per position;
- dead share: the share of latents that fire (activation > 0) at no position;
- CE loss recovered: ``(CE_zero - CE_sae) / (CE_zero - CE_clean)`` (SAELens's ``ce_loss_score``),
  each CE the model's mean next-token cross-entropy over every predicted position of the rows,
  with the SAE's activation replaced by the reconstruction (``CE_sae``) or by zeros (``CE_zero``)
  at every SAE position; ``CE_sae - CE_clean`` (nats) beside it.

Every metric is a ratio of sums over rows, so :class:`QualityRows` keeps per-row sums
(``sum ||x||^2``, ``sum x``, ``sum ||x - x_hat||^2``, firing counts per latent, NLL sums) and
recomputes each metric for any resample of the rows: ``rows`` of shape ``[n_boot, n_rows]``
(:func:`interp.stats.bootstrap_indices`), the ``statistic(data, rows)`` convention of
:func:`interp.stats.crossed_bootstrap`.

**Latents under another model** (:func:`latent_stats`, :func:`latent_stats_layers`, :func:`latent_row_stats`):
the same SAE encodes the reference's and another model's activation at the same positions; per row and
latent the sums a Pearson correlation over positions needs (``n, sum a, sum b, sum a^2,
sum b^2, sum ab``, zeros included) and the firing counts of both. A TopK SAE fires ``k`` of its
``d_sae`` latents per position, so most (row, latent) pairs are all zeros: :class:`LatentRowStats`
stores only the pairs where either model fires (COO), 56 bytes a pair (two int32 coordinates, five
float64 sums, two int32 counts) and 8 bytes a row. For 192 rows of 511 SAE positions and 4,096
latents at ``k = 32`` a row can fire up to ``511 x 32 x 2`` latents, more than there are, so the
bound is every pair: ``192 x 4,096`` pairs, 44 MB per model and layer; the real size is the number
of distinct latents each row fires in either model, which only a trained SAE says.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from interp.data import Examples, aligned_rows, counted_positions
from interp.errors import DataError, InterpError
from interp.io import read_safetensors, write_safetensors
from interp.localize.sae import SparseAutoencoder, TopKSAE, sae_site
from interp.localize.sae_data import residuals, sae_positions, separator_of
from interp.models import Model, model_name
from interp.runtime import hooks as hk
from interp.runtime.batching import batches, check_context, show_progress
from interp.runtime.decoder import DecoderRunner
from interp.runtime.readout import Readout
from interp.stats import bootstrap_indices
from interp.validate import checked

__all__ = ["HeldOutActivations", "LatentRowStats", "QualityRows", "held_out_activations", "latent_row_stats",
           "latent_stats", "latent_stats_layers", "sae_quality"]

QUALITY_METRICS = ("fvu", "l0", "dead_share", "ce_recovered", "ce_increase")
_LATENT_CHUNK = 512  # positions encoded at once: [512, 8192] float64 latents are 32 MB, a few of them alive


def _weights(rows: np.ndarray | None, n_rows: int) -> np.ndarray:
    """``[n_boot, n_rows]`` float64 counts of each row in each resample (one resample of all rows for None)."""
    if rows is None:
        return np.ones((1, n_rows))
    rows = np.asarray(rows).reshape(-1, np.asarray(rows).shape[-1])
    out = np.zeros((rows.shape[0], n_rows))
    np.add.at(out, (np.repeat(np.arange(rows.shape[0]), rows.shape[1]), rows.reshape(-1)), 1.0)
    return out


def _sparse_fired(latent: np.ndarray, row: np.ndarray, counts: np.ndarray, n_rows: int, d_sae: int) -> Any:
    from scipy import sparse

    return sparse.csr_matrix((counts.astype(np.float64), (row, latent)), shape=(n_rows, d_sae))


class _PerRowFile:
    """What :class:`QualityRows` and :class:`LatentRowStats` share: per-row arrays (``positions`` ``[R]`` among
    them), ``d_sae`` and ``settings``, saved as one safetensors file (``_WHAT`` names it in errors)."""

    _WHAT = ""
    positions: np.ndarray

    @property
    def n_rows(self) -> int:
        return int(self.positions.shape[0])

    def save(self, path: str | os.PathLike[str]) -> Path:
        return _save(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Any:
        return _load(cls, path, cls._WHAT)


@dataclass(frozen=True)
class QualityRows(_PerRowFile):
    """Per-row sums of one SAE on held-out rows (:func:`sae_quality`); every metric recomputed from them.

    Attributes:
        positions: ``[R]`` SAE positions per row. sum_sq: ``[R]`` ``sum ||x||^2``. sum_x: ``[R, d]`` ``sum x``.
        err_sq: ``[R]`` ``sum ||x - x_hat||^2``. active: ``[R]`` nonzero latents summed over positions.
        fired_row, fired_latent, fired_count: COO firing counts (row, latent, positions where it fires).
        predicted: ``[R]`` predicted positions. nll_clean, nll_sae, nll_zero: ``[R]`` NLL sums over them.
        d_sae: latents. settings: model, SAE, rows.
    """

    positions: np.ndarray
    sum_sq: np.ndarray
    sum_x: np.ndarray
    err_sq: np.ndarray
    active: np.ndarray
    fired_row: np.ndarray
    fired_latent: np.ndarray
    fired_count: np.ndarray
    predicted: np.ndarray
    nll_clean: np.ndarray
    nll_sae: np.ndarray
    nll_zero: np.ndarray
    d_sae: int
    settings: dict[str, Any] = field(default_factory=dict)
    _WHAT = "SAE quality rows"

    def metric(self, name: str, rows: np.ndarray | None = None) -> np.ndarray:
        """``name`` (one of ``fvu``, ``l0``, ``dead_share``, ``ce_recovered``, ``ce_increase``) on each resample
        ``rows`` (``[n_boot, n_rows]`` row indices; None: all rows once): ``[n_boot]`` float64."""
        if name not in QUALITY_METRICS:
            raise InterpError(f"Unknown SAE quality metric {name!r}; the metrics are {', '.join(QUALITY_METRICS)}.")
        w = _weights(rows, self.n_rows)
        n = w @ self.positions
        with np.errstate(divide="ignore", invalid="ignore"):
            if name == "fvu":
                sum_x = w @ self.sum_x
                return (w @ self.err_sq) / ((w @ self.sum_sq) - (sum_x * sum_x).sum(1) / n)
            if name == "l0":
                return (w @ self.active) / n
            if name == "dead_share":
                fired = _sparse_fired(self.fired_latent, self.fired_row, self.fired_count, self.n_rows, self.d_sae)
                return ((fired.T @ w.T).T == 0).mean(axis=1)
            ce = {kind: (w @ getattr(self, f"nll_{kind}")) / (w @ self.predicted) for kind in ("clean", "sae", "zero")}
            if name == "ce_increase":
                return ce["sae"] - ce["clean"]
            return (ce["zero"] - ce["sae"]) / (ce["zero"] - ce["clean"])

    def statistic(self, name: str) -> Callable[[Any, np.ndarray], np.ndarray]:
        """``(data, rows) -> [n_boot]``, as :func:`interp.stats.crossed_bootstrap` calls it (``data`` unused)."""
        return lambda data, rows: self.metric(name, rows)

    def values(self) -> dict[str, float]:
        """Every metric on all rows."""
        return {name: float(self.metric(name)[0]) for name in QUALITY_METRICS}

    def resampled(self, name: str, n_boot: int = 1000, seed: int = 0) -> np.ndarray:
        """``[n_boot]`` values of ``name`` on row resamples drawn by :func:`interp.stats.bootstrap_indices`."""
        return self.metric(name, bootstrap_indices(self.n_rows, n_boot, seed))



def _save(obj: Any, path: str | os.PathLike[str]) -> Path:
    import json

    # host: numpy arrays written to a file
    arrays = {f.name: torch.from_numpy(np.ascontiguousarray(getattr(obj, f.name))) for f in fields(obj)
              if isinstance(getattr(obj, f.name), np.ndarray)}
    meta = {"d_sae": str(obj.d_sae), "settings": json.dumps(obj.settings, default=str)}
    write_safetensors(Path(path), arrays, meta)
    return Path(path)


def _load(cls: Any, path: str | os.PathLike[str], what: str) -> Any:
    import json

    from safetensors import safe_open

    from interp.reading import regular_file

    regular_file(path, what)
    tensors = read_safetensors(path, what)
    with safe_open(str(path), framework="pt") as fh:
        meta = dict(fh.metadata() or {})
    names = [f.name for f in fields(cls) if f.name not in ("d_sae", "settings")]
    if sorted(tensors) != sorted(names) or not meta.get("d_sae", "").isdigit():
        raise DataError(f"{path} is not {what} written by interp (it holds {sorted(tensors)}); compute it again.")
    return cls(**{n: tensors[n].numpy() for n in names}, d_sae=int(meta["d_sae"]),
               settings=json.loads(meta.get("settings", "{}")))


# ---------------------------------------------------------------------------------------
# Quality on held-out rows


def _latents(sae: SparseAutoencoder, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Reconstruction ``[P, d]``, and the (position, latent) pairs that fire: ``[F]`` each."""
    if isinstance(sae, TopKSAE):
        values, indices = sae.encode_sparse(x)
        fires = values > 0
        where = fires.nonzero()
        return sae.decode_sparse(values, indices), where[:, 0], indices[fires]
    z = sae.encode(x)
    where = (z > 0).nonzero()
    return sae.decode(z), where[:, 0], where[:, 1]


def _final(model: Model, tokens: Tensor, site: tuple[str, int], value: Callable[[Tensor], Tensor] | None
           ) -> tuple[Tensor, Tensor | None]:
    """The final residual of one forward, with ``value(x)`` written at ``site`` (None: nothing written, and the
    activation there returned too)."""
    seen: dict[str, Tensor] = {}

    def at_site(x: Tensor, hook: Any) -> Tensor | None:
        if value is None:
            seen["site"] = x.detach()
            return None
        return value(x)

    def last(x: Tensor, hook: Any) -> None:
        seen["final"] = x.detach()

    fwd = [(hk.hook_point(model, *site), at_site), (hk.hook_point(model, "resid_post", hk.n_layers(model) - 1), last)]
    with torch.no_grad(), model.hooks(fwd_hooks=fwd):
        hk.decoder_body(model)(input_ids=tokens)
    return seen["final"], seen.get("site")


class _Splicer:
    """Final residuals with the site's activation replaced at kept positions: from the site on when the model's
    blocks can be run from a residual (resid_post, unpadded rows, checked once against a full forward), else by
    a full forward with a hook."""

    def __init__(self, model: Model, site: tuple[str, int]) -> None:
        self.model, self.site = model, site
        self.runner = DecoderRunner.for_model(model) if site[0] == "resid_post" else None
        self.checked = False

    def final(self, tokens: Tensor, lengths: Tensor | None, x: Tensor, keep: Tensor, new: Tensor,
              clean_final: Tensor) -> Tensor:
        spliced = x.clone()
        spliced[keep] = new.to(x.dtype)
        if self.runner is not None and lengths is None:
            if not self.checked:
                with torch.no_grad():
                    again = self.runner.run(x, self.site[1] + 1)
                scale = float(clean_final.abs().max()) or 1.0
                if not torch.allclose(again, clean_final, rtol=1e-4, atol=1e-4 * scale):
                    self.runner = None  # this model's blocks are not run as its forward runs them: hooks instead
                self.checked = True
            if self.runner is not None:
                with torch.no_grad():
                    return self.runner.run(spliced, self.site[1] + 1)
        return _final(self.model, tokens, self.site, lambda _: spliced)[0]


def _row_nll(readout: Readout, final: Tensor, tokens: Tensor, lengths: Tensor | None) -> Tensor:
    """Per-row NLL sums over the predicted positions (targets 1..length-1), float64 ``[B]``."""
    with torch.no_grad():
        per = readout.token_nll(final, tokens).double()
    if lengths is not None:
        per = per * counted_positions(lengths.to(per.device), tokens.shape[1], skip_first=True)[:, 1:]
    return per.sum(1)


@checked
def sae_quality(model: Model, sae: SparseAutoencoder, examples: Examples, batch_size: int = 8,
                progress: bool | None = None) -> QualityRows:
    """Per-row sums for FVU, L0, dead share and CE loss recovered of ``sae`` on ``model`` over ``examples``.

    Three forwards per batch: the clean one (activations and CE_clean), then the activation replaced at every
    SAE position by the reconstruction (CE_sae) and by zeros (CE_zero), from the SAE's layer on where the model
    allows it. See :class:`QualityRows` for reading the metrics and their intervals.
    """
    site = sae_site(model, sae)
    check_context(model, examples.tokens)
    device = next(model.original_model.parameters()).device
    sae = sae.to(device)
    readout, splicer, separator = Readout(model), _Splicer(model, site), separator_of(examples)
    parts: dict[str, list[Tensor]] = {name: [] for name in ("positions", "sum_sq", "sum_x", "err_sq", "active",
                                                            "predicted", "nll_clean", "nll_sae", "nll_zero")}
    fired: list[Tensor] = []
    bar = tqdm(total=len(examples), desc="SAE quality", unit="row", disable=not show_progress(progress))
    for start, end in batches(len(examples), batch_size):
        tokens, lengths = aligned_rows(examples, start, end, device)
        keep = sae_positions(tokens, lengths, separator)
        clean_final, x = _final(model, tokens, site, None)
        assert x is not None
        kept = x[keep].to(sae.W_enc.dtype)
        x_hat, fire_pos, fire_latent = _latents(sae, kept)
        row_of = keep.nonzero()[:, 0]
        batch_rows = end - start
        parts["positions"].append(keep.sum(1).double())
        parts["sum_sq"].append(_per_row(kept.double().square().sum(1), row_of, batch_rows))
        parts["sum_x"].append(torch.zeros(batch_rows, kept.shape[1], dtype=torch.float64, device=kept.device)
                              .index_add_(0, row_of, kept.double()))
        parts["err_sq"].append(_per_row((x_hat.double() - kept.double()).square().sum(1), row_of, batch_rows))
        parts["active"].append(_per_row(torch.ones_like(fire_pos, dtype=torch.float64), row_of[fire_pos], batch_rows))
        counts = torch.zeros(batch_rows, sae.d_sae, dtype=torch.float64, device=kept.device)
        counts.index_put_((row_of[fire_pos], fire_latent), torch.ones_like(fire_pos, dtype=torch.float64),
                          accumulate=True)
        r, j = counts.nonzero(as_tuple=True)
        fired.append(torch.stack([r + start, j, counts[r, j].long()]).cpu())
        predicted = (tokens.shape[1] - 1) if lengths is None else (lengths - 1).clamp(min=0)
        parts["predicted"].append(torch.as_tensor(predicted, device=device).double().expand(batch_rows).clone())
        parts["nll_clean"].append(_row_nll(readout, clean_final, tokens, lengths))
        for name, new in (("nll_sae", x_hat), ("nll_zero", torch.zeros_like(x_hat))):
            final = splicer.final(tokens, lengths, x, keep, new, clean_final)
            parts[name].append(_row_nll(readout, final, tokens, lengths))
        bar.update(end - start)
    bar.close()
    arrays = {name: torch.cat(values).cpu().numpy() for name, values in parts.items()}
    coo = torch.cat(fired, dim=1).numpy()
    settings = {"model": model_name(model), "hook_name": sae.hook_name, "d_sae": sae.d_sae,
                "architecture": sae.architecture, "batch_size": batch_size, "examples": dict(examples.settings),
                "rows": len(examples)}
    return QualityRows(**arrays, fired_row=coo[0].astype(np.int32), fired_latent=coo[1].astype(np.int32),
                       fired_count=coo[2].astype(np.int32), d_sae=sae.d_sae, settings=settings)


def _per_row(values: Tensor, row_of: Tensor, n_rows: int) -> Tensor:
    return torch.zeros(n_rows, dtype=torch.float64, device=values.device).index_add_(0, row_of, values.double())


# ---------------------------------------------------------------------------------------
# Latents under another model


@dataclass(frozen=True)
class LatentRowStats(_PerRowFile):
    """Per (row, latent) sums for the Pearson correlation of a latent's activation in two models over positions,
    and the firing counts; only the pairs where either model fires (COO, one entry per pair).

    Attributes:
        row, latent: ``[E]`` int32 coordinates. sum_a, sum_b, sum_aa, sum_bb, sum_ab: ``[E]`` float64 (``a`` the
        reference's activation, ``b`` the other model's). fire_a, fire_b: ``[E]`` int32 positions where each fires
        (activation > 0). positions: ``[R]`` SAE positions per row (the ``n`` of every latent, zeros included).
        d_sae: latents. settings: the models, the SAE, the rows.
    """

    row: np.ndarray
    latent: np.ndarray
    sum_a: np.ndarray
    sum_b: np.ndarray
    sum_aa: np.ndarray
    sum_bb: np.ndarray
    sum_ab: np.ndarray
    fire_a: np.ndarray
    fire_b: np.ndarray
    positions: np.ndarray
    d_sae: int
    settings: dict[str, Any] = field(default_factory=dict)
    _WHAT = "SAE latent statistics"

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self) if isinstance(getattr(self, f.name), np.ndarray))

    def totals(self, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Each sum over the rows of each resample (``[n_boot, n_rows]`` indices; None: all rows once):
        ``[n_boot, d_sae]`` per name, and ``n`` ``[n_boot, 1]``."""
        from scipy import sparse

        w = _weights(rows, self.n_rows)
        out = {"n": (w @ self.positions)[:, None]}
        for name in ("sum_a", "sum_b", "sum_aa", "sum_bb", "sum_ab", "fire_a", "fire_b"):
            matrix = sparse.csr_matrix((getattr(self, name).astype(np.float64), (self.row, self.latent)),
                                       shape=(self.n_rows, self.d_sae))
            out[name] = np.asarray((matrix.T @ w.T).T)
        return out

    def correlation(self, rows: np.ndarray | None = None) -> np.ndarray:
        """``[n_boot, d_sae]`` Pearson correlation over positions (zeros included) of each latent's two activations;
        NaN where either never fires (no variance)."""
        t = self.totals(rows)
        n = t["n"]
        cov = t["sum_ab"] - t["sum_a"] * t["sum_b"] / n
        var_a = t["sum_aa"] - t["sum_a"] ** 2 / n
        var_b = t["sum_bb"] - t["sum_b"] ** 2 / n
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where((var_a > 0) & (var_b > 0), cov / np.sqrt(var_a * var_b), np.nan)

    def firing_rates(self, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``[n_boot, d_sae]`` shares of positions where each latent fires, in the reference and the other model."""
        t = self.totals(rows)
        return t["fire_a"] / t["n"], t["fire_b"] / t["n"]



class _LatentSums:
    """Dense ``[R, d_sae]`` float64 accumulators, made sparse at the end."""

    names = ("sum_a", "sum_b", "sum_aa", "sum_bb", "sum_ab", "fire_a", "fire_b")

    def __init__(self, n_rows: int, d_sae: int, device: torch.device) -> None:
        self.sums = {name: torch.zeros(n_rows, d_sae, dtype=torch.float64, device=device) for name in self.names}
        self.positions = torch.zeros(n_rows, dtype=torch.float64, device=device)
        self.d_sae = d_sae

    def add(self, sae: SparseAutoencoder, a_x: Tensor, b_x: Tensor, rows: Tensor) -> None:
        rows = rows.to(self.positions.device).long()
        self.positions.index_add_(0, rows, torch.ones_like(rows, dtype=torch.float64))
        for start in range(0, a_x.shape[0], _LATENT_CHUNK):  # dense [chunk, d_sae] latents at a time
            a = sae.encode(a_x[start : start + _LATENT_CHUNK]).double()
            b = sae.encode(b_x[start : start + _LATENT_CHUNK]).double()
            r = rows[start : start + _LATENT_CHUNK]
            for name, value in (("sum_a", a), ("sum_b", b), ("sum_aa", a * a), ("sum_bb", b * b), ("sum_ab", a * b),
                                ("fire_a", (a > 0).double()), ("fire_b", (b > 0).double())):
                self.sums[name].index_add_(0, r, value)

    def finish(self, settings: dict[str, Any]) -> LatentRowStats:
        fires = (self.sums["fire_a"] > 0) | (self.sums["fire_b"] > 0)
        row, latent = fires.nonzero(as_tuple=True)
        values = {name: self.sums[name][row, latent].cpu().numpy() for name in self.names}
        for name in ("fire_a", "fire_b"):
            values[name] = values[name].astype(np.int32)
        return LatentRowStats(row=row.cpu().numpy().astype(np.int32), latent=latent.cpu().numpy().astype(np.int32),
                              **values, positions=self.positions.cpu().numpy().astype(np.int64), d_sae=self.d_sae,
                              settings=settings)


def latent_row_stats(sae: SparseAutoencoder, reference_x: Tensor, other_x: Tensor, rows: Tensor,
                     n_rows: int | None = None) -> LatentRowStats:
    """:class:`LatentRowStats` of ``sae`` from two models' activations at the same positions.

    Args:
        reference_x, other_x: ``[P, d_in]`` activations at the same positions (any dtype; encoded in the SAE's).
        rows: ``[P]`` the row of each position (``0 .. n_rows - 1``).
        n_rows: rows in all (default: ``max(rows) + 1``).
    """
    if reference_x.shape != other_x.shape or reference_x.ndim != 2 or rows.shape != reference_x.shape[:1]:
        raise DataError(f"latent_row_stats needs two [P, d] activations of one shape and [P] rows; got "
                        f"{list(reference_x.shape)}, {list(other_x.shape)} and {list(rows.shape)}.")
    n = int(rows.max()) + 1 if n_rows is None else n_rows
    sums = _LatentSums(n, sae.d_sae, sae.W_enc.device)
    sums.add(sae, reference_x.to(sae.W_enc.device), other_x.to(sae.W_enc.device), rows)
    return sums.finish({"hook_name": sae.hook_name, "d_sae": sae.d_sae})


@checked
def latent_stats(sae: SparseAutoencoder, reference: Model, other: Model, examples: Examples, batch_size: int = 8,
                 progress: bool | None = None) -> LatentRowStats:
    """:class:`LatentRowStats` of ``sae`` on ``examples``: the reference's and ``other``'s activations at the SAE's
    hook point and positions, each from a forward that stops there (:func:`latent_stats_layers` for several SAEs)."""
    return latent_stats_layers([sae], reference, other, examples, batch_size, progress)[0]


@dataclass(frozen=True)
class HeldOutActivations:
    """A model's activations at several SAE sites on ``examples``, per batch (``batch_size`` rows):
    ``batches[i]`` maps each site's layer to ``[P_i, d]`` (the SAE positions of that batch's rows, in order) and
    ``rows[i]`` gives each position's row. Made once by :func:`held_out_activations` and read for every other
    model (the reference's side of :func:`latent_stats_layers` does not change between quantized models)."""

    sites: tuple[tuple[str, int], ...]
    batches: tuple[dict[int, Tensor], ...]
    rows: tuple[Tensor, ...]
    batch_size: int
    n_rows: int


@checked
def held_out_activations(model: Model, saes: list[SparseAutoencoder], examples: Examples, batch_size: int = 8,
                         progress: bool | None = None) -> HeldOutActivations:
    """``model``'s activations at every SAE's site and positions on ``examples``, one forward per batch that stops
    after the last site (for 3 sites of SmolLM2 and 192 rows of 512 tokens: about 0.7 GB in float32)."""
    sites = tuple(sae_site(model, sae) for sae in saes)
    check_context(model, examples.tokens)
    device = next(model.original_model.parameters()).device
    separator = separator_of(examples)
    captured, rows = [], []
    bar = tqdm(total=len(examples), desc="SAE sites", unit="row", disable=not show_progress(progress))
    for start, end in batches(len(examples), batch_size):
        tokens, lengths = aligned_rows(examples, start, end, device)
        keep = sae_positions(tokens, lengths, separator)
        captured.append(residuals(model, tokens, keep, list(sites)))
        rows.append(keep.nonzero()[:, 0] + start)
        bar.update(end - start)
    bar.close()
    return HeldOutActivations(sites, tuple(captured), tuple(rows), batch_size, len(examples))


def _reference_or_captured(value: Any, name: str, arguments: dict[str, Any]) -> None:
    if not isinstance(value, HeldOutActivations) and not isinstance(value, torch.nn.Module):
        raise InterpError(f"{name} must be a model, such as interp.load_model(...), or its activations captured by "
                          f"held_out_activations(...); got {type(value).__name__}.")


@checked(reference=_reference_or_captured)
def latent_stats_layers(saes: list[SparseAutoencoder], reference: Model | HeldOutActivations, other: Model,
                        examples: Examples, batch_size: int = 8, progress: bool | None = None) -> list[LatentRowStats]:
    """:class:`LatentRowStats` of each SAE (one per site of one model) on ``examples``, from one forward of
    ``other`` per batch for all sites; ``reference`` is the reference model, or its activations already captured
    by :func:`held_out_activations` on the same examples, SAEs and batch size (then it runs no forward)."""
    if isinstance(reference, HeldOutActivations):
        ref = reference
        sites = tuple(sae_site(other, sae) for sae in saes)
        if ref.sites != sites or ref.batch_size != batch_size or ref.n_rows != len(examples):
            raise DataError(f"the captured reference activations are of sites {list(ref.sites)}, batch size "
                            f"{ref.batch_size} and {ref.n_rows} rows; these SAEs read {list(sites)}, with batch size "
                            f"{batch_size} on {len(examples)} rows. Capture them again for these.")
        names = {"reference": "captured reference activations"}
    else:
        ref = held_out_activations(reference, saes, examples, batch_size, progress)
        names = {"reference": model_name(reference)}
    check_context(other, examples.tokens)
    device = next(other.original_model.parameters()).device
    saes = [sae.to(device) for sae in saes]
    sums = [_LatentSums(len(examples), sae.d_sae, device) for sae in saes]
    separator = separator_of(examples)
    bar = tqdm(total=len(examples), desc="SAE latents", unit="row", disable=not show_progress(progress))
    for i, (start, end) in enumerate(batches(len(examples), batch_size)):
        tokens, lengths = aligned_rows(examples, start, end, device)
        keep = sae_positions(tokens, lengths, separator)
        rows = keep.nonzero()[:, 0] + start
        if not torch.equal(rows.cpu(), ref.rows[i].cpu()):
            raise DataError("the captured reference activations are of other positions than these examples: "
                            "capture them again on the same examples.")
        b_x = residuals(other, tokens, keep, list(ref.sites))
        for (_, layer), sae, acc in zip(ref.sites, saes, sums, strict=True):
            acc.add(sae, ref.batches[i][layer].to(device), b_x[layer], rows)
        bar.update(end - start)
    bar.close()
    return [acc.finish({**names, "other": model_name(other), "hook_name": sae.hook_name, "d_sae": sae.d_sae,
                        "examples": dict(examples.settings), "batch_size": batch_size})
            for sae, acc in zip(saes, sums, strict=True)]
