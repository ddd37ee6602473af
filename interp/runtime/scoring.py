"""Per-example next-token NLL, computed without materialising a full log-softmax.

``nll(x) = mean over t = 1..T-1 of -log p(x_t | x_<t)``: position 0 is BOS and is never a
target. No ``[batch, pos, vocab]`` log-softmax copy is made: :func:`token_nll` uses a fused
log-softmax + gather (``cross_entropy``) over position chunks, and :func:`nll` decodes by
vocabulary slices (:func:`token_nll_fn`). Examples never share a row and are never padded,
so an example's NLL does not depend on its batch (checked to 1e-4 in tests).
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from tqdm.auto import tqdm

from interp import validate
from interp.data import Examples, left_aligned
from interp.errors import ComponentError, NonFiniteError
from interp.models import Model
from interp.runtime import hooks as hk
from interp.runtime.batching import batches, check_examples, device_of, listed, non_finite_weights, show_progress
from interp.runtime.readout import Readout, refuse_saturated
from interp.validate import checked


def token_nll(logits: torch.Tensor, tokens: torch.Tensor, chunk: int = 32) -> torch.Tensor:
    """``-log p(tokens[:, t+1] | ...)`` from ``logits[:, t]``: ``[B, T, V], [B, T] -> [B, T-1]``."""
    out = []
    targets = tokens[:, 1:]
    logits = logits[:, :-1]
    for start in range(0, targets.shape[1], chunk):
        block = logits[:, start : start + chunk].float()
        target = targets[:, start : start + chunk]
        # log-softmax + gather fused per chunk (torch.logsumexp is several times slower on CPU)
        # rows in the last dim: over a strided class dim (``[B, V, T]``) CE loses ~1e-4 nats
        rows = torch.nn.functional.cross_entropy(rearrange(block, "b t v -> (b t) v"),
                                                 rearrange(target, "b t -> (b t)"), reduction="none")
        out.append(rearrange(rows, "(b t) -> b t", b=target.shape[0]))
    values = torch.cat(out, dim=1)
    refuse_saturated(values, logits.shape[-1])  # a row predicted uniformly everywhere is an overflow, not a result
    return values


def token_kl(ref_logits: torch.Tensor, logits: torch.Tensor, chunk: int = 32) -> torch.Tensor:
    """``KL(p_ref || p)`` per predicting position: ``[B, T, V] x 2 -> [B, T-1]``."""
    out = []
    for start in range(0, logits.shape[1] - 1, chunk):
        stop = min(start + chunk, logits.shape[1] - 1)
        log_p_ref = torch.log_softmax(ref_logits[:, start:stop].float(), dim=-1)
        log_p = torch.log_softmax(logits[:, start:stop].float(), dim=-1)
        out.append((log_p_ref.exp() * (log_p_ref - log_p)).sum(-1))
    return torch.cat(out, dim=1)


def in_padded_layout(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-target values of left-aligned rows, put back where each target sat in the padded batch.

    ``values [B, T-1]`` come from rows whose real tokens were moved to the front
    (:func:`interp.data.left_aligned`): entry ``j`` scores real token ``j + 1`` of the row.
    The result has the padded batch's layout, entry ``t`` scoring token ``t + 1``, with NaN
    wherever :func:`target_mask` is False (a pad target, or a target predicted from a pad).
    """
    mask = mask.to(values.device).bool()
    out = torch.full_like(values, float("nan"))
    for row in range(mask.shape[0]):
        where = torch.nonzero(mask[row]).flatten()  # the row's real positions, in order
        if len(where) > 1:
            out[row, where[1:] - 1] = values[row, : len(where) - 1]
    return out


