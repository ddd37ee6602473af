"""Checks of plain argument values: counts, lengths, layer lists, names, indices, seeds, devices, tensors.

Python quietly turns ``True`` into 1, ``0.5`` into layer 0 and ``"01"`` into layers 0 and 1.
These helpers accept only what the argument means (an integer that is not a bool, a
non-empty list of integer layer indices) and raise an :class:`~interp.errors.InterpError`
subclass that says what to pass instead. :func:`interp.validate.checked` applies them to a public
function's arguments by name and annotation; every name here is importable from :mod:`interp.validate`
too. This is a base module: it imports only :mod:`interp.errors` (and numbers), so every layer of the
package may use it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

from interp.errors import ComponentError, DataError, InterpError, NonFiniteError


def is_integer(value: Any) -> bool:
    """True for ints (Python, NumPy, 0-d integer tensors via ``__index__``), False for bools and floats."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return False
    if isinstance(value, numbers.Integral):
        return True
    is_tensor = type(value).__name__ == "Tensor" and getattr(value, "ndim", None) == 0
    return is_tensor and not value.is_floating_point() and not value.is_complex() and str(value.dtype) != "torch.bool"


def integer(value: Any, name: str, minimum: int | None = None, error: type[InterpError] = InterpError) -> int:
    """``value`` as an int, refusing bools, floats and strings (and values below ``minimum``).

    Example:
        >>> integer(8, "batch_size", minimum=1)
        8
        >>> integer(True, "n")
        Traceback (most recent call last):
        ...
        interp.errors.InterpError: n must be an integer, got True (bool). Pass a whole number such as 8.
    """
    if not is_integer(value):
        raise error(f"{name} must be an integer, got {_shown(value)} ({type(value).__name__}). "
                    "Pass a whole number such as 8.")
    number = int(value)
    if minimum is not None and number < minimum:
        raise error(f"{name} must be at least {minimum}, got {number}.")
    if abs(number) >= 2**63:  # torch and numpy hold 64-bit integers: beyond them it is an OverflowError
        raise error(f"{name} must fit in 64 bits, got {number:.3g}.")
    return number


def count(value: Any, name: str, minimum: int = 1) -> int:
    """A positive count of examples or tokens (``n``, ``seq_len``).

    Bad values raise :class:`interp.errors.DataError`.
    """
    return integer(value, name, minimum=minimum, error=DataError)


def batch_size(value: Any) -> int:
    """A batch size: an integer >= 1."""
    return integer(value, "batch_size", minimum=1)


def layer_indices(layers: Any, n_layers: int) -> list[int]:
    """Validated layer indices in ``[0, n_layers)``; negative indices count from the end.

    Args:
        layers: ``None`` (all layers), one integer, or an iterable of integers (a list,
            tuple, range or integer tensor). Bools, floats, strings and an empty
            selection are refused.
        n_layers: the model's number of layers.

    Raises:
        ComponentError: naming the offending value and the valid range.

    Example:
        >>> layer_indices([0, -1], 4)
        [0, 3]
    """
    if layers is None:
        return list(range(n_layers))
    if isinstance(layers, (str, bytes)):
        raise ComponentError(f"layers must be integer layer indices such as [0, {n_layers - 1}], got the string "
                             f"{layers!r}.")
    if is_integer(layers):
        layers = [layers]
    elif type(layers).__name__ == "Tensor" and getattr(layers, "ndim", 0) == 1:
        layers = list(layers)
    if not isinstance(layers, Iterable):
        raise ComponentError(f"layers must be a list of layer indices, got {type(layers).__name__}.")
    out = []
    for layer in layers:
        if not is_integer(layer):
            raise ComponentError(f"Layer {layer!r} ({type(layer).__name__}) is not an integer layer index; "
                                 f"this model has layers 0..{n_layers - 1}.")
        index = int(layer)
        if not -n_layers <= index < n_layers:
            raise ComponentError(f"Layer {index} is out of range: this model has layers 0..{n_layers - 1}.")
        out.append(index % n_layers)
    if not out:
        raise ComponentError(f"The layer selection is empty; pass at least one layer in 0..{n_layers - 1}, "
                             "or None for all layers.")
    repeated = next((layer for i, layer in enumerate(out) if layer in out[:i]), None)
    if repeated is not None:  # measured twice, a layer would fill one row and leave its twin NaN or zero
        raise ComponentError(f"Layer {repeated} is selected twice (negative indices count from the end, so -1 is "
                             f"layer {n_layers - 1}); give each layer once.")
    return out


