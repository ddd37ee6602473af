"""SAOBP: refine an attention pattern with one step of belief propagation.

Deep layers of a transformer often collapse their attention: most queries pile onto one
"sink" key and entropy falls. SAOBP (Findings of EMNLP 2025, arXiv 2509.07324) counters
this with one step of belief propagation over the attention graph, built on a repulsive
Potts model. The paper's full equations were not available to this project, so the model
below is this project's own derivation from its description (see ``docs/attention.md``).

Graphical model, for one head and one example:

* variable ``x_i`` is the key query ``i`` attends to, with prior (unary) belief ``A_i``;
* every pair of queries ``(i, j)``, ``j != i``, shares a repulsive Potts factor
  ``psi_ij(x_i, x_j) = exp(-J_ij [x_i == x_j])`` that penalises both picking the same key;
* the coupling follows attention, ``J_ij = beta * A_ij`` with ``beta >= 0`` per head, so a
  query is pushed away only by the tokens it attends to (the effect is multi-hop:
  ``i -> j -> k``).

One sum-product step from uniform messages gives, with ``c_ij = 1 - exp(-J_ij)``::

    m_{j->i}(k) = 1 - c_ij A_jk
    log B_ik    = log A_ik + sum_{j != i} log(1 - c_ij A_jk)     (then normalise over k)

Two ways to compute it:

* ``mode="exact"`` evaluates the formula above. The ``log(1 - c_ij A_jk)`` term is an
  ``L x L x L`` tensor per head; it is built a chunk of queries at a time.
* ``mode="first_order"`` uses ``log(1 - cA) ~ -cA`` and ``c_ij ~ beta A_ij``:
  ``B = softmax(S - beta * (A_offdiag @ A))`` with ``S`` the pre-softmax scores (or
  ``log A``). One batched matmul; the fast path for training. It is accurate only while
  ``beta * A_ij`` is small: both approximations drop terms of order ``(beta A_ij)^2``,
  and for large beta the first-order penalty grows without bound where the exact one
  saturates at ``-J_ij`` per sender.

Zero entries of ``A`` (causal mask, padded keys) stay zero, ``beta = 0`` returns the
input unchanged, and rows with no mass (padded queries) come back all zero.

Example:
    >>> import torch
    >>> from interp.attention import entropy, saobp
    >>> sink = torch.tril(torch.full((4, 4), 0.1)); sink[:, 0] = 1.0
    >>> sink = sink / sink.sum(-1, keepdim=True)
    >>> refined = saobp(sink, beta=4.0)
    >>> bool((entropy(refined) >= entropy(sink)).all())
    True
    >>> torch.equal(saobp(sink, beta=0.0), sink)
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from interp.attention.metrics import KeyMask, _check_pattern, check_key_mask
from interp.errors import InterpError
from interp.typing import Pattern
from interp.validate import checked

Mode = Literal["exact", "first_order"]
Beta = float | Float[Tensor, "*head"]
Scores = Float[Tensor, "... query key"]

MODES: tuple[str, ...] = ("exact", "first_order")
# Exact mode builds chunk * L * L elements per (batch, head) at a time; the default chunk
# keeps each such buffer at about this many elements (16 MiB in float32).
DEFAULT_CHUNK_ELEMENTS = 2**22

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "MODES", "saobp", "saobp_hook"]


def _beta_for(pattern: Tensor, beta: Beta) -> float | Tensor:
    """Check beta and shape a per-head vector to broadcast over ``[..., head, q, k]``."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float, Tensor)):
        raise InterpError(f"beta must be a float or a per-head tensor, got {type(beta).__name__}.")
    if not isinstance(beta, Tensor):
        if not 0 <= beta < math.inf:
            raise InterpError(f"beta must be finite and >= 0 (the Potts factor is repulsive), got {beta!r}.")
        return float(beta)
    if bool((beta.detach() < 0).any()) or not bool(torch.isfinite(beta.detach()).all()):
        raise InterpError("beta must be finite and >= 0 everywhere; keep a learnable beta positive with softplus.")
    if beta.ndim == 0:
        return beta
    if beta.ndim == 1:
        if pattern.ndim < 3 or beta.shape[0] != pattern.shape[-3]:
            raise InterpError(
                f"A per-head beta of shape {tuple(beta.shape)} needs a pattern [..., head, query, key] with "
                f"{beta.shape[0]} heads, got pattern shape {tuple(pattern.shape)}."
            )
        return beta.reshape(-1, 1, 1)
    if beta.shape[-2:] != (1, 1):
        raise InterpError(
            f"A beta tensor with {beta.ndim} axes must end in two size-1 axes ([..., head, 1, 1]) so it "
            f"broadcasts over queries and keys; got shape {tuple(beta.shape)}."
        )
    return beta


