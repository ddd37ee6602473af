"""Pattern generators shared by the attention tests (data only; the formulas live in each test)."""

from __future__ import annotations

import torch


def random_causal(batch: int, heads: int, length: int, seed: int, pad_max: int = 0, sharpness: float = 2.0):
    """Random causal patterns with left padding: ``(pattern [b, h, L, L], key_mask [b, L])``.

    Padded keys get zero columns and padded queries all-zero rows.
    """
    gen = torch.Generator().manual_seed(seed)
    pads = torch.randint(0, pad_max + 1, (batch,), generator=gen) if pad_max else torch.zeros(batch, dtype=torch.long)
    key_mask = torch.arange(length)[None, :] >= pads[:, None]
    scores = sharpness * torch.randn(batch, heads, length, length, generator=gen, dtype=torch.float64)
    allowed = torch.tril(torch.ones(length, length, dtype=torch.bool)) & key_mask[:, None, None, :]
    pattern = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    pattern = torch.nan_to_num(pattern, nan=0.0)  # rows of padded queries have no allowed key
    pattern = pattern * key_mask[:, None, :, None]
    return pattern, key_mask


def sink_pattern(batch, heads, length, seed, low=0.6, high=0.9):
    """Causal patterns that put ``low..high`` of each row on key 0 and spread the rest."""
    gen = torch.Generator().manual_seed(seed)
    rest = torch.tril(0.5 + torch.rand(batch, heads, length, length, generator=gen, dtype=torch.float64))
    rest[..., 0] = 0.0
    rest = rest / rest.sum(-1, keepdim=True).clamp_min(1e-300)
    share = low + (high - low) * torch.rand(batch, heads, length, 1, generator=gen, dtype=torch.float64)
    pattern = (1 - share) * rest
    pattern[..., 0] = share[..., 0]
    pattern[..., 0, :] = 0.0
    pattern[..., 0, 0] = 1.0
    return pattern
