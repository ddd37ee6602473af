"""Checks of arguments at the library's boundary: :func:`checked` checks every argument of a public function.

Python quietly turns ``True`` into 1, ``0.5`` into layer 0 and ``"01"`` into layers 0 and 1.
The plain checks (:mod:`interp.argument_checks`, importable from here: counts, lengths, layer
lists, indices, seeds) accept only what the argument means (an integer that is not a bool, a
non-empty list of integer layer indices) and raise an :class:`~interp.errors.InterpError`
subclass that says what to pass instead; :func:`checked` and :func:`checked_class` apply them to
each argument by its name and annotation. This is a base module: it imports only
:mod:`interp.errors` (and numbers), so every layer of the package may use it.
"""

from __future__ import annotations

import functools
import inspect
import math
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from interp.argument_checks import (  # noqa: F401 (the plain checks, importable from here as before)
    SEED_LIMIT,
    _is_bool,
    _is_real,
    _is_tensor,
    _kind,
    _shown,
    batch_size,
    count,
    device,
    finite_number,
    index,
    indices,
    integer,
    is_integer,
    layer_indices,
    names,
    seed,
    tensor,
)
from interp.errors import ComponentError, DataError, InterpError, ModelLoadError, NonFiniteError, SpecError

# ---------------------------------------------------------------------------------------
# The public boundary: one decorator checks every argument by its annotation and its name
#
# ``@checked`` on a public function reads its signature once (on the first call, when the module's
# names are all defined) and, on every call, checks each argument before the body runs:
#
# - by annotation: ``int`` refuses bools, floats and strings; ``float`` refuses bools, NaN and
#   inf; ``bool`` refuses 0, 1 and "yes"; ``str`` and ``Literal[...]`` refuse anything else (a
#   literal must be one of its choices); ``Sequence[int]``/``list[int]`` refuse strings, floats,
#   bools and duplicates; ``Sequence[str]`` refuses a bare string where the name says rows
#   (``texts``, ``ids``); tensor annotations (``Tensor``, jaxtyping ``Float[...]``) refuse
#   non-tensors, empty tensors and NaN/inf;
# - by name (:data:`NAMED`): a ``seed`` lies in [0, 2**63); counts (``batch_size``, ``n``,
#   ``n_boot``...) are >= 1; fractions (``top``, ``level``) lie in (0, 1); ``device`` is
#   not ``"meta"``; ``layers``/``layer`` are indices of the model's layers (negative ones
#   count from the end, as documented), ``head``/``heads`` of its heads, ``position(s)`` of
#   the examples' positions, ``token``/``target``/``answers`` ids of its vocabulary; a
#   per-row argument (``answers``, ``targets``, ``labels``) has one entry per example row.
#
# The model and the examples that ranges refer to are the arguments that look like them (an
# object with ``cfg.n_layers``; one with ``tokens``). Adding a function: decorate it, and name
# its parameters as above; a new kind of argument is one entry in NAMED.


# ---- the context that ranges refer to


def _model_of(arguments: dict[str, Any]) -> Any:
    for value in arguments.values():
        cfg = getattr(value, "cfg", None)
        if cfg is not None and is_integer(getattr(cfg, "n_layers", None)):
            return value
    return None


def _examples_of(arguments: dict[str, Any]) -> Any:
    for value in arguments.values():
        if any(cls.__name__ == "Examples" for cls in type(value).__mro__):
            return value
    return None


def _cfg(arguments: dict[str, Any], field_name: str) -> int | None:
    model = _model_of(arguments)
    value = getattr(getattr(model, "cfg", None), field_name, None)
    return int(value) if is_integer(value) else None


def _positions(arguments: dict[str, Any]) -> int | None:
    examples = _examples_of(arguments)
    return int(examples.tokens.shape[1]) if examples is not None else None


def _rows(arguments: dict[str, Any]) -> int | None:
    examples = _examples_of(arguments)
    return len(examples) if examples is not None else None


# ---- rules by parameter name: (value, name, arguments) -> None, raising an InterpError


Rule = Callable[[Any, str, dict[str, Any]], None]


