"""Activations for sparse autoencoders: the positions an SAE reads, captured once in resumable shards.

An SAE is trained and judged on the activations of a model at one hook point, over many
token positions: every position except BOS and the document separators of packed rows
(:func:`interp.data.load_packed_examples`). BOS's residual is an outlier hundreds of times larger
than the rest (SmolLM2's reaches norm ~25,000 from layer 10, against ~130 elsewhere), and a
separator carries no text; neither is what the SAE is asked to explain. :func:`sae_positions`
is the one definition every SAE statistic uses.

:func:`capture_activations` runs the model over token rows once and writes the residual
stream at several layers, counted positions only, to an interp output folder in shards of
whole rows. Each shard is written whole (to a temporary, then renamed), so a run killed at
any point leaves only whole shards; the rerun checks that the folder was made with the same
model, rows and settings, and computes the missing shards only. Batches never straddle
shards, so a resumed capture writes the same bytes as one that ran through. The folder says
``INCOMPLETE`` until the last shard is in, and :func:`load_activations` refuses it until then.

Values are stored as float16 by default: half the disk and memory of float32 (the 0.8M
training positions of SmolLM2 at three layers are 2.7 GB instead of 5.5 GB, and one layer,
0.9 GB, fits in memory while an SAE trains on it). The rounding is relative 2^-11 at most
(2^-12 on average) per value, which adds ~1e-7 of the activation's variance: 10^6 times below
the FVU bar of 0.2 it is trained to meet. Values beyond float16's range (65,504) are refused
rather than stored as inf; choose ``dtype="float32"`` then, as for held-out activations that
are compared across models at full precision.

Example:
    >>> import tempfile, torch, interp
    >>> from interp.localize.sae_data import capture_activations, load_activations
    >>> model = interp.tiny_model("llama")
    >>> rows = interp.Examples.from_tokens(torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(0)))
    >>> folder = capture_activations(model, rows, [0, 1], tempfile.mkdtemp() + "/acts", rows_per_shard=2)
    >>> acts = load_activations(folder, 1)
    >>> tuple(acts.values.shape), acts.values.dtype  # 3 rows x 11 positions (BOS left out), d_model 64
    ((33, 64), torch.float16)
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from tqdm.auto import tqdm

from interp.data import Examples, aligned_rows, counted_positions
from interp.errors import DataError, InterpError, NonFiniteError
from interp.io import check_complete, claim_folder, write_json, write_safetensors, writing
from interp.models import Model, model_hash, model_name
from interp.reading import JSON_LIMIT, read_json
from interp.runtime import hooks as hk
from interp.runtime.batching import StopForward, batches, check_context, show_progress
from interp.validate import checked

__all__ = ["Activations", "capture_activations", "load_activations", "residuals", "sae_positions"]

ACTIVATIONS_KIND = "sae-activations"
MANIFEST = "capture.json"
FLOAT16_MAX = float(torch.finfo(torch.float16).max)
StoredDtype = Literal["float16", "float32"]


def sae_positions(tokens: Tensor, lengths: Tensor | None, separator: int | None) -> Tensor:
    """``[B, T]`` bool: the positions an SAE reads in left-aligned rows (:func:`interp.data.aligned_rows`):
    real tokens, not position 0 (BOS), not the separator token (``None``: rows hold no separators).

    Example:
        >>> sae_positions(torch.tensor([[1, 5, 2, 6], [1, 7, 8, 2]]), None, separator=2).tolist()
        [[False, True, False, True], [False, True, True, False]]
    """
    if lengths is None:
        lengths = torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long, device=tokens.device)
    keep = counted_positions(lengths.to(tokens.device), tokens.shape[1], skip_first=True)
    keep[:, 0] = False
    if separator is not None:
        keep &= tokens != separator
    return keep


def separator_of(examples: Examples) -> int | None:
    """The document separator of packed rows (recorded by :func:`interp.data.load_packed_examples`), else None."""
    sep = examples.settings.get("separator") if examples.settings.get("packed") else None
    return int(sep) if isinstance(sep, int) and not isinstance(sep, bool) else None


def residuals(model: Model, tokens: Tensor, keep: Tensor, sites: Sequence[tuple[str, int]]) -> dict[int, Tensor]:
    """The activations at ``sites`` (``(component, layer)``) of one batch, at the positions ``keep`` only
    (``[P, d_model]`` each, rows in order, positions ascending), from one forward that stops after the last site.
    """
    store: dict[int, Tensor] = {}
    last = max(layer for _, layer in sites)

    def saver(layer: int) -> Any:
        def save(x: Tensor, hook: Any) -> None:
            store[layer] = x.detach()[keep.to(x.device)]
            if layer == last:
                raise StopForward
        return save

    fwd = [(hk.hook_point(model, component, layer), saver(layer)) for component, layer in sites]
    with torch.no_grad(), model.hooks(fwd_hooks=fwd):
        try:
            hk.decoder_body(model)(input_ids=tokens)
        except StopForward:
            pass
    return store


def _digest(examples: Examples) -> str:
    hashed = hashlib.sha256(examples.tokens.contiguous().numpy().tobytes())
    if examples.attention_mask is not None:
        hashed.update(examples.attention_mask.contiguous().numpy().tobytes())
    return hashed.hexdigest()[:16]


def _manifest(model: Model, examples: Examples, layers: list[int], batch_size: int, rows_per_shard: int,
              dtype: str) -> dict[str, Any]:
    n_shards = -(-len(examples) // rows_per_shard)
    return {"what": "residual stream at SAE positions (not BOS, not separators)", "model": model_name(model),
            "model_hash": model_hash(model), "rows": len(examples), "seq_len": examples.seq_len,
            "tokens_digest": _digest(examples), "examples": json.loads(json.dumps(examples.settings, default=str)),
            "layers": layers, "hook_names": [hk.hook_point(model, "resid_post", layer) for layer in layers],
            "separator": separator_of(examples), "dtype": dtype, "batch_size": batch_size,
            "rows_per_shard": rows_per_shard, "shards": n_shards}


def _shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _shard_done(path: Path, layers: list[int]) -> bool:
    """Whether ``path`` is a whole shard (written by rename, so present means whole; the header is checked too)."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as fh:
            return {"row", "position", *(f"layer{layer}" for layer in layers)} <= set(fh.keys())
    except (SafetensorError, OSError):
        return False


