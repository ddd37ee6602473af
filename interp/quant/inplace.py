"""One copy of the weights: quantized variants applied to the reference model in place.

:func:`~interp.quant.apply.quantize` returns a new model, so a run that compares the
reference with a quantized variant holds the weights twice (1.19x the weights' size more
than the reference alone, measured on SmolLM2 with ``score``). Here the reference model
itself carries each variant for a while instead:

the variant's weights are swapped in block by block, and the reference's own are kept on
disk meanwhile and put back bit for bit afterwards (:mod:`interp.runtime.swap`). A variant
is either quantized on the spot (:func:`quantize_in_place`, :func:`quantized_in_place`) or
read from a saved folder one block at a time (:func:`variant`, :class:`SavedWeights`).
:func:`cached_variant` finds or makes the folder in :func:`~interp.quant.apply.quantize_cached`'s cache.

While a variant is in place the model *is* that variant: do not use it as the reference
inside the ``with`` block (``model_hash`` of an in-memory model would change too).

Example:
    >>> import interp, torch
    >>> from interp.quant.inplace import quantized_in_place
    >>> model = interp.tiny_model("llama")
    >>> before = {k: v.clone() for k, v in model.original_model.state_dict().items()}
    >>> tokens = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    >>> with quantized_in_place(model, "rtn:bits=3,group=32", progress=False) as info:
    ...     changed = not torch.equal(model(tokens), model(tokens) * 0 + interp.tiny_model("llama")(tokens))
    >>> info.spec, changed, all(torch.equal(v, before[k]) for k, v in model.original_model.state_dict().items())
    ('rtn:bits=3,group=32,zero=float', True, True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from safetensors import safe_open

from interp import models
from interp.data import Examples
from interp.errors import InterpError
from interp.io import ensure_writable_dir
from interp.models import Model, model_name
from interp.quant.apply import (
    WEIGHTS_FILE,
    QuantInfo,
    _cache_key,
    _checked_request,
    _file_sha256,
    _info_from_record,
    _quantize_weights,
    model_hash,
    quantized_model_info,
    read_quant_info,
    save_quantized,
)
from interp.quant.saving import quant_record
from interp.quant.spec import MethodSpec, parse_spec
from interp.runtime import hooks
from interp.runtime.swap import WeightStash, swapped


def quantize_in_place(model: Model, spec: str | MethodSpec, calibration: Examples | None = None, *,
                      stash: WeightStash, progress: bool | None = None, batch_size: int = 8) -> QuantInfo:
    """Quantize ``model``'s own block weights with ``spec``, keeping the originals in ``stash``.

    The quantized weights equal :func:`~interp.quant.apply.quantize`'s bit for bit (the same
    code runs on the same values; tested). The caller restores the reference with
    ``stash.restore_all()``; :func:`quantized_in_place` does both.
    """
    return _quantize_in_place(model, parse_spec(spec), calibration, stash, progress, batch_size)


def _quantize_in_place(model: Model, spec: MethodSpec, calibration: Examples | None, stash: WeightStash,
                       progress: bool | None, batch_size: int) -> QuantInfo:
    """:func:`quantize_in_place` for a parsed spec."""
    parsed, calibration = _checked_request(model, spec, calibration)
    name = model_name(model)
    return _quantize_weights(model, parsed, calibration, model_hash(model), name, progress, batch_size,
                             before_layer=stash.save)


@contextlib.contextmanager
def quantized_in_place(model: Model, spec: str | MethodSpec, calibration: Examples | None = None, *,
                       progress: bool | None = None, batch_size: int = 8,
                       stash_dir: str | Path | None = None) -> Iterator[QuantInfo]:
    """Inside the block, ``model`` carries ``spec``'s quantized weights; after it, its own again (bit for bit)."""
    with WeightStash(model, stash_dir) as stash:
        try:
            yield quantize_in_place(model, spec, calibration, stash=stash, progress=progress, batch_size=batch_size)
        finally:
            stash.restore_all()


