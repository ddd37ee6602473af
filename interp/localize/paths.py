"""Path patching: the effect of one component on the output *through chosen receivers only*.

Activation patching asks what a component does by every route; path patching (Wang et al.
2022, "Interpretability in the Wild: a Circuit for Indirect Object Identification in GPT-2
small", arXiv 2211.00593, section 3.1) asks what it does through a chosen path. The
definition, for a *sender* (an attention head or an MLP) and a set of *receivers* (the
query, key or value input of later heads, or the final residual stream):

1. run the target (clean) prompt and the source (corrupted) prompt, and keep every activation;
2. run the target prompt with the sender's output taken from the source run and
   **everything else frozen at its target value**: every other head and MLP keeps its target
   output, so the change reaches each receiver only directly, along the residual stream;
   record each receiver's input in this run;
3. run the target prompt with the receivers' inputs set to what step 2 recorded, everything
   downstream recomputed, and measure the metric.

With everything frozen, the residual stream that a receiver at layer ``l`` reads in step 2
is the target's ``resid_pre[l]`` plus the sender's change ``delta`` (its patched output
minus its target output, after its own output norm where the model has one). This module
uses that: one forward per window of senders does step 2 (the sender patched, ``delta``
read where it enters the residual, and each receiver layer's residual set to
``resid_pre[l] + delta``), and one more does step 3. Senders are batched by stacking their
rows (one copy of the batch per sender): the rows never mix, so this changes nothing but
speed. :func:`path_patch_naive` is the textbook three-step loop, one sender at a time, which
freezes every head's ``z`` and every MLP output explicitly; the tests compare the two.

The receiver ``"logits"`` (the final residual) gives the sender's *direct* effect: the
final residual is the target's plus ``delta``.

Receivers are written ``(layer, head, input)`` with ``input`` in ``"q"``, ``"k"``, ``"v"``;
for keys and values ``head`` counts key/value heads (fewer than query heads under
grouped-query attention, where one key/value head serves a group of query heads).

Padded examples: each target row and its source row must have the same number of real
tokens (a template filled with different names); rows are run left-aligned, as alone.

Example:
    >>> import interp, torch
    >>> from interp.localize.paths import Sender, path_patch
    >>> from interp.localize.patching import LogitDiffMetric
    >>> model = interp.tiny_model("llama")
    >>> g = torch.Generator().manual_seed(0)
    >>> clean = interp.Examples.from_tokens(torch.randint(0, 256, (2, 8), generator=g))
    >>> corrupt = interp.Examples.from_tokens(torch.randint(0, 256, (2, 8), generator=g))
    >>> res = path_patch(model, clean, [Sender("head", 0, 1), Sender("mlp", 0)], receivers=[(1, 2, "q")],
    ...                  source_examples=corrupt, metric=LogitDiffMetric(65, 66))
    >>> tuple(res.values.shape), res.table()["sender"].tolist()
    ((2, 2), ['head 0.1', 'mlp 0'])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from interp.data import Examples, aligned_rows, check_same_real_lengths
from interp.display import ResultDisplay
from interp.errors import ComponentError, DataError, NonFiniteError
from interp.localize.patching.engine import _check_pair, _metric_values, _takes_lengths
from interp.localize.patching.metrics import Metric, _metric
from interp.models import Model, model_name
from interp.results import CheckedResult
from interp.runtime import hooks as hk
from interp.runtime.batching import batches, device_of
from interp.validate import checked, checked_class

Receiver = tuple[int, int, str]  # (layer, head, "q" | "k" | "v")
RECEIVER_INPUTS = ("q", "k", "v")


@checked_class
@dataclass(frozen=True)
class Sender:
    """A path's start: an attention head (``kind="head"``, ``layer``, ``head``) or an MLP (``kind="mlp"``)."""

    kind: Literal["head", "mlp"]
    layer: int
    head: int | None = None

    @property
    def label(self) -> str:
        return f"head {self.layer}.{self.head}" if self.kind == "head" else f"mlp {self.layer}"


