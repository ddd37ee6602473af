"""Edge attribution patching (EAP) and its integrated-gradients variant (EAP-IG).

Path patching (:mod:`interp.localize.paths`) measures one sender's effect through chosen
receivers exactly, at two forwards per window of senders. EAP (Syed et al. 2023, "Attribution
Patching Outperforms Automated Circuit Discovery", arXiv 2310.10348) estimates every
(sender, receiver) edge at once, to first order, from one forward and one backward pass:

    score(s -> r) = sum over positions and features of  delta_s . dM/dx_r

``delta_s`` is the sender's change where it enters the residual stream (source run minus
target run: a head's output after ``W_O``, and after the attention output norm where the
model has one; an MLP's output), and ``x_r`` is the receiver's own copy of the residual
stream it reads (for the query, key or value input of head ``r``: the residual entering its
layer, as seen through that head's projection only; for ``"logits"``: the final residual).
With everything else frozen, path patching sets exactly ``x_r = resid + delta_s``, so the
score is the first-order Taylor term of the path-patching effect of the edge.

EAP-IG (Hanna et al. 2024, "Have Faith in Faithfulness", arXiv 2403.17806) replaces the
gradient at the target run by its average over ``ig_steps`` runs whose embeddings are
interpolated from the target's towards the source's (``k / ig_steps``, ``k = 0 ..
ig_steps - 1``), which tracks larger, non-linear effects better. ``ig_steps=1`` is plain EAP.

Grouped-query attention: keys and values are per key/value head (the receiver ``(l, r, "k")``
is key/value head ``r``, shared by a group of query heads), which is what their projection
computes; nothing else changes.

The per-head gradient ``dM/dx_r`` is the backward pass's gradient at head ``r``'s projection
output, pulled back through that head's slice of the projection weight and the norm in front
of attention (a vector-Jacobian product at the run's own residual).

Example:
    >>> import interp, torch
    >>> from interp.localize.eap import edge_attribution
    >>> from interp.localize.paths import Sender
    >>> from interp.localize.patching import LogitDiffMetric
    >>> model = interp.tiny_model("llama")
    >>> g = torch.Generator().manual_seed(0)
    >>> clean = interp.Examples.from_tokens(torch.randint(0, 256, (2, 8), generator=g))
    >>> corrupt = interp.Examples.from_tokens(torch.randint(0, 256, (2, 8), generator=g))
    >>> res = edge_attribution(model, clean, [Sender("head", 0, 1)], [(1, 0, "q"), (1, 1, "k")],
    ...                        source_examples=corrupt, metric=LogitDiffMetric(65, 66), ig_steps=3)
    >>> tuple(res.scores.shape), res.table()["edge"].tolist()
    ((1, 2, 2), ['head 0.1 -> q 1.0', 'head 0.1 -> k 1.1'])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from interp.data import Examples, aligned_rows
from interp.display import ResultDisplay
from interp.errors import InterpError, NonFiniteError
from interp.localize.patching.engine import _metric_values
from interp.localize.patching.metrics import Metric
from interp.localize.paths import Receiver, Sender, _capture, _checked_inputs, _out_point, _sender_hooks, _sender_points
from interp.models import Model
from interp.runtime import hooks as hk
from interp.runtime import placement
from interp.runtime.batching import batches, device_of
from interp.validate import checked

_ATTENTION_NORMS = ("input_layernorm", "ln_1")


@dataclass(frozen=True)
class EdgeAttribution(ResultDisplay):
    """EAP scores: ``scores[s, r, n]`` estimates the metric change of edge (sender ``s`` -> receiver ``r``), row ``n``.

    Attributes:
        scores: ``[n_senders, n_receivers, N]``; zero where the receiver is not after the sender.
        senders: the senders.
        receivers: the receivers (``[(layer, head, input)]``, or ``["logits"]``).
        ids: example ids.
        metric: the metric's name.
        settings: model, ``ig_steps``, batch size.
    """

    scores: Float[Tensor, "senders receivers n"]
    senders: list[Sender]
    receivers: list[Any]
    ids: list[str]
    metric: str
    settings: dict[str, Any] = field(default_factory=dict)

    def edge_scores(self) -> Float[Tensor, "senders receivers"]:
        """Mean score over examples per edge."""
        return self.scores.double().mean(dim=2)

    def table(self) -> pd.DataFrame:
        """One row per edge, sender-major: ``edge``, ``sender``, ``receiver``, ``score`` (mean over examples)."""
        mean = self.edge_scores()
        rows = []
        for i, s in enumerate(self.senders):
            for j, r in enumerate(self.receivers):
                name = "logits" if r == "logits" else f"{r[2]} {r[0]}.{r[1]}"
                rows.append((f"{s.label} -> {name}", s.label, name, float(mean[i, j])))
        return pd.DataFrame(rows, columns=["edge", "sender", "receiver", "score"])

    def top(self, k: int = 10) -> pd.DataFrame:
        """The ``k`` edges with the largest absolute mean score."""
        table = self.table()
        return table.reindex(table["score"].abs().sort_values(ascending=False).index).head(k)


def _sender_deltas(model: Model, tokens: Tensor, senders: list[Sender], clean: dict[tuple[str, int], Tensor],
                   source: dict[tuple[str, int], Tensor]) -> list[Tensor]:
    """Each sender's change where it enters the residual, ``[B, T, d_model]``.

    An MLP's is its output difference, and a head's its ``z`` difference through its slice of
    ``W_O``; only where the attention output passes through a norm of its own (Gemma-2/3,
    OLMo-2) does it take a forward, with the senders stacked along the rows.
    """
    if not getattr(getattr(model, "info", None), "post_norms", False):
        deltas = []
        for s in senders:
            if s.kind == "mlp":
                deltas.append(source[("down", s.layer)] - clean[("down", s.layer)])
                continue
            dz = (hk.reader(model, "z", s.layer)(source[("z", s.layer)])
                  - hk.reader(model, "z", s.layer)(clean[("z", s.layer)]))[:, :, s.head]
            with placement.onloaded(model, [s.layer]):  # a block offloaded by a device map: its weights, not meta
                w_o = hk.per_head_w_o(model, s.layer)[s.head].to(dz.device, dz.dtype)
            deltas.append(dz @ w_o.T)
        return deltas
    out: dict[int, Tensor] = {}
    with torch.no_grad(), model.hooks(fwd_hooks=_sender_hooks(model, senders, tokens.shape[0], clean, source, out)):
        hk.decoder_body(model)(input_ids=tokens.repeat(len(senders), 1))
    return [out[j] for j in range(len(senders))]


def _attention_norm(model: Model, layer: int) -> Callable[[Tensor], Tensor]:
    block = hk.blocks(model)[layer]
    norm = next((getattr(block, n) for n in _ATTENTION_NORMS if getattr(block, n, None) is not None), None)
    if norm is None:  # OLMo-2: attention reads the residual itself
        return lambda x: x
    return hk._unwrap(norm)  # type: ignore[no-any-return]


def _projection(model: Model, layer: int, kind: str) -> Tensor:
    """``[heads, d_head, d_model]``: the q / k / v projection weight split by (key/value) head."""
    with placement.onloaded(model, [layer]):  # a block offloaded by a device map: its weights, not meta
        weight = hk.linear_weights(model, layer)[kind].read().detach().clone()
    return weight.reshape(-1, hk._dims(model)["d_head"], weight.shape[-1])


def _receiver_grads(model: Model, tokens: Tensor, embeds: Tensor, receivers: list[Receiver] | str, metric: Metric,
                    index: Tensor, lengths: Tensor | None) -> list[Tensor]:
    """``dM/dx_r`` ``[B, T, d_model]`` per receiver, from one forward and backward whose embeddings are ``embeds``."""
    n_layers = hk.n_layers(model)
    nodes: dict[tuple[str, int], Tensor] = {}
    resid: dict[int, Tensor] = {}

    def start(x: Tensor, hook: Any) -> Tensor:
        return embeds.detach().clone().requires_grad_(True)

    def keep(key: tuple[str, int]) -> Callable[[Tensor, Any], Tensor]:
        def fn(x: Tensor, hook: Any) -> Tensor:
            y = x.view_as(x)
            nodes[key] = y
            return y
        return fn

    def keep_resid(layer: int) -> Callable[[Tensor, Any], None]:
        def fn(x: Tensor, hook: Any) -> None:
            resid[layer] = x.detach()
        return fn

    final_key = ("resid_post", n_layers - 1)
    hooks: list[tuple[str, Callable[..., Any]]] = [(hk.hook_point(model, "resid_pre", 0), start)]
    wanted: list[tuple[str, int]] = [final_key]
    if receivers != "logits":
        assert not isinstance(receivers, str)
        wanted += list(dict.fromkeys((kind, layer) for layer, _, kind in receivers))
        hooks += [(hk.hook_point(model, "resid_pre", layer), keep_resid(layer))
                  for layer in sorted({layer for layer, _, _ in receivers})]
    hooks += [(hk.hook_point(model, *key), keep(key)) for key in wanted]
    with torch.enable_grad(), model.hooks(fwd_hooks=hooks):
        logits = model.original_model(input_ids=tokens).logits
        value = _metric_values(metric, "from_logits", logits, tokens, index, lengths=lengths)
        grads = dict(zip(wanted, torch.autograd.grad(value.sum(), [nodes[k] for k in wanted], allow_unused=True),
                         strict=True))
    if receivers == "logits":
        grad = grads[final_key]
        return [grad if grad is not None else torch.zeros_like(nodes[final_key])]
    assert not isinstance(receivers, str)
    out = []
    for layer, head, kind in receivers:
        g = grads[(kind, layer)]
        if g is None:
            out.append(torch.zeros_like(resid[layer]))
            continue
        g = hk.reader(model, kind, layer)(g)[:, :, head]  # [B, T, d_head]
        u = g @ _projection(model, layer, kind)[head].to(g.dtype)  # back through this head's projection only
        x = resid[layer].clone().requires_grad_(True)
        with torch.enable_grad():
            (pulled,) = torch.autograd.grad(_attention_norm(model, layer)(x), x, grad_outputs=u)
        out.append(pulled)
    return out


@checked
def edge_attribution(
    model: Model,
    examples: Examples,
    senders: Sequence[Sender],
    receivers: Sequence[Receiver] | str = "logits",
    *,
    source_examples: Examples,
    metric: Metric | str | None = None,
    ig_steps: int = 1,
    batch_size: int = 8,
) -> EdgeAttribution:
    """EAP (``ig_steps=1``) or EAP-IG scores for every (sender, receiver) edge.

    Args:
        model: a bridge from :func:`interp.load_model`.
        examples: the target (clean) prompts, padded or not.
        senders: heads and MLPs (:class:`~interp.localize.paths.Sender`).
        receivers: ``(layer, head, "q" | "k" | "v")`` triples, or ``"logits"`` (the final residual).
        source_examples: the source (corrupted) prompts, each as long as its target row.
        metric: ``"nll"`` or a :class:`~interp.localize.patching.metrics.LogitDiffMetric`.
        ig_steps: gradient evaluations along the embedding path from target to source (1: plain EAP).
        batch_size: examples per forward and backward pass.

    Returns:
        An :class:`EdgeAttribution`; edges whose receiver is not after the sender score 0.
    """
    if isinstance(ig_steps, bool) or not isinstance(ig_steps, int) or ig_steps < 1:
        raise InterpError(f"ig_steps must be a positive integer (1 is plain EAP); got {ig_steps!r}.")
    senders_, receivers_, metric_ = _checked_inputs(model, examples, senders, receivers, source_examples, metric)
    listed: list[Any] = ["logits"] if receivers_ == "logits" else list(receivers_)
    n, device = len(examples), device_of(model)
    # on the model's device, to the host once at the end (not one copy per edge and batch)
    scores = torch.zeros(len(senders_), len(listed), n, dtype=torch.float64, device=device)
    points = [*_sender_points(senders_), *(_out_point(s) for s in senders_), ("resid_pre", 0)]
    for start, end in batches(n, batch_size):
        tokens, lengths = aligned_rows(examples, start, end, device)
        source_tokens, _ = aligned_rows(source_examples, start, end, device)
        index = torch.arange(start, end)  # host: example indices; a metric picks its host-side answers with them
        clean, _ = _capture(model, tokens, points)
        source, _ = _capture(model, source_tokens, [*_sender_points(senders_), ("resid_pre", 0)])
        deltas = _sender_deltas(model, tokens, senders_, clean, source)
        grads: list[Tensor] | None = None
        for k in range(ig_steps):
            alpha = k / ig_steps
            embeds = clean[("resid_pre", 0)] + alpha * (source[("resid_pre", 0)] - clean[("resid_pre", 0)])
            step = _receiver_grads(model, tokens, embeds, receivers_, metric_, index, lengths)
            grads = step if grads is None else [a + b for a, b in zip(grads, step, strict=True)]
        assert grads is not None
        for i, s in enumerate(senders_):
            for j, r in enumerate(listed):
                if r == "logits" or r[0] > s.layer:
                    scores[i, j, start:end] = (deltas[i] * grads[j] / ig_steps).flatten(1).sum(1).double()
    if not torch.isfinite(scores).all():
        raise NonFiniteError("Edge attribution produced NaN/inf scores: check the model's weights.")
    return EdgeAttribution(scores=scores.cpu(), senders=senders_, receivers=listed, ids=list(examples.ids),
                           metric=metric_.name, settings={"model": model.info.name,
                                                          "ig_steps": ig_steps, "batch_size": batch_size})
