"""The patching engine (:func:`patch`) and the textbook loop it is checked against (:func:`patch_naive`).

How the engine saves time without changing results:

1. the source's activations are captured once per batch, for every patch;
2. the target's residual stream entering each block is cached once per batch, and each
   patched run starts at its lowest patched layer, running the Hugging Face decoder layers
   directly (rotary position embeddings and causal masks rebuilt as the model's own forward
   builds them; checked against a full forward on the first batch);
3. patches starting at the same layer share one forward: their rows are stacked (up to
   ``max_rows``), and patches starting higher join the stack when it reaches their layer;
4. the metric is computed from the final residual in row chunks, never as ``[rows, T, vocab]``.

Padded examples and pairs of different lengths (see :func:`patch`) take a second path, only
when the rows need it: each row is left-aligned (:func:`interp.data.left_aligned`, its real
tokens first, so under the causal mask they never see padding and keep their own position
ids), the source's activations are moved to the target row's positions (the two rows
aligned at their last real token), each patch writes through a per-row mask, and the metric
reads positions ``< length`` only. Unpadded rows of one length run exactly as before.

Example:
    >>> import interp, torch
    >>> from interp.localize.patching.engine import patch, patch_naive
    >>> from interp.localize.patching.patches import single_layer_patches
    >>> model = interp.tiny_model("llama")
    >>> clean = interp.Examples.from_tokens(torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0)))
    >>> other = interp.Examples.from_tokens(torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1)))
    >>> jobs = single_layer_patches(["resid_pre", "down"], [0, 1])
    >>> fast = patch(model, model, other, jobs, source_examples=clean)
    >>> slow = patch_naive(model, model, other, jobs, source_examples=clean)
    >>> bool((fast.values - slow.values).abs().max() < 1e-4)
    True
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from interp.data import Examples, left_aligned
from interp.errors import NonFiniteError
from interp.localize.patching.checks import (  # noqa: F401 (paths, attribution and eap import some from here)
    _check_pair,
    _checked_lengths,
    _checked_patches,
    _metric_values,
    _result,
    _settings,
    _source_keys,
    _takes_lengths,
)
from interp.localize.patching.metrics import Metric, PerRow, _metric
from interp.localize.patching.patches import Patch
from interp.localize.patching.results import PatchResult
from interp.models import Model
from interp.runtime import hooks as hk
from interp.runtime.batching import batches, device_of, listed, show_progress
from interp.runtime.capture import capture
from interp.runtime.decoder import DecoderRunner
from interp.runtime.readout import Readout
from interp.runtime.scoring import model_logits
from interp.runtime.swap import BlockWeights, WeightStash, is_block_weights, swapped
from interp.typing import Key, Resid, Tokens
from interp.validate import checked, model_or_weights

# ---------------------------------------------------------------------------------------
# Hooks that replace an activation by the source's


def _assign(x: Tensor, row: int, src: Tensor, positions: Tensor | None, heads: Tensor | None) -> None:
    """Overwrite rows ``row:row+B`` of ``x`` with ``src`` (at some positions / heads)."""
    view = x[row : row + src.shape[0]]
    if positions is None and heads is None:
        view.copy_(src)
    elif heads is None:
        view[:, positions] = src[:, positions]
    elif positions is None:
        view[:, :, heads] = src[:, :, heads]
    else:
        grid = positions[:, None]
        view[:, grid, heads] = src[:, grid, heads]


def _assign_masked(x: Tensor, row: int, src: Tensor, mask: Tensor) -> None:
    """Overwrite rows ``row:row+B`` of ``x`` with ``src`` where ``mask`` ([B, T] or [B, T, heads]) is set."""
    view = x[row : row + src.shape[0]]
    view[mask] = src[mask]


_Entry = tuple[int, Tensor, Tensor | None, Tensor | None, Tensor | None]  # row, src, positions, heads, mask


def _replacer(entries: list[_Entry]) -> Callable[[Tensor, Any], Tensor]:
    def replace(x: Tensor, hook: Any) -> Tensor:
        x = x.clone()
        for row, src, positions, heads, mask in entries:
            if mask is None:
                _assign(x, row, src, positions, heads)
            else:
                _assign_masked(x, row, src, mask)
        return x
    return replace


def _as_index(values: Sequence[int] | None, device: torch.device, width: int | None = None) -> Tensor | None:
    """Indices as a tensor on ``device``; with ``width``, negative positions count from the end (-1: ``width - 1``)."""
    if values is None:
        return None
    return _index_on(tuple(values if width is None else [q % width for q in values]), device)


@functools.lru_cache(maxsize=1024)
def _index_on(values: tuple[int, ...], device: torch.device) -> Tensor:
    """Cached: the staggered runner builds its hooks at every layer, and each would otherwise copy the
    same few indices from the host again. The tensors are only read (indexing), never written."""
    return torch.tensor(values, dtype=torch.long, device=device)


def _patch_hooks(model: Model, jobs: Sequence[Patch], cache: Mapping[Key, Tensor], batch: int,
                 layer: int | None = None, masks: Sequence[Tensor] | None = None
                 ) -> list[tuple[str, Callable[..., Any]]]:
    """Hooks applying job ``j`` to rows ``j*batch:(j+1)*batch`` (only at ``layer`` when given).

    ``masks[j]`` (padded or unequal pairs) says which target positions (and heads) job ``j``
    overwrites, per row; ``cache`` then holds the source already moved to the target's positions.
    """
    grouped: dict[str, list[_Entry]] = {}
    for j, job in enumerate(jobs):
        for patched_layer in job.layers:
            if layer is not None and patched_layer != layer:
                continue
            name = hk.hook_point(model, job.component, patched_layer)
            src = cache[(job.component, patched_layer)]
            if masks is not None:
                entry: _Entry = (j * batch, src, None, None, masks[j])
            else:
                entry = (j * batch, src, _as_index(job.positions, src.device, src.shape[1]),
                         _as_index(job.heads, src.device), None)
            grouped.setdefault(name, []).append(entry)
    return [(name, _replacer(entries)) for name, entries in grouped.items()]


# ---------------------------------------------------------------------------------------
# Padded examples and pairs of different lengths: rows left-aligned, aligned at their ends


def _aligned_rows(tokens: Tokens, mask: Tensor | None) -> tuple[Tokens, Tensor]:
    """Rows with their real tokens first, cut to the longest row: ``(tokens, lengths)``."""
    if mask is None:
        return tokens, torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long, device=tokens.device)
    tokens, lengths = left_aligned(tokens, mask.to(tokens.device))
    return tokens[:, : int(lengths.max())], lengths


def _row_positions(q: int, target_len: Tensor) -> Tensor:
    """Target-row position of patch position ``q`` per row (negative ``q`` counts from each row's end)."""
    return target_len + q if q < 0 else torch.full_like(target_len, q)


def _job_mask(job: Patch, target_len: Tensor, source_len: Tensor, width: int, n_heads: int) -> Tensor:
    """``[B, width]`` (``[B, width, heads]`` for a head subset): the target positions ``job`` overwrites."""
    b = target_len.shape[0]
    pos = torch.arange(width, device=target_len.device)
    if job.positions is None:  # the last min(len_t, len_s) real positions of each target row
        first = (target_len - source_len).clamp(min=0)
        mask = (pos[None] >= first[:, None]) & (pos[None] < target_len[:, None])
    else:
        mask = torch.zeros(b, width, dtype=torch.bool, device=target_len.device)
        rows = torch.arange(b, device=target_len.device)
        for q in job.positions:
            mask[rows, _row_positions(q, target_len)] = True
    if job.heads is not None:
        chosen = torch.zeros(n_heads, dtype=torch.bool, device=mask.device)
        chosen[list(job.heads)] = True
        mask = mask[:, :, None] & chosen
    return mask


def _end_aligned(src: Tensor, target_len: Tensor, source_len: Tensor, width: int) -> Tensor:
    """``src [B, Ts, ...]`` moved to the target rows' positions: target position ``p`` of row
    ``b`` gets source position ``p + source_len[b] - target_len[b]`` (clamped where there is
    none; the job masks never read those)."""
    pos = torch.arange(width, device=src.device)
    index = (pos[None] + (source_len - target_len).to(src.device)[:, None]).clamp(0, src.shape[1] - 1)
    return src[torch.arange(src.shape[0], device=src.device)[:, None], index]


@dataclass
class _Batch:
    """One batch of examples with everything the patched runs need."""

    tokens: Tokens
    index: Tensor
    source_cache: dict[Key, Tensor]
    target_cache: dict[Key, Tensor]
    lengths: Tensor | None = None  # aligned rows: the target rows' real lengths
    masks: list[Tensor] | None = None  # aligned rows: per patch, the target positions it overwrites


@dataclass
class _SourceSide:
    """What the source run leaves for the target's: the rows (left-aligned when they need it) and the source's
    activations, captured before the target runs (with one copy of the weights, before its weights go in)."""

    tokens: Tokens
    index: Tensor
    source_cache: dict[Key, Tensor]
    lengths: Tensor | None = None  # aligned rows: the target rows' real lengths
    source_lengths: Tensor | None = None  # and the source rows'


class _Engine:
    def __init__(self, target: Model, source: Model, patches: list[Patch], metric: Metric, fast: bool) -> None:
        self.target, self.source, self.patches, self.metric = target, source, patches, metric
        self.readout_target, self.readout_source = Readout(target), Readout(source)
        self.runner = DecoderRunner.for_model(target) if fast else None
        self.verified = self.runner is None
        self.order = sorted(range(len(patches)), key=lambda j: patches[j].start)

    def prepare_source(self, tokens: Tokens, source_tokens: Tokens, index: Tensor,
                       masks: tuple[Tensor | None, Tensor | None] | None = None) -> tuple[_SourceSide, PerRow]:
        """Capture the source for one batch: the patched components' activations and its metric.
        ``masks`` (the target's and source's attention masks, or ``None`` for a side without
        padding) is given when the rows need aligning."""
        lengths = source_lengths = None
        if masks is not None:
            tokens, lengths = _aligned_rows(tokens, masks[0])
            source_tokens, source_lengths = _aligned_rows(source_tokens, masks[1])
        source_cache, source_final = capture(self.source, source_tokens, _source_keys(self.patches))
        source_value = _metric_values(self.metric, "from_resid", self.readout_source, source_final, source_tokens,
                                      index, lengths=source_lengths)
        return _SourceSide(tokens, index, source_cache, lengths, source_lengths), source_value

    def prepare_target(self, side: _SourceSide) -> tuple[_Batch, PerRow]:
        """The target's cached residuals and unpatched metric for the batch ``side`` was captured for."""
        tokens, index, lengths, source_lengths = side.tokens, side.index, side.lengths, side.source_lengths
        keys: list[Key] = []
        if self.runner is not None:
            keys = [("resid_pre", layer) for layer in sorted({p.start for p in self.patches})]
            if not self.verified:
                keys += [(c, layer) for layer in self.runner.check_layers() for c in ("resid_pre", "resid_post")]
        target_cache, target_final = capture(self.target, tokens, keys)
        if not self.verified:
            if not self.runner.verify(target_cache):  # type: ignore[union-attr]
                warnings.warn("interp.localize.patching: running decoder layers from a cached residual did not "
                              "reproduce the model's forward; falling back to full forwards (same results, slower).",
                              stacklevel=3)
                self.runner = None
            self.verified = True
        target_value = _metric_values(self.metric, "from_resid", self.readout_target, target_final, tokens, index,
                                      lengths=lengths)
        batch = _Batch(tokens, index, side.source_cache, target_cache)
        if lengths is not None and source_lengths is not None:
            width, n_heads = tokens.shape[1], int(self.target.cfg.n_heads)
            batch.source_cache = {key: _end_aligned(x, lengths, source_lengths, width)
                                  for key, x in side.source_cache.items()}
            batch.masks = [_job_mask(job, lengths, source_lengths, width, n_heads) for job in self.patches]
            batch.lengths = lengths
        return batch, target_value

    def run_window(self, batch: _Batch, window: list[int]) -> Float[Tensor, "jobs batch"]:
        jobs = [self.patches[j] for j in window]
        masks = None if batch.masks is None else [batch.masks[j] for j in window]
        b = batch.tokens.shape[0]
        final = self._staggered(batch, jobs, masks) if self.runner is not None else self._full(batch, jobs, masks)
        tokens = batch.tokens.repeat(len(jobs), 1)
        lengths = None if batch.lengths is None else batch.lengths.repeat(len(jobs))
        values = _metric_values(self.metric, "from_resid", self.readout_target, final, tokens,
                                batch.index.repeat(len(jobs)), lengths=lengths)
        return values.view(len(jobs), b)

    def _staggered(self, batch: _Batch, jobs: list[Patch], masks: list[Tensor] | None) -> Resid:
        """Jobs (sorted by start layer) join the stacked forward at their first patched layer."""
        runner = self.runner
        assert runner is not None
        hidden: Tensor | None = None
        joined = 0
        # layers with no patch run bridge-free (about 10% faster, identical output) unless the
        # caller has hooks of their own on the target, which must keep firing
        native = not hk.hooks_active(self.target)
        for layer in range(jobs[0].start, len(runner.blocks)):
            new = 0
            while joined + new < len(jobs) and jobs[joined + new].start == layer:
                new += 1
            if new:
                fresh = batch.target_cache[("resid_pre", layer)].repeat(new, 1, 1)
                hidden = fresh if hidden is None else torch.cat([hidden, fresh])
                joined += new
            fwd = _patch_hooks(self.target, jobs[:joined], batch.source_cache, batch.tokens.shape[0], layer,
                               None if masks is None else masks[:joined])
            assert hidden is not None
            if fwd:
                with self.target.hooks(fwd_hooks=fwd):
                    hidden = runner.block(layer, hidden)
            else:
                hidden = runner.block(layer, hidden, native=native)
        assert hidden is not None
        return hidden

    def _full(self, batch: _Batch, jobs: list[Patch], masks: list[Tensor] | None) -> Resid:
        """Fallback: all jobs stacked in one full forward from the tokens."""
        fwd = _patch_hooks(self.target, jobs, batch.source_cache, batch.tokens.shape[0], masks=masks)
        final: dict[str, Tensor] = {}

        def keep(x: Tensor, hook: Any) -> None:
            final["resid"] = x

        last = hk.hook_point(self.target, "resid_post", hk.n_layers(self.target) - 1)
        with self.target.hooks(fwd_hooks=[*fwd, (last, keep)]):
            hk.decoder_body(self.target)(input_ids=batch.tokens.repeat(len(jobs), 1))
        return final["resid"]


@checked(target=model_or_weights)
def patch(
    target: Model | BlockWeights,
    source: Model,
    examples: Examples,
    patches: Sequence[Patch],
    *,
    source_examples: Examples | None = None,
    metric: Metric | str | None = None,
    batch_size: int = 8,
    max_rows: int = 64,
    progress: bool | None = None,
    fast: bool = True,
    stash: WeightStash | None = None,
) -> PatchResult:
    """The patching engine: run ``target`` on ``examples`` with each patch from ``source``.

    Padded examples and pairs of different lengths: ``examples`` and ``source_examples`` may
    carry padding (``attention_mask``, e.g. from :func:`interp.data.examples_from_texts`, left
    or right) and may differ in width; they must have the same number of rows. Each row counts
    as its real tokens alone: it gets the values it has when run alone, unpadded, and pad
    positions never enter a metric. Target row ``n`` and source row ``n`` are aligned at their
    **end** (the last real token of each corresponds: the answer position), so
    target position ``p`` (counted from the row's first real token) takes the source's
    position ``p + len_source - len_target``:

    - ``positions=None`` replaces the target's last ``min(len_target, len_source)`` positions
      and leaves earlier ones as they are;
    - a negative position counts from each row's end (``-1``: the last real token), valid
      when both rows have it (``-q <= min(len_target, len_source)``);
    - a non-negative position is in the target row's coordinates (``0`` is its first real
      token, BOS) and takes its end-aligned source counterpart; a position that a target row
      lacks, or whose counterpart falls before the source row's start, is refused with a
      :class:`~interp.errors.DataError` before anything runs.

    For unpadded rows of one length all of this reduces to the usual: position ``p`` (or
    ``p - T`` from the end) in both runs.

    One copy of the weights: ``target`` may be a variant's block weights alone (a
    :class:`~interp.runtime.swap.BlockWeights` such as :class:`interp.quant.inplace.SavedWeights`,
    told apart as :func:`~interp.validate.is_block_weights` does) with ``source`` the model
    they belong in. Each batch then runs the source first (the patched components' activations
    and the source metric), swaps the target's weights into ``source``
    (:func:`~interp.runtime.swap.swapped`, its own weights stashed on disk once per call), runs the
    unpatched and patched target, and swaps back. The values are the two-model path's (the same
    forwards on the same weights; tested with ``torch.equal``), and ``source`` is bit-identical
    afterwards, also when the run fails inside.

    Args:
        target: the model whose run is patched (e.g. the quantized model, or the model on
            corrupted prompts), or its block weights alone (see above).
        source: the model the activations come from (e.g. the reference; may be ``target``).
        examples: the target's token rows.
        patches: the jobs (see :func:`~interp.localize.patching.patches.single_layer_patches`,
            :func:`~interp.localize.patching.patches.joint_patches`,
            :func:`~interp.localize.patching.patches.position_patches`).
        source_examples: the source's token rows (one per target row, any width, padded or
            not); default ``examples``.
        metric: ``"nll"`` (default) or a :class:`~interp.localize.patching.metrics.LogitDiffMetric`
            (read at each row's own position: ``-1`` is its last real token).
        batch_size: examples per batch.
        max_rows: the most rows (examples x stacked jobs) in one forward; sets peak memory.
        progress: show a progress bar.
        fast: reuse the target's unpatched prefix (default); ``False`` runs full forwards
            (the results are the same).
        stash: with block weights as ``target``, the :class:`~interp.runtime.swap.WeightStash`
            of ``source`` to keep its own weights in (share one across calls, e.g. one per batch
            under ``torchrun``, to write them to disk once); default: one for this call.

    Returns:
        A :class:`~interp.localize.patching.results.PatchResult`.

    Example:
        >>> import torch
        >>> import interp
        >>> from interp.localize.patching import Patch
        >>> source = interp.tiny_model("llama")
        >>> target = interp.quantize(source, "rtn:bits=2,group=32", progress=False)
        >>> ex = interp.Examples.from_tokens(torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0)))
        >>> result = interp.patch(target, source, ex, [Patch("resid_post", [1])])
        >>> bool(torch.allclose(result.values[0], result.source, atol=1e-5))  # the last residual carries it all
        True
    """
    weights = cast(BlockWeights, target) if is_block_weights(target) else None
    model = source if weights is not None else cast(Model, target)
    source_examples = source_examples if source_examples is not None else examples
    _check_pair(model, source, examples, source_examples)
    engine = _Engine(model, source, _checked_patches(model, patches, examples.seq_len), _metric(metric), fast)
    lengths = _checked_lengths(examples, source_examples, engine.patches, engine.metric)
    n = len(examples)
    device = device_of(model)
    # the values stay on the model's device (no host sync per window) and go to the host once, at the end
    values = torch.empty(len(engine.patches), n, dtype=torch.float64, device=device)
    target_values = torch.empty(n, dtype=torch.float64, device=device)
    source_values = torch.empty(n, dtype=torch.float64, device=device)
    jobs_per_window = max(1, max_rows // max(1, min(batch_size, n)))
    windows = [engine.order[i : i + jobs_per_window] for i in range(0, len(engine.order), jobs_per_window)]
    bar = tqdm(total=len(windows) * len(list(batches(n, batch_size))), desc="patch", unit="run",
               disable=not show_progress(progress))
    with torch.no_grad(), _TargetWeights(source, weights, stash) as as_target:
        for start, end in batches(n, batch_size):
            index = torch.arange(start, end)  # host: example indices; a metric picks its host-side answers with them
            masks = None
            if lengths is not None:
                masks = (_batch_mask(examples, start, end), _batch_mask(source_examples, start, end))
            side, source_values[start:end] = engine.prepare_source(
                examples.tokens[start:end].to(device), source_examples.tokens[start:end].to(device), index, masks)
            with as_target():
                batch, target_values[start:end] = engine.prepare_target(side)
                for window in windows:
                    # .to: a no-op unless a device_map puts the last layer elsewhere
                    values[window, start:end] = engine.run_window(batch, window).to(device)
                    bar.update(1)
    bar.close()
    # block weights name themselves as their model would (SavedWeights: the quantized copy's name)
    settings = _settings(str(getattr(weights, "name", "block weights")) if weights is not None else model, source,
                         examples, batch_size, max_rows=max_rows, fast=engine.runner is not None)
    return _result(values.cpu(), target_values.cpu(), source_values.cpu(), engine.patches, examples, engine.metric,
                   settings)


class _TargetWeights:
    """``with _TargetWeights(source, weights, stash) as as_target: with as_target(): ...``: inside the inner
    block ``source`` carries ``weights`` (nothing changes when ``weights`` is ``None``: two models).

    One stash serves every batch (each block is written to disk once); it is the caller's when given,
    else made here and deleted on leaving. The target's weights are checked for NaN/inf the first
    time they are in place, before its first forward.
    """

    def __init__(self, source: Model, weights: BlockWeights | None, stash: WeightStash | None) -> None:
        self.source, self.weights, self.stash = source, weights, stash
        self._own: WeightStash | None = None
        self._checked = False

    def __enter__(self) -> Callable[[], contextlib.AbstractContextManager[None]]:
        if self.weights is not None and self.stash is None:
            self._own = self.stash = WeightStash(self.source)
        return self._as_target

    def __exit__(self, *exc: Any) -> None:
        if self._own is not None:
            self._own.close()

    @contextlib.contextmanager
    def _as_target(self) -> Iterator[None]:
        if self.weights is None:
            yield
            return
        with swapped(self.source, self.weights, stash=self.stash):
            if not self._checked:
                _check_finite_blocks(self.source)
                self._checked = True
            yield


def _check_finite_blocks(model: Model) -> None:
    """:func:`~interp.runtime.batching.check_finite_weights` for the swapped-in block weights alone (the
    rest is the source's, checked already); a block offloaded by a ``device_map`` is skipped, as there."""
    bad = [f"block {layer} {role}" for layer in range(hk.n_layers(model))
           for role, slot in hk.linear_weights(model, layer).items()
           if not slot.read().is_meta and not bool(torch.isfinite(slot.read()).all())]
    if bad:
        raise NonFiniteError(f"The target's block weights have NaN/inf ({listed(bad)}), so any number computed from "
                             "them is meaningless. Quantize again, or repair the saved weights.")


def _batch_mask(examples: Examples, start: int, end: int) -> Tensor | None:
    return None if examples.attention_mask is None else examples.attention_mask[start:end]


# The naive reference loop repeats patch()'s signature and preamble on purpose: it is the
# textbook implementation the engine is tested and benchmarked against, so it shares none of
# the engine's code (a `duplicates` run lists this pair; it is the one deliberate repeat here).
def patch_naive(
    target: Model,
    source: Model,
    examples: Examples,
    patches: Sequence[Patch],
    *,
    source_examples: Examples | None = None,
    metric: Metric | str | None = None,
    batch_size: int = 8,
    progress: bool | None = None,
) -> PatchResult:
    """The textbook loop, one full forward (with full logits) per patch, as transformer-lens'
    ``patching.py`` does. Same arguments and results as :func:`patch` (padded rows and pairs
    of different lengths included, with the same end-aligned positions); kept as the
    reference implementation for tests and benchmarks.
    """
    source_examples = source_examples if source_examples is not None else examples
    _check_pair(target, source, examples, source_examples)
    patches = _checked_patches(target, patches, examples.seq_len)
    metric_ = _metric(metric)
    aligned = _checked_lengths(examples, source_examples, patches, metric_) is not None
    n = len(examples)
    # host: the textbook loop's results, gathered on the host run by run as transformer-lens' loop does
    values = torch.empty(len(patches), n, dtype=torch.float64)
    target_values = torch.empty(n, dtype=torch.float64)  # host: as above
    source_values = torch.empty(n, dtype=torch.float64)  # host: as above
    device = device_of(target)
    bar = tqdm(total=len(patches) * len(list(batches(n, batch_size))), desc="patch (naive)", unit="run",
               disable=not show_progress(progress))
    with torch.no_grad():
        for start, end in batches(n, batch_size):
            tokens, source_tokens = examples.tokens[start:end].to(device), source_examples.tokens[start:end].to(device)
            lengths = source_lengths = None
            if aligned:  # each row's real tokens first: the causal mask keeps them from the padding
                lengths = _naive_lengths(examples, start, end, tokens)
                source_lengths = _naive_lengths(source_examples, start, end, source_tokens)
                tokens = left_aligned(tokens, _naive_mask(examples, start, end, tokens))[0]
                source_tokens = left_aligned(source_tokens, _naive_mask(source_examples, start, end, source_tokens))[0]
            index = torch.arange(start, end)  # host: example indices, as in patch()
            cache, _ = capture(source, source_tokens, _source_keys(patches))
            source_values[start:end] = _metric_values(metric_, "from_logits", model_logits(source, source_tokens),
                                                      source_tokens, index, lengths=source_lengths)
            target_values[start:end] = _metric_values(metric_, "from_logits", model_logits(target, tokens), tokens,
                                                      index, lengths=lengths)
            # the reference's own row-by-row hooks for every case (no engine code: an indexing bug
            # in the engine's assignment cannot hide behind the same bug here); unpadded rows of
            # one width are rows whose real length is the width
            row_lengths = [tokens.shape[1]] * (end - start) if lengths is None else lengths.tolist()
            source_row_lengths = ([source_tokens.shape[1]] * (end - start) if source_lengths is None
                                  else source_lengths.tolist())
            for j, job in enumerate(patches):
                hooks = _naive_row_hooks(target, job, cache, row_lengths, source_row_lengths)
                with target.hooks(fwd_hooks=hooks):
                    values[j, start:end] = _metric_values(metric_, "from_logits", model_logits(target, tokens),
                                                          tokens, index, lengths=lengths)
                bar.update(1)
    bar.close()
    return _result(values, target_values, source_values, patches, examples, metric_,
                   _settings(target, source, examples, batch_size, naive=True))



def _naive_mask(examples: Examples, start: int, end: int, tokens: Tokens) -> Tensor:
    mask = examples.attention_mask
    return torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask[start:end].to(tokens.device)


def _naive_lengths(examples: Examples, start: int, end: int, tokens: Tokens) -> Tensor:
    return _naive_mask(examples, start, end, tokens).sum(dim=1).cpu()


def _naive_row_hooks(target: Model, job: Patch, cache: Mapping[Key, Tensor], lengths: list[int],
                     source_lengths: list[int]) -> list[tuple[str, Callable[..., Any]]]:
    """The patch, one row and one position at a time: target position ``p`` of row ``b`` takes
    the source's position ``p + source_lengths[b] - lengths[b]`` (rows aligned at their ends)."""
    def positions(b: int) -> list[int]:
        if job.positions is None:
            return list(range(max(0, lengths[b] - source_lengths[b]), lengths[b]))
        return [q if q >= 0 else lengths[b] + q for q in job.positions]

    def replacer(src: Tensor) -> Callable[[Tensor, Any], Tensor]:
        def replace(x: Tensor, hook: Any) -> Tensor:
            x = x.clone()
            for b in range(x.shape[0]):
                shift = source_lengths[b] - lengths[b]
                for p in positions(b):
                    if job.heads is None:
                        x[b, p] = src[b, p + shift]
                    else:
                        for h in job.heads:
                            x[b, p, h] = src[b, p + shift, h]
            return x
        return replace

    return [(hk.hook_point(target, job.component, layer), replacer(cache[(job.component, layer)]))
            for layer in job.layers]
