"""What a persisted object's file must hold: the one schema check every ``.load`` runs before it builds anything.

A saved :class:`~interp.localize.tuned_lens.TunedLens`, :class:`~interp.probes.ProbeResult`,
:class:`~interp.report.confirm.Preregistration` or :class:`~interp.quant.sensitivity.Sensitivity`
is read back from JSON (and tensors). A file edited by hand, truncated, or written by something
else may lack a key or hold the wrong kind of value; without a check that surfaces as a
``KeyError`` or ``TypeError`` deep inside, or worse, as an object that works until much later.
:func:`conform` checks a record against a schema, ``{key: kind}`` with the kinds written as
annotations are (``"int"``, ``"float"``, ``"str"``, ``"bool"``, ``"dict"``, ``"list[int]"``,
``"tuple[str, ...]"``...), and raises the caller's :class:`~interp.errors.InterpError` subclass
naming the file, the key and what it should hold.

Example:
    >>> conform({"layers": [0, 1], "ids": ["a"]}, {"layers": "list[int]", "ids": "list[str]"}, "probe.json")
    {'layers': [0, 1], 'ids': ['a']}
    >>> conform({"layers": [0, 1.5]}, {"layers": "list[int]", "ids": "list[str]"}, "probe.json")
    Traceback (most recent call last):
    ...
    interp.errors.DataError: probe.json: "layers" must be a list of integers, got [0, 1.5]; "ids" is missing. \
It was not written by interp, or was edited or truncated: write it again.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from typing import Any

from interp.errors import DataError, InterpError

__all__ = ["conform", "fits", "schema_of"]

_WORDS = {"int": "an integer", "float": "a finite number", "str": "a string", "bool": "true or false",
          "dict": "an object (a mapping)", "Any": "anything"}


def _scalar(value: Any, kind: str) -> bool:
    if kind == "Any":
        return True
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
    if kind == "str":
        return isinstance(value, str)
    if kind in ("dict", "Mapping") or kind.startswith(("dict[", "Mapping[")):
        return isinstance(value, Mapping)
    raise InterpError(f"interp.schema has no kind {kind!r}")  # a programming error in a schema, not a user's


_SEQUENCE = re.compile(r"^(?:list|tuple|Sequence)\[([A-Za-z]+)(?:, \.\.\.)?\]$")


def fits(value: Any, kind: str) -> bool:
    """Whether ``value`` (as JSON gives it back) is of ``kind``; ``"X | None"`` admits None.

    Example:
        >>> fits([1, 2], "tuple[int, ...]"), fits([1, True], "list[int]"), fits(None, "str | None")
        (True, False, True)
    """
    alternatives = [k.strip() for k in kind.split("|")]
    if "None" in alternatives and value is None:
        return True
    for alternative in (k for k in alternatives if k != "None"):
        match = _SEQUENCE.match(alternative)
        if match:
            if isinstance(value, (list, tuple)) and all(_scalar(v, match.group(1)) for v in value):
                return True
        elif _scalar(value, alternative):
            return True
    return False


def _words(kind: str) -> str:
    out = []
    for alternative in (k.strip() for k in kind.split("|")):
        match = _SEQUENCE.match(alternative)
        if alternative == "None":
            out.append("null")
        elif match:
            item = _WORDS.get(match.group(1), match.group(1))
            out.append("a list of " + {"an integer": "integers", "a string": "strings",
                                       "a finite number": "finite numbers"}.get(item, item))
        else:
            out.append(_WORDS.get(alternative, alternative))
    return " or ".join(out)


def _shown(value: Any) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 50 else text[:47] + "..."


def conform(record: Any, schema: Mapping[str, str], what: str, error: type[InterpError] = DataError,
            optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """``record`` when it is a mapping holding every key of ``schema`` (bar ``optional`` ones) with a value of its
    kind; else ``error`` naming ``what`` (the file), every wrong or missing key, and what it should hold."""
    if not isinstance(record, Mapping):
        raise error(f"{what} must hold a JSON object with {', '.join(schema)}; got {type(record).__name__}. It was "
                    "not written by interp, or was edited or truncated: write it again.")
    problems = []
    for key, kind in schema.items():
        if key not in record:
            if key not in optional:
                problems.append(f'"{key}" is missing')
        elif not fits(record[key], kind):
            problems.append(f'"{key}" must be {_words(kind)}, got {_shown(record[key])}')
    if problems:
        raise error(f"{what}: {'; '.join(problems)}. It was not written by interp, or was edited or truncated: "
                    "write it again.")
    return dict(record)


def schema_of(cls: type, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """A dataclass's fields as a schema, from its annotations (``tuple[int, ...]``, ``str``, ``float``...).

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Plan:
        ...     name: str
        ...     seeds: tuple[int, ...]
        >>> schema_of(Plan)
        {'name': 'str', 'seeds': 'tuple[int, ...]'}
    """
    fields = getattr(cls, "__dataclass_fields__", {})
    return {name: str(f.type) if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            for name, f in fields.items() if name not in skip}
