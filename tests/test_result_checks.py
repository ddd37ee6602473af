"""Results are checked before they are returned (issue 31): a saturated prediction, an attention mask with a
hole and a layer selected twice are refused with a clear error instead of returning a number.

The saturated case is the one the issue found: weights scaled to 1e30 are finite, yet the residual's
mean square overflows float32 in the final RMSNorm, which then returns zeros, so every logit is equal
and every NLL is exactly log V. Plain transformers is the independent witness: its own logits for that
model are equal across the vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pandas as pd
import pytest
import torch

import interp
from interp.errors import ComponentError, DataError, InterpError, NonFiniteError
from interp.localize.lens import early_exit
from interp.results import CheckedResult
from interp.runtime.readout import SATURATED_ULPS, refuse_saturated
from interp.runtime.scoring import token_nll

V = interp.models.TINY_VOCAB


def _rows(n: int = 3, width: int = 8) -> interp.Examples:
    generator = torch.Generator().manual_seed(0)
    return interp.Examples.from_tokens(torch.randint(0, 256, (n, width), generator=generator))


@pytest.fixture(scope="module")
def scaled():
    """A tiny llama whose every weight is multiplied by 1e30: finite, and saturating."""
    model = interp.tiny_model("llama", seed=3)
    with torch.no_grad():
        for parameter in model.original_model.parameters():
            parameter.mul_(1e30)
    assert all(bool(torch.isfinite(p).all()) for p in model.original_model.parameters())
    return model


def test_the_scaled_model_really_predicts_uniformly(scaled):
    """The premise, from transformers alone: every logit of the scaled model is the same number."""
    with torch.no_grad():
        logits = scaled.original_model(input_ids=_rows().tokens).logits
    assert bool(torch.isfinite(logits).all()) and bool((logits.amax(-1) == logits.amin(-1)).all())


def test_nll_of_a_saturated_model_is_refused_and_says_where(scaled):
    with pytest.raises(NonFiniteError, match=r"uniform over all 259 tokens.*rows \[0, 1, 2\].*overflowed"):
        interp.nll(scaled, _rows())


def test_the_early_exit_lens_of_a_saturated_model_is_refused(scaled):
    with pytest.raises(NonFiniteError, match="uniform over all 259 tokens"):
        early_exit(scaled, _rows(), layers=[1])


def test_padded_rows_of_a_saturated_model_are_refused(scaled):
    rows = interp.examples_from_texts(["a short one", "a somewhat longer prompt"], scaled.tokenizer, padding="left")
    with pytest.raises(NonFiniteError, match="uniform"):
        interp.nll(scaled, rows)


def test_an_ordinary_model_passes_and_its_nll_is_far_from_the_uniform_value():
    model = interp.tiny_model("llama", seed=3)
    values = interp.nll(model, _rows()).double()
    with torch.no_grad():  # the same NLL from transformers' logits in float64, as an independent computation
        logits = model.original_model(input_ids=_rows().tokens).logits.double()
    tokens = _rows().tokens
    expected = -torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1).mean(1)
    # float32 forward vs float64 log-softmax: 1e-4 nats is ~1000 float32 ulps of a 5.6-nat value, far above
    # the rounding of a 2-layer forward, and far below the gap to log V the next line requires
    assert torch.allclose(values, expected, atol=1e-4, rtol=0)
    assert bool(((values - math.log(V)).abs() > 1e-3).all())


def test_the_threshold_is_float32_rounding_of_log_v():
    level = torch.tensor(math.log(V), dtype=torch.float32)  # log V rounded to float32: within half an ulp
    with pytest.raises(NonFiniteError):
        refuse_saturated(level.expand(2, 4).clone(), V)
    spacing = SATURATED_ULPS * torch.finfo(torch.float32).eps * math.log(V)
    near = level.double() + 4 * spacing  # four times the threshold away: a prediction, however flat
    refuse_saturated(near.expand(2, 4).clone(), V)
    one_real = level.expand(2, 4).clone()
    one_real[:, 2] = 4.0  # one target that is not uniform makes the row a measurement
    refuse_saturated(one_real, V)


def test_the_full_logits_scorer_refuses_equal_logits_too():
    tokens = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
    with pytest.raises(NonFiniteError, match="uniform"):
        token_nll(torch.full((2, 6, V), 7.5), tokens)
    values = token_nll(torch.randn(2, 6, V, generator=torch.Generator().manual_seed(2)), tokens)
    assert tuple(values.shape) == (2, 5)


# ---------------------------------------------------------------------------------------
# attention masks: one run of real tokens, padded on one side


@pytest.mark.parametrize("row", [[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 0, 1], [0, 0, 0, 0]])
def test_a_mask_with_a_hole_or_two_padded_sides_is_refused(row):
    rows = _rows(2, 4)
    mask = torch.tensor([[1, 1, 1, 1], row]).bool()
    with pytest.raises(DataError, match="'row1' has the attention mask"):
        dataclasses.replace(rows, attention_mask=mask)


def test_left_and_right_padding_pass():
    rows = _rows(4, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 0, 1]]).bool()
    assert torch.equal(dataclasses.replace(rows, attention_mask=mask).attention_mask, mask)
    for padding in ("left", "right"):
        texts = ["one", "a longer text here"]
        assert interp.examples_from_texts(texts, interp.models.tiny_tokenizer(), padding=padding).padded


# ---------------------------------------------------------------------------------------
# layers: each selected once


@pytest.mark.parametrize("layers", [[1, 1], [-1, 3], [0, -4]])
def test_a_layer_selected_twice_is_refused(layers):
    model = interp.tiny_model("llama", n_layers=4)
    with pytest.raises(ComponentError, match="selected twice"):
        early_exit(model, _rows(), layers=layers)
    with pytest.raises(ComponentError, match="selected twice"):
        interp.probe(model, _rows(), ["resid_post"], ["norm"], layers=layers)


def test_a_negative_layer_alone_is_the_layer_counted_from_the_end():
    model = interp.tiny_model("llama", n_layers=4)
    assert torch.equal(early_exit(model, _rows(), layers=[-1]).nll, early_exit(model, _rows(), layers=[3]).nll)


# ---------------------------------------------------------------------------------------
# Every numeric result is finite and meaningful, or refused (issue 45): one check, interp.results.check_result,
# run by each result type's constructor


def _valid_results() -> dict[str, Any]:
    """A valid instance's fields for each checked result type, built by hand (no model): name -> (class, fields)."""
    import numpy as np

    from interp.localize.dla import LogitAttribution
    from interp.localize.linear_probe import LinearProbeResult, RidgeProbe
    from interp.localize.patterns import AttentionPatterns
    from interp.localize.steering import SteeringResult
    from interp.localize.top_tokens import TopTokens
    from interp.quant.imatrix import ImportanceMatrix

    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(2, 3, 10, generator=g, dtype=torch.float64), -1).topk(3, dim=-1)
    return {
        "steer": (SteeringResult, {"prompt_tokens": torch.tensor([256, 72]), "new_tokens": [1, 2],
                                   "logits": torch.randn(2, 10, generator=g), "text": "ab",
                                   "settings": {"alpha": 1.0}}),
        "lens_top_tokens": (TopTokens, {"ids": probs.indices, "probs": probs.values.float(), "layers": [0, 1],
                                        "labels": ["0:a", "1:b", "2:c"], "strings": [[["x"] * 3] * 3] * 2,
                                        "settings": {"vocab": 10}}),
        "dla": (LogitAttribution, {"heads": torch.randn(2, 2, 4, generator=g), "attn_bias": torch.zeros(2, 2),
                                   "mlp": torch.randn(2, 2, generator=g), "embed": torch.randn(2, generator=g),
                                   "pos_embed": torch.zeros(2), "final_bias": torch.zeros(2),
                                   "logit": torch.randn(2, generator=g), "ids": ["a", "b"]}),
        "linear_probe": (LinearProbeResult, {
            "accuracy": torch.tensor([0.5, 0.75], dtype=torch.float64), "control_accuracy": torch.tensor([0.5, 0.5]),
            "train_accuracy": torch.tensor([1.0, 1.0]), "majority": 0.5, "layers": [0, 1], "classes": [0, 1],
            "probes": [RidgeProbe(torch.randn(4, 2, generator=g), torch.zeros(2))], "n_train": 6, "n_test": 2}),
        "attention_view": (AttentionPatterns, {"pattern": torch.softmax(torch.randn(1, 2, 3, 3, generator=g), -1),
                                               "layers": [0], "labels": ["0:a", "1:b", "2:c"]}),
        "imatrix": (ImportanceMatrix, {"sums": {"blk.0.attn_q.weight": np.arange(4.0)},
                                       "counts": {"blk.0.attn_q.weight": 8}, "chunk_size": 4}),
        **_valid_analysis_results(g),
    }


