"""Activation patching: which component carries the difference between two runs?

Activation patching runs a *target* forward pass and overwrites one activation (one
component at some layers, optionally some positions or heads) with its value from a
*source* run, then measures how far the output moves towards the source's output. A
component whose patch moves the output most of the way carries the difference; one whose
patch moves nothing does not (alone, at those layers).

Two front ends share one engine (:func:`patch`):

- **Cross-model** (:func:`cross_model`, :func:`patching_table`, :func:`layer_sweep`): the
  target is a quantized model, the source the reference model, both on the *same* tokens.
  This is the reference paper's experiment ("Why Do Some Inputs Break Low-Bit LLM
  Quantization?", EMNLP 2025): patching the reference's MLP output into the upper half of
  a 3-bit Llama3-8B recovers 93% of the perplexity gap on D_large, the gate 84%, the up
  projection 14% and attention 28%.
- **Clean/corrupt** (:func:`clean_corrupt`): one model, two prompts of the same length.
  The target run is the corrupted prompt, the source the clean one ("denoising"); the
  metric is the logit difference between a right and a wrong answer token.

Components are semantic names (see :mod:`interp.hooks`): ``resid_pre``, ``resid_mid``,
``resid_post``, ``attn_out``, ``head`` (per-head ``z``, optionally a subset of heads),
``gate`` (the gate *pre-activation*; the activation is deterministic, so this equals
patching ``act(gate)``), ``up``, ``down`` (MLP output) and ``gate_input``: the source's
input to the gate projection, multiplied by the *target's* gate weight. Only the gate
projection sees the source input there; the up projection keeps the target's input.

Reading a :class:`PatchResult`:

- ``values[j, n]``: the metric (mean NLL, or logit difference) for patch ``j`` on example ``n``;
- ``target`` / ``source``: the unpatched target's and source's metric per example;
- ``recovery()``: ``(target - patched) / (target - source)`` on the aggregate (perplexity for
  NLL, the paper's definition; the mean for logit differences). 1 means the patch closes the
  whole gap, 0 that it changes nothing; negative values move away from the source.
- ``table()`` is a DataFrame with one row per patch; ``figure()`` a plotly figure.

How the engine saves time without changing results (:func:`patch_naive` is the textbook
loop, one full forward per patch, kept as the reference and for benchmarks):

1. the source's activations are captured once per batch, for every patch;
2. the target's residual stream entering each block is cached once per batch, and each
   patched run starts at its lowest patched layer, running the Hugging Face decoder layers
   directly (rotary position embeddings and causal masks rebuilt as the model's own forward
   builds them; checked against a full forward on the first batch);
3. patches starting at the same layer share one forward: their rows are stacked (up to
   ``max_rows``), and patches starting higher join the stack when it reaches their layer;
4. the metric is computed from the final residual in row chunks, never as ``[rows, T, vocab]``.

:func:`attribution` is the first-order (gradient) estimate of every (component, layer)
effect, ``(source_act - target_act) . dMetric/dact``, from one forward and backward pass:
a fast prefilter before exact patching (:func:`rank_agreement` measures how well it ranks).

Example:
    >>> import interp, torch
    >>> from interp import patching
    >>> from interp.quant.apply import quantize
    >>> source = interp.tiny_model("llama")
    >>> target = quantize(source, "rtn:bits=3,group=64", progress=False)
    >>> ex = interp.Examples.from_tokens(torch.randint(0, 256, (4, 16)))
    >>> res = patching.patch(target, source, ex, patching.single_layer_patches(["down", "gate"], [0, 1]))
    >>> res.table()[["component", "layers"]].values.tolist()
    [['down', '0'], ['down', '1'], ['gate', '0'], ['gate', '1']]
    >>> every = patching.patch(target, source, ex, [patching.Patch("resid_post", (0, 1))])
    >>> bool((every.values[0] - every.source).abs().max() < 1e-5)  # every block output patched: the source
    True
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from interp import hooks as hk
from interp import validate
from interp.data import Examples, refuse_padding
from interp.display import ResultDisplay
from interp.errors import ComponentError, DataError, InterpError, NonFiniteError
from interp.lens import Readout
from interp.probes import batches, check_context, check_examples, show_progress
from interp.scoring import model_logits, token_nll
from interp.typing import PerExample, Resid, Tokens

PatchComponent = Literal[
    "resid_pre", "resid_mid", "resid_post", "attn_out", "head", "gate", "up", "down", "gate_input", "mlp_pre",
]
PATCHABLE: tuple[str, ...] = ("resid_pre", "resid_mid", "resid_post", "attn_out", "head", "gate", "up", "down",
                              "gate_input", "mlp_pre")
PAPER_COMPONENTS: tuple[str, ...] = ("attn_out", "gate", "up", "down", "gate_input")
PAPER_NAMES = {"attn_out": "attention", "gate": "gate", "up": "up", "down": "down (MLP out)",
               "gate_input": "gate input only", "head": "heads", "resid_pre": "resid_pre",
               "resid_mid": "resid_mid", "resid_post": "resid_post", "mlp_pre": "MLP pre-activation"}
LayerSelection = Union[str, int, Sequence[int], None]

PerRow = Float[Tensor, " rows"]
PatchValues = Float[Tensor, "n_patches n_examples"]
Key = tuple[str, int]  # (component, layer)


# ---------------------------------------------------------------------------------------
# What to patch


@dataclass(frozen=True)
class Patch:
    """One patch job: a component at one or more layers, at all or some positions and heads.

    Attributes:
        component: a semantic name from :data:`PATCHABLE`.
        layers: layers patched together, in one run.
        positions: token positions to patch (default: all).
        heads: for ``head``, the heads to patch (default: all).
    """

    component: str
    layers: tuple[int, ...]
    positions: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.component not in PATCHABLE:
            raise ComponentError(f"Cannot patch {self.component!r}. Patchable components: {', '.join(PATCHABLE)}.")
        if not self.layers:
            raise ComponentError("A patch needs at least one layer.")
        if not all(validate.is_integer(layer) for layer in self.layers):
            raise ComponentError(f"Patch layers must be integer layer indices, got {self.layers!r}.")
        if self.heads is not None and self.component != "head":
            raise ComponentError(f"heads= applies to the 'head' component only, not {self.component!r}.")

    @property
    def start(self) -> int:
        """The lowest patched layer: the patched run starts there."""
        return min(self.layers)

    @property
    def label(self) -> str:
        text = f"{self.component}@{span(self.layers)}"
        if self.heads is not None:
            text += f" h{span(self.heads)}"
        if self.positions is not None:
            text += f" pos{span(self.positions)}"
        return text


def span(values: Sequence[int]) -> str:
    """``(15, 16, ..., 29)`` -> ``"15-29"``; other sets are listed."""
    ordered = sorted(values)
    if len(ordered) > 1 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))


def resolve_layers(model: Any, layers: LayerSelection) -> list[int]:
    """``None``/``"all"``, ``"upper_half"``, ``"lower_half"``, a layer, or a list of layers."""
    n = hk.n_layers(model)
    if layers is None or layers == "all":
        return list(range(n))
    if layers == "upper_half":
        return list(range(n // 2, n))
    if layers == "lower_half":
        return list(range(n // 2))
    if isinstance(layers, str):
        raise ComponentError(f"Unknown layer selection {layers!r}: use 'all', 'upper_half', 'lower_half' or indices.")
    return sorted(set(validate.layer_indices(layers, n)))


def single_layer_patches(components: Sequence[str], layers: Sequence[int], positions: Sequence[int] | None = None,
                         heads: Sequence[int] | None = None) -> list[Patch]:
    """One patch per (component, layer): a per-layer sweep."""
    pos = tuple(positions) if positions is not None else None
    return [Patch(c, (int(layer),), pos, tuple(heads) if heads is not None and c == "head" else None)
            for c in components for layer in layers]


def joint_patches(components: Sequence[str], layers: Sequence[int], heads: Sequence[int] | None = None) -> list[Patch]:
    """One patch per component, covering all ``layers`` at once (e.g. the upper half)."""
    return [Patch(c, tuple(int(x) for x in layers), None, tuple(heads) if heads is not None and c == "head" else None)
            for c in components]


def position_patches(component: str, layers: Sequence[int], positions: Sequence[int]) -> list[Patch]:
    """One patch per (layer, position): the classic layer x position grid."""
    return [Patch(component, (int(layer),), (int(p),)) for layer in layers for p in positions]


# ---------------------------------------------------------------------------------------
# Metrics: per-example values from the final residual (engine) or from logits (naive loop)


class Metric:
    """A per-example scalar read from the model's output.

    ``from_resid`` decodes the final (pre-norm) residual with a :class:`~interp.lens.Readout`;
    ``from_logits`` reads full logits. Both give the same values. ``index`` holds each row's
    example index (rows of stacked patch jobs repeat examples).
    """

    name = "metric"
    aggregate_name = "mean"

    def from_resid(self, readout: Readout, resid: Resid, tokens: Tokens, index: Tensor) -> PerRow:
        raise NotImplementedError

    def from_logits(self, logits: Float[Tensor, "batch pos vocab"], tokens: Tokens, index: Tensor) -> PerRow:
        raise NotImplementedError

    def aggregate(self, values: Float[Tensor, "... n_examples"]) -> Float[Tensor, "..."]:
        return values.double().mean(dim=-1)


class NLLMetric(Metric):
    """Mean next-token NLL per example; aggregated as perplexity ``exp(mean NLL)``."""

    name = "nll"
    aggregate_name = "perplexity"

    def from_resid(self, readout: Readout, resid: Resid, tokens: Tokens, index: Tensor) -> PerRow:
        return readout.mean_nll(resid, tokens)

    def from_logits(self, logits: Float[Tensor, "batch pos vocab"], tokens: Tokens, index: Tensor) -> PerRow:
        return token_nll(logits, tokens.to(logits.device)).double().mean(dim=1)

    def aggregate(self, values: Float[Tensor, "... n_examples"]) -> Float[Tensor, "..."]:
        return torch.exp(values.double().mean(dim=-1))


class LogitDiffMetric(Metric):
    """``logit[answer] - logit[wrong]`` at one position (default: the last)."""

    name = "logit_diff"
    aggregate_name = "mean logit difference"

    def __init__(self, answers: Sequence[int] | Tensor | int, wrongs: Sequence[int] | Tensor | int, position: int = -1):
        self.answers = torch.as_tensor(answers, dtype=torch.long).reshape(-1)
        self.wrongs = torch.as_tensor(wrongs, dtype=torch.long).reshape(-1)
        self.position = position

    def _pick(self, logits: Float[Tensor, "rows vocab"], index: Tensor) -> PerRow:
        def per_row(tokens: Tensor) -> Tensor:  # one token for all rows, or one per example
            return (tokens.expand(len(index)) if len(tokens) == 1 else tokens[index]).to(logits.device)

        rows = torch.arange(logits.shape[0], device=logits.device)
        return (logits[rows, per_row(self.answers)] - logits[rows, per_row(self.wrongs)]).double()

    def from_resid(self, readout: Readout, resid: Resid, tokens: Tokens, index: Tensor) -> PerRow:
        return self._pick(readout.logits(resid[:, self.position]).float(), index)

    def from_logits(self, logits: Float[Tensor, "batch pos vocab"], tokens: Tokens, index: Tensor) -> PerRow:
        return self._pick(logits[:, self.position].float(), index)


def _metric(metric: Metric | str | None) -> Metric:
    if metric is None or metric == "nll":
        return NLLMetric()
    if isinstance(metric, Metric):
        return metric
    raise InterpError(f"Unknown metric {metric!r}: use 'nll' or a LogitDiffMetric(answers, wrongs).")


# ---------------------------------------------------------------------------------------
# Running a suffix of decoder layers from a cached residual


class DecoderRunner:
    """Runs decoder blocks ``start..L-1`` from a residual, calling them as the model's forward does.

    Llama-style models (Llama, Mistral, Qwen) call each layer with
    ``position_embeddings=(cos, sin)`` from the rotary module, a causal mask from
    ``create_causal_mask`` and ``position_ids``; Gemma-3 and other models with
    ``config.layer_types`` pick a full or sliding-window mask (and, for Gemma-3, rotary
    embeddings) per layer type. The blocks are the bridge's, so hooks fire as usual.
    """

    def __init__(self, model: Any) -> None:
        inner = model.original_model.model
        self.blocks = hk.blocks(model)
        self.config = inner.config
        self.rotary = inner.rotary_emb
        n = len(self.blocks)
        self.layer_types = list(getattr(self.config, "layer_types", None) or ["full_attention"] * n)
        rotary_forward = getattr(self.rotary, "original_component", None) or self.rotary
        self.rotary_by_type = "layer_type" in inspect.signature(rotary_forward.forward).parameters
        self._rotary: dict[tuple[Any, ...], Any] = {}
        self._masks: dict[tuple[Any, ...], Any] = {}
        self._model = model
        self._native: Any = None

    @classmethod
    def for_model(cls, model: Any) -> DecoderRunner | None:
        """A runner for blocks under ``model.layers`` with a rotary module (Llama, Mistral, Qwen, Gemma, Phi-3,
        OLMo-2...); ``None`` where the layer call is unknown. :meth:`verify` checks it on the first batch."""
        info = getattr(model, "info", None)
        if info is None or info.layers_path != "model.layers":
            return None
        inner = getattr(model.original_model, "model", None)
        if inner is None or not hasattr(inner, "rotary_emb"):
            return None
        if getattr(inner.config, "use_bidirectional_attention", False):
            return None
        return cls(model)

    def _layer_kwargs(self, layer: int, hidden: Tensor) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kind = self.layer_types[layer]
        rows, seq = hidden.shape[:2]
        position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0)
        rkey = (kind if self.rotary_by_type else "", seq, hidden.dtype, hidden.device)
        if rkey not in self._rotary:
            extra = (kind,) if self.rotary_by_type else ()
            self._rotary[rkey] = self.rotary(hidden[:1], position_ids, *extra)
        mkey = (kind, rows, seq, hidden.dtype, hidden.device)
        if mkey not in self._masks:
            make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
            self._masks[mkey] = make(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                     past_key_values=None, position_ids=position_ids)
        return {"attention_mask": self._masks[mkey], "position_embeddings": self._rotary[rkey],
                "position_ids": position_ids}

    def native_blocks(self) -> Any:
        """The decoder layers without the bridge's wrappers (:func:`interp.hooks.native_model`)."""
        if self._native is None:
            tree: Any = hk.native_model(self._model)
            self._native = tree.model.layers
        return self._native

    def block(self, layer: int, hidden: Resid, module: Any = None, native: bool = False) -> Resid:
        """Block ``layer`` (or ``module`` in its place) applied to ``hidden``.

        ``native=True`` runs the bridge-free layer: same output bit for bit, no hooks fire.
        """
        if module is None:
            module = self.native_blocks()[layer] if native else self.blocks[layer]
        out = module(hidden, **self._layer_kwargs(layer, hidden))
        return out[0] if isinstance(out, tuple) else out

    def run(self, hidden: Resid, start: int, modules: Sequence[Any] | None = None) -> Resid:
        """Blocks ``start..L-1``; ``modules[l]`` replaces block ``l`` when given."""
        for layer in range(start, len(self.blocks)):
            hidden = self.block(layer, hidden, None if modules is None else modules[layer])
        return hidden

    def check_layers(self) -> list[int]:
        """The last layer of each layer type: enough to check masks and rotary embeddings."""
        last: dict[str, int] = {}
        for layer, kind in enumerate(self.layer_types):
            last[kind] = layer
        return sorted(last.values())

    def verify(self, cache: Mapping[Key, Tensor]) -> bool:
        """Does one block from the cached ``resid_pre`` reproduce the cached ``resid_post``?"""
        for layer in self.check_layers():
            expected = cache[("resid_post", layer)]
            got = self.block(layer, cache[("resid_pre", layer)])
            scale = float(expected.abs().max()) or 1.0
            if not torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * scale):
                return False
        return True