def _count(minimum: int = 1, error: type[InterpError] = InterpError, maximum: tuple[int, str] | None = None) -> Rule:
    """An integer count of at least ``minimum`` and, with ``maximum = (ceiling, why)``, at most ``ceiling``."""
    def rule(value: Any, name: str, arguments: dict[str, Any]) -> None:
        number = integer(value, name, minimum=minimum, error=error)
        if maximum is not None and number > maximum[0]:
            raise error(f"{name} must be at most {maximum[0]:,} ({maximum[1]}), got {number:,}.")
    return rule


def _fraction(low: float, high: float, open_low: bool = True, open_high: bool = True) -> Rule:
    def rule(value: Any, name: str, arguments: dict[str, Any]) -> None:
        finite_number(value, name, low, high, open_low, open_high)
    rule.only_for = float  # type: ignore[attr-defined]  # a ``top: int`` (a count) is not a fraction
    return rule


def _indexed(size_of: Callable[[dict[str, Any]], int | None], what: str, many: bool, negative: bool = False,
             error: type[InterpError] = ComponentError) -> Rule:
    def rule(value: Any, name: str, arguments: dict[str, Any]) -> None:
        size = size_of(arguments)
        if many:
            indices(value, name, size, what, negative, error)
        elif size is None:
            integer(value, name, error=error)
        else:
            index(value, name, size, what, negative, error)
    return rule


def _per_row(value: Any, name: str, arguments: dict[str, Any]) -> None:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) and not _is_tensor(value):
        raise DataError(f"{name} must hold one entry per example row, got {_kind(value)}.")
    rows = _rows(arguments)
    if rows is not None and len(value) != rows:
        raise DataError(f"{name} has {len(value)} entries but the examples have {rows} rows; give one per row.")


def _tokens(many: bool) -> Rule:
    vocab = _indexed(lambda a: _cfg(a, "d_vocab"), "token ids in the vocabulary", many, error=DataError)

    def rule(value: Any, name: str, arguments: dict[str, Any]) -> None:
        if _is_tensor(value) and value.ndim > 0:
            size = _cfg(arguments, "d_vocab")
            if value.is_floating_point() or (size is not None and bool(((value < 0) | (value >= size)).any())):
                raise DataError(f"{name} must hold integer token ids in 0..{(size or 1) - 1}.")
            return
        vocab(value, name, arguments)
    return rule


def token_ids(value: Any, name: str, arguments: dict[str, Any]) -> None:
    """A rule: token ids, one or one per row (repeats welcome), integers in the vocabulary of the model argument.

    Example:
        >>> token_ids([5, 5, 7], "target", {})
        >>> token_ids([5, 0.5], "target", {})
        Traceback (most recent call last):
        ...
        interp.errors.DataError: target must be an integer, got 0.5 (float). Pass a whole number such as 8.
    """
    size = _cfg(arguments, "d_vocab")
    if _is_tensor(value):
        if value.is_floating_point() or value.is_complex() or str(value.dtype) == "torch.bool" or value.ndim > 1:
            raise DataError(f"{name} must hold integer token ids (one, or one per row), got a {value.dtype} tensor of "
                            f"shape {list(value.shape)}.")
        value = value.tolist()
    items = [value] if is_integer(value) else value
    if isinstance(items, (str, bytes, dict)) or not isinstance(items, Iterable) or not list(items):
        raise DataError(f"{name} must be a token id or a non-empty list of them, got {_shown(value)} ({_kind(value)}).")
    for item in items:
        number = integer(item, name, minimum=0, error=DataError)
        if size is not None and number >= size:
            raise DataError(f"{name} holds token id {number}, but the model's vocabulary has ids 0..{size - 1}.")


token_ids.always = True  # type: ignore[attr-defined]


def integers(value: Any, name: str, arguments: dict[str, Any]) -> None:
    """A rule: one integer or a non-empty list of them, repeats welcome (one position per row, say)."""
    if _is_tensor(value):
        if value.is_floating_point() or value.is_complex() or str(value.dtype) == "torch.bool" or value.ndim > 1:
            raise DataError(f"{name} must hold integers, got a {value.dtype} tensor of shape {list(value.shape)}.")
        value = value.tolist()
    items = [value] if is_integer(value) else value
    if isinstance(items, (str, bytes, dict)) or not isinstance(items, Iterable) or not list(items):
        raise DataError(f"{name} must be an integer or a non-empty list of them, got {_shown(value)} ({_kind(value)}).")
    for item in items:
        integer(item, name, error=DataError)