def _is_zero(beta: float | Tensor) -> bool | Tensor:
    return beta == 0.0 if isinstance(beta, float) else (beta == 0)


def _valid_entries(pattern: Tensor, key_mask: KeyMask | None) -> Tensor:
    """Entries that may carry mass in the refined pattern: nonzero in A and not padded."""
    valid = pattern > 0
    if key_mask is not None:
        check_key_mask(key_mask, pattern)
        valid = valid & key_mask.unsqueeze(-2)
    return valid


def _masked_softmax(logits: Tensor, valid: Tensor) -> Tensor:
    """Softmax over valid keys; rows without a valid key give zeros instead of NaN."""
    logits = torch.where(valid, logits, float("-inf"))
    row_has_mass = valid.any(-1, keepdim=True)
    if bool(row_has_mass.all()):
        return torch.softmax(logits, dim=-1)
    logits = logits.masked_fill(~row_has_mass, 0.0)
    return torch.softmax(logits, dim=-1).masked_fill(~row_has_mass, 0.0)


def _safe_log(pattern: Tensor, valid: Tensor) -> Tensor:
    # log(1) on invalid entries keeps log's gradient finite there (0 * inf would be NaN).
    return torch.log(torch.where(valid, pattern, torch.ones_like(pattern)))


def _first_order(pattern: Tensor, beta: float | Tensor, valid: Tensor, scores: Tensor | None) -> Tensor:
    """``softmax(S - beta * (A_offdiag @ A))``: one matmul, accurate for small beta."""
    # (A_offdiag @ A)_ik = sum_j A_ij A_jk - A_ii A_ik: drop the j = i term after the matmul.
    two_hop = pattern @ pattern - pattern.diagonal(dim1=-2, dim2=-1).unsqueeze(-1) * pattern
    logits = _safe_log(pattern, valid) if scores is None else scores.to(pattern.dtype)
    if isinstance(beta, float):
        logits = torch.add(logits, two_hop, alpha=-beta)
    else:
        logits = torch.addcmul(logits, beta, two_hop, value=-1.0)
    return _masked_softmax(logits, valid)