def _valid_analysis_results(g: torch.Generator) -> dict[str, Any]:
    """The localization, attention, probe and quantization analyses' result types (issue 45's second round)."""
    import numpy as np
    import pandas as pd

    from interp import stats
    from interp.attention.analysis import AttentionResult
    from interp.localize.ablation import AblationResult
    from interp.localize.lens import EarlyExitResult
    from interp.localize.patching.attribution import AttributionResult
    from interp.localize.patching.patches import Patch
    from interp.localize.patching.results import PatchResult
    from interp.localize.paths import PathPatchResult, Sender
    from interp.localize.restoration import RestorationResult
    from interp.probes import ProbeResult
    from interp.quant.analysis.agreement import AgreementResult
    from interp.quant.analysis.norms import NormCorrelationResult
    from interp.quant.analysis.reversal import ReversalResult
    from interp.quant.analysis.split import SplitResult

    ids = ["a", "b", "c"]
    full = torch.randn(2, 3, 4, 5, generator=g)
    full[:, 0, :1] = math.nan  # a padded prompt's pad position in a full capture: NaN by design (allow_nan)
    errors = pd.DataFrame(np.random.default_rng(0).normal(size=(12, 3)), columns=["p", "q", "r"])
    matrix = stats.correlation_matrix(errors, n_boot=0)  # no bootstrap: low/high are NaN, stats' convention
    examples = interp.Examples.from_tokens(torch.randint(0, 256, (4, 6), generator=g))
    norms = pd.DataFrame({"component": ["resid_post"] * 2, "layer": [0, 1], "r": [0.3, math.nan],
                          "low": [0.1, math.nan], "high": [0.5, math.nan], "p": [0.04, math.nan], "n": [12, 12],
                          "mean_norm": [3.5, 4.0]})  # layer 1: a constant vector, r undefined
    return {
        "ablate": (AblationResult, {"logits": torch.randn(3, 10, generator=g),
                                    "clean_logits": torch.randn(3, 10, generator=g), "ids": ids,
                                    "answers": torch.tensor([1, 2, 3]), "wrongs": torch.tensor([4, 5, 6]),
                                    "settings": {"how": "zero"}}),
        "early_exit": (EarlyExitResult, {"nll": torch.rand(2, 3, generator=g) + 1, "layers": [0, 1], "ids": ids,
                                         "at": "resid_post", "settings": {"batch_size": 2}}),
        "patch": (PatchResult, {"values": torch.randn(2, 3, generator=g), "target": torch.randn(3, generator=g),
                                "source": torch.randn(3, generator=g), "ids": ids, "metric": "logit_diff",
                                "patches": [Patch("resid_post", (0,)), Patch("down", (1,))]}),
        "path_patch": (PathPatchResult, {"values": torch.randn(1, 3, generator=g),
                                         "target": torch.randn(3, generator=g),
                                         "source": torch.randn(3, generator=g), "senders": [Sender("head", 0, 0)],
                                         "receivers": "logits", "ids": ids, "metric": "logit_diff"}),
        "restoration": (RestorationResult, {"ks": [0, 1], "restored": [[], [1]], "ids": ids,
                                            "nll": torch.rand(2, 3, generator=g) + 1,
                                            "reference_nll": torch.rand(3, generator=g) + 1}),
        "attribution": (AttributionResult, {"estimates": torch.randn(2, 3, generator=g), "ids": ids,
                                            "points": [("resid_post", 0), ("down", 1)]}),
        "analyze": (AttentionResult, {"table": pd.DataFrame({"variant": ["reference"] * 2, "layer": [0, 0],
                                                             "head": [0, 1], "entropy": [0.7, 1.2],
                                                             "gtd": [0.3, 0.5]}),
                                      "nll_reference": torch.rand(3, generator=g),
                                      "nll_saobp": torch.rand(3, generator=g),
                                      "settings": {"beta": 0.5}}),
        "probe": (ProbeResult, {"stats": {"resid_post/norm": torch.rand(2, 3, generator=g), "resid_post/full": full},
                                "layers": [0, 1], "ids": ids, "nll": torch.rand(3, generator=g)}),
        "agreement": (AgreementResult, {"pearson": matrix, "spearman": stats.correlation_matrix(errors, "spearman",
                                                                                                 n_boot=5),
                                        "jaccard": pd.DataFrame(np.eye(3), index=["p", "q", "r"],
                                                                columns=["p", "q", "r"]),
                                        "chance_jaccard": 0.05, "chance_method": "exact", "n": 12,
                                        "settings": {"top": 0.1}}),
        "split": (SplitResult, {"large": examples.subset([0]), "ctrl": examples.subset([1]),
                                "errors": pd.Series([3.0, 0.5, 1.0, 2.0], index=examples.ids), "dropped_ids": [],
                                "settings": {"top": 0.25}}),
        "reversal": (ReversalResult, {
            "by_layer": pd.DataFrame({"layer": [0, 1], "r_norm_large": [1.0, 2.0], "r_norm_ctrl": [1.5, 2.5]}),
            "mse": pd.DataFrame({"spec": ["rtn3"] * 2, "layer": [0, 1], "mse_large": [0.0, 0.2],
                                 "mse_ctrl": [0.0, 0.1], "corr_h_mse": [math.nan, 0.4],
                                 "corr_low": [math.nan, 0.1], "corr_high": [math.nan, 0.7]}),  # layer 0 untouched
            "outliers": pd.DataFrame({"layer": [0], "rank": [1], "dim": [3], "gamma_percentile": [0.2]}),
            "per_example": pd.DataFrame({"layer": [0, 1], "r_norm": [1.0, 2.0], "mse[rtn3]": [0.0, 0.2]})}),
        "norm_error_correlation": (NormCorrelationResult, {"table": norms, "settings": {"n_boot": 20}}),
    }


