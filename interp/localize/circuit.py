"""Circuits on your own prompt: direct logit attribution, edge attribution and path patching from plain strings.

The three circuit tools take token rows and a metric (:func:`~interp.localize.dla.logit_attribution`,
:func:`~interp.localize.eap.edge_attribution`, :func:`~interp.localize.paths.path_patch`). The
functions here are their doors for prompts written as text, one dot away as ``interp.dla``,
``interp.eap`` and ``interp.path_patch``:

- a *prompt* is a string, a list of strings (one prompt per row, padded as
  :func:`~interp.data.examples_from_texts` pads them: BOS first, each row read as its real tokens
  alone), :class:`~interp.data.Examples`, or a tensor of token ids (``[T]`` or ``[N, T]``, used as given);
- an *answer* (and the *wrong* answer it is compared with) is a string or a token id, one for all
  prompts or one per prompt. A string must be exactly one token under the model's tokenizer.
  Most tokenizers (GPT-2, LLaMA, SmolLM2) fold the space before a word into the word's token,
  so the answer after "The capital of France is" is ``" Paris"`` with its leading space;
  ``"Paris"`` is another token (or several). A string that is not one token is refused with
  how it tokenizes.

The logit difference ``logit(answer) - logit(wrong)`` is read at each prompt's last real token.
Each corrupted prompt must tokenize to as many tokens as its clean prompt (swap one
single-token word: a name, a city).

:func:`~interp.localize.circuit.circuit` runs the three in the usual order on a prompt pair: DLA finds the heads that
write the answer, EAP scores every edge into the logits and into those heads' queries, keys and
values, and path patching measures the top edges exactly (``interp circuit`` on the command line).

Example:
    >>> import interp
    >>> model = interp.tiny_model("llama")  # a byte-level tokenizer: every character is one token
    >>> res = interp.dla(model, "The cat sat on the", "m", "h")
    >>> res.settings["answer_text"], tuple(res.heads.shape)
    (['m'], (1, 2, 4))
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from interp.data import Examples, aligned_rows, examples_from_texts, real_lengths
from interp.display import ResultDisplay
from interp.errors import ComponentError, DataError
from interp.localize.dla import LogitAttribution, logit_attribution
from interp.localize.eap import EdgeAttribution, edge_attribution
from interp.localize.patching.metrics import LogitDiffMetric
from interp.localize.paths import RECEIVER_INPUTS, PathPatchResult, Receiver, Sender, _capture
from interp.localize.paths import path_patch as _path_patch
from interp.models import Model
from interp.runtime import hooks as hk
from interp.runtime.batching import device_of
from interp.validate import batch_size as _batch_size
from interp.validate import checked, count, integer, is_integer

Prompts = str | Sequence[str] | Examples | Tensor
Answers = str | int | Sequence[str | int] | Tensor

# ---------------------------------------------------------------------------------------
# Prompts and answers


@checked
def prompt_rows(model: Model, prompts: Prompts, what: str = "prompts") -> Examples:
    """``prompts`` as :class:`~interp.data.Examples` of ``model``'s tokenizer (strings get BOS and padding).

    Example:
        >>> import interp
        >>> model = interp.tiny_model("llama")
        >>> prompt_rows(model, ["ab", "abcd"]).attention_mask.sum(dim=1).tolist()  # BOS + one token a byte
        [3, 5]
    """
    if isinstance(prompts, Examples):
        return prompts
    if isinstance(prompts, Tensor):
        if prompts.ndim == 1:
            prompts = prompts[None]
        return Examples.from_tokens(prompts)
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise DataError(f"{what} must be a string, a list of strings, interp Examples or a tensor of token ids; "
                        f"got {type(prompts).__name__}.")
    if len(prompts) == 0:
        raise DataError(f"{what} is empty: give at least one prompt.")
    for i, text in enumerate(prompts):
        if not isinstance(text, str):
            raise DataError(f"{what}[{i}] is a {type(text).__name__}; every prompt must be a string.")
        if not text.strip():
            raise DataError(f"{what}[{i}] is empty: every prompt must hold some text.")
    return examples_from_texts(list(prompts), _tokenizer(model))


def _tokenizer(model: Model) -> Any:
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise DataError("This model has no tokenizer, so prompts and answers cannot be strings: pass token ids, or "
                        "load the model with interp.load_model(model, tokenizer=...).")
    return tokenizer


def one_token(tokenizer: Any, text: str, what: str = "answer") -> int:
    """The id of ``text`` if the tokenizer encodes it as exactly one token; otherwise a
    :class:`~interp.errors.DataError` that shows how it tokenizes and what to pass.

    Example:
        >>> import interp
        >>> tok = interp.models.tiny_tokenizer()  # one token a byte
        >>> one_token(tok, " ") == tok.encode(" ", add_special_tokens=False)[0]
        True
        >>> one_token(tok, " Paris")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        interp.errors.DataError: answer ' Paris' is 6 tokens under this model's tokenizer (' ', 'P', 'a', 'r', ...
    """
    if not text:
        raise DataError(f"{what} is an empty string; pass one token such as ' Paris', or its token id.")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1:
        return int(ids[0])
    pieces = ", ".join(repr(tokenizer.decode([i])) for i in ids)
    hint = ""
    if not text.startswith(" ") and len(tokenizer.encode(" " + text, add_special_tokens=False)) == 1:
        hint = f" With its leading space, {' ' + text!r} is one token: did you mean it?"
    raise DataError(f"{what} {text!r} is {len(ids)} tokens under this model's tokenizer ({pieces}), but an answer "
                   "must be one token. Pass a single-token string (mind the leading space: the word after a space "
                   f"is usually ' Paris', not 'Paris') or its token id.{hint}")


@checked(answers=lambda value, name, arguments: None,  # strings or ids, checked below with their own words
         n=lambda value, name, arguments: count(value, name) and None)
def answer_ids(model: Model, answers: Answers, n: int, what: str = "answer") -> Tensor:
    """``[n]`` token ids: one answer for all ``n`` prompts or one per prompt, each a single-token string or an id.

    Example:
        >>> import interp
        >>> model = interp.tiny_model("llama")
        >>> answer_ids(model, "M", 3).tolist() == [model.tokenizer.encode("M", add_special_tokens=False)[0]] * 3
        True
    """
    if isinstance(answers, Tensor):
        if answers.is_floating_point() or answers.is_complex() or answers.dtype == torch.bool or answers.ndim > 1:
            raise DataError(f"{what} as a tensor must hold integer token ids, one or one per prompt; got "
                            f"{answers.dtype} of shape {tuple(answers.shape)}.")
        items: list[Any] = answers.reshape(-1).tolist()
    elif isinstance(answers, (str, bytes)) or is_integer(answers):
        items = [answers]
    elif isinstance(answers, Sequence):
        items = list(answers)
    else:
        raise DataError(f"{what} must be a string, a token id, or a list of them; got {type(answers).__name__}.")
    if len(items) not in (1, n):
        raise DataError(f"{len(items)} {what}s for {n} prompt(s): give one {what} for all prompts or one per prompt.")
    vocab = int(hk.unembed_weight(model).shape[0])
    ids = []
    for i, item in enumerate(items):
        where = what if len(items) == 1 else f"{what}[{i}]"
        if isinstance(item, str):
            ids.append(one_token(_tokenizer(model), item, where))
            continue
        token = integer(item, where, minimum=0, error=DataError)
        if token >= vocab:
            raise DataError(f"{where} is token id {token}, but this model's vocabulary has ids 0..{vocab - 1}.")
        ids.append(token)
    # host: the user's token ids, one per prompt; their readers move them with each batch
    return torch.tensor(ids * (n if len(ids) == 1 else 1), dtype=torch.long)


def _texts(model: Model, ids: Tensor) -> list[str]:
    tokenizer = getattr(model, "tokenizer", None)
    return [tokenizer.decode([int(i)]) if tokenizer is not None else str(int(i)) for i in ids]


def _pair(model: Model, clean: Prompts, corrupt: Prompts) -> tuple[Examples, Examples]:
    """Clean and corrupted rows, one corrupted row per clean row, each as long as its clean row."""
    rows, source = prompt_rows(model, clean, "clean"), prompt_rows(model, corrupt, "corrupt")
    if len(rows) != len(source):
        raise DataError(f"{len(rows)} clean and {len(source)} corrupt prompts: give one corrupted prompt per clean "
                        "prompt.")
    a, b = real_lengths(rows), real_lengths(source)
    for i in (a != b).nonzero().flatten().tolist():
        raise DataError(f"clean prompt {i} is {int(a[i])} tokens but its corrupted prompt {int(b[i])}: each pair "
                        "must tokenize to the same length. Change one single-token word (a name, a city), keeping "
                        f"the rest. Tokens: clean {_real_texts(model, rows, i)}, "
                        f"corrupt {_real_texts(model, source, i)}.")
    return rows, source


def _real_texts(model: Model, rows: Examples, i: int) -> list[str]:
    tokens = rows.tokens[i]
    if rows.attention_mask is not None:
        tokens = tokens[rows.attention_mask[i]]
    return _texts(model, tokens)


def _with_text(result: Any, model: Model, answers: Tensor, wrongs: Tensor | None) -> Any:
    """``result`` with the answers' strings in its settings (the figures label answers by them)."""
    texts = {"answer_text": _texts(model, answers)}
    if wrongs is not None:
        texts["wrong_text"] = _texts(model, wrongs)
    return replace(result, settings={**result.settings, **texts})