# ---------------------------------------------------------------------------------------
# Hooks: capture and replace


def _device(model: Any) -> torch.device:
    return next(model.original_model.parameters()).device


def _capture(model: Any, tokens: Tokens, keys: Sequence[Key]) -> tuple[dict[Key, Tensor], Resid]:
    """Activations at ``keys`` and the final (pre-norm) residual, from one forward."""
    store: dict[Key, Tensor] = {}
    final_key = ("resid_post", hk.n_layers(model) - 1)

    def saver(key: Key) -> Callable[[Tensor, Any], None]:
        def save(x: Tensor, hook: Any) -> None:
            store[key] = x.detach()
        return save

    wanted = list(dict.fromkeys([*keys, final_key]))
    fwd = [(hk.hook_point(model, component, layer), saver((component, layer))) for component, layer in wanted]
    with model.hooks(fwd_hooks=fwd):
        hk.decoder_body(model)(input_ids=tokens)
    return store, store[final_key]


def _assign(x: Tensor, row: int, src: Tensor, positions: Tensor | None, heads: Tensor | None) -> None:
    """Overwrite rows ``row:row+B`` of ``x`` with ``src`` (at some positions / heads)."""
    view = x[row : row + src.shape[0]]
    if positions is None and heads is None:
        view.copy_(src)
    elif heads is None:
        view[:, positions] = src[:, positions]
    elif positions is None:
        view[:, :, heads] = src[:, :, heads]
    else:
        grid = positions[:, None]
        view[:, grid, heads] = src[:, grid, heads]


