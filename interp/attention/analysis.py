"""Layer-by-layer attention localization of a loaded model, with and without SAOBP.

:func:`analyze` runs the model over examples through the probe machinery. The hook on
``blocks.{l}.attn.hook_pattern`` reduces each batch's pattern to per-head means of
entropy, normalised entropy, GTD, sink share and effective span, then drops it, so no
attention tensor is kept across batches. With ``saobp_beta``, a second pass installs
:func:`interp.attention.saobp_hook` on the analysed layers *before* the measuring hooks:
the statistics then describe the refined pattern, later layers see the refined attention
output, and the per-example NLL change measures what SAOBP does to the pretrained model.

Reading the result:

- ``result.table`` has one row per (variant, layer, head) with the five metrics, averaged
  over examples (``variant`` is ``"reference"`` or ``"saobp"``);
- ``result.by_layer()`` averages over heads and gives the head spread;
- ``result.delta_nll`` is ``NLL(saobp) - NLL(reference)`` per example.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from interp import validate
from interp.attention.metrics import METRICS
from interp.attention.saobp import saobp_hook
from interp.data import Examples
from interp.display import ResultDisplay
from interp.models import Model
from interp.probes import ProbeResult, probe
from interp.results import CheckedResult
from interp.runtime import hooks as hk
from interp.validate import checked

if TYPE_CHECKING:
    from interp.attention.saobp import Mode



@dataclass(frozen=True)
class AttentionResult(CheckedResult, ResultDisplay):
    """Per layer and head attention statistics, for the reference model and optionally SAOBP.

    Attributes:
        table: long DataFrame with columns variant, layer, head and one column per metric.
        nll_reference: per-example NLL of the unmodified model (when computed).
        nll_saobp: per-example NLL with SAOBP on the analysed layers (when computed).
        settings: beta, mode, layers, examples' settings.

    Made only finite: see :mod:`interp.results`.
    """

    table: pd.DataFrame
    nll_reference: torch.Tensor | None = None
    nll_saobp: torch.Tensor | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def delta_nll(self) -> torch.Tensor | None:
        if self.nll_reference is None or self.nll_saobp is None:
            return None
        return self.nll_saobp - self.nll_reference

    @property
    def variants(self) -> list[str]:
        return list(dict.fromkeys(self.table["variant"]))

    def by_layer(self) -> pd.DataFrame:
        """Mean, min and max over heads per (variant, layer) for every metric."""
        grouped = self.table.groupby(["variant", "layer"])[list(METRICS)]
        out = grouped.agg(["mean", "min", "max"])
        out.columns = [f"{metric}_{stat}" for metric, stat in out.columns]
        return out.reset_index()

    def to_frame(self) -> pd.DataFrame:
        return self.table.copy()

    def summary(self) -> pd.DataFrame:
        """Mean over heads of every metric, per (variant, layer)."""
        return self.table.groupby(["variant", "layer"])[list(METRICS)].mean().reset_index()

    def to_dict(self) -> dict[str, Any]:
        layer = self.by_layer()
        summary: dict[str, Any] = {"settings": self.settings, "by_layer": {}}
        for variant in self.variants:
            rows = layer[layer["variant"] == variant]
            summary["by_layer"][variant] = {m: rows[f"{m}_mean"].round(6).tolist() for m in METRICS}
        nll_ref, nll_saobp = self.nll_reference, self.nll_saobp
        if nll_ref is not None and nll_saobp is not None:  # i.e. delta_nll is not None
            summary["nll_reference_mean"] = float(nll_ref.mean())
            summary["nll_saobp_mean"] = float(nll_saobp.mean())
            summary["delta_nll_mean"] = float((nll_saobp - nll_ref).mean())
        return summary


def _table(stats: Any, variant: str) -> pd.DataFrame:
    frames = []
    for metric in METRICS:
        values = stats["pattern", metric].double().mean(dim=1)  # [layers, heads], mean over examples
        n_layers, n_heads = values.shape
        frame = pd.DataFrame({
            "variant": variant,
            "layer": [layer for layer in stats.layers for _ in range(n_heads)],
            "head": list(range(n_heads)) * n_layers,
            metric: values.flatten().double().numpy(),
        })
        frames.append(frame.set_index(["variant", "layer", "head"]))
    return pd.concat(frames, axis=1).reset_index()


@checked
def analyze(
    model: Model,
    examples: Examples,
    saobp_beta: float | torch.Tensor | None = None,
    layers: Sequence[int] | None = None,
    mode: Mode = "exact",
    batch_size: int = 8,
    with_nll: bool = True,
    progress: bool | None = None,
) -> AttentionResult:
    """Attention entropy, GTD, sink share and effective span per layer and head.

    Args:
        model: a bridge from :func:`interp.load_model`.
        examples: token rows; padded rows (:func:`interp.examples_from_texts`) are honoured: pad
            queries never enter a mean, and left padding shifts nothing.
        saobp_beta: if given, also measure after inference-time SAOBP with this beta
            (a float or a per-head tensor) on ``layers``.
        layers: layers to analyse and refine (default: all).
        mode: SAOBP mode, ``"exact"`` or ``"first_order"``.
        batch_size: examples per forward.
        with_nll: also compute per-example NLL for both variants (needed for the NLL change).
        progress: show progress bars.

    Returns:
        An :class:`interp.attention.analysis.AttentionResult`.

    Example:
        >>> import torch
        >>> import interp
        >>> from interp.attention import analyze
        >>> model = interp.tiny_model("llama")
        >>> ex = interp.Examples.from_tokens(torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(0)))
        >>> res = analyze(model, ex, saobp_beta=2.0, with_nll=False, progress=False)
        >>> res.variants, sorted(set(res.table["layer"]))
        (['reference', 'saobp'], [0, 1])
    """

    layer_list = validate.layer_indices(layers, hk.n_layers(model))
    reference, refined = attention_probes(model, examples, saobp_beta, layer_list, mode, batch_size, with_nll,
                                          progress)
    return attention_result(reference, refined, settings(model, examples, saobp_beta, layer_list, mode, batch_size))


def attention_probes(model: Model, examples: Examples, saobp_beta: float | torch.Tensor | None, layers: list[int],
                     mode: Mode, batch_size: int, with_nll: bool, progress: bool | None
                     ) -> tuple[ProbeResult, ProbeResult | None]:
    """The per-example half of :func:`analyze`: the probe of every metric, then (with ``saobp_beta``) the
    probe with SAOBP installed. Sharded runs (:mod:`interp.runtime.distributed`) compute this per batch
    and hand the concatenated probes to :func:`attention_result`, the half that averages over examples."""
    kwargs: dict[str, Any] = dict(batch_size=batch_size, layers=layers, progress=progress)
    reference = probe(model, examples, ["pattern"], list(METRICS), with_nll=with_nll and saobp_beta is not None,
                      **kwargs)
    if saobp_beta is None:
        return reference, None
    hook = saobp_hook(saobp_beta, mode=mode)  # validates beta and mode once
    extra = [(hk.hook_point(model, "pattern", layer), hook) for layer in layers]
    return reference, probe(model, examples, ["pattern"], list(METRICS), extra_hooks=extra, with_nll=with_nll,
                            **kwargs)


def settings(model: Model, examples: Examples, saobp_beta: float | torch.Tensor | None, layers: list[int], mode: Mode,
             batch_size: int) -> dict[str, Any]:
    """The settings an :class:`AttentionResult` records."""
    beta_setting = saobp_beta.tolist() if isinstance(saobp_beta, torch.Tensor) else saobp_beta
    return {"saobp_beta": beta_setting, "mode": mode, "layers": layers, "batch_size": batch_size,
            "examples": dict(examples.settings), "model": getattr(getattr(model, "info", None), "name", "")}


def attention_result(reference: ProbeResult, refined: ProbeResult | None, settings: dict[str, Any]
                     ) -> AttentionResult:
    """Per-head means over examples of the probes from :func:`attention_probes`."""
    table = _table(reference, "reference")
    nll_saobp = None
    if refined is not None:
        table = pd.concat([table, _table(refined, "saobp")], ignore_index=True)
        nll_saobp = refined.nll
    return AttentionResult(table=table, nll_reference=reference.nll, nll_saobp=nll_saobp, settings=settings)


def capture_patterns(model: Model, tokens: torch.Tensor, layers: Sequence[int], saobp_beta: float | None = None,
                     mode: Mode = "exact") -> dict[int, torch.Tensor]:
    """Attention patterns ``[head, q, k]`` of one token row at ``layers`` (for attention-map figures)."""

    layer_list = hk.check_layers(model, layers)
    captured: dict[int, torch.Tensor] = {}
    fwd_hooks: list[tuple[str, Callable[..., Any]]] = []
    for layer in layer_list:
        name = hk.hook_point(model, "pattern", layer)
        if saobp_beta is not None:
            fwd_hooks.append((name, saobp_hook(saobp_beta, mode=mode)))

        def keep(x: torch.Tensor, hook: Any, layer: int = layer) -> None:
            captured[layer] = x[0].detach().float().cpu()

        fwd_hooks.append((name, keep))
    with torch.no_grad(), model.hooks(fwd_hooks=fwd_hooks):
        model.original_model(input_ids=tokens.reshape(1, -1))
    return captured