@dataclass(frozen=True)
class PathPatchResult(CheckedResult, ResultDisplay):
    """Path patching values: ``values[j, n]`` is the metric with sender ``j`` patched along the path.

    Attributes:
        values: ``[n_senders, N]`` the metric after step 3, per sender and example.
        target: ``[N]`` the unpatched target's metric.
        source: ``[N]`` the source's metric.
        senders: the senders, in ``values``' order.
        receivers: the receivers, or ``"logits"``.
        ids: example ids.
        metric: the metric's name.
        settings: models, batch size, examples' settings.

    Made only finite: see :mod:`interp.results`.
    """

    values: Float[Tensor, "senders n"]
    target: Float[Tensor, " n"]
    source: Float[Tensor, " n"]
    senders: list[Sender]
    receivers: list[Receiver] | str
    ids: list[str]
    metric: str
    settings: dict[str, Any] = field(default_factory=dict)

    def effect(self) -> Float[Tensor, " senders"]:
        """Mean change of the metric, ``mean_n(values - target)``, per sender."""
        return (self.values - self.target).double().mean(dim=1)

    def table(self) -> pd.DataFrame:
        """One row per sender: its label and mean effect (patched minus target)."""
        return pd.DataFrame({"sender": [s.label for s in self.senders], "effect": self.effect().numpy()})


# ---------------------------------------------------------------------------------------
# Checks


def _checked_senders(model: Model, senders: Sequence[Sender]) -> list[Sender]:
    n_layers, n_heads = hk.n_layers(model), int(model.cfg.n_heads)
    out = []
    if not senders:
        raise ComponentError("Path patching needs at least one sender: Sender('head', layer, head) or "
                             "Sender('mlp', layer).")
    for s in senders:
        if s.kind not in ("head", "mlp"):
            raise ComponentError(f"Unknown sender kind {s.kind!r}: use 'head' or 'mlp'.")
        (layer,) = hk.check_layers(model, [s.layer])
        if s.kind == "head" and (s.head is None or not 0 <= s.head < n_heads):
            raise ComponentError(f"Sender {s.label}: a head sender needs head in 0..{n_heads - 1}.")
        out.append(Sender(s.kind, layer, s.head if s.kind == "head" else None))
    del n_layers
    return out


def _checked_receivers(model: Model, receivers: Sequence[Receiver] | str, senders: list[Sender]
                       ) -> list[Receiver] | str:
    if receivers == "logits":
        return "logits"
    if isinstance(receivers, str) or not receivers:
        raise ComponentError("receivers= takes 'logits' or a list of (layer, head, 'q' | 'k' | 'v').")
    dims = hk._dims(model)
    out: list[Receiver] = []
    for layer, head, kind in receivers:
        if kind not in RECEIVER_INPUTS:
            raise ComponentError(f"Receiver input {kind!r}: use one of {', '.join(RECEIVER_INPUTS)}.")
        (layer,) = hk.check_layers(model, [layer])
        hk.hook_point(model, kind, layer)
        count = dims["n_heads"] if kind == "q" else dims["n_kv_heads"]
        if not 0 <= head < count:
            raise ComponentError(f"Receiver ({layer}, {head}, {kind!r}): {kind} heads lie in 0..{count - 1}.")
        out.append((layer, int(head), kind))
    if all(layer <= s.layer for s in senders for layer, _, _ in out):  # a sender alone may lack one: effect 0
        raise ComponentError(f"No sender has a receiver after its layer ({', '.join(s.label for s in senders)}): "
                             "path patching follows the residual stream forward only.")
    return out