def _check_resumable(folder: Path, manifest: dict[str, Any]) -> None:
    path = folder / MANIFEST
    if not path.is_file():
        return
    saved = read_json(path, "an activation capture's manifest", limit=JSON_LIMIT)
    if saved != json.loads(json.dumps(manifest)):
        differ = sorted(k for k in set(saved) | set(manifest) if saved.get(k) != manifest.get(k)) \
            if isinstance(saved, dict) else ["all"]
        raise DataError(f"{folder} holds a capture of other settings (they differ in {', '.join(differ)}); a rerun "
                        "resumes only the same capture. Choose another folder for this one.")


def _shard(model: Model, examples: Examples, start: int, end: int, layers: list[int], batch_size: int,
           dtype: torch.dtype) -> dict[str, Tensor]:
    device = next(model.original_model.parameters()).device
    separator = separator_of(examples)
    parts: dict[str, list[Tensor]] = {"row": [], "position": [], **{f"layer{layer}": [] for layer in layers}}
    for s, e in batches(end - start, batch_size):
        tokens, lengths = aligned_rows(examples, start + s, start + e, device)
        keep = sae_positions(tokens, lengths, separator)
        found = residuals(model, tokens, keep, [("resid_post", layer) for layer in layers])
        where = keep.nonzero()  # [P, 2]: (row in batch, position), rows in order
        parts["row"].append((where[:, 0] + start + s).to("cpu", torch.int32))
        parts["position"].append(where[:, 1].to("cpu", torch.int32))
        for layer in layers:
            x = found[layer]
            if not bool(x.isfinite().all()):
                raise NonFiniteError(f"The residual at layer {layer} holds NaN or inf in rows "
                                     f"{start + s}..{start + e}: check the model's weights.")
            if dtype == torch.float16 and float(x.abs().max()) > FLOAT16_MAX:
                raise NonFiniteError(f"The residual at layer {layer} reaches {float(x.abs().max()):.4g}, beyond "
                                     f"float16's range ({FLOAT16_MAX:g}): capture with dtype='float32'.")
            parts[f"layer{layer}"].append(x.to("cpu", dtype))  # host: shards are files
    return {name: torch.cat(values).contiguous() for name, values in parts.items()}


@checked
def capture_activations(model: Model, examples: Examples, layers: Sequence[int], folder: str | os.PathLike[str],
                        batch_size: int = 8, rows_per_shard: int = 64, dtype: StoredDtype = "float16",
                        progress: bool | None = None) -> Path:
    """Write the residual stream after each block in ``layers`` (``resid_post``) at the SAE positions of
    ``examples`` (:func:`sae_positions`) into ``folder``, in shards of ``rows_per_shard`` rows; resumable.

    Args:
        model: the model whose activations are captured (its own device; shards are written from the host).
        examples: token rows; packed rows' separators (their ``settings["separator"]``) are left out.
        layers: block indices.
        folder: a new or empty folder, or an earlier, possibly killed, run of this same capture (then only the
            missing shards are computed).
        batch_size: rows per forward (within a shard).
        rows_per_shard: rows per file: a kill loses at most this many rows' work.
        dtype: ``"float16"`` (default; see the module docstring) or ``"float32"``.

    Returns:
        The folder: ``capture.json`` (model, rows, settings) and ``shard-NNNNN.safetensors`` files, each with
        ``row`` and ``position`` (int32 ``[P]``) and ``layer{L}`` (``[P, d_model]``) tensors.

    Raises:
        DataError: ``folder`` holds a capture of other settings.
        NonFiniteError: an activation is NaN or inf, or beyond float16's range with ``dtype="float16"``.
    """
    layers = hk.check_layers(model, layers)
    check_context(model, examples.tokens)
    if isinstance(rows_per_shard, bool) or not isinstance(rows_per_shard, int) or rows_per_shard < 1:
        raise InterpError(f"rows_per_shard must be a positive integer; got {rows_per_shard!r}.")
    manifest = _manifest(model, examples, layers, batch_size, rows_per_shard, dtype)
    real = claim_folder(folder, ACTIVATIONS_KIND)
    _check_resumable(real, manifest)
    stored = torch.float16 if dtype == "float16" else torch.float32
    with writing(real):
        write_json(real / MANIFEST, manifest)
        todo = [i for i in range(manifest["shards"]) if not _shard_done(real / _shard_name(i), layers)]
        bar = tqdm(total=len(examples), desc="capture activations", unit="row", disable=not show_progress(progress))
        bar.update(len(examples) - sum(min(len(examples), (i + 1) * rows_per_shard) - i * rows_per_shard
                                       for i in todo))
        for i in todo:
            start, end = i * rows_per_shard, min(len(examples), (i + 1) * rows_per_shard)
            tensors = _shard(model, examples, start, end, layers, batch_size, stored)
            write_safetensors(real / _shard_name(i), tensors, metadata={"rows": f"{start}-{end}"})
            bar.update(end - start)
        bar.close()
    return real