def names(value: Any, what: str, valid: Iterable[str] | None = None, error: type[InterpError] = ComponentError
          ) -> list[str]:
    """A non-empty list of names (components, reducers, stages, ...); one string counts as one name.

    Args:
        value: a string or an iterable of strings.
        what: the argument's name, for the message (``"reducers"``).
        valid: when given, every name must be one of these (the message lists them).
        error: the :class:`~interp.errors.InterpError` subclass to raise.

    Example:
        >>> names("norm", "reducers")
        ['norm']
        >>> names([], "reducers", valid=["norm", "mean"])
        Traceback (most recent call last):
        ...
        interp.errors.ComponentError: reducers is empty: give at least one, e.g. ['norm']. Valid reducers: norm, mean.
    """
    choices = list(valid) if valid is not None else None
    listed = f" Valid {what}: {', '.join(choices)}." if choices else ""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Iterable) or isinstance(value, (bytes, dict)):
        raise error(f"{what} must be a list of names, got {type(value).__name__}.{listed}")
    out = list(value)
    if not out:
        example = f" e.g. [{choices[0]!r}]." if choices else "."
        raise error(f"{what} is empty: give at least one,{example}{listed}")
    for name in out:
        if not isinstance(name, str):
            raise error(f"{what} must hold names (strings), got {_shown(name)} ({type(name).__name__}).{listed}")
        if choices is not None and name not in choices:
            raise error(f"Unknown {what[:-1] if what.endswith('s') else what} {name!r}.{listed}")
    return out



SEED_LIMIT = 2**63


def _kind(value: Any) -> str:
    return type(value).__name__


def _is_tensor(value: Any) -> bool:
    return any(cls.__name__ == "Tensor" and cls.__module__.startswith("torch") for cls in type(value).__mro__)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool) or _kind(value) == "bool_"


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not _is_bool(value)


def finite_number(value: Any, name: str, low: float | None = None, high: float | None = None,
                  open_low: bool = False, open_high: bool = False) -> float:
    """``value`` as a finite float (ints welcome), refusing bools, strings, NaN, inf and values out of bounds.

    Example:
        >>> finite_number(0.1, "top", 0, 1, open_low=True)
        0.1
        >>> finite_number(float("nan"), "alpha")
        Traceback (most recent call last):
        ...
        interp.errors.InterpError: alpha must be a finite number, got nan.
    """
    if not _is_real(value):
        raise InterpError(f"{name} must be a number, got {_shown(value)} ({_kind(value)}).")
    number = float(value)
    if not math.isfinite(number):
        raise InterpError(f"{name} must be a finite number, got {number}.")
    below = low is not None and (number <= low if open_low else number < low)
    above = high is not None and (number >= high if open_high else number > high)
    if below or above:
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        span = f"{'(' if open_low else '['}{lo}, {hi}{')' if open_high else ']'}"
        raise InterpError(f"{name} must lie in {span}, got {number:g}.")
    return number


def seed(value: Any, name: str = "seed", error: type[InterpError] = DataError) -> int:
    """A random seed: an integer in [0, 2**63) (what torch and NumPy generators take).

    Example:
        >>> seed(2**64)
        Traceback (most recent call last):
        ...
        interp.errors.DataError: seed must lie in [0, 2**63), got 18446744073709551616. Pass a smaller seed such as 0.
    """
    if is_integer(value) and not 0 <= int(value) < SEED_LIMIT:  # before integer(), whose 64-bit message is vaguer
        raise error(f"{name} must lie in [0, 2**63), got {int(value)}. Pass a smaller seed such as 0.")
    return integer(value, name, error=error)


