"""How localized is an attention pattern? Entropy, GTD, sink share and effective span.

Every function here is a pure function of an attention pattern ``A`` of shape
``[..., query, key]`` (any leading axes: batch, head, layer). Row ``i`` is the
distribution of query ``i`` over the keys. The patterns this project meets are causal
(``A[i, k] = 0`` for ``k > i``), may carry zero columns for padded keys, and may carry
all-zero rows for padded queries. All-zero rows give ``0`` everywhere here, never NaN;
use :func:`valid_query_mask` to leave them (and the first position, which can only see
one key) out of averages.

Quantities (per query ``i``, natural logs):

* **Entropy** ``H_i = -sum_k A_ik log A_ik`` with ``0 log 0 = 0``. It lies in
  ``[0, log n_i]`` where ``n_i`` is the number of keys query ``i`` may attend to. The
  normalized entropy ``H_i / log n_i`` lies in ``[0, 1]`` so short prefixes do not look
  collapsed. A collapsed head (everything on one "sink" key) has entropy near 0.
* **Effective span** ``exp(H_i)``: the number of keys a uniform distribution with the same
  entropy would cover.
* **Sink share** ``A_i,sink``: mass on one key, by default key 0 (the BOS token).
* **Global Token Dependency (GTD)**: the total variation distance between the direct
  attention row ``A_i`` and the multi-hop walk mixture
  ``W = sum_{m=2..K} alpha^(m-2) A^m / sum_{m=2..K} alpha^(m-2)``. With ``K = 2`` this is
  ``TV(A_i, (A @ A)_i)``. If a head has collapsed onto a sink that attends to itself,
  ``A @ A = A`` and GTD is 0: multi-hop paths add nothing. Chains ``i -> j -> k`` over
  distinct tokens give a high GTD.

The GTD formula is this project's own derivation from the description in the SAOBP paper
(Findings of EMNLP 2025, arXiv 2509.07324), which calls GTD "the relative contribution of
multi-hop connections in the attention graph"; ``hops`` and ``alpha`` let a user match
another reading. See ``docs/attention.md``.

Example:
    >>> import torch
    >>> from interp.attention import entropy, gtd, valid_query_mask
    >>> uniform = torch.tril(torch.ones(4, 4))
    >>> uniform = uniform / uniform.sum(-1, keepdim=True)
    >>> entropy(uniform, normalized=True)
    tensor([0., 1., 1., 1.])
    >>> valid_query_mask(4)
    tensor([False,  True,  True,  True])
    >>> sink = torch.zeros(4, 4); sink[:, 0] = 1.0
    >>> gtd(sink)
    tensor([0., 0., 0., 0.])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from jaxtyping import Bool
from torch import Tensor

from interp import validate
from interp.errors import InterpError
from interp.results import row_sum_tolerance  # re-exported: defined below the analyses, which all read it
from interp.typing import Pattern, PerQuery
from interp.validate import checked

KeyMask = Bool[Tensor, "... key"]
QueryMask = Bool[Tensor, "... query"]

__all__ = [
    "METRICS",
    "AttentionMetric",
    "effective_span",
    "entropy",
    "gtd",
    "keys_per_query",
    "check_key_mask",
    "check_pattern_values",
    "masked_mean",
    "row_sum_tolerance",
    "sink_share",
    "valid_query_mask",
]


def check_pattern_values(pattern: Tensor) -> None:
    """Refuse NaN/inf, negative entries, and rows that sum neither to 1 nor to 0 (a padded query).

    Raises:
        InterpError: naming the first bad row and what a pattern must be.
    """
    work = _working_dtype(pattern)
    if not bool(torch.isfinite(work).all()):
        raise InterpError("The attention pattern contains NaN or inf; patterns are softmax outputs with entries in "
                          "[0, 1]. Check the model's activations (or its dtype) before measuring them.")
    if bool((work < 0).any()):
        raise InterpError(f"The attention pattern has negative entries (smallest {float(work.min()):.3g}); "
                          "pass the softmax output (hook_pattern), not the scores (hook_attn_scores).")
    sums = work.sum(-1)
    tolerance = row_sum_tolerance(pattern)
    bad = ((sums - 1).abs() > tolerance) & (sums != 0)
    if bool(bad.any()):
        index = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise InterpError(
            f"Row {index} of the attention pattern sums to {float(sums[index]):.6g}, not 1 (tolerance "
            f"{tolerance:.2g} from float rounding) or 0 (a padded query). Pass a pattern [..., query, key] whose "
            "rows are distributions over keys, e.g. cache['blocks.0.attn.hook_pattern']."
        )


def check_key_mask(key_mask: Tensor, pattern: Tensor) -> None:
    """A key mask is a bool tensor ``[..., key]`` over the pattern's keys that broadcasts over its leading axes."""
    n_keys = pattern.shape[-1]
    if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool or key_mask.ndim < 1:
        raise InterpError(f"key_mask must be a bool tensor [..., key] (True = real token), got "
                          f"{getattr(key_mask, 'dtype', type(key_mask).__name__)}.")
    try:
        fits = key_mask.shape[-1] == n_keys and torch.broadcast_shapes(key_mask.shape[:-1], pattern.shape[:-2]) \
            == pattern.shape[:-2]
    except RuntimeError:
        fits = False
    if not fits:
        raise InterpError(f"key_mask {tuple(key_mask.shape)} does not fit the pattern {tuple(pattern.shape)}: it "
                          f"must be [..., key] with {n_keys} keys, its leading axes broadcasting to "
                          f"{tuple(pattern.shape[:-2])}.")


