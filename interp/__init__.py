"""interp: attention localization and low-bit quantization analysis on transformer-lens bridges."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "load_model": "interp.models",
    "tiny_model": "interp.models",
    "ModelInfo": "interp.models",
    "load_examples": "interp.data",
    "Examples": "interp.data",
    "examples_from_texts": "interp.data",
    "nll": "interp.runtime.scoring",
    "probe": "interp.probes",
    "ProbeResult": "interp.probes",
}
_SUBMODULES = {"attention", "quant", "localize", "runtime", "probes", "figures", "report", "stats", "data", "models",
               "errors", "io", "typing", "validate", "display"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"interp.{name}")
    raise AttributeError(f"module 'interp' has no attribute {name!r}")


__all__ = sorted(_LAZY) + sorted(_SUBMODULES)
