"""Weight-only fake quantization of one linear layer.

Every quantizer here takes a weight ``W`` in ``nn.Linear`` layout, ``[d_out, d_in]``,
and returns the *dequantized* weight ``W_hat``: same shape, same dtype, but every
value now lies on the grid the quantized format can store. Putting ``W_hat`` back
into the model simulates running the quantized model ("fake quant"), which is all
the analyses need.

Grouping: the input dimension of each row is cut into runs of ``group`` consecutive
weights, and each run gets its own scale (and zero-point). ``group`` must divide
``d_in``; SmolLM2's d_in = 576 takes 64 but not 128.

Methods (see :mod:`interp.quant.spec` for the spec strings):

- ``rtn``: round-to-nearest on an asymmetric min-max grid per group. The default
  float zero-point reproduces ``hqq``'s ``optimize=False`` path bit for bit.
- ``nf``: NormalFloat (QLoRA). Each group is divided by its absmax and snapped to the
  nearest value of a codebook built from quantiles of N(0, 1). NF4 reproduces
  bitsandbytes' ``quantize_4bit``/``dequantize_4bit`` bit for bit.
- ``hqq``: the ``hqq`` package's half-quadratic quantizer, called on the CPU.
- ``gptq``: rounds one input column at a time and spreads each column's rounding
  error over the columns not yet rounded, weighted by the inverse Hessian of the
  layer's output error, ``H = 2 X^T X / n``.
- ``awq``: scales input channel ``i`` by ``s_i = mean|x_i|^alpha`` before RTN and
  divides it back out afterwards, with ``alpha`` chosen on a grid to minimise the
  output error on the calibration tokens.

All arithmetic runs in float32 (GPTQ's Hessian factorisation in float64) whatever the
input dtype; the result is cast back.

Example:
    >>> import torch
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

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from interp.errors import NonFiniteError, SpecError
from interp.quant.spec import METHODS, MethodSpec, parse_spec

__all__ = [
    "awq_alpha_search",
    "normal_float_codebook",
    "quantize_weight",
    "relative_error",
    "relative_output_error",
]

# Largest |w| accepted. The quantizers work in float32 (max 3.4e38): a group's span
# (max - min) reaches 2|w|, GPTQ/AWQ form squared errors of |w| summed over d_in, and HQQ
# raises |w| to small powers, so |w| must stay many orders below sqrt(3.4e38) ~ 1.8e19.
# Trained weights are below ~1e3.
MAX_ABS_WEIGHT = 1e15

Weight = Float[Tensor, "d_out d_in"]
Calibration = Float[Tensor, "n_tokens d_in"]
Codebook = Float[Tensor, " levels"]

# A quantizer gets a float32 weight, the parsed spec, and float32 calibration inputs
# (None for methods that need none), and returns the float32 dequantized weight.
Quantizer = Callable[[Tensor, MethodSpec, "Tensor | None"], Tensor]


def quantize_weight(W: Weight, spec: str | MethodSpec, calibration_inputs: Calibration | None = None) -> Weight:
    """Fake-quantize one linear weight.

    Args:
        W: weight in nn.Linear layout, [d_out, d_in], any float dtype.
        spec: method spec string such as ``"gptq:bits=3,group=64"``, or a MethodSpec.
        calibration_inputs: [n_tokens, d_in] (or [..., d_in]) inputs to this layer,
            required by gptq and awq and ignored by the other methods.

    Returns:
        The dequantized weight, same shape, dtype and device as ``W`` (the work itself
        runs on the CPU).

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
    spec = parse_spec(spec)
    weight = _checked_weight(W, spec)
    calibration = None
    if spec.needs_calibration:
        calibration = _checked_calibration(calibration_inputs, spec, weight.shape[1])
    dequantized = _QUANTIZERS[spec.method](weight, spec, calibration)
    return dequantized.to(device=W.device, dtype=W.dtype)


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


def _checked_weight(W: object, spec: MethodSpec) -> Tensor:
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
    weight = W.detach().to(device="cpu", dtype=torch.float32)
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