def _checked_inputs(model: Model, examples: Examples, senders: Sequence[Sender], receivers: Sequence[Receiver] | str,
                    source_examples: Examples, metric: Metric | str | None
                    ) -> tuple[list[Sender], list[Receiver] | str, Metric]:
    """The checks every path-level analysis makes (path patching, its textbook loop, edge attribution)."""
    senders_ = _checked_senders(model, senders)
    receivers_ = _checked_receivers(model, receivers, senders_)
    metric_ = _metric(metric)
    _check_pair(model, model, examples, source_examples)
    check_same_real_lengths(examples, source_examples, "Path patching pairs each target row with a source row of "
                            "the same real length", " Fill one template with different words.")
    return senders_, receivers_, metric_


# ---------------------------------------------------------------------------------------
# The batched implementation


def _capture(model: Model, tokens: Tensor, points: Sequence[tuple[str, int]]) -> tuple[dict[tuple[str, int], Tensor],
                                                                                    Tensor]:
    store: dict[tuple[str, int], Tensor] = {}

    def keep(key: tuple[str, int]) -> Callable[[Tensor, Any], None]:
        def fn(x: Tensor, hook: Any) -> None:
            store[key] = x.detach()
        return fn

    hooks = [(hk.hook_point(model, c, layer), keep((c, layer))) for c, layer in dict.fromkeys(points)]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        logits = model.original_model(input_ids=tokens).logits
    return store, logits


def _sender_points(senders: list[Sender]) -> list[tuple[str, int]]:
    return [("z", s.layer) if s.kind == "head" else ("down", s.layer) for s in senders]


def _out_point(s: Sender) -> tuple[str, int]:
    """Where the sender's output enters the residual stream."""
    return ("attn_out", s.layer) if s.kind == "head" else ("down", s.layer)


def _sender_hooks(model: Model, senders: list[Sender], b: int, clean: dict[tuple[str, int], Tensor],
                  source: dict[tuple[str, int], Tensor], delta: dict[int, Tensor]
                  ) -> list[tuple[str, Callable[..., Any]]]:
    """Hooks for senders stacked along the rows (``b`` rows each): sender ``j``'s rows get its output
    from the source run, and ``delta[j]`` receives its change where it enters the residual stream
    (after its output norm where the model has one), against the target run ``clean``."""

    def patch_sender(j: int, s: Sender) -> Callable[[Tensor, Any], Tensor]:
        def fn(x: Tensor, hook: Any) -> Tensor:
            x = x.clone()
            rows = slice(j * b, (j + 1) * b)
            if s.kind == "head":
                x = hk.reader(model, "z", s.layer)(x) if x.ndim == 3 else x
                x[rows, :, s.head] = source[("z", s.layer)][:, :, s.head]
            else:
                x[rows] = source[("down", s.layer)]
            return x
        return fn

    def read_delta(j: int, s: Sender) -> Callable[[Tensor, Any], None]:
        def fn(x: Tensor, hook: Any) -> None:
            delta[j] = x[j * b : (j + 1) * b].detach() - clean[_out_point(s)]
        return fn

    hooks: list[tuple[str, Callable[..., Any]]] = []
    for j, s in enumerate(senders):
        hooks.append((hk.hook_point(model, *_sender_points([s])[0]), patch_sender(j, s)))
        hooks.append((hk.hook_point(model, *_out_point(s)), read_delta(j, s)))
    return hooks


