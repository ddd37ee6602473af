"""Every public function, fuzzed from its signature: a hostile argument gives a clear error or a finite result.

The functions are those of the API reference (the ``__all__`` of each package that
``docs/build_api.py`` documents), enumerated here, not listed: a new public function is fuzzed as
soon as it is exported. For each one, hypothesis draws one parameter and a hostile value for it
(wrong types, bools, floats, negatives, 2**64, NaN, inf, empty and duplicated lists, "meta",
out-of-range indices) while the other parameters keep valid base values on a tiny random model.
The call must either raise an :class:`interp.errors.InterpError` or return a result with no NaN
or inf in it, within ``CALL_TIMEOUT_S``.

The valid base values come from :data:`BASE`, keyed by parameter name (shared conventions such
as ``model``, ``examples``, ``layers``), with :data:`OVERRIDES` for the few functions whose
parameter of a common name means something else. A new function whose required parameter has
no base value fails :func:`test_every_public_function_has_base_arguments`, saying which to add.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import interp
from interp.errors import InterpError

ROOT = Path(__file__).resolve().parents[1]
CALL_TIMEOUT_S = 20
SPEC = "rtn:bits=4,group=32"
EXAMPLES_PER_FUNCTION = int(os.environ.get("INTERP_FUZZ_EXAMPLES", "12"))
# The suite draws the same values every run (derandomized); benchmarks/fuzz_nightly.py sets INTERP_FUZZ_SEED to draw
# fresh ones from a recorded seed, with more examples, so new hostile values are tried without making CI flaky.
FUZZ_SEED = os.environ.get("INTERP_FUZZ_SEED")
FUZZ = {"derandomize": FUZZ_SEED is None, "database": None, "deadline": None,
        "phases": (Phase.explicit, Phase.generate), "suppress_health_check": list(HealthCheck)}


def _seeded(test: Any) -> Any:
    """Draw from ``INTERP_FUZZ_SEED`` when it is set (the nightly run); otherwise leave the test derandomized."""
    return seed(int(FUZZ_SEED))(test) if FUZZ_SEED is not None else test
# Not fuzzed, with the reason: functions whose only caller is a library, not a user.
EXCLUDED = {
    "interp.attention.saobp_attention_forward": "called by transformers inside a model's forward with its tensors",
    "interp.attention.register_saobp_attention": "takes no arguments",
}


def _api_packages() -> tuple[str, ...]:
    spec = importlib.util.spec_from_file_location("build_api", ROOT / "docs" / "build_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.PACKAGES)


def public_functions() -> dict[str, Callable[..., Any]]:
    """``qualified name -> function`` for every function exported by a documented package (first name wins)."""
    found: dict[str, Callable[..., Any]] = {}
    seen: set[int] = set()
    for package in _api_packages():
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or inspect.isclass(obj) or not callable(obj):
                continue
            key = id(inspect.unwrap(obj))
            if key not in seen:
                seen.add(key)
                found[f"{package}.{name}"] = obj
    return found


FUNCTIONS = {name: fn for name, fn in public_functions().items() if name not in EXCLUDED}


# ---------------------------------------------------------------------------------------
# Valid base arguments


class World:
    """The tiny objects that valid arguments are made of, built once per module."""

    def __init__(self, folder: Path) -> None:
        generator = torch.Generator().manual_seed(0)
        self.folder = folder
        self.model = interp.tiny_model("llama")
        self.examples = interp.Examples.from_tokens(torch.randint(0, 256, (4, 8), generator=generator),
                                                    ids=["a", "b", "c", "d"])
        self.pattern = torch.softmax(torch.randn(1, 2, 6, 6, generator=generator), dim=-1)
        self.weight = torch.randn(8, 64, generator=generator)
        self.inputs = torch.randn(32, 64, generator=generator)
        self.errors = pd.DataFrame({SPEC: [0.1, 0.4, 0.2, 0.3], "nf:bits=4,group=32": [0.2, 0.5, 0.1, 0.3]},
                                   index=pd.Index(["a", "b", "c", "d"], name="id"))
        text = folder / "text.txt"
        text.write_text("\n\n".join(f"Paragraph {i} has a few plain words in it." for i in range(8)))
        self.text = text
        self._quantized: Any = None
        self._saved: Path | None = None

    @property
    def quantized(self) -> Any:
        if self._quantized is None:
            self._quantized = interp.quantize(self.model, SPEC, progress=False)
        return self._quantized

    @property
    def saved(self) -> Path:
        if self._saved is None:
            from interp.quant import save_quantized

            self._saved = save_quantized(self.quantized, self.folder / "saved")
        return self._saved

    def hf_llama(self) -> Any:
        from interp.attention import build_llama

        return build_llama(LLAMA_CONFIG, seed=0)


_COUNTER = iter(range(10**9))
LLAMA_CONFIG = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                "num_attention_heads": 2, "num_key_value_heads": 1}


def _patches(world: World) -> Any:
    from interp.localize.patching import Patch

    return [Patch("resid_pre", (1,))]


BASE: dict[str, Callable[[World], Any]] = {
    **dict.fromkeys(("model", "reference", "target", "source", "model_or_patterns"), lambda w: w.model),
    **dict.fromkeys(("examples", "calibration", "d_large", "d_ctrl", "source_examples"), lambda w: w.examples),
    **dict.fromkeys(("prompts", "clean"), lambda w: ["The cat sat on", "A dog ran to"]),
    "corrupt": lambda w: ["The dog ran to", "A cat sat on"],  # differs from clean: a gap to recover
    **dict.fromkeys(("prompt", "positive"), lambda w: "The cat sat on"),
    "negative": lambda w: "A dog ran to",  # not the positive prompt: a steering vector that is not zero
    "answer": lambda w: ["x", "y"],
    "wrong": lambda w: ["y", "x"],  # not the answer: a logit difference that is not zero
    "pattern": lambda w: w.pattern,
    **dict.fromkeys(("beta", "saobp_beta"), lambda w: 1.0),
    **dict.fromkeys(("W", "W_hat"), lambda w: w.weight),
    "X": lambda w: w.inputs,
    "spec": lambda w: SPEC,
    "specs": lambda w: [SPEC],
    "store": lambda w: w.folder / "store",
    "path": lambda w: w.folder / "out",
    "errors": lambda w: w.errors,
    "quantized_models": lambda w: {SPEC: w.quantized},
    "patches": _patches,
    "tokenizer": lambda w: w.model.tokenizer,
    "texts": lambda w: ["one two three", "four five six"],
    "source": lambda w: w.text,
    "n": lambda w: 2,
    "seq_len": lambda w: 8,
    "n_queries": lambda w: 6,
    "values": lambda w: torch.arange(6.0).reshape(2, 3),
    "mask": lambda w: torch.tensor([[True, False, True], [True, True, False]]),
    "config_kwargs": lambda w: dict(LLAMA_CONFIG),
    "labels": lambda w: [0, 1],
    "vector": lambda w: torch.ones(64),
    "layer": lambda w: 0,
    "component": lambda w: "resid_post",
    "name_or_path": lambda w: w.saved,
    "senders": lambda w: ["head 1.0", "mlp 0"],
}
"""Parameter name -> a valid value (what a required parameter takes when another one is fuzzed)."""

OVERRIDES: dict[tuple[str, str], Callable[[World], Any]] = {
    ("interp.quant.load_quantized", "path"): lambda w: w.saved,
    ("interp.quant.save_quantized", "model"): lambda w: w.quantized,
    ("interp.quant.save_quantized", "path"): lambda w: w.folder / f"saved-{next(_COUNTER)}",
    ("interp.patch", "source"): lambda w: w.model,
    ("interp.attention.capture_prior_patterns", "model"): lambda w: w.hf_llama(),
    ("interp.attention.saobp_betas", "model"): lambda w: w.hf_llama(),
}

# Optional parameters given a cheaper value than their default in every call (fewer bootstrap resamples).
CHEAP = {"n_boot": 20, "progress": False, "batch_size": 2}
# Optional parameters some functions need (one of two alternatives) or run slowly without.
EXTRA: dict[str, dict[str, Callable[[World], Any]]] = {
    "interp.quant.prescribe": {"calibration": lambda w: w.examples, "method": lambda w: "rtn",
                               "bits": lambda w: (2, 4), "budget": lambda w: 3.5, "group": lambda w: 32},
    "interp.quant.error_split": {"store": lambda w: w.folder / f"split-{next(_COUNTER)}"},
    "interp.attention_view": {"prompt": lambda w: "The cat sat on"},
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The tiny objects, with the working folder and the cache in a temporary folder: a fuzzed path or
    cache_dir (random text) is created there, never in the repository."""
    folder = tmp_path_factory.mktemp("fuzz")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setenv("INTERP_CACHE", str(folder / "cache"))
        yield World(folder)


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def base_value(name: str, parameter: str, world: World) -> Any:
    make = OVERRIDES.get((name, parameter)) or BASE[parameter]
    return make(world)