def _checked_calibration(X: object, spec: MethodSpec, d_in: int) -> Tensor:
    if X is None:
        raise SpecError(
            f"{spec.method} needs calibration data: pass calibration_inputs, the "
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
    flat = X.detach().reshape(-1, d_in).to(device="cpu", dtype=torch.float32)
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


def _grouped(W: Tensor, group: int) -> Tensor:
    """[d_out, d_in] -> [d_out, d_in // group, group], a view."""
    return W.reshape(W.shape[0], -1, group)


def _rtn_weights(W: Tensor, bits: int, group: int, integer_zero: bool = False) -> Tensor:
    groups = _grouped(W, group)
    grid = MinMaxGrid.fit(groups, bits, dim=-1, integer_zero=integer_zero)
    return grid.fake_quant(groups).reshape(W.shape)


def _rtn(W: Tensor, spec: MethodSpec, _calibration: Tensor | None) -> Tensor:
    return _rtn_weights(W, spec.bits, spec.group, integer_zero=spec.params["zero"] == "int")


# --- NormalFloat --------------------------------------------------------------------


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
    from scipy.stats import norm

    offset = _normal_float_offset(bits)
    half = 2 ** (bits - 1)
    # Quantile positions in float32, quantiles in float64, code in float32: the
    # precision path of the published NF4 table, so ours matches it bit for bit.
    positive_p = torch.linspace(offset, 0.5, half + 1, dtype=torch.float32)[:-1]
    negative_p = torch.linspace(offset, 0.5, half, dtype=torch.float32)[:-1]
    positive = norm.ppf(positive_p.double().numpy())  # `half` values > 0
    negative = -norm.ppf(negative_p.double().numpy())  # `half - 1` values < 0
    values = torch.tensor([*negative, 0.0, *positive], dtype=torch.float32).sort().values
    return tuple((values / values.max()).tolist())


def normal_float_codebook(bits: int) -> Codebook:
    """The k-bit NormalFloat code, sorted, in [-1, 1], with an exact 0.

    Asymmetric: 2^(k-1) positive levels and 2^(k-1) - 1 negative ones, so that 0 is a
    level and +-1 are both reachable (QLoRA's construction).

    Example:
        >>> normal_float_codebook(3).tolist()[:4]
        [-1.0, -0.5350227952003479, -0.24693147838115692, 0.0]
    """
    if bits not in METHODS["nf"].bits:
        raise SpecError(f"NormalFloat supports bits {METHODS['nf'].bits_text()}, got {bits}")
    return torch.tensor(_normal_float_levels(bits), dtype=torch.float32)


def _nf(W: Tensor, spec: MethodSpec, _calibration: Tensor | None) -> Tensor:
    code = normal_float_codebook(spec.bits)
    midpoints = (code[:-1] + code[1:]) / 2
    groups = _grouped(W, spec.group)
    absmax = groups.abs().amax(-1, keepdim=True)
    # Multiply by the reciprocal (not divide) and keep an all-zero group at 0: the
    # arithmetic bitsandbytes uses, needed for bit-exact agreement.
    reciprocal = 1.0 / absmax.clamp(min=torch.finfo(torch.float32).tiny)
    normalised = (groups * reciprocal).clamp(-1.0, 1.0)
    # bucketize(right=False) sends a value exactly on a midpoint to the lower level.
    levels = torch.bucketize(normalised, midpoints)
    return (code[levels] * absmax).reshape(W.shape)


# --- HQQ (the hqq package) ----------------------------------------------------------


def _hqq(W: Tensor, spec: MethodSpec, _calibration: Tensor | None) -> Tensor:
    from hqq.core.quantize import Quantizer as HQQQuantizer

    levels, meta = HQQQuantizer.quantize(
        W,
        nbits=spec.bits,
        group_size=spec.group,
        optimize=bool(spec.params["optimize"]),
        axis=1,  # groups run along the input dimension, as for every other method
        bitpack=False,
        compute_dtype=torch.float32,
        device="cpu",
    )
    meta["compute_dtype"] = torch.float32  # dequantize() defaults to float16 otherwise
    dequantized: Tensor = HQQQuantizer.dequantize(levels, meta)
    return dequantized.reshape(W.shape).float()


# --- GPTQ ---------------------------------------------------------------------------


def _hessian(X: Tensor) -> Tensor:
    """``H = 2 X^T X / n``, the Hessian of the layer's squared output error.

    The product runs in float32 (the cost is n * d_in^2); the result is returned in
    float64 for the damping and Cholesky steps.
    """
    return (2.0 / X.shape[0]) * (X.T @ X).double()


def _inverse_hessian_factor(hessian: Tensor, damp: float, n_tokens: int) -> Tensor:
    """Upper Cholesky factor U of the damped inverse Hessian, ``H^-1 = U^T U``, float32.

    Damping adds ``damp * mean(diag H)`` to the diagonal (mean over live channels).
    Dead input channels (never nonzero in the calibration data, diag(H) = 0) get that
    mean as their diagonal: they are then decoupled from the others, so they are
    rounded like RTN and pass no error on. GPTQ's reference code instead zeroes their
    weights; we keep them, because a channel silent on the calibration text need not
    be silent on the evaluation text.
    """
    hessian = hessian.clone()
    raw_diag = hessian.diagonal().clone()
    dead = raw_diag == 0
    live_mean = float(raw_diag[~dead].mean()) if bool((~dead).any()) else 1.0
    hessian.diagonal().add_(torch.where(dead, live_mean, damp * live_mean))
    lower, info = torch.linalg.cholesky_ex(hessian)
    upper: Tensor | None = None
    if int(info) == 0:
        upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
    if upper is None or int(info) != 0 or not bool(torch.isfinite(upper).all()):
        raise SpecError(
            f"the GPTQ Hessian is not positive definite with damp={damp}; use a larger "
            f"damp (e.g. damp=0.1) or more calibration tokens (got {n_tokens} for "
            f"d_in={hessian.shape[0]})"
        )
    return upper.float()


@dataclass
class _GptqSweep:
    """State of one GPTQ pass over the (possibly permuted) columns.

    ``weight`` holds the columns in processing order and receives the lazy block
    updates; ``upper`` is the inverse-Hessian factor in the same order.
    ``members[g]`` lists the positions (in processing order) of ORIGINAL group g, so
    groups keep their storage layout under act-order.
    """

    weight: Tensor  # [d_out, d_in], processing order
    upper: Tensor  # [d_in, d_in], processing order
    group_of: list[int]  # position -> original group
    members: list[Tensor]  # original group -> its positions, ascending
    bits: int
    grids: dict[int, MinMaxGrid]

    def grid_for(self, position: int, start: int, end: int, work: Tensor, errors: Tensor) -> MinMaxGrid:
        """The grid of this column's group; fitted when the group is first reached.

        Under act-order the grids are fitted up front (static groups) and this only
        looks them up. Otherwise the group is fitted on entry, on its current values:
        all error feedback so far, including the running block's lazy update that
        columns beyond the block have not received yet (so the result does not
        depend on ``block``, which is only a speed knob).
        """
        group = self.group_of[position]
        if group not in self.grids:
            members = self.members[group]
            inside, beyond = members[members < end], members[members >= end]
            pending = self.weight[:, beyond] - errors @ self.upper[start:end, beyond]
            current = torch.cat([work[:, inside - start], pending], dim=1)
            self.grids[group] = MinMaxGrid.fit(current, self.bits, dim=1)
        return self.grids[group]

    def run_block(self, start: int, end: int, out: Tensor) -> None:
        """Round columns start..end-1 with eager in-block feedback, then pass it on lazily."""
        work = self.weight[:, start:end].clone()
        errors = torch.zeros_like(work)
        for offset in range(end - start):
            position = start + offset
            grid = self.grid_for(position, start, end, work, errors)
            column = work[:, offset : offset + 1]  # [d_out, 1]
            rounded = grid.fake_quant(column)
            out[:, position : position + 1] = rounded
            error = (column - rounded) / self.upper[position, position]
            work[:, offset + 1 :] -= error * self.upper[position, position + 1 : end]
            errors[:, offset : offset + 1] = error
        self.weight[:, end:] -= errors @ self.upper[start:end, end:]


def _gptq(W: Tensor, spec: MethodSpec, X: Tensor | None) -> Tensor:
    assert X is not None
    d_in = W.shape[1]
    hessian = _hessian(X)
    if spec.params["act_order"]:
        # Most-activated input channels first, dead ones last. Stable, so ties (e.g.
        # H proportional to I) keep the natural order.
        order = torch.argsort(hessian.diagonal(), descending=True, stable=True)
        hessian = hessian[order][:, order]
    else:
        order = torch.arange(d_in)
    group_of = order // spec.group
    grids: dict[int, MinMaxGrid] = {}
    if spec.params["act_order"]:
        # Static groups: each ORIGINAL group's min-max grid comes from the original
        # weights, i.e. it is RTN's grid; GPTQ only picks other points on it. On
        # SmolLM2 activations this was as good as or slightly better (by ~0.001
        # relative output error) than fitting each group when first reached.
        fitted = MinMaxGrid.fit(_grouped(W, spec.group), spec.bits)
        grids = {g: fitted.group(g) for g in range(d_in // spec.group)}
    sweep = _GptqSweep(
        weight=W[:, order].clone(),
        upper=_inverse_hessian_factor(hessian, float(spec.params["damp"]), X.shape[0]),
        group_of=group_of.tolist(),
        members=[torch.nonzero(group_of == g).flatten() for g in range(d_in // spec.group)],
        bits=spec.bits,
        grids=grids,
    )
    rounded = torch.empty_like(W)
    block = int(spec.params["block"])
    for start in range(0, d_in, block):
        sweep.run_block(start, min(start + block, d_in), rounded)
    result = torch.empty_like(W)
    result[:, order] = rounded
    return result


# --- AWQ ----------------------------------------------------------------------------


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


def _squared_output_error(X: Tensor) -> Callable[[Tensor], float]:
    """``delta -> ||X delta^T||_F^2``, through X^T X when that is the cheaper product."""
    if X.shape[0] <= X.shape[1]:
        return lambda delta: float((X @ delta.T).square().sum())
    gram = X.T @ X
    return lambda delta: float(((delta @ gram) * delta).sum())


def awq_alpha_search(W: Weight, X: Calibration, bits: int, group: int, grid: int = 20) -> AwqSearch:
    """AWQ's search: try ``alpha`` on ``linspace(0, 1, grid)``, keep the best.

    For each alpha, ``s = mean_tokens |x|^alpha`` (normalised so that
    ``max(s) * min(s) = 1``, which keeps the scaled weights near their old range;
    min-max RTN is invariant to a global factor anyway), ``W_hat = RTN(W diag(s))
    diag(1/s)``. Channels never active in X get the floor ``1e-6 * max mean|x|``
    so that no column is scaled to zero. Ties go to the smaller alpha, so on the
    calibration data AWQ is never worse than RTN (alpha = 0 is plain RTN).

    Both tensors must be float32 and already checked; use :func:`quantize_weight` for
    the checked entry point.
    """
    magnitude = X.abs().mean(0)
    floor = float(magnitude.max()) * 1e-6
    base = magnitude.clamp(min=floor) if floor > 0 else torch.ones_like(magnitude)
    output_error = _squared_output_error(X)
    alphas = tuple(torch.linspace(0.0, 1.0, grid).tolist())
    best: tuple[float, float, Tensor] | None = None
    errors = []
    for alpha in alphas:
        scale = base**alpha
        scale = scale / torch.sqrt(scale.max() * scale.min())
        candidate = _rtn_weights(W * scale, bits, group) / scale
        error = output_error(W - candidate)
        errors.append(error)
        if best is None or error < best[0]:
            best = (error, alpha, candidate)
    assert best is not None
    return AwqSearch(weight=best[2], alpha=best[1], alphas=alphas, errors=tuple(errors))


def _awq(W: Tensor, spec: MethodSpec, X: Tensor | None) -> Tensor:
    assert X is not None
    return awq_alpha_search(W, X, spec.bits, spec.group, int(spec.params["grid"])).weight


# --- dispatch -----------------------------------------------------------------------

_QUANTIZERS: dict[str, Quantizer] = {
    "rtn": _rtn,
    "nf": _nf,
    "hqq": _hqq,
    "gptq": _gptq,
    "awq": _awq,
}
assert set(_QUANTIZERS) == set(METHODS), "every method in spec.METHODS needs a quantizer"