def _check_pattern(pattern: Tensor, *, square: bool = False, check: bool = True) -> None:
    if not isinstance(pattern, Tensor) or pattern.ndim < 2:
        raise InterpError(
            "An attention pattern must be a tensor of shape [..., query, key]; "
            f"got {type(pattern).__name__} with shape {getattr(pattern, 'shape', None)}. "
            "Pass e.g. cache['blocks.0.attn.hook_pattern'] ([batch, head, query, key])."
        )
    if not pattern.is_floating_point():
        raise InterpError(f"An attention pattern must be floating point, got {pattern.dtype}; call .float() first.")
    q, k = pattern.shape[-2:]
    if q > k:
        raise InterpError(
            f"The pattern has more queries ({q}) than keys ({k}); pass it as [..., query, key], not transposed."
        )
    if square and q != k:
        raise InterpError(
            f"This quantity needs the full square pattern (query == key), got {q} x {k}. "
            "Run the model on the whole sequence without a KV cache (use_cache=False)."
        )
    if check:
        check_pattern_values(pattern)


def _working_dtype(pattern: Tensor) -> Tensor:
    """Half-precision patterns are upcast: sums of many small terms lose too much in fp16."""
    return pattern.float() if pattern.dtype in (torch.float16, torch.bfloat16) else pattern


@checked
def keys_per_query(n_queries: int, key_mask: KeyMask | None = None, n_keys: int | None = None, *,
                   device: torch.device | str | None = None) -> Tensor:
    """Number of keys ``n_i`` each query may attend to under a causal mask and padding.

    Queries are aligned to the last ``n_queries`` keys (query ``i`` sits at key position
    ``n_keys - n_queries + i``), which is the layout of a causal model with or without a
    cached prefix.

    Args:
        n_queries: number of query positions ``q``.
        key_mask: ``[..., key]`` bool, True for real (non-padded) keys. ``None`` means every
            key is real.
        n_keys: number of keys when ``key_mask`` is None; defaults to ``n_queries``.
        device: where the counts are made when ``key_mask`` is None (the device of the pattern they
            meet; default the CPU); with a mask they are made on the mask's device.

    Returns:
        ``[..., query]`` int64 counts (shape ``[query]`` when ``key_mask`` is None).

    Example:
        >>> keys_per_query(3)
        tensor([1, 2, 3])
        >>> keys_per_query(3, torch.tensor([False, True, True]))
        tensor([0, 1, 2])
    """
    if key_mask is None:
        n_keys = n_queries if n_keys is None else n_keys
        return torch.arange(1, n_queries + 1, device=device) + (n_keys - n_queries)
    if key_mask.dtype != torch.bool:
        raise InterpError(f"key_mask must be a bool tensor [..., key] (True = real token), got {key_mask.dtype}.")
    n_keys = key_mask.shape[-1]
    if n_queries > n_keys:
        raise InterpError(
            f"key_mask covers {n_keys} keys but there are {n_queries} queries; pass a mask over all keys."
        )
    counts = key_mask.long().cumsum(-1)
    return counts[..., n_keys - n_queries :]