def base_arguments(name: str, fn: Callable[..., Any], world: World) -> dict[str, Any]:
    out = {}
    for p in _parameters(fn):
        if p.default is p.empty:
            out[p.name] = base_value(name, p.name, world)
        elif p.name in EXTRA.get(name, {}):
            out[p.name] = EXTRA[name][p.name](world)
        elif p.name in CHEAP:
            out[p.name] = CHEAP[p.name]
    if "store" in out:  # each call its own store: a fuzzed call must not meet an earlier one's rows
        out["store"] = world.folder / f"store-{next(_COUNTER)}"
    return out


def test_every_public_function_has_base_arguments():
    missing = [f"{name}({p.name})" for name, fn in FUNCTIONS.items() for p in _parameters(fn)
               if p.default is p.empty and p.name not in BASE and (name, p.name) not in OVERRIDES]
    assert missing == [], f"add a valid base value to BASE (tests/test_fuzz_api.py) for: {missing}"
    assert len(FUNCTIONS) >= 40  # the enumeration found the API (not an empty list that passes)


# ---------------------------------------------------------------------------------------
# Hostile values and the verdict on one call


HOSTILE = st.one_of(
    st.sampled_from([True, False, None, 0, -1, 1, 2**64, -(2**64), 10**6, 0.5, 5.7, -0.0, math.nan, math.inf,
                     -math.inf, "", "meta", "01", "x", [], [0, 0], [1, 1, 0], [-1], [0.5], [True], ["a"], (),
                     {}, {"a": 1}, b"\x00", object(), torch.tensor([]), torch.tensor([math.nan]),
                     torch.full((2, 3), math.inf), torch.zeros(2, 2, dtype=torch.long), np.float64("nan")]),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.lists(st.integers(min_value=-3, max_value=300), max_size=4),
    st.text(max_size=4),
)


