"""``gptq``: Hessian-aware rounding with error feedback.

GPTQ rounds one input column at a time and spreads each column's rounding error over the
columns not yet rounded, weighted by the inverse Hessian of the layer's output error,
``H = 2 X^T X / n``. Columns are processed in blocks of ``block``: inside a block the
feedback is applied column by column, to the columns beyond it once per block (the
"lazy batch" update), which gives the same result for any ``block``. With ``act_order=1``
the most-activated input channels go first and each group keeps the min-max grid of its
original weights (static groups).

The Hessian factorisation runs in float64, everything else in float32, all of it on the
weight's device (the column sweep's buffers, the Hessian and its factor included): on a GPU
nothing comes back to the host but a few scalars (a sum to check, the factorisation's
status). torch is imported inside the functions: the registry imports this module to read ``QUANTIZER``, and parsing
a spec must not load torch.

Example:
    >>> import torch
    >>> from interp.quant import quantize_weight, relative_output_error
    >>> W = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    >>> X = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    >>> gptq = relative_output_error(W, quantize_weight(W, "gptq:bits=3,group=32", X), X)
    >>> rtn = relative_output_error(W, quantize_weight(W, "rtn:bits=3,group=32"), X)
    >>> gptq < rtn
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from interp.errors import SpecError
from interp.quant.spec import MethodSpec, Option, Quantizer, flag, non_negative_float, positive_int

if TYPE_CHECKING:
    from torch import Tensor

    from interp.quant.methods._common import LayerInputs, MinMaxGrid


def inverse_hessian_factor(hessian: Tensor, damp: float, n_tokens: int) -> Tensor:
    """Upper Cholesky factor U of the damped inverse Hessian, ``H^-1 = U^T U``, float32.

    Damping adds ``damp * mean(diag H)`` to the diagonal (mean over live channels).
    Dead input channels (never nonzero in the calibration data, diag(H) = 0) get that
    mean as their diagonal: they are then decoupled from the others, so they are
    rounded like RTN and pass no error on. GPTQ's reference code instead zeroes their
    weights; we keep them, because a channel silent on the calibration text need not
    be silent on the evaluation text.
    """
    import torch  # deferred, see the module docstring

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


def _factor(inputs: LayerInputs, damp: float, act_order: bool) -> tuple[Tensor, Tensor]:
    """``(order, upper)``: the order the columns are processed in, and the inverse-Hessian factor in that order.

    ``H = 2 X^T X / n`` is formed from the inputs' shared ``X^T X`` (float32 product, float64
    result), so q, k and v (and gate and up) pay for it, and for the factorisation, once.
    """
    import torch  # deferred, see the module docstring

    hessian = (2.0 / inputs.n_tokens) * inputs.gram().double()
    if act_order:
        # Most-activated input channels first, dead ones last. Stable, so ties (e.g.
        # H proportional to I) keep the natural order.
        order = torch.argsort(hessian.diagonal(), descending=True, stable=True)
        hessian = hessian[order][:, order]
    else:
        order = torch.arange(inputs.d_in, device=hessian.device)
    return order, inverse_hessian_factor(hessian, damp, inputs.n_tokens)


@dataclass
class _Sweep:
    """State of one GPTQ pass over the (possibly permuted) columns.

    ``weight`` holds the columns in processing order and receives the lazy block
    updates; ``upper`` is the inverse-Hessian factor in the same order.
    Without act-order the columns keep their order, so group ``g`` is positions
    ``g * group`` to ``(g + 1) * group - 1`` and its grid is fitted when the sweep reaches it;
    ``grids`` holds each fitted group's grid as three contiguous ``[d_out]`` vectors
    (inverse scale, zero-point, scale). Under act-order every grid is fixed up front
    (static groups) and ``static`` holds, for each position in processing order, its
    ORIGINAL group's grid: three ``[d_in, d_out]`` tensors whose row ``p`` is position
    ``p``'s vector, gathered on the device (no group index comes back to the host).

    Inside a block the columns are held transposed (one contiguous row per column), which
    makes each step a few operations on contiguous vectors; every value is computed by the
    same floating-point operations as in the column-by-column formulation (products of
    the same two numbers, the same subtractions and divisions, the lazy update from the
    same contiguous error matrix), so the result is the same to the bit.
    """

    weight: Tensor  # [d_out, d_in], processing order
    upper: Tensor  # [d_in, d_in], processing order
    group: int  # columns per group
    bits: int
    grids: dict[int, tuple[Tensor, Tensor, Tensor]]  # without act-order: group -> its grid, once reached
    static: tuple[Tensor, Tensor, Tensor] | None = None  # under act-order: [d_in, d_out] grid rows per position

    def grid_for(self, position: int, start: int, end: int, work_t: Tensor,
                 errors_t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The grid of this column's group; fitted when the group is first reached.

        Under act-order the grids are fitted up front (static groups) and this only
        looks them up. Otherwise the group is fitted on entry, on its current values:
        all error feedback so far, including the running block's lazy update that
        columns beyond the block have not received yet (so the result does not
        depend on ``block``, which is only a speed knob).
        """
        import torch  # deferred, see the module docstring

        from interp.quant.methods._common import MinMaxGrid

        if self.static is not None:
            return self.static[0][position], self.static[1][position], self.static[2][position]
        group = position // self.group
        if group not in self.grids:
            first, last = group * self.group, (group + 1) * self.group  # the group's positions, first..last-1
            inside, beyond = slice(first - start, min(last, end) - start), slice(max(first, end), max(last, end))
            errors = errors_t.T.contiguous()
            # contiguous: the product sees the operand the gathered columns of earlier versions gave it
            pending = self.weight[:, beyond] - errors @ self.upper[start:end, beyond].contiguous()
            current = torch.cat([work_t[inside].T, pending], dim=1)
            self.grids[group] = _vectors(MinMaxGrid.fit(current, self.bits, dim=1))
        return self.grids[group]

    def run_block(self, start: int, end: int, out_t: Tensor) -> None:
        """Round columns start..end-1 into rows of ``out_t`` with eager in-block feedback, then pass it on lazily."""
        import torch  # deferred, see the module docstring

        work_t = self.weight[:, start:end].T.contiguous()  # [block, d_out]: one row per column
        errors_t = torch.zeros_like(work_t)
        products = torch.empty_like(work_t)
        diagonal = self.upper.diagonal()
        max_level = 2**self.bits - 1
        for offset in range(end - start):
            position = start + offset
            inv_scale, zero, scale = self.grid_for(position, start, end, work_t, errors_t)
            column, rounded, error = work_t[offset], out_t[position], errors_t[offset]
            # MinMaxGrid.fake_quant, in place: levels = clamp(round(w * inv_scale + zero)), (levels - zero) * scale
            torch.mul(column, inv_scale, out=rounded).add_(zero).round_().clamp_(0, max_level).sub_(zero).mul_(scale)
            torch.sub(column, rounded, out=error).div_(diagonal[position])
            if offset + 1 < end - start:
                rest = work_t[offset + 1 :]
                update = products[: rest.shape[0]]
                torch.mul(self.upper[position, position + 1 : end, None], error, out=update)
                rest.sub_(update)
        self.weight[:, end:] -= errors_t.T.contiguous() @ self.upper[start:end, end:]


