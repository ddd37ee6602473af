"""Direct logit attribution: how much each head, each MLP and the embedding write the answer.

The final residual stream is a sum: the embedding (plus the learned positional embedding
where the model has one), then, block by block, what attention adds and what the MLP adds.
Attention's share splits further into one term per head (``z_h W_O[h]``, the ``result``
component) plus the output projection's bias. The logit of a token ``t`` is
``W_U[t] . norm(resid_final) + b_U[t]``; the final norm is not linear, so the usual
*frozen-norm* decomposition holds its scale at the value it has in the actual forward:

    norm(x) = gamma * P(x) / s(x) + beta     (P centres for LayerNorm, is the identity for RMSNorm)

With ``s`` frozen, ``norm`` is affine, and each term ``c`` of the residual contributes
``(W_U[t] * gamma) . P(c) / s``. The contributions plus the bias terms (the heads' output
bias, the final norm's ``beta . W_U[t]`` and ``b_U[t]``) sum to the model's logit exactly,
up to rounding; :attr:`LogitAttribution.residual` is what is left. Models whose attention
output passes through its own norm before the residual add (Gemma-2/3, OLMo-2) get the same
treatment there: that norm's scale is frozen at its value in the forward, so the heads still
add up. A logit *difference* (``versus=``) is the same with ``W_U[t] - W_U[v]``.

What a frozen-norm contribution is not: it is not the effect of removing the component (the
norm scale would change, and later layers would read a different residual); it is the
component's direct path to the logit only. Path patching and activation patching measure
the indirect paths.

Reading the result:

- ``heads[n, layer, head]``, ``mlp[n, layer]``, ``attn_bias[n, layer]``, ``embed[n]``,
  ``pos_embed[n]`` (zero for rotary models), ``final_bias[n]``: contributions per example;
- ``logit[n]``: the model's logit (difference) from the same forward, read at the output
  head (before Gemma-2's final soft cap, whose ``tanh`` is not additive);
- ``summary()``: one row per layer (attention, MLP, the top head), averaged over examples;
  ``to_frame()``: every contribution of every example, long format;
- ``interp.figures.draw(result)``: the layer x head heatmap (:mod:`interp.figures.localize`).

Example:
    >>> import interp, torch
    >>> from interp.localize.dla import logit_attribution
    >>> model = interp.tiny_model("llama")
    >>> ex = interp.Examples.from_tokens(torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(0)))
    >>> res = logit_attribution(model, ex, target=[65, 66, 67], versus=68)
    >>> tuple(res.heads.shape)  # [examples, layers, heads]
    (3, 2, 4)
    >>> bool((res.total() - res.logit).abs().max() < 1e-4)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from interp.data import Examples, aligned_rows, real_lengths
from interp.display import ResultDisplay
from interp.errors import DataError, InterpError
from interp.models import Model, model_name
from interp.results import CheckedResult, distinct_answers
from interp.runtime import hooks as hk
from interp.runtime import placement
from interp.runtime.batching import batches, check_examples, device_of, show_progress
from interp.validate import checked, integers, token_ids

TokenChoice = int | Sequence[int] | Tensor


@dataclass(frozen=True)
class LogitAttribution(CheckedResult, ResultDisplay):
    """Direct logit attribution per example (see the module docstring for the decomposition).

    Attributes:
        heads: ``[N, n_layers, n_heads]`` each head's direct contribution.
        attn_bias: ``[N, n_layers]`` the attention output bias (zero where there is none).
        mlp: ``[N, n_layers]`` each MLP's contribution.
        embed: ``[N]`` the token embedding (scaled, where the model scales it).
        pos_embed: ``[N]`` the learned positional embedding (zero for rotary models).
        final_bias: ``[N]`` the final norm's shift and the unembedding bias.
        logit: ``[N]`` the model's logit (difference) at the position, from the same forward.
        ids: example ids.
        settings: model, targets, positions, batch size.
    """

    heads: Float[Tensor, "n layer head"]
    attn_bias: Float[Tensor, "n layer"]
    mlp: Float[Tensor, "n layer"]
    embed: Float[Tensor, " n"]
    pos_embed: Float[Tensor, " n"]
    final_bias: Float[Tensor, " n"]
    logit: Float[Tensor, " n"]
    ids: list[str]
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()  # finite, or refused (interp.results.check_result)
        n = len(self.ids)
        if self.heads.ndim != 3 or self.heads.shape[0] != n or self.mlp.shape != self.heads.shape[:2]:
            raise InterpError(f"LogitAttribution: heads {tuple(self.heads.shape)} and mlp {tuple(self.mlp.shape)} "
                              f"do not match {n} examples.")

    def total(self) -> Float[Tensor, " n"]:
        """The sum of every contribution and bias term: the frozen-norm reconstruction of :attr:`logit`."""
        return (self.heads.sum(dim=(1, 2)) + self.attn_bias.sum(dim=1) + self.mlp.sum(dim=1) + self.embed
                + self.pos_embed + self.final_bias)

    @property
    def residual(self) -> Float[Tensor, " n"]:
        """``logit - total()``: rounding only (the decomposition is exact with the norm scale frozen)."""
        return self.logit - self.total()

    def summary(self) -> pd.DataFrame:
        """One row per layer, means over examples: attention (heads + bias), MLP, and the top head."""
        heads = self.heads.double().mean(dim=0)
        top = heads.abs().argmax(dim=1)
        layers = range(heads.shape[0])
        return pd.DataFrame({
            "attention": (heads.sum(dim=1) + self.attn_bias.double().mean(dim=0)).numpy(),
            "mlp": self.mlp.double().mean(dim=0).numpy(),
            "top_head": top.numpy(),
            "top_head_value": heads[torch.arange(len(top), device=top.device), top].numpy(),
        }, index=pd.Index(layers, name="layer"))

    def to_frame(self) -> pd.DataFrame:
        """Long table: ``example``, ``component`` (head, attn_bias, mlp, embed, pos_embed, final_bias),
        ``layer`` and ``head`` (-1 where they do not apply), ``value``."""
        n, n_layers, n_heads = self.heads.shape
        rows: list[tuple[str, str, int, int, float]] = []
        for i, name in enumerate(self.ids):
            for layer in range(n_layers):
                rows += [(name, "head", layer, h, float(self.heads[i, layer, h])) for h in range(n_heads)]
                rows.append((name, "attn_bias", layer, -1, float(self.attn_bias[i, layer])))
                rows.append((name, "mlp", layer, -1, float(self.mlp[i, layer])))
            for part in ("embed", "pos_embed", "final_bias"):
                rows.append((name, part, -1, -1, float(getattr(self, part)[i])))
        return pd.DataFrame(rows, columns=["example", "component", "layer", "head", "value"])

    def head_means(self) -> Float[Tensor, "layer head"]:
        """``[n_layers, n_heads]``: each head's contribution averaged over examples (the heatmap)."""
        return self.heads.double().mean(dim=0)