# ---------------------------------------------------------------------------------------
# Senders and receivers by name


_SENDER = re.compile(r"^\s*(?:head\s+(\d+)\.(\d+)|mlp\s+(\d+))\s*$")
_RECEIVER = re.compile(r"^\s*([qkv])\s+(\d+)\.(\d+)\s*$")


def sender(value: Sender | str) -> Sender:
    """A :class:`~interp.localize.paths.Sender`, or one written as EAP's tables write it: ``"head 9.1"``, ``"mlp 3"``.

    Example:
        >>> sender("head 9.1"), sender("mlp 3")
        (Sender(kind='head', layer=9, head=1), Sender(kind='mlp', layer=3, head=None))
    """
    if isinstance(value, Sender):
        return value
    match = _SENDER.match(value) if isinstance(value, str) else None
    if match is None:
        raise ComponentError(f"Sender {value!r}: write 'head LAYER.HEAD' (e.g. 'head 9.1') or 'mlp LAYER', or pass "
                             "a Sender.")
    if match.group(3) is not None:
        return Sender("mlp", int(match.group(3)))
    return Sender("head", int(match.group(1)), int(match.group(2)))


def receiver(value: Receiver | str) -> Receiver:
    """A receiver ``(layer, head, "q" | "k" | "v")``, or one written as EAP's tables write it: ``"q 9.1"``.

    Example:
        >>> receiver("v 9.0")
        (9, 0, 'v')
    """
    if isinstance(value, str):
        match = _RECEIVER.match(value)
        if match is None:
            raise ComponentError(f"Receiver {value!r}: write 'q LAYER.HEAD', 'k LAYER.HEAD' or 'v LAYER.HEAD' (keys "
                                 "and values count key/value heads), or pass 'logits' for the direct path.")
        return int(match.group(2)), int(match.group(3)), match.group(1)
    if (isinstance(value, tuple) and len(value) == 3 and is_integer(value[0]) and is_integer(value[1])
            and value[2] in RECEIVER_INPUTS):
        return int(value[0]), int(value[1]), value[2]
    raise ComponentError(f"Receiver {value!r}: use (layer, head, 'q' | 'k' | 'v') or 'q 9.1'.")


