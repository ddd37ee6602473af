"""llama.cpp's K-quants (Q2_K ... Q6_K) stored byte for byte as ``llama-quantize`` stores them, in numpy.

Written from the algorithms of llama.cpp's ``ggml/src/ggml-quants.c``: each type splits a row
into super-blocks of 256 weights, and those into sub-blocks of 16 (Q2_K, Q3_K, Q6_K) or 32
(Q4_K, Q5_K), each with its own scale (and min for Q2_K, Q4_K, Q5_K). A sub-block's scale comes
from a small search (``_fit_symmetric``, ``_fit_offset``, ``_fit_q3``), the
sub-blocks' scales are themselves quantized against one fp16 super-block scale (4, 6 or 8 bits),
and every weight is rounded again with the scale that is stored.

Without an importance matrix ``llama-quantize`` weighs each weight by its own size; with one
(``--imatrix``), by the importance of its input channel (:func:`llama_importance`: the mean
squared input, ``in_sum2 / counts`` in float32) times ``sqrt(sigma² + x²)``, and it picks the
super-block scales by a weighted search too. Both paths are here.

Byte-exactness is the point, so the arithmetic is llama.cpp's: float32 throughout, every sum
accumulated in the C code's sequential order (``_seqsum``), ties broken as its loops break
them (the first maximum, strict comparisons), and rounding as its ``nearest_int`` (float32 add of
1.5 * 2**23, ties to even). The work is vectorized over all (sub-)blocks of a matrix at once; the
loops left are over the 16 or 32 weights of a sub-block and over the candidate scales.
tests/test_kquants.py checks the bytes against llama-quantize's own for every type, with and
without an importance matrix.

Example:
    >>> import numpy as np
    >>> from interp.quant.kquants import dequantize, quantize
    >>> rows = np.random.default_rng(0).standard_normal((2, 512)).astype(np.float32)
    >>> blocks = quantize(rows, "q4_k")
    >>> blocks.shape, blocks.dtype  # 2 super-blocks of 144 bytes per row
    ((2, 288), dtype('uint8'))
    >>> float(np.abs(dequantize(blocks, "q4_k") - rows).max()) < 0.25
    True
"""

from __future__ import annotations

from typing import Any

import numpy as np

from interp.errors import SpecError

__all__ = ["KQUANT_TYPES", "dequantize", "llama_importance", "quantize", "quantize_legacy"]

KQUANT_TYPES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
QK = 256  # weights per super-block
F32 = np.float32
EPS = F32(1e-15)  # ggml's GROUP_MAX_EPS: a sub-block whose largest |x| is below it is all zero
MAGIC = F32(12582912.0)  # 1.5 * 2**23: adding it leaves the rounded integer in the low mantissa bits


def _f(value: float) -> np.float32:
    """A float32 constant, as the C literal ``valuef`` is."""
    return F32(value)


def nearest_int(values: np.ndarray) -> np.ndarray:
    """llama.cpp's ``nearest_int``: round float32 values to int32, ties to even (exact for |x| < 2**22)."""
    with np.errstate(all="ignore"):
        bits = (np.asarray(values, dtype=F32) + MAGIC).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def _seqsum(values: np.ndarray) -> np.ndarray:
    """Float32 sum over the last axis, left to right (the C loops' ``sum += ...``; numpy's own sum is pairwise)."""
    # numpy's accumulate along the last axis is ~50x slower than a loop over contiguous rows
    return _rowsum(np.ascontiguousarray(np.moveaxis(values.astype(F32, copy=False), -1, 0)))


