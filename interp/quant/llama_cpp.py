"""llama.cpp's tensor types, its ``_M`` / ``_S`` mixes, and its ``--tensor-type-file`` format.

This module is interp's model of how ``llama-quantize`` picks a type per tensor, written
from the facts in ``docs/prescribe.md`` (read from llama.cpp's ``src/llama-quant.cpp``,
``ggml/src/ggml-common.h`` and ``tools/quantize``), so interp can use llama.cpp's own rule as
a baseline and write plans llama.cpp applies:

- **Sizes.** Each type stores blocks of ``block`` weights in ``nbytes`` bytes, so its bits
  per weight are ``8 * nbytes / block`` (Q4_K: 144 bytes per 256 weights, 4.5; Q6_K 6.5625;
  Q5_0: 22 bytes per 32, 5.5; Q8_0 8.5).
- **The mixes** (:func:`mix_types`): a base type, raised on ``attn_v`` and ``ffn_down`` in
  the layers :func:`use_more_bits` picks (Q4_K_M), in the first layers (Q4_K_S), or as
  Q3_K_M does; the output and a tied token embedding get Q6_K.
- **The shape fallback** (:func:`fallback`): a type whose block does not divide a tensor's
  input width (GGUF ``ne[0]``, interp's ``d_in``) is replaced: Q2_K and Q3_K by Q4_0, Q4_K by
  Q5_0, Q5_K by Q5_1, Q6_K by Q8_0; F16 if even that block does not divide. llama.cpp applies
  it after its rule *and* after a user's overrides, so the type a tensor ends up with is
  always the fallback's.
- **The tensor-type file**: whitespace-separated ``PATTERN=TYPE`` items; the pattern is a
  regular expression searched in the lowercased GGUF tensor name (the first matching item
  wins), the type a ggml type name in any case. interp writes one escaped full name per
  tensor (``blk\\.3\\.ffn_down\\.weight=q6_k``), so each item matches exactly one tensor.

Example:
    >>> from interp.quant.shapes import WeightShape
    >>> shapes = [WeightShape(0, "v", 192, 576), WeightShape(0, "down", 576, 1536)]
    >>> mix_types(shapes, "Q4_K_M", n_layers=1)  # layer 0 of 1 gets more bits
    {'0.v': 'q6_k', '0.down': 'q6_k'}
    >>> [fallback(t, s.d_in) for t, s in zip(mix_types(shapes, "Q4_K_M", 1).values(), shapes)]
    ['q8_0', 'q6_k']
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from interp.errors import SpecError
from interp.quant.shapes import WeightShape

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["GGML_TYPES", "LEGACY_TYPES", "MIXES", "STORED_TYPES", "bits_per_weight", "embedding_type", "fallback",
           "gguf_block_weights", "gguf_name", "mix_types", "quantize_blocks", "read_tensor_types",
           "resolve_tensor_types", "stored_weight", "tensor_bytes", "tensor_type_lines", "type_for_bits",
           "types_average_bits", "use_more_bits", "write_tensor_types"]

# type -> (weights per block, bytes per block), from the block structs of ggml-common.h
GGML_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2),
    "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
    "q2_k": (256, 84), "q3_k": (256, 110), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
}
FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
MIXES = ("Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_M")
ROLE_TENSORS = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate",
                "up": "ffn_up", "down": "ffn_down"}
# interp's bit widths as llama.cpp types (before the shape fallback): the K-quant of that width, Q8_0 for 8
BITS_TYPES = {2: "q2_k", 3: "q3_k", 4: "q4_k", 5: "q5_k", 6: "q6_k", 8: "q8_0", 16: "f16"}


def check_type(name: str) -> str:
    """``name`` as a lowercase ggml type interp knows the size of (SpecError otherwise)."""
    key = name.strip().lower()
    if key not in GGML_TYPES:
        raise SpecError(f"unknown llama.cpp tensor type {name!r}; use one of {', '.join(GGML_TYPES)}")
    return key


def bits_per_weight(ggml_type: str) -> float:
    """Bits per weight of a type: ``8 * bytes per block / weights per block``.

    Example:
        >>> [bits_per_weight(t) for t in ("q3_k", "q4_k", "q5_0", "q6_k", "q8_0")]
        [3.4375, 4.5, 5.5, 6.5625, 8.5]
    """
    block, nbytes = GGML_TYPES[check_type(ggml_type)]
    return 8 * nbytes / block


def tensor_bytes(ggml_type: str, d_out: int, d_in: int) -> int:
    """Bytes llama.cpp stores for a ``[d_out, d_in]`` weight of ``ggml_type`` (whose block divides ``d_in``).

    Example:
        >>> tensor_bytes("q4_k", 576, 1536), tensor_bytes("q5_0", 192, 576)  # 576 rows of 6 and 192 of 18 blocks
        (497664, 76032)
    """
    block, nbytes = GGML_TYPES[check_type(ggml_type)]
    return d_out * (d_in // block) * nbytes


def fallback(ggml_type: str, d_in: int) -> str:
    """The type llama.cpp actually stores for a tensor of input width ``d_in`` asked to be ``ggml_type``."""
    wanted = check_type(ggml_type)
    if d_in % GGML_TYPES[wanted][0] == 0:
        return wanted
    replacement = FALLBACK.get(wanted, "f16")
    return replacement if d_in % GGML_TYPES[replacement][0] == 0 else "f16"


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits: the first and last eighth, and every third between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def _mix_type(mix: str, layer: int, role: str, n_layers: int) -> str:
    """The type ``mix`` asks for one block linear weight (before the shape fallback)."""
    if mix == "Q3_K_M":
        if role == "v":
            return "q5_k" if layer < 2 else "q4_k"
        if role == "down":
            return "q5_k" if layer < n_layers // 16 else "q4_k"
        return "q4_k" if role == "o" else "q3_k"
    if mix == "Q4_K_S":
        if role == "v" and layer < 4 or role == "down" and layer < n_layers // 8:
            return "q5_k"
        return "q4_k"
    base = "q4_k" if mix == "Q4_K_M" else "q5_k"
    return "q6_k" if role in ("v", "down") and use_more_bits(layer, n_layers) else base


def mix_types(shapes: Sequence[WeightShape], mix: str, n_layers: int | None = None) -> dict[str, str]:
    """``"layer.role"`` -> the type llama.cpp's ``mix`` asks for each block linear weight (before the fallback).

    ``n_layers`` defaults to one more than the largest layer in ``shapes``. The output and tied
    embedding (Q6_K, or Q8_0 where the width forbids it) are not block linear weights: see
    ``embedding_type``.
    """
    if mix not in MIXES:
        raise SpecError(f"unknown llama.cpp mix {mix!r}; use one of {', '.join(MIXES)}")
    n = n_layers if n_layers is not None else 1 + max(s.layer for s in shapes)
    return {s.name: _mix_type(mix, s.layer, s.role, n) for s in shapes}


def embedding_type(width: int) -> str:
    """The output (or tied token embedding) type of every ``_M``/``_S`` mix: Q6_K, Q8_0 if ``width`` forbids it."""
    return "q6_k" if width % GGML_TYPES["q6_k"][0] == 0 else "q8_0"


def stored_types(shapes: Sequence[WeightShape], types: Mapping[str, str]) -> dict[str, str]:
    """Each weight's type after the shape fallback."""
    return {s.name: fallback(types[s.name], s.d_in) for s in shapes}