@checked
def valid_query_mask(n_queries: int, key_mask: KeyMask | None = None, min_keys: int = 2, *,
                     device: torch.device | str | None = None) -> QueryMask:
    """Which queries to include when averaging a per-query quantity.

    A query is valid when its own position is a real token (not padding) and it may
    attend to at least ``min_keys`` keys. With the default ``min_keys=2`` the first real
    position, which can only attend to itself (entropy 0 by construction, normalized
    entropy undefined), is excluded, as the spec asks for normalized means.

    Args:
        n_queries: number of query positions.
        key_mask: ``[..., key]`` bool, True for real keys; None means no padding.
        min_keys: smallest number of visible keys a query needs to count.
        device: where the mask is made when ``key_mask`` is None (as in :func:`keys_per_query`).

    Returns:
        ``[..., query]`` bool mask (``[query]`` when ``key_mask`` is None).

    Example:
        >>> valid_query_mask(3, torch.tensor([[True, True, True], [False, True, True]]))
        tensor([[False,  True,  True],
                [False, False,  True]])
    """
    n_visible = keys_per_query(n_queries, key_mask, device=device)
    valid = n_visible >= min_keys
    if key_mask is not None:
        valid = valid & key_mask[..., key_mask.shape[-1] - n_queries :]
    return valid


