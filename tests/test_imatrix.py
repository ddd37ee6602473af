"""llama.cpp's importance matrix from interp's probes (interp.quant.imatrix), against llama.cpp itself.

Three independent references:
- a plain loop over the tiny model's ``nn.Linear`` modules (forward pre-hooks on each one, not
  interp's hook points), in float64, so every role's input and the q/k/v and gate/up sharing are
  checked exactly;
- ``llama-imatrix``'s own file for 8 x 128 tokens of the bundled SmolLM2 (committed fixture; see
  smol_imatrix_tokens.json for the command): interp reads it, writes it back byte for byte, and
  computes the same matrix from the same tokens;
- the matrix's own sampling noise, which sets how close two engines must be (below).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import interp
from interp.errors import DataError, SpecError
from interp.quant.imatrix import ImportanceMatrix, importance_matrix, read_imatrix, write_imatrix
from interp.quant.llama_cpp import gguf_name
from interp.runtime import hooks

FIXTURES = Path(__file__).parent / "fixtures" / "llama_cpp"
LLAMA_FILE = FIXTURES / "smol_imatrix_8x128.gguf"


def _forward_then_remove(native, rows, handles):
    """One plain forward of the Hugging Face model with the test's own hooks, which are then removed."""
    try:
        with torch.no_grad():
            native(input_ids=rows.tokens)
    finally:
        for handle in handles:
            handle.remove()


def test_sums_equal_a_loop_over_every_linear_module_in_float64(model64, rows):
    """Each block linear module's own input, summed as x^2 per channel over every position, in float64."""
    native = hooks.native_model(model64)
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for layer in range(hooks.n_layers(model64)):
        for role, slot in hooks.linear_weights(model64, layer).items():
            module = next(m for m in native.modules()
                          if isinstance(m, torch.nn.Linear) and m.weight is slot.module.weight)

            def pre(mod, args, name=gguf_name(layer, role)):
                x = args[0].detach()
                total = torch.zeros(x.shape[-1], dtype=torch.float64)
                for b in range(x.shape[0]):
                    for t in range(x.shape[1]):
                        total += x[b, t].double() ** 2
                seen[name] = seen.get(name, 0) + total

            handles.append(module.register_forward_pre_hook(pre))
    _forward_then_remove(native, rows, handles)
    matrix = importance_matrix(model64, rows, batch_size=2, progress=False)
    assert set(matrix.sums) == set(seen) and len(seen) == 7 * hooks.n_layers(model64)
    for name, expected in seen.items():
        np.testing.assert_allclose(matrix.sums[name], expected.numpy(), rtol=1e-12, atol=0)
        assert matrix.counts[name] == rows.tokens.numel()
    assert matrix.chunk_size == rows.seq_len and matrix.chunk_count == len(rows)


def test_llama_imatrix_file_is_read_and_written_back_byte_for_byte(tmp_path):
    llama = read_imatrix(LLAMA_FILE)
    assert len(llama.sums) == 30 * 7 and llama.datasets == ("cal.txt",)
    assert llama.chunk_size == 128 and llama.chunk_count == 8 and set(llama.counts.values()) == {8 * 128}
    assert llama.sums["blk.29.ffn_down.weight"].shape == (1536,) and llama.sums["blk.0.attn_q.weight"].shape == (576,)
    again = write_imatrix(llama, tmp_path / "again.gguf")
    assert again.read_bytes() == LLAMA_FILE.read_bytes()


def test_smollm2_matrix_matches_llama_imatrix_on_the_same_tokens(smol):
    """The same 8 x 128 tokens through interp and through llama.cpp.

    The two engines' float32 kernels differ, so the sums differ in their last digits, growing with
    depth. The tolerance is what such a difference must stay under to be irrelevant: a tenth of the
    difference between the matrices of two halves of the same tokens (its own sampling noise, which
    an imatrix user accepts whenever they pick calibration text). Measured here: the engines differ
    by 2e-5 to 3e-4 relative, 0.2% to 0.8% of each tensor's split-half difference."""
    chunks = json.loads((FIXTURES / "smol_imatrix_tokens.json").read_text())["chunks"]
    rows = interp.Examples.from_tokens(torch.tensor(chunks))
    ours = importance_matrix(smol, rows, progress=False)
    even = importance_matrix(smol, rows.subset([0, 2, 4, 6]), progress=False)
    odd = importance_matrix(smol, rows.subset([1, 3, 5, 7]), progress=False)
    llama = read_imatrix(LLAMA_FILE)
    assert set(ours.sums) == set(llama.sums) and ours.counts == llama.counts
    for name, theirs in llama.sums.items():
        engines = np.linalg.norm(ours.sums[name] - theirs)
        # the halves' difference has the variance of the full sum itself (two independent halves of equal size)
        halves = np.linalg.norm(even.sums[name] - odd.sums[name])
        assert engines <= 0.1 * halves, (name, engines / halves)


def test_bad_inputs_are_clear_errors(tmp_path, tiny_llama):
    padded = interp.examples_from_texts(["a b c d e f", "a b"], tiny_llama.tokenizer)
    assert padded.padded
    with pytest.raises(DataError, match="padded"):
        importance_matrix(tiny_llama, padded, progress=False)
    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("not a gguf")
    with pytest.raises(SpecError, match="cannot read"):
        read_imatrix(not_gguf)
    with pytest.raises(SpecError, match="not a regular file"):
        read_imatrix(tmp_path)
    import gguf  # a GGUF file that is not an imatrix

    model_file = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(model_file), arch="llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SpecError, match="not an importance matrix"):
        read_imatrix(model_file)
    with pytest.raises(SpecError, match="empty"):
        write_imatrix(ImportanceMatrix({}, {}, 128), tmp_path / "empty.gguf")
    assert not (tmp_path / "empty.gguf").exists()


def test_fused_weights_get_llama_cpps_fused_tensor_name(rows):
    """GPT-2 stores q, k and v in one Conv1D (c_attn): llama.cpp has one tensor for it, attn_qkv, whose input is
    c_attn's input (checked with a pre-hook on the module itself, in float64)."""
    tiny_gpt2 = interp.tiny_model("gpt2", seed=0)
    tiny_gpt2.original_model.to(torch.float64)
    native = hooks.native_model(tiny_gpt2)
    seen = {}
    attn = [m for name, m in native.named_modules() if name.endswith("attn.c_attn")]

    def pre(mod, args, layer):
        seen[layer] = seen.get(layer, 0) + (args[0].detach().double() ** 2).sum((0, 1))

    handles = [m.register_forward_pre_hook(lambda mod, args, i=i: pre(mod, args, i)) for i, m in enumerate(attn)]
    _forward_then_remove(native, rows, handles)
    matrix = importance_matrix(tiny_gpt2, rows, progress=False)
    n = hooks.n_layers(tiny_gpt2)
    assert sorted(matrix.sums) == sorted(f"blk.{i}.{t}.weight" for i in range(n)
                                         for t in ("attn_qkv", "attn_output", "ffn_up", "ffn_down"))
    for layer in range(n):
        np.testing.assert_allclose(matrix.sums[f"blk.{layer}.attn_qkv.weight"], seen[layer].numpy(), rtol=1e-12)