def _window(model: Model, tokens: Tensor, senders: list[Sender], receivers: list[Receiver] | str,
            clean: dict[tuple[str, int], Tensor], source: dict[tuple[str, int], Tensor]) -> Tensor:
    """Steps 2 and 3 for a window of senders stacked along the rows: the patched logits ``[J*B, T, vocab]``."""
    b, n_layers = tokens.shape[0], hk.n_layers(model)
    stacked = tokens.repeat(len(senders), 1)
    delta: dict[int, Tensor] = {}  # sender j -> its change where it enters the residual [B, T, d]

    def resid_with_delta(layer: int, key: tuple[str, int]) -> Callable[[Tensor, Any], Tensor]:
        def fn(x: Tensor, hook: Any) -> Tensor:
            x = x.clone()
            for j, s in enumerate(senders):
                if layer > s.layer or key[0] == "resid_post":
                    x[j * b : (j + 1) * b] = clean[key] + delta[j]
            return x
        return fn

    recorded: dict[tuple[str, int], Tensor] = {}

    def record(key: tuple[str, int]) -> Callable[[Tensor, Any], None]:
        def fn(x: Tensor, hook: Any) -> None:
            recorded[key] = hk.reader(model, key[0], key[1])(x.detach())
        return fn

    step2 = _sender_hooks(model, senders, b, clean, source, delta)
    if receivers == "logits":
        key = ("resid_post", n_layers - 1)
        step2.append((hk.hook_point(model, *key), resid_with_delta(n_layers, key)))
        with torch.no_grad(), model.hooks(fwd_hooks=step2):
            return model.original_model(input_ids=stacked).logits
    assert not isinstance(receivers, str)
    layers = sorted({layer for layer, _, _ in receivers})
    step2 += [(hk.hook_point(model, "resid_pre", layer), resid_with_delta(layer, ("resid_pre", layer)))
              for layer in layers]
    step2 += [(hk.hook_point(model, kind, layer), record((kind, layer)))
              for kind, layer in dict.fromkeys((kind, layer) for layer, _, kind in receivers)]
    with torch.no_grad(), model.hooks(fwd_hooks=step2):
        hk.decoder_body(model)(input_ids=stacked)
    return _step3(model, stacked, b, senders, receivers, recorded)


def _step3(model: Model, stacked: Tensor, b: int, senders: list[Sender], receivers: list[Receiver],
           recorded: dict[tuple[str, int], Tensor]) -> Tensor:
    """The target run with each receiver's input set to what step 2 recorded (downstream recomputed)."""
    by_point: dict[tuple[str, int], list[int]] = {}
    for layer, head, kind in receivers:
        by_point.setdefault((kind, layer), []).append(head)

    def overwrite(key: tuple[str, int], heads: list[int]) -> Callable[[Tensor, Any], Tensor]:
        def fn(x: Tensor, hook: Any) -> Tensor:
            flat = x.ndim == 3
            y = hk.reader(model, key[0], key[1])(x).clone()
            for j, s in enumerate(senders):
                if key[1] > s.layer:  # receivers at or before the sender's layer keep their target input
                    rows = slice(j * b, (j + 1) * b)
                    y[rows, :, heads] = recorded[key][rows][:, :, heads]
            return y.reshape(x.shape) if flat else y
        return fn

    hooks = [(hk.hook_point(model, kind, layer), overwrite((kind, layer), heads))
             for (kind, layer), heads in by_point.items()]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        return model.original_model(input_ids=stacked).logits


