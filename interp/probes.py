"""Probes: run a model over examples and reduce named activations as they stream past.

A probe registers one forward hook per (component, layer). Each hook reduces the batch's
activation to a few numbers per example *inside the hook* (an L2 norm averaged over
positions, a kurtosis, the attention entropy per head, ...) and writes them into a
preallocated ``[n_layers, N, ...]`` table. The activation itself is dropped straight away,
so peak memory is set by the batch size, not by the number of examples. Only the ``full``
reducer keeps tensors, and only when asked.

Reading a result:

- ``result["resid_mid", "norm"]`` is a ``[n_layers, N]`` tensor;
- attention reducers (``entropy``, ``gtd``, ...) are per head: ``[n_layers, N, n_heads]``;
- ``result.layer_mean("resid_mid", "norm")`` averages over examples (and heads);
- ``result.to_frame()`` is a long DataFrame (``example``, ``layer``, ``component``,
  ``reducer``, ``head``, ``value``), and ``result.save(folder)`` writes safetensors + JSON
  + parquet.

Example:
    >>> import interp
    >>> model = interp.tiny_model("llama")
    >>> ex = interp.Examples.from_tokens(__import__("torch").randint(0, 256, (4, 16)))
    >>> res = interp.probe(model, ex, ["resid_mid"], ["norm"], progress=False)
    >>> tuple(res["resid_mid", "norm"].shape)
    (2, 4)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from interp import validate

# The one import that runs up the layers: the attention reducers are the attention package's metric
# table, so that adding a metric there adds its probe reducer too (allowed in setup.cfg's contract).
from interp.attention.metrics import METRICS as ATTENTION_METRICS
from interp.attention.metrics import AttentionMetric
from interp.data import Examples, counted_positions, left_aligned
from interp.display import ResultDisplay
from interp.errors import ComponentError, DataError, InterpError, NonFiniteError
from interp.io import check_complete, read_safetensors, saving, write_json, write_parquet, write_safetensors
from interp.models import Model, model_name
from interp.results import CheckedResult
from interp.runtime import hooks as hk
from interp.runtime.batching import StopForward, batches, check_examples, check_memory, device_of, show_progress
from interp.runtime.scoring import token_nll
from interp.validate import checked, checked_class

# ---------------------------------------------------------------------------------------
# Reducers: activation [batch, pos, ...] -> per-example values [batch, ...]


def _positions(x: torch.Tensor, exclude_bos: bool) -> torch.Tensor:
    return x[:, 1:] if exclude_bos and x.shape[1] > 1 else x


def _position_mean(values: torch.Tensor, exclude_bos: bool, valid: torch.Tensor | None) -> torch.Tensor:
    """Mean of per-position ``values [B, T, ...]`` over positions: all but BOS, or the ``valid`` ones.

    ``valid [B, T]`` marks the positions that count in each row (padded examples, left-aligned:
    see :func:`counted_positions`); without it every row counts positions ``1..T-1``.
    """
    if valid is None:
        return _positions(values, exclude_bos).mean(dim=1)
    weights = valid.to(values.dtype).reshape(*valid.shape, *([1] * (values.ndim - 2)))
    return (values * weights).sum(dim=1) / weights.sum(dim=1)


def reduce_norm(x: torch.Tensor, exclude_bos: bool = True, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over positions of the L2 norm over the last dim: ``[B, T, D] -> [B]``."""
    if valid is None:
        return torch.linalg.vector_norm(_positions(x, exclude_bos), dim=-1).mean(dim=1)
    return _position_mean(torch.linalg.vector_norm(x, dim=-1), exclude_bos, valid)