def _replacer(entries: list[tuple[int, Tensor, Tensor | None, Tensor | None]]) -> Callable[[Tensor, Any], Tensor]:
    def replace(x: Tensor, hook: Any) -> Tensor:
        x = x.clone()
        for row, src, positions, heads in entries:
            _assign(x, row, src, positions, heads)
        return x
    return replace


def _as_index(values: tuple[int, ...] | None) -> Tensor | None:
    return None if values is None else torch.tensor(values, dtype=torch.long)


def _patch_hooks(model: Any, jobs: Sequence[Patch], cache: Mapping[Key, Tensor], batch: int,
                 layer: int | None = None) -> list[tuple[str, Callable[..., Any]]]:
    """Hooks applying job ``j`` to rows ``j*batch:(j+1)*batch`` (only at ``layer`` when given)."""
    grouped: dict[str, list[tuple[int, Tensor, Tensor | None, Tensor | None]]] = {}
    for j, job in enumerate(jobs):
        for patched_layer in job.layers:
            if layer is not None and patched_layer != layer:
                continue
            name = hk.hook_point(model, job.component, patched_layer)
            src = cache[(job.component, patched_layer)]
            grouped.setdefault(name, []).append((j * batch, src, _as_index(job.positions), _as_index(job.heads)))
    return [(name, _replacer(entries)) for name, entries in grouped.items()]


