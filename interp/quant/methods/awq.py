"""``awq``: activation-aware per-channel scaling, then round-to-nearest.

AWQ scales input channel ``i`` by ``s_i = mean|x_i|^alpha`` before RTN and divides it back
out afterwards, with ``alpha`` chosen on a grid of ``grid`` values in [0, 1] to minimise
the output error on the calibration tokens (:func:`awq_alpha_search`).

torch is imported inside the functions: the registry imports this module to read
``QUANTIZER``, and parsing a spec must not load torch.

Example:
    >>> import torch
    >>> W = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    >>> X = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    >>> search = awq_alpha_search(W, X, bits=3, group=32, grid=5)
    >>> search.alphas, search.errors[search.alphas.index(search.alpha)] == min(search.errors)
    ((0.0, 0.25, 0.5, 0.75, 1.0), True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from interp.quant.spec import MethodSpec, Option, Quantizer, positive_int

if TYPE_CHECKING:
    from torch import Tensor

    from interp.quant.methods._common import LayerInputs


@dataclass(frozen=True)
class AwqSearch:
    """Outcome of AWQ's alpha search on one layer.

    Attributes:
        weight: the chosen dequantized weight, folded back to W's input space.
        alpha: the chosen exponent (0 means plain RTN).
        alphas: every exponent tried.
        errors: squared output error ``||X (W - W_hat)^T||_F^2`` for each alpha.
    """

    weight: Tensor
    alpha: float
    alphas: tuple[float, ...]
    errors: tuple[float, ...]


def _squared_output_error(inputs: LayerInputs) -> Callable[[Tensor], float]:
    """``delta -> ||X delta^T||_F^2``, through the shared ``X^T X`` when that is the cheaper product."""
    X = inputs.X
    if X.shape[0] <= X.shape[1]:
        return lambda delta: float((X @ delta.T).square().sum())
    gram = inputs.gram()
    return lambda delta: float(((delta @ gram) * delta).sum())


def awq_alpha_search(W: Tensor, X: Tensor | LayerInputs, bits: int, group: int, grid: int = 20) -> AwqSearch:
    """AWQ's search: try ``alpha`` on ``linspace(0, 1, grid)``, keep the best.

    For each alpha, ``s = mean_tokens |x|^alpha`` (normalised so that
    ``max(s) * min(s) = 1``, which keeps the scaled weights near their old range;
    min-max RTN is invariant to a global factor anyway), ``W_hat = RTN(W diag(s))
    diag(1/s)``. Channels never active in X get the floor ``1e-6 * max mean|x|``
    so that no column is scaled to zero. Ties go to the smaller alpha, so on the
    calibration data AWQ is never worse than RTN (alpha = 0 is plain RTN).

    ``X`` may be the layer's ``LayerInputs``, whose
    ``mean |x|`` and ``X^T X`` are then shared with the other weights that read it. The
    candidates are tried one alpha at a time: rounding a stack of all of them at once was
    slower on the CPU (0.61 s against 0.38 s for a 1536x576 weight; the stack does not fit
    in cache), and the error's product with ``X^T X`` is most of the cost either way.

    Everything runs on ``W``'s device (``X`` must be there too) but the exponents, a grid of
    Python numbers. Both tensors must be float32 and already checked; use
    :func:`~interp.quant.quantize_weight` for the checked entry point.
    """
    import torch  # deferred, see the module docstring

    from interp.quant.methods._common import LayerInputs, rtn_weights

    inputs = X if isinstance(X, LayerInputs) else LayerInputs(X)
    magnitude = inputs.abs_mean()
    floor = float(magnitude.max()) * 1e-6
    base = magnitude.clamp(min=floor) if floor > 0 else torch.ones_like(magnitude)
    output_error = _squared_output_error(inputs)
    # host: the exponents are Python numbers (CPU float32 linspace, so every device tries the same alphas)
    alphas = tuple(torch.linspace(0.0, 1.0, grid, device="cpu").tolist())
    best: tuple[float, float, Tensor] | None = None
    errors = []
    for alpha in alphas:
        scale = base**alpha
        scale = scale / torch.sqrt(scale.max() * scale.min())
        candidate = rtn_weights(W * scale, bits, group) / scale
        error = output_error(W - candidate)
        errors.append(error)
        if best is None or error < best[0]:
            best = (error, alpha, candidate)
    assert best is not None
    return AwqSearch(weight=best[2], alpha=best[1], alphas=alphas, errors=tuple(errors))


def quantize(W: Tensor, spec: MethodSpec, inputs: LayerInputs | None) -> Tensor:
    assert inputs is not None
    return awq_alpha_search(W, inputs, spec.bits, spec.group, int(spec.params["grid"])).weight


QUANTIZER = Quantizer(
    name="awq",
    quantize=quantize,
    bits=tuple(range(2, 9)),
    options={"grid": Option(20, "an integer >= 1", positive_int)},
    needs_calibration=True,
    summary="activation-aware per-channel scaling, then RTN",
    report_bits=(3, 4),
    report_rank=3,
)