integers.always = True  # type: ignore[attr-defined]


def _layers(value: Any, name: str, arguments: dict[str, Any]) -> None:
    n_layers = _cfg(arguments, "n_layers")
    if n_layers is not None:
        layer_indices(value, n_layers)  # its messages name the model's layers
    indices(value, name, n_layers, "layers", negative=True)


def _module(value: Any, name: str, arguments: dict[str, Any]) -> None:
    if not any(cls.__name__ == "Module" and cls.__module__.startswith("torch.nn") for cls in type(value).__mro__):
        raise InterpError(f"{name} must be a model, such as interp.load_model(...) or interp.tiny_model(), got "
                          f"{_shown(value)} ({_kind(value)}).")


_module.always = True  # type: ignore[attr-defined]  # whatever the annotation says (Any, a protocol)


def _dim(value: Any, name: str, arguments: dict[str, Any]) -> None:
    """Tensor dimensions: integers within the rank of the tensor arguments."""
    ranks = [v.ndim for v in arguments.values() if _is_tensor(v)]
    dims = value if isinstance(value, (tuple, list)) else [value]
    for dim in dims:
        integer(dim, name)
        if ranks and not -min(ranks) <= int(dim) < min(ranks):
            raise InterpError(f"{name} {dim} is out of range for a tensor of {min(ranks)} dimensions.")
    if len({int(d) % min(ranks) if ranks else int(d) for d in dims}) != len(dims):
        raise InterpError(f"{name} names one dimension twice: {value!r}.")


def _has(attribute: str, what: str) -> Rule:
    """A rule for an argument typed ``Any``: it must have ``attribute`` (``what`` names such an object)."""
    def rule(value: Any, name: str, arguments: dict[str, Any]) -> None:
        if not hasattr(value, attribute):
            raise InterpError(f"{name} must be {what}, got {_shown(value)} ({_kind(value)}).")
    rule.always = True  # type: ignore[attr-defined]
    return rule


def weight(value: Any, name: str, arguments: dict[str, Any]) -> None:
    """A weight: a floating-point tensor, ``[d_out, d_in]`` for a quantizer (which checks the shape and values)."""
    if not (_is_tensor(value) and value.is_floating_point()):
        shape = f"shape {tuple(value.shape)}, {value.dtype}" if _is_tensor(value) else _kind(value)
        raise SpecError(f"{name} must be a 2-D float weight [d_out, d_in], got {shape}.")


weight.always = True  # type: ignore[attr-defined]


def _like_weight(value: Any, name: str, arguments: dict[str, Any]) -> None:
    """A weight compared with ``W``: its shape, and finite (an error measure of inf or NaN says nothing)."""
    W = arguments.get("W")
    if _is_tensor(W) and tuple(value.shape) != tuple(W.shape):
        raise SpecError(f"{name} must have W's shape {tuple(W.shape)}, got {tuple(value.shape)}.")
    if not bool(value.isfinite().all()):
        raise NonFiniteError(f"{name} holds NaN or inf values.")


def _inputs_of_weight(value: Any, name: str, arguments: dict[str, Any]) -> None:
    """Calibration inputs ``[n, d_in]`` for ``W [d_out, d_in]``: float, finite, with W's input width."""
    if not (_is_tensor(value) and value.is_floating_point() and value.ndim == 2):
        shape = f"shape {tuple(value.shape)}, {value.dtype}" if _is_tensor(value) else _kind(value)
        raise DataError(f"{name} must be 2-D float inputs [n, d_in], got {shape}.")
    W = arguments.get("W")
    if _is_tensor(W) and W.ndim == 2 and value.shape[1] != W.shape[1]:
        raise DataError(f"{name} has {value.shape[1]} columns but W takes inputs of width {W.shape[1]}.")
    if not bool(value.isfinite().all()):
        raise NonFiniteError(f"{name} holds NaN or inf values.")


def is_block_weights(obj: Any) -> bool:
    """Whether ``obj`` is a :class:`~interp.runtime.swap.BlockWeights` source rather than a model (it has ``block``
    and no ``original_model``): the analyses that take either, and this checker, tell them apart this way."""
    return hasattr(obj, "block") and not hasattr(obj, "original_model")