def index(value: Any, name: str, size: int, what: str, negative: bool = False,
          error: type[InterpError] = ComponentError) -> int:
    """An integer index into ``size`` things (``what`` names them for the message); negatives only when allowed.

    Example:
        >>> index(3, "head", 4, "heads")
        3
        >>> index(0.5, "head", 4, "heads")
        Traceback (most recent call last):
        ...
        interp.errors.ComponentError: head must be an integer, got 0.5 (float). Pass a whole number such as 8.
    """
    number = integer(value, name, error=error)
    low = -size if negative else 0
    if not low <= number < size:
        valid = f"0..{size - 1}" + (f" (or -{size}..-1 from the end)" if negative else "")
        raise error(f"{name} {number} is out of range: there are {size} {what}, valid {valid}.")
    return number


def indices(values: Any, name: str, size: int | None, what: str, negative: bool = False,
            error: type[InterpError] = ComponentError) -> list[int]:
    """A non-empty list of distinct integer indices (one integer counts as a list of one).

    Duplicates are refused (after negatives are read from the end): a layer given twice would
    be measured twice and counted twice.

    Example:
        >>> indices([0, -1], "layers", 4, "layers", negative=True)
        [0, -1]
        >>> indices([1, 1], "heads", 4, "heads")
        Traceback (most recent call last):
        ...
        interp.errors.ComponentError: heads holds 1 twice; give each of the heads once.
    """
    if is_integer(values):
        values = [values]
    elif _is_tensor(values) and getattr(values, "ndim", 0) == 1:
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable) or isinstance(values, dict):
        raise error(f"{name} must be a list of integer indices such as [0, 1], got {_shown(values)} ({_kind(values)}).")
    out = list(values)
    if not out:
        raise error(f"{name} is empty; give at least one index.")
    seen: set[int] = set()
    for value in out:
        number = index(value, name, size, what, negative, error) if size is not None else integer(value, name,
                                                                                                    error=error)
        key = number % size if size else number
        if key in seen:
            raise error(f"{name} holds {number} twice; give each of the {what} once.")
        seen.add(key)
    return out


def device(value: Any, name: str = "device") -> str:
    """A torch device name that holds data: ``"meta"`` (no data) and unparseable names are refused."""
    if _kind(value) == "device":
        value = str(value)
    if not isinstance(value, str):
        raise InterpError(f"{name} must be a device name such as 'cpu' or 'cuda', "
                          f"got {_shown(value)} ({_kind(value)}).")
    import torch

    try:
        parsed = torch.device(value)
    except (RuntimeError, ValueError):
        raise InterpError(f"{name} {value!r} is not a device; use 'cpu', 'cuda' or 'cuda:0'.") from None
    if parsed.type == "meta":
        raise InterpError(f"{name} 'meta' holds no data, so nothing can be computed on it; use 'cpu' or 'cuda'.")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise InterpError(f"{name} {value!r}: this machine has no CUDA device; use 'cpu'.")
    return value


def tensor(value: Any, name: str) -> Any:
    """A non-empty torch tensor, finite when it holds floats."""
    if not _is_tensor(value):
        raise InterpError(f"{name} must be a torch tensor, got {_kind(value)}.")
    if value.numel() == 0:
        raise InterpError(f"{name} is empty (shape {tuple(value.shape)}); give a tensor with at least one entry.")
    if value.is_floating_point() and value.device.type != "meta" and not bool(value.isfinite().all()):
        raise NonFiniteError(f"{name} holds NaN or inf; pass finite values.")
    return value



def _shown(value: Any) -> str:
    """``repr(value)`` on one line and at most 60 characters (a tensor's repr spans lines)."""
    if _is_tensor(value) and getattr(value, "ndim", 0) > 0:
        return f"a tensor of shape {list(value.shape)}"
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."
