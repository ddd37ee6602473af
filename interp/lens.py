"""Early exit (the logit lens) and layer restoration.

**Early exit.** The residual stream ``r_l`` after layer ``l`` lives in the same basis as the
final residual, so the model's own head can read it: decoding ``unembed(final_norm(r_l))``
gives the next-token distribution the model would predict if it stopped at layer ``l`` (the
"logit lens"). The mean next-token NLL of that decoding, layer by layer, shows at what
depth the prediction forms. Run for a reference model and its quantized copy, on the
examples quantization hurts most (D_large) and on controls (D_ctrl), it shows *where* the
quantized model's predictions part from the reference's: in the reference paper
(Mistral-12B, AWQ 3-bit) the two curves coincide until the last ~7 of 40 layers.

Reading an :class:`EarlyExitResult`: ``result.nll[i, n]`` is example ``n``'s mean NLL (nats)
when decoding at layer ``result.layers[i]``; the last layer's ``resid_post`` exit is the
model's own NLL (checked to 1e-4 in the tests). Decoding ``resid_mid`` reads the residual
after attention, before the MLP.

Memory: the decoding never holds ``[N, T, vocab]`` logits, nor even ``[batch, T, vocab]``:
each hook decodes its layer's residual as the forward passes, one vocabulary slice of at
most ``max_logits`` logits at a time, with a running log-sum-exp, keeping only
``logsumexp - logit[target]`` per position.

**Layer restoration.** :func:`restore_layers` copies the reference weights back into chosen
blocks of a quantized model (on a deep copy). :func:`restoration_sweep` restores the top
``k`` blocks for growing ``k`` and measures perplexity on D_large. The paper's result is that
restoring the top 7 of 40 layers barely helps (8.67 -> 8.05, reference 5.60): the damage is
not local to the layers where the curves split. The sweep reuses the quantized model's
unrestored prefix: the residual entering the lowest restored block is computed once per
batch, and only the blocks above it are run for each ``k``.

Example:
    >>> import interp
    >>> from interp import lens
    >>> model = interp.tiny_model("llama")
    >>> ex = interp.Examples.from_tokens(__import__("torch").randint(0, 256, (4, 16)))
    >>> res = lens.early_exit(model, ex, at="resid_post")
    >>> tuple(res.nll.shape)
    (2, 4)
    >>> bool(abs(res.nll[-1] - interp.nll(model, ex)).max() < 1e-4)
    True
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pandas as pd
import torch
from jaxtyping import Float, Int64
from torch import Tensor
from tqdm.auto import tqdm

from interp import hooks as hk
from interp.data import Examples, refuse_padding
from interp.display import ResultDisplay
from interp.errors import ComponentError, InterpError, NonFiniteError
from interp.probes import batches, check_context, show_progress
from interp.typing import PerExample, Resid, Tokens

ExitPoint = Literal["resid_mid", "resid_post"]
TokenNLL = Float[Tensor, "batch predicted"]
LayerNLL = Float[Tensor, "n_layers n_examples"]

DEFAULT_MAX_LOGITS = 1 << 23  # 32 MiB of float32 logits alive at once (fits a large L3)


# ---------------------------------------------------------------------------------------
# The readout: the model's own head applied to any residual


class Readout:
    """``unembed(final_norm(r))`` for any residual ``r``: the model's own output head.

    The final norm is the decoder body's own (``norm``, GPT-2's ``ln_f``, GPT-NeoX's
    ``final_layer_norm``: RMSNorm or LayerNorm, Gemma's ``1 + gamma`` included, since the
    module itself is called) and the head is the model's output embedding (``lm_head``,
    GPT-NeoX's ``embed_out``), with its bias when it has one. Gemma-2-style final logit
    soft-capping (``tanh(z / c) * c``) is applied when the config sets
    ``final_logit_softcapping``.

    Args:
        model: a bridge from :func:`interp.load_model`.
        max_logits: the most logits materialised at once when scoring; sets peak memory.
    """

    def __init__(self, model: Any, max_logits: int = DEFAULT_MAX_LOGITS) -> None:
        try:
            self.norm = hk.final_norm(model)
            self.weight = hk.unembed_weight(model)
            self.bias = hk.unembed_bias(model)
        except AttributeError as exc:
            raise ComponentError(
                f"{getattr(getattr(model, 'info', None), 'architecture', type(model).__name__)}: no final norm "
                f"and output head where interp looks ({exc}); early exit and patching need both."
            ) from None
        config = model.original_model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.max_logits = max(1, int(max_logits))

    @property
    def vocab(self) -> int:
        return int(self.weight.shape[0])

    def logits(self, resid: Float[Tensor, "... d_model"]) -> Float[Tensor, "... vocab"]:
        """Logits of ``resid`` (keep the input small: the output has ``vocab`` columns)."""
        return self.head(self.norm(resid))

    def head(self, normed: Float[Tensor, "... d_model"]) -> Float[Tensor, "... vocab"]:
        """Logits of an already normalised residual (the unembedding and any soft-cap)."""
        logits = torch.nn.functional.linear(normed, self.weight, self.bias)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def token_nll(self, resid: Resid, tokens: Tokens, normed: bool = False) -> TokenNLL:
        """``-log p(tokens[:, t + 1] | r[:, t])`` for ``t < T - 1``: ``[B, T, D] -> [B, T - 1]``.

        Without gradients, every row is decoded against one slice of the vocabulary at a time
        with a running (online) log-sum-exp, so each slice of the unembedding is read once
        and the matmuls stay large (20% faster than row chunks on CPU). With gradients (used
        by attribution patching), rows are decoded in chunks of ``max_logits // vocab``
        positions with a fused log-softmax. Either way no ``[B, T, vocab]`` tensor exists.
        ``normed=True`` means ``resid`` already went through the final norm.
        """
        batch, seq, d_model = resid.shape
        flat = resid[:, :-1].reshape(-1, d_model)
        targets = tokens[:, 1:].reshape(-1, 1).to(flat.device)
        if not (torch.is_grad_enabled() and flat.requires_grad):
            normed_rows = flat if normed else self.norm(flat)
            return self._nll_by_vocab_slices(normed_rows, targets.squeeze(-1)).view(batch, seq - 1)
        rows = max(1, self.max_logits // self.vocab)
        out = [self._rows_nll(flat[start : start + rows], targets[start : start + rows], normed)
               for start in range(0, flat.shape[0], rows)]
        return torch.cat(out).view(batch, seq - 1)

    def _nll_by_vocab_slices(self, normed: Float[Tensor, "rows d_model"], targets: Int64[Tensor, " rows"]
                             ) -> Float[Tensor, " rows"]:
        rows = normed.shape[0]
        step = min(self.vocab, max(256, self.max_logits // max(1, rows)))
        peak = torch.full((rows,), -math.inf, device=normed.device)
        total = torch.zeros(rows, device=normed.device)
        picked = torch.zeros(rows, device=normed.device)
        for start in range(0, self.vocab, step):
            bias = None if self.bias is None else self.bias[start : start + step]
            logits = torch.nn.functional.linear(normed, self.weight[start : start + step], bias).float()
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            inside = (targets >= start) & (targets < start + logits.shape[1])
            if bool(inside.any()):
                picked[inside] = logits[inside, targets[inside] - start]
            new_peak = torch.maximum(peak, logits.amax(dim=1))
            # rescale what was summed so far to the new peak, then add this slice (in place: ours)
            total = total * torch.exp(peak - new_peak) + logits.sub_(new_peak[:, None]).exp_().sum(dim=1)
            peak = new_peak
        return peak + total.log() - picked

    def _rows_nll(self, resid: Float[Tensor, "rows d_model"], targets: Int64[Tensor, "rows 1"],
                  normed: bool = False) -> Float[Tensor, " rows"]:
        logits = (self.head(resid) if normed else self.logits(resid)).float()
        # cross_entropy fuses log-softmax and gather in one pass over the chunk; on CPU it is
        # several times faster than torch.logsumexp or an amax/exp/sum chain (benchmarks.md)
        return torch.nn.functional.cross_entropy(logits, targets.squeeze(-1), reduction="none")

    def mean_nll(self, resid: Resid, tokens: Tokens) -> Float[Tensor, " batch"]:
        """Mean next-token NLL per row (float64)."""
        return self.token_nll(resid, tokens).double().mean(dim=1)


# ---------------------------------------------------------------------------------------
# Early exit


@dataclass(frozen=True)
class EarlyExitResult(ResultDisplay):
    """Per-layer, per-example NLL of the logit-lens decoding.

    Attributes:
        nll: ``[n_layers, N]`` mean next-token NLL (nats) decoding at each layer.
        layers: the model layers of the first axis.
        ids: the example ids of the second axis.
        at: where the residual was read (``resid_mid`` or ``resid_post``).
        settings: model name, batch size, examples' settings.
    """

    nll: LayerNLL
    layers: list[int]
    ids: list[str]
    at: str
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if tuple(self.nll.shape) != (len(self.layers), len(self.ids)):
            raise InterpError(f"EarlyExitResult.nll has shape {tuple(self.nll.shape)}; expected "
                              f"[{len(self.layers)}, {len(self.ids)}].")
        if self.at not in ("resid_mid", "resid_post"):
            raise InterpError(f"EarlyExitResult.at must be 'resid_mid' or 'resid_post'; got {self.at!r}.")

    def layer_mean(self) -> Float[Tensor, " n_layers"]:
        """Mean NLL over examples, per layer."""
        return self.nll.double().mean(dim=1)

    def summary(self) -> pd.DataFrame:
        """Mean NLL over examples, one row per layer."""
        return pd.DataFrame({"nll": self.layer_mean().numpy()}, index=pd.Index(self.layers, name="layer"))

    def to_frame(self) -> pd.DataFrame:
        """Long table: ``layer``, ``example``, ``nll``."""
        index = pd.MultiIndex.from_product([self.layers, self.ids], names=["layer", "example"])
        return pd.DataFrame({"nll": self.nll.double().flatten().numpy()}, index=index).reset_index()

    def figure(self, name: str | None = None) -> Any:
        """NLL by layer (one curve)."""
        return early_exit_figure({name or str(self.settings.get("model", "model")): self})


def _exit_hook(readout: Readout, tokens: Tokens, row: Tensor, stop: bool) -> Any:
    def decode(x: Tensor, hook: Any) -> None:
        row.copy_(readout.mean_nll(x, tokens).cpu())
        if stop:
            raise _StopForward
    return decode


class _StopForward(Exception):
    """Raised by the last needed hook: the rest of the forward and the full head are skipped."""


def early_exit(
    model: Any,
    examples: Examples,
    at: ExitPoint = "resid_post",
    batch_size: int = 8,
    layers: Sequence[int] | None = None,
    progress: bool | None = None,
    max_logits: int = DEFAULT_MAX_LOGITS,
) -> EarlyExitResult:
    """Decode every layer's residual with the model's own head and score next-token NLL.

    Args:
        model: a bridge (any family :func:`interp.load_model` describes: see docs/models.md).
        examples: token rows.
        at: ``"resid_post"`` (block output; the last layer's equals the model's NLL) or
            ``"resid_mid"`` (after attention, before the MLP).
        batch_size: examples per forward.
        layers: layer indices (default: all).
        progress: show a progress bar.
        max_logits: the most logits alive at once.

    Returns:
        An :class:`EarlyExitResult` with ``nll`` of shape ``[len(layers), N]``.
    """
    if at not in ("resid_mid", "resid_post"):
        raise ComponentError(f"Early exit reads 'resid_mid' or 'resid_post'; got {at!r}.")
    layers = hk.check_layers(model, layers)
    check_context(model, examples.tokens)
    refuse_padding(examples, "Early exit")
    readout = Readout(model, max_logits)
    nll = torch.empty(len(layers), len(examples), dtype=torch.float64)
    last = max(layers)
    device = next(model.original_model.parameters()).device
    bar = tqdm(total=len(examples), desc=f"early exit {at}", unit="ex", disable=not show_progress(progress))
    for start, end in batches(len(examples), batch_size):
        tokens = examples.tokens[start:end].to(device)
        fwd = [(hk.hook_point(model, at, layer), _exit_hook(readout, tokens, nll[i, start:end], layer == last))
               for i, layer in enumerate(layers)]
        with torch.no_grad(), model.hooks(fwd_hooks=fwd):
            try:
                hk.decoder_body(model)(input_ids=tokens)
            except _StopForward:
                pass
        bar.update(end - start)
    bar.close()
    _check_finite(nll, examples, "early exit")
    settings = {"model": getattr(getattr(model, "info", None), "name", "model"), "batch_size": batch_size,
                "examples": dict(examples.settings)}
    return EarlyExitResult(nll=nll.float(), layers=layers, ids=list(examples.ids), at=at, settings=settings)


def _check_finite(values: Tensor, examples: Examples, what: str) -> None:
    bad = ~torch.isfinite(values)
    if bad.any():
        cols = torch.nonzero(bad.reshape(-1, values.shape[-1]).any(dim=0)).flatten().tolist()[:3]
        raise NonFiniteError(f"{what} produced NaN/inf NLL for examples {[examples.ids[i] for i in cols]}: "
                             "check the model's weights.")


def early_exit_figure(results: Mapping[str, EarlyExitResult], title: str | None = None) -> Any:
    """Mean NLL by layer, one curve per result (e.g. ``"quantized / D_large"``).

    Curves whose name mentions ``ctrl`` are dashed, so {model} x {D_large, D_ctrl} reads at
    a glance.
    """
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, res in results.items():
        fig.add_trace(go.Scatter(
            x=res.layers, y=res.layer_mean().numpy(), mode="lines+markers", name=name,
            line={"dash": "dash" if "ctrl" in name.lower() else "solid"},
        ))
    at = next(iter(results.values())).at if results else "resid_post"
    fig.update_layout(
        title=title or f"Early exit: NLL decoding {at} at each layer",
        xaxis_title="layer", yaxis_title="mean next-token NLL (nats)", template="plotly_white",
    )
    return fig


@dataclass(frozen=True)
class EarlyExitCurves(ResultDisplay):
    """Early-exit results for several models on several example sets.

    Attributes:
        results: ``"model / set"`` -> :class:`EarlyExitResult`.
        models: model names in order (the first is the reference).
        sets: example-set names in order (e.g. ``D_large``, ``D_ctrl``).
    """

    results: dict[str, EarlyExitResult]
    models: list[str]
    sets: list[str]

    def table(self) -> pd.DataFrame:
        """Layer x curve mean NLL, plus ``gap / set`` = last model minus the first, per set."""
        first = next(iter(self.results.values()))
        frame = pd.DataFrame({name: res.layer_mean().numpy() for name, res in self.results.items()},
                             index=pd.Index(first.layers, name="layer"))
        for name in self.sets:
            frame[f"gap / {name}"] = frame[f"{self.models[-1]} / {name}"] - frame[f"{self.models[0]} / {name}"]
        return frame

    def split_layer(self, dataset: str | None = None, fraction: float = 0.5) -> int:
        """The first layer from which the gap stays at least ``fraction`` of its final value.

        The gap is (last model - first model) mean NLL on ``dataset`` (default: the first set).
        ``n_layers - split_layer`` is "the curves split only in the last k layers".
        """
        gaps = self.table()[f"gap / {dataset or self.sets[0]}"]
        final = float(gaps.iloc[-1])
        if final <= 0:
            return int(gaps.index[-1])
        split = int(gaps.index[-1])
        for layer, gap in zip(gaps.index[::-1], gaps.to_numpy()[::-1], strict=True):
            if gap < fraction * final:
                break
            split = int(layer)
        return split

    def figure(self) -> Any:
        return early_exit_figure(self.results)


def early_exit_curves(
    models: Mapping[str, Any],
    sets: Mapping[str, Examples],
    at: ExitPoint = "resid_post",
    batch_size: int = 8,
    layers: Sequence[int] | None = None,
    progress: bool | None = None,
) -> EarlyExitCurves:
    """Early exit for every (model, example set) pair, e.g. {reference, quantized} x {D_large, D_ctrl}.

    Example:
        >>> import torch
        >>> import interp
        >>> from interp.quant import quantize
        >>> ref = interp.tiny_model("llama")
        >>> q = quantize(ref, "rtn:bits=2,group=32", progress=False)
        >>> rows = torch.randint(0, 256, (6, 16), generator=torch.Generator().manual_seed(0))
        >>> large, ctrl = interp.Examples.from_tokens(rows[:3]), interp.Examples.from_tokens(rows[3:])
        >>> curves = early_exit_curves({"reference": ref, "quantized": q}, {"D_large": large, "D_ctrl": ctrl})
        >>> curves.table().columns.tolist()[-2:]  # last model minus the first, per set
        ['gap / D_large', 'gap / D_ctrl']
        >>> curves.split_layer("D_large") in (0, 1)
        True
    """
    results = {f"{m} / {s}": early_exit(model, ex, at=at, batch_size=batch_size, layers=layers, progress=progress)
               for m, model in models.items() for s, ex in sets.items()}
    return EarlyExitCurves(results=results, models=list(models), sets=list(sets))


# ---------------------------------------------------------------------------------------
# Layer restoration


def _block_pairs(restored: Any, reference: Any, layer: int, roles: Sequence[str] | None) -> list[tuple[Tensor, Tensor]]:
    if roles is None:
        dst = dict(hk.blocks(restored)[layer].named_parameters())
        src = dict(hk.blocks(reference)[layer].named_parameters())
    else:
        dst_mods, src_mods = hk.linear_modules(restored, layer), hk.linear_modules(reference, layer)
        unknown = sorted(set(roles) - set(dst_mods))
        if unknown:
            raise ComponentError(f"Unknown linear roles {unknown}; this model has {sorted(dst_mods)}.")
        dst = {f"{r}.{n}": p for r in roles for n, p in dst_mods[r].named_parameters()}
        src = {f"{r}.{n}": p for r in roles for n, p in src_mods[r].named_parameters()}
    if dst.keys() != src.keys() or any(dst[k].shape != src[k].shape for k in dst):
        raise ComponentError(f"Block {layer} of the two models differs in structure: they need the same architecture.")
    return [(dst[k], src[k]) for k in dst]


def restore_layers(quantized: Any, reference: Any, layers: Sequence[int], roles: Sequence[str] | None = None) -> Any:
    """A copy of ``quantized`` whose blocks ``layers`` carry the reference's weights again.

    Args:
        quantized: the damaged model (not modified).
        reference: the model to take weights from (not modified); same architecture.
        layers: block indices to restore (negative indices count from the end).
        roles: restore only these linear layers (``"gate"``, ``"up"``, ``"q"``, ...); default:
            every parameter of the block.

    Returns:
        A deep copy of ``quantized`` with ``restored_layers`` / ``restored_roles`` attributes.
    """
    if hk.n_layers(quantized) != hk.n_layers(reference):
        raise ComponentError("restore_layers needs two models with the same number of layers.")
    layers = list(layers)
    layers = hk.check_layers(quantized, layers) if layers else []  # restoring no block is the quantized model
    restored = copy.deepcopy(quantized)
    with torch.no_grad():
        for layer in layers:
            for dst, src in _block_pairs(restored, reference, layer, roles):
                dst.copy_(src.to(dst.device, dst.dtype))
    object.__setattr__(restored, "restored_layers", sorted(layers))
    object.__setattr__(restored, "restored_roles", list(roles) if roles is not None else None)
    return restored


@dataclass(frozen=True)
class RestorationResult(ResultDisplay):
    """Perplexity on a set of examples with the top-k blocks restored, for each k.

    Attributes:
        ks: numbers of restored blocks.
        restored: the blocks restored for each k.
        nll: ``[len(ks), N]`` mean NLL per example (``ks[i] = 0`` is the quantized model).
        reference_nll: ``[N]`` the reference model's NLL.
        ids, settings: example ids and run settings.
    """

    ks: list[int]
    restored: list[list[int]]
    nll: Float[Tensor, "n_ks n_examples"]
    reference_nll: PerExample
    ids: list[str]
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if tuple(self.nll.shape) != (len(self.ks), len(self.ids)) or len(self.restored) != len(self.ks):
            raise InterpError(f"RestorationResult.nll has shape {tuple(self.nll.shape)}; expected "
                              f"[{len(self.ks)}, {len(self.ids)}].")

    def perplexity(self) -> Float[Tensor, " n_ks"]:
        return torch.exp(self.nll.double().mean(dim=1))

    @property
    def reference_perplexity(self) -> float:
        return math.exp(float(self.reference_nll.double().mean()))

    def table(self) -> pd.DataFrame:
        """``k``, restored blocks, perplexity and recovery ``(ppl_q - ppl_k) / (ppl_q - ppl_ref)``."""
        ppl = self.perplexity().numpy()
        quantized = float(ppl[self.ks.index(0)]) if 0 in self.ks else math.nan
        denom = quantized - self.reference_perplexity
        return pd.DataFrame({
            "k": self.ks,
            "restored": [_span(layers) for layers in self.restored],
            "perplexity": ppl,
            "reference": self.reference_perplexity,
            "recovery": (quantized - ppl) / denom if denom else math.nan,
        })

    def figure(self) -> Any:
        import plotly.graph_objects as go

        fig = go.Figure(go.Scatter(x=self.ks, y=self.perplexity().numpy(), mode="lines+markers",
                                   name="top-k blocks restored"))
        fig.add_hline(y=self.reference_perplexity, line_dash="dash", annotation_text="reference")
        fig.update_layout(title="Layer restoration: perplexity with the top-k blocks restored",
                          xaxis_title="k (restored blocks, from the top)", yaxis_title="perplexity",
                          template="plotly_white")
        return fig

    def save(self, folder: str | Path) -> Path:
        from interp.io import ensure_writable_dir

        out = ensure_writable_dir(folder)
        self.table().to_csv(out / "restoration.csv", index=False)
        return out


def _span(layers: Sequence[int]) -> str:
    """``[27, 28, 29]`` -> ``"27-29"``; non-contiguous sets are listed."""
    if not layers:
        return ""
    ordered = sorted(layers)
    if ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) > 1:
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))


def restoration_sweep(
    quantized: Any,
    reference: Any,
    examples: Examples,
    ks: Sequence[int] | None = None,
    order: Sequence[int] | None = None,
    batch_size: int = 8,
    progress: bool | None = None,
) -> RestorationResult:
    """Perplexity with the reference weights restored in the top-k blocks, for each k.

    Args:
        quantized: the damaged model (not modified).
        reference: the model whose blocks are restored (not modified).
        examples: typically D_large.
        ks: numbers of blocks to restore (default ``0..n_layers``).
        order: the order in which blocks are restored (default: from the top down).
        batch_size: examples per forward.
        progress: show a progress bar.

    Returns:
        A :class:`RestorationResult`; ``result.nll[i]`` equals
        ``interp.nll(restore_layers(quantized, reference, order[:ks[i]]), examples)``.
    """
    from interp import patching

    n = hk.n_layers(quantized)
    order = hk.check_layers(quantized, order if order is not None else range(n - 1, -1, -1))
    ks = sorted({int(k) for k in (ks if ks is not None else range(n + 1))})
    if ks[0] < 0 or ks[-1] > len(order):
        raise InterpError(f"ks must lie in 0..{len(order)}; got {ks}.")
    restored = [sorted(order[:k]) for k in ks]
    nll, reference_nll = patching.restored_nll(quantized, reference, examples, restored, batch_size, progress)
    settings = {"order": order, "batch_size": batch_size, "examples": dict(examples.settings)}
    return RestorationResult(ks=ks, restored=restored, nll=nll, reference_nll=reference_nll,
                             ids=list(examples.ids), settings=settings)