class CallTimeout(BaseException):
    """Raised by the alarm when one call runs past CALL_TIMEOUT_S (a BaseException: nothing swallows it)."""


def _alarm(signum, frame):
    raise CallTimeout


def non_finite(value: Any, depth: int = 0) -> str | None:
    """Where a result holds NaN or inf (a description), or None when all of it is finite."""
    if depth > 4:
        return None
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.numel() and not bool(value.isfinite().all()):
            return f"tensor {tuple(value.shape)}"
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, np.ndarray) and value.dtype.kind == "f" and not np.isfinite(value).all():
        return f"array {value.shape}"
    if isinstance(value, pd.DataFrame):
        numeric = value.select_dtypes("number")
        return None if np.isfinite(numeric.to_numpy(dtype=float)).all() else f"frame {list(numeric.columns)}"
    if isinstance(value, pd.Series) and value.dtype.kind == "f":
        return None if np.isfinite(value.to_numpy()).all() else "series"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value) if f.name != "settings")
    elif isinstance(value, dict):
        items = ((str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(value[:64]))
    else:
        return None
    for key, item in items:
        where = non_finite(item, depth + 1)
        if where is not None:
            return f"{key}: {where}"
    return None


def verdict(fn: Callable[..., Any], kwargs: dict[str, Any], budget: float = CALL_TIMEOUT_S) -> str | None:
    """None when the call raised an InterpError or returned a finite result within ``budget`` seconds; else what
    went wrong."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    # the real-time timer is shared with pytest-timeout's signal method: its remaining time is put back after
    outer, _ = signal.setitimer(signal.ITIMER_REAL, budget)
    start = time.monotonic()
    try:
        result = fn(**kwargs)
        if inspect.isgenerator(result) or hasattr(result, "__enter__"):
            with result:
                pass
            return None
    except InterpError as exc:
        return None if str(exc).strip() and "\n" not in str(exc).strip() else f"InterpError without one line: {exc!r}"
    except CallTimeout:
        return f"no answer within {budget:.0f} s"
    except Exception as exc:  # noqa: BLE001 - any other exception is the finding
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 0.001))
    where = non_finite(result)
    return None if where is None else f"returned NaN/inf ({where})"


def _fuzzable(name: str) -> bool:
    return bool(_parameters(FUNCTIONS[name]))


def _base_call(name: str, fn: Callable[..., Any], world: World) -> tuple[Any, float]:
    """The base call's result and its seconds (its context entered and left, as verdict does)."""
    start = time.monotonic()
    result = fn(**base_arguments(name, fn, world))  # no error allowed here
    if hasattr(result, "__enter__"):
        with result:
            pass
    return result, time.monotonic() - start


@pytest.mark.parametrize("name", [n for n in FUNCTIONS if _fuzzable(n)])
def test_base_arguments_are_valid(name, world):
    """The base call itself succeeds with a finite result: otherwise every fuzzed call would pass trivially."""
    fn = FUNCTIONS[name]
    result, _ = _base_call(name, fn, world)
    assert non_finite(result) is None


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in FUNCTIONS if _fuzzable(n)])
def test_hostile_argument_gives_a_clear_error_or_a_finite_result(name, world):
    fn = FUNCTIONS[name]
    names = [p.name for p in _parameters(fn)]
    # a hang is judged against what the valid call costs on this machine now (imports and the world's lazy files
    # warmed by this first call): a loaded 2-core CI machine can take 20 s for a call that takes 1 s alone
    _, seconds = _base_call(name, fn, world)
    budget = max(CALL_TIMEOUT_S, 10 * seconds)

    # no shrinking: the values are already small, and a shrink would rerun a slow call dozens of times
    @settings(max_examples=EXAMPLES_PER_FUNCTION, **FUZZ)
    @_seeded
    @given(parameter=st.sampled_from(names), value=HOSTILE)
    def fuzz(parameter: str, value: Any) -> None:
        kwargs = {**base_arguments(name, fn, world), parameter: value}
        problem = verdict(fn, kwargs, budget)
        assert problem is None, f"{name}({parameter}={value!r}): {problem}"

    fuzz()


