"""``gguf_block_weights`` reads a GGUF file's block linear weights as llama.cpp computes with them.

Independent reference: transformers' own GGUF loader, which interp's ``load_model`` uses (it
dequantizes and puts llama's rotary-interleaved ``attn_q``/``attn_k`` rows back). Both decode the
same stored Q4_1 blocks to float32, so every weight must be equal bit for bit; a wrong row order
for q or k (or a transposed shape) would differ in almost every element."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from interp.errors import SpecError
from interp.quant.llama_cpp import _unpermute_rows, gguf_block_weights
from interp.runtime import hooks


@pytest.mark.slow
def test_block_weights_equal_the_loaded_model_bit_for_bit(smol):
    from interp.models import _bundled_gguf

    weights = gguf_block_weights(_bundled_gguf("smollm2-135m"))
    assert len(weights) == 7 * hooks.n_layers(smol)
    for (layer, role), (ggml_type, values) in weights.items():
        assert ggml_type == "q4_1"
        loaded = hooks.linear_weights(smol, layer)[role].read().detach().float().numpy()
        assert np.array_equal(values, loaded), (layer, role)


def test_unpermute_inverts_the_converters_rotary_order():
    # the converter's order, written from its description: each head's rows as (2, rows/2) -> (rows/2, 2)
    heads, rows, cols = 3, 8, 5
    hf = torch.arange(heads * rows * cols, dtype=torch.float32).reshape(heads * rows, cols).numpy()
    stored = hf.reshape(heads, 2, rows // 2, cols).swapaxes(1, 2).reshape(heads * rows, cols)
    assert not np.array_equal(stored, hf)
    assert np.array_equal(_unpermute_rows(stored, heads), hf)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(SpecError, match="cannot read"):
        gguf_block_weights(path)


@pytest.mark.parametrize("ggml_type", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_legacy_blocks_are_llama_quantizes_own_bytes(ggml_type):
    """The fixture holds llama-quantize's stored blocks of the first rows of SmolLM2's blk.0.attn_k (from its
    F32 reference, which is the bundled Q4_1 file decoded); interp's quantizer must write the same bytes."""
    import base64
    import json
    from pathlib import Path

    import gguf

    from interp.models import _bundled_gguf
    from interp.quant.llama_cpp import quantize_blocks, stored_weight

    fixture = json.loads((Path(__file__).parent / "fixtures" / "llama_cpp" / "smol_attn_k_blocks.json").read_text())
    reader = gguf.GGUFReader(str(_bundled_gguf("smollm2-135m")))
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    rows = gguf.quants.dequantize(tensor.data, tensor.tensor_type)[:fixture["rows"]]  # GGUF row order
    blocks = quantize_blocks(rows, ggml_type)
    assert blocks.tobytes() == base64.b64decode(fixture["types"][ggml_type])
    back = stored_weight(torch.from_numpy(rows.copy()), ggml_type)
    assert back.shape == rows.shape and np.array_equal(back.numpy(), gguf.quants.dequantize(
        blocks, gguf.GGMLQuantizationType[ggml_type.upper()]))
    if ggml_type == "q4_1":  # the bundled file's own type: decoding and re-encoding changes nothing
        assert np.array_equal(back.numpy(), rows)


def test_types_interp_cannot_store_are_refused():
    from interp.quant.llama_cpp import quantize_blocks

    with pytest.raises(SpecError, match="needs llama-quantize"):  # K-quants are stored here (tests/test_kquants.py)
        quantize_blocks(np.zeros((2, 256), np.float32), "f16")
    with pytest.raises(SpecError, match="do not split"):
        quantize_blocks(np.zeros((2, 40), np.float32), "q4_0")
    with pytest.raises(SpecError, match="do not split"):
        quantize_blocks(np.zeros((2, 96), np.float32), "q4_k")
