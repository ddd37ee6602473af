"""``nf``: NormalFloat (QLoRA), absmax per group.

Each group is divided by its absmax and snapped to the nearest value of a codebook built
from quantiles of N(0, 1). NF4 reproduces bitsandbytes' ``quantize_4bit``/``dequantize_4bit``
bit for bit.

torch and scipy are imported inside the functions: the registry imports this module to
read ``QUANTIZER``, and parsing a spec must not load them.

Example:
    >>> normal_float_codebook(4).tolist()[-2:]
    [0.7229568362236023, 1.0]
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from interp.errors import SpecError
from interp.quant.spec import MethodSpec, Quantizer

if TYPE_CHECKING:
    import torch
    from torch import Tensor

BITS = (3, 4)


def _normal_float_offset(bits: int) -> float:
    """The outermost quantile, QLoRA's choice generalised to k bits.

    QLoRA puts the extreme quantile halfway between the ones a symmetric
    (2^k - 1)-level and a 2^k-level code would use, 1 - 1/(2 (2^k - 1)) and
    1 - 1/(2 * 2^k). For k = 4 this is 0.96770833..., published rounded to 7 decimals
    as 0.9677083; we round the same way for every k, which reproduces the published
    NF4 code exactly.
    """
    levels = 1 << bits
    return round(0.5 * ((1 - 1 / (2 * (levels - 1))) + (1 - 1 / (2 * levels))), 7)


@functools.cache
def _normal_float_levels(bits: int) -> tuple[float, ...]:
    import torch  # deferred, see the module docstring
    from scipy.stats import norm

    offset = _normal_float_offset(bits)
    half = 2 ** (bits - 1)
    # Quantile positions in float32, quantiles in float64, code in float32: the
    # precision path of the published NF4 table, so ours matches it bit for bit.
    positive_p = torch.linspace(offset, 0.5, half + 1, dtype=torch.float32, device="cpu")[:-1]  # host: for scipy
    negative_p = torch.linspace(offset, 0.5, half, dtype=torch.float32, device="cpu")[:-1]  # host: for scipy
    positive = norm.ppf(positive_p.double().numpy())  # `half` values > 0
    negative = -norm.ppf(negative_p.double().numpy())  # `half - 1` values < 0
    values = torch.tensor([*negative, 0.0, *positive], dtype=torch.float32, device="cpu")  # host: from scipy's numbers
    values = values.sort().values
    return tuple((values / values.max()).tolist())


def normal_float_codebook(bits: int, device: torch.device | str = "cpu") -> Tensor:
    """The k-bit NormalFloat code, sorted, in [-1, 1], with an exact 0, on ``device``.

    Asymmetric: 2^(k-1) positive levels and 2^(k-1) - 1 negative ones, so that 0 is a
    level and +-1 are both reachable (QLoRA's construction).

    Example:
        >>> normal_float_codebook(3).tolist()[:4]
        [-1.0, -0.5350227952003479, -0.24693147838115692, 0.0]
    """
    import torch  # deferred, see the module docstring

    if bits not in BITS:
        raise SpecError(f"NormalFloat supports bits {', '.join(map(str, BITS))}, got {bits}")
    return torch.tensor(_normal_float_levels(bits), dtype=torch.float32, device=device)


def quantize(W: Tensor, spec: MethodSpec, _calibration: object) -> Tensor:
    import torch  # deferred, see the module docstring

    from interp.quant.methods._common import grouped

    code = normal_float_codebook(spec.bits, W.device)
    midpoints = (code[:-1] + code[1:]) / 2
    groups = grouped(W, spec.group)
    absmax = groups.abs().amax(-1, keepdim=True)
    # Multiply by the reciprocal (not divide) and keep an all-zero group at 0: the
    # arithmetic bitsandbytes uses, needed for bit-exact agreement.
    reciprocal = 1.0 / absmax.clamp(min=torch.finfo(torch.float32).tiny)
    normalised = (groups * reciprocal).clamp(-1.0, 1.0)
    # bucketize(right=False) sends a value exactly on a midpoint to the lower level.
    levels = torch.bucketize(normalised, midpoints)
    return (code[levels] * absmax).reshape(W.shape)


QUANTIZER = Quantizer(
    name="nf",
    quantize=quantize,
    bits=BITS,
    summary="NormalFloat codebook, absmax per group",
    report_bits=(3, 4),
    quick_bits=(3,),
    report_rank=1,
)