# ---------------------------------------------------------------------------------------
# The deep functions the flat API wraps, and the classes of the API (issue 45): checked and fuzzed too.
#
# Both are enumerated, not listed: the deep functions are the public functions of interp.localize that a
# function of the reference calls (read from its source), and the classes are those the reference exports
# plus every interp class a public or deep function takes as an argument, with their interp subclasses.


DEEP_PACKAGES = ("interp.localize.",)


def deep_functions() -> dict[str, Callable[..., Any]]:
    """``module.name -> function`` for each public function of interp.localize that a public function calls."""
    import ast
    import textwrap
    import types

    public = {id(inspect.unwrap(fn)) for fn in FUNCTIONS.values()}
    found: dict[str, Callable[..., Any]] = {}
    for fn in FUNCTIONS.values():
        inner = inspect.unwrap(fn)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(inner)))
        except (OSError, TypeError):
            continue
        names = inner.__globals__
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            target = None
            if isinstance(node.func, ast.Name):
                target = names.get(node.func.id)
            elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
                owner = names.get(node.func.value.id)
                target = getattr(owner, node.func.attr, None) if isinstance(owner, types.ModuleType) else None
            if target is None or not inspect.isfunction(inspect.unwrap(target)):
                continue
            module, name = target.__module__, target.__name__
            deep = module.startswith(DEEP_PACKAGES) and not name.startswith("_")
            if deep and id(inspect.unwrap(target)) not in public:
                found[f"{module}.{name}"] = target
    return found


DEEP = deep_functions()


def _interp_classes(annotation: Any, out: set[type]) -> None:
    import typing

    if inspect.isclass(annotation):
        private = any(part.startswith("_") for part in annotation.__module__.split("."))  # interp.quant.methods._common
        if (annotation.__module__.startswith("interp.") and not private and not issubclass(annotation, BaseException)
                and not getattr(annotation, "_is_protocol", False)):
            out.add(annotation)
        return
    for arg in typing.get_args(annotation):
        _interp_classes(arg, out)