def _senders(model: Model, senders: Sequence[Sender | str] | None) -> list[Sender]:
    if senders is None:
        n_layers, n_heads = hk.n_layers(model), int(model.cfg.n_heads)
        return ([Sender("head", layer, head) for layer in range(n_layers) for head in range(n_heads)]
                + [Sender("mlp", layer) for layer in range(n_layers)])
    if isinstance(senders, (str, Sender)):
        senders = [senders]
    return [sender(s) for s in _listed(senders, "senders", "'head 9.1' or 'mlp 3'")]


def _receivers(receivers: Sequence[Receiver | str] | str) -> list[Receiver] | str:
    if isinstance(receivers, str) and receivers == "logits":
        return "logits"
    if isinstance(receivers, (str, tuple)):
        return [receiver(receivers)]  # type: ignore[arg-type]
    return [receiver(r) for r in _listed(receivers, "receivers", "'logits', 'q 9.1' or (9, 1, 'q')")]


def _listed(values: Any, what: str, example: str) -> list[Any]:
    if isinstance(values, (bytes, dict, Tensor)) or not isinstance(values, Iterable):
        raise ComponentError(f"{what} must be a list such as [{example}], got {type(values).__name__}.")
    return list(values)


# ---------------------------------------------------------------------------------------
# The three tools


