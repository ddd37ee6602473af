"""A tiny random llama written as a GGUF file that both llama.cpp and interp load (no download, no converter).

The weights are a seeded random ``LlamaForCausalLM`` (2 layers, width 256 so every K-quant's
256-weight block fits, FFN 512, 4 heads with 2 KV heads), written with the ``gguf`` package the
way llama.cpp's converter writes a llama: the q and k rows in llama.cpp's rotary order, the
embedding tied to the output. The tokenizer is a byte-level SentencePiece vocabulary: ``<unk>``,
``<s>``, ``</s>`` and the 256 byte tokens ``<0x00>``..``<0xFF>``, so any text tokenizes in both
(one token per UTF-8 byte, after the space marker) and the file stays small (about 4 MB in F32).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

WIDTH, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
VOCAB = 3 + 256


def _rotary_order(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for a llama q or k weight (``interp.quant.llama_cpp`` undoes it)."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path, seed: int = 0, replace: dict[str, np.ndarray] | None = None) -> Path:
    """Write the tiny model to ``path`` (F32 tensors, F32 norms) and return it.

    ``replace``: GGUF name -> float32 values stored instead of that tensor's random ones (same shape, in
    the stored row order), e.g. awkward rows for a quantizer test.
    """
    import gguf

    rng = np.random.default_rng(seed)
    head_dim = WIDTH // HEADS

    def normal(*shape: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    add_tensor = writer.add_tensor

    def replaced(name: str, values: np.ndarray) -> None:
        new = (replace or {}).get(name)
        if new is not None and new.shape != values.shape:
            raise ValueError(f"{name} is {values.shape}; the replacement is {new.shape}")
        add_tensor(name, values if new is None else np.ascontiguousarray(new, dtype=np.float32))

    writer.add_tensor = replaced  # type: ignore[method-assign]
    writer.add_name("tiny-random-llama")
    writer.add_context_length(512)
    writer.add_embedding_length(WIDTH)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL,
                            *([gguf.TokenType.BYTE] * 256)])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_tensor("token_embd.weight", normal(VOCAB, WIDTH, scale=0.125))  # tied output: logits of std ~2
    for layer in range(LAYERS):
        scale = WIDTH ** -0.5
        blk = f"blk.{layer}"
        writer.add_tensor(f"{blk}.attn_norm.weight", np.ones(WIDTH, dtype=np.float32))
        writer.add_tensor(f"{blk}.attn_q.weight", _rotary_order(normal(WIDTH, WIDTH, scale=scale), HEADS))
        writer.add_tensor(f"{blk}.attn_k.weight",
                          _rotary_order(normal(KV_HEADS * head_dim, WIDTH, scale=scale), KV_HEADS))
        writer.add_tensor(f"{blk}.attn_v.weight", normal(KV_HEADS * head_dim, WIDTH, scale=scale))
        writer.add_tensor(f"{blk}.attn_output.weight", normal(WIDTH, WIDTH, scale=scale))
        writer.add_tensor(f"{blk}.ffn_norm.weight", np.ones(WIDTH, dtype=np.float32))
        writer.add_tensor(f"{blk}.ffn_gate.weight", normal(FFN, WIDTH, scale=scale))
        writer.add_tensor(f"{blk}.ffn_up.weight", normal(FFN, WIDTH, scale=scale))
        writer.add_tensor(f"{blk}.ffn_down.weight", normal(WIDTH, FFN, scale=FFN ** -0.5))
    writer.add_tensor("output_norm.weight", np.ones(WIDTH, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
