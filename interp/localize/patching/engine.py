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

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from interp.data import Examples, refuse_padding
from interp.errors import ComponentError, DataError, InterpError, NonFiniteError
from interp.localize.patching.metrics import Metric, PerRow, _metric
from interp.localize.patching.patches import Patch
from interp.localize.patching.results import PatchResult
from interp.runtime import hooks as hk
from interp.runtime.batching import batches, check_examples, device_of, show_progress
from interp.runtime.capture import capture
from interp.runtime.decoder import DecoderRunner
from interp.runtime.readout import Readout
from interp.runtime.scoring import model_logits
from interp.typing import Key, Resid, Tokens

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


def _replacer(entries: list[tuple[int, Tensor, Tensor | None, Tensor | None]]) -> Callable[[Tensor, Any], Tensor]:
    def replace(x: Tensor, hook: Any) -> Tensor:
        x = x.clone()
        for row, src, positions, heads in entries:
            _assign(x, row, src, positions, heads)
        return x
    return replace


def _as_index(values: tuple[int, ...] | None) -> Tensor | None:
    return None if values is None else torch.tensor(values, dtype=torch.long)


def _patch_hooks(model: Any, jobs: Sequence[Patch], cache: Mapping[Key, Tensor], batch: int,
                 layer: int | None = None) -> list[tuple[str, Callable[..., Any]]]:
    """Hooks applying job ``j`` to rows ``j*batch:(j+1)*batch`` (only at ``layer`` when given)."""
    grouped: dict[str, list[tuple[int, Tensor, Tensor | None, Tensor | None]]] = {}
    for j, job in enumerate(jobs):
        for patched_layer in job.layers:
            if layer is not None and patched_layer != layer:
                continue
            name = hk.hook_point(model, job.component, patched_layer)
            src = cache[(job.component, patched_layer)]
            grouped.setdefault(name, []).append((j * batch, src, _as_index(job.positions), _as_index(job.heads)))
    return [(name, _replacer(entries)) for name, entries in grouped.items()]




def _checked_patches(model: Any, patches: Sequence[Patch], seq_len: int) -> list[Patch]:
    patches = list(patches)
    if not patches:
        raise InterpError("No patches given: build them with single_layer_patches / joint_patches.")
    n_heads = int(model.cfg.n_heads)
    for p in patches:
        for layer in p.layers:
            hk.hook_point(model, p.component, layer)  # raises a ComponentError naming the problem
        if p.positions is not None and any(not 0 <= q < seq_len for q in p.positions):
            raise ComponentError(f"Patch {p.label}: positions must lie in 0..{seq_len - 1}.")
        if p.heads is not None and any(not 0 <= h < n_heads for h in p.heads):
            raise ComponentError(f"Patch {p.label}: heads must lie in 0..{n_heads - 1}.")
    return [Patch(p.component, tuple(hk.check_layers(model, p.layers)), p.positions, p.heads) for p in patches]


def _check_pair(target: Any, source: Any, examples: Examples, source_examples: Examples) -> None:
    if hk.n_layers(target) != hk.n_layers(source) or target.cfg.d_model != source.cfg.d_model:
        raise ComponentError("Patching needs two models with the same architecture (layers and widths).")
    if source_examples.tokens.shape != examples.tokens.shape:
        raise DataError(f"Source and target token rows must have the same shape; got "
                        f"{tuple(source_examples.tokens.shape)} and {tuple(examples.tokens.shape)}.")
    check_examples(target, examples)
    check_examples(source, source_examples)
    refuse_padding(examples, "Activation patching")
    refuse_padding(source_examples, "Activation patching")


def _source_keys(patches: Sequence[Patch]) -> list[Key]:
    return list(dict.fromkeys((p.component, layer) for p in patches for layer in p.layers))


def _settings(target: Any, source: Any, examples: Examples, batch_size: int, **extra: Any) -> dict[str, Any]:
    def name(model: Any) -> str:
        return str(getattr(getattr(model, "info", None), "name", "model"))

    return {"target": name(target), "source": name(source), "batch_size": batch_size,
            "examples": dict(examples.settings), **extra}