@checked
def dla(model: Model, prompts: Prompts, answer: Answers, wrong: Answers | None = None, *, position: int = -1,
        batch_size: int = 8, progress: bool | None = None) -> LogitAttribution:
    """Direct logit attribution of ``answer`` (minus ``wrong``) at each prompt's last token, from strings.

    :func:`~interp.localize.dla.logit_attribution` on ``prompts``: how much the embedding, each
    head and each MLP write ``logit(answer) - logit(wrong)`` (or ``logit(answer)``) directly.

    Args:
        model: a bridge from :func:`interp.load_model`.
        prompts: a string, a list of strings, Examples or token ids (see :mod:`interp.localize.circuit`).
        answer: a single-token string (``" Paris"``, leading space included) or a token id; one for
            all prompts or one per prompt.
        wrong: the answer it is compared with (same forms), or None for the answer's logit alone.
        position: where the logit is read, counted in each prompt's real tokens (-1: the last).
        batch_size: prompts per forward.
        progress: show a progress bar.

    Returns:
        A :class:`~interp.localize.dla.LogitAttribution`; ``settings["answer_text"]`` (and
        ``"wrong_text"``) hold the answers as strings.

    Example:
        >>> import interp
        >>> model = interp.tiny_model("llama")
        >>> res = interp.dla(model, ["When Mary and John", "When John and Mary"], "M", "J")
        >>> bool((res.total() - res.logit).abs().max() < 1e-4)  # the terms add up to the logit difference
        True
    """
    rows = prompt_rows(model, prompts)
    answers = answer_ids(model, answer, len(rows))
    wrongs = None if wrong is None else answer_ids(model, wrong, len(rows), "wrong")
    result = logit_attribution(model, rows, answers, versus=wrongs, positions=integer(position, "position"),
                               batch_size=_batch_size(batch_size), progress=progress)
    return _with_text(result, model, answers, wrongs)


@checked
def eap(model: Model, clean: Prompts, corrupt: Prompts, answer: Answers, wrong: Answers, *,
        senders: Sequence[Sender | str] | None = None, receivers: Sequence[Receiver | str] | str = "logits",
        ig_steps: int = 1, batch_size: int = 8) -> EdgeAttribution:
    """Edge attribution patching (EAP, or EAP-IG with ``ig_steps > 1``) of the logit difference, from strings.

    :func:`~interp.localize.eap.edge_attribution` with the metric ``logit(answer) - logit(wrong)``
    at each clean prompt's last token, the corrupted prompts as the source.

    Args:
        model: a bridge from :func:`interp.load_model`.
        clean: the clean prompts (see :mod:`interp.localize.circuit` for the forms).
        corrupt: one corrupted prompt per clean prompt, each tokenizing to the same length.
        answer: the right answer: a single-token string or id, one for all prompts or one per prompt.
        wrong: the answer it is compared with.
        senders: heads and MLPs (Senders or names such as ``"head 9.1"``, ``"mlp 3"``); default all.
        receivers: ``"logits"`` (each sender's direct path) or receivers such as ``"q 9.1"`` or ``(9, 1, "q")``.
        ig_steps: gradient evaluations along the embedding path (1: plain EAP).
        batch_size: prompts per forward and backward pass.

    Returns:
        An :class:`~interp.localize.eap.EdgeAttribution` (``table()``, ``top(k)``).

    Example:
        >>> import interp
        >>> model = interp.tiny_model("llama")
        >>> clean, corrupt = "When Mary and John went, John gave it to", "When Mary and John went, Anna gave it to"
        >>> res = interp.eap(model, clean, corrupt, "M", "J")
        >>> len(res.table())  # 2 layers x 4 heads + 2 MLPs, each into the logits
        10
    """
    rows, source = _pair(model, clean, corrupt)
    answers, wrongs = answer_ids(model, answer, len(rows)), answer_ids(model, wrong, len(rows), "wrong")
    result = edge_attribution(model, rows, _senders(model, senders), _receivers(receivers), source_examples=source,
                              metric=LogitDiffMetric(answers, wrongs), ig_steps=ig_steps,
                              batch_size=_batch_size(batch_size))
    return _with_text(result, model, answers, wrongs)