def types_average_bits(shapes: Sequence[WeightShape], types: Mapping[str, str]) -> float:
    """Average bits per weight over ``shapes`` with ``types`` (the fallback applied)."""
    stored = stored_types(shapes, types)
    total = sum(s.size * bits_per_weight(stored[s.name]) for s in shapes)
    return total / sum(s.size for s in shapes)


def type_for_bits(bits: int, d_in: int) -> str:
    """The llama.cpp type that stores an interp width ``bits`` for input width ``d_in`` (fallback applied)."""
    if bits not in BITS_TYPES:
        raise SpecError(f"llama.cpp has no type for {bits}-bit weights; use one of {', '.join(map(str, BITS_TYPES))}")
    return fallback(BITS_TYPES[bits], d_in)


def gguf_name(layer: int, role: str) -> str:
    """The GGUF tensor name of a block linear weight, e.g. ``blk.3.ffn_down.weight``."""
    return f"blk.{layer}.{ROLE_TENSORS[role]}.weight"


def tensor_type_lines(shapes: Sequence[WeightShape], types: Mapping[str, str]) -> list[str]:
    """One ``PATTERN=type`` item per weight, the pattern its escaped GGUF name, the type after the fallback."""
    stored = stored_types(shapes, types)
    return [f"{re.escape(gguf_name(s.layer, s.role))}={stored[s.name]}" for s in shapes]