# ---------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class PatchResult(ResultDisplay):
    """Per-patch, per-example metric values from :func:`patch`.

    Attributes:
        values: ``[n_patches, N]`` metric with each patch applied.
        target: ``[N]`` the unpatched target run's metric.
        source: ``[N]`` the source run's metric.
        patches: the patch jobs, in the order of ``values``.
        ids: example ids.
        metric: ``"nll"`` (aggregated as perplexity) or ``"logit_diff"`` (mean).
        settings: models, batch size, examples' settings.
    """

    values: PatchValues
    target: PerExample
    source: PerExample
    patches: list[Patch]
    ids: list[str]
    metric: str = "nll"
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.ids)
        if tuple(self.values.shape) != (len(self.patches), n) or self.target.shape != (n,) or self.source.shape != (n,):
            raise InterpError(f"PatchResult shapes do not match: values {tuple(self.values.shape)}, "
                              f"{len(self.patches)} patches, {n} examples.")

    def _aggregate(self, values: Tensor) -> Tensor:
        if self.metric == "nll":
            return torch.exp(values.double().mean(dim=-1))
        return values.double().mean(dim=-1)

    @property
    def target_value(self) -> float:
        """The unpatched target's aggregate (perplexity for NLL)."""
        return float(self._aggregate(self.target))

    @property
    def source_value(self) -> float:
        return float(self._aggregate(self.source))

    def aggregate(self) -> Float[Tensor, " n_patches"]:
        """Each patch's aggregate: perplexity for NLL, mean logit difference otherwise."""
        return self._aggregate(self.values)

    def recovery(self) -> Float[Tensor, " n_patches"]:
        """``(target - patched) / (target - source)`` on the aggregate (NaN when source == target)."""
        gap = self.target_value - self.source_value
        if gap == 0:
            return torch.full((len(self.patches),), math.nan, dtype=torch.float64)
        return (self.target_value - self.aggregate()) / gap

    def table(self) -> pd.DataFrame:
        """One row per patch: component, layers, value, target, source, recovery (fraction)."""
        unit = "perplexity" if self.metric == "nll" else "logit_diff"
        return pd.DataFrame({
            "patch": [p.label for p in self.patches],
            "component": [p.component for p in self.patches],
            "name": [PAPER_NAMES.get(p.component, p.component) for p in self.patches],
            "layers": [span(p.layers) for p in self.patches],
            "positions": [span(p.positions) if p.positions is not None else "all" for p in self.patches],
            "heads": [span(p.heads) if p.heads is not None else "all" for p in self.patches],
            unit: self.aggregate().numpy(),
            f"target_{unit}": self.target_value,
            f"source_{unit}": self.source_value,
            "recovery": self.recovery().numpy(),
        })

    def to_frame(self) -> pd.DataFrame:
        """Long table: ``patch``, ``example``, ``value``, ``target``, ``source``."""
        n_patches, n = self.values.shape
        return pd.DataFrame({
            "patch": [p.label for p in self.patches for _ in range(n)],
            "example": self.ids * n_patches,
            "value": self.values.double().flatten().numpy(),
            "target": self.target.double().repeat(n_patches).numpy(),
            "source": self.source.double().repeat(n_patches).numpy(),
        })

    def figure(self) -> Any:
        """Recovery by layer (single-layer sweeps), a layer x position heatmap, or bars."""
        if any(p.positions is not None for p in self.patches):
            return _position_heatmap(self)
        if all(len(p.layers) == 1 and p.heads is None for p in self.patches):
            return _sweep_figure(self)
        return _bar_figure(self)

    def save(self, folder: str | Path, name: str = "patching") -> Path:
        """``{name}.csv`` (table), ``{name}_examples.csv`` (per example) and ``{name}.json`` (settings)."""
        from interp.io import ensure_writable_dir, write_json

        out = ensure_writable_dir(folder)
        self.table().to_csv(out / f"{name}.csv", index=False)
        self.to_frame().to_csv(out / f"{name}_examples.csv", index=False)
        write_json(out / f"{name}.json", {"metric": self.metric, "settings": self.settings,
                                           "target": self.target_value, "source": self.source_value})
        return out


def _clip_recovery_axis(fig: Any, recovery: Any) -> None:
    """Keep -100%..+110% readable when one patch moves far away from the source (hover shows the value)."""
    low, high = float(np.nanmin(recovery)) * 100, float(np.nanmax(recovery)) * 100
    if low < -100 or high > 200:
        fig.update_yaxes(range=[max(low, -100) - 10, min(max(high, 110), 200) + 10])
        fig.update_layout(title=f"{fig.layout.title.text} (axis clipped; see hover for values)")


def _sweep_figure(result: PatchResult) -> Any:
    import plotly.graph_objects as go

    table = result.table()
    fig = go.Figure()
    for component, rows in table.groupby("component", sort=False):
        fig.add_trace(go.Scatter(x=rows["layers"].astype(int), y=100 * rows["recovery"], mode="lines+markers",
                                 name=PAPER_NAMES.get(component, component)))
    fig.update_layout(title="Patching one layer at a time: recovery of the gap", xaxis_title="layer",
                      yaxis_title="recovery (%)", template="plotly_white")
    _clip_recovery_axis(fig, table["recovery"])
    return fig


def _bar_figure(result: PatchResult) -> Any:
    import plotly.graph_objects as go

    table = result.table()
    labels = [f"{n} ({layers})" for n, layers in zip(table["name"], table["layers"], strict=True)]
    fig = go.Figure(go.Bar(x=labels, y=100 * table["recovery"], text=[f"{100 * r:.0f}%" for r in table["recovery"]]))
    fig.update_layout(title="Patching: recovery of the gap", yaxis_title="recovery (%)", template="plotly_white")
    _clip_recovery_axis(fig, table["recovery"])
    return fig


def _position_heatmap(result: PatchResult) -> Any:
    import plotly.graph_objects as go

    table = result.table()
    grid = table.pivot_table(index="layers", columns="positions", values="recovery", sort=False, dropna=False)
    fig = go.Figure(go.Heatmap(z=grid.to_numpy(), x=list(grid.columns), y=list(grid.index),
                               colorscale="RdBu", zmid=0, colorbar={"title": "recovery"}))
    fig.update_layout(title=f"Patching {', '.join(table['component'].unique())} by layer and position",
                      xaxis_title="position", yaxis_title="layer", template="plotly_white")
    return fig


# ---------------------------------------------------------------------------------------
# The engine


def _checked_patches(model: Any, patches: Sequence[Patch], seq_len: int) -> list[Patch]:
    patches = list(patches)
    if not patches:
        raise InterpError("No patches given: build them with single_layer_patches / joint_patches.")
    n_heads = int(model.cfg.n_heads)
    for p in patches:
        for layer in p.layers:
            hk.hook_point(model, p.component, layer)  # raises a ComponentError naming the problem
        if p.positions is not None and any(not 0 <= q < seq_len for q in p.positions):
            raise ComponentError(f"Patch {p.label}: positions must lie in 0..{seq_len - 1}.")
        if p.heads is not None and any(not 0 <= h < n_heads for h in p.heads):
            raise ComponentError(f"Patch {p.label}: heads must lie in 0..{n_heads - 1}.")
    return [Patch(p.component, tuple(hk.check_layers(model, p.layers)), p.positions, p.heads) for p in patches]