@checked
def path_patch(model: Model, clean: Prompts, corrupt: Prompts, answer: Answers, wrong: Answers,
               senders: Sequence[Sender | str] | Sender | str, receivers: Sequence[Receiver | str] | str = "logits", *,
               batch_size: int = 8, max_rows: int = 64) -> PathPatchResult:
    """Path patching of the logit difference, from strings: each sender patched from the corrupted
    prompt along its paths to ``receivers`` only (:func:`~interp.localize.paths.path_patch`).

    Args:
        model: a bridge from :func:`interp.load_model`.
        clean: the clean prompts (see :mod:`interp.localize.circuit` for the forms).
        corrupt: one corrupted prompt per clean prompt, each tokenizing to the same length.
        answer: the right answer: a single-token string or id, one for all prompts or one per prompt.
        wrong: the answer it is compared with.
        senders: heads and MLPs, as Senders or names such as ``"head 9.1"``, ``"mlp 3"`` (EAP's table's ``sender``).
        receivers: ``"logits"`` (the direct path) or receivers such as ``"q 9.1"`` or ``(9, 1, "q")``.
        batch_size: prompts per batch.
        max_rows: the most rows (prompts x stacked senders) in one forward.

    Returns:
        A :class:`~interp.localize.paths.PathPatchResult`; ``effect()`` is each sender's change of
        the mean logit difference.

    Example:
        >>> import interp
        >>> model = interp.tiny_model("llama")
        >>> res = interp.path_patch(model, "When Mary and John went, John gave it to",
        ...                         "When Mary and John went, Anna gave it to", "M", "J", ["head 0.1", "mlp 1"])
        >>> res.table()["sender"].tolist()
        ['head 0.1', 'mlp 1']
    """
    rows, source = _pair(model, clean, corrupt)
    answers, wrongs = answer_ids(model, answer, len(rows)), answer_ids(model, wrong, len(rows), "wrong")
    result = _path_patch(model, rows, _senders(model, senders if senders is not None else []), _receivers(receivers),
                         source_examples=source, metric=LogitDiffMetric(answers, wrongs),
                         batch_size=_batch_size(batch_size), max_rows=integer(max_rows, "max_rows", minimum=1))
    return _with_text(result, model, answers, wrongs)


# ---------------------------------------------------------------------------------------
# The whole recipe on a prompt pair


