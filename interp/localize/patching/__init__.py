"""Activation patching: which component carries the difference between two runs?

Activation patching runs a *target* forward pass and overwrites one activation (one
component at some layers, optionally some positions or heads) with its value from a
*source* run, then measures how far the output moves towards the source's output. A
component whose patch moves the output most of the way carries the difference; one whose
patch moves nothing does not (alone, at those layers).

Two front ends share one engine (:func:`patch`):

- **Cross-model** (:func:`cross_model`, :func:`patching_table`, :func:`layer_sweep`): the
  target is a quantized model, the source the reference model, both on the *same* tokens.
  This is the reference paper's experiment ("Why Do Some Inputs Break Low-Bit LLM
  Quantization?", EMNLP 2025): patching the reference's MLP output into the upper half of
  a 3-bit Llama3-8B recovers 93% of the perplexity gap on D_large, the gate 84%, the up
  projection 14% and attention 28%.
- **Clean/corrupt** (:func:`clean_corrupt`): one model, two prompts of the same length.
  The target run is the corrupted prompt, the source the clean one ("denoising"); the
  metric is the logit difference between a right and a wrong answer token.

:func:`patch` and :func:`patch_naive` also take padded examples (``attention_mask``) and
source rows of other lengths than the target's: each row counts as its real tokens alone,
and a pair is aligned at its last real token (negative positions count from each row's
end; see :func:`patch` and docs/patching.md).

Components are semantic names (see :mod:`interp.runtime.hooks`): ``resid_pre``, ``resid_mid``,
``resid_post``, ``attn_out``, ``head`` (per-head ``z``, optionally a subset of heads),
``gate`` (the gate *pre-activation*; the activation is deterministic, so this equals
patching ``act(gate)``), ``up``, ``down`` (MLP output) and ``gate_input``: the source's
input to the gate projection, multiplied by the *target's* gate weight. Only the gate
projection sees the source input there; the up projection keeps the target's input.

Reading a :class:`PatchResult`:

- ``values[j, n]``: the metric (mean NLL, or logit difference) for patch ``j`` on example ``n``;
- ``target`` / ``source``: the unpatched target's and source's metric per example;
- ``recovery()``: ``(target - patched) / (target - source)`` on the aggregate (perplexity for
  NLL, the paper's definition; the mean for logit differences). 1 means the patch closes the
  whole gap, 0 that it changes nothing; negative values move away from the source.
- ``table()`` is a DataFrame with one row per patch; ``interp.figures.draw(result)`` draws it
  (:mod:`interp.figures.localize`).

The modules, bottom to top (each imports only those before it):

- :mod:`~interp.localize.patching.patches`: :class:`Patch` jobs, layer selections, job lists;
- :mod:`~interp.localize.patching.metrics`: the NLL and logit-difference metrics;
- :mod:`~interp.localize.patching.results`: :class:`PatchResult`;
- :mod:`~interp.localize.patching.engine`: :func:`patch` and the textbook loop
  :func:`patch_naive` (one full forward per patch, kept as the reference and for
  benchmarks); how the engine saves time without changing results is described there;
- :mod:`~interp.localize.patching.attribution`: :func:`attribution`, the first-order
  (gradient) estimate of every (component, layer) effect from one forward and backward
  pass, and :func:`rank_agreement`;
- :mod:`~interp.localize.patching.experiments`: the front ends and the paper's experiments.

Example:
    >>> import interp, torch
    >>> from interp.localize import patching
    >>> from interp.quant.apply import quantize
    >>> source = interp.tiny_model("llama")
    >>> target = quantize(source, "rtn:bits=3,group=64", progress=False)
    >>> ex = interp.Examples.from_tokens(torch.randint(0, 256, (4, 16)))
    >>> res = patching.patch(target, source, ex, patching.single_layer_patches(["down", "gate"], [0, 1]))
    >>> res.table()[["component", "layers"]].values.tolist()
    [['down', '0'], ['down', '1'], ['gate', '0'], ['gate', '1']]
    >>> every = patching.patch(target, source, ex, [patching.Patch("resid_post", (0, 1))])
    >>> bool((every.values[0] - every.source).abs().max() < 1e-5)  # every block output patched: the source
    True
"""

from __future__ import annotations

from interp.localize.patching.attribution import AttributionResult, attribution, rank_agreement
from interp.localize.patching.engine import _patch_hooks, patch, patch_naive  # noqa: F401 (tests use _patch_hooks)
from interp.localize.patching.experiments import (
    GateInputComparison,
    clean_corrupt,
    cross_model,
    gate_input_vs_gate_weights,
    gate_restored_nll,
    layer_sweep,
    patch_attn_out,
    patch_component,
    patch_down,
    patch_gate,
    patch_gate_input,
    patch_heads,
    patch_resid_pre,
    patch_up,
    patching_table,
)
from interp.localize.patching.metrics import LogitDiffMetric, Metric, NLLMetric
from interp.localize.patching.patches import (
    PAPER_COMPONENTS,
    PAPER_NAMES,
    PATCHABLE,
    LayerSelection,
    Patch,
    PatchComponent,
    joint_patches,
    position_patches,
    resolve_layers,
    single_layer_patches,
    span,
)
from interp.localize.patching.results import PatchResult
from interp.runtime.capture import capture
from interp.runtime.decoder import DecoderRunner

__all__ = [
    "PAPER_COMPONENTS", "PAPER_NAMES", "PATCHABLE", "AttributionResult", "DecoderRunner", "GateInputComparison",
    "LayerSelection", "LogitDiffMetric", "Metric", "NLLMetric", "Patch", "PatchComponent", "PatchResult",
    "attribution", "capture", "clean_corrupt", "cross_model", "gate_input_vs_gate_weights", "gate_restored_nll",
    "joint_patches", "layer_sweep", "patch", "patch_attn_out", "patch_component", "patch_down", "patch_gate",
    "patch_gate_input", "patch_heads", "patch_naive", "patch_resid_pre", "patch_up", "patching_table",
    "position_patches", "rank_agreement", "resolve_layers", "single_layer_patches", "span",
]
