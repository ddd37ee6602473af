"""Shared by the padding tests: prompts of different lengths, and one row of a padded batch alone."""

from __future__ import annotations

from interp.data import Examples

TEXTS = ["Paris is the capital of France.", "Hi there", "A somewhat longer prompt, with punctuation; and more.",
         "Quantization error varies by input."]


def row_alone(ex: Examples, i: int) -> Examples:
    """Row ``i`` of padded ``ex`` as an example of its own: its real tokens only, no padding."""
    assert ex.attention_mask is not None
    keep = ex.attention_mask[i]
    return Examples(tokens=ex.tokens[i][keep][None], texts=[ex.texts[i]], ids=[ex.ids[i]],
                    tokenizer=ex.tokenizer, vocab_size=ex.vocab_size)