def api_classes() -> dict[str, type]:
    """``module.Class -> class``: exported by a documented package, or taken as an argument by a public or deep
    function (annotations resolved), with the interp subclasses of those."""
    import typing

    found: set[type] = set()
    for package in _api_packages():
        module = importlib.import_module(package)
        for name in module.__all__:
            _interp_classes(getattr(module, name), found)
    for fn in [*FUNCTIONS.values(), *DEEP.values()]:
        try:
            hints = typing.get_type_hints(inspect.unwrap(fn))
        except Exception:  # noqa: BLE001 - an annotation imported for type checking only
            hints = {}
        for key, hint in hints.items():
            if key != "return":
                _interp_classes(hint, found)
    for cls in list(found):
        found.update(sub for sub in cls.__subclasses__() if sub.__module__.startswith("interp."))
    return {f"{cls.__module__}.{cls.__qualname__}": cls for cls in sorted(found, key=lambda c: c.__qualname__)}


CLASSES = api_classes()


def class_callables(cls: type) -> dict[str, Callable[..., Any]]:
    """The constructor and every public method (classmethods and staticmethods too) a class defines itself."""
    out = {}
    for name, member in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        function = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
        if inspect.isfunction(function):
            out[name] = function
    return out


def test_the_walk_finds_the_deep_functions_and_classes():
    """The enumeration is not empty and holds what the issue names (it can fail: a rename is noticed)."""
    assert {"interp.localize.dla.logit_attribution", "interp.localize.eap.edge_attribution",
            "interp.localize.paths.path_patch", "interp.localize.circuit.answer_ids"} <= set(DEEP), sorted(DEEP)
    names = {cls.__name__ for cls in CLASSES.values()}
    assert {"Sender", "LogitDiffMetric", "Examples", "TunedLens", "ProbeResult", "Patch", "MethodSpec"} <= names, names


@pytest.mark.parametrize("name", sorted(DEEP))
def test_every_deep_function_is_checked(name):
    assert getattr(DEEP[name], "__checked__", False), f"{name} lacks interp.validate.checked"


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_api_class_checks_its_constructor_and_methods(name):
    """Every constructor and public method of the API's classes goes through the argument checker
    (interp.validate.checked_class)."""
    cls = CLASSES[name]
    unchecked = [method for method, fn in class_callables(cls).items() if not getattr(fn, "__checked__", False)]
    assert unchecked == [], f"{name}: {unchecked} lack interp.validate.checked (decorate the class with checked_class)"


# Valid instances and the arguments their callables take (by parameter name; a few per class and method).


def _instances(world: World) -> dict[str, Callable[[], Any]]:
    from interp.attention import SAOBPConfig
    from interp.localize.patching import LogitDiffMetric, Patch
    from interp.localize.patching.metrics import Metric, NLLMetric
    from interp.localize.paths import Sender
    from interp.localize.tuned_lens import fit_tuned_lens
    from interp.quant import MethodSpec, ScoreStore, Sensitivity
    from interp.quant.prescribe import Plan
    from interp.runtime.swap import WeightStash

    return {
        "Examples": lambda: world.examples,
        "ModelInfo": lambda: world.model.info,
        "ProbeResult": lambda: interp.probe(world.model, world.examples, ["resid_post"], ["norm"], progress=False),
        "SAOBPConfig": lambda: SAOBPConfig(layers=[0]),
        "MethodSpec": lambda: MethodSpec("rtn", 4, 32),
        "QuantInfo": lambda: world.quantized.quant_info,
        "ScoreStore": lambda: ScoreStore(world.folder / f"class-store-{next(_COUNTER)}"),
        "Plan": lambda: Plan(SPEC, {}, 4.0, 4.0, (4.0, 4.0), "interp"),
        "Sensitivity": lambda: Sensitivity(SPEC, [0, 0], ["q", "k"], [64, 64],
                                           np.random.default_rng(0).normal(size=(2, 4))),
        "Sender": lambda: Sender("head", 1, 0),
        "Patch": lambda: Patch("resid_pre", (1,)),
        "TunedLens": lambda: fit_tuned_lens(world.model, interp.Examples.from_tokens(
            torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))), progress=False),
        "WeightStash": lambda: WeightStash(world.model),
        "Metric": lambda: Metric(),
        "NLLMetric": lambda: NLLMetric(),
        "LogitDiffMetric": lambda: LogitDiffMetric(65, 66),
    }


def _constructor_arguments(name: str, instance: Any, world: World) -> dict[str, Any]:
    if dataclasses.is_dataclass(instance):
        return {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance) if f.init}
    return {"ScoreStore": {"path": world.folder / f"class-store-{next(_COUNTER)}"},
            "LogitDiffMetric": {"answers": 65, "wrongs": 66}}.get(name, {})


