"""Small prompt tasks for circuit work: an indirect-object-identification (IOI) set.

The IOI task (Wang et al. 2022, arXiv 2211.00593): in "When Mary and John went to the store,
John gave a drink to", the answer is the *indirect object* " Mary", not the repeated subject
" John". The corrupted prompt is the paper's "ABC" version: the second mention of the subject
is replaced by a third name ("..., Anna gave a drink to"), which removes the information
the circuit uses while keeping every token position.

Names are drawn from a fixed list and kept only where the tokenizer gives " Name" (with its
leading space) a single token, so every clean prompt and its corruption have the same number
of tokens and the answer and wrong tokens are single ids.

Example (the tiny models' byte tokenizer has no single-token names; the bundled SmolLM2's has all 30):
    >>> import interp
    >>> single_token_names(interp.models.tiny_tokenizer())
    []
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from interp.data import Examples, examples_from_texts
from interp.errors import DataError

NAMES = ("Mary", "John", "Anna", "James", "Sarah", "David", "Emma", "Michael", "Lisa", "Paul", "Laura", "Mark",
         "Kate", "Tom", "Alice", "Peter", "Jane", "Chris", "Amy", "Daniel", "Rachel", "Sam", "Helen", "George",
         "Ben", "Lucy", "Jack", "Sophie", "Henry", "Grace")
TEMPLATES = (
    "When {a} and {b} went to the store, {c} gave a drink to",
    "When {a} and {b} went to the park, {c} gave a ball to",
    "After {a} and {b} arrived at the office, {c} handed a letter to",
    "Then {a} and {b} had lunch at home, and {c} passed the salt to",
)


@dataclass(frozen=True)
class IOITask:
    """Clean and corrupted IOI prompts with their answer (indirect object) and wrong (subject) tokens."""

    clean: Examples
    corrupt: Examples
    answers: torch.Tensor  # [N] the indirect object's token id (with its leading space)
    wrongs: torch.Tensor  # [N] the subject's token id
    names: tuple[str, ...]  # the single-token names the prompts were drawn from


def single_token_names(tokenizer: Any, names: tuple[str, ...] = NAMES) -> list[str]:
    """The names that the tokenizer encodes as one token with a leading space."""
    return [name for name in names if len(tokenizer.encode(" " + name, add_special_tokens=False)) == 1]


def ioi_task(tokenizer: Any, n: int = 16, seed: int = 0) -> IOITask:
    """``n`` IOI prompts from :data:`TEMPLATES` and the tokenizer's single-token names (seeded)."""
    names = single_token_names(tokenizer)
    if len(names) < 3:
        raise DataError(f"The IOI task needs at least 3 names that this tokenizer encodes as one token; found "
                        f"{len(names)} ({', '.join(names) or 'none'}). A byte-level or character tokenizer has none.")
    g = torch.Generator().manual_seed(seed)
    clean, corrupt, answers, wrongs = [], [], [], []
    for i in range(n):
        a, b, c = (names[j] for j in torch.randperm(len(names), generator=g)[:3].tolist())  # host: seeded CPU draw
        template = TEMPLATES[i % len(TEMPLATES)]
        clean.append(template.format(a=a, b=b, c=b))
        corrupt.append(template.format(a=a, b=b, c=c))
        answers.append(tokenizer.encode(" " + a, add_special_tokens=False)[0])
        wrongs.append(tokenizer.encode(" " + b, add_special_tokens=False)[0])
    return IOITask(examples_from_texts(clean, tokenizer), examples_from_texts(corrupt, tokenizer),
                   torch.tensor(answers), torch.tensor(wrongs), tuple(names))  # host: token ids, as the examples