@dataclass
class _Batch:
    """One batch of examples with everything the patched runs need."""

    tokens: Tokens
    index: Tensor
    source_cache: dict[Key, Tensor]
    target_cache: dict[Key, Tensor]


class _Engine:
    def __init__(self, target: Any, source: Any, patches: list[Patch], metric: Metric, fast: bool) -> None:
        self.target, self.source, self.patches, self.metric = target, source, patches, metric
        self.readout_target, self.readout_source = Readout(target), Readout(source)
        self.runner = DecoderRunner.for_model(target) if fast else None
        self.verified = self.runner is None
        self.order = sorted(range(len(patches)), key=lambda j: patches[j].start)

    def prepare(self, tokens: Tokens, source_tokens: Tokens, index: Tensor) -> tuple[_Batch, PerRow, PerRow]:
        source_cache, source_final = capture(self.source, source_tokens, _source_keys(self.patches))
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
        source_value = self.metric.from_resid(self.readout_source, source_final, source_tokens, index)
        target_value = self.metric.from_resid(self.readout_target, target_final, tokens, index)
        return _Batch(tokens, index, source_cache, target_cache), target_value, source_value

    def run_window(self, batch: _Batch, window: list[int]) -> Float[Tensor, "jobs batch"]:
        jobs = [self.patches[j] for j in window]
        b = batch.tokens.shape[0]
        final = self._staggered(batch, jobs) if self.runner is not None else self._full(batch, jobs)
        tokens = batch.tokens.repeat(len(jobs), 1)
        values = self.metric.from_resid(self.readout_target, final, tokens, batch.index.repeat(len(jobs)))
        return values.view(len(jobs), b)

    def _staggered(self, batch: _Batch, jobs: list[Patch]) -> Resid:
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
            fwd = _patch_hooks(self.target, jobs[:joined], batch.source_cache, batch.tokens.shape[0], layer)
            assert hidden is not None
            if fwd:
                with self.target.hooks(fwd_hooks=fwd):
                    hidden = runner.block(layer, hidden)
            else:
                hidden = runner.block(layer, hidden, native=native)
        assert hidden is not None
        return hidden

    def _full(self, batch: _Batch, jobs: list[Patch]) -> Resid:
        """Fallback: all jobs stacked in one full forward from the tokens."""
        fwd = _patch_hooks(self.target, jobs, batch.source_cache, batch.tokens.shape[0])
        final: dict[str, Tensor] = {}

        def keep(x: Tensor, hook: Any) -> None:
            final["resid"] = x

        last = hk.hook_point(self.target, "resid_post", hk.n_layers(self.target) - 1)
        with self.target.hooks(fwd_hooks=[*fwd, (last, keep)]):
            hk.decoder_body(self.target)(input_ids=batch.tokens.repeat(len(jobs), 1))
        return final["resid"]


