"""Hostile inputs to the library: each gives an InterpError subclass, never a raw exception or a result.

Table-driven: every case is (category, name, run, expected). ``run(tmp_path)`` calls the
library; ``expected`` is either an InterpError subclass that must be raised, or a
:class:`Valid` check for an input that is in fact valid (then the result must be right).
A case fails on a raw Python exception (a traceback in the user's face) and on a silent
result where an error was due. The CLI's hostile inputs are in ``test_bad_input.py``.

Property tests (hypothesis) cover method specs (random and near-valid strings: a valid
parse or a SpecError, nothing else) and attention patterns (valid causal patterns: finite
metrics in range; broken ones: InterpError).
"""

from __future__ import annotations

import functools
import json
import math
import sqlite3
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import interp
from interp.attention import effective_span, entropy, gtd, saobp, saobp_hook, sink_share
from interp.data import Examples, load_examples
from interp.errors import ComponentError, DataError, InterpError, NonFiniteError, SpecError
from interp.localize import patching as P
from interp.quant.methods import quantize_weight
from interp.quant.spec import METHODS, parse_spec

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: thread hand-offs dominate


@dataclass(frozen=True)
class Valid:
    """The input is valid: ``check(result)`` asserts the result is right."""

    check: Callable[[Any], None]


@dataclass(frozen=True)
class Case:
    category: str
    name: str
    run: Callable[[Path], Any]
    expected: type[InterpError] | Valid


# ---------------------------------------------------------------------------------------
# Shared inputs (tiny and deterministic)


