"""Weight-only fake quantization of one linear layer: one module per quantizer, and their registry.

Every quantizer takes a weight ``W`` in ``nn.Linear`` layout, ``[d_out, d_in]``, and
returns the *dequantized* weight ``W_hat``: same shape, same dtype, but every value now
lies on the grid the quantized format can store. Putting ``W_hat`` back into the model
simulates running the quantized model ("fake quant"), which is all the analyses need.

Grouping: the input dimension of each row is cut into runs of ``group`` consecutive
weights, and each run gets its own scale (and zero-point). ``group`` must divide ``d_in``;
SmolLM2's d_in = 576 takes 64 but not 128.

The registry: every public module of this package is one quantizer and defines
``QUANTIZER``, a :class:`~interp.quant.spec.Quantizer` record (name, ``quantize``
function, bit widths, options with defaults, whether it needs calibration, a one-line
summary). :data:`METHODS` maps each name to its record; spec parsing, the CLI and the
calibration decisions read it, so adding a quantizer is adding one module here. Modules
whose names start with an underscore hold shared helpers (``_common``: the checked entry
point, input checks, min-max grids) and are not quantizers.

The records are pure Python: the quantizer modules import torch (and scipy or hqq) inside
their functions, so reading the registry, e.g. to parse a spec, never loads torch.

All arithmetic runs in float32 (GPTQ's Hessian factorisation in float64) whatever the
input dtype; the result is cast back.

Example:
    >>> import torch
    >>> from interp.quant.methods import METHODS, quantize_weight, relative_error
    >>> sorted(name for name, record in METHODS.items() if record.needs_calibration)
    ['awq', 'gptq']
    >>> W = torch.randn(8, 128)
    >>> W_hat = quantize_weight(W, "rtn:bits=4,group=64")
    >>> W_hat.shape, W_hat.dtype
    (torch.Size([8, 128]), torch.float32)
    >>> bool(relative_error(W, W_hat) < 0.15)
    True
    >>> X = torch.randn(256, 128)
    >>> W_gptq = quantize_weight(W, "gptq:bits=4,group=64", calibration_inputs=X)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from interp.quant.spec import METHODS, Quantizer, describe_methods

if TYPE_CHECKING:
    from interp.quant.methods._common import LayerInputs as LayerInputs
    from interp.quant.methods._common import MinMaxGrid as MinMaxGrid
    from interp.quant.methods._common import quantize_weight as quantize_weight
    from interp.quant.methods._common import relative_error as relative_error
    from interp.quant.methods._common import relative_output_error as relative_output_error

# The torch-side names (quantize_weight, relative_error, relative_output_error, LayerInputs, MinMaxGrid) are importable
# from here too, lazily; their documentation is in interp.quant and interp.quant.methods._common.
__all__ = ["METHODS", "Quantizer", "describe_methods"]

_TORCH_SIDE = {"LayerInputs", "MinMaxGrid", "quantize_weight", "relative_error", "relative_output_error"}


def __getattr__(name: str) -> Any:
    """The torch-side names, imported on first use (importing torch takes seconds; the registry must not)."""
    if name in _TORCH_SIDE:
        return getattr(importlib.import_module("interp.quant.methods._common"), name)
    raise AttributeError(f"module 'interp.quant.methods' has no attribute {name!r}")