METHOD_BASE: dict[str, Callable[[World], Any]] = {
    "index": lambda w: [0, 1], "tokens": lambda w: w.examples.tokens, "component": lambda w: "resid_post",
    "reducer": lambda w: "norm", "folder": lambda w: w.folder / f"saved-{next(_COUNTER)}",
    "path": lambda w: w.folder / f"saved-{next(_COUNTER)}.safetensors", "layer_idx": lambda w: 0,
    "layer": lambda w: 0, "role": lambda w: "q", "key": lambda w: "k", "value": lambda w: 1,
    "model": lambda w: "m", "spec": lambda w: SPEC, "ids": lambda w: ["a", "b"], "nll": lambda w: [0.5, 0.25],
    "examples": lambda w: w.examples, "batch": lambda w: "b0", "done": lambda w: (lambda: False),
    "values": lambda w: torch.zeros(2, 7), "lengths": lambda w: torch.tensor([8, 8, 8, 8]),
    "what": lambda w: "target", "resid": lambda w: torch.zeros(4, 8, 64),
    "readout": lambda w: __import__("interp.runtime.readout", fromlist=["Readout"]).Readout(w.model),
    "logits": lambda w: torch.zeros(4, 8, 259).normal_(generator=torch.Generator().manual_seed(0)),
}
# parameters whose meaning differs per class
METHOD_OVERRIDES: dict[tuple[str, str, str], Callable[[World], Any]] = {
    ("TunedLens", "translate", "index"): lambda w: 0,
    ("TunedLens", "check_fits", "model"): lambda w: w.model,
    **{(metric, method, "index"): (lambda w: torch.arange(4)) for metric in ("NLLMetric", "LogitDiffMetric")
       for method in ("from_resid", "from_logits")},
    ("WeightStash", "__init__", "model"): lambda w: w.model,
    ("TunedLens", "translate", "resid"): lambda w: torch.zeros(2, 64),
    ("Examples", "from_tokens", "tokens"): lambda w: torch.randint(0, 256, (2, 5)),
    ("Examples", "subset", "index"): lambda w: [0, 1],
    ("Metric", "aggregate", "values"): lambda w: torch.zeros(2, 7),
}


# Not fuzzed, with the reason.
ABSTRACT = {("interp.localize.patching.metrics.Metric", "from_resid"): "the base class's: each metric defines it",
            ("interp.localize.patching.metrics.Metric", "from_logits"): "the base class's: each metric defines it"}


def _method_calls(world: World) -> list[tuple[str, str]]:
    return [(cls_name, method) for cls_name, cls in CLASSES.items() for method in class_callables(cls)
            if method != "__init__" and _parameters(class_callables(cls)[method])[1:]
            and (cls_name, method) not in ABSTRACT]


def _method_base(cls_name: str, method: str, fn: Callable[..., Any], world: World) -> dict[str, Any]:
    short = cls_name.rsplit(".", 1)[1]
    out = {}
    for p in _parameters(fn)[1:]:  # self or cls
        key = (short, method, p.name)
        if key in METHOD_OVERRIDES:
            out[p.name] = METHOD_OVERRIDES[key](world)
        elif p.default is p.empty:
            out[p.name] = METHOD_BASE[p.name](world)
    return out


def test_every_api_class_has_a_valid_instance_and_method_arguments(world):
    instances = _instances(world)
    missing = [name for name in CLASSES if name.rsplit(".", 1)[1] not in instances]
    assert missing == [], f"add a valid instance to _instances (tests/test_fuzz_api.py) for: {missing}"
    for cls_name, method in _method_calls(world):
        fn = class_callables(CLASSES[cls_name])[method]
        needs = [p.name for p in _parameters(fn)[1:] if p.default is p.empty
                 and p.name not in METHOD_BASE and (cls_name.rsplit(".", 1)[1], method, p.name) not in METHOD_OVERRIDES]
        assert needs == [], f"add base values for {cls_name}.{method}: {needs}"


def _bound(cls_name: str, method: str, world: World) -> tuple[Callable[..., Any], dict[str, Any]]:
    cls, short = CLASSES[cls_name], cls_name.rsplit(".", 1)[1]
    fn = class_callables(cls)[method]
    if method == "__init__":
        instance = _instances(world)[short]()
        return cls, _constructor_arguments(short, instance, world)
    owner = cls if isinstance(vars(cls)[method], (classmethod, staticmethod)) else _instances(world)[short]()
    return getattr(owner, method), _method_base(cls_name, method, fn, world)