def model_or_weights(value: Any, name: str, arguments: dict[str, Any]) -> None:
    """A model, or the block weights that stand for one (interp.patch's ``target``): a mapping, or a
    :class:`~interp.runtime.swap.BlockWeights` source such as :class:`~interp.quant.inplace.SavedWeights`."""
    if not isinstance(value, Mapping) and not is_block_weights(value):
        _module(value, name, arguments)


_ERRORS: dict[str, type[InterpError]] = {
    **dict.fromkeys(("spec", "specs", "method"), SpecError),
    **dict.fromkeys(("source", "texts", "ids", "examples", "n", "seq_len", "max_len", "seed", "tokens"), DataError),
    **dict.fromkeys(("layers", "layer", "heads", "head", "components", "component", "reducers"), ComponentError),
    **dict.fromkeys(("device_map", "max_memory", "offload_folder", "tokenizer"), ModelLoadError),
}
"""The error a wrongly typed argument raises, by parameter name (InterpError for the rest)."""
_HEADS = _indexed(lambda a: _cfg(a, "n_heads"), "heads", many=True)
_POSITIONS = _indexed(_positions, "positions", many=True, negative=True, error=DataError)

NAMED: dict[str, Rule] = {
    "seed": lambda value, name, arguments: None if value is None else seed(value, name) and None,
    **{name: _count() for name in ("batch_size", "n_outliers", "max_rows", "max_logits",
                                  "chunk", "group", "ngram", "top_k", "k")},
    # counts that set the work or the memory and have no use beyond a ceiling: refused there, not run for hours
    "hops": _count(maximum=(1_000, "a walk of more hops than a context has tokens adds nothing a user can read")),
    "ig_steps": _count(maximum=(512, "integrated gradients converges within a few hundred steps")),
    "n_boot": _count(maximum=(100_000, "an interval end's Monte Carlo error is already far below its width at 10,000 "
                                       "resamples, and each resample holds a row index per example in memory")),
    "n_layers": _count(maximum=(1_024, "a tiny test model; load a real one with interp.load_model")),
    "max_new_tokens": _count(maximum=(1 << 16, "longer than the context of any model here")),
    **{name: _count(maximum=(1 << 20, "a million tokens, more than any model here attends over"))
       for name in ("n_queries", "n_keys")},
    **{name: _count(error=DataError) for name in ("sensitivity_n", "sensitivity_seq_len")},
    "sink": _count(0),
    "min_keys": _count(1),
    **{name: _fraction(0, 1) for name in ("top", "level", "memory_fraction")},
    "dedup": _fraction(0, 1, open_low=False, open_high=False),
    "ctrl_pool": _fraction(0, 1, open_high=False),
    "device": lambda value, name, arguments: None if value is None else device(value, name) and None,
    "model": _module,
    "reference": _module,
    "dim": _dim,
    "W": weight,
    "W_hat": lambda value, name, arguments: (weight(value, name, arguments), _like_weight(value, name, arguments))
    and None,
    "X": lambda value, name, arguments: _inputs_of_weight(value, name, arguments),
    "probe_result": _has("stats", "a ProbeResult from interp.probe"),
    "layers": _layers,
    "layer": _indexed(lambda a: _cfg(a, "n_layers"), "layers", many=False, negative=True),
    "heads": _HEADS,
    "head": _indexed(lambda a: _cfg(a, "n_heads"), "heads", many=False),
    "positions": _POSITIONS,
    "position": _indexed(_positions, "positions", many=False, negative=True, error=DataError),
    "token": _tokens(many=False),
    "target": _tokens(many=False),
    "answers": lambda value, name, arguments: (_per_row(value, name, arguments), _tokens(True)(value, name, arguments))
    and None,
    "targets": _per_row,
    "labels": _per_row,
}
"""Parameter name -> its rule. A rule sees the value, the name, and all bound arguments (for the model's sizes)."""


# ---- rules by annotation


_CONTAINERS = (dict, list, tuple, set, frozenset, Mapping, Sequence, Iterable, __import__("os").PathLike)
_UNKNOWN = object()  # an annotation member that cannot be resolved (imported for type checking only)


