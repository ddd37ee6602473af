"""The inputs of the survival study's units, made exactly as ``survival-1.json`` states them.

- :func:`token_set`: the frequent normal tokens E the repeated sequences draw from;
- :func:`repeated_sequences`: BOS, R distinct tokens of E, the same R again;
- :func:`ioi_candidates` and :func:`capital_candidates`: the prompt pairs before the reference filter;
- :func:`reference_sets`: the selection and measurement sets, after the reference's filter.

Example:
    >>> import torch
    >>> from interp.report.survival.units import repeated_sequences
    >>> seqs = repeated_sequences([5, 6, 7, 8, 9], bos=1, r=3, n=2, seed=0)
    >>> seqs.shape, bool((seqs[:, 1:4] == seqs[:, 4:7]).all()), bool((seqs[:, 0] == 1).all())
    (torch.Size([2, 7]), True, True)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from interp.errors import DataError

__all__ = ["Pairs", "capital_candidates", "ioi_candidates", "reference_sets", "repeated_sequences", "token_set"]


def gguf_token_types(path: Any) -> list[int]:
    """Every token's GGUF token type (1 = normal) from the file's header."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("tokenizer.ggml.token_type")
    if field is None:
        raise DataError(f"{path} stores no tokenizer.ggml.token_type: the token set needs the GGUF's token types")
    return [int(field.parts[i][0]) for i in field.data]


def token_counts(tokenizer: Any, texts: Sequence[str]) -> Counter[int]:
    """How often each id occurs when every text is encoded alone, without special tokens."""
    counts: Counter[int] = Counter()
    for text in texts:
        counts.update(tokenizer.encode(text, add_special_tokens=False))
    return counts


def token_set(counts: Counter[int], special: Sequence[int], types: Sequence[int], size: int) -> list[int]:
    """The ``size`` most frequent ids (ties to the lower id) among normal (type 1), non-special tokens.

    Example:
        >>> from collections import Counter
        >>> token_set(Counter({4: 9, 2: 9, 3: 1, 0: 50, 5: 70}), special=[0], types=[1, 1, 1, 1, 1, 3], size=2)
        [2, 4]
    """
    banned = set(int(i) for i in special)
    allowed = [i for i in counts if i not in banned and 0 <= i < len(types) and types[i] == 1]
    chosen = sorted(allowed, key=lambda i: (-counts[i], i))[:size]
    if len(chosen) < size:
        raise DataError(f"the text holds only {len(chosen)} distinct normal tokens; the token set needs {size}")
    return chosen


def repeated_sequences(ids: Sequence[int], bos: int, r: int, n: int, seed: int) -> torch.Tensor:
    """``[n, 2r + 1]`` rows: BOS, ``r`` distinct ids of ``ids`` drawn by ``randperm`` (one generator, in row order),
    then the same ``r`` again."""
    if r > len(ids):
        raise DataError(f"a repeated sequence of {r} distinct tokens needs at least {r} ids; the set has {len(ids)}")
    pool = torch.tensor(list(ids), dtype=torch.long)  # host: ids for a seeded CPU draw, as registered
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        half = pool[torch.randperm(len(pool), generator=g)[:r]]  # host: the registered seeded CPU draw
        rows.append(torch.cat([torch.tensor([bos]), half, half]))  # host: token ids, moved with the batch
    return torch.stack(rows)


@dataclass(frozen=True)
class Pairs:
    """Clean/corrupt prompt pairs with their answer and wrong token ids, in candidate order."""

    clean: list[str]
    corrupt: list[str]
    answers: list[int]
    wrongs: list[int]

    def __len__(self) -> int:
        return len(self.clean)

    def take(self, index: Sequence[int]) -> "Pairs":
        return Pairs([self.clean[i] for i in index], [self.corrupt[i] for i in index],
                     [self.answers[i] for i in index], [self.wrongs[i] for i in index])

    def to_dict(self) -> dict[str, list[Any]]:
        return {"clean": self.clean, "corrupt": self.corrupt, "answers": self.answers, "wrongs": self.wrongs}


def _dedup(clean: list[str], corrupt: list[str], answers: list[int], wrongs: list[int]) -> Pairs:
    seen: set[tuple[str, str]] = set()
    keep = []
    for i, key in enumerate(zip(clean, corrupt, strict=True)):
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return Pairs(clean, corrupt, answers, wrongs).take(keep)


def one_token(tokenizer: Any, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise DataError(f"{text!r} is {len(ids)} tokens under this tokenizer; the registered task needs one")
    return int(ids[0])


def ioi_candidates(tokenizer: Any, spec: dict[str, Any]) -> Pairs:
    """The registered IOI candidates: ``ioi_task(tokenizer, n, seed)`` in order, exact duplicates dropped."""
    from interp.localize.tasks import NAMES, ioi_task

    names = [n for n in NAMES if len(tokenizer.encode(" " + n, add_special_tokens=False)) == 1]
    if len(names) != len(NAMES):
        raise DataError(f"the registration expects all {len(NAMES)} IOI names as one token; this tokenizer splits "
                        f"{', '.join(sorted(set(NAMES) - set(names)))}")
    n, seed = _ints(spec["source"], "n="), _ints(spec["source"], "seed=")
    task = ioi_task(tokenizer, n=n, seed=seed)
    return _dedup(list(task.clean.texts), list(task.corrupt.texts), [int(a) for a in task.answers.tolist()],
                  [int(w) for w in task.wrongs.tolist()])


def _ints(text: str, key: str) -> int:
    """The integer after ``key`` in the registration's source line (``ioi_task(tokenizer, n=2048, seed=2034)``)."""
    start = text.index(key) + len(key)
    end = start
    while end < len(text) and text[end].isdigit():
        end += 1
    return int(text[start:end])


def capital_candidates(tokenizer: Any, spec: dict[str, Any]) -> Pairs:
    """The registered capital-city candidates: pairs of countries drawn by ``randperm`` (seed from the file)."""
    countries = [tuple(part.strip() for part in item.split(":")) for item in spec["countries"]]
    templates = list(spec["templates"])
    seed, count = _ints(spec["candidates"], "manual_seed("), _ints(spec["candidates"], "for i in 0..") + 1
    g = torch.Generator().manual_seed(seed)
    clean, corrupt, answers, wrongs = [], [], [], []
    for i in range(count):
        a, b = torch.randperm(len(countries), generator=g)[:2].tolist()  # host: the registered seeded draw
        template = templates[i % len(templates)]
        clean.append(template.format(c=countries[a][0]))
        corrupt.append(template.format(c=countries[b][0]))
        answers.append(one_token(tokenizer, " " + countries[a][1]))
        wrongs.append(one_token(tokenizer, " " + countries[b][1]))
    return _dedup(clean, corrupt, answers, wrongs)


def reference_sets(passing: Sequence[int], selection: int = 64, measurement: int = 128
                   ) -> tuple[list[int], list[int], str]:
    """The selection and measurement sets from the candidates that pass the reference filter, in order, and the
    registered reading of their size: ``"measured"``, ``"short"`` (64-127 measurement pairs, all used, stated) or
    ``"not measured"`` (fewer than 64 + 64 pass)."""
    passing = list(passing)
    if len(passing) < selection + 64:
        return [], [], "not measured"
    chosen = passing[:selection]
    rest = passing[selection:selection + measurement]
    return chosen, rest, "measured" if len(rest) == measurement else "short"
