"""The argument checker's rules that the derandomized fuzz may not draw: 64-bit integers, count ceilings,
one-line messages for tensors, and the forms callers really pass (pandas Series, block-weight sources)."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import pytest
import torch

from interp import validate
from interp.errors import InterpError


def _ceilinged() -> dict[str, int]:
    """name -> ceiling, read from the rules themselves: the largest value each count rule accepts."""
    found = {}
    for name, rule in validate.NAMED.items():
        try:
            rule(1 << 40, name, {})
        except InterpError as exc:
            if "at most" in str(exc):
                found[name] = int(str(exc).split("at most ")[1].split(" ")[0].replace(",", ""))
    return found


def test_the_work_setting_counts_have_ceilings():
    assert set(_ceilinged()) >= {"hops", "ig_steps", "n_layers", "n_queries", "n_keys", "max_new_tokens"}


@pytest.mark.parametrize("name", sorted(_ceilinged()))
def test_a_ceiling_is_accepted_and_one_more_is_refused_with_its_reason(name):
    ceiling = _ceilinged()[name]
    validate.NAMED[name](ceiling, name, {})
    with pytest.raises(InterpError, match=rf"{name} must be at most {ceiling:,} \(.+\), got {ceiling + 1:,}\."):
        validate.NAMED[name](ceiling + 1, name, {})


@pytest.mark.parametrize("value", [2**63, -(2**63), 2**70])
def test_integers_beyond_64_bits_are_refused(value):
    with pytest.raises(InterpError, match="must fit in 64 bits"):
        validate.integer(value, "min_keys")
    assert validate.integer(2**63 - 1, "min_keys") == 2**63 - 1


def test_a_tensor_in_a_message_is_one_line():
    @validate.checked
    def f(n_boot: int = 1) -> int:
        return n_boot

    with pytest.raises(InterpError) as exc:
        f(n_boot=torch.zeros(3, 4, dtype=torch.long))
    assert "\n" not in str(exc.value) and "a tensor of shape [3, 4]" in str(exc.value)


def test_a_series_is_taken_where_a_sequence_is_meant_and_a_frame_is_not():
    @validate.checked
    def f(names: Sequence[str]) -> list[str]:
        return list(names)

    assert f(pd.Series(["head 1.0", "mlp 2"])) == ["head 1.0", "mlp 2"]
    with pytest.raises(InterpError, match="names must be"):
        f(pd.DataFrame({"a": ["x"]}))


def test_a_block_weight_source_is_a_patching_target_and_a_plain_object_is_not():
    class Source:
        def block(self, layer: int) -> dict[str, torch.Tensor]:
            return {}

    validate.model_or_weights(Source(), "target", {})
    validate.model_or_weights({"0.q": torch.zeros(1)}, "target", {})
    with pytest.raises(InterpError, match="target must be a model"):
        validate.model_or_weights(object(), "target", {})