def _float_slots(value: Any, path: tuple = ()) -> list[tuple]:
    """Paths to every float tensor, array or float inside a field's value (into lists, dicts and dataclasses)."""
    import numpy as np

    if isinstance(value, torch.Tensor):
        return [path] if value.is_floating_point() and value.numel() else []
    if isinstance(value, np.ndarray):
        return [path] if value.dtype.kind == "f" and value.size else []
    if isinstance(value, float):
        return [path]
    if isinstance(value, pd.DataFrame):
        return [(*path, c) for c in value.columns if value[c].dtype.kind == "f" and len(value)]
    if isinstance(value, pd.Series):
        return [path] if value.dtype.kind == "f" and len(value) else []
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [p for f in dataclasses.fields(value) for p in _float_slots(getattr(value, f.name), (*path, f.name))]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _float_slots(v, (*path, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _float_slots(v, (*path, i))]
    return []


def _poisoned(value: Any, path: tuple, poison: float, where: int) -> Any:
    """A copy of ``value`` with one entry at ``path`` (the ``where``-th element of a tensor or array) replaced."""
    import copy

    import numpy as np

    if not path:
        if isinstance(value, torch.Tensor):
            out = value.clone()
            out.view(-1)[where % out.numel()] = poison
            return out
        if isinstance(value, np.ndarray):
            out = value.copy()
            out.reshape(-1)[where % out.size] = poison
            return out
        if isinstance(value, pd.Series):
            out = value.copy()
            out.iloc[where % len(out)] = poison
            return out
        return poison
    if isinstance(value, pd.DataFrame):  # the column path[0], one row
        out = value.copy()
        out.iloc[where % len(out), out.columns.get_loc(path[0])] = poison
        return out
    head, rest = path[0], path[1:]
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{head: _poisoned(getattr(value, head), rest, poison, where)})
    out = copy.copy(value)
    out[head] = _poisoned(value[head], rest, poison, where)
    return out