@dataclass(frozen=True)
class Circuit(ResultDisplay):
    """DLA, EAP and the path-patching check of the top edges on clean/corrupted prompt pairs
    (:func:`~interp.localize.circuit.circuit`).

    Attributes:
        dla: direct logit attribution on the clean prompts.
        edges: every scored edge, largest ``|score|`` first: ``rank``, ``edge``, ``sender``, ``receiver``,
            ``score`` (EAP's estimate of the change of the mean logit difference).
        confirmed: the top edges measured exactly: ``rank``, ``edge``, ``sender``, ``receiver``, ``eap``,
            ``path_patching`` (the exact change), ``agree`` (same sign).
        movers: the heads whose queries, keys and values were receivers (largest direct contribution).
        attention: the first clean prompt's attention from its last token, for each mover: ``head``,
            ``position``, ``token``, ``weight``.
        tokens: the first clean prompt's tokens as strings (BOS first); ``corrupt_tokens`` its corrupted twin's.
        answer_text, wrong_text: the answers as strings, one per prompt.
        settings: model, prompts, ``top_k``, ``ig_steps``, ...
    """

    dla: LogitAttribution
    edges: pd.DataFrame
    confirmed: pd.DataFrame
    movers: list[str]
    attention: pd.DataFrame
    tokens: list[str]
    corrupt_tokens: list[str]
    answer_text: list[str]
    wrong_text: list[str]
    settings: dict[str, Any] = field(default_factory=dict)

    def table(self) -> pd.DataFrame:
        """The confirmed edges (EAP's estimate beside the exact path-patching effect)."""
        return self.confirmed.copy()

    def tables(self) -> dict[str, pd.DataFrame]:
        """Every table by name: ``dla_heads``, ``dla_layers``, ``edges``, ``confirmed``, ``attention``."""
        means = self.dla.head_means()
        heads = pd.DataFrame([(layer, head, float(means[layer, head])) for layer in range(means.shape[0])
                              for head in range(means.shape[1])], columns=["layer", "head", "dla"])
        return {"dla_heads": heads, "dla_layers": self.dla.summary().reset_index(), "edges": self.edges,
                "confirmed": self.confirmed, "attention": self.attention}