def causal(q: int = 5, batch: tuple[int, ...] = (2, 3), dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Random valid causal pattern [*batch, q, q]: rows sum to 1, zero above the diagonal."""
    gen = torch.Generator().manual_seed(q)
    raw = torch.rand(*batch, q, q, generator=gen, dtype=torch.float64) + 0.05
    raw = torch.tril(raw)
    return (raw / raw.sum(-1, keepdim=True)).to(dtype)


def poisoned(value: float, where: tuple[int, int] = (3, 1)) -> torch.Tensor:
    a = causal()
    a[..., where[0], where[1]] = value
    return a


def scaled_rows(factor: float) -> torch.Tensor:
    return causal() * factor


def negative_entry() -> torch.Tensor:
    a = causal()
    a[..., 3, 1] = -0.1  # the row still sums to 1, but one entry is negative
    a[..., 3, 0] = 1.0 - a[..., 3, 1:].sum(-1)
    return a


def padded_query() -> torch.Tensor:
    a = causal()
    a[..., 0, :] = 0.0  # a padded query: an all-zero row is allowed
    return a


@functools.cache
def tiny() -> Any:
    return interp.tiny_model("llama", seed=0, n_layers=2)


@functools.cache
def tiny_gpt2() -> Any:
    return interp.tiny_model("gpt2", seed=0, n_layers=2)


def rows(n: int = 3, t: int = 10, high: int = 256, seed: int = 0) -> Examples:
    tokens = torch.randint(0, high, (n, t), generator=torch.Generator().manual_seed(seed))
    tokens[:, 0] = 256
    return Examples.from_tokens(tokens)


def with_token(value: int) -> Examples:
    ex = rows()
    tokens = ex.tokens.clone()
    tokens[1, 4] = value
    return Examples.from_tokens(tokens)


def foreign_rows() -> Examples:
    """Rows whose ids fit the vocabulary but were made by another tokenizer."""
    return replace(rows(), tokenizer="0123456789abcdef", vocab_size=50_000)


def weight(scale: float = 1.0, shape: tuple[int, int] = (8, 64)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * scale


def extreme_weight() -> torch.Tensor:
    w = weight()
    w[0, 0], w[0, 1] = 3e38, -3e38
    return w


def text_file(tmp: Path, name: str, content: str | bytes) -> Path:
    path = tmp / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def long_text(tmp: Path) -> Path:
    docs = ["word " * 60 + f"doc {i}" for i in range(40)]
    return text_file(tmp, "docs.txt", "\n\n".join(docs))


def tok() -> Any:
    return tiny().tokenizer


def examples_from(tmp: Path, **kwargs: Any) -> Examples:
    args: dict[str, Any] = {"n": 2, "seq_len": 16, "split": "all"}
    args.update(kwargs)
    return load_examples(long_text(tmp), tok(), **args)


def store_with_other_schema(tmp: Path) -> Path:
    path = tmp / "scores.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE scores (a TEXT, b TEXT)")
    db.commit()
    db.close()
    return path


def score(tmp: Path, store: Any = None, examples: Examples | None = None, specs: Any = ("rtn:bits=4,group=32",),
          **kwargs: Any) -> Any:
    from interp.quant import score as score_fn

    return score_fn(tiny(), list(specs), examples if examples is not None else rows(), store or tmp / "store",
                    progress=False, **kwargs)


# ---------------------------------------------------------------------------------------
# Checks for valid inputs


def close_to(expected: Any, tol: float = 1e-12) -> Valid:
    # float64 patterns of a few entries: exact up to a few ulp (~1e-15); 1e-12 leaves room
    def check(result: Any) -> None:
        assert torch.allclose(torch.as_tensor(result).double(), torch.as_tensor(expected).double(), atol=tol, rtol=0)
    return Valid(check)


def finite_in(low: float, high: float) -> Valid:
    def check(result: Any) -> None:
        values = torch.as_tensor(result).double()
        assert torch.isfinite(values).all() and (values >= low).all() and (values <= high).all(), values
    return Valid(check)


def shape_is(*shape: int) -> Valid:
    def check(result: Any) -> None:
        assert tuple(result.shape) == shape
    return Valid(check)


def spec_is(text: str) -> Valid:
    def check(result: Any) -> None:
        assert str(result) == text
    return Valid(check)


def is_true(result: Any) -> None:
    assert result is True or bool(result)


def layers_are(expected: list[int]) -> Valid:
    def check(result: Any) -> None:
        assert list(result) == expected
    return Valid(check)


# ---------------------------------------------------------------------------------------
# The table

PATTERNS = [
    Case("patterns", "entropy NaN entry", lambda t: entropy(poisoned(math.nan)), InterpError),
    Case("patterns", "entropy +inf entry", lambda t: entropy(poisoned(math.inf)), InterpError),
    Case("patterns", "entropy -inf entry", lambda t: entropy(poisoned(-math.inf)), InterpError),
    Case("patterns", "entropy negative entry", lambda t: entropy(negative_entry()), InterpError),
    Case("patterns", "entropy rows sum to 2", lambda t: entropy(scaled_rows(2.0)), InterpError),
    Case("patterns", "entropy rows sum to 0.5", lambda t: entropy(scaled_rows(0.5)), InterpError),
    Case("patterns", "entropy rows sum to 1.001", lambda t: entropy(scaled_rows(1.001)), InterpError),
    Case("patterns", "normalized entropy rows sum to 2", lambda t: entropy(scaled_rows(2.0), normalized=True),
         InterpError),
    Case("patterns", "gtd NaN entry", lambda t: gtd(poisoned(math.nan)), InterpError),
    Case("patterns", "gtd rows sum to 2", lambda t: gtd(scaled_rows(2.0)), InterpError),
    Case("patterns", "gtd negative entry", lambda t: gtd(negative_entry()), InterpError),
    Case("patterns", "sink_share NaN entry", lambda t: sink_share(poisoned(math.nan)), InterpError),
    Case("patterns", "sink_share rows sum to 2", lambda t: sink_share(scaled_rows(2.0)), InterpError),
    Case("patterns", "effective_span inf entry", lambda t: effective_span(poisoned(math.inf)), InterpError),
    Case("patterns", "saobp NaN entry", lambda t: saobp(poisoned(math.nan), 1.0), InterpError),
    Case("patterns", "saobp negative entry", lambda t: saobp(negative_entry(), 1.0), InterpError),
    Case("patterns", "saobp rows sum to 2", lambda t: saobp(scaled_rows(2.0), 1.0), InterpError),
    Case("patterns", "saobp first-order rows sum to 3", lambda t: saobp(scaled_rows(3.0), 0.1, mode="first_order"),
         InterpError),
    Case("patterns", "entropy of an int tensor", lambda t: entropy(torch.eye(3, dtype=torch.long)), InterpError),
    Case("patterns", "entropy of a 1-D tensor", lambda t: entropy(torch.ones(3) / 3), InterpError),
    Case("patterns", "entropy of a list", lambda t: entropy([[1.0]]), InterpError),
    Case("patterns", "entropy of a transposed pattern", lambda t: entropy(torch.ones(4, 2) / 2), InterpError),
    Case("patterns", "gtd of a non-square pattern", lambda t: gtd(torch.ones(2, 4) / 4), InterpError),
    Case("patterns", "gtd alpha inf", lambda t: gtd(causal(), hops=3, alpha=math.inf), InterpError),
    Case("patterns", "gtd alpha NaN", lambda t: gtd(causal(), hops=3, alpha=math.nan), InterpError),
    Case("patterns", "gtd hops True", lambda t: gtd(causal(), hops=True), InterpError),
    Case("patterns", "sink_share sink out of range", lambda t: sink_share(causal(), sink=9), InterpError),
    Case("patterns", "sink_share sink True", lambda t: sink_share(causal(), sink=True), InterpError),
    Case("patterns", "sink_share sink 0.5", lambda t: sink_share(causal(), sink=0.5), InterpError),
    Case("patterns", "valid: padded query rows of zeros", lambda t: entropy(padded_query())[..., 0],
         close_to(torch.zeros(2, 3))),
    Case("patterns", "valid: float32 rows off by rounding",
         lambda t: entropy(causal(dtype=torch.float32) * (1 + 2e-7)), finite_in(0.0, math.log(5))),
    Case("patterns", "valid: bfloat16 pattern", lambda t: entropy(causal(dtype=torch.bfloat16)),
         finite_in(0.0, math.log(5) + 0.05)),
    Case("patterns", "valid: one-hot rows", lambda t: entropy(torch.eye(4)), close_to(torch.zeros(4))),
    Case("patterns", "valid: check=False skips the check", lambda t: entropy(scaled_rows(2.0), check=False),
         finite_in(-100.0, 100.0)),
]

BETA_AND_MASKS = [
    Case("beta/masks", "saobp beta inf (exact)", lambda t: saobp(causal(), math.inf), InterpError),
    Case("beta/masks", "saobp beta inf (first order)", lambda t: saobp(causal(), math.inf, mode="first_order"),
         InterpError),
    Case("beta/masks", "saobp beta NaN", lambda t: saobp(causal(), math.nan), InterpError),
    Case("beta/masks", "saobp beta -1", lambda t: saobp(causal(), -1.0), InterpError),
    Case("beta/masks", "saobp beta tensor with inf", lambda t: saobp(causal(), torch.tensor([1.0, math.inf, 1.0])),
         InterpError),
    Case("beta/masks", "saobp beta tensor with NaN", lambda t: saobp(causal(), torch.tensor([1.0, math.nan, 1.0])),
         InterpError),
    Case("beta/masks", "saobp beta a string", lambda t: saobp(causal(), "1.0"), InterpError),
    Case("beta/masks", "saobp beta True", lambda t: saobp(causal(), True), InterpError),
    Case("beta/masks", "saobp beta per head, wrong head count", lambda t: saobp(causal(), torch.ones(7)),
         InterpError),
    Case("beta/masks", "saobp_hook beta inf", lambda t: saobp_hook(math.inf), InterpError),
    Case("beta/masks", "saobp_hook beta NaN", lambda t: saobp_hook(math.nan), InterpError),
    Case("beta/masks", "saobp key_mask too short", lambda t: saobp(causal(), 1.0, key_mask=torch.ones(3, dtype=bool)),
         InterpError),
    Case("beta/masks", "saobp key_mask too long", lambda t: saobp(causal(), 1.0, key_mask=torch.ones(9, dtype=bool)),
         InterpError),
    Case("beta/masks", "saobp key_mask not broadcastable",
         lambda t: saobp(causal(), 1.0, key_mask=torch.ones(7, 5, dtype=torch.bool)), InterpError),
    Case("beta/masks", "saobp key_mask of ints", lambda t: saobp(causal(), 1.0, key_mask=torch.ones(5)), InterpError),
    Case("beta/masks", "entropy key_mask too short",
         lambda t: entropy(causal(), normalized=True, key_mask=torch.ones(3, dtype=torch.bool)), InterpError),
    Case("beta/masks", "entropy key_mask not broadcastable",
         lambda t: entropy(causal(), normalized=True, key_mask=torch.ones(7, 5, dtype=torch.bool)), InterpError),
    Case("beta/masks", "saobp scores with NaN",
         lambda t: saobp(causal(), 0.1, mode="first_order", scores=torch.full((5, 5), math.nan)), InterpError),
    Case("beta/masks", "saobp scores wrong shape",
         lambda t: saobp(causal(), 0.1, mode="first_order", scores=torch.zeros(4, 4)), InterpError),
    Case("beta/masks", "saobp mode unknown", lambda t: saobp(causal(), 1.0, mode="fast"), InterpError),
    Case("beta/masks", "saobp chunk 0", lambda t: saobp(causal(), 1.0, chunk=0), InterpError),
    Case("beta/masks", "valid: saobp beta 0 returns the pattern", lambda t: saobp(causal(), 0.0),
         close_to(causal(), 0)),
    Case("beta/masks", "valid: saobp beta 1e6 (exact) rows sum to 1", lambda t: saobp(causal(), 1e6).sum(-1),
         close_to(torch.ones(2, 3, 5), 1e-12)),
    Case("beta/masks", "valid: saobp key_mask of the right length",
         lambda t: saobp(causal(), 1.0, key_mask=torch.ones(5, dtype=torch.bool)), close_to(saobp(causal(), 1.0))),
]

SPECS = [
    Case("specs", "empty spec", lambda t: parse_spec(""), SpecError),
    Case("specs", "None", lambda t: parse_spec(None), SpecError),
    Case("specs", "an int", lambda t: parse_spec(3), SpecError),
    Case("specs", "unknown method", lambda t: parse_spec("int4:bits=3"), SpecError),
    Case("specs", "bits 0", lambda t: parse_spec("rtn:bits=0"), SpecError),
    Case("specs", "bits 3.5", lambda t: parse_spec("rtn:bits=3.5"), SpecError),
    Case("specs", "bits nan", lambda t: parse_spec("rtn:bits=nan"), SpecError),
    Case("specs", "bits 99", lambda t: parse_spec("rtn:bits=99"), SpecError),
    Case("specs", "bits missing", lambda t: parse_spec("rtn:group=64"), SpecError),
    Case("specs", "bits empty", lambda t: parse_spec("rtn:bits="), SpecError),
    Case("specs", "group 0", lambda t: parse_spec("rtn:bits=3,group=0"), SpecError),
    Case("specs", "group -64", lambda t: parse_spec("rtn:bits=3,group=-64"), SpecError),
    Case("specs", "duplicate key", lambda t: parse_spec("rtn:bits=3,bits=4"), SpecError),
    Case("specs", "unknown option", lambda t: parse_spec("rtn:bits=3,foo=1"), SpecError),
    Case("specs", "gptq damp inf", lambda t: parse_spec("gptq:bits=3,damp=inf"), SpecError),
    Case("specs", "gptq damp -1", lambda t: parse_spec("gptq:bits=3,damp=-1"), SpecError),
    Case("specs", "awq grid 0", lambda t: parse_spec("awq:bits=3,grid=0"), SpecError),
    Case("specs", "hqq bits 7", lambda t: parse_spec("hqq:bits=7"), SpecError),
    Case("specs", "key without value", lambda t: parse_spec("rtn:bits"), SpecError),
    Case("specs", "MethodSpec bits True", lambda t: interp.quant.MethodSpec("rtn", bits=True), SpecError),
    Case("specs", "MethodSpec method a list", lambda t: interp.quant.MethodSpec(["rtn"], bits=3), SpecError),
    Case("specs", "MethodSpec params a list", lambda t: interp.quant.MethodSpec("rtn", 3, 64, ["zero"]), SpecError),
    Case("specs", "valid: upper case and spaces", lambda t: parse_spec(" RTN : bits = 3 , group = 32 "),
         spec_is("rtn:bits=3,group=32,zero=float")),
    Case("specs", "valid: trailing comma", lambda t: parse_spec("nf:bits=4,"), spec_is("nf:bits=4,group=64")),
]

WEIGHTS = [
    Case("weights", "rtn on +-3e38", lambda t: quantize_weight(extreme_weight(), "rtn:bits=4,group=32"), SpecError),
    Case("weights", "nf on +-3e38", lambda t: quantize_weight(extreme_weight(), "nf:bits=4,group=32"), SpecError),
    Case("weights", "hqq on +-3e38", lambda t: quantize_weight(extreme_weight(), "hqq:bits=4,group=32"), SpecError),
    Case("weights", "awq on +-3e38",
         lambda t: quantize_weight(extreme_weight(), "awq:bits=4,group=32", torch.randn(16, 64)), SpecError),
    Case("weights", "empty weight [0, 64]", lambda t: quantize_weight(torch.zeros(0, 64), "rtn:bits=4"), SpecError),
    Case("weights", "empty weight [8, 0]", lambda t: quantize_weight(torch.zeros(8, 0), "rtn:bits=4"), SpecError),
    Case("weights", "1-D weight", lambda t: quantize_weight(torch.zeros(64), "rtn:bits=4"), SpecError),
    Case("weights", "int weight", lambda t: quantize_weight(torch.zeros(8, 64, dtype=torch.long), "rtn:bits=4"),
         SpecError),
    Case("weights", "NaN weight", lambda t: quantize_weight(weight() * math.nan, "rtn:bits=4"), NonFiniteError),
    Case("weights", "inf weight", lambda t: quantize_weight(weight() / 0.0, "rtn:bits=4"), NonFiniteError),
    Case("weights", "group does not divide d_in", lambda t: quantize_weight(weight(), "rtn:bits=4,group=48"),
         SpecError),
    Case("weights", "gptq without calibration", lambda t: quantize_weight(weight(), "gptq:bits=4,group=32"),
         SpecError),
    Case("weights", "gptq calibration NaN",
         lambda t: quantize_weight(weight(), "gptq:bits=4,group=32", torch.full((16, 64), math.nan)), NonFiniteError),
    Case("weights", "gptq calibration wrong width",
         lambda t: quantize_weight(weight(), "gptq:bits=4,group=32", torch.randn(16, 32)), SpecError),
    Case("weights", "gptq calibration empty",
         lambda t: quantize_weight(weight(), "gptq:bits=4,group=32", torch.zeros(0, 64)), SpecError),
    Case("weights", "gptq calibration +-3e38",
         lambda t: quantize_weight(weight(), "gptq:bits=4,group=32", torch.full((16, 64), 3e38)), InterpError),
    Case("weights", "valid: rtn on a constant weight is exact",
         lambda t: quantize_weight(torch.full((4, 64), 0.37), "rtn:bits=3"), close_to(torch.full((4, 64), 0.37), 1e-7)),
    Case("weights", "valid: rtn on weights of scale 1e10", lambda t: quantize_weight(weight(1e10), "rtn:bits=8"),
         Valid(lambda r: _relative_error_below(r, weight(1e10), 0.02))),
    Case("weights", "valid: bfloat16 weight", lambda t: quantize_weight(weight().bfloat16(), "rtn:bits=4").dtype,
         Valid(lambda r: _equal(r, torch.bfloat16))),
]


def _relative_error_below(result: torch.Tensor, original: torch.Tensor, bound: float) -> None:
    # 8-bit RTN of Gaussian weights: step = range / 255 ~ 8 sigma / 255, error <= step / 2 ~ 1.6% of sigma
    assert torch.isfinite(result).all()
    assert float((result - original).norm() / original.norm()) < bound


def _equal(got: Any, expected: Any) -> None:
    assert got == expected, (got, expected)


EXAMPLES = [
    Case("examples", "nll: token id == vocab", lambda t: interp.nll(tiny(), with_token(259)), DataError),
    Case("examples", "nll: token id 10**6", lambda t: interp.nll(tiny(), with_token(10**6)), DataError),
    Case("examples", "nll: negative token id", lambda t: interp.nll(tiny(), with_token(-1)), DataError),
    Case("examples", "probe: token id == vocab", lambda t: interp.probe(tiny(), with_token(259)), DataError),
    Case("examples", "probe: negative token id", lambda t: interp.probe(tiny(), with_token(-5)), DataError),
    Case("examples", "patch: token id == vocab",
         lambda t: P.patch(tiny(), tiny(), with_token(259), [P.Patch("down", (0,))]), DataError),
    Case("examples", "patch: negative source token",
         lambda t: P.patch(tiny(), tiny(), rows(), [P.Patch("down", (0,))], source_examples=with_token(-1)), DataError),
    Case("examples", "score: token id == vocab", lambda t: score(t, examples=with_token(259)), DataError),
    Case("examples", "analyze: token id == vocab", lambda t: interp.attention.analyze(tiny(), with_token(300)),
         DataError),
    Case("examples", "nll: rows from another tokenizer", lambda t: interp.nll(tiny(), foreign_rows()), DataError),
    Case("examples", "probe: rows from another tokenizer", lambda t: interp.probe(tiny(), foreign_rows()), DataError),
    Case("examples", "patch: rows from another tokenizer",
         lambda t: P.patch(tiny(), tiny(), foreign_rows(), [P.Patch("down", (0,))]), DataError),
    Case("examples", "score: rows from another tokenizer", lambda t: score(t, examples=foreign_rows()), DataError),
    Case("examples", "from_tokens: float tokens", lambda t: Examples.from_tokens(torch.rand(2, 8) * 100), DataError),
    Case("examples", "from_tokens: bool tokens", lambda t: Examples.from_tokens(torch.ones(2, 8, dtype=torch.bool)),
         DataError),
    Case("examples", "from_tokens: a list", lambda t: Examples.from_tokens([[1, 2, 3]]), DataError),
    Case("examples", "from_tokens: 1-D tokens", lambda t: Examples.from_tokens(torch.arange(8)), DataError),
    Case("examples", "from_tokens: ids of the wrong length",
         lambda t: Examples.from_tokens(torch.zeros(2, 8, dtype=torch.long), ids=["a"]), DataError),
    Case("examples", "nll: rows of one token", lambda t: interp.nll(tiny(), Examples.from_tokens(torch.zeros(2, 1))),
         DataError),
    Case("examples", "nll: rows longer than the context", lambda t: interp.nll(tiny(), rows(t=300)), InterpError),
    Case("examples", "nll: batch_size 0", lambda t: interp.nll(tiny(), rows(), batch_size=0), InterpError),
    Case("examples", "nll: batch_size True", lambda t: interp.nll(tiny(), rows(), batch_size=True), InterpError),
    Case("examples", "probe: batch_size -1", lambda t: interp.probe(tiny(), rows(), batch_size=-1), InterpError),
    Case("examples", "score: duplicate ids",
         lambda t: score(t, examples=Examples.from_tokens(rows().tokens, ids=["a", "a", "b"])), InterpError),
    Case("examples", "gptq calibration rows longer than the context",
         lambda t: interp.quant.quantize(tiny(), "gptq:bits=4,group=32", calibration=rows(t=300), progress=False),
         InterpError),
    Case("examples", "gptq calibration with token id == vocab",
         lambda t: interp.quant.quantize(tiny(), "gptq:bits=4,group=32", calibration=with_token(259), progress=False),
         DataError),
    Case("examples", "valid: int32 tokens give the int64 NLL",
         lambda t: interp.nll(tiny(), Examples.from_tokens(rows().tokens.int())), close_to(interp.nll(tiny(), rows()),
                                                                                           1e-6)),
    Case("examples", "valid: rows of the model's own tokenizer",
         lambda t: interp.nll(tiny(), examples_from(t)), finite_in(0.0, 50.0)),
]

N_SEQ_LAYERS = [
    Case("n/seq_len/layers", "load_examples n True", lambda t: examples_from(t, n=True), DataError),
    Case("n/seq_len/layers", "load_examples n 2.5", lambda t: examples_from(t, n=2.5), DataError),
    Case("n/seq_len/layers", "load_examples n '3'", lambda t: examples_from(t, n="3"), DataError),
    Case("n/seq_len/layers", "load_examples n 0", lambda t: examples_from(t, n=0), DataError),
    Case("n/seq_len/layers", "load_examples n -1", lambda t: examples_from(t, n=-1), DataError),
    Case("n/seq_len/layers", "load_examples seq_len True", lambda t: examples_from(t, seq_len=True), DataError),
    Case("n/seq_len/layers", "load_examples seq_len 16.0", lambda t: examples_from(t, seq_len=16.0), DataError),
    Case("n/seq_len/layers", "load_examples seq_len '16'", lambda t: examples_from(t, seq_len="16"), DataError),
    Case("n/seq_len/layers", "load_examples seq_len 1", lambda t: examples_from(t, seq_len=1), DataError),
    Case("n/seq_len/layers", "load_examples seed True", lambda t: examples_from(t, seed=True), DataError),
    Case("n/seq_len/layers", "load_examples seed 1.5", lambda t: examples_from(t, seed=1.5), DataError),
    Case("n/seq_len/layers", "probe layers []", lambda t: interp.probe(tiny(), rows(), layers=[]), ComponentError),
    Case("n/seq_len/layers", "probe layers [0.5]", lambda t: interp.probe(tiny(), rows(), layers=[0.5]),
         ComponentError),
    Case("n/seq_len/layers", "probe layers [True]", lambda t: interp.probe(tiny(), rows(), layers=[True]),
         ComponentError),
    Case("n/seq_len/layers", "probe layers '01'", lambda t: interp.probe(tiny(), rows(), layers="01"), ComponentError),
    Case("n/seq_len/layers", "probe layers [9]", lambda t: interp.probe(tiny(), rows(), layers=[9]), ComponentError),
    Case("n/seq_len/layers", "patching resolve_layers [0.5]", lambda t: P.resolve_layers(tiny(), [0.5]),
         ComponentError),
    Case("n/seq_len/layers", "patching resolve_layers []", lambda t: P.resolve_layers(tiny(), []), ComponentError),
    Case("n/seq_len/layers", "patching resolve_layers True", lambda t: P.resolve_layers(tiny(), True),
         ComponentError),
    Case("n/seq_len/layers", "Patch layers (0.5,)", lambda t: P.Patch("down", (0.5,)), ComponentError),
    Case("n/seq_len/layers", "Patch layers (True,)", lambda t: P.Patch("down", (True,)), ComponentError),
    Case("n/seq_len/layers", "analyze layers []", lambda t: interp.attention.analyze(tiny(), rows(), layers=[]),
         ComponentError),
    Case("n/seq_len/layers", "analyze layers [0.5]", lambda t: interp.attention.analyze(tiny(), rows(), layers=[0.5]),
         ComponentError),
    Case("n/seq_len/layers", "valid: probe layers [-1] is the last layer",
         lambda t: interp.probe(tiny(), rows(), layers=[-1]).layers, layers_are([1])),
    Case("n/seq_len/layers", "valid: patching resolve_layers 'upper_half'", lambda t: P.resolve_layers(tiny(),
                                                                                                         "upper_half"),
         layers_are([1])),
    Case("n/seq_len/layers", "valid: probe layers as a tensor of ints",
         lambda t: interp.probe(tiny(), rows(), layers=torch.tensor([0, 1])).layers, layers_are([0, 1])),
]

DATA = [
    Case("data", "source missing", lambda t: load_examples(t / "nope.txt", tok(), n=1, seq_len=8), DataError),
    Case("data", "source an int", lambda t: load_examples(123, tok(), n=1, seq_len=8), DataError),
    Case("data", "empty file", lambda t: load_examples(text_file(t, "e.txt", ""), tok(), n=1, seq_len=8), DataError),
    Case("data", "latin-1 file", lambda t: load_examples(text_file(t, "l.txt", "caf\xe9".encode("latin-1")), tok(),
                                                         n=1, seq_len=2), DataError),
    Case("data", "jsonl without text", lambda t: load_examples(text_file(t, "a.jsonl", '{"id": 1}\n'), tok(), n=1,
                                                               seq_len=2), DataError),
    Case("data", "jsonl text null", lambda t: load_examples(text_file(t, "b.jsonl", '{"text": null}\n'), tok(), n=1,
                                                            seq_len=2), DataError),
    Case("data", "jsonl text a number", lambda t: load_examples(text_file(t, "c.jsonl", '{"text": 12345}\n'), tok(),
                                                                n=1, seq_len=2), DataError),
    Case("data", "jsonl line a list", lambda t: load_examples(text_file(t, "d.jsonl", '["text"]\n'), tok(), n=1,
                                                              seq_len=2), DataError),
    Case("data", "jsonl broken line", lambda t: load_examples(text_file(t, "f.jsonl", '{"text": \n'), tok(), n=1,
                                                              seq_len=2), DataError),
    Case("data", "unsupported suffix", lambda t: load_examples(text_file(t, "x.csv", "a,b"), tok(), n=1, seq_len=2),
         DataError),
    Case("data", "more rows than documents", lambda t: examples_from(t, n=500), DataError),
    Case("data", "unknown split", lambda t: examples_from(t, split="train"), DataError),
    Case("data", "tokenizer None", lambda t: load_examples(long_text(t), None, n=1, seq_len=8), DataError),
    Case("data", "folder that is not a dataset", lambda t: load_examples(t, tok(), n=1, seq_len=8), DataError),
    Case("data", "valid: examples carry the tokenizer fingerprint",
         lambda t: (examples_from(t).tokenizer, examples_from(t).vocab_size),
         Valid(lambda r: _fingerprint_ok(r))),
]


def _fingerprint_ok(result: tuple[str, int]) -> None:
    fingerprint, vocab = result
    assert isinstance(fingerprint, str) and len(fingerprint) >= 8 and vocab == 259


STORE = [
    Case("store", "a store file that is not SQLite",
         lambda t: score(t, store=text_file(t, "scores.sqlite", "not a database " * 100)), InterpError),
    Case("store", "an SQLite file with another schema", lambda t: score(t, store=store_with_other_schema(t)),
         InterpError),
    Case("store", "a second reference model", lambda t: (score(t), score_other_model(t)), InterpError),
    Case("store", "store path is a file without suffix", lambda t: score(t, store=text_file(t, "plain", "x")),
         InterpError),
    Case("store", "score batch_size 0", lambda t: score(t, batch_size=0), InterpError),
    Case("store", "score no specs", lambda t: score(t, specs=()), SpecError),
    Case("store", "score a bad spec", lambda t: score(t, specs=("rtn:bits=1",)), SpecError),
    Case("store", "score gptq without calibration", lambda t: score(t, specs=("gptq:bits=3",)), SpecError),
    Case("store", "valid: a rerun returns the same errors", lambda t: (score(t), score(t)),
         Valid(lambda r: _frames_equal(*r))),
]


def score_other_model(tmp: Path) -> Any:
    from interp.quant import score as score_fn

    return score_fn(interp.tiny_model("llama", seed=1, n_layers=2), ["rtn:bits=4,group=32"], rows(), tmp / "store",
                    progress=False)


def _frames_equal(a: Any, b: Any) -> None:
    import pandas as pd

    pd.testing.assert_frame_equal(a, b, atol=0, rtol=0)


CASES = PATTERNS + BETA_AND_MASKS + SPECS + WEIGHTS + EXAMPLES + N_SEQ_LAYERS + DATA + STORE


def test_the_table_is_large_and_named_uniquely():
    names = [(c.category, c.name) for c in CASES]
    assert len(set(names)) == len(names)
    assert len(CASES) >= 100
    counts = Counter(c.category for c in CASES)
    assert min(counts.values()) >= 8, counts


@pytest.mark.parametrize("case", CASES, ids=[f"{c.category}: {c.name}" for c in CASES])
def test_hostile_input(case: Case, tmp_path: Path):
    if isinstance(case.expected, Valid):
        case.expected.check(case.run(tmp_path))
        return
    with pytest.raises(case.expected) as caught:
        case.run(tmp_path)
    assert len(str(caught.value)) > 20  # a sentence naming the fix, not a bare repr


# ---------------------------------------------------------------------------------------
# Property tests


SPEC_ALPHABET = "rtnfhqgpawbisoudemzlckr:=,.-+0123456789 eE_"


def near_valid_specs() -> st.SearchStrategy[str]:
    """A valid spec with one or two keys and values replaced by random fragments."""
    method = st.sampled_from(sorted(METHODS))
    key = st.sampled_from(["bits", "group", "zero", "damp", "act_order", "block", "grid", "optimize", "x", ""])
    value = st.one_of(st.integers(-10, 300).map(str), st.sampled_from(["", "nan", "inf", "1e3", "float", "int",
                                                                       "0.5", "-0", " 4 ", "٣", "1_0"]),
                      st.text(SPEC_ALPHABET, max_size=6))
    pair = st.tuples(key, value).map(lambda kv: f"{kv[0]}={kv[1]}")
    return st.tuples(method, st.lists(pair, max_size=4)).map(lambda mp: f"{mp[0]}:{','.join(mp[1])}")


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=30), st.text(SPEC_ALPHABET, max_size=30), near_valid_specs()))
def test_any_spec_string_parses_or_raises_spec_error(text: str):
    try:
        spec = parse_spec(text)
    except SpecError as exc:
        assert str(exc)
        return
    assert parse_spec(str(spec)) == spec  # the canonical form round-trips
    assert spec.bits in METHODS[spec.method].bits and spec.group >= 1


@st.composite
def causal_patterns(draw: Any) -> torch.Tensor:
    q = draw(st.integers(1, 7))
    heads = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    sharp = draw(st.floats(0.0, 30.0))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(heads, q, q, generator=gen, dtype=torch.float64) * sharp
    mask = torch.ones(q, q, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~mask, -math.inf), dim=-1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(causal_patterns(), st.floats(0.0, 50.0))
def test_metrics_of_valid_patterns_are_finite_and_in_range(pattern: torch.Tensor, beta: float):
    q = pattern.shape[-1]
    # float64 rows: entropy may exceed log(n) by rounding only (~1e-15); 1e-9 is far above that
    assert torch.isfinite(entropy(pattern)).all()
    assert (entropy(pattern) >= -1e-12).all() and (entropy(pattern) <= math.log(q) + 1e-9).all()
    normalized = entropy(pattern, normalized=True)
    assert ((normalized >= -1e-12) & (normalized <= 1 + 1e-9)).all()
    g = gtd(pattern)
    assert ((g >= 0) & (g <= 1)).all()
    assert ((sink_share(pattern) >= 0) & (sink_share(pattern) <= 1 + 1e-12)).all()
    for mode in ("exact", "first_order"):
        refined = saobp(pattern, beta, mode=mode)
        assert torch.isfinite(refined).all()
        # softmax of float64 logits: each row sums to 1 within a few ulp per key (q <= 7)
        assert torch.allclose(refined.sum(-1), torch.ones(refined.shape[:-1], dtype=torch.float64), atol=1e-12)
        assert not torch.triu(refined, diagonal=1).any()


@st.composite
def broken_patterns(draw: Any) -> torch.Tensor:
    pattern = draw(causal_patterns())
    q = pattern.shape[-1]
    row = draw(st.integers(0, q - 1))
    col = draw(st.integers(0, row))
    kind = draw(st.sampled_from(["nan", "inf", "negative", "scaled"]))
    broken = pattern.clone()
    if kind == "nan":
        broken[0, row, col] = math.nan
    elif kind == "inf":
        broken[0, row, col] = math.inf
    elif kind == "negative":
        broken[0, row, col] = -draw(st.floats(0.01, 10.0))
    else:
        factor = draw(st.one_of(st.floats(0.0, 0.99), st.floats(1.01, 1e6)))
        broken[0, row] = broken[0, row] * factor
        if not bool(broken[0, row].any()):  # all zero (factor 0, or a tiny one that underflows): a padded
            # query, which is valid, so break it another way
            broken[0, row, col] = -1.0
    return broken


@settings(max_examples=150, deadline=None)
@given(broken_patterns(), st.sampled_from(["entropy", "gtd", "sink_share", "effective_span", "saobp"]))
def test_metrics_refuse_broken_patterns(pattern: torch.Tensor, metric: str):
    fn = {"entropy": entropy, "gtd": gtd, "sink_share": sink_share, "effective_span": effective_span,
          "saobp": lambda p: saobp(p, 1.0)}[metric]
    with pytest.raises(InterpError):
        fn(pattern)


def test_table_counts_by_category_match_the_docs():
    """docs/reliability.md shows the table's size by category; keep the two in step."""
    counts = Counter(c.category for c in CASES)
    text = (Path(__file__).resolve().parent.parent / "docs" / "reliability.md").read_text(encoding="utf-8")
    for category, count in counts.items():
        assert f"| {category} | {count} |" in text, (category, count)
    assert f"| total | {len(CASES)} |" in text
    assert json.dumps(sorted(counts))  # categories are plain strings
