"""Tiny random-init models and their byte-level tokenizer, for tests and examples, built offline (no download).

:func:`tiny_model` gives a llama-style (gated MLP) or GPT-2 bridge of a few small layers over :data:`TINY_VOCAB`
tokens: the 256 bytes and BOS/EOS/PAD of :func:`tiny_tokenizer`. Both are importable from :mod:`interp.models`
too, and ``interp.tiny_model`` is the first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

from interp.errors import ModelLoadError
from interp.io import staged_folder
from interp.loading import pretrained
from interp.model_cache import _quiet, cache_dir
from interp.models import bridge
from interp.validate import checked


def _only_json(folder: Path) -> bool:
    """A tokenizer folder written before cache folders carried interp's marker (JSON files only)."""
    return all(p.suffix == ".json" for p in folder.iterdir())


def tiny_tokenizer() -> Any:
    """A byte-level tokenizer (256 byte tokens + BOS/EOS/PAD) for tiny test models, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({"<bos>": 256, "<eos>": 257, "<pad>": 258})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False), pre_tokenizers.Split("", "isolated")]
    )
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    # transformer-lens reloads tokenizers by path, so the tokenizer must live in a folder.
    folder = cache_dir() / "tiny-tokenizer-v1"
    if not (folder / "tokenizer.json").is_file():
        # another process may install the same files meanwhile: each file is replaced whole, by equal bytes
        with staged_folder(folder, "tiny-tokenizer", adopt=_only_json) as tmp:
            fast.save_pretrained(tmp)
    return pretrained(AutoTokenizer, folder)


TINY_VOCAB = 259


@checked
def tiny_model(kind: Literal["llama", "gpt2"] = "llama", seed: int = 0, n_layers: int = 2, **overrides: Any) -> Any:
    """A random-init model for unit tests (no download): llama-style gated MLP, or GPT-2.

    ``overrides`` are config fields, replacing the small defaults (e.g. ``hidden_size=256``).

    Example:
        >>> import interp
        >>> model = interp.tiny_model("gpt2", n_layers=1)
        >>> model.cfg.n_layers, model.cfg.d_model, model.info.gated_mlp
        (1, 64, False)
    """
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedConfig

    torch.manual_seed(seed)
    cfg: PreTrainedConfig
    if kind == "llama":
        cfg = LlamaConfig(**{  # type: ignore[call-arg]  # attn_implementation is taken by PreTrainedConfig
            "vocab_size": TINY_VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": n_layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
            "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258, "tie_word_embeddings": True,
            "attn_implementation": "eager", **overrides,
        })
    elif kind == "gpt2":
        cfg = GPT2Config(**{  # type: ignore[call-arg]  # attn_implementation is taken by PreTrainedConfig
            "vocab_size": TINY_VOCAB, "n_embd": 64, "n_layer": n_layers, "n_head": 4, "n_positions": 256,
            "bos_token_id": 256, "eos_token_id": 257, "attn_implementation": "eager", **overrides,
        })
    else:
        raise ModelLoadError(f"tiny_model kind must be 'llama' or 'gpt2'; got {kind!r}.")
    cfg.architectures = ["LlamaForCausalLM" if kind == "llama" else "GPT2LMHeadModel"]
    with _quiet():
        hf_model = AutoModelForCausalLM.from_config(cfg)
    hf_model.eval()
    return bridge(hf_model, tiny_tokenizer(), f"tiny-{kind}-seed{seed}")