def _resolve(text: str, namespace: dict[str, Any]) -> Any:
    try:
        value = eval(text, namespace)  # noqa: S307 - the function's own annotation, in its own module's names
    except Exception:  # noqa: BLE001 - a name only imported for type checking: no check from it
        return _UNKNOWN
    return type(None) if value is None else value


def _alternatives(annotation: Any, namespace: dict[str, Any]) -> list[Any]:
    """The members of a union annotation, resolved (None for a member that cannot be resolved)."""
    if isinstance(annotation, str):
        depth, parts, start = 0, [], 0
        for i, char in enumerate(annotation):
            depth += char in "[(" and 1 or (char in "])" and -1 or 0)
            if char == "|" and depth == 0:
                parts.append(annotation[start:i])
                start = i + 1
        parts.append(annotation[start:])
        resolved = [_resolve(part.strip(), namespace) for part in parts]
        return [r for part in resolved for r in (_alternatives(part, namespace) if part is not _UNKNOWN else [part])]
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return [r for arg in typing.get_args(annotation) for r in _alternatives(arg, namespace)]
    return [annotation]


def _type_check(member: Any) -> Callable[[Any], bool] | None:
    """A test that a value fits one member of an annotation; None when the member says nothing checkable."""
    origin, args = typing.get_origin(member), typing.get_args(member)
    simple: dict[Any, Callable[[Any], bool]] = {
        type(None): lambda v: v is None, int: is_integer, float: _is_real,
        bool: _is_bool, str: lambda v: isinstance(v, str)}
    if member is _UNKNOWN or member is typing.Any:
        return None
    if member in simple:
        return simple[member]
    if origin is typing.Literal:
        # a string outside the choices is left to the function, whose message can say "did you mean"
        return lambda v: isinstance(v, str) or (is_integer(v) and v in args)
    fixed_tuple = origin is tuple and args[1:] != (Ellipsis,)  # tuple[str, Callable]: not a list of names
    if origin in (list, tuple, Sequence, Iterable) and args and args[0] is int and not fixed_tuple:
        return lambda v: (not isinstance(v, (str, bytes, dict)) and isinstance(v, Iterable)
                          and getattr(v, "ndim", 1) <= 1 and all(is_integer(x) for x in v))
    if origin in (list, tuple, Sequence, Iterable) and args and args[0] is str and not fixed_tuple:
        # one name counts as a list of one
        # a table iterates over its column names: not a list of names (ndim 2)
        return lambda v: isinstance(v, str) or (not isinstance(v, (bytes, dict)) and isinstance(v, Iterable)
                                                and getattr(v, "ndim", 1) <= 1 and all(isinstance(x, str) for x in v))
    if getattr(member, "__module__", "").startswith("jaxtyping") or (
            isinstance(member, type) and member.__name__ == "Tensor" and member.__module__.startswith("torch")):
        return _is_tensor
    if getattr(member, "_is_protocol", False):  # interp.models.Model is runtime-checkable
        return (lambda v: isinstance(v, member)) if getattr(member, "_is_runtime_protocol", False) else None
    if isinstance(member, type) and origin is None:
        return lambda v: isinstance(v, member)  # a class such as Examples or pd.DataFrame
    if fixed_tuple and args:  # tuple[str, Callable]: that many items, each of its type
        items = [_type_check(a) for a in args]
        return lambda v: isinstance(v, tuple) and len(v) == len(items) and all(
            test is None or test(x) for test, x in zip(items, v, strict=True))
    if origin is Callable:
        return callable
    if origin in _CONTAINERS:  # dict[str, Any], os.PathLike[str], Sequence[Patch]
        plain_item = args and isinstance(args[0], type) and typing.get_origin(args[0]) is None
        pair_item = args and typing.get_origin(args[0]) is tuple  # Sequence[tuple[str, Callable]]
        item = _type_check(args[0]) if (plain_item or pair_item) and origin in (list, Sequence, Iterable) else None
        fits = _sequence_like if origin is Sequence else (lambda v: isinstance(v, origin))
        return lambda v: fits(v) and not isinstance(v, (str, bytes)) and (
            item is None or all(item(x) for x in v))
    return None