def assert_result_refused(cls: type, fields: Any, fragment: str) -> None:
    """The property's inner check: making the result (``fields``, or a function giving them) raises NonFiniteError
    naming ``fragment``."""
    with pytest.raises(NonFiniteError, match=fragment):
        cls(**(fields() if callable(fields) else fields))


def _owner(cls: type, key: str, value: Any, path: tuple) -> str:
    """``Class.field`` of the innermost result holding the entry at ``path`` (a RidgeProbe inside a probe result)."""
    owner, attr, current = cls.__name__, key, value
    for step in path:
        if isinstance(current, CheckedResult):  # a nested result checks itself (a RidgeProbe); a plain one does not
            owner, attr, current = type(current).__name__, step, getattr(current, step)
        elif dataclasses.is_dataclass(current):  # a plain dataclass (a CorrelationMatrix): its owner names it
            current = getattr(current, step)
        else:
            current = current[step]
    return f"{owner}.{attr}"


RESULT_NAMES = ("steer", "lens_top_tokens", "dla", "linear_probe", "attention_view", "imatrix", "ablate", "early_exit",
                "patch", "path_patch", "restoration", "attribution", "analyze", "probe", "agreement", "split",
                "reversal", "norm_error_correlation")


def _nan_allowed(cls: type, key: str, path: tuple) -> bool:
    """Whether the class documents NaN as a value at ``key``/``path`` (its ``allow_nan``: the field, or an entry
    ``field[GLOB]`` of a dict or frame): an undefined correlation, a padded position. inf is refused there too."""
    import fnmatch

    allowed = getattr(cls, "allow_nan", ())
    globs = [a[len(key) + 1 : -1] for a in allowed if a.startswith(f"{key}[") and a.endswith("]")]
    return key in allowed or bool(path) and any(fnmatch.fnmatchcase(str(path[0]), glob) for glob in globs)