def _check_pair(target: Any, source: Any, examples: Examples, source_examples: Examples) -> None:
    if hk.n_layers(target) != hk.n_layers(source) or target.cfg.d_model != source.cfg.d_model:
        raise ComponentError("Patching needs two models with the same architecture (layers and widths).")
    if source_examples.tokens.shape != examples.tokens.shape:
        raise DataError(f"Source and target token rows must have the same shape; got "
                        f"{tuple(source_examples.tokens.shape)} and {tuple(examples.tokens.shape)}.")
    check_examples(target, examples)
    check_examples(source, source_examples)
    refuse_padding(examples, "Activation patching")
    refuse_padding(source_examples, "Activation patching")


def _source_keys(patches: Sequence[Patch]) -> list[Key]:
    return list(dict.fromkeys((p.component, layer) for p in patches for layer in p.layers))


def _settings(target: Any, source: Any, examples: Examples, batch_size: int, **extra: Any) -> dict[str, Any]:
    def name(model: Any) -> str:
        return str(getattr(getattr(model, "info", None), "name", "model"))

    return {"target": name(target), "source": name(source), "batch_size": batch_size,
            "examples": dict(examples.settings), **extra}


@dataclass
class _Batch:
    """One batch of examples with everything the patched runs need."""

    tokens: Tokens
    index: Tensor
    source_cache: dict[Key, Tensor]
    target_cache: dict[Key, Tensor]


class _Engine:
    def __init__(self, target: Any, source: Any, patches: list[Patch], metric: Metric, fast: bool) -> None:
        self.target, self.source, self.patches, self.metric = target, source, patches, metric
        self.readout_target, self.readout_source = Readout(target), Readout(source)
        self.runner = DecoderRunner.for_model(target) if fast else None
        self.verified = self.runner is None
        self.order = sorted(range(len(patches)), key=lambda j: patches[j].start)

    def prepare(self, tokens: Tokens, source_tokens: Tokens, index: Tensor) -> tuple[_Batch, PerRow, PerRow]:
        source_cache, source_final = _capture(self.source, source_tokens, _source_keys(self.patches))
        keys: list[Key] = []
        if self.runner is not None:
            keys = [("resid_pre", layer) for layer in sorted({p.start for p in self.patches})]
            if not self.verified:
                keys += [(c, layer) for layer in self.runner.check_layers() for c in ("resid_pre", "resid_post")]
        target_cache, target_final = _capture(self.target, tokens, keys)
        if not self.verified:
            if not self.runner.verify(target_cache):  # type: ignore[union-attr]
                warnings.warn("interp.patching: running decoder layers from a cached residual did not reproduce "
                              "the model's forward; falling back to full forwards (same results, slower).",
                              stacklevel=3)
                self.runner = None
            self.verified = True
        source_value = self.metric.from_resid(self.readout_source, source_final, source_tokens, index)
        target_value = self.metric.from_resid(self.readout_target, target_final, tokens, index)
        return _Batch(tokens, index, source_cache, target_cache), target_value, source_value

    def run_window(self, batch: _Batch, window: list[int]) -> Float[Tensor, "jobs batch"]:
        jobs = [self.patches[j] for j in window]
        b = batch.tokens.shape[0]
        final = self._staggered(batch, jobs) if self.runner is not None else self._full(batch, jobs)
        tokens = batch.tokens.repeat(len(jobs), 1)
        values = self.metric.from_resid(self.readout_target, final, tokens, batch.index.repeat(len(jobs)))
        return values.view(len(jobs), b)

    def _staggered(self, batch: _Batch, jobs: list[Patch]) -> Resid:
        """Jobs (sorted by start layer) join the stacked forward at their first patched layer."""
        runner = self.runner
        assert runner is not None
        hidden: Tensor | None = None
        joined = 0
        # layers with no patch run bridge-free (about 10% faster, identical output) unless the
        # caller has hooks of their own on the target, which must keep firing
        native = not hk.hooks_active(self.target)
        for layer in range(jobs[0].start, len(runner.blocks)):
            new = 0
            while joined + new < len(jobs) and jobs[joined + new].start == layer:
                new += 1
            if new:
                fresh = batch.target_cache[("resid_pre", layer)].repeat(new, 1, 1)
                hidden = fresh if hidden is None else torch.cat([hidden, fresh])
                joined += new
            fwd = _patch_hooks(self.target, jobs[:joined], batch.source_cache, batch.tokens.shape[0], layer)
            assert hidden is not None
            if fwd:
                with self.target.hooks(fwd_hooks=fwd):
                    hidden = runner.block(layer, hidden)
            else:
                hidden = runner.block(layer, hidden, native=native)
        assert hidden is not None
        return hidden

    def _full(self, batch: _Batch, jobs: list[Patch]) -> Resid:
        """Fallback: all jobs stacked in one full forward from the tokens."""
        fwd = _patch_hooks(self.target, jobs, batch.source_cache, batch.tokens.shape[0])
        final: dict[str, Tensor] = {}

        def keep(x: Tensor, hook: Any) -> None:
            final["resid"] = x

        last = hk.hook_point(self.target, "resid_post", hk.n_layers(self.target) - 1)
        with self.target.hooks(fwd_hooks=[*fwd, (last, keep)]):
            hk.decoder_body(self.target)(input_ids=batch.tokens.repeat(len(jobs), 1))
        return final["resid"]