@dataclass(frozen=True)
class Activations:
    """One layer's captured activations, in the order they were captured.

    Attributes:
        values: ``[P, d_model]`` (the stored dtype; convert per batch).
        rows: ``[P]`` int32: the example row of each position.
        positions: ``[P]`` int32: its token position in that (left-aligned) row.
        layer: the block index.
        settings: the capture's manifest.
    """

    values: Tensor
    rows: Tensor
    positions: Tensor
    layer: int
    settings: dict[str, Any] = field(default_factory=dict)


def _read_manifest(folder: Path) -> dict[str, Any]:
    check_complete(folder, "activation capture")
    path = folder / MANIFEST
    if not path.is_file():
        raise DataError(f"{folder} is not an activation capture (no {MANIFEST}): capture_activations writes one.")
    manifest = read_json(path, "an activation capture's manifest", limit=JSON_LIMIT)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), int) \
            or not isinstance(manifest.get("layers"), list):
        raise DataError(f"{path} is not a capture manifest written by interp: capture again.")
    return manifest


def load_activations(folder: str | os.PathLike[str], layer: int, rows: Sequence[int] | range | None = None
                     ) -> Activations:
    """Read one layer of a finished capture (:func:`capture_activations`), optionally only some example rows.

    Memory is one copy of the selected positions: each shard's tensor is read, filtered and placed into one
    preallocated tensor.

    Raises:
        DataError: the folder is no finished capture, or it holds no ``layer``.
    """
    real = Path(folder)
    manifest = _read_manifest(real)
    if layer not in manifest["layers"]:
        raise DataError(f"{folder} holds layers {manifest['layers']}, not layer {layer}.")
    # host: a row mask over the shards read from disk, which load on the CPU
    wanted = None if rows is None else torch.zeros(int(manifest.get("rows", 0)), dtype=torch.bool)
    if wanted is not None and rows is not None:
        index = torch.as_tensor(list(rows), dtype=torch.long)  # host: indexes the CPU mask above
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= wanted.numel()):
            raise DataError(f"Rows {int(index.min())}..{int(index.max())} asked for; {folder} holds rows "
                            f"0..{wanted.numel() - 1}.")
        wanted[index] = True
    selections, total = [], 0
    for i in range(manifest["shards"]):
        path = real / _shard_name(i)
        row = _read(path, "row")
        keep = None if wanted is None else wanted[row.long()]
        selections.append((path, keep))
        total += int(row.numel() if keep is None else keep.sum())
    return _gather(selections, layer, total, manifest)


def _read(path: Path, name: str) -> Tensor:
    """One tensor of a shard; a missing or damaged shard (removed by hand: interp writes each whole) is refused."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            return fh.get_tensor(name)
    except (SafetensorError, OSError) as exc:
        raise DataError(f"Cannot read {name} from the activation shard {path} ({exc}): the capture was changed "
                        "after it finished. Capture again into a new folder.") from None


def _gather(selections: list[tuple[Path, Tensor | None]], layer: int, total: int, manifest: dict[str, Any]
            ) -> Activations:
    values: Tensor | None = None
    # host: the gathered activations are read from disk shards into host memory; the caller moves what it trains on
    rows = torch.empty(total, dtype=torch.int32)
    positions = torch.empty(total, dtype=torch.int32)  # host: as rows
    at = 0
    for path, keep in selections:
        x, row, pos = _read(path, f"layer{layer}"), _read(path, "row"), _read(path, "position")
        if keep is not None:
            x, row, pos = x[keep], row[keep], pos[keep]
        if values is None:
            values = torch.empty(total, x.shape[1], dtype=x.dtype)  # host: the capture's store
        values[at : at + len(row)] = x
        rows[at : at + len(row)] = row
        positions[at : at + len(row)] = pos
        at += len(row)
    if values is None:
        raise DataError(f"The capture holds no positions for layer {layer} in the rows asked for.")
    return Activations(values, rows, positions, layer, manifest)