def test_every_checked_result_type_accepts_its_valid_fields():
    for name, (cls, fields) in _valid_results().items():
        assert cls(**fields) is not None, name
        assert _float_slots(fields), name  # there is something to poison


@pytest.mark.parametrize("name", RESULT_NAMES)
def test_property_nan_or_inf_anywhere_in_a_result_is_refused(name):
    """Property: one NaN, inf or -inf put anywhere in any float field of the result (any tensor element, any
    float of a list, dict or nested dataclass) makes its constructor raise NonFiniteError naming the field."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    cls, fields = _valid_results()[name]
    slots = [(key, path) for key, value in fields.items() for path in _float_slots(value)]

    @settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(slot=st.sampled_from(slots), poison=st.sampled_from([math.nan, math.inf, -math.inf]),
           where=st.integers(0, 1000))
    def prop(slot, poison, where):
        key, path = slot
        bad = lambda: {**fields, key: _poisoned(fields[key], path, poison, where)}  # noqa: E731 - made inside the check
        if math.isnan(poison) and _nan_allowed(cls, key, path):
            assert cls(**bad()) is not None  # NaN is a documented value here (allow_nan); inf is not
            return
        assert_result_refused(cls, bad, f"{_owner(cls, key, fields[key], path)} holds NaN or inf")

    prop()


def test_constant_logits_where_a_ranking_is_read_are_refused():
    results = _valid_results()
    cls, fields = results["steer"]
    flat = fields["logits"].clone()
    flat[1] = 3.0  # the second generated token was an argmax over equal logits
    assert_result_refused(cls, {**fields, "logits": flat}, r"SteeringResult.logits has rows \[1\]")
    cls, fields = results["lens_top_tokens"]
    uniform = fields["probs"].clone()
    uniform[1, 2] = 0.1  # 1 / vocab: the logits of that cell were all equal
    assert_result_refused(cls, {**fields, "probs": uniform}, r"\(layer, position\) \[\(1, 2\)\] are uniform")
    unknown = {**fields, "probs": uniform, "settings": {}}  # no vocabulary recorded: k equal probabilities say it
    assert_result_refused(cls, unknown, "uniform")


def test_with_the_one_place_switched_off_the_property_check_fails(monkeypatch):
    """With interp.results.check_result a no-op, the property's inner check fails for every result type: the
    refusals come from that one place."""
    monkeypatch.setattr("interp.results.check_result", lambda *args, **kwargs: None)
    for cls, fields in _valid_results().values():
        key, path = next((k, p) for k, v in fields.items() for p in _float_slots(v) if not _nan_allowed(cls, k, p))
        bad = {**fields, key: _poisoned(fields[key], path, math.nan, 0)}
        with pytest.raises(pytest.fail.Exception):
            assert_result_refused(cls, bad, "NaN or inf")
    from interp.results import check_values

    assert check_values(torch.tensor([math.nan]), "v") is not None  # the bare-tensor path shares the one place


def result_class_names(source: str) -> list[str]:
    """The dataclasses in ``source`` with "Result" in their name (``@dataclass`` or ``@dataclass(...)``)."""
    import ast

    def is_dataclass(decorator: ast.expr) -> bool:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        return (isinstance(target, ast.Name) and target.id == "dataclass") or (
            isinstance(target, ast.Attribute) and target.attr == "dataclass")

    return [node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)
            and "Result" in node.name and any(is_dataclass(d) for d in node.decorator_list)]


def interp_result_classes() -> list[type]:
    """Every dataclass of the package with "Result" in its name, found in the source and imported."""
    import importlib
    from pathlib import Path

    root = Path(interp.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        names = result_class_names(path.read_text(encoding="utf-8"))
        if names:
            module = importlib.import_module(".".join(path.relative_to(root.parent).with_suffix("").parts))
            found += [getattr(module, name) for name in names]
    return found


def test_every_result_type_in_interp_is_checked_and_in_the_property():
    """A new result dataclass fails here until it mixes in CheckedResult (so NaN and inf are refused when it is
    made) and has valid fields in ``_valid_results`` (so the property above poisons each of its float fields)."""
    classes = interp_result_classes()
    assert len(classes) >= 14  # the walk finds them (14 when this test was written)
    assert [c.__qualname__ for c in classes if not issubclass(c, CheckedResult)] == []
    covered = {cls for cls, _ in _valid_results().values()}
    assert [c.__qualname__ for c in classes if c not in covered] == []
    assert set(RESULT_NAMES) == set(_valid_results())


def test_the_walk_finds_an_unchecked_result_type():
    """The walk's own check: a dataclass named like a result is found whatever its bases; other classes are not."""
    source = ("from dataclasses import dataclass\nimport dataclasses\n"
              "@dataclass(frozen=True)\nclass FooResult:\n    x: float\n"
              "@dataclasses.dataclass\nclass BarResult(Base):\n    y: float\n"
              "class NotADataclassResult:\n    pass\n@dataclass\nclass Table:\n    z: float\n")
    assert result_class_names(source) == ["FooResult", "BarResult"]