def _sequence_like(value: Any) -> bool:
    """A Sequence, or a one-dimensional array a user holds in its place (a pandas Series or Index, a numpy array:
    e.g. ``edges.top(3)["sender"]``)."""
    if isinstance(value, Sequence):
        return True
    return type(value).__name__ in ("Series", "Index", "ndarray") and getattr(value, "ndim", 0) == 1


class _Parameter:
    """How one parameter is checked: the type tests of its annotation's members, and its named rule."""

    def __init__(self, parameter: inspect.Parameter, namespace: dict[str, Any], own: Rule | None = None) -> None:
        self.name = parameter.name
        members = _alternatives(parameter.annotation, namespace) if parameter.annotation is not parameter.empty else []
        tests = [_type_check(m) for m in members]
        self.tests = tests if tests and all(t is not None for t in tests) else []
        self.members = members
        self.default_none = parameter.default is None
        self.tensor = any(t is _is_tensor for t in tests)
        self.rule = NAMED.get(parameter.name)
        only_for = getattr(self.rule, "only_for", None)
        if only_for is not None and only_for not in members:
            self.rule = None
        elif members and all(not self._plain(m) for m in members) and not getattr(self.rule, "always", False):
            self.rule = None  # e.g. patch(target: Model): a name shared with a rule for plain values
        if own is not None:
            self.rule = own

    def check(self, value: Any, arguments: dict[str, Any]) -> None:
        if value is None and (self.default_none or type(None) in self.members):
            return
        if self.rule is not None:  # first: its message (and error class) is the more specific
            self.rule(value, self.name, arguments)
        if self.tests and not any(test(value) for test in self.tests):
            error = _ERRORS.get(self.name, InterpError)
            raise error(f"{self.name} must be {self._expected()}, got {_shown(value)} ({_kind(value)})"
                        f"{self._bad_item(value)}.")
        if isinstance(value, float) and not math.isfinite(value):
            raise InterpError(f"{self.name} must be a finite number, got {value}.")
        if self.name in ("texts", "ids") and isinstance(value, str):
            raise DataError(f"{self.name} must be a list of strings (one per row), got the string {_shown(value)}.")
        if isinstance(value, (list, tuple)) and self.rule is None and self._ints() and len(set(value)) != len(value):
            raise InterpError(f"{self.name} holds a value twice: {list(value)!r}; give each once.")

    def _bad_item(self, value: Any) -> str:
        """``"; 0.5 (float) is not an integer"`` for a list whose items are of the wrong kind."""
        if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
            return ""
        for kind, test, word in ((int, is_integer, "an integer"), (str, lambda v: isinstance(v, str), "a string")):
            if any(typing.get_args(m)[:1] == (kind,) for m in self.members):
                bad = next((item for item in value if not test(item)), None)
                if bad is not None:
                    return f"; {_shown(bad)} ({_kind(bad)}) is not {word}"
        return ""

    @staticmethod
    def _plain(member: Any) -> bool:
        """Whether an annotation member is a plain value a named rule can judge (a number, a name, a list of them)."""
        return member in (int, float, bool, str, type(None)) or _type_check(member) is _is_tensor or (
            typing.get_args(member)[:1] in ((int,), (str,)))

    def _ints(self) -> bool:
        return any(typing.get_args(m)[:1] == (int,) for m in self.members)

    def _expected(self) -> str:
        words = {int: "an integer", float: "a number (float)", bool: "True or False", str: "a string",
                 type(None): "None"}
        out = []
        for member in self.members:
            if member in words:
                out.append(words[member])
            elif typing.get_origin(member) is typing.Literal:
                out.append("one of " + ", ".join(repr(a) for a in typing.get_args(member)))
            elif typing.get_args(member)[:1] == (int,):
                out.append("a list of integers")
            elif typing.get_args(member)[:1] == (str,):
                out.append("a list of strings")
            elif isinstance(member, type) and member.__name__ != "Tensor":
                out.append(f"a {member.__name__}")
            elif typing.get_origin(member) in _CONTAINERS:
                out.append(f"a {typing.get_origin(member).__name__}")
            else:
                out.append("a tensor")
        return " or ".join(dict.fromkeys(out))