def _fp16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 -> fp16 bits (round to nearest even, as ggml's conversion) and the float32 value stored."""
    with np.errstate(over="ignore"):  # past fp16's range is inf, as ggml's conversion gives
        half = np.asarray(values, dtype=F32).astype(np.float16)
    return half, half.astype(F32)


def _first_max_abs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the value of largest magnitude (the first on ties, as ``if (ax > amax)``) and that magnitude."""
    index = np.argmax(np.abs(values), axis=-1)
    chosen = np.take_along_axis(values, index[..., None], axis=-1)[..., 0]
    return chosen, np.abs(chosen)


def _positive_max(values: np.ndarray) -> np.ndarray:
    """``max = 0; if (v > max) max = v`` over the last axis."""
    return np.maximum(values.max(axis=-1), F32(0))


# ---------------------------------------------------------------------------------------------------------------
# Sub-block fits: values [S, n] (S sub-blocks of n weights) -> scale [S] (and min) and levels [S, n]. Inside, the
# arrays are transposed to [n, S], so a sub-block's sequential sum is a loop over n contiguous rows (_rowsum)


def _rowsum(columns: np.ndarray) -> np.ndarray:
    """Float32 sum over the first axis, in order: ``[n, S] -> [S]``."""
    total = columns[0].copy()
    for row in columns[1:]:
        total += row
    return total


def _t(values: np.ndarray) -> np.ndarray:
    """``[S, n]`` float32 -> contiguous ``[n, S]``."""
    return np.ascontiguousarray(values.astype(F32, copy=False).T)


def _fit_symmetric(x: np.ndarray, nmax: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``make_qx_quants`` (rmse_type 1): levels in [-nmax, nmax-1] of a scale through the largest |x|,
    then the scale of least weighted error among 18 nudged scales. Returns (scale, levels + nmax)."""
    big, amax = _first_max_abs(x)
    zero = amax < EPS
    big = np.where(zero, F32(1), big)
    xt, wt = _t(x), _t(w)
    wx = wt * xt

    def levels(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        q = np.clip(nearest_int(iscale * xt), -nmax, nmax - 1)
        lf = q.astype(F32)
        return q, _rowsum(wx * lf), _rowsum(wt * lf * lf)

    with np.errstate(all="ignore"):
        best_l, sumlx, suml2 = levels(-_f(nmax) / big)
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            q, sumlx, suml2 = levels(-(_f(nmax) + _f(0.1) * _f(step)) / big)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            best_l = np.where(better, q, best_l)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    return np.where(zero, F32(0), scale), np.where(zero, 0, best_l + nmax).T


def _fit_q3(x: np.ndarray, nmax: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``make_q3_quants`` with its rmse search: levels of a scale through the largest |x|, then up to five
    passes that move one weight's level at a time while the weighted (x²) fit improves. Returns (scale, L + nmax)."""
    big, amax = _first_max_abs(x)
    zero = amax < EPS
    big = np.where(zero, F32(1), big)
    xt = _t(x)
    w = xt * xt
    wx = w * xt
    with np.errstate(all="ignore"):
        q = np.clip(nearest_int((-_f(nmax) / big) * xt), -nmax, nmax - 1)
        lf = q.astype(F32)
        sumlx, suml2 = _rowsum(wx * lf), _rowsum(w * lf * lf)
        # a pass that changes nothing leaves the state as it found it, so passes after the C code's early exit
        # change nothing either: running all five on every sub-block gives its result
        for _ in range(5):
            for i in range(xt.shape[0]):
                wi, wxi, li = w[i], wx[i], q[i].astype(F32)
                slx = sumlx - wxi * li
                sl2 = suml2 - wi * li * li
                new = np.clip(nearest_int(xt[i] * sl2 / slx), -nmax, nmax - 1)
                nf = new.astype(F32)
                slx_new = slx + wxi * nf
                sl2_new = sl2 + wi * nf * nf
                take = ((slx > 0) & (new != q[i]) & (sl2_new > 0)
                        & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new))
                q[i] = np.where(take, new, q[i])
                sumlx = np.where(take, slx_new, sumlx)
                suml2 = np.where(take, sl2_new, suml2)
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    return np.where(zero, F32(0), scale), np.where(zero, 0, q + nmax).T


def _fit_offset(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool,
                strict: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's ``make_qkx2_quants`` (``strict``: a flat sub-block is one whose max equals its min) and
    ``make_qkx3_quants`` (max <= min): ``x ~ scale * L - min`` with L in [0, nmax], min >= 0, searched over
    ``nstep + 1`` scales, each with the least-squares scale and min of its levels, kept when its weighted error
    (|d| or d²) is lower. Each kept fit moves the grid the next candidates are rounded on, as in the C loop.
    Returns (scale, the min as a positive offset, levels)."""
    lo = np.take_along_axis(x, np.argmin(x, axis=1)[:, None], axis=1)[:, 0]  # the first minimum, -0.0 kept
    lo = np.where(lo > 0, F32(0), lo)
    hi = x.max(axis=1)
    xt, wt = _t(x), _t(w)
    sum_w = _rowsum(wt)
    sum_x = _rowsum(wt * xt)
    flat = (hi == lo) if strict else (hi <= lo)
    span_ok = np.where(flat, F32(1), hi - lo)

    def error(scale: np.ndarray, offset: np.ndarray, lf: np.ndarray) -> np.ndarray:
        diff = scale * lf + offset - xt
        return _rowsum(wt * (np.abs(diff) if use_mad else diff * diff))

    with np.errstate(all="ignore"):
        iscale = _f(nmax) / span_ok
        scale = F32(1) / iscale
        best_l = np.clip(nearest_int(iscale * (xt - lo)), 0, nmax)
        best = error(scale, lo, best_l.astype(F32))
        for step in range(nstep + 1):
            iscale = (_f(rmin) + _f(rdelta) * _f(step) + _f(nmax)) / (hi - lo)
            q = np.clip(nearest_int(iscale * (xt - lo)), 0, nmax)
            lf = q.astype(F32)
            wl = wt * lf
            sum_l, sum_l2, sum_xl = _rowsum(wl), _rowsum(wl * lf), _rowsum(wl * xt)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            clamp = this_min > 0
            this_min = np.where(clamp, F32(0), this_min)
            this_scale = np.where(clamp, sum_xl / sum_l2, this_scale)
            current = error(this_scale, this_min, lf)
            better = (det > 0) & (current < best) & ~flat
            best = np.where(better, current, best)
            best_l = np.where(better, q, best_l)
            scale = np.where(better, this_scale, scale)
            lo = np.where(better, this_min, lo)
    return np.where(flat, F32(0), scale), -lo, np.where(flat, 0, best_l).T


def _fit_positive(x: np.ndarray, nmax: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``make_qp_quants``: non-negative values (sub-block scales or mins) as levels in [0, nmax] of one scale,
    the scale picked among 9 by weighted squared error, then up to five passes of one-level moves. Returns
    (scale, levels as the uint8 the C code stores)."""
    top = _positive_max(x)
    zero = top < EPS
    top = np.where(zero, F32(1), top)
    xt, wt = _t(x), _t(w)
    wx = wt * xt
    with np.errstate(all="ignore"):
        iscale = _f(nmax) / top
        stored = nearest_int(iscale * xt) & 0xFF
        scale = F32(1) / iscale
        diff = xt - scale * stored.astype(F32)
        best = _rowsum(wt * diff * diff)
        for step in range(-4, 5):
            if step == 0:
                continue
            iscale_step = (_f(0.1) * _f(step) + _f(nmax)) / top
            scale_step = F32(1) / iscale_step
            lf = np.minimum(nmax, nearest_int(iscale_step * xt)).astype(F32)
            diff = xt - scale_step * lf
            mse = _rowsum(wt * diff * diff)
            better = mse < best
            best = np.where(better, mse, best)
            iscale = np.where(better, iscale_step, iscale)
        q = np.minimum(nmax, nearest_int(iscale * xt))
        lf = q.astype(F32)
        stored = q & 0xFF
        sumlx, suml2 = _rowsum(wx * lf), _rowsum(wt * lf * lf)
        for _ in range(5):  # see _fit_q3: passes past a pass without change change nothing
            for i in range(xt.shape[0]):
                wi, wxi, li = wt[i], wx[i], stored[i].astype(F32)
                slx = sumlx - wxi * li
                sl2 = suml2 - wi * li * li
                new = np.minimum(nmax, nearest_int(xt[i] * sl2 / slx))
                nf = new.astype(F32)
                slx_new = slx + wxi * nf
                sl2_new = sl2 + wi * nf * nf
                take = ((slx > 0) & (sl2 > 0) & (new != stored[i])
                        & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new))
                stored[i] = np.where(take, new & 0xFF, stored[i])
                sumlx = np.where(take, slx_new, sumlx)
                suml2 = np.where(take, sl2_new, suml2)
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    return np.where(zero, F32(0), scale), np.where(zero, 0, stored).T


# ---------------------------------------------------------------------------------------------------------------
# Packing


def _pack2(levels: np.ndarray) -> np.ndarray:
    """[B, 256] levels in 0..3 -> [B, 64]: byte 32h + l holds levels 128h + l + 32k at bits 2k."""
    q = levels.reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6).reshape(-1, 64)


def _pack4(levels: np.ndarray) -> np.ndarray:
    """[B, 256] levels in 0..15 -> [B, 128]: byte 32h + l holds levels 64h + l (low) and 64h + 32 + l (high)."""
    q = levels.reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | q[:, :, 1] << 4).reshape(-1, 128)