def reduce_mean(x: torch.Tensor, exclude_bos: bool = True, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over positions and features: ``[B, T, D] -> [B]``."""
    if valid is None:
        return _positions(x, exclude_bos).mean(dim=(1, 2))
    return _position_mean(x.mean(dim=-1), exclude_bos, valid)


def reduce_kurtosis(x: torch.Tensor, exclude_bos: bool = True, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Kurtosis ``m4 / m2^2`` over features per position (3 for a Gaussian), mean over positions."""
    x = _positions(x, exclude_bos) if valid is None else x
    squared = (x - x.mean(dim=-1, keepdim=True)).square_()  # in place: one buffer, no pow
    m2 = squared.sum(dim=-1) / x.shape[-1]
    m4 = torch.linalg.vecdot(squared, squared) / x.shape[-1]  # sum of c^4 without a second buffer
    per_position = m4 / m2.clamp_min(torch.finfo(x.dtype).tiny).pow(2)
    return per_position.mean(dim=1) if valid is None else _position_mean(per_position, exclude_bos, valid)


def reduce_abs_mean_dims(x: torch.Tensor, exclude_bos: bool = True, valid: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """Mean |x| per feature over positions: ``[B, T, D] -> [B, D]`` (for outlier dimensions)."""
    return _position_mean(x.abs(), exclude_bos, valid)


def _attention_reducer(metric: AttentionMetric) -> Callable[[torch.Tensor, bool], torch.Tensor]:
    def reduce(pattern: torch.Tensor, exclude_bos: bool = True, valid: torch.Tensor | None = None) -> torch.Tensor:
        q = pattern.shape[-2]
        # the model's own softmax output, validated by construction: compute skips the value checks
        values = metric.compute(pattern)
        # query 0 sees only BOS: it carries no information about localization
        skip = exclude_bos or metric.skip_first_query
        if valid is None:
            start = 1 if skip and q > 1 else 0
            return values[..., start:].mean(dim=-1)  # [B, H]
        if skip and not exclude_bos:  # this metric always leaves query 0 out
            lone = valid.sum(dim=1, keepdim=True) <= 1
            valid = valid & ((torch.arange(q, device=valid.device) >= 1)[None, :] | lone)
        weights = valid.to(values.dtype)[:, None, :]  # [B, 1, Q]
        return (values * weights).sum(dim=-1) / weights.sum(dim=-1)

    reduce.__name__ = f"reduce_{metric.name}"
    reduce.__doc__ = f"Per-head {metric.label} averaged over query positions: ``[B, H, Q, K] -> [B, H]``."
    return reduce


def reduce_full(x: torch.Tensor, exclude_bos: bool = True, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the whole activation (memory grows with N: use only when needed)."""
    return x.detach().clone()


REDUCERS: dict[str, Callable[..., torch.Tensor]] = {
    "norm": reduce_norm,
    "mean": reduce_mean,
    "kurtosis": reduce_kurtosis,
    "abs_mean_dims": reduce_abs_mean_dims,
    **{name: _attention_reducer(metric) for name, metric in ATTENTION_METRICS.items()},
    "full": reduce_full,
}
ATTENTION_REDUCERS = frozenset(ATTENTION_METRICS)
VECTOR_REDUCERS = frozenset({"norm", "mean", "kurtosis", "abs_mean_dims"})


def _check_pair(component: str, reducer: str) -> None:
    if reducer not in REDUCERS:
        raise ComponentError(f"Unknown reducer {reducer!r}. Valid reducers: {', '.join(REDUCERS)}.")
    if reducer in ATTENTION_REDUCERS and component != "pattern":
        raise ComponentError(f"Reducer {reducer!r} applies to 'pattern' only, not {component!r}.")
    if component == "pattern" and reducer in VECTOR_REDUCERS:
        raise ComponentError(
            f"Reducer {reducer!r} applies to vector activations; for 'pattern' use one of "
            f"{', '.join(sorted(ATTENTION_REDUCERS))} or 'full'."
        )


# ---------------------------------------------------------------------------------------
# Result


SAVED_FILES = ("stats.safetensors", "probe.json", "probe.parquet")  # what ProbeResult.save writes


@checked_class
@dataclass(frozen=True)
class ProbeResult(CheckedResult, ResultDisplay):
    """Per-layer, per-example statistics from :func:`probe`.

    Attributes:
        stats: ``"component/reducer"`` -> tensor ``[n_layers, N, ...]``.
        layers: the model layers in the first axis.
        ids: example ids in the second axis.
        settings: model name, components, reducers, batch size, examples' settings.

    Example:
        >>> import torch
        >>> import interp
        >>> model = interp.tiny_model("llama")
        >>> ex = interp.Examples.from_tokens(torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(0)))
        >>> res = interp.probe(model, ex, ["resid_post"], ["norm"], progress=False)
        >>> res.layers, res.ids, tuple(res["resid_post", "norm"].shape)
        ([0, 1], ['row0', 'row1', 'row2'], (2, 3))
        >>> res.summary().columns.tolist()
        ['resid_post/norm']

    Made only finite: see :mod:`interp.results`.
    """

    # a ``full`` capture of padded prompts holds NaN at the pad positions, by design (see probe); every reduced
    # statistic is checked
    allow_nan = ("stats[*/full]",)

    stats: dict[str, torch.Tensor]
    layers: list[int]
    ids: list[str]
    settings: dict[str, Any] = field(default_factory=dict)
    nll: torch.Tensor | None = None  # [N] mean next-token NLL, when probed with with_nll=True

    def __post_init__(self) -> None:
        for key, value in self.stats.items():
            if value.shape[:2] != (len(self.layers), len(self.ids)):
                raise InterpError(f"ProbeResult stat {key} has shape {tuple(value.shape)}; expected "
                                  f"[{len(self.layers)}, {len(self.ids)}, ...].")
        super().__post_init__()  # finite (CheckedResult), after the shapes

    def __getitem__(self, key: tuple[str, str] | str) -> torch.Tensor:
        name = key if isinstance(key, str) else f"{key[0]}/{key[1]}"
        if name not in self.stats:
            raise ComponentError(f"No statistic {name!r} in this result; available: {', '.join(self.stats)}.")
        return self.stats[name]

    def layer_mean(self, component: str, reducer: str) -> torch.Tensor:
        """Mean over examples (and heads, for attention stats): ``[n_layers]``."""
        values = self[component, reducer]
        return values.float().flatten(start_dim=1).nanmean(dim=1)

    def to_frame(self) -> pd.DataFrame:
        """Long table of all scalar and per-head statistics (``full`` tensors are left out)."""
        frames = []
        for name, values in self.stats.items():
            component, reducer = name.split("/")
            if reducer in ("full", "abs_mean_dims"):
                continue
            n_layers, n_examples = values.shape[:2]
            flat = values.reshape(n_layers, n_examples, -1)
            n_heads = flat.shape[2]
            index = pd.MultiIndex.from_product(
                [self.layers, self.ids, range(n_heads)], names=["layer", "example", "head"]
            )
            frame = pd.DataFrame({"value": flat.flatten().double().numpy()}, index=index).reset_index()
            if values.ndim == 2:
                frame["head"] = -1
            frame["component"], frame["reducer"] = component, reducer
            frames.append(frame)
        columns = ["example", "layer", "component", "reducer", "head", "value"]
        return pd.concat(frames, ignore_index=True)[columns] if frames else pd.DataFrame(columns=columns)

    def summary(self) -> pd.DataFrame:
        """Layer x statistic table of means over examples (and heads)."""
        data = {name: self.layer_mean(*name.split("/")).numpy()
                for name in self.stats if not name.endswith(("/full", "/abs_mean_dims"))}
        return pd.DataFrame(data, index=pd.Index(self.layers, name="layer"))

    def save(self, folder: str | Path) -> Path:
        """Write ``stats.safetensors``, ``probe.json`` and ``probe.parquet`` into ``folder``."""

        with saving(folder, "probe-result", own=SAVED_FILES) as out:  # INCOMPLETE until the last file is in
            write_safetensors(out / "stats.safetensors",
                              {k.replace("/", "."): v.contiguous() for k, v in self.stats.items()})
            write_json(out / "probe.json", {"layers": self.layers, "ids": self.ids, "settings": self.settings})
            write_parquet(out / "probe.parquet", self.to_frame(), index=False)
        return out

    @classmethod
    def load(cls, folder: str | Path) -> "ProbeResult":
        """A result :meth:`save` wrote. ``probe.json`` is read bounded (a pipe or device is refused) and checked
        against its schema (:func:`interp.schema.conform`), the statistics against its layers and ids."""
        from interp.reading import read_json
        from interp.schema import conform

        folder = Path(folder)
        check_complete(folder, "saved probe result")  # a save killed part-way (INCOMPLETE) is refused
        record = read_json(folder / "probe.json", "a saved probe result's probe.json (ProbeResult.save writes one)")
        meta = conform(record, {"layers": "list[int]", "ids": "list[str]", "settings": "dict"},
                       f"{folder / 'probe.json'}")
        raw = read_safetensors(folder / "stats.safetensors", "probe statistics")
        stats = {k.replace(".", "/", 1): v for k, v in raw.items()}
        bad = sorted(k for k in stats if k.count("/") != 1)
        if bad:
            raise DataError(f"{folder / 'stats.safetensors'} holds {bad[:3]}, which are not component.reducer "
                            "statistics: it was not written by ProbeResult.save.")
        try:
            return cls(stats=stats, layers=meta["layers"], ids=meta["ids"], settings=meta["settings"])
        except InterpError as exc:
            raise DataError(f"{folder} is not a consistent saved probe result: {exc}") from None


# ---------------------------------------------------------------------------------------
# Running


def _full_bytes(model: Model, component: str, n_examples: int, seq_len: int, n_layers: int) -> int:
    """Bytes a float32 ``full`` capture takes: the component record's width (d_mlp for ``mlp_pre``...)."""
    return hk.capture_bytes(model, component, n_examples, seq_len, n_layers)


@checked
def probe(
    model: Model,
    examples: Examples,
    components: Sequence[str] = ("resid_mid", "resid_post", "h", "gate"),
    reducers: Sequence[str] = ("norm",),
    batch_size: int = 8,
    layers: Sequence[int] | None = None,
    exclude_bos: bool = True,
    progress: bool | None = None,
    memory_fraction: float = 0.5,
    extra_hooks: Sequence[tuple[str, Callable[..., Any]]] = (),
    with_nll: bool = False,
    native: bool | None = None,
) -> ProbeResult:
    """Run ``model`` over ``examples`` and reduce each (component, layer) as it streams past.

    Args:
        model: a bridge from :func:`interp.load_model`.
        examples: token rows from :func:`interp.load_examples`, or padded prompts from
            :func:`interp.examples_from_texts`: each row's real tokens are run first (the causal
            mask keeps them from seeing the padding), pad positions never enter a statistic,
            and ``full`` captures hold NaN there.
        components: semantic names (see :mod:`interp.runtime.hooks`).
        reducers: reducer names; each applies to every component it fits (vector reducers to
            vector activations, attention reducers to ``pattern``). ``full`` keeps tensors.
        batch_size: examples per forward; sets the peak memory.
        layers: layer indices (default: all).
        exclude_bos: leave position 0 out of position averages.
        progress: show a tqdm bar (default: when stderr is a terminal).
        memory_fraction: refuse ``full`` captures larger than this share of free memory.
        extra_hooks: ``(hook_name, fn)`` pairs run during the same forwards, before the
            measuring hooks (e.g. SAOBP's pattern hook, which then changes what the probe and
            later layers see).
        with_nll: also compute each example's mean next-token NLL from the same forwards
            (``result.nll``); the forward then always runs to the end.
        native: read the activations on the bridge-free Hugging Face tree
            (:func:`interp.runtime.hooks.native_model`; same numbers, ~20% faster) instead of the
            bridge's hook points. Default: whenever possible, i.e. no ``extra_hooks``, no
            hooks registered on ``model``, and a llama-style or Gemma-3 module layout.

    Returns:
        A :class:`ProbeResult`.

    Example:
        >>> import torch
        >>> import interp
        >>> model = interp.tiny_model("llama")
        >>> ex = interp.Examples.from_tokens(torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(0)))
        >>> res = interp.probe(model, ex, ["resid_post", "pattern"], ["norm", "entropy"], progress=False)
        >>> sorted(res.stats), tuple(res["pattern", "entropy"].shape)  # [n_layers, N, n_heads]
        (['pattern/entropy', 'resid_post/norm'], (2, 3, 4))
    """
    layer_list = validate.layer_indices(layers, hk.n_layers(model))
    batch_size = validate.batch_size(batch_size)
    components = validate.names(components, "components")
    reducers = validate.names(reducers, "reducers", valid=REDUCERS)
    pairs = _pairs(model, components, reducers, layer_list)
    n, seq_len = examples.tokens.shape
    check_examples(model, examples)
    full_bytes = sum(_full_bytes(model, c, n, seq_len, len(layer_list)) for c, r in pairs if r == "full")
    if full_bytes:
        check_memory(full_bytes, "Keeping full activations", memory_fraction)

    run = _ProbeRun(model, pairs, layer_list, exclude_bos, n)
    forward, context = run.attach(extra_hooks, native)
    bar = tqdm(total=n, desc="probe", unit="ex", disable=not show_progress(progress))
    nll_chunks: list[torch.Tensor] = []
    with torch.no_grad(), context:
        if not (extra_hooks or with_nll):  # else the forward must run to the end
            run.find_last_hook(forward, examples.tokens[:1, :2].to(device_of(model)))
        for start, end in batches(n, batch_size):
            run.ids, run.offset = examples.ids[start:end], start
            tokens = examples.tokens[start:end].to(device_of(model))
            lengths = None
            if examples.padded and examples.attention_mask is not None:  # real tokens first: under the
                run.mask = examples.attention_mask[start:end].to(tokens.device)  # causal mask they never see pads
                tokens, lengths = left_aligned(tokens, run.mask)
                run.lengths = lengths
            try:
                out = forward(input_ids=tokens)
                if with_nll:
                    per_token = token_nll(out.logits, tokens).double()
                    if lengths is None:
                        nll_chunks.append(per_token.mean(dim=1).float().cpu())
                    else:  # targets 1..length-1 of each row
                        targets = counted_positions(lengths, tokens.shape[1], skip_first=True)[:, 1:]
                        nll_chunks.append(((per_token * targets).sum(1) / targets.sum(1)).float().cpu())
            except StopForward:
                pass
            bar.update(end - start)
    bar.close()
    settings = {
        "model": model_name(model),
        "components": list(components), "reducers": list(reducers), "batch_size": batch_size,
        "exclude_bos": exclude_bos, "examples": dict(examples.settings),
    }
    return ProbeResult(stats={key: table.cpu() for key, table in run.stats.items()}, layers=layer_list,
                       ids=list(examples.ids), settings=settings,
                       nll=torch.cat(nll_chunks) if with_nll else None)


def _pairs(model: Model | None, components: Sequence[str], reducers: Sequence[str], layers: list[int]
           ) -> list[tuple[str, str]]:
    """The validated (component, reducer) pairs: each reducer applies to every component it fits."""
    pairs = []
    for component in components:
        for layer in layers:  # model None (the CLI's early check) comes with no layers
            assert model is not None
            hk.hook_point(model, component, layer)  # validates
        fitting = [r for r in reducers if r == "full" or (r in ATTENTION_REDUCERS) == (component == "pattern")]
        if not fitting:
            _check_pair(component, reducers[0])
        for reducer in fitting:
            _check_pair(component, reducer)
            pairs.append((component, reducer))
    if not pairs:
        raise ComponentError("Nothing to probe: give at least one component and reducer.")
    return pairs


class _ProbeRun:
    """The reducing consumers of one probe call, and how they are attached to the model."""

    def __init__(self, model: Model, pairs: list[tuple[str, str]], layers: list[int], exclude_bos: bool,
                 n_examples: int) -> None:
        self.model, self.exclude_bos = model, exclude_bos
        # [n_layers, N, ...] tables, allocated at the first value (its trailing shape) and
        # filled in place: no per-batch tensors pile up between the forward's big buffers
        self.stats: dict[str, torch.Tensor] = {}
        self.n_layers, self.n_examples, self.offset = len(layers), n_examples, 0
        self.ids: list[str] = []
        self.dry = False
        self.last: str | None = None
        self.mask: torch.Tensor | None = None  # padded batches: the rows' own attention mask
        self.lengths: torch.Tensor | None = None  # and their lengths, once left-aligned
        self.fired: list[str] = []
        self.consumers: list[tuple[str, int, str, Callable[[torch.Tensor], None]]] = []
        for li, layer in enumerate(layers):
            for component in dict.fromkeys(c for c, _ in pairs):
                wanted = [r for c, r in pairs if c == component]
                name = hk.hook_point(model, component, layer)
                self.consumers.append((component, layer, name, self._consumer(component, li, layer, wanted, name)))

    def _consumer(self, component: str, li: int, layer: int, wanted: list[str], name: str
                  ) -> Callable[[torch.Tensor], None]:
        read = hk.reader(self.model, component, layer)
        key_of_consumer = f"{component}@{layer}"
        keys = [(reducer, f"{component}/{reducer}") for reducer in wanted]

        def consume(x: torch.Tensor) -> None:
            if self.dry:
                self.fired.append(key_of_consumer)
                return
            x = read(x.detach())  # the record's transform: heads split, gate activation, per-head W_O
            wide = x if x.dtype == torch.float64 else x.float()  # statistics in float32, or float64 if the model is
            for reducer, key in keys:
                if self.lengths is None:
                    value = REDUCERS[reducer](wide if reducer != "full" else x, self.exclude_bos)
                elif reducer == "full":
                    value = self._unaligned(x)
                else:
                    skip = self.exclude_bos
                    valid = counted_positions(self.lengths, x.shape[-2] if component == "pattern" else x.shape[1],
                                              skip_first=skip)
                    value = REDUCERS[reducer](wide, self.exclude_bos, valid)
                if reducer != "full":
                    self._check_finite(value, component, layer)
                self._store(key, li, value)
            if key_of_consumer == self.last:  # not the hook name: two components may share one hook point
                raise StopForward

        return consume

    def _unaligned(self, x: torch.Tensor) -> torch.Tensor:
        """A ``full`` capture of left-aligned rows put back where each token sat in the padded
        batch; pad positions hold NaN, so no statistic can take them for data."""
        out = torch.full_like(x, math.nan) if x.is_floating_point() else torch.zeros_like(x)
        assert self.lengths is not None and self.mask is not None  # set for every padded batch
        for row, length in enumerate(self.lengths.tolist()):
            out[row, self.mask[row]] = x[row, :length]
        return out

    def _check_finite(self, value: torch.Tensor, component: str, layer: int) -> None:
        if torch.isfinite(value).all():
            return
        bad = torch.nonzero(~torch.isfinite(value.reshape(value.shape[0], -1)).all(dim=1)).flatten().tolist()
        raise NonFiniteError(
            f"NaN or inf in {component} at layer {layer} (examples {[self.ids[i] for i in bad][:3]}). Check the "
            "model's weights (e.g. a broken quantization) or use float32."
        )

    def attach(self, extra_hooks: Sequence[tuple[str, Callable[..., Any]]], native: bool | None
               ) -> tuple[Callable[..., Any], Any]:
        """``(forward, context)``: without hooks of the caller's own, the consumers sit on the
        bridge-free Hugging Face tree (same numbers, no wrapper dispatch, HF's own attention);
        otherwise, or for an unknown module layout, on the bridge's hook points."""
        model = self.model
        taps = None
        if native is not False and not extra_hooks and not hk.hooks_active(model):
            tree = hk.native_model(model)
            found = [hk.native_tap(model, tree, c, layer) for c, layer, _, _ in self.consumers]
            if all(t is not None for t in found):
                taps = [(tap, consume) for tap, (_, _, _, consume) in zip(found, self.consumers, strict=True)]
        if native and taps is None:
            raise InterpError("native=True needs no extra_hooks, no hooks registered on the model, and a "
                              "llama-style or Gemma-3 model; use native=None to fall back to the bridge.")
        if taps is not None:
            return tree, _native_hooks(taps)
        fwd_hooks = [*extra_hooks, *((name, _bridge_hook(consume)) for _, _, name, consume in self.consumers)]
        return model.original_model, model.hooks(fwd_hooks=fwd_hooks)

    def find_last_hook(self, forward: Callable[..., Any], tokens: torch.Tensor) -> None:
        """A two-token dry run records the order the consumers fire in (cheap, and
        architecture-agnostic); every real batch then stops right after the last one,
        skipping the remaining layers and the unembed."""
        self.dry, self.fired = True, []
        try:
            forward(input_ids=tokens)
        finally:
            self.dry = False
        self.last = self.fired[-1] if self.fired else None

    def _store(self, key: str, li: int, value: torch.Tensor) -> None:
        table = self.stats.get(key)
        if table is None:
            shape = (self.n_layers, self.n_examples, *value.shape[1:])
            # reduced statistics stay on the device of the values (no host copy per layer; to the host once, at
            # the end); full activations go to the host as they come, where check_memory has sized them
            device = torch.device("cpu") if key.endswith("/full") else value.device
            fill = math.nan if value.is_floating_point() else 0
            table = self.stats[key] = torch.full(shape, fill, dtype=value.dtype, device=device)
        table[li, self.offset : self.offset + value.shape[0]] = value


def _bridge_hook(consume: Callable[[torch.Tensor], None]) -> Callable[..., None]:
    def hook(x: torch.Tensor, hook: Any) -> None:
        consume(x)

    return hook


@contextmanager
def _native_hooks(taps: Sequence[tuple[Any, Callable[[torch.Tensor], None]]]) -> Iterator[None]:
    """Register ``consume`` on each ``(module, "in" | "out", index)`` tap; removed on exit."""
    handles = []

    def on_input(consume: Callable[[torch.Tensor], None]) -> Callable[..., None]:
        def pre(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            consume(args[0] if args else kwargs["hidden_states"])

        return pre

    def on_output(consume: Callable[[torch.Tensor], None], index: int | None) -> Callable[..., None]:
        def post(module: Any, args: Any, output: Any) -> None:
            consume(output[index] if isinstance(output, tuple) and index is not None else output)

        return post

    try:
        for (module, side, index), consume in taps:
            if side == "in":
                handles.append(module.register_forward_pre_hook(on_input(consume), with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(on_output(consume, index)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def nan_to_none(x: float) -> float | None:
    return None if math.isnan(x) else x