def _nan_model() -> Any:
    model = interp.tiny_model("llama", seed=4)
    with torch.no_grad():
        model.original_model.model.layers[0].mlp.down_proj.weight[0, 0] = math.nan
    return model


def test_the_public_functions_refuse_nan_and_equal_logits(scaled, tmp_path):
    """End to end: each function of the issue, on a model with a NaN weight or a saturated one, raises an
    InterpError (NonFiniteError) instead of returning a result."""
    from interp.quant.imatrix import importance_matrix

    nan = _nan_model()
    prompts = [f"{w} {i}" for i in range(4) for w in ("cat", "dog")]
    with pytest.raises(NonFiniteError, match="SteeringResult.logits has rows"):
        interp.steer(scaled, "I feel", torch.zeros(64), layer=1, max_new_tokens=2)
    with pytest.raises(NonFiniteError, match="steering vector holds NaN"):
        interp.steering_vector(nan, "happy", "sad", layer=1)
    with pytest.raises(NonFiniteError, match="uniform"):
        interp.lens_top_tokens(scaled, "hello", k=3)
    with pytest.raises(NonFiniteError):
        interp.dla(nan, ["When Mary and John", "When John and Mary"], "M", "J")
    with pytest.raises(NonFiniteError, match="RidgeProbe.weight holds NaN"):  # the probe fitted on NaN activations
        interp.linear_probe(nan, prompts, [p[:3] for p in prompts], layers=[1])
    with pytest.raises(NonFiniteError, match="AttentionPatterns: query rows"):  # NaN scores came back as zeros
        interp.attention_view(nan, "abc", layers=[1])
    with pytest.raises(NonFiniteError, match="ImportanceMatrix.sums holds NaN"):
        importance_matrix(nan, _rows(2, 8), progress=False)


