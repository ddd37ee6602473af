"""``hqq``: the ``hqq`` package's half-quadratic quantizer, called on the weight's device.

``optimize=0`` is plain min-max round-to-nearest (``rtn`` reproduces it bit for bit);
``optimize=1`` (the default) refines the zero-points and scales. The package has no
7-bit mode.

The package runs on one torch thread here, whatever the caller's setting. Its optimiser's result
depends on the thread count: on SmolLM2-135M, ``hqq:bits=3,group=64`` put 2,621 of the 106M
block weights (2.5e-5) elsewhere with two threads than with one (at most 9e-5 of the weight's
largest magnitude), so a cached model would have depended on the machine that made it. One
thread costs 10.7 s against 8.1 s for the whole model on two cores (single runs).

Example:
    >>> import torch
    >>> from interp.quant import quantize_weight
    >>> W = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    >>> quantize_weight(W, "hqq:bits=4,group=64").shape
    torch.Size([8, 64])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from interp.quant.spec import MethodSpec, Option, Quantizer, flag

if TYPE_CHECKING:
    from torch import Tensor


def quantize(W: Tensor, spec: MethodSpec, _calibration: object) -> Tensor:
    # deferred: hqq and torch are slow to import, and the registry imports this module to read QUANTIZER
    import torch
    from hqq.core.quantize import Quantizer as HQQQuantizer

    from interp.runtime.batching import torch_threads

    with torch_threads(1):  # the same weights on every machine (see the module docstring)
        levels, meta = HQQQuantizer.quantize(
            W,
            nbits=spec.bits,
            group_size=spec.group,
            optimize=bool(spec.params["optimize"]),
            axis=1,  # groups run along the input dimension, as for every other method
            bitpack=False,
            compute_dtype=torch.float32,
            device=str(W.device),  # its optimiser's work goes where the weight is
        )
        meta["compute_dtype"] = torch.float32  # dequantize() defaults to float16 otherwise
        dequantized: Tensor = HQQQuantizer.dequantize(levels, meta)
    return dequantized.reshape(W.shape).float()


QUANTIZER = Quantizer(
    name="hqq",
    quantize=quantize,
    bits=(2, 3, 4, 5, 6, 8),
    options={"optimize": Option(1, "0 or 1", flag)},
    summary="half-quadratic quantization via the hqq package",
    report_bits=(3,),
    report_rank=4,
    version=2,  # 2: optimised on one thread (the weights no longer depend on the thread count)
)