# ---------------------------------------------------------------------------------------
# The frozen norm


@dataclass(frozen=True)
class FrozenNorm:
    """A norm with its scale held at the value it had on ``x``: ``c -> gamma * P(c) / s`` (plus ``beta``)."""

    gamma: Tensor  # [d] the multiplier actually applied (1 + gamma for Gemma)
    beta: Tensor | None  # [d] LayerNorm's shift
    scale: Tensor  # [B, 1] s(x) per row
    centred: bool

    @classmethod
    def at(cls, module: Any, x: Tensor, offset: float) -> "FrozenNorm":
        """The norm ``module`` (RMSNorm or LayerNorm) frozen at its input ``x`` ``[B, d]``, in ``x``'s dtype."""
        module = hk._unwrap(module)
        centred = isinstance(module, torch.nn.LayerNorm)
        eps = getattr(module, "variance_epsilon", None)
        eps = float(getattr(module, "eps", 1e-6) if eps is None else eps)
        weight = module.weight.detach().to(x.device, x.dtype)
        gamma = weight + offset if (offset and not centred) else weight
        bias = getattr(module, "bias", None)
        y = x - x.mean(dim=-1, keepdim=True) if centred else x
        scale = torch.sqrt(y.pow(2).mean(dim=-1, keepdim=True) + eps)
        return cls(gamma, bias.detach().to(x.dtype) if isinstance(bias, Tensor) else None, scale, centred)

    def linear(self, c: Tensor) -> Tensor:
        """The frozen norm's linear part applied to ``c`` ``[B, ..., d]`` (rows of ``B`` first)."""
        if self.centred:
            c = c - c.mean(dim=-1, keepdim=True)
        scale = self.scale.reshape(self.scale.shape[0], *([1] * (c.ndim - 1)))
        return c * self.gamma / scale


# ---------------------------------------------------------------------------------------
# Running


def _token_column(value: TokenChoice, n: int, what: str) -> Tensor:
    tokens = torch.as_tensor(value, dtype=torch.long).flatten()  # host: the user's ids, checked here, moved per batch
    if tokens.numel() == 1:
        tokens = tokens.expand(n)
    if tokens.numel() != n:
        raise DataError(f"{what} needs one token id or one per example ({n}); got {tokens.numel()}.")
    return tokens.clone()