def write_tensor_types(path: str | os.PathLike[str], shapes: Sequence[WeightShape],
                       types: Mapping[str, str]) -> Path:
    """Write a ``llama-quantize --tensor-type-file`` giving every weight in ``shapes`` its type."""
    from interp.io import write_text

    return write_text(path, "\n".join(tensor_type_lines(shapes, types)) + "\n")


def read_tensor_types(path: str | os.PathLike[str], tensor_names: Sequence[str] | None = None
                      ) -> list[tuple[str, str]]:
    """Read a tensor-type file as ``llama-quantize`` does: ``(pattern, type)`` items, patterns lowercased.

    Raises:
        SpecError: an unreadable file, an item without ``=``, an empty pattern or type, a type
            interp does not know, a pattern that is not a regular expression, or (with
            ``tensor_names``, the model's GGUF tensor names) a pattern that names no tensor.
    """
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise SpecError(f"cannot read the tensor-type file {path}: {error}") from None
    items = []
    for item in text.split():
        pattern, sep, type_name = item.partition("=")
        if not sep or not pattern or not type_name:
            raise SpecError(f"tensor-type file {path}: item {item!r} is not PATTERN=TYPE (e.g. "
                            f"blk\\.3\\.ffn_down\\.weight=q6_k)")
        pattern = pattern.lower()
        try:
            compiled = re.compile(pattern)
        except re.error as error:
            raise SpecError(f"tensor-type file {path}: {pattern!r} is not a regular expression ({error})") from None
        if tensor_names is not None and not any(compiled.search(name) for name in tensor_names):
            raise SpecError(f"tensor-type file {path}: {pattern!r} names no tensor of this model (names look "
                            f"like {tensor_names[0]})")
        items.append((pattern, check_type(type_name)))
    return items


def resolve_tensor_types(shapes: Sequence[WeightShape], items: Sequence[tuple[str, str]], mix: str,
                         n_layers: int | None = None) -> dict[str, tuple[str, str]]:
    r"""``"layer.role"`` -> ``(stored type, pattern)``: what ``llama-quantize MIX --tensor-type-file`` stores.

    As llama.cpp does it: tensors go in file order (by layer); the first item whose pattern is
    found in a tensor's name sets its type (``pattern`` is that item's, ``""`` where none
    matched); an unmatched weight gets the mix's rule, whose ``attn_v`` and ``ffn_down`` layer
    index counts only the earlier weights of that role the rule itself typed (a file that
    overrides ``blk.1.attn_v`` moves every later ``attn_v`` bump down one layer); the shape
    fallback applies last, to both.

    Example:
        >>> shapes = [WeightShape(i, "v", 192, 576) for i in range(16)]
        >>> got = resolve_tensor_types(shapes, [(r"blk\.1\.", "q5_0")], "Q4_K_M")
        >>> [got[f"{i}.v"][0] for i in (1, 2, 3)]  # 2 is the rule's second weight: one of the first 16/8
        ['q5_0', 'q8_0', 'q5_0']
    """
    if mix not in MIXES:
        raise SpecError(f"unknown llama.cpp mix {mix!r}; use one of {', '.join(MIXES)}")
    compiled = [(re.compile(pattern), pattern, check_type(t)) for pattern, t in items]
    n = n_layers if n_layers is not None else 1 + max(s.layer for s in shapes)
    counted = {"v": 0, "down": 0}  # llama.cpp's i_attention_wv and i_ffn_down
    out = {}
    for s in sorted(shapes, key=lambda w: w.layer):
        name = gguf_name(s.layer, s.role)
        match = next(((pattern, t) for regex, pattern, t in compiled if regex.search(name)), None)
        if match is not None:
            pattern, asked = match
        else:
            pattern, asked = "", _mix_type(mix, counted.get(s.role, s.layer), s.role, n)
            if s.role in counted:
                counted[s.role] += 1
        out[s.name] = (fallback(asked, s.d_in), pattern)
    return out


TENSOR_ROLES = {tensor: role for role, tensor in ROLE_TENSORS.items()}


