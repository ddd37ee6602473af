"""Prompts and answers as a researcher types them: strings, token ids or :class:`~interp.data.Examples`.

The toolbox helpers (:mod:`~interp.localize.ablation`, :mod:`~interp.localize.heatmaps`,
:mod:`~interp.localize.top_tokens`, :mod:`~interp.localize.patterns`,
:mod:`~interp.localize.linear_probe`, :mod:`~interp.localize.steering`) take their inputs
through these functions and the circuit tools' own doors (:func:`interp.localize.circuit.prompt_rows`,
:func:`interp.localize.circuit.answer_ids`), so each accepts the same forms as ``interp.dla`` and
refuses bad ones with the same words.

Example:
    >>> import interp
    >>> from interp.localize.prompts import as_examples, answer_ids, token_labels
    >>> model = interp.tiny_model("llama")
    >>> ex = as_examples(model, ["ab", "abc"])  # strings: BOS + tokens, padded with a mask
    >>> ex.tokens.shape, ex.padded
    (torch.Size([2, 4]), True)
    >>> answer_ids(model, "x", 2).tolist(), answer_ids(model, [87, 88], 2).tolist()
    ([87, 87], [87, 88])
    >>> token_labels(model, ex.tokens[1])
    ['0:<bos>', '1:a', '2:b', '3:c']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

from torch import Tensor

from interp.data import Examples
from interp.errors import DataError
from interp.localize.circuit import answer_ids, prompt_rows  # noqa: F401 (answer_ids: re-exported)
from interp.models import Model
from interp.runtime.batching import check_examples
from interp.validate import checked, token_ids

Prompts = Union[str, Sequence[str], Examples, Tensor]
Answers = Union[str, int, Sequence[Union[str, int]], Tensor]


@checked
def as_examples(model: Model, prompts: Prompts, what: str = "prompts") -> Examples:
    """``prompts`` as checked Examples: a string or a list of strings (BOS added, padded with a mask),
    token rows ``[N, T]`` (or one row ``[T]``), or Examples as they are (:func:`interp.localize.circuit.prompt_rows`,
    the circuit tools' door, then the model's checks)."""
    examples = prompt_rows(model, prompts, what)
    check_examples(model, examples)
    return examples


@checked
def one_prompt(model: Model, prompt: Prompts) -> Tensor:
    """The real tokens ``[T]`` of a single prompt (a string, one row of ids, or one-row Examples)."""
    examples = as_examples(model, prompt, "prompt")
    if len(examples) != 1:
        raise DataError(f"This takes one prompt; got {len(examples)}. Pass a single string (or one row of ids).")
    row = examples.tokens[0]
    return row if examples.attention_mask is None else row[examples.attention_mask[0]]


@checked(ids=token_ids)
def token_strings(model: Model, ids: Sequence[int] | Tensor) -> list[str]:
    """Each token id decoded alone (what a figure labels it with)."""
    values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
    return [model.tokenizer.decode([int(i)]) for i in values]


@checked(ids=token_ids)
def token_labels(model: Model, ids: Sequence[int] | Tensor) -> list[str]:
    """``"position:token"`` labels, unique even where a token repeats (a figure's axis needs that)."""
    return [f"{i}:{text}" for i, text in enumerate(token_strings(model, ids))]
