"""What the "full-precision" reference really is.

Both bundled models ship as GGUF files whose block weights are already quantized: every
one of SmolLM2-135M's 210 block linear weights is Q4_1 (groups of 32, affine), and
Gemma-3-270m is a Q4_K_M mix. interp dequantizes them to float32 and calls the result the
reference, so every page must say what it is: "GGUF Q4_1 dequantized to fp32 (4-bit,
group 32)". :func:`describe_reference` reads the tensor types from the GGUF file itself.

Example:
    >>> from interp.quant.reference import describe_types
    >>> describe_types({"Q4_1": 210})
    'GGUF Q4_1 dequantized to fp32 (4-bit, group 32; all 210 block linear weights)'
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

# GGUF block types: (bits per weight in the codes, block size, short description)
_TYPES = {
    "Q4_0": "4-bit, group 32", "Q4_1": "4-bit, group 32", "Q5_0": "5-bit, group 32", "Q5_1": "5-bit, group 32",
    "Q8_0": "8-bit, group 32", "Q4_K": "4-bit k-quant, super-block 256", "Q5_K": "5-bit k-quant, super-block 256",
    "Q6_K": "6-bit k-quant, super-block 256", "Q3_K": "3-bit k-quant, super-block 256",
    "Q2_K": "2-bit k-quant, super-block 256", "F16": "16-bit float", "BF16": "bfloat16", "F32": "32-bit float",
}
_LINEAR_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "attn_qkv")


def gguf_block_types(path: str | Path) -> Counter[str]:
    """How many block linear weights of each GGUF tensor type the file holds."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return Counter(t.tensor_type.name for t in reader.tensors
                   if t.name.startswith("blk.") and any(f".{part}." in t.name for part in _LINEAR_PARTS))


def describe_types(types: Counter[str] | dict[str, int]) -> str:
    """One line naming the reference by the GGUF types of its block linear weights."""
    total = sum(types.values())
    if not total:
        return "GGUF weights dequantized to fp32"
    if len(types) == 1:
        (name, count), = types.items()
        return f"GGUF {name} dequantized to fp32 ({_TYPES.get(name, name)}; all {count} block linear weights)"
    parts = ", ".join(f"{n} x{c}" for n, c in sorted(types.items(), key=lambda kv: -kv[1]))
    return f"GGUF mixed quantization dequantized to fp32 ({parts} of {total} block linear weights)"


def describe_reference(model: str | Path, gguf_path: str | Path | None = None) -> str:
    """Name the reference for a model name or path.

    Args:
        model: a bundled name (``"smollm2-135m"``, ``"gemma3-270m"``), a ``.gguf`` file, or an HF folder.
        gguf_path: the GGUF file, when known (skips locating it).
    """
    path = Path(gguf_path) if gguf_path is not None else _locate_gguf(model)
    if path is not None and path.is_file():
        try:
            return describe_types(gguf_block_types(path))
        except Exception:  # noqa: BLE001 - an unreadable header only loses the description
            return "GGUF weights dequantized to fp32 (types unreadable)"
    return f"the weights as stored in {model} (not a GGUF file: no further quantization is implied)"


def _locate_gguf(model: Any) -> Path | None:
    text = str(model)
    if text.endswith(".gguf"):
        return Path(text)
    try:
        from interp.models import BUNDLED, _bundled_gguf
    except ImportError:
        return None
    if text in BUNDLED:
        try:
            return _bundled_gguf(text)
        except Exception:  # noqa: BLE001 - not installed: described as unknown below
            return None
    return None