def _positions(positions: int | Sequence[int], n: int) -> Tensor:
    pos = torch.as_tensor(positions, dtype=torch.long).flatten()  # host: checked against host lengths, moved per batch
    if pos.numel() == 1:
        pos = pos.expand(n)
    if pos.numel() != n:
        raise DataError(f"positions= needs one position or one per example ({n}); got {pos.numel()}.")
    return pos.clone()


def _checked(model: Model, examples: Examples, target: TokenChoice, versus: TokenChoice | None,
             positions: int | Sequence[int]) -> tuple[Tensor, Tensor | None, Tensor]:
    """Targets, versus tokens and each row's position (counted from its first real token), all checked."""
    check_examples(model, examples)
    n = len(examples)
    vocab = int(hk.unembed_weight(model).shape[0])
    targets = _token_column(target, n, "target=")
    others = None if versus is None else _token_column(versus, n, "versus=")
    for name, column in (("target", targets), ("versus", others)):
        if column is not None and bool(((column < 0) | (column >= vocab)).any()):
            raise DataError(f"{name}= token ids must lie in 0..{vocab - 1}.")
    if others is not None:  # logit(t) - logit(t) is 0 whatever the model computes: refused before it runs
        distinct_answers(targets, others, examples.ids)
    lengths = real_lengths(examples)
    pos = _positions(positions, n)
    rows = torch.where(pos < 0, lengths + pos, pos)
    bad = (rows < 0) | (rows >= lengths)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise DataError(f"Position {int(pos[i])} is outside example {examples.ids[i]!r} ({int(lengths[i])} real "
                        "tokens); count from the end (-1 is the last real token).")
    return targets, others, rows


@checked(target=token_ids, versus=token_ids, positions=integers)  # one per row: repeats are welcome
def logit_attribution(
    model: Model,
    examples: Examples,
    target: TokenChoice,
    *,
    versus: TokenChoice | None = None,
    positions: int | Sequence[int] = -1,
    batch_size: int = 8,
    progress: bool | None = None,
) -> LogitAttribution:
    """Direct logit attribution of ``target`` (minus ``versus``) to the embedding, each head and each MLP.

    Uses the frozen-norm decomposition: the final norm's scale (and, in Gemma-2/3 and OLMo-2,
    the attention output norm's scale) is taken from the actual forward and held fixed, so
    the contributions plus the bias terms add up to the model's logit (see the module docstring).

    Args:
        model: a bridge from :func:`interp.load_model`.
        examples: token rows, padded or not (each row is read as its real tokens alone).
        target: the token whose logit is explained: one id for all rows or one per example.
        versus: explain ``logit(target) - logit(versus)`` instead (one id or one per example).
        positions: the position read in each row: one for all rows or one per example;
            negative counts from each row's last real token (default ``-1``).
        batch_size: examples per forward.
        progress: show a progress bar.

    Returns:
        A :class:`LogitAttribution`.
    """
    targets, others, rows = _checked(model, examples, target, versus, positions)
    n, n_layers = len(examples), hk.n_layers(model)
    for layer in range(n_layers):
        hk.hook_point(model, "z", layer)
    device = device_of(model)
    parts: list[dict[str, Tensor]] = []
    for start, end in tqdm(list(batches(n, batch_size)), desc="logit attribution", unit="batch",
                           disable=not show_progress(progress)):
        tokens, _ = aligned_rows(examples, start, end, device)
        parts.append(_batch(model, tokens, rows[start:end].to(device), targets[start:end].to(device),
                            None if others is None else others[start:end].to(device)))
    merged = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
    name = model_name(model)
    settings = {"model": name, "target": targets.tolist(), "versus": None if others is None else others.tolist(),
                "positions": rows.tolist(), "batch_size": batch_size, "examples": dict(examples.settings),
                "decomposition": "frozen final-norm scale"}
    return LogitAttribution(ids=list(examples.ids), settings=settings, **merged)