def _default_chunk(pattern: Tensor) -> int:
    n = pattern.shape[-1]
    per_query = max(1, pattern[..., 0, 0].numel()) * n * n
    within_budget = max(1, DEFAULT_CHUNK_ELEMENTS // per_query)
    # At least ~8 chunks, so that causal slicing (below) can skip the empty upper blocks.
    return max(1, min(n, within_budget, -(-n // 8)))


def _log_messages(damping: Tensor, senders: Tensor, ceiling: float) -> Tensor:
    """``sum_j log(1 - c_ij A_jk)`` for a chunk: ``[..., chunk, sender] x [..., sender, key] -> [..., chunk, key]``."""
    product = damping.unsqueeze(-1) * senders.unsqueeze(-3)  # [..., chunk, sender, key]
    # Floor 1 - cA at eps so log and its gradient stay finite when beta * A_ij > ~16.
    if torch.is_grad_enabled() and product.requires_grad:
        return torch.log1p(-product.clamp(max=ceiling)).sum(-2)
    return product.clamp_(max=ceiling).neg_().log1p_().sum(-2)


def _exact(pattern: Tensor, beta: float | Tensor, valid: Tensor, chunk: int | None) -> Tensor:
    """Exact one-step BP belief, a chunk of queries at a time."""
    n = pattern.shape[-1]
    chunk = _default_chunk(pattern) if chunk is None else chunk
    # A causal pattern has no mass above the diagonal, so for queries < end only senders
    # j < end and keys k < end matter; slicing to them skips most of the work.
    causal = not bool(torch.triu(pattern.detach(), diagonal=1).any())
    log_prior = _safe_log(pattern, valid)
    ceiling = 1.0 - torch.finfo(pattern.dtype).eps
    pieces = []
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        width = end if causal else n
        queries = torch.arange(start, end, device=pattern.device)
        is_self = queries[:, None] == torch.arange(width, device=pattern.device)[None, :]
        coupling = (beta * pattern[..., start:end, :width]).masked_fill(is_self, 0.0)  # J_ij, no self-message
        damping = -torch.expm1(-coupling)  # c_ij
        messages = _log_messages(damping, pattern[..., :width, :width], ceiling)
        refined = _masked_softmax(log_prior[..., start:end, :width] + messages, valid[..., start:end, :width])
        pieces.append(torch.nn.functional.pad(refined, (0, n - width)))
    return torch.cat(pieces, dim=-2)


@checked
def saobp(
    pattern: Pattern,
    beta: Beta,
    mode: Mode = "exact",
    chunk: int | None = None,
    scores: Scores | None = None,
    key_mask: KeyMask | None = None,
    *,
    check: bool = True,
) -> Pattern:
    """Refine attention patterns with one step of repulsive-Potts belief propagation.

    Args:
        pattern: ``[..., query, key]`` square attention pattern, rows summing to 1 (zeros
            above the diagonal for causal models, zero columns for padded keys, all-zero
            rows for padded queries). Usually ``[batch, head, query, key]``.
        beta: coupling strength ``>= 0``. A float, a 0-d tensor, a ``[head]`` tensor that
            applies to axis -3, or a ``[..., head, 1, 1]`` tensor that broadcasts against ``pattern``. A tensor
            beta may require grad (learnable beta).
        mode: ``"exact"`` (the formula in the module docstring) or ``"first_order"``
            (``softmax(S - beta * (A_offdiag @ A))``, accurate for small beta only).
        chunk: exact mode only: number of queries processed at once. Without autograd the
            peak extra memory is one ``chunk * L * L`` buffer per (batch, head) pair (the
            message term, built in place) plus ``O(L * L)`` for the output and log prior;
            i.e. ``batch * heads * chunk * L * L`` elements in all. By default chunk is the
            smaller of ``ceil(L / 8)`` and the value that keeps that buffer at about
            ``2**22`` elements (16 MiB in float32), at least 1. Under autograd each chunk
            keeps about four such buffers for backward, so training in exact mode holds
            roughly ``4 * L**3 / 3`` elements per (batch, head) for a causal pattern (a
            chunk ending at query ``e`` builds only senders and keys ``< e``).
        scores: first-order mode only: the pre-softmax scores ``S`` ``[..., query, key]``.
            When None, ``log A`` is used (equal to ``S`` up to a per-row constant).
        key_mask: ``[..., key]`` bool, True for real keys. Masked keys get zero mass in the
            result even if ``pattern`` gives them some.
        check: validate the pattern's values (finite, non-negative, rows summing to 1 or 0;
            see :func:`interp.attention.metrics.entropy`). The inference hook passes False:
            it refines the model's own softmax output.

    Returns:
        The refined pattern ``B``, same shape and dtype as ``pattern``. Entries that are
        zero in ``pattern`` stay zero; ``beta == 0`` (per head, for a tensor) returns the
        input bitwise.

    Raises:
        InterpError: bad mode, negative or non-finite beta, a non-square pattern, a pattern
            that is not a stack of distributions, NaN or +inf scores, or mismatched shapes.

    Example:
        >>> import torch
        >>> a = torch.tensor([[1.0, 0.0, 0.0], [0.8, 0.2, 0.0], [0.7, 0.2, 0.1]])
        >>> saobp(a, beta=2.0)[2]
        tensor([0.3071, 0.4513, 0.2416])
    """
    _check_pattern(pattern, square=True, check=check)
    if mode not in MODES:
        raise InterpError(f"Unknown SAOBP mode {mode!r}; use one of {', '.join(MODES)}.")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise InterpError(f"chunk must be a positive integer number of queries, got {chunk!r}.")
    if scores is not None and scores.shape[-2:] != pattern.shape[-2:]:
        raise InterpError(
            f"scores {tuple(scores.shape)} must match the pattern {tuple(pattern.shape)} in its last two axes."
        )
    if scores is not None and bool((scores.isnan() | (scores == math.inf)).any()):
        raise InterpError("scores contain NaN or +inf; pre-softmax scores are finite (-inf only at masked keys).")
    beta = _beta_for(pattern, beta)
    zero = _is_zero(beta)
    if isinstance(zero, bool) and zero:
        return pattern
    if isinstance(zero, Tensor) and bool(zero.all()):
        return pattern
    original_dtype = pattern.dtype
    work = pattern.float() if original_dtype in (torch.float16, torch.bfloat16) else pattern
    if isinstance(beta, Tensor):
        beta = beta.to(device=work.device, dtype=work.dtype)
    valid = _valid_entries(work, key_mask)
    if mode == "first_order":
        refined = _first_order(work, beta, valid, scores)
    else:
        refined = _exact(work, beta, valid, chunk)
    refined = refined.to(original_dtype)
    if isinstance(zero, Tensor) and bool(zero.any()):
        refined = torch.where(zero, pattern, refined)
    return refined


@checked
def saobp_hook(beta: Beta, mode: Mode = "exact", chunk: int | None = None) -> Callable[[Tensor, Any], Tensor]:
    """A transformer-lens forward hook that replaces an attention pattern by its SAOBP refinement.

    Attach it to ``blocks.{layer}.attn.hook_pattern`` (pattern ``[batch, head, query, key]``)
    on the layers to refine; the bridge then uses the refined pattern for the attention
    output, so loss, entropy and GTD downstream all see SAOBP. Padded keys have zero mass in
    the hooked pattern and stay at zero. The settings are checked once, here.

    Args:
        beta: as in :func:`saobp` (a ``[head]`` tensor applies per head).
        mode: ``"exact"`` or ``"first_order"``.
        chunk: exact-mode query chunk, as in :func:`saobp`.

    Returns:
        ``fn(pattern, hook) -> refined_pattern``.

    Example:
        >>> hook_fn = saobp_hook(4.0)
        >>> a = torch.tril(torch.ones(1, 2, 3, 3)); a = a / a.sum(-1, keepdim=True)
        >>> hook_fn(a, hook=None).shape
        torch.Size([1, 2, 3, 3])
    """
    if mode not in MODES:
        raise InterpError(f"Unknown SAOBP mode {mode!r}; use one of {', '.join(MODES)}.")
    # a shape-only probe for the checks: on the meta device it holds no memory and meets no data
    probe = torch.zeros(1, beta.shape[0] if isinstance(beta, Tensor) and beta.ndim == 1 else 1, 1, 1, device="meta")
    _beta_for(probe, beta)

    def hook_fn(pattern: Tensor, hook: Any) -> Tensor:  # [batch, head, query, key]
        return saobp(pattern, beta, mode=mode, chunk=chunk, check=False)  # the model's own softmax output

    return hook_fn