def _unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the row order llama.cpp's converter gives a llama ``attn_q``/``attn_k`` (rotary halves interleaved)."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_block_weights(path: str | os.PathLike[str]) -> dict[tuple[int, str], tuple[str, np.ndarray]]:
    """Every block linear weight of a GGUF file, dequantized: ``(layer, role) -> (ggml type, float32 [d_out, d_in])``.

    The values are what llama.cpp computes with (gguf-py's dequantization of the stored blocks),
    in Hugging Face's row order: a ``llama`` file's ``attn_q`` and ``attn_k`` rows are put back
    from the converter's rotary order, as transformers does when it loads the file.

    Raises:
        SpecError: the file is not a GGUF file gguf-py can read.
    """
    import gguf
    import numpy

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as error:
        raise SpecError(f"cannot read {path} as a GGUF file ({error})") from None
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def field_int(key: str) -> int | None:
        found = reader.fields.get(f"{arch}.{key}")
        return None if found is None else int(found.parts[-1][0])

    heads = {"attn_q": field_int("attention.head_count"), "attn_k": field_int("attention.head_count_kv")}
    out = {}
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight" or parts[2] not in TENSOR_ROLES:
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(numpy.float32)
        values = values.reshape(int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF shapes are [ne0 = d_in, ne1 = d_out]
        n_heads = heads.get(parts[2])
        if arch == "llama" and n_heads:
            values = _unpermute_rows(values, n_heads)
        out[int(parts[1]), TENSOR_ROLES[parts[2]]] = (tensor.tensor_type.name.lower(), values)
    return out


# types interp can store exactly as llama-quantize does (without an importance matrix): gguf-py's reference
# quantizers, byte-identical to llama.cpp's (tests/test_gguf_weights.py, against llama-quantize's own blocks)
LEGACY_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
# every type interp stores as llama-quantize does, with or without an importance matrix: the legacy types and the
# K-quants (interp.quant.kquants; tests/test_kquants.py checks the bytes against llama-quantize's)
STORED_TYPES = (*LEGACY_TYPES, "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")


def quantize_blocks(values: np.ndarray, ggml_type: str, importance: np.ndarray | None = None) -> np.ndarray:
    """The stored blocks (``uint8 [rows, bytes per row]``) of float32 rows, as llama-quantize writes them.

    ``importance``: the ``[d_in]`` values ``llama-quantize --imatrix`` passes for this tensor
    (:func:`interp.quant.kquants.llama_importance`), or None for a file made without an
    importance matrix. The legacy types without one go through gguf-py's reference quantizers;
    K-quants, and Q4_0 ... Q5_1 with one, through :mod:`interp.quant.kquants` (Q8_0 ignores it,
    as llama.cpp does).

    Raises:
        SpecError: a type outside :data:`STORED_TYPES`, rows whose width the type's block does
            not divide, or an importance of another width.
    """
    import gguf
    import numpy

    from interp.quant import kquants

    wanted = check_type(ggml_type)
    if wanted not in STORED_TYPES:
        raise SpecError(f"interp stores only {', '.join(STORED_TYPES)} without llama.cpp; {wanted} needs "
                        "llama-quantize")
    rows = numpy.ascontiguousarray(values, dtype=numpy.float32)
    if rows.shape[-1] % GGML_TYPES[wanted][0]:
        raise SpecError(f"{wanted} stores blocks of {GGML_TYPES[wanted][0]} weights; rows of {rows.shape[-1]} do not "
                        "split into them")
    if wanted in kquants.KQUANT_TYPES:
        return kquants.quantize(rows, wanted, importance)
    if importance is not None and wanted != "q8_0":
        return kquants.quantize_legacy(rows, wanted, importance)
    return gguf.quants.quantize(rows, gguf.GGMLQuantizationType[wanted.upper()])


def stored_weight(weight: torch.Tensor, ggml_type: str, importance: np.ndarray | None = None) -> torch.Tensor:
    """``weight`` ``[d_out, d_in]`` as llama.cpp stores it in ``ggml_type`` (with ``importance`` where the file is
    made with an importance matrix: see :func:`quantize_blocks`), dequantized (float32)."""
    import gguf
    import torch

    blocks = quantize_blocks(weight.detach().float().cpu().numpy(), ggml_type, importance)
    values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[ggml_type.upper()])
    # host: gguf quantizes in numpy; the dequantized weight goes back to the weight's device, once
    return torch.from_numpy(values.reshape(weight.shape).copy()).to(weight.device)