@checked
def circuit(model: Model, clean: Prompts, corrupt: Prompts, answer: Answers, wrong: Answers, *, top_k: int = 8,
            movers: int = 3, ig_steps: int = 1, batch_size: int = 8) -> Circuit:
    """DLA, then EAP, then path patching of EAP's ``top_k`` edges, on clean/corrupted prompt pairs.

    1. :func:`~interp.localize.circuit.dla` on the clean prompts; the ``movers`` heads with the largest mean direct
       contribution (towards the answer) become receivers;
    2. :func:`~interp.localize.circuit.eap` of every head and MLP into the logits and into the movers' queries, keys and
       values (their key/value heads under grouped-query attention);
    3. :func:`~interp.localize.circuit.path_patch` of the ``top_k`` edges with the largest ``|score|``,
       one receiver at a time.

    Args:
        model: a bridge from :func:`interp.load_model`.
        clean, corrupt: prompt pairs (strings, lists of strings, Examples or token ids).
        answer, wrong: single-token strings or ids, one for all pairs or one per pair.
        top_k: how many of EAP's edges path patching measures.
        movers: how many heads' queries, keys and values are receivers (0: the logits only).
        ig_steps: EAP's gradient evaluations (1: plain EAP).
        batch_size: prompts per forward.

    Returns:
        A :class:`~interp.localize.circuit.Circuit`.

    Example:
        >>> import interp
        >>> from interp.localize.circuit import circuit
        >>> model = interp.tiny_model("llama")
        >>> res = circuit(model, "When Mary and John went, John gave it to", "When Mary and John went, Anna gave it to",
        ...               "M", "J", top_k=3, movers=1)
        >>> list(res.confirmed.columns), len(res.confirmed)
        (['rank', 'edge', 'sender', 'receiver', 'eap', 'path_patching', 'agree'], 3)
    """
    top_k, movers = integer(top_k, "top_k", minimum=1), integer(movers, "movers", minimum=0)
    ig_steps = integer(ig_steps, "ig_steps", minimum=1)
    rows, source = _pair(model, clean, corrupt)
    answers, wrongs = answer_ids(model, answer, len(rows)), answer_ids(model, wrong, len(rows), "wrong")
    batch = _batch_size(batch_size)
    attribution = logit_attribution(model, rows, answers, versus=wrongs, batch_size=batch, progress=False)
    attribution = _with_text(attribution, model, answers, wrongs)
    means = attribution.head_means()
    n_heads = means.shape[1]
    chosen = [(int(i) // n_heads, int(i) % n_heads) for i in means.flatten().argsort(descending=True)[:movers]]
    metric = LogitDiffMetric(answers, wrongs)
    edges = _edges(model, rows, source, metric, _mover_receivers(model, chosen), ig_steps, batch)
    confirmed = _confirm(model, rows, source, metric, edges.head(top_k), batch)
    settings = {"model": getattr(getattr(model, "info", None), "name", "model"), "pairs": len(rows), "top_k": top_k,
                "movers": movers, "ig_steps": ig_steps, "clean": list(rows.texts), "corrupt": list(source.texts),
                "logit_diff": float(attribution.logit.double().mean())}
    return Circuit(dla=attribution, edges=edges, confirmed=confirmed, movers=[f"head {a}.{b}" for a, b in chosen],
                   attention=_attention_from_last(model, rows, chosen), tokens=_real_texts(model, rows, 0),
                   corrupt_tokens=_real_texts(model, source, 0), answer_text=_texts(model, answers),
                   wrong_text=_texts(model, wrongs), settings=settings)


def _mover_receivers(model: Model, heads: list[tuple[int, int]]) -> list[Receiver]:
    """Each head's query, and its key/value head's key and value (one key/value head serves a group of heads)."""
    n_heads = int(model.cfg.n_heads)
    group = n_heads // int(hk._dims(model)["n_kv_heads"])
    out: list[Receiver] = [(layer, head, "q") for layer, head in heads]
    out += [(layer, head // group, kind) for layer, head in heads for kind in ("k", "v")]
    return list(dict.fromkeys(out))


def _edges(model: Model, rows: Examples, source: Examples, metric: LogitDiffMetric, receivers: list[Receiver],
           ig_steps: int, batch: int) -> pd.DataFrame:
    """EAP of every head and MLP into the logits and into ``receivers``, largest ``|score|`` first."""
    senders = _senders(model, None)
    common = dict(source_examples=source, metric=metric, ig_steps=ig_steps, batch_size=batch)
    tables = [edge_attribution(model, rows, senders, "logits", **common).table()]  # type: ignore[arg-type]
    if receivers and any(layer > 0 for layer, _, _ in receivers):
        tables.append(edge_attribution(model, rows, senders, receivers, **common).table())  # type: ignore[arg-type]
    edges = pd.concat(tables, ignore_index=True)
    edges = edges.reindex(edges["score"].abs().sort_values(ascending=False, kind="stable").index)
    edges = edges.reset_index(drop=True)
    edges.insert(0, "rank", range(1, len(edges) + 1))
    return edges


def _confirm(model: Model, rows: Examples, source: Examples, metric: LogitDiffMetric, top: pd.DataFrame,
             batch: int) -> pd.DataFrame:
    """Path patching of each edge in ``top``, the edges into one receiver in one call."""
    exact: dict[str, float] = {}
    for name, group in top.groupby("receiver", sort=False):
        target: list[Receiver] | str = "logits" if name == "logits" else [receiver(str(name))]
        result = _path_patch(model, rows, [sender(s) for s in group["sender"]], target, source_examples=source,
                             metric=metric, batch_size=batch)
        exact.update(zip(group["edge"], result.effect().tolist(), strict=True))
    out = top.rename(columns={"score": "eap"}).reset_index(drop=True)
    out["path_patching"] = [exact[e] for e in out["edge"]]
    out["agree"] = (out["eap"] > 0) == (out["path_patching"] > 0)
    return out


def _attention_from_last(model: Model, rows: Examples, heads: list[tuple[int, int]]) -> pd.DataFrame:
    """The first row's attention pattern from its last real token, for each of ``heads``."""
    columns = ["head", "position", "token", "weight"]
    if not heads:
        return pd.DataFrame(columns=columns)
    tokens, lengths = aligned_rows(rows, 0, 1, device_of(model))
    last = int(lengths[0]) if lengths is not None else tokens.shape[1]
    layers = sorted({layer for layer, _ in heads})
    store, _ = _capture(model, tokens[:, :last], [("pattern", layer) for layer in layers])
    texts = _real_texts(model, rows, 0)
    out = []
    for layer, head in heads:
        weights = hk.reader(model, "pattern", layer)(store[("pattern", layer)])[0, head, last - 1].double().cpu()
        out += [(f"head {layer}.{head}", p, texts[p], float(weights[p])) for p in range(last)]
    return pd.DataFrame(out, columns=columns)
