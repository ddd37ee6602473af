"""``rtn``: round-to-nearest on an asymmetric min-max grid per group.

The default float zero-point reproduces ``hqq``'s ``optimize=False`` path bit for bit;
``zero=int`` rounds the zero-point to a level (GPTQ's reference convention), so 0.0 is
exactly representable.

Example:
    >>> import torch
    >>> from interp.quant import quantize_weight
    >>> W = torch.tensor([[0.0, 0.1, 0.2, 0.3]])
    >>> quantize_weight(W, "rtn:bits=2,group=4").tolist()  # four levels: the values themselves
    [[0.0, 0.10000000149011612, 0.20000000298023224, 0.30000001192092896]]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from interp.quant.spec import MethodSpec, Option, Quantizer, one_of

if TYPE_CHECKING:
    from torch import Tensor


def quantize(W: Tensor, spec: MethodSpec, _calibration: object) -> Tensor:
    # deferred: the registry imports this module to read QUANTIZER, and parsing a spec must not load torch
    from interp.quant.methods._common import rtn_weights

    return rtn_weights(W, spec.bits, spec.group, integer_zero=spec.params["zero"] == "int")


QUANTIZER = Quantizer(
    name="rtn",
    quantize=quantize,
    bits=tuple(range(2, 9)),
    options={"zero": Option("float", "float or int", one_of("float", "int"))},
    summary="round-to-nearest, asymmetric min-max per group",
    report_bits=(3, 4),
    quick_bits=(3, 4),
    report_rank=0,
)