def _capture_at(model: Model, tokens: Tensor, rows: Tensor) -> dict[str, Tensor]:
    """One forward; every activation DLA needs, read at each row's position only."""
    n_layers = hk.n_layers(model)
    b = torch.arange(tokens.shape[0], device=tokens.device)
    store: dict[str, Tensor] = {}

    def keep(key: str) -> Callable[[Tensor, Any], None]:
        def fn(x: Tensor, hook: Any) -> None:
            store[key] = x.detach()[b, rows]
        return fn

    fwd = [(hk.hook_point(model, "resid_pre", 0), keep("resid_pre")),
           (hk.hook_point(model, "resid_post", n_layers - 1), keep("final")), ("unembed.hook_out", keep("logits"))]
    for layer in range(n_layers):
        fwd += [(hk.hook_point(model, "z", layer), keep(f"z{layer}")),
                (hk.hook_point(model, "down", layer), keep(f"down{layer}"))]
    with torch.no_grad(), model.hooks(fwd_hooks=fwd):
        model.original_model(input_ids=tokens)
    for layer in range(n_layers):  # the bridge's z may arrive flat on some families
        store[f"z{layer}"] = hk.reader(model, "z", layer)(store[f"z{layer}"][:, None])[:, 0]
    return store


def _batch(model: Model, tokens: Tensor, rows: Tensor, targets: Tensor, others: Tensor | None) -> dict[str, Tensor]:
    """The contributions for one batch of (left-aligned) rows."""
    info = getattr(model, "info", None)
    offset = float(getattr(info, "norm_offset", 0.0) or 0.0)
    post_norms = bool(getattr(info, "post_norms", False))
    store = _capture_at(model, tokens, rows)
    w_u = hk.unembed_weight(model).detach()
    direction = w_u[targets] - (w_u[others] if others is not None else 0)  # [B, d]
    b_u = hk.unembed_bias(model)
    final = FrozenNorm.at(hk.final_norm(model), store["final"], offset)

    def through_final(c: Tensor) -> Tensor:  # [B, ..., d] -> [B, ...]
        shape = (direction.shape[0], *([1] * (c.ndim - 2)), direction.shape[1])
        return (final.linear(c) * direction.to(c.dtype).reshape(shape)).sum(dim=-1)

    heads, attn_bias, mlp = [], [], []
    for layer in range(hk.n_layers(model)):
        z = store[f"z{layer}"]  # [B, head, d_head]
        with placement.onloaded(model, [layer]):  # a block offloaded by a device map: its weights, not meta
            result = torch.einsum("bhd,hmd->bhm", z, hk.per_head_w_o(model, layer).to(z.device, z.dtype))
            bias = getattr(hk.linear_weights(model, layer)["o"].module, "bias", None)
            bias = bias.detach().to(z.device, z.dtype) if isinstance(bias, Tensor) else None
            o_bias = bias if bias is not None else torch.zeros_like(result[:, 0])
            o_bias = o_bias.expand_as(result[:, 0])
            if post_norms:  # the attention output's own norm, frozen at the o_proj output of this forward
                post = FrozenNorm.at(hk.blocks(model)[layer].post_attention_layernorm, result.sum(dim=1) + o_bias,
                                     offset)
                result, o_bias = post.linear(result), post.linear(o_bias) + (post.beta if post.beta is not None else 0)
        heads.append(through_final(result))
        attn_bias.append(through_final(o_bias))
        mlp.append(through_final(store[f"down{layer}"]))
    pos_embed = _positional(model, rows, store["resid_pre"])
    final_bias = torch.zeros_like(targets, dtype=store["final"].dtype)
    if final.beta is not None:
        final_bias = final_bias + (final.beta * direction.to(final.beta.dtype)).sum(dim=-1)
    if b_u is not None:
        final_bias = final_bias + b_u.detach()[targets] - (b_u.detach()[others] if others is not None else 0)
    logits = store["logits"]
    logit = logits.gather(1, targets[:, None])[:, 0] - (logits.gather(1, others[:, None])[:, 0]
                                                         if others is not None else 0)
    return {"heads": torch.stack(heads, dim=1).cpu(), "attn_bias": torch.stack(attn_bias, dim=1).cpu(),
            "mlp": torch.stack(mlp, dim=1).cpu(), "embed": through_final(store["resid_pre"] - pos_embed).cpu(),
            "pos_embed": through_final(pos_embed).cpu(), "final_bias": final_bias.cpu(), "logit": logit.cpu()}


def _positional(model: Model, rows: Tensor, resid_pre: Tensor) -> Tensor:
    """The learned positional embedding at each row's position (rows are left-aligned: it is the position id)."""
    body = hk.decoder_body(model)
    wpe = getattr(body, "wpe", None) or getattr(body, "embed_positions", None)
    weight = getattr(hk._unwrap(wpe), "weight", None) if wpe is not None else None
    if not isinstance(weight, Tensor):
        return torch.zeros_like(resid_pre)
    return weight.detach().to(resid_pre.dtype)[rows]