def patch(
    target: Any,
    source: Any,
    examples: Examples,
    patches: Sequence[Patch],
    *,
    source_examples: Examples | None = None,
    metric: Metric | str | None = None,
    batch_size: int = 8,
    max_rows: int = 64,
    progress: bool | None = None,
    fast: bool = True,
) -> PatchResult:
    """The patching engine: run ``target`` on ``examples`` with each patch from ``source``.

    Args:
        target: the model whose run is patched (e.g. the quantized model, or the model on
            corrupted prompts).
        source: the model the activations come from (e.g. the reference; may be ``target``).
        examples: the target's token rows.
        patches: the jobs (see :func:`~interp.localize.patching.patches.single_layer_patches`,
            :func:`~interp.localize.patching.patches.joint_patches`,
            :func:`~interp.localize.patching.patches.position_patches`).
        source_examples: the source's token rows (same shape); default ``examples``.
        metric: ``"nll"`` (default) or a :class:`~interp.localize.patching.metrics.LogitDiffMetric`.
        batch_size: examples per batch.
        max_rows: the most rows (examples x stacked jobs) in one forward; sets peak memory.
        progress: show a progress bar.
        fast: reuse the target's unpatched prefix (default); ``False`` runs full forwards
            (the results are the same).

    Returns:
        A :class:`~interp.localize.patching.results.PatchResult`.
    """
    source_examples = source_examples if source_examples is not None else examples
    _check_pair(target, source, examples, source_examples)
    engine = _Engine(target, source, _checked_patches(target, patches, examples.seq_len), _metric(metric), fast)
    n = len(examples)
    values = torch.empty(len(engine.patches), n, dtype=torch.float64)
    target_values, source_values = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
    device = device_of(target)
    jobs_per_window = max(1, max_rows // max(1, min(batch_size, n)))
    windows = [engine.order[i : i + jobs_per_window] for i in range(0, len(engine.order), jobs_per_window)]
    bar = tqdm(total=len(windows) * len(list(batches(n, batch_size))), desc="patch", unit="run",
               disable=not show_progress(progress))
    with torch.no_grad():
        for start, end in batches(n, batch_size):
            index = torch.arange(start, end)
            batch, target_values[start:end], source_values[start:end] = engine.prepare(
                examples.tokens[start:end].to(device), source_examples.tokens[start:end].to(device), index)
            for window in windows:
                values[window, start:end] = engine.run_window(batch, window).cpu()
                bar.update(1)
    bar.close()
    return _result(values, target_values, source_values, engine.patches, examples, engine.metric,
                   _settings(target, source, examples, batch_size, max_rows=max_rows, fast=engine.runner is not None))


def _result(values: Tensor, target: Tensor, source: Tensor, patches: list[Patch], examples: Examples, metric: Metric,
            settings: dict[str, Any]) -> PatchResult:
    for name, tensor in (("patched", values), ("target", target), ("source", source)):
        if not torch.isfinite(tensor).all():
            raise NonFiniteError(f"Patching produced NaN/inf {name} values: check both models' weights.")
    return PatchResult(values=values, target=target, source=source, patches=patches, ids=list(examples.ids),
                       metric=metric.name, settings=settings)


# The naive reference loop repeats patch()'s signature and preamble on purpose: it is the
# textbook implementation the engine is tested and benchmarked against, so it shares none of
# the engine's code (a `duplicates` run lists this pair; it is the one deliberate repeat here).
def patch_naive(
    target: Any,
    source: Any,
    examples: Examples,
    patches: Sequence[Patch],
    *,
    source_examples: Examples | None = None,
    metric: Metric | str | None = None,
    batch_size: int = 8,
    progress: bool | None = None,
) -> PatchResult:
    """The textbook loop, one full forward (with full logits) per patch, as transformer-lens'
    ``patching.py`` does. Same arguments and results as :func:`patch`; kept as the reference
    implementation for tests and benchmarks.
    """
    source_examples = source_examples if source_examples is not None else examples
    _check_pair(target, source, examples, source_examples)
    patches = _checked_patches(target, patches, examples.seq_len)
    metric_ = _metric(metric)
    n = len(examples)
    values = torch.empty(len(patches), n, dtype=torch.float64)
    target_values, source_values = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
    device = device_of(target)
    bar = tqdm(total=len(patches) * len(list(batches(n, batch_size))), desc="patch (naive)", unit="run",
               disable=not show_progress(progress))
    with torch.no_grad():
        for start, end in batches(n, batch_size):
            tokens, source_tokens = examples.tokens[start:end].to(device), source_examples.tokens[start:end].to(device)
            index = torch.arange(start, end)
            cache, _ = capture(source, source_tokens, _source_keys(patches))
            source_values[start:end] = metric_.from_logits(model_logits(source, source_tokens), source_tokens, index)
            target_values[start:end] = metric_.from_logits(model_logits(target, tokens), tokens, index)
            for j, job in enumerate(patches):
                with target.hooks(fwd_hooks=_patch_hooks(target, [job], cache, end - start)):
                    values[j, start:end] = metric_.from_logits(model_logits(target, tokens), tokens, index)
                bar.update(1)
    bar.close()
    return _result(values, target_values, source_values, patches, examples, metric_,
                   _settings(target, source, examples, batch_size, naive=True))

