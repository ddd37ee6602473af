"""Method specs: the short strings that name a weight quantizer and its settings.

A spec is ``method:key=value,key=value``, for example ``gptq:bits=3,group=64`` or
``nf:bits=4``. The CLI and the API accept the same strings, and results record the
canonical form, in which every option is written out with its value (defaults
included) in a fixed order::

    >>> str(parse_spec("gptq:bits=3"))
    'gptq:bits=3,group=64,damp=0.01,act_order=1,block=128'
    >>> parse_spec("rtn:group=32,bits=4") == parse_spec("rtn:bits=4,group=32,zero=float")
    True

``bits`` is required; ``group`` (the number of consecutive input-dimension weights
that share one scale) defaults to 64. The other options depend on the method:

=======  ===========  ===========================================================
method   bits         options (default first)
=======  ===========  ===========================================================
rtn      2-8          ``zero=float|int`` (float or integer zero-point)
nf       3, 4         none
hqq      2-6, 8       ``optimize=1|0`` (the hqq package has no 7-bit mode)
gptq     2-8          ``damp=0.01``, ``act_order=1|0``, ``block=128``
awq      2-8          ``grid=20`` (number of alpha values tried in [0, 1])
=======  ===========  ===========================================================

This module is pure Python and cheap to import; the quantizers themselves live in
:mod:`interp.quant.methods`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from interp.errors import SpecError

__all__ = ["METHODS", "MethodSpec", "MethodSyntax", "Option", "parse_spec"]

OptionValue = int | float | str
DEFAULT_GROUP = 64


def _parse_flag(text: str) -> int:
    if text not in ("0", "1"):
        raise ValueError
    return int(text)


def _parse_positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError
    return value


def _parse_damp(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError
    return value


def _parse_zero_kind(text: str) -> str:
    if text not in ("float", "int"):
        raise ValueError
    return text


@dataclass(frozen=True)
class Option:
    """One method-specific option: its default, what it accepts, and its parser."""

    default: OptionValue
    accepts: str  # shown in error messages, e.g. "0 or 1"
    parse: Callable[[str], OptionValue]


@dataclass(frozen=True)
class MethodSyntax:
    """What a spec for one method may say. Adding a method is one entry in METHODS."""

    bits: tuple[int, ...]
    options: Mapping[str, Option] = field(default_factory=dict)
    needs_calibration: bool = False
    summary: str = ""

    def bits_text(self) -> str:
        return ", ".join(str(b) for b in self.bits)


_FLAG = "0 or 1"
_TWO_TO_EIGHT = tuple(range(2, 9))

METHODS: Mapping[str, MethodSyntax] = MappingProxyType(
    {
        "rtn": MethodSyntax(
            bits=_TWO_TO_EIGHT,
            options={"zero": Option("float", "float or int", _parse_zero_kind)},
            summary="round-to-nearest, asymmetric min-max per group",
        ),
        "nf": MethodSyntax(
            bits=(3, 4),
            summary="NormalFloat codebook, absmax per group",
        ),
        "hqq": MethodSyntax(
            bits=(2, 3, 4, 5, 6, 8),
            options={"optimize": Option(1, _FLAG, _parse_flag)},
            summary="half-quadratic quantization via the hqq package",
        ),
        "gptq": MethodSyntax(
            bits=_TWO_TO_EIGHT,
            options={
                "damp": Option(0.01, "a float >= 0", _parse_damp),
                "act_order": Option(1, _FLAG, _parse_flag),
                "block": Option(128, "an integer >= 1", _parse_positive_int),
            },
            needs_calibration=True,
            summary="Hessian-aware rounding with error feedback",
        ),
        "awq": MethodSyntax(
            bits=_TWO_TO_EIGHT,
            options={"grid": Option(20, "an integer >= 1", _parse_positive_int)},
            needs_calibration=True,
            summary="activation-aware per-channel scaling, then RTN",
        ),
    }
)


def _valid_methods() -> str:
    return ", ".join(f"{name} (bits {syntax.bits_text()})" for name, syntax in METHODS.items())


def _syntax(method: str) -> MethodSyntax:
    try:
        return METHODS[method]
    except KeyError:
        raise SpecError(f"unknown quantization method {method!r}; valid methods: {_valid_methods()}") from None


def _valid_keys(method: str) -> str:
    return ", ".join(["bits", "group", *METHODS[method].options])


@dataclass(frozen=True)
class MethodSpec:
    """A validated quantizer spec.

    ``params`` always holds every option of the method, with defaults filled in, so
    two specs that mean the same thing compare (and hash) equal. It is read-only.

    Example:
        >>> MethodSpec("awq", bits=4)
        MethodSpec('awq:bits=4,group=64,grid=20')
        >>> MethodSpec("nf", bits=4).needs_calibration
        False
    """

    method: str
    bits: int
    group: int = DEFAULT_GROUP
    params: Mapping[str, OptionValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.method, str):
            raise SpecError(f"method must be a name such as 'rtn', got {type(self.method).__name__}; "
                            f"valid methods: {_valid_methods()}")
        if not isinstance(self.params, Mapping):
            raise SpecError(f"params must be a mapping of option names to values, got {type(self.params).__name__}")
        syntax = _syntax(self.method)
        if isinstance(self.bits, bool) or not isinstance(self.bits, int):
            raise SpecError(f"bits must be an integer, got {self.bits!r}")
        if self.bits not in syntax.bits:
            raise SpecError(f"{self.method} supports bits {syntax.bits_text()}, got bits={self.bits}")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 1:
            raise SpecError(f"group must be an integer >= 1, got {self.group!r}")
        unknown = sorted(set(self.params) - set(syntax.options))
        if unknown:
            raise SpecError(f"unknown option {unknown[0]!r} for {self.method}; valid keys: {_valid_keys(self.method)}")
        full = {
            name: _checked_value(self.method, name, option, self.params.get(name, option.default))
            for name, option in syntax.options.items()
        }
        object.__setattr__(self, "params", MappingProxyType(full))

    def __hash__(self) -> int:
        return hash((self.method, self.bits, self.group, tuple(self.params.items())))

    def __str__(self) -> str:
        parts = [f"bits={self.bits}", f"group={self.group}"]
        parts += [f"{name}={value}" for name, value in self.params.items()]
        return f"{self.method}:{','.join(parts)}"

    def __repr__(self) -> str:
        return f"MethodSpec({str(self)!r})"

    @property
    def needs_calibration(self) -> bool:
        """True for methods that need activations of the layer (gptq, awq)."""
        return METHODS[self.method].needs_calibration


def _checked_value(method: str, name: str, option: Option, value: object) -> OptionValue:
    """Validate an option given as a Python value, through the same parser as text."""
    text = str(int(value)) if isinstance(value, bool) else str(value).strip().lower()
    try:
        return option.parse(text)
    except ValueError:
        raise SpecError(f"{method} option {name} must be {option.accepts}, got {value!r}") from None


def parse_spec(spec: str | MethodSpec) -> MethodSpec:
    """Parse ``method:key=value,...`` into a :class:`MethodSpec`.

    Args:
        spec: a spec string, or a MethodSpec (returned unchanged).

    Returns:
        The validated spec, with defaults filled in.

    Raises:
        SpecError: unknown method or key, repeated key, malformed or unsupported value.
            The message lists the valid methods, keys or values.

    Example:
        >>> parse_spec("nf:bits=4")
        MethodSpec('nf:bits=4,group=64')
        >>> parse_spec("hqq:bits=3,group=32,optimize=0").params["optimize"]
        0
    """
    if isinstance(spec, MethodSpec):
        return spec
    if not isinstance(spec, str):
        raise SpecError(f"a method spec must be a string like 'rtn:bits=4,group=64', got {type(spec).__name__}")
    method, _, body = spec.strip().partition(":")
    method = method.strip().lower()
    syntax = _syntax(method)
    pairs = _split_pairs(method, body)
    if "bits" not in pairs:
        raise SpecError(
            f"spec {spec!r} has no bits; write e.g. '{method}:bits={syntax.bits[-1]}' "
            f"({method} supports bits {syntax.bits_text()})"
        )
    bits = _parse_int_field(method, "bits", pairs.pop("bits"), f"one of {syntax.bits_text()}")
    group = DEFAULT_GROUP
    if "group" in pairs:
        group = _parse_int_field(method, "group", pairs.pop("group"), "an integer >= 1")
    return MethodSpec(method, bits, group, pairs)


def _split_pairs(method: str, body: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    allowed = {"bits", "group", *METHODS[method].options}
    for item in body.split(","):
        if not item.strip():
            continue
        key, sep, value = (part.strip() for part in item.partition("="))
        key = key.lower()
        if not sep or not value:
            raise SpecError(
                f"malformed spec item {item.strip()!r}; write key=value, "
                f"e.g. '{method}:bits=4,group=64' (valid keys: {_valid_keys(method)})"
            )
        if key not in allowed:
            raise SpecError(f"unknown option {key!r} for {method}; valid keys: {_valid_keys(method)}")
        if key in pairs:
            raise SpecError(f"option {key!r} is given twice in the {method} spec")
        pairs[key] = value
    return pairs


def _parse_int_field(method: str, name: str, text: str, accepts: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise SpecError(f"{method} {name} must be {accepts}, got {text!r}") from None
