"""Weight-only fake quantization: method specs and per-layer quantizers.

``parse_spec``/``MethodSpec`` are pure Python; ``quantize_weight`` and the error
helpers load torch-side code (and scipy/hqq when a method needs them) on first use.

Example:
    >>> from interp.quant import parse_spec
    >>> str(parse_spec("nf:bits=4"))
    'nf:bits=4,group=64'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from interp.quant.prescribe import prescribe  # bound here: the function, not the submodule of the same name
from interp.quant.spec import MethodSpec, parse_spec

if TYPE_CHECKING:
    from interp.quant.methods import (
        quantize_weight,
        relative_error,
        relative_output_error,
    )

__all__ = [
    "MethodSpec",
    "parse_spec",
    "prescribe",
    "quantize_weight",
    "relative_error",
    "relative_output_error",
]

_LAZY = {"quantize_weight", "relative_error", "relative_output_error"}


def _methods_getattr(name: str) -> Any:
    if name in _LAZY:
        from interp.quant import methods

        return getattr(methods, name)
    raise AttributeError(f"module 'interp.quant' has no attribute {name!r}")


# --- whole-model quantization, scoring and analyses (interp.quant.apply / store / analysis) ---
_LAZY_MODULES = {
    "quantize": "apply", "quantize_cached": "apply", "save_quantized": "apply", "load_quantized": "apply",
    "model_hash": "apply", "QuantInfo": "apply",
    "score": "store", "ScoreStore": "store",
    "agreement": "analysis", "split_large_ctrl": "analysis", "norm_error_correlation": "analysis",
    "reversal": "analysis", "error_split": "analysis",
    "Plan": "prescribe", "Sensitivity": "sensitivity",
}
__all__ += list(_LAZY_MODULES)


def __getattr__(name: str) -> Any:  # the lazy loader: whole-model modules, then the quantizers above
    if name in _LAZY_MODULES:
        import importlib

        return getattr(importlib.import_module(f"interp.quant.{_LAZY_MODULES[name]}"), name)
    return _methods_getattr(name)
