"""Early exit: the logit lens, layer by layer.

The residual stream ``r_l`` after layer ``l`` lives in the same basis as the
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

Layer restoration lives in :mod:`interp.localize.restoration`; figures of both in
:mod:`interp.figures.localize`.

Example:
    >>> import interp
    >>> from interp.localize import lens
    >>> model = interp.tiny_model("llama")
    >>> ex = interp.Examples.from_tokens(__import__("torch").randint(0, 256, (4, 16)))
    >>> res = lens.early_exit(model, ex, at="resid_post")
    >>> tuple(res.nll.shape)
    (2, 4)
    >>> bool(abs(res.nll[-1] - interp.nll(model, ex)).max() < 1e-4)
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from interp.data import Examples, aligned_rows
from interp.display import ResultDisplay
from interp.errors import ComponentError, InterpError, NonFiniteError
from interp.models import Model, model_name
from interp.results import CheckedResult
from interp.runtime import hooks as hk
from interp.runtime.batching import StopForward, batches, check_context, show_progress
from interp.runtime.readout import DEFAULT_MAX_LOGITS, Readout
from interp.typing import Tokens
from interp.validate import checked

ExitPoint = Literal["resid_mid", "resid_post"]
LayerNLL = Float[Tensor, "n_layers n_examples"]


# ---------------------------------------------------------------------------------------
# Early exit


@dataclass(frozen=True)
class EarlyExitResult(CheckedResult, ResultDisplay):
    """Per-layer, per-example NLL of the logit-lens decoding.

    Attributes:
        nll: ``[n_layers, N]`` mean next-token NLL (nats) decoding at each layer.
        layers: the model layers of the first axis.
        ids: the example ids of the second axis.
        at: where the residual was read (``resid_mid`` or ``resid_post``).
        settings: model name, batch size, examples' settings.

    Made only finite: see :mod:`interp.results`.
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
        super().__post_init__()  # finite (CheckedResult), after the shapes

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


def _exit_hook(readout: Readout, tokens: Tokens, row: Tensor, stop: bool, lengths: Tensor | None = None) -> Any:
    def decode(x: Tensor, hook: Any) -> None:
        row.copy_(readout.mean_nll(x, tokens, lengths))  # no host copy per layer: the table is on the device
        if stop:
            raise StopForward
    return decode


@checked
def early_exit(
    model: Model,
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
        examples: token rows; padded rows (``examples_from_texts``) are left-aligned and
            each row averages its own real targets only, so padding changes nothing.
        at: ``"resid_post"`` (block output; the last layer's equals the model's NLL) or
            ``"resid_mid"`` (after attention, before the MLP).
        batch_size: examples per forward.
        layers: layer indices (default: all).
        progress: show a progress bar.
        max_logits: the most logits alive at once.

    Returns:
        An :class:`~interp.localize.lens.EarlyExitResult` with ``nll`` of shape ``[len(layers), N]``.

    Example:
        >>> import torch
        >>> import interp
        >>> model = interp.tiny_model("llama")
        >>> ex = interp.Examples.from_tokens(torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(0)))
        >>> result = interp.logit_lens(model, ex)
        >>> tuple(result.nll.shape), result.layers  # the last layer's row is the model's own NLL
        ((2, 3), [0, 1])
        >>> bool(torch.allclose(result.nll[-1], interp.nll(model, ex), atol=1e-5))
        True
    """
    if at not in ("resid_mid", "resid_post"):
        raise ComponentError(f"Early exit reads 'resid_mid' or 'resid_post'; got {at!r}.")
    layers = hk.check_layers(model, layers)
    check_context(model, examples.tokens)
    readout = Readout(model, max_logits)
    last = max(layers)
    device = next(model.original_model.parameters()).device
    nll = torch.empty(len(layers), len(examples), dtype=torch.float64, device=device)  # to the host once, at the end
    bar = tqdm(total=len(examples), desc=f"early exit {at}", unit="ex", disable=not show_progress(progress))
    for start, end in batches(len(examples), batch_size):
        tokens, lengths = aligned_rows(examples, start, end, device)
        fwd = [(hk.hook_point(model, at, layer), _exit_hook(readout, tokens, nll[i, start:end], layer == last, lengths))
               for i, layer in enumerate(layers)]
        with torch.no_grad(), model.hooks(fwd_hooks=fwd):
            try:
                hk.decoder_body(model)(input_ids=tokens)
            except StopForward:
                pass
        bar.update(end - start)
    bar.close()
    _check_finite(nll, examples, "early exit")
    settings = {"model": model_name(model), "batch_size": batch_size,
                "examples": dict(examples.settings)}
    return EarlyExitResult(nll=nll.float().cpu(), layers=layers, ids=list(examples.ids), at=at, settings=settings)


def _check_finite(values: Tensor, examples: Examples, what: str) -> None:
    bad = ~torch.isfinite(values)
    if bad.any():
        cols = torch.nonzero(bad.reshape(-1, values.shape[-1]).any(dim=0)).flatten().tolist()[:3]
        raise NonFiniteError(f"{what} produced NaN/inf NLL for examples {[examples.ids[i] for i in cols]}: "
                             "check the model's weights.")


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
    if not models or not sets:
        raise InterpError(f"early_exit_curves needs at least one model and one example set; got {len(models)} "
                          f"model(s) and {len(sets)} set(s), e.g. {{'reference': ref}} and {{'D_large': examples}}.")
    results = {f"{m} / {s}": early_exit(model, ex, at=at, batch_size=batch_size, layers=layers, progress=progress)
               for m, model in models.items() for s, ex in sets.items()}
    return EarlyExitCurves(results=results, models=list(models), sets=list(sets))
