"""What the quantizers share: the checked entry point, input checks, error measures and min-max grids.

:func:`quantize_weight` checks its inputs, looks the method up in the registry
(:data:`interp.quant.spec.METHODS`) and calls the method's ``quantize``. The calibrated
methods get the layer's inputs as ``LayerInputs``, which computes each statistic
(``X^T X``, ``mean |x|``, GPTQ's inverse-Hessian factor) once for every weight that reads
that input. The min-max grid (:class:`MinMaxGrid`) and round-to-nearest
(:func:`rtn_weights`) serve RTN, GPTQ and AWQ.

This module imports torch; the quantizer modules import it when they first run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from jaxtyping import Float
from torch import Tensor

from interp.errors import NonFiniteError, SpecError
from interp.quant.spec import METHODS, MethodSpec, parse_spec
from interp.typing import Weight
from interp.validate import checked

__all__ = ["MAX_ABS_WEIGHT", "LayerInputs", "MinMaxGrid", "grouped", "quantize_weight", "relative_error",
           "relative_output_error", "rtn_weights"]

# Largest |w| accepted. The quantizers work in float32 (max 3.4e38): a group's span
# (max - min) reaches 2|w|, GPTQ/AWQ form squared errors of |w| summed over d_in, and HQQ
# raises |w| to small powers, so |w| must stay many orders below sqrt(3.4e38) ~ 1.8e19.
# Trained weights are below ~1e3.
MAX_ABS_WEIGHT = 1e15

Calibration = Float[Tensor, "n_tokens d_in"]
T = TypeVar("T")


class LayerInputs:
    """A linear layer's calibration inputs, checked, with the statistics derived from them computed once.

    Several weights read one input (q, k and v; gate and up), so the statistics the calibrated
    quantizers derive from it (``X^T X``, ``mean |x|``, GPTQ's inverse-Hessian factor) are
    kept here and reused by each of them: built once per input by
    :func:`interp.quant.quantize`, or by :func:`quantize_weight` from a tensor. Each
    statistic is computed by the same operations as when it was computed per weight, so
    sharing changes no bit of the result.

    Example:
        >>> import torch
        >>> inputs = LayerInputs.checked(torch.ones(4, 2, 8), d_in=8, method="gptq")  # [..., d_in] is flattened
        >>> inputs.X.shape, inputs.gram() is inputs.gram(), float(inputs.abs_mean()[0])
        (torch.Size([8, 8]), True, 1.0)
    """

    def __init__(self, X: Tensor) -> None:
        """``X``: float32 ``[n_tokens, d_in]`` on its own device, already checked (see :meth:`checked`)."""
        self.X = X
        self._derived: dict[Hashable, Any] = {}

    @classmethod
    def checked(cls, X: object, d_in: int, method: str = "this method") -> LayerInputs:
        """Check ``X`` (a float tensor ``[..., d_in]``, finite, not huge) and wrap it as float32, on its device."""
        return cls(checked_calibration(X, method, d_in))

    def on(self, device: torch.device) -> LayerInputs:
        """These inputs on ``device`` (the weight's), moved once and kept: itself when already there.

        The statistics are computed where the weight is, so a weight on a GPU is quantized on
        the GPU even when its inputs were captured elsewhere (a block offloaded by a device map).
        """
        if self.X.device == device:
            return self
        return self.derived(("on", device), lambda: LayerInputs(self.X.to(device)))

    @property
    def n_tokens(self) -> int:
        return int(self.X.shape[0])

    @property
    def d_in(self) -> int:
        return int(self.X.shape[1])

    def derived(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()`` the first time ``key`` is asked for; the kept value afterwards."""
        if key not in self._derived:
            self._derived[key] = compute()
        value: T = self._derived[key]
        return value

    def gram(self) -> Tensor:
        """``X^T X`` in float32, ``[d_in, d_in]`` (the cost, ``n_tokens * d_in^2``, is paid once)."""
        return self.derived("gram", lambda: self.X.T @ self.X)

    def abs_mean(self) -> Tensor:
        """``mean_tokens |x|`` per input channel, ``[d_in]``."""
        return self.derived("abs_mean", lambda: self.X.abs().mean(0))


@checked
def quantize_weight(W: Weight, spec: str | MethodSpec,
                    calibration_inputs: Calibration | LayerInputs | None = None) -> Weight:
    """Fake-quantize one linear weight.

    Args:
        W: weight in nn.Linear layout, [d_out, d_in], any float dtype.
        spec: method spec string such as ``"gptq:bits=3,group=64"``, or a MethodSpec.
        calibration_inputs: [n_tokens, d_in] (or [..., d_in]) inputs to this layer, or a
            ``LayerInputs`` shared by the weights that read them; required by the
            calibrated methods (gptq, awq) and ignored by the others.

    Returns:
        The dequantized weight, same shape, dtype and device as ``W``. The work runs on
        ``W``'s device, in float32 (GPTQ's Hessian factorisation in float64); calibration
        inputs on another device are moved to it once.

    Raises:
        SpecError: bad spec, a group that does not divide d_in, a weight that is not a
            2-D float tensor, missing or mis-shaped calibration inputs.
        NonFiniteError: NaN or inf in ``W`` or in the calibration inputs.

    Example:
        >>> import torch
        >>> from interp.quant import quantize_weight
        >>> W = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
        >>> W_hat = quantize_weight(W, "nf:bits=4,group=64")
        >>> W_hat.shape == W.shape, W_hat.dtype, len(torch.unique(W_hat[0])) <= 16  # 4 bits: at most 16 levels a group
        (True, torch.float32, True)
    """
    return quantize_parsed(W, parse_spec(spec), calibration_inputs)  # the API's edge: parsed once


def quantize_parsed(W: Tensor, spec: MethodSpec, calibration_inputs: Any = None) -> Tensor:
    """:func:`quantize_weight` for a parsed spec: what a whole-model quantizer calls for each of its weights
    (:mod:`interp.quant.apply`), so a spec is not parsed again per weight. The weight and the calibration
    inputs are checked here all the same."""
    weight = checked_weight(W, spec)
    calibration = None
    if spec.needs_calibration:
        calibration = calibration_inputs if isinstance(calibration_inputs, LayerInputs) else None
        if calibration is None or calibration.d_in != weight.shape[1]:
            calibration = LayerInputs.checked(calibration_inputs if calibration is None else calibration.X,
                                              weight.shape[1], spec.method)
        calibration = calibration.on(weight.device)
    dequantized = METHODS[spec.method].quantize(weight, spec, calibration)
    return dequantized.to(device=W.device, dtype=W.dtype)


@checked
def relative_error(W: Weight, W_hat: Weight) -> float:
    """``||W - W_hat||_F / ||W||_F``, computed in float32 (0.0 when both are zero).

    Example:
        >>> import torch
        >>> from interp.quant import quantize_weight, relative_error
        >>> W = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
        >>> relative_error(W, W), 0 < relative_error(W, quantize_weight(W, "rtn:bits=4,group=64")) < 0.2
        (0.0, True)
    """
    return _relative_norm(W.float() - W_hat.float(), W.float())


@checked
def relative_output_error(W: Weight, W_hat: Weight, X: Calibration) -> float:
    """``||X W^T - X W_hat^T||_F / ||X W^T||_F``: the layer's relative output error on X.

    Example:
        >>> import torch
        >>> from interp.quant import quantize_weight, relative_output_error
        >>> W = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
        >>> X = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))  # [tokens, in_features]
        >>> 0 < relative_output_error(W, quantize_weight(W, "rtn:bits=4,group=64"), X) < 0.2
        True
    """
    X = X.reshape(-1, X.shape[-1]).float()
    return _relative_norm(X @ (W.float() - W_hat.float()).T, X @ W.float().T)


def _relative_norm(difference: Tensor, reference: Tensor) -> float:
    numerator = float(torch.linalg.norm(difference))
    denominator = float(torch.linalg.norm(reference))
    if denominator == 0.0:
        return 0.0 if numerator == 0.0 else math.inf
    return numerator / denominator


# --- input checks -------------------------------------------------------------------


def _valid_groups(d_in: int) -> str:
    divisors = [g for g in range(1, d_in + 1) if d_in % g == 0]
    shown = [g for g in divisors if g >= 8] or divisors
    return ", ".join(str(g) for g in shown)


def checked_weight(W: object, spec: MethodSpec) -> Tensor:
    """``W`` as a contiguous float32 tensor on its own device, after checking shape, group and values."""
    if not isinstance(W, Tensor) or W.ndim != 2 or not W.is_floating_point():
        described = f"a {W.ndim}-D {W.dtype} tensor" if isinstance(W, Tensor) else type(W).__name__
        raise SpecError(f"quantize_weight needs a 2-D float weight [d_out, d_in] (nn.Linear layout), got {described}")
    d_in = W.shape[1]
    if d_in % spec.group != 0:
        raise SpecError(
            f"group={spec.group} does not divide d_in={d_in}; groups must tile each row "
            f"exactly. Valid group sizes for d_in={d_in}: {_valid_groups(d_in)}"
        )
    if W.numel() == 0:
        raise SpecError(f"quantize_weight needs a non-empty weight, got shape {tuple(W.shape)}")
    weight = W.detach().to(dtype=torch.float32)
    if not bool(torch.isfinite(weight).all()):
        raise NonFiniteError("the weight to quantize contains NaN or inf")
    largest = float(weight.abs().max())
    if largest > MAX_ABS_WEIGHT:
        raise SpecError(
            f"the weight has an entry of magnitude {largest:.3g}, beyond the {MAX_ABS_WEIGHT:.0e} the quantizers "
            "support in float32 (group spans, squares and scales would overflow to inf and give NaN); "
            "no trained model has such weights: check how this one was loaded"
        )
    return weight.contiguous()


def checked_calibration(X: object, method: str, d_in: int) -> Tensor:
    """The calibration inputs as float32 ``[n_tokens, d_in]`` on their own device, after checking them."""
    if X is None:
        raise SpecError(
            f"{method} needs calibration data: pass calibration_inputs, the "
            f"[n_tokens, {d_in}] inputs to this layer on held-apart calibration text"
        )
    if not isinstance(X, Tensor) or X.ndim < 2 or not X.is_floating_point():
        raise SpecError(
            f"calibration_inputs must be a float tensor [n_tokens, {d_in}], "
            f"got {type(X).__name__ if not isinstance(X, Tensor) else tuple(X.shape)}"
        )
    if X.shape[-1] != d_in or X.numel() == 0:
        raise SpecError(
            f"calibration_inputs must be [n_tokens, d_in={d_in}] with n_tokens >= 1, got shape {tuple(X.shape)}"
        )
    flat = X.detach().reshape(-1, d_in).to(dtype=torch.float32)
    if not bool(torch.isfinite(flat).all()):
        raise NonFiniteError("calibration_inputs contain NaN or inf")
    if float(flat.abs().max()) > MAX_ABS_WEIGHT:
        raise NonFiniteError(
            f"calibration_inputs reach {float(flat.abs().max()):.3g}; their Hessian X^T X would overflow float32 "
            "(activations of a sound model stay far below 1e15)"
        )
    return flat


# --- min-max grids (rtn, gptq, awq) -------------------------------------------------


@dataclass(frozen=True)
class MinMaxGrid:
    """An asymmetric uniform grid per group: ``w_hat = (q - zero) * scale``.

    ``inv_scale`` maps weights to levels, ``q = clamp(round(w * inv_scale + zero))``.
    The order of operations (multiply by the inverse scale, zero = -min * inv_scale,
    dequantize with ``scale = 1 / inv_scale``) is hqq's, so the float zero-point
    variant reproduces ``hqq.Quantizer(optimize=False)`` bit for bit.

    Attributes are broadcastable against the grouped values.

    Example:
        >>> import torch
        >>> grid = MinMaxGrid.fit(torch.tensor([[0.0, 0.3, 1.0]]), bits=2)
        >>> grid.fake_quant(torch.tensor([[0.0, 0.3, 1.0]])).tolist()
        [[0.0, 0.3333333432674408, 1.0]]
    """

    inv_scale: Tensor
    zero: Tensor
    scale: Tensor
    max_level: int

    @classmethod
    def fit(cls, values: Tensor, bits: int, dim: int = -1, integer_zero: bool = False) -> MinMaxGrid:
        """Fit one grid per slice of ``values`` along ``dim``.

        Float zero-point: the grid runs exactly from the group's min to its max.
        Integer zero-point: the range is first widened to include 0 and the zero-point
        is rounded to an integer level, so it fits in ``bits`` bits and 0.0 is exactly
        representable (the convention of GPTQ's reference quantizer).

        A constant group (max == min) gets ``inv_scale = 1``: every weight maps to
        level 0 and dequantizes to the constant itself, exactly.
        """
        low = values.amin(dim, keepdim=True)
        high = values.amax(dim, keepdim=True)
        if integer_zero:
            low = low.clamp(max=0.0)
            high = high.clamp(min=0.0)
        max_level = 2**bits - 1
        inv_scale = max_level / (high - low)
        usable = torch.isfinite(inv_scale)  # span 0, or so small that 1/span overflows
        inv_scale = torch.where(usable, inv_scale, torch.ones_like(inv_scale))
        zero = -low * inv_scale
        if integer_zero:
            zero = zero.round()
        return cls(inv_scale, zero, 1.0 / inv_scale, max_level)

    def fake_quant(self, values: Tensor) -> Tensor:
        levels = (values * self.inv_scale + self.zero).round().clamp(0, self.max_level)
        return (levels - self.zero) * self.scale

    def group(self, index: int) -> MinMaxGrid:
        """Group ``index``'s grid, from one fitted on [d_out, n_groups, group] values."""
        return MinMaxGrid(
            self.inv_scale[:, index],
            self.zero[:, index],
            self.scale[:, index],
            self.max_level,
        )


def grouped(W: Tensor, group: int) -> Tensor:
    """[d_out, d_in] -> [d_out, d_in // group, group], a view."""
    return W.reshape(W.shape[0], -1, group)


def rtn_weights(W: Tensor, bits: int, group: int, integer_zero: bool = False) -> Tensor:
    """Round-to-nearest on a min-max grid per group of ``group`` consecutive input weights."""
    groups = grouped(W, group)
    grid = MinMaxGrid.fit(groups, bits, dim=-1, integer_zero=integer_zero)
    return grid.fake_quant(groups).reshape(W.shape)