CLASS_CALLS = [(c, "__init__") for c in CLASSES if "__init__" in class_callables(CLASSES[c])
               and _parameters(class_callables(CLASSES[c])["__init__"])[1:]]


@pytest.mark.parametrize("cls_name, method", CLASS_CALLS + _method_calls(None))
def test_a_class_callable_gives_a_clear_error_or_a_finite_result(cls_name, method, world):
    """Hostile values, one parameter at a time, into every constructor and method of the API's classes
    (derandomized, like the functions above): an InterpError or a finite result, never a raw exception."""
    call, base = _bound(cls_name, method, world)
    assert verdict(call, dict(base)) is None, f"{cls_name}.{method} fails on its valid base arguments"
    names = [p.name for p in _parameters(class_callables(CLASSES[cls_name])[method])[1:]]

    @settings(max_examples=max(8, EXAMPLES_PER_FUNCTION * 2 // 3), **FUZZ)
    @_seeded
    @given(parameter=st.sampled_from(names), value=HOSTILE)
    def fuzz(parameter: str, value: Any) -> None:
        fresh_call, fresh = _bound(cls_name, method, world)
        problem = verdict(fresh_call, {**fresh, parameter: value})
        assert problem is None, f"{cls_name}.{method}({parameter}={value!r}): {problem}"

    fuzz()


DEEP_BASE: dict[str, Callable[[World], Any]] = {
    "answers": lambda w: ["x", "y"], "target": lambda w: 65, "x": lambda w: torch.randn(8, 4),
    "y": lambda w: torch.tensor([0, 1] * 4), "n_classes": lambda w: 2, "ids": lambda w: [65, 66],
}
DEEP_OVERRIDES: dict[tuple[str, str], Callable[[World], Any]] = {
    **{(name, "senders"): (lambda w: [__import__("interp.localize.paths", fromlist=["Sender"]).Sender("head", 1, 0)])
       for name in ("interp.localize.eap.edge_attribution", "interp.localize.paths.path_patch")},
    **{(name, "source_examples"): (lambda w: interp.Examples.from_tokens(w.examples.tokens.flip(1)))
       for name in ("interp.localize.eap.edge_attribution", "interp.localize.paths.path_patch")},
}


def _deep_arguments(name: str, fn: Callable[..., Any], world: World) -> dict[str, Any]:
    out = {}
    for p in _parameters(fn):
        if (name, p.name) in DEEP_OVERRIDES:
            out[p.name] = DEEP_OVERRIDES[(name, p.name)](world)
        elif p.default is p.empty:
            out[p.name] = (DEEP_BASE.get(p.name) or BASE[p.name])(world)
        elif p.name in CHEAP:
            out[p.name] = CHEAP[p.name]
    return out


@pytest.mark.parametrize("name", sorted(DEEP))
def test_a_deep_function_gives_a_clear_error_or_a_finite_result(name, world):
    fn = DEEP[name]
    assert verdict(fn, _deep_arguments(name, fn, world)) is None, f"{name} fails on its valid base arguments"
    names = [p.name for p in _parameters(fn)]

    @settings(max_examples=EXAMPLES_PER_FUNCTION, **FUZZ)
    @_seeded
    @given(parameter=st.sampled_from(names), value=HOSTILE)
    def fuzz(parameter: str, value: Any) -> None:
        problem = verdict(fn, {**_deep_arguments(name, fn, world), parameter: value})
        assert problem is None, f"{name}({parameter}={value!r}): {problem}"

    fuzz()


def test_with_the_checker_switched_off_the_walk_finds_raw_errors(world, monkeypatch):
    """The class and deep-function fuzz fails with the one place switched off (interp.validate.check_arguments a
    no-op): a method and a deep function then raise raw exceptions that the checked calls turn into InterpErrors."""
    from interp.localize.prompts import token_strings

    calls = [(world.examples.subset, {"index": [10]}), (token_strings, {"model": world.model, "ids": [10**30]})]
    assert all(verdict(fn, kwargs) is None for fn, kwargs in calls)  # checked: clear errors
    monkeypatch.setattr("interp.validate.check_arguments", lambda fn, arguments: None)
    found = [verdict(fn, kwargs) for fn, kwargs in calls]
    assert all(problem is not None and "InterpError" not in problem for problem in found), found
