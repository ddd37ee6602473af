"""Method specs: the short strings that name a weight quantizer and its settings, and the registry of quantizers.

A spec is ``method:key=value,key=value``, for example ``gptq:bits=3,group=64`` or
``nf:bits=4``. The CLI and the API accept the same strings, and results record the
canonical form, in which every option is written out with its value (defaults
included) in a fixed order::

    >>> str(parse_spec("gptq:bits=3"))
    'gptq:bits=3,group=64,damp=0.01,act_order=1,block=128'
    >>> parse_spec("rtn:group=32,bits=4") == parse_spec("rtn:bits=4,group=32,zero=float")
    True

A spec may also carry a per-module bit map (a mixed-precision plan, see
:mod:`interp.quant.prescribe`): ``|LAYER.ROLE=BITS`` items after the options give those
block weights another of the method's bit widths; ``@DIR/plan.json`` reads the spec a plan
file records::

    >>> str(parse_spec("rtn:bits=3|12.down=4|0.v=4"))
    'rtn:bits=3,group=64,zero=float|0.v=4|12.down=4'

``bits`` is required; ``group`` (the number of consecutive input-dimension weights
that share one scale) defaults to 64. Which bit widths and which other options a method
takes is said by its :class:`Quantizer` record: every public module of
:mod:`interp.quant.methods` is one quantizer and defines one, ``QUANTIZER``, and
:data:`METHODS` collects them (:func:`describe_methods` prints the table). Adding a
quantizer is adding one such module; nothing here names a method.

This module is pure Python and cheap to import, and so are the quantizer modules until a
quantizer runs, so parsing a spec (which the CLI does while it reads its options) never
loads torch.
"""

from __future__ import annotations

import functools
import importlib
import math
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from interp.errors import SpecError
from interp.validate import checked, checked_class

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["DEFAULT_GROUP", "METHODS", "MethodSpec", "Option", "Quantizer", "describe_methods", "parse_spec",
           "split_specs"]

OptionValue = int | float | str
DEFAULT_GROUP = 64
QUANTIZER_PACKAGE = "interp.quant.methods"


# ---------------------------------------------------------------------------------------
# Option parsers a quantizer's record can use (text in, value out, ValueError when refused)


def flag(text: str) -> int:
    """``"0"`` or ``"1"``."""
    if text not in ("0", "1"):
        raise ValueError
    return int(text)


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = int(text)
    if value < 1:
        raise ValueError
    return value