def patch(
    target: Any,
    source: Any,
    examples: Examples,
    patches: Sequence[Patch],
    *,
    source_examples: Examples | None = None,
    metric: Metric | str | None = None,
    batch_size: int = 8,
    max_rows: int = 64,
    progress: bool | None = None,
    fast: bool = True,
) -> PatchResult:
    """The patching engine: run ``target`` on ``examples`` with each patch from ``source``.

    Args:
        target: the model whose run is patched (e.g. the quantized model, or the model on
            corrupted prompts).
        source: the model the activations come from (e.g. the reference; may be ``target``).
        examples: the target's token rows.
        patches: the jobs (see :func:`single_layer_patches`, :func:`joint_patches`,
            :func:`position_patches`).
        source_examples: the source's token rows (same shape); default ``examples``.
        metric: ``"nll"`` (default) or a :class:`LogitDiffMetric`.
        batch_size: examples per batch.
        max_rows: the most rows (examples x stacked jobs) in one forward; sets peak memory.
        progress: show a progress bar.
        fast: reuse the target's unpatched prefix (default); ``False`` runs full forwards
            (the results are the same).

    Returns:
        A :class:`PatchResult`.
    """
    source_examples = source_examples if source_examples is not None else examples
    _check_pair(target, source, examples, source_examples)
    engine = _Engine(target, source, _checked_patches(target, patches, examples.seq_len), _metric(metric), fast)
    n = len(examples)
    values = torch.empty(len(engine.patches), n, dtype=torch.float64)
    target_values, source_values = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
    device = _device(target)
    jobs_per_window = max(1, max_rows // max(1, min(batch_size, n)))
    windows = [engine.order[i : i + jobs_per_window] for i in range(0, len(engine.order), jobs_per_window)]
    bar = tqdm(total=len(windows) * len(list(batches(n, batch_size))), desc="patch", unit="run",
               disable=not show_progress(progress))
    with torch.no_grad():
        for start, end in batches(n, batch_size):
            index = torch.arange(start, end)
            batch, target_values[start:end], source_values[start:end] = engine.prepare(
                examples.tokens[start:end].to(device), source_examples.tokens[start:end].to(device), index)
            for window in windows:
                values[window, start:end] = engine.run_window(batch, window).cpu()
                bar.update(1)
    bar.close()
    return _result(values, target_values, source_values, engine.patches, examples, engine.metric,
                   _settings(target, source, examples, batch_size, max_rows=max_rows, fast=engine.runner is not None))


def _result(values: Tensor, target: Tensor, source: Tensor, patches: list[Patch], examples: Examples, metric: Metric,
            settings: dict[str, Any]) -> PatchResult:
    for name, tensor in (("patched", values), ("target", target), ("source", source)):
        if not torch.isfinite(tensor).all():
            raise NonFiniteError(f"Patching produced NaN/inf {name} values: check both models' weights.")
    return PatchResult(values=values, target=target, source=source, patches=patches, ids=list(examples.ids),
                       metric=metric.name, settings=settings)


def patch_naive(
    target: Any,
    source: Any,
    examples: Examples,
    patches: Sequence[Patch],
    *,
    source_examples: Examples | None = None,
    metric: Metric | str | None = None,
    batch_size: int = 8,
    progress: bool | None = None,
) -> PatchResult:
    """The textbook loop, one full forward (with full logits) per patch, as transformer-lens'
    ``patching.py`` does. Same arguments and results as :func:`patch`; kept as the reference
    implementation for tests and benchmarks.
    """
    source_examples = source_examples if source_examples is not None else examples
    _check_pair(target, source, examples, source_examples)
    patches = _checked_patches(target, patches, examples.seq_len)
    metric_ = _metric(metric)
    n = len(examples)
    values = torch.empty(len(patches), n, dtype=torch.float64)
    target_values, source_values = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
    device = _device(target)
    bar = tqdm(total=len(patches) * len(list(batches(n, batch_size))), desc="patch (naive)", unit="run",
               disable=not show_progress(progress))
    with torch.no_grad():
        for start, end in batches(n, batch_size):
            tokens, source_tokens = examples.tokens[start:end].to(device), source_examples.tokens[start:end].to(device)
            index = torch.arange(start, end)
            cache, _ = _capture(source, source_tokens, _source_keys(patches))
            source_values[start:end] = metric_.from_logits(model_logits(source, source_tokens), source_tokens, index)
            target_values[start:end] = metric_.from_logits(model_logits(target, tokens), tokens, index)
            for j, job in enumerate(patches):
                with target.hooks(fwd_hooks=_patch_hooks(target, [job], cache, end - start)):
                    values[j, start:end] = metric_.from_logits(model_logits(target, tokens), tokens, index)
                bar.update(1)
    bar.close()
    return _result(values, target_values, source_values, patches, examples, metric_,
                   _settings(target, source, examples, batch_size, naive=True))


# ---------------------------------------------------------------------------------------
# Front ends and thin specialisations


def cross_model(target: Any, source: Any, examples: Examples, patches: Sequence[Patch], **engine: Any) -> PatchResult:
    """Run ``target`` (e.g. quantized) on ``examples`` with components from ``source`` (e.g.
    the reference) on the same tokens. Keyword arguments go to :func:`patch`."""
    return patch(target, source, examples, patches, **engine)


def patch_component(
    target: Any,
    source: Any,
    examples: Examples,
    layers: LayerSelection = None,
    *,
    component: str,
    joint: bool = False,
    heads: Sequence[int] | None = None,
    **engine: Any,
) -> PatchResult:
    """Patch one component, per layer (default) or at all ``layers`` at once (``joint=True``)."""
    chosen = resolve_layers(target, layers)
    if joint:
        jobs = joint_patches([component], chosen, heads)
    else:
        jobs = single_layer_patches([component], chosen, heads=heads)
    return patch(target, source, examples, jobs, **engine)


patch_attn_out = partial(patch_component, component="attn_out")
patch_attn_out.__doc__ = "Patch the attention output (what attention adds to the residual), ``[batch, pos, d_model]``."
patch_heads = partial(patch_component, component="head")
patch_heads.__doc__ = "Patch per-head attention mixes ``z`` (all, or ``heads=[...]``), ``[batch, pos, head, d_head]``."
patch_gate = partial(patch_component, component="gate")
patch_gate.__doc__ = "Patch the gate pre-activation ``W_gate h`` (= patching ``act(gate)``), ``[batch, pos, d_mlp]``."
patch_up = partial(patch_component, component="up")
patch_up.__doc__ = "Patch the up projection ``W_up h``, ``[batch, pos, d_mlp]``."
patch_down = partial(patch_component, component="down")
patch_down.__doc__ = "Patch the MLP output (after the down projection), ``[batch, pos, d_model]``."
patch_gate_input = partial(patch_component, component="gate_input")
patch_gate_input.__doc__ = ("Feed the source's gate-projection input through the target's gate weight "
                            "(the up projection keeps the target's input), ``[batch, pos, d_model]``.")
patch_resid_pre = partial(patch_component, component="resid_pre")
patch_resid_pre.__doc__ = "Patch the residual stream entering each block, ``[batch, pos, d_model]``."


def clean_corrupt(
    model: Any,
    clean: Tokens,
    corrupt: Tokens,
    answers: Sequence[int] | Tensor | int,
    wrongs: Sequence[int] | Tensor | int,
    component: str = "resid_pre",
    layers: LayerSelection = None,
    positions: Literal["each", "all"] | Sequence[int] = "each",
    heads: Sequence[int] | None = None,
    position: int = -1,
    **engine: Any,
) -> PatchResult:
    """Classic activation patching: run the corrupted prompts, patch in the clean activations.

    Args:
        model: the model (source and target).
        clean, corrupt: ``[N, T]`` token rows of the same shape.
        answers, wrongs: the right and wrong answer token per row (or one for all rows).
        component: what to patch.
        layers: layer selection (default: all).
        positions: ``"each"`` (one patch per layer and position: a heatmap), ``"all"``, or a
            list of positions patched together.
        heads: for ``head``, the heads to patch.
        position: where the logit difference is read (default: the last position).

    Returns:
        A :class:`PatchResult` with ``metric="logit_diff"``; ``recovery()`` is the usual
        normalised logit difference ``(ld_patched - ld_corrupt) / (ld_clean - ld_corrupt)``.
    """
    if clean.shape != corrupt.shape:
        raise DataError(f"Clean and corrupted prompts must have the same shape; got {tuple(clean.shape)} "
                        f"and {tuple(corrupt.shape)}.")
    chosen = resolve_layers(model, layers)
    if isinstance(positions, str) and positions == "each":
        jobs = position_patches(component, chosen, range(corrupt.shape[1]))
    else:
        pos = None if isinstance(positions, str) else list(positions)
        jobs = single_layer_patches([component], chosen, positions=pos, heads=heads)
    metric = LogitDiffMetric(answers, wrongs, position)
    return patch(model, model, Examples.from_tokens(corrupt), jobs, source_examples=Examples.from_tokens(clean),
                 metric=metric, **engine)


# ---------------------------------------------------------------------------------------
# Attribution patching


@dataclass(frozen=True)
class AttributionResult(ResultDisplay):
    """First-order estimates of each (component, layer) patch's effect on the metric.

    Attributes:
        estimates: ``[n_points, N]`` estimated ``metric(patched) - metric(target)`` per example.
        points: ``(component, layer)`` of each row.
        ids, metric, settings: as in :class:`PatchResult`.
    """

    estimates: Float[Tensor, "n_points n_examples"]
    points: list[Key]
    ids: list[str]
    metric: str = "nll"
    settings: dict[str, Any] = field(default_factory=dict)

    def table(self) -> pd.DataFrame:
        return pd.DataFrame({"component": [c for c, _ in self.points], "layer": [layer for _, layer in self.points],
                             "estimate": self.estimates.double().mean(dim=1).numpy()})

    def figure(self) -> Any:
        import plotly.graph_objects as go

        fig = go.Figure()
        for component, rows in self.table().groupby("component", sort=False):
            fig.add_trace(go.Scatter(x=rows["layer"], y=rows["estimate"], mode="lines+markers",
                                     name=PAPER_NAMES.get(component, component)))
        fig.update_layout(title="Attribution patching: first-order effect of each patch", xaxis_title="layer",
                          yaxis_title=f"estimated change in mean {self.metric}", template="plotly_white")
        return fig


def attribution(
    target: Any,
    source: Any,
    examples: Examples,
    components: Sequence[str] = PAPER_COMPONENTS,
    layers: LayerSelection = None,
    *,
    source_examples: Examples | None = None,
    metric: Metric | str | None = None,
    batch_size: int = 4,
    progress: bool | None = None,
) -> AttributionResult:
    """Estimate every (component, layer) patch at once: ``(source - target) . dMetric/dact``.

    One forward and one backward pass of the target per batch (plus a source forward), against
    one forward per patch for exact patching. The gradient at each hook point counts only the
    paths through that point (``gate_input`` reaches the metric through the gate projection
    only), so each estimate is the linearisation of the corresponding exact patch.
    """
    source_examples = source_examples if source_examples is not None else examples
    _check_pair(target, source, examples, source_examples)
    chosen = resolve_layers(target, layers)
    points = [(c, layer) for c in components for layer in chosen]
    for c, layer in points:
        if c == "head":
            raise ComponentError("attribution() covers whole components; patch heads exactly with patch_heads().")
        hk.hook_point(target, c, layer)
    metric_ = _metric(metric)
    readout = Readout(target)
    estimates = torch.empty(len(points), len(examples), dtype=torch.float64)
    device = _device(target)
    for start, end in tqdm(list(batches(len(examples), batch_size)), desc="attribution", unit="batch",
                           disable=not show_progress(progress)):
        index = torch.arange(start, end)
        with torch.no_grad():
            source_cache, _ = _capture(source, source_examples.tokens[start:end].to(device), points)
        estimates[:, start:end] = _attribute_batch(target, readout, metric_, examples.tokens[start:end].to(device),
                                                   index, points, source_cache)
    return AttributionResult(estimates=estimates, points=points, ids=list(examples.ids), metric=metric_.name,
                             settings=_settings(target, source, examples, batch_size))


def _attribute_batch(target: Any, readout: Readout, metric: Metric, tokens: Tokens, index: Tensor,
                     points: list[Key], source_cache: Mapping[Key, Tensor]) -> Float[Tensor, "n_points batch"]:
    acts: dict[Key, Tensor] = {}
    last = ("resid_post", hk.n_layers(target) - 1)

    def start_graph(x: Tensor, hook: Any) -> Tensor:
        return x.detach().requires_grad_(True)

    def keep(key: Key) -> Callable[[Tensor, Any], Tensor]:
        def fn(x: Tensor, hook: Any) -> Tensor:
            y = x.view_as(x)  # a fresh node: its gradient counts only the uses of this hook's output
            acts[key] = y
            return y
        return fn

    fwd: list[tuple[str, Callable[[Tensor, Any], Tensor]]] = [(hk.hook_point(target, "resid_pre", 0), start_graph)]
    fwd += [(hk.hook_point(target, c, layer), keep((c, layer))) for c, layer in dict.fromkeys([*points, last])]
    with torch.enable_grad(), target.hooks(fwd_hooks=fwd):
        hk.decoder_body(target)(input_ids=tokens)
        values = metric.from_resid(readout, acts[last], tokens, index)
        grads = torch.autograd.grad(values.sum(), [acts[p] for p in points], allow_unused=True)
    out = torch.zeros(len(points), tokens.shape[0], dtype=torch.float64)
    for i, (point, grad) in enumerate(zip(points, grads, strict=True)):
        if grad is not None:
            delta = source_cache[point] - acts[point].detach()
            out[i] = (delta * grad).flatten(start_dim=1).sum(dim=1).double().cpu()
    return out


def rank_agreement(estimated: AttributionResult, exact: PatchResult) -> float:
    """Spearman correlation between attribution estimates and exact single-layer patching effects.

    Compares the mean over examples of ``metric(patched) - metric(target)`` for every
    (component, layer) both results cover.
    """
    from scipy.stats import spearmanr

    exact_delta = (exact.values - exact.target).double().mean(dim=1)
    lookup = {(p.component, p.layers[0]): float(d) for p, d in zip(exact.patches, exact_delta, strict=True)
              if len(p.layers) == 1 and p.positions is None and p.heads is None}
    est = estimated.table()
    pairs = [(float(e), lookup[(c, int(layer))]) for c, layer, e in est[["component", "layer", "estimate"]].values
             if (c, int(layer)) in lookup]
    if len(pairs) < 3:
        raise InterpError("rank_agreement needs at least 3 (component, layer) points present in both results.")
    return float(spearmanr([a for a, _ in pairs], [b for _, b in pairs]).statistic)


# ---------------------------------------------------------------------------------------
# The reference paper's experiments (reference vs quantized)


def patching_table(
    reference: Any,
    quantized: Any,
    d_large: Examples,
    layers: LayerSelection = "upper_half",
    components: Sequence[str] = PAPER_COMPONENTS,
    **engine: Any,
) -> PatchResult:
    """Patch each component of the reference into the quantized model at ``layers`` (all at once).

    The paper's Table 4: run the quantized model on D_large and overwrite one component, in
    the upper half of the layers and at every position, with the reference model's
    activation. ``result.table()`` lists each component's perplexity and recovery.
    """
    return patch(quantized, reference, d_large, joint_patches(components, resolve_layers(quantized, layers)), **engine)


def layer_sweep(
    reference: Any,
    quantized: Any,
    examples: Examples,
    components: Sequence[str] = PAPER_COMPONENTS,
    layers: LayerSelection = None,
    **engine: Any,
) -> PatchResult:
    """Patch each component of the reference into the quantized model one layer at a time."""
    jobs = single_layer_patches(components, resolve_layers(quantized, layers))
    return patch(quantized, reference, examples, jobs, **engine)


@dataclass(frozen=True)
class GateInputComparison(ResultDisplay):
    """Gate-input-only patching against restoring the gate weights, on the same layers.

    Attributes:
        patched: the ``gate_input`` patch (reference input, quantized gate weight).
        restored_nll: ``[N]`` NLL of the quantized model with the gate weights restored.
        layers: the layers both act on.
    """

    patched: PatchResult
    restored_nll: PerExample
    layers: list[int]

    def table(self) -> pd.DataFrame:
        p = self.patched
        quantized, reference = p.target_value, p.source_value
        rows = {
            "reference": reference,
            "quantized": quantized,
            "gate input patched (quantized gate weight)": float(p.aggregate()[0]),
            "gate weights restored (quantized input)": math.exp(float(self.restored_nll.double().mean())),
        }
        frame = pd.DataFrame({"setting": list(rows), "perplexity": list(rows.values())})
        frame["recovery"] = (quantized - frame["perplexity"]) / (quantized - reference)
        frame["layers"] = span(self.layers)
        return frame

    def figure(self) -> Any:
        import plotly.graph_objects as go

        table = self.table()
        fig = go.Figure(go.Bar(x=table["setting"], y=table["perplexity"],
                               text=[f"{v:.2f}" for v in table["perplexity"]]))
        fig.update_layout(title=f"Gate input vs gate weights (layers {span(self.layers)})",
                          yaxis_title="perplexity", template="plotly_white")
        return fig


def gate_input_vs_gate_weights(
    reference: Any,
    quantized: Any,
    d_large: Examples,
    layers: LayerSelection = "upper_half",
    batch_size: int = 8,
    **engine: Any,
) -> GateInputComparison:
    """Is the gate hurt by its input or by its weights? (the paper: 6.53 vs 10.45 perplexity)

    Compares (a) feeding the reference's gate input through the quantized gate weights with
    (b) restoring the gate weights to the reference's while the input stays quantized, both
    on ``layers`` of the quantized model.
    """
    from interp.lens import restore_layers
    from interp.scoring import nll

    chosen = resolve_layers(quantized, layers)
    patched = patch(quantized, reference, d_large, joint_patches(["gate_input"], chosen), batch_size=batch_size,
                    **engine)
    restored = restore_layers(quantized, reference, chosen, roles=["gate"])
    restored_nll = nll(restored, d_large, batch_size=batch_size).double()
    del restored
    return GateInputComparison(patched=patched, restored_nll=restored_nll, layers=chosen)


# ---------------------------------------------------------------------------------------
# Used by interp.lens.restoration_sweep: blocks swapped in, prefix reused


def restored_nll(
    quantized: Any,
    reference: Any,
    examples: Examples,
    restored: Sequence[Sequence[int]],
    batch_size: int = 8,
    progress: bool | None = None,
) -> tuple[Float[Tensor, "n_sets n_examples"], PerExample]:
    """NLL of ``quantized`` with the reference's blocks in place at each set of layers.

    The quantized model's residual entering the lowest restored block is computed once per
    batch; only the blocks above it run for each set. Returns ``(nll [n_sets, N], reference_nll [N])``.
    """
    from interp.lens import restore_layers
    from interp.scoring import nll

    check_context(quantized, examples.tokens)
    runner = DecoderRunner.for_model(quantized)
    if runner is None:
        per_set = [nll(restore_layers(quantized, reference, s), examples, batch_size) if s else
                   nll(quantized, examples, batch_size) for s in restored]
        return torch.stack(per_set).double(), nll(reference, examples, batch_size).double()
    readout, reference_readout = Readout(quantized), Readout(reference)
    q_blocks, r_blocks = hk.blocks(quantized), hk.blocks(reference)
    starts = sorted({min(s) for s in restored if s})
    out = torch.empty(len(restored), len(examples), dtype=torch.float64)
    reference_out = torch.empty(len(examples), dtype=torch.float64)
    device = _device(quantized)
    bar = tqdm(total=len(examples), desc="restoration", unit="ex", disable=not show_progress(progress))
    with torch.no_grad():
        for start, end in batches(len(examples), batch_size):
            tokens = examples.tokens[start:end].to(device)
            checks = [(c, layer) for layer in runner.check_layers() for c in ("resid_pre", "resid_post")]
            keys = [("resid_pre", s) for s in starts] + (checks if start == 0 else [])
            cache, final = _capture(quantized, tokens, keys)
            if start == 0 and not runner.verify(cache):
                raise InterpError("Running decoder layers from a cached residual did not reproduce this model's "
                                  "forward; use restore_layers() and interp.nll() instead.")
            _, reference_final = _capture(reference, tokens, [])
            reference_out[start:end] = reference_readout.mean_nll(reference_final, tokens).cpu()
            for i, layers in enumerate(restored):
                if layers:
                    chosen = set(layers)
                    modules = [r_blocks[j] if j in chosen else q_blocks[j] for j in range(len(q_blocks))]
                    final_i = runner.run(cache[("resid_pre", min(chosen))], min(chosen), modules)
                else:
                    final_i = final
                out[i, start:end] = readout.mean_nll(final_i, tokens).cpu()
            bar.update(end - start)
    bar.close()
    return out, reference_out