def test_an_imatrix_sum_beyond_float32_is_refused_before_it_is_written(tmp_path):
    import numpy as np

    from interp.quant.imatrix import ImportanceMatrix, write_imatrix

    matrix = ImportanceMatrix({"blk.0.attn_q.weight": np.array([1.0, 1e39])}, {"blk.0.attn_q.weight": 8}, 4)
    with pytest.raises(NonFiniteError, match="float32"):
        write_imatrix(matrix, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


# ---------------------------------------------------------------------------------------
# Degenerate questions: a clear error before any model runs


@pytest.fixture
def no_forward():
    """A tiny model whose forward raises: a question refused before any model runs never reaches it."""
    model = interp.tiny_model("llama", seed=5)

    def refuse(*args, **kwargs):
        raise AssertionError("the model ran")

    handles = [m.register_forward_pre_hook(refuse) for m in model.original_model.modules()
               if isinstance(m, torch.nn.Embedding)]  # every forward starts at the token embedding
    with pytest.raises(AssertionError, match="the model ran"):
        interp.nll(model, _rows(1, 4))  # the guard works
    yield model
    for handle in handles:
        handle.remove()


def test_answer_equal_to_wrong_is_refused_before_the_model_runs(no_forward):
    from interp.localize.patching import LogitDiffMetric

    prompts = ["When Mary and John", "When John and Mary"]
    for call in (lambda: interp.dla(no_forward, prompts, "M", ["J", "M"]),
                 lambda: interp.eap(no_forward, prompts[0], prompts[1], "M", "M"),
                 lambda: interp.path_patch(no_forward, prompts[0], prompts[1], "M", "M", senders=["head 1.0"]),
                 lambda: interp.patch_heatmap(no_forward, prompts[0], prompts[1], "M", "M"),
                 lambda: interp.ablate(no_forward, prompts, "z", "zero", answer="M", wrong="M"),
                 lambda: LogitDiffMetric([5, 6], [5, 7])):
        with pytest.raises(DataError, match="same token"):
            call()


def test_a_resample_that_can_only_draw_the_row_itself_is_refused(no_forward):
    with pytest.raises(DataError, match="can only draw the prompt itself"):
        interp.ablate(no_forward, ["a", "a much longer prompt"], "z", "resample", layers=[0])


@pytest.mark.parametrize("labels, test_fraction, fragment", [
    ([0.1, 0.7, 0.3, 0.9], 0.25, "is a float"),
    (torch.tensor([0.0, 1.0, 0.0, 1.0]), 0.25, "float32 values"),
    ([1, 1, 1, 1], 0.25, "two distinct labels"),
    ([0, 1, 0, 1], 0.9, "Too few prompts to hold some out"),
])
def test_a_probe_question_without_an_answer_is_refused_before_the_model_runs(no_forward, labels, test_fraction,
                                                                             fragment):
    with pytest.raises(DataError, match=fragment):
        interp.linear_probe(no_forward, ["ab", "cd", "ef", "gh"], labels, test_fraction=test_fraction)


def test_a_steering_vector_of_one_prompt_against_itself_is_refused(no_forward):
    with pytest.raises(InterpError, match="same tokens"):
        interp.steering_vector(no_forward, "happy", "happy", layer=0)


def test_a_tuned_lens_of_another_model_is_refused(tmp_path):
    from interp.localize.tuned_lens import TunedLens, fit_tuned_lens, tuned_early_exit

    model = interp.tiny_model("llama", seed=0)
    rows = _rows(12, 16)
    lens = fit_tuned_lens(model, rows, progress=False)
    lens.save(tmp_path / "lens.safetensors")
    back = TunedLens.load(tmp_path / "lens.safetensors")
    interp.lens_top_tokens(model, "hi", k=2, lens=back)  # its own model: fine
    quantized = interp.quantize(model, "rtn:bits=4,group=32", progress=False)
    interp.lens_top_tokens(quantized, "hi", k=2, lens=back)  # a quantized copy reads its reference's lens
    for other, fragment in ((interp.tiny_model("llama", seed=1), "embedding"),
                            (interp.tiny_model("llama", n_layers=3), "n_layers"),
                            (interp.tiny_model("gpt2"), "fitted on another model")):
        with pytest.raises(InterpError, match=fragment):
            interp.lens_top_tokens(other, "hi", k=2, lens=back)
        with pytest.raises(InterpError, match="fitted on another model"):
            tuned_early_exit(other, back, _rows(2, 8))