@checked
def masked_mean(values: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of ``values`` over the entries where ``mask`` is True (mask broadcasts).

    Entries outside the mask do not count, even if they are NaN. A slice with no valid
    entry gives NaN, which makes an empty selection visible instead of silently 0.

    Example:
        >>> masked_mean(torch.tensor([1.0, 3.0, float("nan")]), torch.tensor([True, True, False]))
        tensor(2.)
    """
    mask = mask.expand_as(values)
    total = torch.where(mask, values, torch.zeros_like(values)).sum(dim=dim)
    count = mask.sum(dim=dim)
    return total / count


@checked
def entropy(pattern: Pattern, normalized: bool = False, key_mask: KeyMask | None = None, *,
            check: bool = True) -> PerQuery:
    """Attention entropy per query, in nats (``0 log 0 = 0``).

    Args:
        pattern: ``[..., query, key]`` rows summing to 1 (or all zero for padded queries).
        normalized: divide by ``log n_i``, where ``n_i`` is the number of keys query ``i``
            may attend to (causal and not padded). Queries with ``n_i <= 1`` give 0; drop
            them from means with :func:`valid_query_mask`.
        key_mask: ``[..., key]`` bool, True for real keys, used only to count ``n_i``.
        check: refuse NaN/inf, negative entries and rows summing to neither 1 nor 0
            (within :func:`interp.attention.metrics.row_sum_tolerance`). Pass False only in loops over patterns
            already known to be softmax outputs (e.g. hooks on a model's pattern).

    Returns:
        ``[..., query]`` entropies: in ``[0, log n_i]``, or ``[0, 1]`` when normalized
        (clamped at 0: a one-hot row a rounding above 1 would give ``-1e-7``).

    Raises:
        InterpError: a pattern that is not a stack of distributions, or a bad key_mask.

    Example:
        >>> entropy(torch.tensor([[1.0, 0.0], [0.5, 0.5]]))
        tensor([0.0000, 0.6931])
    """
    _check_pattern(pattern, check=check)
    if key_mask is not None:
        check_key_mask(key_mask, pattern)
    work = _working_dtype(pattern)
    h = (0.0 - torch.special.xlogy(work, work).sum(-1)).clamp_(min=0.0)  # 0.0 - x avoids printing -0.
    if not normalized:
        return h
    n_visible = keys_per_query(pattern.shape[-2], key_mask, n_keys=pattern.shape[-1], device=h.device).to(h.device)
    log_n = torch.log(n_visible.clamp_min(1).to(h.dtype))
    return torch.where(n_visible > 1, h / torch.where(n_visible > 1, log_n, torch.ones_like(log_n)), 0.0)


@checked
def effective_span(pattern: Pattern, *, check: bool = True) -> PerQuery:
    """Effective number of attended keys, ``exp(H_i)``; 1 for a one-hot (or all-zero) row.

    Example:
        >>> effective_span(torch.tensor([[0.25, 0.25, 0.25, 0.25]]))
        tensor([4.])
    """
    return torch.exp(entropy(pattern, check=check))


@checked
def sink_share(pattern: Pattern, sink: int = 0, *, check: bool = True) -> PerQuery:
    """Attention mass each query puts on the key at index ``sink`` (default 0, the BOS).

    Example:
        >>> sink_share(torch.tensor([[1.0, 0.0], [0.7, 0.3]]))
        tensor([1.0000, 0.7000])
    """
    _check_pattern(pattern, check=check)
    n_keys = pattern.shape[-1]
    if not validate.is_integer(sink):
        raise InterpError(f"sink must be an integer key index, got {sink!r} ({type(sink).__name__}).")
    if not -n_keys <= sink < n_keys:
        raise InterpError(f"sink={sink} is out of range for {n_keys} keys; pass a key index in [0, {n_keys - 1}].")
    return pattern[..., sink]


def _walk_mixture(pattern: Tensor, hops: int, alpha: float) -> Tensor:
    """``sum_{m=2..hops} alpha^(m-2) A^m`` divided by the sum of its weights."""
    power = pattern @ pattern
    if hops == 2:
        return power
    mixture = power.clone()
    weight_sum = 1.0
    for m in range(3, hops + 1):
        power = power @ pattern
        weight = alpha ** (m - 2)
        mixture = mixture + weight * power
        weight_sum += weight
    return mixture / weight_sum


@checked
def gtd(pattern: Pattern, hops: int = 2, alpha: float = 1.0, *, check: bool = True) -> PerQuery:
    """Global Token Dependency: ``TV(A_i, W_i)`` with ``W`` the multi-hop walk mixture.

    ``W = sum_{m=2..hops} alpha^(m-2) A^m / sum_{m=2..hops} alpha^(m-2)``, and
    ``TV(p, q) = 1/2 sum_k |p_k - q_k|``. This is the project's reading of the paper's GTD
    (see the module docstring). Padded keys carry no mass so ``A^m`` stays well defined;
    padded query rows give 0 (drop them with :func:`valid_query_mask`).

    Args:
        pattern: ``[..., query, key]`` square pattern (query == key).
        hops: longest walk ``K >= 2`` in the mixture.
        alpha: geometric weight of each extra hop (finite, ``>= 0``).
        check: validate the pattern's values (see :func:`entropy`).

    Returns:
        ``[..., query]`` values clamped to ``[0, 1]``.

    Example:
        >>> chain = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
        >>> gtd(chain)
        tensor([0., 0., 1.])
    """
    _check_pattern(pattern, square=True, check=check)
    if isinstance(hops, bool) or not isinstance(hops, int) or hops < 2:
        raise InterpError(f"hops must be an integer >= 2 (2 compares A with A @ A), got {hops!r}.")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (0 <= alpha < math.inf):
        raise InterpError(f"alpha must be a finite number >= 0 (the weight of each extra hop), got {alpha!r}.")
    work = _working_dtype(pattern)
    # the mixture is a fresh buffer: subtract, abs and halve in place (no 3 extra [.., q, k] copies)
    distance = _walk_mixture(work, hops, alpha).sub_(work).abs_().sum(-1).mul_(0.5)
    return distance.clamp_(0.0, 1.0)


# ---------------------------------------------------------------------------------------
# The metric table: probe reducers, the analysis, its figures, the training logs and the
# CLI all read this. Adding a metric is one entry here (and its function above).


@dataclass(frozen=True)
class AttentionMetric:
    """One attention metric: its function, its axis label, and its column stem in training logs.

    ``compute`` maps a pattern ``[..., query, key]`` to ``[..., query]`` without re-checking the
    values (callers pass the model's own softmax output). Means over queries leave query 0 out
    when asked (it sees only BOS), and always when ``skip_first_query`` is set (normalised
    entropy is 0/0 there).
    """

    name: str
    label: str
    compute: Callable[[Tensor], Tensor]
    log_name: str
    skip_first_query: bool = False


METRICS: dict[str, AttentionMetric] = {metric.name: metric for metric in (
    AttentionMetric("entropy", "entropy (nats)", partial(entropy, check=False), "entropy"),
    AttentionMetric("entropy_norm", "normalised entropy", partial(entropy, normalized=True, check=False),
                    "entropy_norm", skip_first_query=True),
    AttentionMetric("gtd", "GTD", partial(gtd, check=False), "gtd"),
    AttentionMetric("sink_share", "sink share (mass on BOS)", partial(sink_share, check=False), "sink"),
    AttentionMetric("effective_span", "effective span exp(H)", partial(effective_span, check=False),
                    "effective_span"),
)}
