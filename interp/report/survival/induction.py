"""Per-sequence prefix-matching and copying scores of every head, on BOS + R tokens + the same R tokens.

For one sequence and head ``(l, h)`` (positions: 0 is BOS, ``1..R`` the first copy, ``R+1..2R`` the second):

- **prefix matching** ``PM``: the mean over queries ``t = R+1..2R`` of the attention weight from ``t`` to
  ``t - R + 1``, the token after the earlier occurrence of ``token[t]``;
- **copying** ``CP``: the mean over ``t = R+1..2R-1`` of the head's direct logit attribution at ``t`` (its
  ``z W_O`` term through the final norm frozen at that position, and through the attention-output norm frozen
  there on models that have one, as :func:`interp.localize.dla.logit_attribution` decomposes) along
  ``W_U[y] - mean_{v in E} W_U[v]``, ``y = token[t+1]`` the correct next token.

Example:
    >>> import interp
    >>> from interp.report.survival.induction import induction_scores
    >>> from interp.report.survival.units import repeated_sequences
    >>> model = interp.tiny_model("llama")
    >>> seqs = repeated_sequences(list(range(10, 60)), bos=1, r=8, n=3, seed=0)
    >>> pm, cp = induction_scores(model, seqs, list(range(10, 60)))
    >>> pm.shape, cp.shape  # [sequences, layers, heads]
    ((3, 2, 4), (3, 2, 4))
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from interp.errors import DataError
from interp.localize.dla import FrozenNorm
from interp.models import Model
from interp.runtime import hooks as hk
from interp.runtime import placement
from interp.runtime.batching import batches, device_of
from interp.runtime.capture import capture

__all__ = ["induction_scores"]


def _check(tokens: Tensor) -> int:
    if tokens.ndim != 2 or tokens.shape[1] % 2 != 1 or tokens.shape[1] < 5:
        raise DataError(f"induction sequences are [n, 2R + 1] with R >= 2; got {tuple(tokens.shape)}")
    r = (tokens.shape[1] - 1) // 2
    if not torch.equal(tokens[:, 1:r + 1], tokens[:, r + 1:]):
        raise DataError("induction sequences repeat their first R tokens after BOS; these do not")
    return r


def induction_scores(model: Model, tokens: Tensor, token_set: Sequence[int], batch_size: int = 8
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``(PM, CP)``, each ``[n, layers, heads]`` float64 (see the module docstring), from one forward per batch."""
    r = _check(tokens)
    n_layers = hk.n_layers(model)
    device = device_of(model)
    w_u = hk.unembed_weight(model).detach()
    ids = torch.as_tensor(list(token_set), dtype=torch.long, device=w_u.device)
    mean_u = w_u[ids].double().mean(dim=0)
    info = getattr(model, "info", None)
    offset = float(getattr(info, "norm_offset", 0.0) or 0.0)
    post_norms = bool(getattr(info, "post_norms", False))
    keys = [(c, layer) for layer in range(n_layers) for c in ("pattern", "head")]
    pm_out, cp_out = [], []
    queries = torch.arange(r + 1, 2 * r + 1, device=device)  # PM's queries, t = R+1..2R
    copies = torch.arange(r + 1, 2 * r, device=device)  # CP's positions, t = R+1..2R-1
    for start, end in batches(len(tokens), batch_size):
        batch = tokens[start:end].to(device)
        with torch.no_grad():
            store, final = capture(model, batch, keys)
            b, t = batch.shape[0], len(copies)
            targets = batch[:, copies + 1]  # [b, t] the next token, which the first copy shows
            direction = (w_u[targets.to(w_u.device)].double() - mean_u).to(final.device)  # [b, t, d]
            frozen = FrozenNorm.at(hk.final_norm(model), final[:, copies].reshape(b * t, -1).double(), offset)
            pm_layers, cp_layers = [], []
            for layer in range(n_layers):
                pattern = hk.reader(model, "pattern", layer)(store[("pattern", layer)])  # [b, head, q, k]
                pm_layers.append(pattern[:, :, queries, queries - r + 1].double().mean(dim=-1))
                z = hk.reader(model, "head", layer)(store[("head", layer)])[:, copies]  # [b, t, head, d_head]
                with placement.onloaded(model, [layer]):
                    w_o = hk.per_head_w_o(model, layer).to(z.device, torch.float64)
                    result = torch.einsum("bthd,hmd->bthm", z.double(), w_o).reshape(b * t, z.shape[2], -1)
                    if post_norms:
                        bias = getattr(hk.linear_weights(model, layer)["o"].module, "bias", None)
                        whole = result.sum(dim=1) + (bias.detach().to(result) if isinstance(bias, Tensor) else 0)
                        post = FrozenNorm.at(hk.blocks(model)[layer].post_attention_layernorm, whole, offset)
                        result = post.linear(result)
                along = (frozen.linear(result) * direction.reshape(b * t, 1, -1).to(result.device)).sum(dim=-1)
                cp_layers.append(along.reshape(b, t, -1).mean(dim=1))
            pm_out.append(torch.stack(pm_layers, dim=1).cpu())
            cp_out.append(torch.stack(cp_layers, dim=1).cpu())
    return torch.cat(pm_out).numpy(), torch.cat(cp_out).numpy()
