"""Prompts and answers as a researcher types them: strings, token ids or :class:`~interp.data.Examples`.

The toolbox helpers (:mod:`~interp.localize.ablation`, :mod:`~interp.localize.heatmaps`,
:mod:`~interp.localize.top_tokens`, :mod:`~interp.localize.patterns`,
:mod:`~interp.localize.linear_probe`, :mod:`~interp.localize.steering`) take their inputs
through these functions, so each accepts the same forms and refuses bad ones with the same words.

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
from typing import Any, Union

import torch
from torch import Tensor

from interp.data import Examples, examples_from_texts
from interp.errors import DataError
from interp.models import Model
from interp.runtime import hooks as hk
from interp.runtime.batching import check_examples

Prompts = Union[str, Sequence[str], Examples, Tensor]
Answers = Union[str, int, Sequence[Union[str, int]], Tensor]


def as_examples(model: Model, prompts: Prompts, what: str = "prompts") -> Examples:
    """``prompts`` as checked Examples: a string or a list of strings (BOS added, padded with a mask),
    token rows ``[N, T]`` (or one row ``[T]``), or Examples as they are."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, Examples):
        examples = prompts
    elif isinstance(prompts, Tensor):
        rows = prompts[None] if prompts.ndim == 1 else prompts
        examples = Examples.from_tokens(rows)
    elif isinstance(prompts, Sequence) and prompts and all(isinstance(p, str) for p in prompts):
        examples = examples_from_texts(list(prompts), model.tokenizer)
    else:
        raise DataError(f"{what} must be a string, a list of strings, token ids [N, T] or interp Examples; got "
                        f"{type(prompts).__name__}.")
    check_examples(model, examples)
    return examples


def one_prompt(model: Model, prompt: Prompts) -> Tensor:
    """The real tokens ``[T]`` of a single prompt (a string, one row of ids, or one-row Examples)."""
    examples = as_examples(model, prompt, "prompt")
    if len(examples) != 1:
        raise DataError(f"This takes one prompt; got {len(examples)}. Pass a single string (or one row of ids).")
    row = examples.tokens[0]
    return row if examples.attention_mask is None else row[examples.attention_mask[0]]


def answer_ids(model: Model, answers: Answers, n: int, what: str = "answer") -> Tensor:
    """``[n]`` token ids: one answer for every prompt or one per prompt; a string must be one token
    (``" Mary"`` with its leading space, as the tokenizer splits words)."""
    if isinstance(answers, (str, int)) or (isinstance(answers, Tensor) and answers.ndim == 0):
        answers = [answers]  # type: ignore[list-item]
    values = answers.tolist() if isinstance(answers, Tensor) else list(answers)  # type: ignore[arg-type]
    ids = [_one_token(model, value, what) for value in values]
    if len(ids) == 1:
        ids = ids * n
    if len(ids) != n:
        raise DataError(f"{what} needs one token or one per prompt ({n}); got {len(ids)}.")
    return torch.tensor(ids, dtype=torch.long)


def _one_token(model: Model, value: Any, what: str) -> int:
    vocab = int(hk.unembed_weight(model).shape[0])
    if isinstance(value, str):
        ids = model.tokenizer.encode(value, add_special_tokens=False)
        if len(ids) != 1:
            raise DataError(f"{what} {value!r} is {len(ids)} tokens for this tokenizer; use a single-token answer "
                            "(often with its leading space, ' Mary') or pass its token id.")
        return int(ids[0])
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
        raise DataError(f"{what} token ids must be integers in 0..{vocab - 1}; got {value!r}.")
    return int(value)


def token_strings(model: Model, ids: Sequence[int] | Tensor) -> list[str]:
    """Each token id decoded alone (what a figure labels it with)."""
    values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
    return [model.tokenizer.decode([int(i)]) for i in values]


def token_labels(model: Model, ids: Sequence[int] | Tensor) -> list[str]:
    """``"position:token"`` labels, unique even where a token repeats (a figure's axis needs that)."""
    return [f"{i}:{text}" for i, text in enumerate(token_strings(model, ids))]