def _checked_record(reference: Model, folder: Path, reference_hash: str) -> dict[str, Any]:
    record = quant_record(folder)  # a missing, incomplete or damaged record: a DataError naming the key
    if record["reference_hash"] != reference_hash:
        raise InterpError(f"The quantized weights in {folder} were made from model {record['reference_hash']}, "
                          f"not from this reference ({reference_hash}). Quantize this model again.")
    if _file_sha256(folder / WEIGHTS_FILE) != record["weights_sha256"]:
        raise InterpError(f"The weights in {folder} are not the ones its quant.json describes ({record['spec']}): "
                          "delete the folder and quantize again.")
    return record


class SavedWeights:
    """The block weights saved in a quantized-model folder (:func:`~interp.quant.saving.save_quantized`),
    read one block at a time (the file is mapped only while a block is read): a
    :class:`~interp.runtime.swap.BlockWeights` source for :func:`~interp.runtime.swap.swapped`.

    Args:
        folder: the saved folder.
        reference: the model the weights go into; the folder must have been made from it.
        reference_hash: its :func:`~interp.models.model_hash`, when already known.

    Attributes:
        info: the weights' :class:`~interp.quant.saving.QuantInfo`.
        model_info: the ``info`` that :func:`~interp.quant.saving.load_quantized`'s copy would carry
            (``None`` for a reference without one), so ``model_hash`` of anything carrying it is the copy's.
        name: that copy's name (``"<reference>+<spec>"``), which results record for the target.
    """

    def __init__(self, folder: str | Path, reference: Model, reference_hash: str | None = None) -> None:
        self.folder = Path(folder)
        self.reference = reference
        record = _checked_record(reference, self.folder, reference_hash or model_hash(reference))
        self.info = _info_from_record(record)
        self.model_info = quantized_model_info(reference, self.info)
        self.name = model_name(self.reference) if self.model_info is None else self.model_info.name

    def block(self, layer: int) -> dict[str, torch.Tensor]:
        with safe_open(str(self.folder / WEIGHTS_FILE), framework="pt") as saved:
            return {role: saved.get_tensor(f"{layer}.{role}") for role in hooks.linear_weights(self.reference, layer)}


@contextlib.contextmanager
def variant(reference: Model, folder: str | Path, *, stash: WeightStash | None = None,
            reference_hash: str | None = None, layers: Iterable[int] | None = None) -> Iterator[QuantInfo]:
    """Inside the block, ``reference`` carries the quantized weights saved in ``folder``; after it, its own
    weights again, bit for bit (see :func:`interp.runtime.swap.swapped`).

    ``stash`` may be shared by several variants (the reference is stashed once);
    ``reference_hash`` saves hashing the reference again. ``layers`` limits the swap to those
    blocks (the others keep the reference's weights: layer restoration).
    """
    saved = SavedWeights(folder, reference, reference_hash)
    with swapped(reference, saved, layers=layers, stash=stash):
        yield saved.info


def cached_variant(reference: Model, spec: str | MethodSpec, calibration: Examples | None = None, *,
                   stash: WeightStash, cache_dir: str | Path | None = None, progress: bool | None = None,
                   batch_size: int = 8) -> Path:
    """The cache folder holding ``spec``'s quantized weights of ``reference``, quantizing in place if it is missing.

    The cache is :func:`~interp.quant.apply.quantize_cached`'s (same keys, same files, same lock),
    so either function finds what the other made. ``reference`` holds its own weights again on return.
    """
    return _cached_variant(reference, parse_spec(spec), calibration, stash=stash, cache_dir=cache_dir,
                           progress=progress, batch_size=batch_size)


def _cached_variant(reference: Model, parsed: MethodSpec, calibration: Examples | None = None, *,
                    stash: WeightStash, cache_dir: str | Path | None = None, progress: bool | None = None,
                    batch_size: int = 8) -> Path:
    """:func:`cached_variant` for a parsed spec (what ``score`` and the analyses pass)."""
    calibration = calibration if parsed.needs_calibration else None
    root = ensure_writable_dir(Path(cache_dir) if cache_dir is not None else models.cache_dir() / "quantized")
    folder = root / _cache_key(reference, parsed, calibration)
    with FileLock(str(root / f"{folder.name}.lock")):
        record = read_quant_info(folder)
        if record is not None and record.get("spec") == str(parsed):
            return folder
        try:
            info = _quantize_in_place(reference, parsed, calibration, stash, progress, batch_size)
            save_quantized(reference, folder, info=info)
        finally:
            stash.restore_all()
    return folder