@checked
def path_patch(
    model: Model,
    examples: Examples,
    senders: Sequence[Sender],
    receivers: Sequence[Receiver] | str = "logits",
    *,
    source_examples: Examples,
    metric: Metric | str | None = None,
    batch_size: int = 8,
    max_rows: int = 64,
) -> PathPatchResult:
    """Path patching (Wang et al. 2022): each sender patched from the source run along its paths to ``receivers`` only.

    Args:
        model: a bridge from :func:`interp.load_model` (target and source are the same model).
        examples: the target (clean) prompts, padded or not.
        senders: the heads and MLPs to patch, one result row each.
        receivers: ``"logits"`` (the final residual: the direct effect) or ``(layer, head, input)``
            triples, ``input`` in ``"q"``, ``"k"``, ``"v"`` (keys and values count key/value heads).
        source_examples: the source (corrupted) prompts, each row as long as its target row.
        metric: ``"nll"`` or a :class:`~interp.localize.patching.metrics.LogitDiffMetric`.
        batch_size: examples per batch.
        max_rows: the most rows (examples x stacked senders) in one forward.

    Returns:
        A :class:`PathPatchResult`.
    """
    senders_, receivers_, metric_ = _checked_inputs(model, examples, senders, receivers, source_examples, metric)
    if examples.padded and not _takes_lengths(metric_):
        raise DataError(f"The metric {type(metric_).__name__} takes no lengths=, so it cannot read padded rows.")
    n, device = len(examples), device_of(model)
    # the values stay on the model's device (no host sync per window) and go to the host once, at the end
    values = torch.empty(len(senders_), n, dtype=torch.float64, device=device)
    target_values = torch.empty(n, dtype=torch.float64, device=device)
    source_values = torch.empty(n, dtype=torch.float64, device=device)
    per_window = max(1, max_rows // max(1, min(batch_size, n)))
    points = [*_sender_points(senders_), *(_out_point(s) for s in senders_)]
    points += [("resid_pre", layer) for layer in range(hk.n_layers(model))]
    points.append(("resid_post", hk.n_layers(model) - 1))
    for start, end in batches(n, batch_size):
        tokens, lengths = aligned_rows(examples, start, end, device)
        source_tokens, _ = aligned_rows(source_examples, start, end, device)
        index = torch.arange(start, end)  # host: example indices; a metric picks its host-side answers with them
        clean, clean_logits = _capture(model, tokens, points)
        source, source_logits = _capture(model, source_tokens, _sender_points(senders_))
        target_values[start:end] = _metric_values(metric_, "from_logits", clean_logits, tokens, index, lengths=lengths)
        source_values[start:end] = _metric_values(metric_, "from_logits", source_logits, source_tokens, index,
                                                  lengths=lengths)
        for w in range(0, len(senders_), per_window):
            window = senders_[w : w + per_window]
            logits = _window(model, tokens, window, receivers_, clean, source)
            j = len(window)
            got = _metric_values(metric_, "from_logits", logits, tokens.repeat(j, 1), index.repeat(j),
                                 lengths=None if lengths is None else lengths.repeat(j))
            values[w : w + j, start:end] = got.view(j, end - start)
    return _path_result(values.cpu(), target_values.cpu(), source_values.cpu(), senders_, receivers_, examples, metric_,
                        {"model": model_name(model), "batch_size": batch_size,
                         "max_rows": max_rows, "examples": dict(examples.settings)})


def _path_result(values: Tensor, target: Tensor, source: Tensor, senders: list[Sender], receivers: Any,
                 examples: Examples, metric: Metric, settings: dict[str, Any]) -> PathPatchResult:
    for name, tensor in (("patched", values), ("target", target), ("source", source)):
        if not torch.isfinite(tensor).all():
            raise NonFiniteError(f"Path patching produced NaN/inf {name} values: check the model's weights.")
    return PathPatchResult(values=values, target=target, source=source, senders=senders, receivers=receivers,
                           ids=list(examples.ids), metric=metric.name, settings=settings)


# ---------------------------------------------------------------------------------------
# The textbook loop (reference for the tests)


def path_patch_naive(
    model: Model,
    examples: Examples,
    senders: Sequence[Sender],
    receivers: Sequence[Receiver] | str = "logits",
    *,
    source_examples: Examples,
    metric: Metric | str | None = None,
) -> PathPatchResult:
    """The three steps of the definition, one sender and one example at a time, freezing every
    other head's ``z`` and every MLP output explicitly. Slow; the reference for :func:`path_patch`."""
    senders_, receivers_, metric_ = _checked_inputs(model, examples, senders, receivers, source_examples, metric)
    n_layers, n = hk.n_layers(model), len(examples)
    # host: the textbook loop's results, gathered on the host run by run
    values = torch.empty(len(senders_), n, dtype=torch.float64)
    target_values = torch.empty(n, dtype=torch.float64)  # host: as above
    source_values = torch.empty(n, dtype=torch.float64)  # host: as above
    frozen = [(c, layer) for layer in range(n_layers) for c in ("z", "down")]
    for i in range(n):
        tokens, source_tokens = _one_row(examples, i), _one_row(source_examples, i)
        index = torch.tensor([i])  # host: the example's index, as in path_patch()
        clean, clean_logits = _capture(model, tokens, frozen)
        source, source_logits = _capture(model, source_tokens, frozen)
        target_values[i] = metric_.from_logits(clean_logits, tokens, index)[0]
        source_values[i] = metric_.from_logits(source_logits, source_tokens, index)[0]
        for j, s in enumerate(senders_):
            logits = _naive_one(model, tokens, s, receivers_, clean, source)
            values[j, i] = metric_.from_logits(logits, tokens, index)[0]
    return _path_result(values, target_values, source_values, senders_, receivers_, examples, metric_,
                        {"model": model_name(model), "naive": True})


def _one_row(examples: Examples, i: int) -> Tensor:
    tokens = examples.tokens[i]
    if examples.attention_mask is not None and examples.padded:
        tokens = tokens[examples.attention_mask[i].bool()]
    return tokens[None]


def _naive_one(model: Model, tokens: Tensor, s: Sender, receivers: list[Receiver] | str,
               clean: dict[tuple[str, int], Tensor], source: dict[tuple[str, int], Tensor]) -> Tensor:
    n_layers = hk.n_layers(model)

    def freeze(key: tuple[str, int]) -> Callable[[Tensor, Any], Tensor]:
        def fn(x: Tensor, hook: Any) -> Tensor:
            value = clean[key].clone()
            if key == (("z", s.layer) if s.kind == "head" else ("down", s.layer)):
                if s.kind == "head":
                    value[0, :, s.head] = source[key][0, :, s.head]
                else:
                    value = source[key].clone()
            return value.reshape(x.shape)
        return fn

    step2 = [(hk.hook_point(model, c, layer), freeze((c, layer))) for layer in range(n_layers) for c in ("z", "down")]
    if receivers == "logits":
        with torch.no_grad(), model.hooks(fwd_hooks=step2):
            return model.original_model(input_ids=tokens).logits
    assert not isinstance(receivers, str)
    seen: dict[tuple[str, int], Tensor] = {}

    def look(key: tuple[str, int]) -> Callable[[Tensor, Any], None]:
        def fn(x: Tensor, hook: Any) -> None:
            seen[key] = x.detach().clone()
        return fn

    wanted = list(dict.fromkeys((kind, layer) for layer, _, kind in receivers))
    with torch.no_grad(), model.hooks(fwd_hooks=[*step2, *((hk.hook_point(model, *k), look(k)) for k in wanted)]):
        model.original_model(input_ids=tokens)

    dims = hk._dims(model)

    def put(key: tuple[str, int]) -> Callable[[Tensor, Any], Tensor]:
        def fn(x: Tensor, hook: Any) -> Tensor:
            x = x.clone()
            count = dims["n_heads"] if key[0] == "q" else dims["n_kv_heads"]
            heads_view = x if x.ndim == 4 else x.view(*x.shape[:2], count, -1)  # shares x's memory
            recorded = seen[key] if seen[key].ndim == 4 else seen[key].view(*x.shape[:2], count, -1)
            if key[1] > s.layer:
                for layer, head, kind in receivers:
                    if (kind, layer) == key:
                        _set_head(heads_view, recorded, head)
            return x
        return fn

    with torch.no_grad(), model.hooks(fwd_hooks=[(hk.hook_point(model, *k), put(k)) for k in wanted]):
        return model.original_model(input_ids=tokens).logits


def _set_head(x: Tensor, value: Tensor, head: int) -> None:
    """``x[..., head, :] = value[..., head, :]`` on ``[1, T, heads, d_head]`` tensors, one position at a time."""
    for p in range(x.shape[1]):
        x[0, p, head] = value[0, p, head]