def _vectors(grid: MinMaxGrid) -> tuple[Tensor, Tensor, Tensor]:
    """A ``[d_out, 1]`` grid as contiguous ``[d_out]`` vectors (inverse scale, zero-point, scale)."""
    return (grid.inv_scale.reshape(-1).contiguous(), grid.zero.reshape(-1).contiguous(),
            grid.scale.reshape(-1).contiguous())


def quantize(W: Tensor, spec: MethodSpec, inputs: LayerInputs | None) -> Tensor:
    import torch  # deferred, see the module docstring

    from interp.quant.methods._common import MinMaxGrid, grouped

    assert inputs is not None
    d_in = W.shape[1]
    act_order = bool(spec.params["act_order"])
    damp = float(spec.params["damp"])
    order, upper = inputs.derived(("gptq", damp, act_order), lambda: _factor(inputs, damp, act_order))
    static = None
    if act_order:
        # Static groups: each ORIGINAL group's min-max grid comes from the original
        # weights, i.e. it is RTN's grid; GPTQ only picks other points on it. On
        # SmolLM2 activations this was as good as or slightly better (by ~0.001
        # relative output error) than fitting each group when first reached.
        fitted = MinMaxGrid.fit(grouped(W, spec.group), spec.bits)  # [d_out, n_groups, 1] each
        group_of = order // spec.group  # position -> original group, on the device
        inv_scale, zero, scale = (v.reshape(W.shape[0], -1).T[group_of].contiguous()
                                  for v in (fitted.inv_scale, fitted.zero, fitted.scale))
        static = (inv_scale, zero, scale)
    sweep = _Sweep(weight=W[:, order].clone(), upper=upper, group=spec.group, bits=spec.bits, grids={},
                   static=static)
    # row p: the rounded column at position p
    rounded_t = torch.empty(d_in, W.shape[0], dtype=W.dtype, device=W.device)
    block = int(spec.params["block"])
    for start in range(0, d_in, block):
        sweep.run_block(start, min(start + block, d_in), rounded_t)
    result = torch.empty_like(W)
    result[:, order] = rounded_t.T
    return result


QUANTIZER = Quantizer(
    name="gptq",
    quantize=quantize,
    bits=tuple(range(2, 9)),
    options={
        "damp": Option(0.01, "a float >= 0", non_negative_float),
        "act_order": Option(1, "0 or 1", flag),
        "block": Option(128, "an integer >= 1", positive_int),
    },
    needs_calibration=True,
    summary="Hessian-aware rounding with error feedback",
    report_bits=(3, 4),
    report_rank=2,
)
