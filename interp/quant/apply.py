"""Quantize a whole model: every linear layer of every transformer block, on a copy.

:func:`quantize` deep-copies the reference model and replaces each block's q, k, v, o,
gate, up and down weights by their fake-quantized versions (see
:mod:`interp.quant.methods`). Embeddings, the (tied) unembedding and the norm gammas are
left as they are, as in the reference paper. The reference model is never modified.

Calibrated methods (GPTQ, AWQ) need the inputs of each linear layer on calibration text.
They are collected *sequentially*, as GPTQ does: the calibration activations entering
block ``l`` are those produced by the already-quantized blocks ``0..l-1``, and inside a
block the sub-layers are quantized in forward order, each seeing the outputs of the
sub-layers quantized before it ("true sequential"):

========  ===================================  ============================
step      linear layers                        their input
========  ===================================  ============================
1         q, k, v (one shared input)           RMSNorm1(resid_pre)
2         o                                    attention mix ``z``
3         gate, up (one shared input)          ``h`` = RMSNorm2(resid_mid)
4         down                                 act(gate) * up
========  ===================================  ============================

The inputs are read at the bridge hook points named by
:func:`interp.runtime.hooks.linear_input_hook`; every token position, BOS included, is a
calibration row; in padded calibration examples only the real tokens are (each batch is
left-aligned and the pad positions are dropped before any statistic, see
:class:`~interp.quant.calibration.LayerFeeder`). Each block is run on its own (its inputs
are kept between blocks): one forward per calibration batch that pauses at each group's input while the group is
quantized (:class:`~interp.quant.calibration.PausedBlock`), checked on the first block to
give the same inputs to the bit as re-running the block from its start for each group
(about 2.3 block forwards), which is used instead when it does not. Each group's inputs
are one ``LayerInputs``, so the layers that share them (q, k,
v; gate, up) share ``X^T X`` and the other statistics the quantizers derive from them.

Quantized models can be saved (:func:`~interp.quant.saving.save_quantized`: safetensors of the block weights
plus JSON provenance) and loaded onto a fresh copy of the reference without redoing the
work (:func:`~interp.quant.saving.load_quantized`). :func:`quantize_cached` does both through a disk cache
keyed by (reference hash, canonical spec, calibration hash).

Example:
    >>> import interp
    >>> from interp.quant import quantize
    >>> model = interp.tiny_model("llama")
    >>> qmodel = quantize(model, "rtn:bits=4,group=32", progress=False)
    >>> qmodel.quant_info.spec
    'rtn:bits=4,group=32,zero=float'
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from tqdm.auto import tqdm

from interp import models
from interp.data import Examples
from interp.errors import ComponentError, InterpError, SpecError
from interp.io import ensure_writable_dir
from interp.models import Model, copy_model, model_hash, model_name  # model_hash is re-exported here
from interp.quant.calibration import FEEDER_VERSION, LayerFeeder, OutOfOrder
from interp.quant.methods import LayerInputs, relative_error
from interp.quant.methods._common import quantize_parsed
from interp.quant.saving import (  # noqa: F401 (saving and loading, importable from here as before)
    FORMAT_VERSION,
    INFO_FILE,
    QUANTIZED_KIND,
    WEIGHTS_FILE,
    QuantInfo,
    _file_sha256,
    _info_from_record,
    _is_saved_quantized,
    _label,
    load_quantized,
    quantized_model_info,
    read_quant_info,
    save_quantized,
)
from interp.quant.spec import METHODS, MethodSpec, parse_spec
from interp.runtime import hooks, placement
from interp.runtime.batching import check_examples, device_of, kernels, show_progress
from interp.validate import checked

ROLES: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
# Linear layers that read the same input, in the order the forward pass reaches them.
SHARED_INPUT_GROUPS: tuple[tuple[str, ...], ...] = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))
@dataclass
class QuantLog:
    """What quantizing collects block by block (times, weight errors); the
    :class:`~interp.quant.saving.QuantInfo` is built from it once."""

    layer_seconds: list[float] = field(default_factory=list)
    role_seconds: dict[str, float] = field(default_factory=dict)
    relative_errors: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------
# Identities (cache keys)


def examples_hash(examples: Examples | None) -> str:
    """A short identity for a set of token rows (``"none"`` for ``None``).

    Padded rows also hash their attention mask (the same ids padded differently are other
    calibration text); unpadded rows hash as before.
    """
    if examples is None:
        return "none"
    digest = hashlib.sha256(str(tuple(examples.tokens.shape)).encode())
    digest.update(examples.tokens.to(torch.int64).cpu().contiguous().numpy().tobytes())
    if examples.padded:
        assert examples.attention_mask is not None
        digest.update(b"mask" + examples.attention_mask.to(torch.bool).cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _calibration_record(calibration: Examples | None) -> dict[str, Any] | None:
    if calibration is None:
        return None
    return {
        "hash": examples_hash(calibration),
        "n": len(calibration),
        "seq_len": calibration.seq_len,
        "settings": {k: v for k, v in calibration.settings.items() if isinstance(v, (str, int, float))},
    }


# ---------------------------------------------------------------------------------------
# Quantizing


def _check_quantizable(model: Model) -> None:
    try:
        found = hooks.linear_weights(model, 0)
    except (AttributeError, TypeError, IndexError):
        found = {}
    needed = [r for r in ROLES if r != "gate" or hooks.is_gated(model)]
    missing = [r for r in needed if r not in found]
    if missing:
        arch = getattr(getattr(model, "info", None), "architecture", type(model).__name__)
        raise ComponentError(
            f"quantize needs blocks with q/k/v/o and up/down (and gate, when gated) linear layers, separate or "
            f"fused; {arch} lacks {', '.join(missing)}."
        )


def _check_modules(model: Model, spec: MethodSpec) -> None:
    """Every module a per-module bit map names is a block linear weight of ``model``."""
    if not spec.modules:
        return
    n = hooks.n_layers(model)
    roles = [role for role in ROLES if role in hooks.linear_weights(model, 0)]
    unknown = [name for name in spec.modules
               if not (int(name.split(".")[0]) < n and name.split(".", 1)[1] in roles)]
    if unknown:
        raise SpecError(f"the spec's bit map names {', '.join(unknown[:3])}, which this model does not have; "
                        f"modules are LAYER.ROLE with LAYER 0..{n - 1} and ROLE one of {', '.join(roles)}")


@checked
def quantize(
    model: Model,
    spec: str | MethodSpec,
    calibration: Examples | None = None,
    progress: bool | None = None,
    batch_size: int = 8,
) -> Any:
    """A quantized copy of ``model``: every block linear weight fake-quantized with ``spec``.

    Args:
        model: the reference bridge (never modified).
        spec: a method spec such as ``"gptq:bits=3,group=64"``.
        calibration: Examples from the calibration split; required by gptq and awq,
            ignored (and not recorded) by the other methods.
        progress: a per-layer progress bar (default: when stderr is a terminal).
        batch_size: calibration examples per block forward.

    Returns:
        A new bridge with the quantized weights; ``.quant_info`` is a :class:`~interp.quant.saving.QuantInfo`
        and ``.info`` is the reference's, renamed, with a source hash of its own.

    Raises:
        SpecError: a bad spec, a group size not dividing a layer's input, or a calibrated
            method without calibration examples.
        ComponentError: a model whose blocks are not llama-style.

    Example:
        >>> import interp
        >>> from interp.quant import quantize
        >>> model = interp.tiny_model("llama")
        >>> qmodel = quantize(model, "nf:bits=3,group=32", progress=False)
        >>> qmodel is model, qmodel.quant_info.spec
        (False, 'nf:bits=3,group=32')
    """
    return _quantize(model, parse_spec(spec), calibration, progress, batch_size)  # the API's edge: parsed once


def _quantize(model: Model, spec: MethodSpec, calibration: Examples | None, progress: bool | None,
              batch_size: int) -> Any:
    """:func:`quantize` for a parsed spec (what the functions that call it inside interp pass)."""
    spec, calibration = _checked_request(model, spec, calibration)
    placement.refuse_offloaded(model, "quantize()", "Use interp.quant.inplace.quantize_in_place (or score, which "
                               "applies each spec in place), which quantizes the model's own weights block by block.")
    reference_hash = model_hash(model)
    qmodel = copy_model(model)
    qmodel.eval()
    info = _quantize_weights(qmodel, spec, calibration, reference_hash,
                             model_name(model), progress, batch_size)
    _label(qmodel, model, info)
    return qmodel


def _checked_request(model: Model, spec: MethodSpec, calibration: Examples | None
                     ) -> tuple[MethodSpec, Examples | None]:
    """The spec and its calibration (``None`` for a calibration-free method), checked against ``model``."""
    _check_quantizable(model)
    _check_modules(model, spec)
    if spec.needs_calibration and (calibration is None or len(calibration) == 0):
        raise SpecError(
            f"{spec.method} needs calibration text: pass calibration=interp.load_examples(..., "
            "split='calibration'), kept apart from the evaluation examples."
        )
    if not spec.needs_calibration:
        calibration = None
    if calibration is not None:
        check_examples(model, calibration)  # rows within the context and vocabulary, same tokenizer
    return spec, calibration


def _quantize_weights(qmodel: Model, spec: MethodSpec, calibration: Examples | None, reference_hash: str, name: str,
                      progress: bool | None, batch_size: int,
                      before_layer: Callable[[int], None] | None = None) -> QuantInfo:
    """Quantize ``qmodel``'s block weights in place, block after block; returns how.

    Only block ``l``'s weights are onloaded while it is quantized (for a model with offloaded
    blocks, see :func:`interp.runtime.placement.onloaded`). ``before_layer(l)`` runs before
    block ``l`` changes (the in-place path keeps the reference's weights there).
    """
    n = hooks.n_layers(qmodel)
    log = QuantLog()
    bar = tqdm(total=n, desc=f"quantize {spec.method}{spec.bits}", unit="layer", disable=not show_progress(progress))
    start = time.perf_counter()
    feeder = None
    if calibration is not None:  # padded rows: only their real tokens are calibration rows (see LayerFeeder)
        mask = calibration.attention_mask if calibration.padded else None
        feeder = LayerFeeder(qmodel, calibration.tokens, batch_size, mask=mask)
    calibration_seconds = time.perf_counter() - start
    for layer in range(n):
        layer_start = time.perf_counter()
        if before_layer is not None:
            before_layer(layer)
        with placement.onloaded(qmodel, [layer]):
            calibration_seconds += _quantize_block(qmodel, layer, spec, feeder, log)
        log.layer_seconds.append(time.perf_counter() - layer_start)
        bar.update(1)
    bar.close()
    return QuantInfo(spec=str(spec), reference_hash=reference_hash, reference_name=name,
                     calibration=_calibration_record(calibration), layer_seconds=log.layer_seconds,
                     role_seconds=log.role_seconds, calibration_seconds=calibration_seconds,
                     relative_errors=log.relative_errors, algorithm=_algorithm_version(spec))


def _quantize_block(qmodel: Model, layer: int, spec: MethodSpec, feeder: LayerFeeder | None, log: QuantLog) -> float:
    """Quantize block ``layer`` in place, sub-layer group by group; returns calibration seconds."""
    slots = hooks.linear_weights(qmodel, layer)
    groups = [roles for group in SHARED_INPUT_GROUPS if (roles := [r for r in group if r in slots])]
    if feeder is None:
        for roles in groups:
            _quantize_group(slots, roles, layer, spec, None, log)
        return 0.0
    if feeder.pauses is None:
        seconds, outputs = _first_calibrated_block(feeder, slots, groups, layer, spec, log)
    elif feeder.pauses:
        seconds, outputs = _calibrated_block_paused(feeder, slots, groups, layer, spec, log)
    else:
        seconds, outputs = _calibrated_block_rerun(feeder, slots, groups, layer, spec, log)
    feeder.advance(layer, outputs)
    return seconds


def _quantize_group(slots: dict[str, Any], roles: list[str], layer: int, spec: MethodSpec, inputs: Any,
                    log: QuantLog) -> None:
    """Quantize the linear layers ``roles`` of one block, which read one input (``inputs``: its LayerInputs)."""
    for role in roles:
        # [out, in] even where the model stores [in, out] (GPT-2's Conv1D) or fuses q/k/v
        # or gate/up in one matrix: each logical matrix is quantized on its own
        weight = slots[role].read().detach()
        tick = time.perf_counter()
        quantized = quantize_parsed(weight, spec.for_module(layer, role), inputs)  # a plan's own width
        log.role_seconds[role] = log.role_seconds.get(role, 0.0) + time.perf_counter() - tick
        log.relative_errors[f"{layer}.{role}"] = relative_error(weight, quantized)
        slots[role].write(quantized)


def _layer_inputs(X: torch.Tensor, spec: MethodSpec) -> LayerInputs:
    """One group's calibration inputs, checked once and shared by its layers (their X^T X, mean |x|, ...)."""
    return LayerInputs.checked(X, X.shape[-1], spec.method)


def _calibrated_block_paused(feeder: LayerFeeder, slots: dict[str, Any], groups: list[list[str]], layer: int,
                             spec: MethodSpec, log: QuantLog, record: list[torch.Tensor] | None = None,
                             ) -> tuple[float, list[torch.Tensor]]:
    """One forward of the block per batch, paused at each group's input.

    See :class:`~interp.quant.calibration.PausedBlock`.
    """
    seconds = 0.0
    with feeder.paused(layer, groups) as block:
        for index, roles in enumerate(groups):
            tick = time.perf_counter()
            X = block.inputs(index)
            seconds += time.perf_counter() - tick
            if record is not None:
                record.append(X)
            _quantize_group(slots, roles, layer, spec, _layer_inputs(X, spec), log)
        tick = time.perf_counter()
        outputs = block.outputs()
        seconds += time.perf_counter() - tick
    return seconds, outputs


def _calibrated_block_rerun(feeder: LayerFeeder, slots: dict[str, Any], groups: list[list[str]], layer: int,
                            spec: MethodSpec, log: QuantLog) -> tuple[float, list[torch.Tensor]]:
    """The block re-run from its start for each group's input, and once more for its output."""
    seconds = 0.0
    for roles in groups:
        tick = time.perf_counter()
        X = feeder.inputs(layer, roles[0])
        seconds += time.perf_counter() - tick
        _quantize_group(slots, roles, layer, spec, _layer_inputs(X, spec), log)
    tick = time.perf_counter()
    outputs = feeder.outputs(layer)
    return seconds + time.perf_counter() - tick, outputs


def _first_calibrated_block(feeder: LayerFeeder, slots: dict[str, Any], groups: list[list[str]], layer: int,
                            spec: MethodSpec, log: QuantLog) -> tuple[float, list[torch.Tensor]]:
    """The paused forward on the first block, checked bit for bit against re-running it; the re-run if they differ.

    The check re-runs the block up to each group's input with the groups before it
    quantized and the others not (their weights as they were), then the whole quantized
    block, and compares every input and output. It decides :attr:`LayerFeeder.pauses` for
    the remaining blocks (a block that computes a group's linear layers before it reaches
    their input hook would fail it).
    """
    roles = [role for group in groups for role in group]
    originals = {role: slots[role].read().detach().clone() for role in roles}
    recorded: list[torch.Tensor] = []
    try:
        seconds, outputs = _calibrated_block_paused(feeder, slots, groups, layer, spec, log, record=recorded)
        feeder.pauses = _replays(feeder, slots, groups, layer, originals, recorded, outputs)
    except OutOfOrder:  # the block reached the groups' inputs out of order
        feeder.pauses = False
    if feeder.pauses:
        return seconds, outputs
    for role in roles:
        slots[role].write(originals[role])
    return _calibrated_block_rerun(feeder, slots, groups, layer, spec, log)


def _replays(feeder: LayerFeeder, slots: dict[str, Any], groups: list[list[str]], layer: int,
             originals: dict[str, torch.Tensor], recorded: list[torch.Tensor], outputs: list[torch.Tensor]) -> bool:
    """Whether re-running the block gives the paused forward's inputs and outputs to the bit (weights restored)."""
    quantized = {role: slots[role].read().detach().clone() for role in originals}
    same = True
    for index, roles in enumerate(groups):
        for position, group in enumerate(groups):
            for role in group:
                slots[role].write(quantized[role] if position < index else originals[role])
        same = same and torch.equal(feeder.inputs(layer, roles[0]), recorded[index])
    for role, weight in quantized.items():
        slots[role].write(weight)
    return same and all(torch.equal(a, b) for a, b in zip(feeder.outputs(layer), outputs, strict=True))


# ---------------------------------------------------------------------------------------
# The disk cache (a quantized model's folder is written and read by interp.quant.saving)


def cached_quant_info(reference: Model, spec: str | MethodSpec, calibration: Examples | None = None,
                      cache_dir: str | os.PathLike[str] | None = None) -> QuantInfo | None:
    """How the cached quantized model for ``spec`` was made, read from its ``quant.json`` without
    loading the weights; ``None`` when the cache has no complete model of ``reference`` for it.

    Example:
        >>> import tempfile
        >>> import interp
        >>> from interp.quant import quantize_cached
        >>> from interp.quant.apply import cached_quant_info
        >>> model, cache = interp.tiny_model("llama"), tempfile.mkdtemp()
        >>> cached_quant_info(model, "rtn:bits=4,group=32", cache_dir=cache) is None
        True
        >>> made = quantize_cached(model, "rtn:bits=4,group=32", cache_dir=cache, progress=False)
        >>> cached_quant_info(model, "rtn:bits=4,group=32", cache_dir=cache) == made.quant_info
        True
    """
    return _cached_quant_info(reference, parse_spec(spec), calibration, cache_dir)


def _cached_quant_info(reference: Model, spec: MethodSpec, calibration: Examples | None = None,
                       cache_dir: str | os.PathLike[str] | None = None) -> QuantInfo | None:
    """:func:`cached_quant_info` for a parsed spec."""
    calibration = calibration if spec.needs_calibration else None
    root = Path(cache_dir) if cache_dir is not None else models.cache_dir() / "quantized"
    record = read_quant_info(root / _cache_key(reference, spec, calibration))  # the key holds the reference's hash
    if record is None or record.get("spec") != str(spec):
        return None
    return _info_from_record(record)


def algorithm_version(spec: str | MethodSpec) -> str:
    """The version of the code that makes ``spec``'s weights, as the cache key and the quant info
    record it: the method's own (:attr:`~interp.quant.spec.Quantizer.version`) and, for a
    calibrated method, the calibration feeder's (:data:`interp.quant.calibration.FEEDER_VERSION`).

    Example:
        >>> from interp.quant.apply import algorithm_version
        >>> algorithm_version("rtn:bits=3"), algorithm_version("gptq:bits=3")
        ('rtn-v1', 'gptq-v1+feeder-v2')
    """
    return _algorithm_version(parse_spec(spec))


def _algorithm_version(spec: MethodSpec) -> str:
    """:func:`algorithm_version` for a parsed spec."""
    text = f"{spec.method}-v{METHODS[spec.method].version}"
    return f"{text}+feeder-v{FEEDER_VERSION}" if spec.needs_calibration else text


def cache_key(reference: Model, spec: str | MethodSpec, calibration: Examples | None) -> str:
    """The disk-cache key of a quantized model: (reference hash, canonical spec, calibration hash,
    kernels, algorithm version).

    The kernels (:func:`interp.runtime.batching.kernels`: ``cpu-AVX512``, ``cpu-AVX2``, a CUDA
    architecture) are part of the key because a calibrated quantizer's result depends on them:
    GPTQ 3-bit on SmolLM2 puts 28% of the weights on another grid level under AVX2 than under
    AVX-512 kernels. A cached model is therefore always what a fresh run here would make.

    So is the algorithm's version (:func:`~interp.quant.apply.algorithm_version`): a change to a quantizer, or to the
    calibration forwards that feed the calibrated ones, bumps it, and older cached results are no
    longer found.
    """
    return _cache_key(reference, parse_spec(spec), calibration)


def _cache_key(reference: Model, spec: MethodSpec, calibration: Examples | None) -> str:
    """:func:`cache_key` for a parsed spec."""
    calibration_hash = examples_hash(calibration) if spec.needs_calibration else "none"
    tag = kernels(device_of(reference))
    version = _algorithm_version(spec)
    key = hashlib.sha256(f"{model_hash(reference)}|{spec}|{calibration_hash}|{tag}|{version}".encode()).hexdigest()[:16]
    mixed = "-mix" if spec.modules else ""
    return f"{spec.method}{spec.bits}{mixed}-g{spec.group}-{key}"


@checked
def quantize_cached(
    reference: Model,
    spec: str | MethodSpec,
    calibration: Examples | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool | None = None,
    batch_size: int = 8,
) -> Any:
    """:func:`quantize`, through a disk cache: load the saved result if present, else quantize and save.

    Args:
        cache_dir: where quantized models are kept (default ``$INTERP_CACHE/quantized``).
        Other arguments as in :func:`quantize`.

    Example:
        >>> import tempfile, torch
        >>> import interp
        >>> from interp.quant import quantize_cached
        >>> model = interp.tiny_model("llama")
        >>> cache = tempfile.mkdtemp()
        >>> first = quantize_cached(model, "rtn:bits=4,group=32", cache_dir=cache, progress=False)  # quantizes, saves
        >>> again = quantize_cached(model, "rtn:bits=4,group=32", cache_dir=cache, progress=False)  # loads
        >>> tokens = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
        >>> bool(torch.equal(first(tokens), again(tokens)))
        True
    """
    return _quantize_cached(reference, parse_spec(spec), calibration, cache_dir, progress, batch_size)


def _quantize_cached(reference: Model, spec: MethodSpec, calibration: Examples | None = None,
                     cache_dir: str | os.PathLike[str] | None = None, progress: bool | None = None,
                     batch_size: int = 8) -> Any:
    """:func:`quantize_cached` for a parsed spec."""
    root = ensure_writable_dir(Path(cache_dir) if cache_dir is not None else models.cache_dir() / "quantized")
    folder = root / _cache_key(reference, spec, calibration)
    # One process quantizes; another asking for the same model waits, then loads its result.
    with FileLock(str(root / f"{folder.name}.lock")):
        record = read_quant_info(folder)
        if record is not None and record.get("spec") == str(spec):
            try:
                return load_quantized(reference, folder)
            except InterpError:
                pass  # a damaged or mislabelled folder: quantize again and replace it
        qmodel = _quantize(reference, spec, calibration, progress, batch_size)
        save_quantized(qmodel, folder)
    return qmodel
