"""interp: attention localization and low-bit quantization analysis on transformer-lens bridges.

The common verbs are one dot away; each is the function at its deep path, loaded on first use:

- ``interp.load_model``, ``interp.load_examples`` (``interp.load_packed_examples`` for rows longer than one
  document), ``interp.examples_from_texts``, ``interp.nll``;
- ``interp.probe`` (:func:`interp.probes.probe`);
- ``interp.quantize`` (:func:`interp.quant.apply.quantize`) and ``interp.score``
  (:func:`interp.quant.store.score`);
- ``interp.logit_lens`` (:func:`interp.localize.lens.early_exit`);
- ``interp.patch`` (:func:`interp.localize.patching.engine.patch`);
- circuits on your own prompt, prompts and answers as plain strings: ``interp.dla``
  (:func:`interp.localize.circuit.dla`), ``interp.eap`` (:func:`interp.localize.circuit.eap`),
  ``interp.path_patch`` (:func:`interp.localize.circuit.path_patch`) and all three in order,
  ``interp.circuit`` (:func:`interp.localize.circuit.circuit`);
- ``interp.analyze_attention`` (:func:`interp.attention.analysis.analyze`);
- the toolbox (docs/toolbox.md): ``interp.ablate``, ``interp.patch_heatmap``, ``interp.lens_top_tokens``,
  ``interp.attention_view``, ``interp.linear_probe``, ``interp.steer`` and ``interp.steering_vector``;
- ``interp.report(out, ...)``: the HTML report (:func:`interp.report.report`); ``interp.report``
  is also the package, so ``interp.report.run_report`` and the other deep paths keep working.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "load_model": "interp.models",
    "tiny_model": "interp.models",
    "ModelInfo": "interp.models",
    "load_examples": "interp.data",
    "load_packed_examples": "interp.data",
    "Examples": "interp.data",
    "examples_from_texts": "interp.data",
    "nll": "interp.runtime.scoring",
    "probe": "interp.probes",
    "ProbeResult": "interp.probes",
    # the common verbs, one dot away (their deep paths keep working)
    "quantize": "interp.quant.apply",
    "score": "interp.quant.store",
    "patch": "interp.localize.patching.engine",
    "logit_lens": "interp.localize.lens",
    "analyze_attention": "interp.attention.analysis",
    # the toolbox (docs/toolbox.md)
    "ablate": "interp.localize.ablation",
    "patch_heatmap": "interp.localize.heatmaps",
    "lens_top_tokens": "interp.localize.top_tokens",
    "attention_view": "interp.figures.toolbox",
    "linear_probe": "interp.localize.linear_probe",
    "steer": "interp.localize.steering",
    "steering_vector": "interp.localize.steering",
    "dla": "interp.localize.circuit",
    "eap": "interp.localize.circuit",
    "path_patch": "interp.localize.circuit",
    "circuit": "interp.localize.circuit",
}
_RENAMED = {"logit_lens": "early_exit", "analyze_attention": "analyze"}
_SUBMODULES = {"attention", "quant", "localize", "runtime", "probes", "figures", "report", "stats", "data", "models",
               "errors", "io", "typing", "validate", "display"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), _RENAMED.get(name, name))
    if name in _SUBMODULES:
        return importlib.import_module(f"interp.{name}")
    raise AttributeError(f"module 'interp' has no attribute {name!r}")


__all__ = sorted(_LAZY) + sorted(_SUBMODULES)
