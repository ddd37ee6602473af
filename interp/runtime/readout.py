"""The readout: the model's own final norm and unembedding applied to any residual, decoded one
vocabulary slice at a time into per-token NLL.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange
from jaxtyping import Float, Int64
from torch import Tensor

from interp.data import counted_positions
from interp.errors import ComponentError, NonFiniteError
from interp.models import Model
from interp.runtime import hooks as hk
from interp.typing import Resid, TokenNLL, Tokens

DEFAULT_MAX_LOGITS = 1 << 23  # 32 MiB of float32 logits alive at once (fits a large L3)
# A uniform prediction over V tokens scores log V; computed in float32 (a log-sum-exp of V equal logits, V < 2^24
# exact, then one log and two subtractions) it lands within a few ulps of log V. 8 ulps of log V bounds that.
SATURATED_ULPS = 8


def refuse_saturated(values: Tensor, vocab: int, counted: Tensor | None = None) -> None:
    """Refuse per-target NLL ``[B, T-1]`` in which some row scores ``log(vocab)`` at every (counted) target.

    That is the NLL of a uniform prediction whatever the text: the logits were equal for every token,
    because an activation overflowed float32 before the output head (finite but huge weights make the
    final norm's mean square inf, and the norm returns zeros) or the head itself is constant. Such a
    row is not a measurement, so :class:`~interp.errors.NonFiniteError` says where instead.

    Example:
        >>> import math, torch
        >>> refuse_saturated(torch.tensor([[5.0, 5.6], [5.5, 5.5]]), 259)  # real predictions: nothing raised
        >>> refuse_saturated(torch.full((2, 3), math.log(259)), 259)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        interp.errors.NonFiniteError: The predictions are uniform over all 259 tokens ...
    """
    if vocab < 2 or values.numel() == 0:
        return
    level = math.log(vocab)
    at_level = (values.detach().double() - level).abs() <= SATURATED_ULPS * torch.finfo(torch.float32).eps * level
    if counted is None:
        rows = at_level.all(dim=1)
    else:
        rows = (at_level | ~counted).all(dim=1) & counted.any(dim=1)
    if bool(rows.any()):
        where = rows.nonzero().flatten().tolist()
        raise NonFiniteError(
            f"The predictions are uniform over all {vocab} tokens at every position of {len(where)} of the "
            f"{values.shape[0]} rows in this batch (rows {where[:5]}): the logits at the output head are equal for "
            f"every token, so each NLL is log {vocab} = {level:.4f} whatever the text. An activation overflowed "
            "float32 before the head (finite but huge weights make the final norm's mean square inf, and it "
            "returns zeros), or the head is constant. This is not a measurement: check the model's weights, "
            "dtype and hooks.")


class Readout:
    """``unembed(final_norm(r))`` for any residual ``r``: the model's own output head.

    The final norm is the decoder body's own (``norm``, GPT-2's ``ln_f``, GPT-NeoX's
    ``final_layer_norm``: RMSNorm or LayerNorm, Gemma's ``1 + gamma`` included, since the
    module itself is called) and the head is the model's output embedding (``lm_head``,
    GPT-NeoX's ``embed_out``), with its bias when it has one. Gemma-2-style final logit
    soft-capping (``tanh(z / c) * c``) is applied when the config sets
    ``final_logit_softcapping``.

    Args:
        model: a bridge from :func:`interp.load_model`.
        max_logits: the most logits materialised at once when scoring; sets peak memory.
    """

    def __init__(self, model: Model, max_logits: int = DEFAULT_MAX_LOGITS) -> None:
        try:
            self.norm = hk.final_norm(model)
            self.weight = hk.unembed_weight(model)
            self.bias = hk.unembed_bias(model)
        except AttributeError as exc:
            raise ComponentError(
                f"{getattr(getattr(model, 'info', None), 'architecture', type(model).__name__)}: no final norm "
                f"and output head where interp looks ({exc}); early exit and patching need both."
            ) from None
        config = model.original_model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.max_logits = max(1, int(max_logits))

    @property
    def vocab(self) -> int:
        return int(self.weight.shape[0])

    def logits(self, resid: Float[Tensor, "... d_model"]) -> Float[Tensor, "... vocab"]:
        """Logits of ``resid`` (keep the input small: the output has ``vocab`` columns)."""
        return self.head(self.norm(resid))

    def head(self, normed: Float[Tensor, "... d_model"]) -> Float[Tensor, "... vocab"]:
        """Logits of an already normalised residual (the unembedding and any soft-cap)."""
        logits = torch.nn.functional.linear(normed, self.weight, self.bias)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def token_nll(self, resid: Resid, tokens: Tokens, normed: bool = False) -> TokenNLL:
        """``-log p(tokens[:, t + 1] | r[:, t])`` for ``t < T - 1``: ``[B, T, D] -> [B, T - 1]``.

        Without gradients, every row is decoded against one slice of the vocabulary at a time
        with a running (online) log-sum-exp, so each slice of the unembedding is read once
        and the matmuls stay large (20% faster than row chunks on CPU). With gradients (used
        by attribution patching), rows are decoded in chunks of ``max_logits // vocab``
        positions with a fused log-softmax. Either way no ``[B, T, vocab]`` tensor exists.
        ``normed=True`` means ``resid`` already went through the final norm.
        """
        batch = resid.shape[0]
        flat = rearrange(resid[:, :-1], "b t d -> (b t) d")  # position t predicts token t + 1
        targets = rearrange(tokens[:, 1:], "b t -> (b t) 1").to(flat.device)
        if not (torch.is_grad_enabled() and flat.requires_grad):
            normed_rows = flat if normed else self.norm(flat)
            values = rearrange(self._nll_by_vocab_slices(normed_rows, targets.squeeze(-1)), "(b t) -> b t", b=batch)
        else:
            rows = max(1, self.max_logits // self.vocab)
            out = [self._rows_nll(flat[start : start + rows], targets[start : start + rows], normed)
                   for start in range(0, flat.shape[0], rows)]
            values = rearrange(torch.cat(out), "(b t) -> b t", b=batch)
        refuse_saturated(values, self.vocab)
        return values

    def _nll_by_vocab_slices(self, normed: Float[Tensor, "rows d_model"], targets: Int64[Tensor, " rows"]
                             ) -> Float[Tensor, " rows"]:
        rows = normed.shape[0]
        step = min(self.vocab, max(256, self.max_logits // max(1, rows)))
        dtype = torch.promote_types(normed.dtype, torch.float32)  # float32, or float64 for a float64 model
        peak = torch.full((rows,), -math.inf, device=normed.device, dtype=dtype)
        total = torch.zeros(rows, device=normed.device, dtype=dtype)
        picked = torch.zeros(rows, device=normed.device, dtype=dtype)
        for start in range(0, self.vocab, step):
            bias = None if self.bias is None else self.bias[start : start + step]
            logits = torch.nn.functional.linear(normed, self.weight[start : start + step], bias).to(dtype)
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            inside = (targets >= start) & (targets < start + logits.shape[1])
            if bool(inside.any()):
                picked[inside] = logits[inside, targets[inside] - start]
            new_peak = torch.maximum(peak, logits.amax(dim=1))
            # rescale what was summed so far to the new peak, then add this slice (in place: ours)
            total = total * torch.exp(peak - new_peak) + logits.sub_(new_peak[:, None]).exp_().sum(dim=1)
            peak = new_peak
        return peak + total.log() - picked

    def _rows_nll(self, resid: Float[Tensor, "rows d_model"], targets: Int64[Tensor, "rows 1"],
                  normed: bool = False) -> Float[Tensor, " rows"]:
        logits = self.head(resid) if normed else self.logits(resid)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        # cross_entropy fuses log-softmax and gather in one pass over the chunk; on CPU it is
        # several times faster than torch.logsumexp or an amax/exp/sum chain (benchmarks.md)
        return torch.nn.functional.cross_entropy(logits, targets.squeeze(-1), reduction="none")

    def mean_nll(self, resid: Resid, tokens: Tokens, lengths: Tensor | None = None,
                 normed: bool = False) -> Float[Tensor, " batch"]:
        """Mean next-token NLL per row (float64).

        ``lengths [B]`` marks left-aligned padded rows (:func:`interp.data.left_aligned`): row
        ``b`` averages the targets ``1 .. lengths[b] - 1`` only, and positions past its length
        are never decoded, so pad positions cost nothing and cannot leak a NaN into the mean.
        ``normed=True`` means ``resid`` already went through the final norm.
        """
        if lengths is None:
            return self.token_nll(resid, tokens, normed=normed).double().mean(dim=1)
        width = tokens.shape[1]
        keep = counted_positions(lengths.to(resid.device), width, skip_first=True)[:, 1:]  # [B, T-1] targets
        flat = resid[:, :-1][keep]
        targets = tokens[:, 1:].to(resid.device)[keep]
        if torch.is_grad_enabled() and flat.requires_grad:
            rows = max(1, self.max_logits // self.vocab)
            per = torch.cat([self._rows_nll(flat[i : i + rows], targets[i : i + rows, None], normed)
                             for i in range(0, flat.shape[0], rows)])
        else:
            per = self._nll_by_vocab_slices(flat if normed else self.norm(flat), targets)
        placed = torch.zeros(keep.shape, dtype=per.dtype, device=per.device)
        placed[keep] = per.detach()
        refuse_saturated(placed, self.vocab, keep)
        total = torch.zeros(tokens.shape[0], dtype=torch.float64, device=resid.device)
        total.index_add_(0, keep.nonzero()[:, 0], per.double())
        return total / keep.sum(dim=1).clamp(min=1)