def non_negative_float(text: str) -> float:
    """A finite float >= 0."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError
    return value


def one_of(*choices: str) -> Callable[[str], str]:
    """One of ``choices``, as given."""

    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError
        return text

    return parse


@dataclass(frozen=True)
class Option:
    """One method-specific option: its default, what it accepts (for error messages), and its parser."""

    default: OptionValue
    accepts: str  # shown in error messages, e.g. "0 or 1"
    parse: Callable[[str], OptionValue]


@dataclass(frozen=True)
class Quantizer:
    """The registry record of one quantizer, defined as ``QUANTIZER`` by its module in :mod:`interp.quant.methods`.

    Attributes:
        name: the method name in specs; must be the module's name.
        quantize: ``(W, spec, X) -> W_hat``: a float32 ``[d_out, d_in]`` weight on the CPU, the
            parsed :class:`~interp.quant.spec.MethodSpec`, and the layer's checked calibration
            inputs (a ``LayerInputs``; None when
            ``needs_calibration`` is False) to the float32 dequantized weight. Input checks are
            done before it is called.
        bits: the bit widths a spec may ask for.
        options: option name -> :class:`~interp.quant.spec.Option`, in the order the canonical spec writes them.
        needs_calibration: whether the method needs the layer's inputs on calibration text.
        summary: one line for help texts.
        report_bits: the bit widths the default ``interp report`` runs it at (the papers' protocol:
            3-bit methods, and the 4-bit ones that re-grid onto the reference's 4-bit grid).
        quick_bits: the bit widths ``interp report --quick`` runs it at (calibration-free methods only).
        report_rank: where the report lists it, simplest grid first.
        version: the algorithm's version, part of the quantized-model cache key
            (:func:`interp.quant.apply.cache_key`). Bump it with any change that alters the
            weights the method produces, so no cache anywhere serves the old result as the new.

    Example:
        >>> record = METHODS["gptq"]
        >>> record.needs_calibration, record.defaults()
        (True, {'damp': 0.01, 'act_order': 1, 'block': 128})
    """

    name: str
    quantize: Callable[[Tensor, MethodSpec, Any], Tensor]  # the third argument: LayerInputs | None
    bits: tuple[int, ...]
    options: Mapping[str, Option] = field(default_factory=dict)
    needs_calibration: bool = False
    summary: str = ""
    report_bits: tuple[int, ...] = ()
    quick_bits: tuple[int, ...] = ()
    report_rank: int = 100
    version: int = 1

    def bits_text(self) -> str:
        return ", ".join(str(b) for b in self.bits)

    def defaults(self) -> dict[str, OptionValue]:
        return {name: option.default for name, option in self.options.items()}


# ---------------------------------------------------------------------------------------
# The registry


@functools.cache
def _discover() -> Mapping[str, Quantizer]:
    """Every public module of :mod:`interp.quant.methods`, by name, with its ``QUANTIZER`` record.

    Modules whose names start with an underscore hold shared helpers and are skipped.
    """
    package = importlib.import_module(QUANTIZER_PACKAGE)
    found: dict[str, Quantizer] = {}
    for info in pkgutil.iter_modules(package.__path__):  # sorted by name
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{QUANTIZER_PACKAGE}.{info.name}")
        record = getattr(module, "QUANTIZER", None)
        if not isinstance(record, Quantizer) or record.name != info.name:
            raise TypeError(f"{module.__name__} must define QUANTIZER = Quantizer(name={info.name!r}, ...)")
        found[info.name] = record
    return MappingProxyType(found)


class _Registry(Mapping[str, Quantizer]):
    """Method name -> :class:`Quantizer`, read from :mod:`interp.quant.methods` on first use.

    Lazy because the quantizer modules import this module for :class:`Quantizer` and :class:`Option`.
    """

    def __getitem__(self, name: str) -> Quantizer:
        return _discover()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(_discover())

    def __len__(self) -> int:
        return len(_discover())

    def __repr__(self) -> str:
        return f"METHODS({', '.join(self)})"


METHODS: Mapping[str, Quantizer] = _Registry()


def report_specs(quick: bool = False, group: int = 64) -> tuple[str, ...]:
    """The method specs ``interp report`` runs by default (or with ``--quick``), read from the registry.

    Example:
        >>> report_specs(quick=True)
        ('rtn:bits=3,group=64', 'rtn:bits=4,group=64', 'nf:bits=3,group=64')
    """
    ranked = sorted(METHODS.values(), key=lambda record: (record.report_rank, record.name))
    return tuple(f"{record.name}:bits={bits},group={group}" for record in ranked
                 for bits in (record.quick_bits if quick else record.report_bits))


def describe_methods() -> str:
    """One line per registered method: its name, bit widths, options with defaults, and summary.

    Example:
        >>> print(describe_methods().splitlines()[0])
        awq   bits 2-8                grid=20 (calibrated): activation-aware per-channel scaling, then RTN
    """
    lines = []
    for name, record in METHODS.items():
        bits = record.bits
        contiguous = len(bits) > 2 and bits == tuple(range(bits[0], bits[-1] + 1))
        span = f"{bits[0]}-{bits[-1]}" if contiguous else record.bits_text()
        options = ",".join(f"{key}={value}" for key, value in record.defaults().items()) or "-"
        calibrated = " (calibrated)" if record.needs_calibration else ""
        lines.append(f"{name:<5} bits {span:<18} {options}{calibrated}: {record.summary}")
    return "\n".join(lines)


def _valid_methods() -> str:
    return ", ".join(f"{name} (bits {record.bits_text()})" for name, record in METHODS.items())


def _record(method: str) -> Quantizer:
    try:
        return METHODS[method]
    except KeyError:
        raise SpecError(f"unknown quantization method {method!r}; valid methods: {_valid_methods()}") from None


def _valid_keys(method: str) -> str:
    return ", ".join(["bits", "group", *METHODS[method].options])


@checked_class(error=SpecError,  # a spec's refusals are SpecErrors; bits and group get __post_init__'s words
               bits=lambda value, name, arguments: None, group=lambda value, name, arguments: None)
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
    modules: Mapping[str, int] = field(default_factory=dict)  # "layer.role" -> bits where it differs from bits

    def __post_init__(self) -> None:
        if not isinstance(self.method, str):
            raise SpecError(f"method must be a name such as 'rtn', got {type(self.method).__name__}; "
                            f"valid methods: {_valid_methods()}")
        if not isinstance(self.params, Mapping):
            raise SpecError(f"params must be a mapping of option names to values, got {type(self.params).__name__}")
        record = _record(self.method)
        if isinstance(self.bits, bool) or not isinstance(self.bits, int):
            raise SpecError(f"bits must be an integer, got {self.bits!r}")
        if self.bits not in record.bits:
            raise SpecError(f"{self.method} supports bits {record.bits_text()}, got bits={self.bits}")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 1:
            raise SpecError(f"group must be an integer >= 1, got {self.group!r}")
        unknown = sorted(set(self.params) - set(record.options))
        if unknown:
            raise SpecError(f"unknown option {unknown[0]!r} for {self.method}; valid keys: {_valid_keys(self.method)}")
        full = {
            name: _checked_value(self.method, name, option, self.params.get(name, option.default))
            for name, option in record.options.items()
        }
        object.__setattr__(self, "params", MappingProxyType(full))
        object.__setattr__(self, "modules", MappingProxyType(_checked_modules(self.method, self.bits, self.modules)))

    def __hash__(self) -> int:
        return hash((self.method, self.bits, self.group, tuple(self.params.items()), tuple(self.modules.items())))

    def __str__(self) -> str:
        parts = [f"bits={self.bits}", f"group={self.group}"]
        parts += [f"{name}={value}" for name, value in self.params.items()]
        return f"{self.method}:{','.join(parts)}" + "".join(f"|{name}={b}" for name, b in self.modules.items())

    def bits_for(self, layer: int, role: str) -> int:
        """The bit width of block ``layer``'s ``role`` weight: its entry in ``modules``, else ``bits``.

        Example:
            >>> spec = parse_spec("gptq:bits=3|0.v=4")
            >>> spec.bits_for(0, "v"), spec.bits_for(0, "q"), spec.for_module(0, "v")
            (4, 3, MethodSpec('gptq:bits=4,group=64,damp=0.01,act_order=1,block=128'))
        """
        return self.modules.get(f"{layer}.{role}", self.bits)

    def for_module(self, layer: int, role: str) -> MethodSpec:
        """The plain (single-width) spec that block ``layer``'s ``role`` weight is quantized with."""
        bits = self.bits_for(layer, role)
        if bits == self.bits and not self.modules:
            return self
        return MethodSpec(self.method, bits, self.group, self.params)

    def __repr__(self) -> str:
        return f"MethodSpec({str(self)!r})"

    @property
    def needs_calibration(self) -> bool:
        """True for methods that need the layer's inputs on calibration text (their record says so)."""
        return METHODS[self.method].needs_calibration


def _module_key(name: str) -> tuple[int, str]:
    layer, _, role = name.partition(".")
    return int(layer), role


def _checked_modules(method: str, bits: int, modules: object) -> dict[str, int]:
    """A per-module bit map, validated and canonical: entries equal to the base width dropped, sorted by layer."""
    if not isinstance(modules, Mapping):
        raise SpecError(f"modules must map module names like '3.down' to bit widths, got {type(modules).__name__}")
    record = METHODS[method]
    out: dict[str, int] = {}
    seen: dict[str, object] = {}
    for name, width in modules.items():
        layer, dot, role = str(name).partition(".")
        if not (dot and layer.isdigit() and role.isidentifier()):
            raise SpecError(f"module name {name!r} must be LAYER.ROLE, e.g. '3.down' (roles: q, k, v, o, gate, up, "
                            "down)")
        if isinstance(width, bool) or not isinstance(width, int) or width not in record.bits:
            raise SpecError(f"{method} supports bits {record.bits_text()}, got {width!r} for module {name}")
        key = f"{int(layer)}.{role}"
        if key in seen:  # '0.v' and '00.v' name one weight: the later entry would silently win
            raise SpecError(f"module {key!r} is given twice in the {method} spec (as {seen[key]!r} and {name!r}); "
                            "give each weight once")
        seen[key] = name
        if width != bits:
            out[key] = width
    return dict(sorted(out.items(), key=lambda item: _module_key(item[0])))


def _checked_value(method: str, name: str, option: Option, value: object) -> OptionValue:
    """Validate an option given as a Python value, through the same parser as text."""
    text = str(int(value)) if isinstance(value, bool) else str(value).strip().lower()
    try:
        return option.parse(text)
    except ValueError:
        raise SpecError(f"{method} option {name} must be {option.accepts}, got {value!r}") from None


@checked
def parse_spec(spec: str | MethodSpec) -> MethodSpec:
    """Parse ``method:key=value,...`` into a :class:`MethodSpec`.

    The one place a spec's text is read: callers parse at their edge (the command line, the API's public
    functions, the report's settings) and pass the :class:`MethodSpec` inward, so each text is parsed once
    (``tests/test_parse_once.py`` counts it).

    Args:
        spec: a spec string, ``@DIR/plan.json`` (the spec a plan file records), or a MethodSpec (returned unchanged).

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
    if spec.strip().startswith("@"):
        return _spec_from_plan(spec.strip()[1:])
    return _parse_text(spec)


def _parse_text(spec: str) -> MethodSpec:
    """The parse itself: ``method:key=value,...|LAYER.ROLE=BITS...`` into a :class:`MethodSpec`."""
    spec, *module_items = spec.split("|")
    method, _, body = spec.strip().partition(":")
    method = method.strip().lower()
    record = _record(method)
    pairs = _split_pairs(method, body)
    if "bits" not in pairs:
        raise SpecError(
            f"spec {spec!r} has no bits; write e.g. '{method}:bits={record.bits[-1]}' "
            f"({method} supports bits {record.bits_text()})"
        )
    bits = _parse_int_field(method, "bits", pairs.pop("bits"), f"one of {record.bits_text()}")
    group = DEFAULT_GROUP
    if "group" in pairs:
        group = _parse_int_field(method, "group", pairs.pop("group"), "an integer >= 1")
    return MethodSpec(method, bits, group, pairs, _split_modules(method, record, module_items))


def _split_modules(method: str, record: Quantizer, items: list[str]) -> dict[str, int]:
    """``["0.v=4", "29.down=4"]`` -> ``{"0.v": 4, "29.down": 4}`` (checked by :class:`MethodSpec`)."""
    modules: dict[str, int] = {}
    for item in items:
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not name:
            raise SpecError(f"malformed module item {item.strip()!r}; write |LAYER.ROLE=BITS, e.g. "
                            f"'{method}:bits=3|0.v=4'")
        if name in modules:
            raise SpecError(f"module {name!r} is given twice in the {method} spec")
        modules[name] = _parse_int_field(method, f"bits of module {name}", value, f"one of {record.bits_text()}")
    return modules


def _spec_from_plan(path: str) -> MethodSpec:
    """The ``spec`` a plan file (``plan.json`` from ``interp prescribe``) records, parsed (once)."""
    from interp.reading import read_json

    try:  # bounded, and a pipe or a device is refused before it is opened
        record = read_json(path, "the plan file", error=SpecError)
    except SpecError as exc:
        raise SpecError(f"@{path}: cannot read a plan from it ({exc}); give @DIR/plan.json written by "
                        "interp prescribe") from None
    return _plan_spec(record, path)


def _plan_spec(record: object, path: str) -> MethodSpec:
    """The spec a plan record holds, parsed, refused when it names another plan or disagrees with the plan's widths.

    A plan's ``spec`` is what quantizes; its ``widths`` say the same per weight. When a user edits
    one and not the other, the edit would be silently ignored (or silently win), so the two must agree.
    """
    if not isinstance(record, dict) or not isinstance(record.get("spec"), str):
        raise SpecError(f"@{path} holds no 'spec' entry; give @DIR/plan.json written by interp prescribe")
    text = record["spec"]
    if text.strip().startswith("@"):
        raise SpecError(f"@{path}: its spec {text.strip()!r} names another plan file; a plan's spec must be a method "
                        "spec such as 'gptq:bits=3|0.v=4' (regenerate it with interp prescribe)")
    spec = _parse_text(text)
    widths = record.get("widths")
    if widths is None:
        return spec
    if not isinstance(widths, dict):
        raise SpecError(f"@{path}: 'widths' must map 'LAYER.ROLE' to bits, got {type(widths).__name__}")
    for name, width in widths.items():
        layer, _, role = str(name).partition(".")
        if not layer.isdigit() or width != spec.bits_for(int(layer), role):
            raise SpecError(f"@{path}: its widths and its spec disagree on {name!r} (widths: {width!r}, spec: "
                            f"{spec.bits_for(int(layer), role) if layer.isdigit() else 'no such weight'}); "
                            "edit both the same way, or regenerate the plan with interp prescribe")
    return spec


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


def split_specs(text: str) -> list[str]:
    """Split a list of specs: ``;``/whitespace separate them, and so does a ``,`` before a method name.

    The items are not checked (see :func:`parse_spec`); a ``,`` followed by a registered
    method name and ``:`` starts a new spec, any other ``,`` continues the current one. A plan
    file's ``@DIR/plan.json`` is always a spec of its own.

    >>> split_specs("rtn:bits=3,group=64,gptq:bits=3;nf:bits=4")
    ['rtn:bits=3,group=64', 'gptq:bits=3', 'nf:bits=4']
    >>> split_specs("rtn:bits=3;@plans/a/plan.json")
    ['rtn:bits=3', '@plans/a/plan.json']
    """
    specs: list[str] = []
    for chunk in text.replace(";", " ").split():
        for item in chunk.split(","):
            head = item.split(":", 1)[0].strip().lower()
            if not specs or item.strip().startswith("@") or (":" in item and head in METHODS):
                specs.append(item)
            else:
                specs[-1] += "," + item
    return [s for s in specs if s]