def check_arguments(fn: Callable[..., Any], arguments: dict[str, Any]) -> None:
    """Check ``arguments`` (name -> value, as bound to ``fn``) by ``fn``'s annotations and :data:`NAMED`.

    For code that cannot take the decorator (a method that binds its own arguments, a function that
    builds its arguments itself): ``check_arguments(fn, {"layers": layers, "model": model})``.
    """
    for parameter in _parameters(fn):
        if parameter.name in arguments:
            parameter.check(arguments[parameter.name], arguments)


@functools.cache
def _parameters(fn: Callable[..., Any]) -> tuple[_Parameter, ...]:
    namespace = {**vars(__import__("builtins")), **getattr(inspect.unwrap(fn), "__globals__", {})}
    signature = inspect.signature(fn)
    own = _OWN_RULES.get(inspect.unwrap(fn), {})
    return tuple(_Parameter(p, namespace, own.get(p.name)) for p in signature.parameters.values()
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def checked(fn: Callable[..., Any] | None = None, **rules: Rule) -> Any:
    """Decorate a public function so that its arguments are checked before its body runs.

    The checks come from the signature (see the section comment above :data:`NAMED`); a
    bad argument raises an :class:`~interp.errors.InterpError` naming it and what to pass.
    ``@checked(name=rule)`` gives one parameter a rule of its own, in place of the one its
    name has in :data:`NAMED` (a rule is ``(value, name, arguments) -> None``).

    Example:
        >>> @checked
        ... def pick(layers: list[int] | None = None, seed: int = 0) -> int:
        ...     return seed
        >>> pick(seed=3)
        3
        >>> pick(seed=True)
        Traceback (most recent call last):
        ...
        interp.errors.DataError: seed must be an integer, got True (bool). Pass a whole number such as 8.
        >>> pick(layers=[1, 1])
        Traceback (most recent call last):
        ...
        interp.errors.ComponentError: layers holds 1 twice; give each of the layers once.
    """
    if fn is None:
        return lambda function: checked(function, **rules)
    signature = inspect.signature(fn)
    if rules:
        _OWN_RULES[inspect.unwrap(fn)] = rules

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise InterpError(f"{fn.__qualname__}(): {exc}. See help({fn.__module__}.{fn.__qualname__}) for its "
                              "arguments.") from None
        try:
            check_arguments(fn, bound.arguments)
        except InterpError as exc:
            own = _OWN_ERRORS.get(inspect.unwrap(fn))
            if own is None or isinstance(exc, own):
                raise
            raise own(str(exc)) from None
        return fn(*args, **kwargs)

    wrapper.__checked__ = True  # type: ignore[attr-defined]
    return wrapper


_OWN_RULES: dict[Any, dict[str, Rule]] = {}
_OWN_ERRORS: dict[Any, type[InterpError]] = {}  # a class whose every refusal is its own kind (SpecError)


def checked_class(cls: Any = None, *, error: type[InterpError] | None = None, **rules: Rule) -> Any:
    """Decorate a public class so that its constructor and every public method check their arguments (:func:`checked`).

    Put it above ``@dataclass`` (whose ``__init__`` it then wraps); ``rules`` apply to every method, as in ``checked``;
    ``error`` makes every refusal that class of :class:`~interp.errors.InterpError` (a spec's are SpecErrors).

    Example:
        >>> from dataclasses import dataclass
        >>> @checked_class
        ... @dataclass(frozen=True)
        ... class Pick:
        ...     layer: int
        ...     def shifted(self, by: int) -> int:
        ...         return self.layer + by
        >>> Pick(1).shifted(2)
        3
        >>> Pick(0.5)
        Traceback (most recent call last):
        ...
        interp.errors.ComponentError: layer must be an integer, got 0.5 (float). Pass a whole number such as 8.
    """
    if cls is None:
        return lambda klass: checked_class(klass, error=error, **rules)
    for name, member in list(vars(cls).items()):
        if name.startswith("_") and name != "__init__":
            continue
        function = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
        if not inspect.isfunction(function) or getattr(function, "__checked__", False):
            continue
        if error is not None:
            _OWN_ERRORS[inspect.unwrap(function)] = error
        wrapped = checked(function, **rules)
        setattr(cls, name, type(member)(wrapped) if isinstance(member, (classmethod, staticmethod)) else wrapped)
    cls.__checked__ = True
    return cls
