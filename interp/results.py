"""Every numeric result is finite and meaningful, or refused: the one check result types run when they are made.

A result class mixes in :class:`CheckedResult`; its dataclass constructor then calls
:func:`check_result`, which walks every field (tensors, NumPy arrays, DataFrames, numbers, and the
lists, tuples and dicts that hold them) and raises :class:`~interp.errors.NonFiniteError` naming the
class and the field where NaN or inf sits. A field the class names in ``ranked`` holds scores whose
last axis is ranked (logits read by ``argmax`` or ``topk``): a row whose values are all equal ranks
nothing, so it is refused too, and a class whose ranking lives elsewhere says so in
``meaningless()``. A field the class names in ``allow_nan`` (or entries of it, ``"field[GLOB]"``: the keys of a
dict or the columns of a DataFrame that match) may hold NaN where NaN is a documented value, not a failure: an
undefined correlation (a constant vector, fewer than 3 pairs, no bootstrap; :func:`interp.stats.correlation`) or
a padded position of a ``full`` capture. inf is refused there too. A bare tensor result
(:func:`interp.steering_vector`) goes through :func:`check_values`, the same walk.

Questions that have no answer are refused before any model runs, in the same words everywhere:
:func:`distinct_answers` (a logit difference of a token with itself is zero whatever the model does).

Example:
    >>> import torch
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Scores(CheckedResult):
    ...     ranked = ("logits",)
    ...     logits: torch.Tensor
    >>> Scores(torch.tensor([[0.0, 1.0]])).logits.shape
    torch.Size([1, 2])
    >>> Scores(torch.tensor([[0.0, float("nan")]]))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    interp.errors.NonFiniteError: Scores.logits holds NaN or inf (tensor (1, 2), at [0, 1]): ...
    >>> Scores(torch.tensor([[2.0, 2.0]]))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    interp.errors.NonFiniteError: Scores.logits has rows [0] whose 2 values are all equal: ...
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch

from interp.errors import DataError, NonFiniteError

__all__ = ["CheckedResult", "check_result", "check_values", "distinct_answers", "non_finite"]

_DEPTH = 6  # nesting followed into lists and dicts (settings hold dicts of lists)
_ITEMS = 10_000  # items of one list or dict looked at (a result's lists are per layer, example or token)


class CheckedResult:
    """Mixin for result dataclasses: the constructor refuses NaN, inf and all-equal ranked rows (:func:`check_result`).

    Attributes:
        ranked: names of fields whose last axis is ranked (logits): a row of equal values is refused.
        allow_nan: fields, or entries ``"field[GLOB]"`` of a dict field or DataFrame (keys or columns matching
            the glob), where NaN is a documented value (an undefined correlation, a padded position); inf is
            still refused there. Each class says why next to its list.
    """

    ranked: ClassVar[tuple[str, ...]] = ()
    allow_nan: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        check_result(self)

    def meaningless(self) -> str | None:
        """Why this result is not a measurement although finite (a class's own rule), or None."""
        return None


_LEAF = object()  # what _leaf returns for a value that holds other values (followed by non_finite)


def _leaf(value: Any, nan_ok: bool = False) -> Any:
    """Where a tensor, array, frame or number holds NaN or inf (only inf with ``nan_ok``; None: it does not);
    ``_LEAF`` for a container."""
    kind = type(value).__name__
    if kind in ("Tensor", "Parameter") and hasattr(value, "is_floating_point"):
        if value.device.type == "meta" or value.numel() == 0 or not (value.is_floating_point() or value.is_complex()):
            return None
        bad = value.detach().isinf() if nan_ok else ~value.detach().isfinite()
        return f"tensor {tuple(value.shape)}, at {bad.nonzero()[0].tolist()}" if bool(bad.any()) else None
    if isinstance(value, (bool, int)):
        return None
    if isinstance(value, float) or kind in ("float64", "float32", "float16"):
        number = float(value)
        return None if math.isfinite(number) or (nan_ok and math.isnan(number)) else repr(number)
    if kind == "ndarray":
        import numpy as np

        if value.dtype.kind not in "fc" or value.size == 0:
            return None
        wrong = np.isinf(value) if nan_ok else ~np.isfinite(value)
        return f"array {value.shape}, at {[int(i) for i in np.argwhere(wrong)[0]]}" if wrong.any() else None
    if kind in ("DataFrame", "Series"):
        numeric = value.select_dtypes("number") if kind == "DataFrame" else value
        if kind == "Series" and value.dtype.kind not in "fc":
            return None
        inner = _leaf(numeric.to_numpy(dtype=float), nan_ok)
        return None if inner is None else f"{kind} {inner}"
    return _LEAF


def non_finite(value: Any, depth: int = 0, nan_ok: bool = False) -> str | None:
    """Where ``value`` holds NaN or inf (a short description), or None when all of it is finite; with ``nan_ok``,
    where it holds inf (NaN passes).

    Example:
        >>> import numpy as np
        >>> non_finite({"a": [1.0, 2.0]}), non_finite({"a": [1.0, np.inf]}), non_finite([np.nan], nan_ok=True)
        (None, "['a'][1]: inf", None)
    """
    if depth > _DEPTH:
        return None
    leaf = _leaf(value, nan_ok)
    if leaf is not _LEAF:
        return leaf
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f".{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif isinstance(value, dict):
        items = [(f"[{k!r}]", v) for k, v in list(value.items())[:_ITEMS]]
    elif isinstance(value, (list, tuple)):
        items = [(f"[{i}]", v) for i, v in enumerate(value[:_ITEMS])]
    else:
        return None
    for key, item in items:
        where = non_finite(item, depth + 1, nan_ok)
        if where is not None:
            return f"{key}{'' if where.startswith(('[', '.')) else ': '}{where}"
    return None


def check_values(value: Any, what: str) -> Any:
    """``value`` (a bare tensor result) when it holds no NaN or inf: :func:`check_result` on it, named ``what``.

    Example:
        >>> import torch
        >>> check_values(torch.ones(2), "the steering vector").tolist()
        [1.0, 1.0]
    """
    check_result(value, what)
    return value


def _equal_rows(tensor: Any) -> list[int]:
    """Indices of the rows (over the last axis, leading axes flattened) whose values are all equal."""
    if tensor.ndim == 0 or tensor.shape[-1] < 2 or tensor.numel() == 0:
        return []
    rows = tensor.detach().reshape(-1, tensor.shape[-1])
    return [int(i) for i in (rows.amax(-1) == rows.amin(-1)).nonzero().flatten().tolist()]


def check_result(result: Any, what: str | None = None) -> None:
    """The one check every result goes through: :class:`CheckedResult` constructors call it on themselves, and
    :func:`check_values` on a bare tensor. No NaN or inf in any field, no ranked row of equal values, and the
    class's own :meth:`CheckedResult.meaningless` rule.

    Raises:
        NonFiniteError: naming the class (or ``what``), the field and where.
    """
    if not (dataclasses.is_dataclass(result) and not isinstance(result, type)):
        where = non_finite(result)
        if where is not None:
            raise NonFiniteError(f"{what or type(result).__name__} holds NaN or inf ({where}): it is not a "
                                 "measurement, so interp does not return it. The model's weights or inputs overflow; "
                                 "check them (interp.nll names the rows where NaN appears).")
        return
    name = what or type(result).__name__
    allowed = getattr(result, "allow_nan", ())
    for f in dataclasses.fields(result):
        where = _field_non_finite(getattr(result, f.name), f.name, allowed)
        if where is not None:
            raise NonFiniteError(f"{name}.{f.name} holds NaN or inf ({where}): it is not a measurement, so interp "
                                 "does not return it. The model's weights or inputs overflow; check them (interp.nll "
                                 "names the rows where NaN appears).")
    for field_name in getattr(result, "ranked", ()):
        value = getattr(result, field_name, None)
        if value is None or not hasattr(value, "reshape"):
            continue
        equal = _equal_rows(value)
        if equal:
            shown = equal[:8] + (["..."] if len(equal) > 8 else [])
            raise NonFiniteError(f"{name}.{field_name} has rows {shown} whose {value.shape[-1]} values are all equal: "
                                 "the ranking read from them (argmax, top-k) is arbitrary, not the model's. The "
                                 "model's final norm or head returns constants (its weights overflow or are zero).")
    rule = getattr(result, "meaningless", None)
    why = rule() if callable(rule) else None
    if why:
        raise NonFiniteError(f"{name}: {why}")


def _field_non_finite(value: Any, name: str, allowed: Any) -> str | None:
    """:func:`non_finite` of one field, NaN passing where ``allowed`` (a class's ``allow_nan``) names the field or,
    as ``"name[GLOB]"``, the keys of a dict field or the columns of a DataFrame field that match."""
    if name in allowed:
        return non_finite(value, nan_ok=True)
    globs = [entry[len(name) + 1 : -1] for entry in allowed if entry.startswith(f"{name}[") and entry.endswith("]")]
    if not globs:
        return non_finite(value)
    import fnmatch

    def nan_ok(key: Any) -> bool:
        return any(fnmatch.fnmatchcase(str(key), glob) for glob in globs)

    if isinstance(value, dict):
        items = list(value.items())[:_ITEMS]
        for key, item in items:
            where = non_finite(item, 1, nan_ok(key))
            if where is not None:
                return f"[{key!r}]{'' if where.startswith(('[', '.')) else ': '}{where}"
        return None
    if type(value).__name__ == "DataFrame":
        for column in value.columns:
            if value[column].dtype.kind in "fc":
                where = _leaf(value[column].to_numpy(dtype=float), nan_ok(column))
                if where is not None:
                    return f"[{column!r}]: {where}"
        return None
    return non_finite(value)


def distinct_answers(answers: Any, wrongs: Any, ids: Any = None) -> None:
    """Refuse a logit difference of a token with itself: ``answer == wrong`` gives 0 whatever the model does.

    ``answers`` and ``wrongs`` hold one token id, or one per row (broadcast against each other).

    Example:
        >>> import torch
        >>> distinct_answers(torch.tensor([5, 6]), torch.tensor([6, 6]), ["a", "b"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        interp.errors.DataError: The answer and the wrong answer are the same token (id 6) for row 'b': ...
    """
    import torch

    # host: a check on the user's ids, compared on the host
    a = torch.as_tensor(answers).reshape(-1).cpu()
    w = torch.as_tensor(wrongs).reshape(-1).cpu()  # host: as above
    if a.numel() == 0 or w.numel() == 0 or (a.numel() != w.numel() and 1 not in (a.numel(), w.numel())):
        return  # the shapes are the per-row checks' to refuse
    a, w = torch.broadcast_tensors(a, w)
    same = (a == w).nonzero().flatten().tolist()
    if same:
        row = same[0]
        label = repr(list(ids)[row]) if ids is not None and row < len(list(ids)) else str(row)
        more = f" (and {len(same) - 1} more rows)" if len(same) > 1 else ""
        raise DataError(f"The answer and the wrong answer are the same token (id {int(a[row])}) for row {label}{more}: "
                        "their logit difference is 0 whatever the model computes. Pass a different wrong answer.")


def row_sum_tolerance(pattern: torch.Tensor) -> float:
    """How far from 1 a row of a valid pattern may sum, from float rounding alone.

    Rounding each entry of a probability row to the pattern's dtype moves the row sum by at
    most ``eps(dtype) / 2`` (relative errors of non-negative entries add up to at most that);
    the softmax that made the row normalises by a sum of ``K`` terms, and the check itself
    sums ``K`` terms, each adding at most ``K * eps(work) / 2`` with ``work`` the dtype the
    sums run in (float32 for half precision). So the bound is
    ``eps(dtype) + K * eps(work)``: 1.3e-6 for 5 keys in float32, 2.4e-4 for 2048 keys,
    about 1e-13 for 512 keys in float64. A row off by more was not a softmax output.
    """
    # half precision is summed in float32 (as the metrics do), other dtypes in their own
    work = torch.float32 if pattern.dtype in (torch.float16, torch.bfloat16) else pattern.dtype
    return float(torch.finfo(pattern.dtype).eps + pattern.shape[-1] * torch.finfo(work).eps)
