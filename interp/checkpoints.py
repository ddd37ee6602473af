"""Read the checkpoints quantization libraries write: compressed-tensors, GPTQ and AWQ folders.

A quantized checkpoint stores each linear weight as integer levels packed into int32 words,
with per-group scales and zero-points. :func:`read_quantized_folder` unpacks them (with the
layouts below, written here from the formats' documented descriptions) and dequantizes
``w = (q - zero) * scale`` to float, so :func:`interp.load_model` can hand the analyses an
ordinary model whose weights are exactly the ones the runtime multiplies by (the
per-group dequantization is what these runtimes' CPU paths compute before the matmul).

Layouts (``q`` and ``zero`` unsigned ``bits``-bit integers, least significant bits first):

- **compressed-tensors** ``pack-quantized``: ``weight_packed [d_out, ceil(d_in*bits/32)]``,
  a dense bit stream per row (values may straddle words), levels stored as ``q - 2^(bits-1)``
  shifted back to unsigned; ``weight_zero_point`` (asymmetric) packed the same way along
  ``d_out``; ``weight_scale [d_out, n_groups]``. ``int-quantized``: ``weight`` int8
  ``[d_out, d_in]`` holding ``q - 2^(bits-1)`` and an unpacked zero-point. The runtime computes
  ``(x_q - zp) * scale``.
- **GPTQ** (``quant_method: gptq``): ``qweight [d_in*bits/32, d_out]``, ``32/bits`` levels per
  word along the *input* dimension; ``qzeros [n_groups, d_out*bits/32]`` packed along the
  output dimension, storing ``zero - 1`` (``checkpoint_format: gptq``, the v1 layout) or
  ``zero`` (``gptq_v2``); ``scales [n_groups, d_out]``; ``g_idx [d_in]``, the group of each
  input channel (any order under act-order). ``w[o, i] = scales[g, o] * (q[i, o] - zero[g, o])``,
  ``g = g_idx[i]``.
- **AWQ** (``quant_method: awq``, GEMM version): ``qweight [d_in, d_out/8]``, 4-bit levels
  packed along the *output* dimension in the interleaved order 0, 2, 4, 6, 1, 3, 5, 7 (the
  level of output ``8j + ORDER[k]`` sits at bits ``4k .. 4k+3`` of word ``j``); ``qzeros
  [n_groups, d_out/8]`` the same way; ``scales [n_groups, d_out]``; groups are consecutive
  input channels.

Example:
    >>> import torch
    >>> words = pack_int32(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]]), 4)
    >>> hex(int(words) & 0xFFFFFFFF), unpack_int32(words, 4, 8).tolist()
    ('0xf7654321', [[1, 2, 3, 4, 5, 6, 7, 15]])
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from interp.errors import ModelLoadError
from interp.loading import check_exact, check_folder, model_from_config, pretrained, read_config, tied_pairs

__all__ = ["FORMATS", "CheckpointInfo", "pack_int32", "quantization_config", "read_quantized_folder", "unpack_int32"]

FORMATS = ("compressed-tensors", "gptq", "awq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class CheckpointInfo:
    """What a quantized checkpoint is (attached to the loaded model as ``model.checkpoint_info``).

    Attributes:
        format: ``"compressed-tensors"``, ``"gptq"`` or ``"awq"``.
        layout: the format's own name for its layout (``"pack-quantized"``, ``"gptq"``, ``"gemm"``, ...).
        bits: bits per weight level.
        group: input channels per scale (``-1``: one per output row).
        symmetric: no zero-points stored (the zero is the middle level).
        modules: the Hugging Face names of the quantized linear layers.
        source: the folder.
    """

    format: str
    layout: str
    bits: int
    group: int
    symmetric: bool
    modules: tuple[str, ...]
    source: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pack_int32(values: Tensor, bits: int) -> Tensor:
    """Pack unsigned ``bits``-bit integers ``[rows, n]`` densely into int32 words along the last dimension.

    Element ``i`` of a row occupies bits ``i*bits .. i*bits+bits-1`` of the row's bit stream,
    word ``j`` holding stream bits ``32j .. 32j+31``; a row is padded with zeros to a multiple
    of 32 elements, then cut to ``ceil(n * bits / 32)`` words (compressed-tensors' dense layout;
    for 4 and 8 bits also GPTQ's, along its packing dimension).
    """
    rows, n = values.shape
    padded = math.ceil(n / 32) * 32
    stream = torch.nn.functional.pad(values.to(torch.int64), (0, padded - n))
    words = torch.zeros(rows, padded * bits // 32, dtype=torch.int64, device=values.device)
    for bit in range(bits):
        position = torch.arange(padded, dtype=torch.int64, device=values.device) * bits + bit  # where this bit goes
        words.index_add_(1, position // 32, ((stream >> bit) & 1) << (position % 32))
    words = torch.where(words >= 2**31, words - 2**32, words)  # the same 32 bits, as a signed int32
    return words[:, : math.ceil(n * bits / 32)].to(torch.int32).contiguous()


def unpack_int32(words: Tensor, bits: int, n: int) -> Tensor:
    """The inverse of :func:`pack_int32`: ``n`` unsigned ``bits``-bit integers per row (int32)."""
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    position = torch.arange(n, dtype=torch.int64, device=words.device) * bits
    values = torch.zeros(words.shape[0], n, dtype=torch.int64, device=words.device)
    for bit in range(bits):
        at = position + bit
        values |= ((unsigned[:, at // 32] >> (at % 32)) & 1) << bit
    return values.to(torch.int32)


def quantization_config(folder: Path) -> dict[str, Any] | None:
    """The ``quantization_config`` of a folder's ``config.json`` when it names a format read here, else ``None``."""
    if not (folder / "config.json").exists():
        return None
    config = read_config(folder / "config.json")  # bounded; a truncated config is a clear error, not "no format"
    qcfg = config.get("quantization_config") if isinstance(config, dict) else None
    if isinstance(qcfg, dict) and qcfg.get("quant_method") in FORMATS:
        return qcfg
    return None


def _bits_check(fmt: str, bits: int, allowed: tuple[int, ...]) -> None:
    if bits not in allowed:
        raise ModelLoadError(f"this {fmt} checkpoint has bits={bits}; interp reads {fmt} with bits in {allowed}.")


def _compressed_tensors(tensors: dict[str, Tensor], qcfg: dict[str, Any]) -> tuple[dict[str, Tensor], CheckpointInfo]:
    groups = [g for g in qcfg.get("config_groups", {}).values() if isinstance(g, dict) and g.get("weights")]
    args = {json.dumps(g["weights"], sort_keys=True) for g in groups}
    if len(args) != 1:
        raise ModelLoadError(f"this compressed-tensors checkpoint has {len(args)} different weight schemes; interp "
                             "reads checkpoints with one (e.g. W4A16 or W8A16).")
    weights = groups[0]["weights"]
    if weights.get("type", "int") != "int" or groups[0].get("input_activations"):
        activations = bool(groups[0].get("input_activations"))
        raise ModelLoadError("interp reads weight-only integer compressed-tensors checkpoints (W4A16, W8A16, ...); "
                             f"this one is {weights.get('type')}, activations quantized: {activations}.")
    bits, layout = int(weights["num_bits"]), str(qcfg.get("format", groups[0].get("format", "")))
    _bits_check("compressed-tensors", bits, tuple(range(1, 9)))
    offset = 2 ** (bits - 1)
    out, modules = {}, []
    for key in sorted(tensors):
        if not key.endswith(".weight_scale"):
            continue
        name = key.removesuffix(".weight_scale")
        scale = tensors[key].float()
        if f"{name}.weight_packed" in tensors:
            d_out, d_in = (int(x) for x in tensors[f"{name}.weight_shape"].tolist())
            levels = unpack_int32(tensors[f"{name}.weight_packed"], bits, d_in) - offset
            zero = tensors.get(f"{name}.weight_zero_point")
            if zero is not None:
                zero = unpack_int32(zero.T.contiguous(), bits, d_out).T - offset
        else:
            levels, zero = tensors[f"{name}.weight"], tensors.get(f"{name}.weight_zero_point")
        out[f"{name}.weight"] = _dequantize(levels, scale, zero)
        modules.append(name)
        for suffix in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"):
            tensors.pop(f"{name}.{suffix}", None)
    group = int(weights.get("group_size") or -1)
    return out, CheckpointInfo("compressed-tensors", layout, bits, group, bool(weights.get("symmetric")),
                               tuple(modules), "")


def _dequantize(levels: Tensor, scale: Tensor, zero: Tensor | None) -> Tensor:
    """``(levels - zero) * scale`` per group, ``scale``/``zero`` ``[d_out, n_groups]`` (or ``[d_out, 1]``)."""
    d_out, d_in = levels.shape
    n_groups = scale.reshape(d_out, -1).shape[1]
    x = levels.float().reshape(d_out, n_groups, d_in // n_groups)
    if zero is not None:
        x = x - zero.reshape(d_out, n_groups, 1).float()
    return (x * scale.reshape(d_out, n_groups, 1)).reshape(d_out, d_in)


def _unpack_columns(words: Tensor, bits: int, order: tuple[int, ...] | None = None) -> Tensor:
    """Levels packed ``32/bits`` per word along the last dimension; ``order[k]``: where the k-th field goes."""
    per_word = 32 // bits
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    fields = torch.stack([(unsigned >> (bits * k)) & (2**bits - 1) for k in range(per_word)], dim=-1)
    if order is not None:
        fields = fields[..., torch.argsort(torch.tensor(order, device=words.device))]
    return fields.reshape(*words.shape[:-1], words.shape[-1] * per_word)


def _gptq(tensors: dict[str, Tensor], qcfg: dict[str, Any]) -> tuple[dict[str, Tensor], CheckpointInfo]:
    bits = int(qcfg.get("bits", 4))
    _bits_check("GPTQ", bits, (2, 4, 8))
    offset = 1 if qcfg.get("checkpoint_format", "gptq") == "gptq" else 0  # v1 stores zero - 1
    out, modules = {}, []
    for key in sorted(k for k in tensors if k.endswith(".qweight")):
        name = key.removesuffix(".qweight")
        levels = _unpack_columns(tensors[key].T.contiguous(), bits)  # [d_out, d_in]
        zero = _unpack_columns(tensors[f"{name}.qzeros"], bits)[:, : levels.shape[0]] + offset  # [n_groups, d_out]
        scales = tensors[f"{name}.scales"].float()
        d_in = levels.shape[1]
        stored = tensors.get(f"{name}.g_idx")
        group = int(qcfg.get("group_size", -1))
        g_idx = (stored.long() if stored is not None
                 else torch.arange(d_in, device=levels.device) // (group if group > 0 else d_in))
        out[f"{name}.weight"] = (levels.float() - zero.T[:, g_idx].float()) * scales.T[:, g_idx]
        modules.append(name)
        for suffix in ("qweight", "qzeros", "scales", "g_idx"):
            tensors.pop(f"{name}.{suffix}", None)
    return out, CheckpointInfo("gptq", str(qcfg.get("checkpoint_format", "gptq")), bits,
                               int(qcfg.get("group_size", -1)), bool(qcfg.get("sym", True)), tuple(modules), "")


def _awq(tensors: dict[str, Tensor], qcfg: dict[str, Any]) -> tuple[dict[str, Tensor], CheckpointInfo]:
    bits = int(qcfg.get("bits", qcfg.get("w_bit", 4)))
    version = str(qcfg.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise ModelLoadError(f"interp reads AWQ checkpoints in the 4-bit GEMM layout; this one is {bits}-bit "
                             f"{version}.")
    group = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
    out, modules = {}, []
    for key in sorted(k for k in tensors if k.endswith(".qweight")):
        name = key.removesuffix(".qweight")
        levels = _unpack_columns(tensors[key], 4, AWQ_ORDER)  # [d_in, d_out]
        zero = _unpack_columns(tensors[f"{name}.qzeros"], 4, AWQ_ORDER)  # [n_groups, d_out]
        scales = tensors[f"{name}.scales"].float()
        groups = torch.arange(levels.shape[0], device=levels.device) // group
        out[f"{name}.weight"] = ((levels.float() - zero[groups].float()) * scales[groups]).T.contiguous()
        modules.append(name)
        for suffix in ("qweight", "qzeros", "scales"):
            tensors.pop(f"{name}.{suffix}", None)
    return out, CheckpointInfo("awq", version, bits, group, not bool(qcfg.get("zero_point", True)), tuple(modules), "")


READERS = {"compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq}


def read_quantized_folder(folder: Path, dtype: torch.dtype) -> tuple[dict[str, Tensor], dict[str, Any], CheckpointInfo]:
    """The dequantized state dict, the config (without its ``quantization_config``) and what the checkpoint is.

    Raises:
        ModelLoadError: an unsupported variant (bits, layout, activation quantization) or missing tensors.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    qcfg = quantization_config(folder)
    if qcfg is None:
        raise ModelLoadError(f"{folder} has no compressed-tensors, GPTQ or AWQ quantization_config.")
    check_folder(folder)  # the loading boundary: no auto_map, files inside the folder, headers that fit
    tensors: dict[str, Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:
            tensors.update(load_file(str(path)))
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path} cannot be read as safetensors ({exc}): it is truncated or corrupt.") from None
    method = str(qcfg["quant_method"])
    try:
        weights, info = READERS[method](tensors, qcfg)
    except (KeyError, RuntimeError, ValueError) as exc:
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(f"{folder} is not a complete {method} checkpoint ({type(exc).__name__}: {exc}).") from None
    if not weights:
        raise ModelLoadError(f"{folder} says it is a {method} checkpoint but holds no quantized weights.")
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in {**tensors, **weights}.items()}
    config = dict(read_config(folder / "config.json"))
    config.pop("quantization_config", None)
    return state, config, CheckpointInfo(**{**info.to_dict(), "source": str(folder)})


def load_quantized_hf(folder: Path, dtype: torch.dtype, device: str, tokenizer: Any) -> tuple[Any, Any, CheckpointInfo]:
    """The transformers model over the dequantized checkpoint in ``folder``, its tokenizer and what it was.

    :func:`interp.models.load_model` wraps the result in a bridge (this module sits below ``models``).
    """
    from transformers import AutoConfig, AutoTokenizer

    state, config, info = read_quantized_folder(folder, dtype)
    try:
        hf_config = AutoConfig.for_model(**config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{folder}/config.json is not a config transformers can build ({type(exc).__name__}: "
                             f"{exc}).") from None
    hf_model = model_from_config(hf_config, dtype=dtype)  # buffers (rotary) built, weights replaced
    tied = tied_pairs(hf_model)  # target -> source, when the config ties
    shapes = {k: tuple(v.shape) for k, v in hf_model.state_dict().items()}
    mismatched = {(k, tuple(v.shape), shapes[k]) for k, v in state.items()
                  if k in shapes and tuple(v.shape) != shapes[k]}
    # buffers older checkpoints saved and transformers itself skips (rotary frequencies, position ids)
    skipped = re.compile(r"rotary_emb\.inv_freq$|(^|\.)position_ids$")
    unexpected = {k for k in set(state) - set(shapes) if not skipped.search(k)}
    fitting = {k: v for k, v in state.items() if k in shapes and tuple(v.shape) == shapes[k]}
    loaded = hf_model.load_state_dict(fitting, strict=False)
    if tied:
        hf_model.tie_weights()
    missing = {k for k in loaded.missing_keys if not (k in tied and tied[k] in state)} - {m[0] for m in mismatched}
    # the same exactness check as every from_pretrained (interp.loading.check_exact), on load_state_dict's answer
    check_exact(hf_model, {"missing_keys": missing, "unexpected_keys": unexpected, "mismatched_keys": mismatched},
                folder, state.get)
    if tokenizer is None:
        try:
            tokenizer = pretrained(AutoTokenizer, folder)
        except ModelLoadError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"No usable tokenizer in {folder} ({type(exc).__name__}: {exc}).") from None
    return hf_model.to(device).eval(), tokenizer, info


def describe_in_memory(model: Any) -> Any:
    """Attach ``checkpoint_info`` to a bridge over a model quantized in memory by bitsandbytes (4- or 8-bit).

    The layers stay bitsandbytes' own (``Linear4bit``/``Linear8bitLt``): every forward of the
    analyses runs through bitsandbytes' arithmetic, not through a dequantized copy. Returns ``model``.
    """
    hf_model = model.original_model
    qcfg = getattr(hf_model.config, "quantization_config", None)
    method = getattr(qcfg, "quant_method", None) if not isinstance(qcfg, dict) else qcfg.get("quant_method")
    if "bitsandbytes" not in str(getattr(method, "value", method)):
        return model
    modules = tuple(name for name, module in hf_model.named_modules()
                    if type(module).__name__ in ("Linear4bit", "Linear8bitLt"))
    four = bool(getattr(qcfg, "load_in_4bit", False))
    info = CheckpointInfo("bitsandbytes", str(getattr(qcfg, "bnb_4bit_quant_type", "int8")) if four else "int8",
                          4 if four else 8, 64 if four else -1, True, modules, "memory")
    object.__setattr__(model, "checkpoint_info", info)
    return model
