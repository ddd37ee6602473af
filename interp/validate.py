"""Checks of plain arguments at the library's boundary: counts, lengths, layer lists.

Python quietly turns ``True`` into 1, ``0.5`` into layer 0 and ``"01"`` into layers 0 and 1.
These helpers accept only what the argument means (an integer that is not a bool, a
non-empty list of integer layer indices) and raise an :class:`~interp.errors.InterpError`
subclass that says what to pass instead. This is a base module: it imports only
:mod:`interp.errors` (and numbers), so every layer of the package may use it.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

from interp.errors import ComponentError, DataError, InterpError


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
        raise error(f"{name} must be an integer, got {value!r} ({type(value).__name__}). "
                    "Pass a whole number such as 8.")
    number = int(value)
    if minimum is not None and number < minimum:
        raise error(f"{name} must be at least {minimum}, got {number}.")
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
            raise error(f"{what} must hold names (strings), got {name!r} ({type(name).__name__}).{listed}")
        if choices is not None and name not in choices:
            raise error(f"Unknown {what[:-1] if what.endswith('s') else what} {name!r}.{listed}")
    return out