def _scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and mins (the C code's stores, wrapped to a byte as it does)."""
    out = np.zeros((ls.shape[0], 12), dtype=np.int64)
    out[:, 0:4] = ls[:, 0:4] & 0xFF
    out[:, 4:8] = lm[:, 0:4] & 0xFF
    out[:, 8:12] = (ls[:, 4:8] & 0xF) | (lm[:, 4:8] & 0xF) << 4
    out[:, 0:4] |= (ls[:, 4:8] & 0xFF) >> 4 << 6
    out[:, 4:8] |= (lm[:, 4:8] & 0xFF) >> 4 << 6
    return out & 0xFF


def _unscales_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``get_scale_min_k4`` for all eight sub-blocks: (scales, mins) as integers."""
    q = packed.astype(np.int64)
    sc = np.concatenate([q[:, 0:4] & 63, (q[:, 8:12] & 0xF) | (q[:, 0:4] >> 6) << 4], axis=1)
    mn = np.concatenate([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | (q[:, 4:8] >> 6) << 4], axis=1)
    return sc, mn


def _scales_q3(q: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes of sixteen 6-bit scales (``q`` in 0..63): low nibbles, then 2 high bits per byte."""
    out = np.zeros((q.shape[0], 12), dtype=np.int64)
    out[:, 0:8] = (q[:, 0:8] & 0xF) | (q[:, 8:16] & 0xF) << 4
    high = (q >> 4) & 3
    for j in range(16):
        out[:, 8 + j % 4] |= high[:, j] << (2 * (j // 4))
    return out


def _unscales_q3(packed: np.ndarray) -> np.ndarray:
    """The sixteen signed scales (-32..31) Q3_K's 12 bytes hold."""
    q = packed.astype(np.int64)
    low = np.concatenate([q[:, 0:8] & 0xF, q[:, 0:8] >> 4], axis=1)
    high = np.stack([(q[:, 8 + j % 4] >> (2 * (j // 4))) & 3 for j in range(16)], axis=1)
    return (low | high << 4) - 32


def _requantize(x: np.ndarray, levels: np.ndarray, d: np.ndarray, offset: np.ndarray | None, lo: int, hi: int
                ) -> np.ndarray:
    """Round every weight again with its sub-block's stored scale ``d`` (and min): ``(x + m) / d`` or ``x / d``,
    clipped to [lo, hi]; a sub-block whose stored scale is 0 keeps its fit's levels. x, levels [S, n]; d [S]."""
    with np.errstate(all="ignore"):
        ratio = (x + offset[:, None]) / d[:, None] if offset is not None else x / d[:, None]
    again = np.clip(nearest_int(ratio), lo, hi) - lo
    return np.where((d != 0)[:, None], again, levels)


def _bytes(*parts: np.ndarray) -> np.ndarray:
    """Concatenate a block's fields (each [B, k], uint8 or fp16) into [B, bytes]."""
    return np.concatenate([np.ascontiguousarray(p).view(np.uint8).reshape(p.shape[0], -1) for p in parts], axis=1)


# ---------------------------------------------------------------------------------------------------------------
# The five types: x [B, 256] float32 super-blocks, qw [B, 256] or None -> [B, bytes]


def _block_weights(x: np.ndarray, qw: np.ndarray, two: bool) -> tuple[np.ndarray, np.ndarray]:
    """The importance-weighted path's weights ``qw * sqrt(sigma2 + x²)``, sigma2 = (2 *) mean x² of the block."""
    sumx2 = _seqsum(x * x)
    sigma2 = (F32(2) * sumx2 if two else sumx2) / F32(QK)
    return qw * np.sqrt(sigma2[:, None] + x * x), sigma2


def _q2_k(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    b = x.shape[0]
    xs = x.reshape(-1, 16)
    if qw is None:
        scales, mins, levels = _fit_offset(xs, np.abs(xs), 3, -0.5, 0.1, 15, True, True)
        scales, mins = scales.reshape(b, 16), mins.reshape(b, 16)
        max_scale, max_min = _positive_max(scales), _positive_max(mins)
        with np.errstate(all="ignore"):
            ls = np.where((max_scale > 0)[:, None], nearest_int((F32(15) / max_scale)[:, None] * scales), 0)
            lm = np.where((max_min > 0)[:, None], nearest_int((F32(15) / max_min)[:, None] * mins), 0)
        packed = (ls & 0xFF | lm << 4) & 0xFF
        d, d32 = _fp16(np.where(max_scale > 0, max_scale / F32(15), F32(0)))
        dmin, dmin32 = _fp16(np.where(max_min > 0, max_min / F32(15), F32(0)))
    else:
        weight, _ = _block_weights(x, qw, two=False)
        weight = weight.reshape(-1, 16)
        sw = _seqsum(weight).reshape(b, 16)
        scales, mins, levels = _fit_offset(xs, weight, 3, -0.9, 0.05, 36, False, False)
        dm, ls = _fit_positive(scales.reshape(b, 16), 15, sw)
        mm, lm = _fit_positive(mins.reshape(b, 16), 15, sw)
        packed = (ls | lm << 4) & 0xFF
        (d, d32), (dmin, dmin32) = _fp16(dm), _fp16(mm)
    sub_d = (d32[:, None] * (packed & 0xF).astype(F32)).reshape(-1)
    sub_m = (dmin32[:, None] * (packed >> 4).astype(F32)).reshape(-1)
    levels = _requantize(xs, levels, sub_d, sub_m, 0, 3).reshape(b, QK)
    return _bytes(packed.astype(np.uint8), _pack2(levels).astype(np.uint8), d[:, None], dmin[:, None])


def _q3_k(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    b = x.shape[0]
    xs = x.reshape(-1, 16)
    if qw is None:
        scales, levels = _fit_q3(xs)
        scales = scales.reshape(b, 16)
        max_scale, amax = _first_max_abs(scales)
        some = amax > 0
        with np.errstate(all="ignore"):
            iscale = F32(-32) / np.where(some, max_scale, F32(1))
            q = nearest_int(iscale[:, None] * scales)
        q = np.clip((q + 128 & 0xFF) - 128, -32, 31) + 32  # stored in an int8 first, as the C code does
        packed = np.where(some[:, None], _scales_q3(q), 0)
        with np.errstate(all="ignore"):
            d, d32 = _fp16(np.where(some, F32(1) / iscale, F32(0)))
    else:
        weight, _ = _block_weights(x, qw, two=True)
        weight = weight.reshape(-1, 16)
        sw = _seqsum(weight).reshape(b, 16)
        scales, levels = _fit_symmetric(xs, 4, weight)
        d_block, q = _fit_symmetric(scales.reshape(b, 16), 32, sw)
        packed = _scales_q3(q)
        d, d32 = _fp16(d_block)
    sub_d = (d32[:, None] * _unscales_q3(packed).astype(F32)).reshape(-1)
    levels = _requantize(xs, levels, sub_d, None, -4, 3).reshape(b, QK)
    high = levels > 3
    levels = np.where(high, levels - 4, levels)
    hmask = np.zeros((b, 32), dtype=np.int64)
    for bit in range(8):  # weight 32 * bit + m sets bit ``bit`` of byte m
        hmask |= high[:, 32 * bit:32 * bit + 32].astype(np.int64) << bit
    return _bytes(hmask.astype(np.uint8), _pack2(levels).astype(np.uint8), packed.astype(np.uint8), d[:, None])


def _q45_k(x: np.ndarray, qw: np.ndarray | None, nmax: int) -> tuple[np.ndarray, ...]:
    """Q4_K (nmax 15) and Q5_K (31): fp16 d and dmin, the 12 scale bytes, and the levels [B, 256]."""
    b = x.shape[0]
    xs = x.reshape(-1, 32)
    if qw is None:
        av_x = np.sqrt(_seqsum(xs * xs) / F32(32))
        rmin, nstep = (-1.0, 20) if nmax == 15 else (-0.5, 15)
        scales, mins, levels = _fit_offset(xs, av_x[:, None] + np.abs(xs), nmax, rmin, 0.1, nstep, False, True)
        scales, mins = scales.reshape(b, 8), mins.reshape(b, 8)
        max_scale, max_min = _positive_max(scales), _positive_max(mins)
        with np.errstate(all="ignore"):
            inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
            inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
        ls = np.minimum(63, nearest_int(inv_scale[:, None] * scales) & 0xFF)
        lm = np.minimum(63, nearest_int(inv_min[:, None] * mins) & 0xFF)
        (d, d32), (dmin, dmin32) = _fp16(max_scale / F32(63)), _fp16(max_min / F32(63))
    else:
        weight, _ = _block_weights(x, qw, two=True)
        weight = weight.reshape(-1, 32)
        sw = _seqsum(weight).reshape(b, 8)
        scales, mins, levels = _fit_offset(xs, weight, nmax, -0.9, 0.05, 36, False, False)
        d_block, ls = _fit_positive(scales.reshape(b, 8), 63, sw)
        m_block, lm = _fit_positive(mins.reshape(b, 8), 63, sw)
        if nmax == 31:  # Q5_K clamps what make_qp_quants stored; Q4_K does not
            ls, lm = np.minimum(63, ls), np.minimum(63, lm)
        (d, d32), (dmin, dmin32) = _fp16(d_block), _fp16(m_block)
    packed = _scales_k4(ls, lm)
    sc, mn = _unscales_k4(packed)
    sub_d = (d32[:, None] * sc.astype(F32)).reshape(-1)
    sub_m = (dmin32[:, None] * mn.astype(F32)).reshape(-1)
    levels = _requantize(xs, levels, sub_d, sub_m, 0, nmax).reshape(b, QK)
    return d, dmin, packed, levels


def _q4_k(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    d, dmin, packed, levels = _q45_k(x, qw, 15)
    return _bytes(d[:, None], dmin[:, None], packed.astype(np.uint8), _pack4(levels).astype(np.uint8))


def _q5_k(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    d, dmin, packed, levels = _q45_k(x, qw, 31)
    high = levels.reshape(-1, 4, 2, 32) > 15  # [B, pair h, half, 32]: weight 64h + 32 half + j
    qh = np.zeros((x.shape[0], 32), dtype=np.int64)
    for h in range(4):
        for half in range(2):
            qh |= high[:, h, half].astype(np.int64) << (2 * h + half)
    return _bytes(d[:, None], dmin[:, None], packed.astype(np.uint8), qh.astype(np.uint8),
                  _pack4(levels & 0xF).astype(np.uint8))


def _q6_k(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    b = x.shape[0]
    xs = x.reshape(-1, 16)
    weight = xs * xs if qw is None else qw.reshape(-1, 16)  # the imatrix as it is: no sigma² term for Q6_K
    scales, levels = _fit_symmetric(xs, 32, weight)
    scales = scales.reshape(b, 16)
    max_scale, amax = _first_max_abs(scales)
    zero = amax < EPS
    with np.errstate(all="ignore"):
        iscale = F32(-128) / np.where(zero, F32(1), max_scale)
        d, d32 = _fp16(np.where(zero, F32(0), F32(1) / iscale))
        sc = np.where(zero[:, None], 0, np.minimum(127, nearest_int(iscale[:, None] * scales)))
    sc = (sc + 128 & 0xFF) - 128
    sub_d = (d32[:, None] * sc.astype(F32)).reshape(-1)
    levels = _requantize(xs, levels, sub_d, None, -32, 31).reshape(b, 2, 4, 32)  # weight 128h + 32k + l
    levels = np.where(zero[:, None, None, None], 0, levels)
    ql = np.concatenate([levels[:, :, 0] & 0xF | (levels[:, :, 2] & 0xF) << 4,
                         levels[:, :, 1] & 0xF | (levels[:, :, 3] & 0xF) << 4], axis=2).reshape(b, 128)
    qh = (levels[:, :, 0] >> 4 | (levels[:, :, 1] >> 4) << 2 | (levels[:, :, 2] >> 4) << 4
          | (levels[:, :, 3] >> 4) << 6).reshape(b, 64)
    return _bytes(ql.astype(np.uint8), qh.astype(np.uint8), sc.astype(np.int8), d[:, None])


_QUANTIZERS = {"q2_k": _q2_k, "q3_k": _q3_k, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}


def _legacy(rows: np.ndarray, key: str, importance: np.ndarray) -> np.ndarray:
    """Q4_0, Q4_1, Q5_0, Q5_1 with an importance matrix (ggml's ``quantize_row_q4_0_impl`` ...): blocks of 32, each
    fit by the K-quants' searches with weights ``qw * sqrt(sigma2 + x²)`` (sigma2 the mean x² of the whole row), the
    fit's scale (and min) stored in fp16 and its levels as they are (no second rounding)."""
    n_rows, width = rows.shape
    sigma2 = _seqsum(rows * rows) / F32(width)
    qw = np.broadcast_to(importance, rows.shape)
    x = rows.reshape(-1, 32)
    weight = (qw * np.sqrt(sigma2[:, None] + rows * rows)).reshape(-1, 32)
    if key in ("q4_0", "q5_0"):
        scale, levels = _fit_symmetric(x, 8 if key == "q4_0" else 16, weight)
        head = [_fp16(scale)[0][:, None]]
    else:
        scale, the_min, levels = _fit_offset(x, weight, 15 if key == "q4_1" else 31, -0.9, 0.05, 36, False, False)
        head = [_fp16(scale)[0][:, None], _fp16(-the_min)[0][:, None]]
    low = (levels[:, :16] & 0xF | (levels[:, 16:] & 0xF) << 4).astype(np.uint8)
    if key in ("q5_0", "q5_1"):
        bits = np.concatenate([levels[:, :16] >> 4, levels[:, 16:] >> 4], axis=1).astype(np.uint32)  # bit j: weight j
        head.append((bits << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32).astype("<u4")[:, None])
    return _bytes(*head, low).reshape(n_rows, -1)


def quantize_legacy(values: np.ndarray, ggml_type: str, importance: np.ndarray) -> np.ndarray:
    """Rows in Q4_0, Q4_1, Q5_0 or Q5_1 as ``llama-quantize --imatrix`` stores them: ``uint8 [rows, bytes per row]``.

    Without an importance matrix llama.cpp stores these types by its reference rounding (gguf-py's
    quantizers: :func:`interp.quant.llama_cpp.quantize_blocks`); Q8_0 ignores the matrix.

    Raises:
        SpecError: another type, a width that is not a multiple of 32, or an importance that does not fit.
    """
    key = str(ggml_type).strip().lower()
    if key not in ("q4_0", "q4_1", "q5_0", "q5_1"):
        raise SpecError(f"{ggml_type!r} has no importance-weighted rounding here; use q4_0, q4_1, q5_0 or q5_1")
    rows, qw = _checked(values, key, importance, 32)
    if qw is None:
        raise SpecError(f"{key} without an importance matrix is gguf-py's reference rounding: use "
                        "interp.quant.llama_cpp.quantize_blocks")
    return _legacy(rows, key, qw)


def _check_type(ggml_type: str) -> str:
    key = str(ggml_type).strip().lower()
    if key not in _QUANTIZERS:
        raise SpecError(f"{ggml_type!r} is not a K-quant type; use one of {', '.join(KQUANT_TYPES)}")
    return key


def quantize(values: np.ndarray, ggml_type: str, importance: np.ndarray | None = None) -> np.ndarray:
    """Float rows ``[rows, width]`` as the blocks ``llama-quantize`` stores: ``uint8 [rows, bytes per row]``.

    Args:
        values: the rows (GGUF order: one row per output, ``width`` = the input width ``ne[0]``);
            converted to float32 as llama.cpp's F32 source holds them.
        ggml_type: one of :data:`KQUANT_TYPES`.
        importance: ``[width]`` per-input-channel importance, exactly what ``llama-quantize
            --imatrix`` passes for this tensor (:func:`llama_importance`); None quantizes as
            llama-quantize does without an importance matrix.

    Raises:
        SpecError: an unknown type, a width that is not a multiple of 256, an importance of
            another width, or values or importance that are not finite.
    """
    key = _check_type(ggml_type)
    rows, qw = _checked(values, key, importance, QK)
    if qw is not None:
        per_row = rows.shape[1] // QK
        qw = np.broadcast_to(qw.reshape(1, per_row, QK), (rows.shape[0], per_row, QK)).reshape(-1, QK)
    blocks = _QUANTIZERS[key](rows.reshape(-1, QK), qw)
    return blocks.reshape(rows.shape[0], -1)


def _checked(values: np.ndarray, key: str, importance: np.ndarray | None, block: int
             ) -> tuple[np.ndarray, np.ndarray | None]:
    """Rows as contiguous float32 ``[rows, width]`` and the importance as float32 ``[width]`` (SpecError if unfit)."""
    rows = np.asarray(values, dtype=F32)
    if rows.ndim == 1:
        rows = rows[None]
    if rows.ndim != 2 or rows.shape[1] % block or rows.shape[1] == 0:
        raise SpecError(f"{key} stores rows in blocks of {block} weights; rows of shape {tuple(np.shape(values))} do "
                        "not split into them")
    if not np.isfinite(rows).all():
        raise SpecError(f"the weights to store as {key} hold NaN or infinite values")
    if importance is None:
        return np.ascontiguousarray(rows), None
    qw = np.asarray(importance, dtype=F32).reshape(-1)
    if qw.size != rows.shape[1]:
        raise SpecError(f"the importance has {qw.size} values; the rows have {rows.shape[1]} input channels")
    if not np.isfinite(qw).all():
        raise SpecError("the importance holds NaN or infinite values (llama-quantize refuses such an imatrix)")
    return np.ascontiguousarray(rows), qw


def dequantize(blocks: np.ndarray, ggml_type: str) -> np.ndarray:
    """The float32 weights ``[rows, width]`` llama.cpp computes with from stored blocks (gguf-py's dequantization)."""
    import gguf

    key = _check_type(ggml_type)
    data = np.ascontiguousarray(blocks, dtype=np.uint8)
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[key.upper()]).astype(F32, copy=False)


def llama_importance(matrix: Any, name: str) -> np.ndarray:
    """The per-channel importance ``llama-quantize --imatrix`` passes for tensor ``name`` of an
    :class:`~interp.quant.imatrix.ImportanceMatrix`: the float32 sums over the float32 token count
    (llama.cpp's ``load_imatrix``; a count of 0 gives ones), from the float32 values the file stores.

    Raises:
        SpecError: ``name`` is not in the matrix.
    """
    sums, counts = matrix.sums, matrix.counts
    if name not in sums:
        raise SpecError(f"the importance matrix has no entry for {name} (it has {len(sums)} entries, e.g. "
                        f"{next(iter(sums), '')})")
    stored = np.asarray(sums[name], dtype=F32)
    count = F32(counts[name])
    return stored / count if count > 0 else np.ones_like(stored)
