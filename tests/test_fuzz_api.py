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
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import interp
from interp.errors import InterpError

ROOT = Path(__file__).resolve().parents[1]
CALL_TIMEOUT_S = 20
SPEC = "rtn:bits=4,group=32"
EXAMPLES_PER_FUNCTION = 12
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
    **dict.fromkeys(("prompt", "positive", "negative"), lambda w: "The cat sat on"),
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
    @settings(max_examples=EXAMPLES_PER_FUNCTION, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(parameter=st.sampled_from(names), value=HOSTILE)
    def fuzz(parameter: str, value: Any) -> None:
        kwargs = {**base_arguments(name, fn, world), parameter: value}
        problem = verdict(fn, kwargs, budget)
        assert problem is None, f"{name}({parameter}={value!r}): {problem}"

    fuzz()