def per_token_honouring_mask(fn: Any, tokens: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``fn(rows) -> [B, T-1]`` per-target values, for padded rows too.

    Padded rows are left-aligned first, so each runs the model's own forward exactly as it
    would alone: the model builds its own causal mask (sliding windows and per-layer-type
    masks included) and its own position ids. The values are then put back in the padded
    layout (:func:`in_padded_layout`). Without a mask ``fn`` runs on ``tokens`` as they are.
    """
    if mask is None:
        return fn(tokens)
    rows, _ = left_aligned(tokens, mask.to(tokens.device))
    return in_padded_layout(fn(rows), mask)


def target_mask(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T] -> [B, T-1]``: targets that are real tokens predicted from a real token."""
    return mask[:, 1:] & mask[:, :-1]


def row_mean(values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean per row of ``[B, T-1]`` token values (float64), over the real targets only when ``mask`` is given."""
    if mask is None:
        return values.double().mean(dim=1)
    valid = target_mask(mask.to(values.device))
    return values.double().masked_fill(~valid, 0.0).sum(dim=1) / valid.sum(dim=1)


def model_logits(model: Model, tokens: torch.Tensor, runner: Any = None, **kwargs: Any) -> torch.Tensor:
    """Logits of the underlying Hugging Face model.

    Bridge hooks fire as usual. With none registered, pass ``runner=fast_forward(model)`` to
    skip the bridge's wrappers (same logits, bit for bit, and about 10% less time).
    """
    device = next(model.original_model.parameters()).device
    kwargs = {k: v.to(device) for k, v in kwargs.items()}
    return (runner or model.original_model)(input_ids=tokens.to(device), **kwargs).logits


def fast_forward(model: Model) -> Any:
    """The bridge-free Hugging Face model when no hook is registered, else the hooked one."""

    return model.original_model if hk.hooks_active(model) else hk.native_model(model)


@checked
def nll(model: Model, examples: Examples, batch_size: int = 8, progress: bool | None = False) -> torch.Tensor:
    """Mean next-token NLL per example: ``Tensor [N]`` (nats).

    Args:
        model: a bridge from :func:`interp.load_model` (or a quantized copy).
        examples: token rows; padded rows (``examples.attention_mask``, e.g. from
            :func:`interp.data.examples_from_texts`) average over their real targets only, and
            give the value the row has when run alone.
        batch_size: examples per forward.
        progress: show a progress bar.

    Example:
        >>> import torch
        >>> import interp
        >>> model = interp.tiny_model("llama")
        >>> ex = interp.Examples.from_tokens(torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(0)))
        >>> values = interp.nll(model, ex)
        >>> tuple(values.shape), bool(((values > 4) & (values < 7)).all())  # random weights: near ln(259) = 5.56
        ((3,), True)
    """
    check_examples(model, examples)
    batch_size = validate.batch_size(batch_size)
    score = token_nll_fn(model)
    device = device_of(model)
    out = torch.empty(len(examples), dtype=torch.float64, device=device)  # to the host once, at the end
    bar = tqdm(total=len(examples), desc="nll", unit="ex", disable=not show_progress(progress))
    with torch.no_grad():
        for start, end in batches(len(examples), batch_size):
            tokens = examples.tokens[start:end].to(device)
            mask = None if examples.attention_mask is None else examples.attention_mask[start:end].to(tokens.device)
            out[start:end] = row_mean(score(tokens, mask), mask)
            bar.update(end - start)
    bar.close()
    if not torch.isfinite(out).all():
        bad = [examples.ids[i] for i in torch.nonzero(~torch.isfinite(out)).flatten().tolist()[:3]]
        raise NonFiniteError(f"The model produced NaN/inf NLL for examples {bad}{_non_finite_weights(model)}")
    return out.float().cpu()


def _non_finite_weights(model: Model) -> str:
    """The end of the NaN/inf message: which weights hold NaN/inf (the usual cause), or what else to check."""
    bad = non_finite_weights(model)
    if bad:
        return f": these weights hold NaN/inf: {listed(bad)}. Reload or repair the model."
    return (": every weight is finite, so an activation overflowed; use float32 rather than float16, or check "
            "the hooks registered on the model.")


def token_nll_fn(model: Model) -> Any:
    """``(tokens, mask=None) -> [B, T-1]`` token NLL without a ``[B, T, vocab]`` logits tensor.

    With no hook registered, the bridge-free decoder body (:func:`interp.runtime.hooks.native_model`)
    runs to its final normalised hidden state, and the unembedding is decoded one vocabulary
    slice at a time with a running log-sum-exp (:meth:`interp.localize.lens.Readout.token_nll`). This
    skips the bridge's wrappers and writing and re-reading ~200 MB of logits per 8 x 128
    batch. With hooks registered (they must fire, on the head too), or for models without a
    llama-style body and head, it scores the full logits of the hooked forward.
    """

    readout = body = None
    if not hk.hooks_active(model):
        body = getattr(hk.native_model(model), "model", None)
        try:
            readout = Readout(model)
        except ComponentError:
            pass
    if readout is None or body is None:
        return lambda tokens, mask=None: per_token_honouring_mask(
            lambda rows: token_nll(model_logits(model, rows), rows), tokens, mask)

    def score(tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        def rows_nll(rows: torch.Tensor) -> torch.Tensor:
            return readout.token_nll(body(input_ids=rows).last_hidden_state, rows, normed=True)

        return per_token_honouring_mask(rows_nll, tokens, mask)

    return score


def perplexity(nll_values: torch.Tensor) -> float:
    """Perplexity of a set of examples: ``exp`` of the mean per-example NLL."""
    return float(torch.exp(nll_values.double().mean()))
