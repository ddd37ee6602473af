"""Sensitivity of each block linear weight to quantization: the loss it costs when it alone is quantized.

A mixed-precision plan (:mod:`interp.quant.prescribe`) needs to know which weights to give
more bits. The score used here is the most direct one: for each block linear weight
``(layer, role)`` (q, k, v, o, gate, up, down in every block),

    s(layer, role) = mean over calibration examples of NLL(x; reference with only that weight quantized)
                     - NLL(x; reference),

the increase in mean next-token NLL (nats) when that one weight is replaced by its
quantized version and every other weight keeps the reference's. It is measured for each
bit width of the plan, so the gain of giving a weight the higher width is
``s_low - s_high`` in the same units as the per-example error the plan is judged on.

Why this score and not the others the issue lists:

- *restoring* one weight into the fully quantized model measures the same thing from the
  other end, but every measurement then depends on all the other quantized weights;
- *patching* a component's activation recovers its output error *and* the error carried in
  from the layers below, so it ranks late components high whatever their own weights do
  (the localization finding), which is not what a bit budget can buy.

Cost: one forward of the blocks ``layer..L-1`` and the head per weight and width, on the
calibration examples. The weights come from one quantization of the whole model per width
(:func:`interp.quant.apply.quantize_cached`, GPTQ's sequential calibration included), so a
weight's quantized value is the one a uniform model has. The reference's residual entering
each block is computed once per batch, and each swapped weight's forward starts there
(:class:`interp.runtime.decoder.DecoderRunner`): on average half a model forward per weight,
``7 L / 2`` model forwards per width in all. The result is cached on disk like the quantized
models (``$INTERP_CACHE/sensitivity``), keyed by the quantized model's cache key and the
calibration examples.

The score assumes the weights' effects add up; the plan's validation on held-out examples
(``benchmarks/prescribe_validation.py``) is where that assumption is checked.

Example:
    >>> import torch
    >>> import interp
    >>> from interp.quant.sensitivity import sensitivity
    >>> model = interp.tiny_model("llama")
    >>> rows = interp.Examples.from_tokens(torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(0)))
    >>> result = sensitivity(model, "rtn:bits=2,group=32", rows, progress=False, cache=False)
    >>> result.table().columns.tolist(), result.table(n_boot=20).columns.tolist()[-2:]
    (['layer', 'role', 'weights', 'score'], ['low', 'high'])
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from filelock import FileLock
from tqdm.auto import tqdm

from interp import models, stats
from interp.data import Examples
from interp.errors import DataError, InterpError
from interp.io import check_complete, ensure_writable_dir, is_complete, sanitize, saving, write_csv, write_json
from interp.models import Model
from interp.quant.apply import ROLES, _cache_key, _quantize, _quantize_cached, examples_hash
from interp.quant.spec import MethodSpec, parse_spec
from interp.runtime import hooks
from interp.runtime.batching import batches, check_examples, show_progress
from interp.runtime.decoder import DecoderRunner
from interp.runtime.readout import Readout
from interp.runtime.scoring import row_mean
from interp.validate import checked_class

__all__ = ["Sensitivity", "sensitivity"]

SENSITIVITY_VERSION = 1  # part of the cache key: bump when the score's computation changes
TABLE_FILE = "sensitivity.csv"
INFO_FILE = "sensitivity.json"


@checked_class(layers=lambda value, name, arguments: None,  # one entry per weight: a layer and a size repeat
               weights=lambda value, name, arguments: None)
@dataclass(frozen=True)
class Sensitivity:
    """Per-weight sensitivity: the NLL increase (nats) when only that weight is quantized with ``spec``.

    Attributes:
        spec: the canonical spec the weights were quantized with.
        layers: block index of each weight.
        roles: role of each weight (q, k, v, o, gate, up, down).
        weights: number of parameters of each weight (``d_out * d_in``).
        per_example: ``[weights, examples]`` NLL increase per calibration example.
        settings: calibration hash and size, seconds, forwards, bootstrap seed.

    Example:
        >>> import torch
        >>> import interp
        >>> from interp.quant.sensitivity import sensitivity
        >>> model = interp.tiny_model("llama")
        >>> generator = torch.Generator().manual_seed(0)
        >>> rows = interp.Examples.from_tokens(torch.randint(0, 256, (4, 12), generator=generator))
        >>> result = sensitivity(model, "rtn:bits=2,group=32", rows, progress=False, cache=False)
        >>> len(result.layers) == 2 * 7, sorted(set(result.roles))  # 2 blocks x 7 linear weights
        (True, ['down', 'gate', 'k', 'o', 'q', 'up', 'v'])
    """

    spec: str
    layers: list[int]
    roles: list[str]
    weights: list[int]
    per_example: np.ndarray
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.layers)
        if not (len(self.roles) == len(self.weights) == n == self.per_example.shape[0]):
            raise InterpError("Sensitivity needs one layer, role, size and row of scores per weight.")

    @property
    def names(self) -> list[str]:
        """``"layer.role"`` of each weight, the names a spec's per-module bit map uses."""
        return [f"{layer}.{role}" for layer, role in zip(self.layers, self.roles, strict=True)]

    @property
    def scores(self) -> np.ndarray:
        """Mean NLL increase per weight (nats), ``[weights]``."""
        return self.per_example.mean(axis=1)

    def table(self, n_boot: int = 0, seed: int = 0) -> pd.DataFrame:
        """One row per weight: layer, role, size, score and, with ``n_boot``, a 95% bootstrap interval over examples
        (``low``, ``high``; without resamples there is no interval, so no columns rather than NaN ones)."""
        frame = pd.DataFrame({"layer": self.layers, "role": self.roles, "weights": self.weights, "score": self.scores})
        if n_boot:
            index = stats.bootstrap_indices(self.per_example.shape[1], n_boot, seed)
            boot = self.per_example[:, index].mean(axis=2)  # [weights, n_boot]
            frame["low"], frame["high"] = np.percentile(boot, 2.5, axis=1), np.percentile(boot, 97.5, axis=1)
        return frame

    def grid(self) -> pd.DataFrame:
        """Scores as a ``layer x role`` table (roles in forward order)."""
        frame = self.table().pivot(index="layer", columns="role", values="score")
        return frame[[role for role in ROLES if role in frame.columns]]

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """``sensitivity.csv`` (per weight and example) and ``sensitivity.json`` (spec, settings)."""
        frame = pd.DataFrame(self.per_example, columns=[f"x{i}" for i in range(self.per_example.shape[1])])
        frame.insert(0, "weights", self.weights)
        frame.insert(0, "role", self.roles)
        frame.insert(0, "layer", self.layers)
        with saving(Path(folder), "sensitivity", own=(TABLE_FILE, INFO_FILE)) as out:  # INCOMPLETE until both are in
            write_csv(out / TABLE_FILE, frame, index=False, float_format="%.9g")
            write_json(out / INFO_FILE, sanitize({"spec": self.spec, "settings": self.settings,
                                                  "version": SENSITIVITY_VERSION}))
        return out

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> Sensitivity:
        """Scores :meth:`save` wrote: its JSON checked against a schema (:func:`interp.schema.conform`), both files
        read only when they are regular files (a pipe or device is refused), the table's columns checked."""
        from interp.reading import read_json, regular_file
        from interp.schema import conform

        check_complete(folder, "saved sensitivity scores")  # a save killed part-way (INCOMPLETE) is refused
        info = conform(read_json(Path(folder) / INFO_FILE, "saved sensitivity scores"),
                       {"spec": "str", "settings": "dict"}, str(Path(folder) / INFO_FILE))
        frame = pd.read_csv(regular_file(Path(folder) / TABLE_FILE, "saved sensitivity scores"))
        if not {"layer", "role", "weights"} <= set(frame.columns) or frame.shape[1] < 4:
            raise DataError(f"{Path(folder) / TABLE_FILE} lacks the layer, role and weights columns and the "
                            "per-example scores: it was not written by Sensitivity.save.")
        scores = frame.drop(columns=["layer", "role", "weights"]).to_numpy(dtype=np.float64)
        return cls(info["spec"], frame["layer"].astype(int).tolist(), frame["role"].astype(str).tolist(),
                   frame["weights"].astype(int).tolist(), scores, info["settings"])


def sensitivity(model: Model, spec: str | MethodSpec, examples: Examples, calibration: Examples | None = None,
                batch_size: int = 8, progress: bool | None = None, cache: bool = True,
                cache_dir: str | os.PathLike[str] | None = None) -> Sensitivity:
    """The NLL increase on ``examples`` when each block linear weight alone is quantized with ``spec``.

    Args:
        model: the reference bridge (its weights are swapped one at a time and always put back).
        spec: a plain method spec, e.g. ``"gptq:bits=3,group=64"``.
        examples: the examples the score is measured on: calibration text, never the evaluation set.
        calibration: the calibrated methods' calibration examples (default: ``examples``).
        batch_size: examples per forward.
        progress: a progress bar over weights.
        cache: read and write the disk cache (``$INTERP_CACHE/sensitivity``, or ``cache_dir``); the
            quantized model comes from the quantized-model cache too.

    Returns:
        A :class:`Sensitivity` with one row per weight, in (layer, role) forward order.

    Raises:
        SpecError: a spec with a per-module bit map, or a bad spec.
    """
    spec = parse_spec(spec)
    if spec.modules:
        raise InterpError(f"sensitivity needs a single-width spec, got one with a per-module bit map: {spec}")
    check_examples(model, examples)
    calibration = calibration if calibration is not None else examples
    root = Path(cache_dir) if cache_dir is not None else models.cache_dir()
    if not cache:
        return _measure(model, _quantize(model, spec, calibration, False, 8), spec, examples, batch_size, progress)
    key = _key(model, spec, examples, calibration)
    folder = ensure_writable_dir(root / "sensitivity") / key
    with FileLock(str(folder) + ".lock"):
        if (folder / INFO_FILE).is_file() and is_complete(folder):  # a save killed part-way is measured again
            return Sensitivity.load(folder)
        low = _quantize_cached(model, spec, calibration, cache_dir=root / "quantized", progress=progress)
        result = _measure(model, low, spec, examples, batch_size, progress)
        result.save(folder)
    return result


def _key(model: Model, spec: MethodSpec, examples: Examples, calibration: Examples) -> str:
    text = f"{_cache_key(model, spec, calibration)}|{examples_hash(examples)}|v{SENSITIVITY_VERSION}"
    return f"{spec.method}{spec.bits}-g{spec.group}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _measure(model: Model, low: Any, spec: MethodSpec, examples: Examples, batch_size: int,
             progress: bool | None) -> Sensitivity:
    """Swap each weight of ``low`` into ``model`` in turn and score ``examples`` from that weight's block on."""
    runner = DecoderRunner.for_model(model)
    if runner is None:
        raise InterpError("sensitivity needs a decoder whose forward can start mid-model (llama-style blocks).")
    readout = Readout(model)
    n_layers = hooks.n_layers(model)
    names = [(layer, role) for layer in range(n_layers) for role in ROLES if role in hooks.linear_weights(model, 0)]
    sizes = [int(hooks.linear_weights(model, layer)[role].read().numel()) for layer, role in names]
    out = np.zeros((len(names), len(examples)), dtype=np.float64)
    body: Any = hooks.native_model(model).model
    start_time = time.perf_counter()
    bar = tqdm(total=len(names) * len(examples), desc=f"sensitivity {spec.method}{spec.bits}", unit="ex",
               disable=not show_progress(progress))
    with torch.no_grad():
        for first, last in batches(len(examples), batch_size):
            tokens = examples.tokens[first:last].to(readout.weight.device)
            hidden = body(input_ids=tokens, output_hidden_states=True).hidden_states
            reference = row_mean(readout.token_nll(_run(runner, hidden[n_layers - 1], n_layers - 1), tokens))
            for index, (layer, role) in enumerate(names):
                slot = hooks.linear_weights(model, layer)[role]
                original = slot.read().detach().clone()
                slot.write(hooks.linear_weights(low, layer)[role].read())
                try:
                    swapped = row_mean(readout.token_nll(_run(runner, hidden[layer], layer), tokens))
                finally:
                    slot.write(original)
                out[index, first:last] = (swapped - reference).cpu().numpy()
                bar.update(last - first)
    bar.close()
    settings = {"examples": examples_hash(examples), "n": len(examples), "seq_len": examples.seq_len,
                "examples_settings": dict(examples.settings), "seconds": time.perf_counter() - start_time,
                "model_forwards": sum(n_layers - layer for layer, _ in names) / n_layers,
                "quantized": getattr(getattr(low, "quant_info", None), "spec", str(spec))}
    return Sensitivity(str(spec), [layer for layer, _ in names], [role for _, role in names], sizes, out, settings)


def _run(runner: DecoderRunner, hidden: torch.Tensor, start: int) -> torch.Tensor:
    """Blocks ``start..L-1`` on the bridge-free layers (no hooks fire; same output as the bridge's)."""
    for layer in range(start, len(runner.blocks)):
        hidden = runner.block(layer, hidden, native=True)
    return hidden


# ---------------------------------------------------------------------------------------
# The no-forward proxy: each weight's output error on calibration inputs, at every width

INPUT_GROUPS = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))  # roles that read the same input


class ChunkedScores:
    """Scores summed per chunk of examples (``per_chunk [weights, options, chunks]``, ``tokens [chunks]``),
    for one weight per ``(layers[i], roles[i])``."""

    layers: list[int]
    roles: list[str]
    per_chunk: np.ndarray
    tokens: np.ndarray

    @property
    def names(self) -> list[str]:
        return [f"{layer}.{role}" for layer, role in zip(self.layers, self.roles, strict=True)]

    def scores(self, chunks: Any = None) -> np.ndarray:
        """``[weights, options]`` score per token over ``chunks`` (an index array; default all)."""
        pick = slice(None) if chunks is None else np.asarray(chunks)
        return self.per_chunk[:, :, pick].sum(axis=2) / self.tokens[pick].sum()


@dataclass(frozen=True)
class ProxySensitivity(ChunkedScores):
    """Per weight and width, the GPTQ objective ``tr(ΔW H ΔWᵀ)`` per calibration token, in chunks of examples.

    ``H = XᵀX`` sums the weight's input over the tokens of a chunk (chunk ``c`` holds examples
    ``c, c + K, c + 2K, ...``), ``ΔW`` is the weight's quantized value minus its own at that
    width, so the score is the weight's squared output error summed over the chunk's tokens.

    Attributes:
        spec: the method spec of the widths (its ``bits`` is the first width).
        layers, roles, weights: as :class:`Sensitivity`.
        widths: the candidate bit widths.
        per_chunk: ``[weights, widths, chunks]`` summed squared output error.
        tokens: ``[chunks]`` tokens in each chunk.
        settings: examples hash, seconds, model forwards.
    """

    spec: str
    layers: list[int]
    roles: list[str]
    weights: list[int]
    widths: list[int]
    per_chunk: np.ndarray
    tokens: np.ndarray
    settings: dict[str, Any] = field(default_factory=dict)



def proxy_sensitivity(model: Model, examples: Examples, widths: tuple[int, ...] = (3, 4, 5, 6, 8),
                      method: str = "rtn", group: int = 32, chunks: int = 8, batch_size: int = 8,
                      progress: bool | None = None) -> ProxySensitivity:
    """The output-error proxy for every block linear weight at every width, from one forward per batch.

    Cost: the forwards (the decoder body, no unembedding) with ``XᵀX`` accumulated at each
    input group, then per weight and width one ``ΔWᵀΔW`` (``d_out * d_in²``) shared by all chunks.

    Args:
        model: the reference bridge.
        examples: calibration text kept apart from the evaluation set (and from GPTQ's calibration
            when the scores are compared with it).
        widths: candidate bit widths of ``method`` (a calibration-free quantizer: ``rtn``, ``nf``, ``hqq``).
        group: group size of ``method``.
        chunks: the examples are scored in this many interleaved chunks (even: the even and odd
            chunks are the even and odd examples, the split halves). Memory: one ``d_in x d_in``
            float32 Gram matrix per input group, layer and chunk (SmolLM2: 0.4 GB per chunk).
        batch_size: examples per forward.

    Raises:
        InterpError: fewer examples than chunks, or a calibrated method.
    """
    from interp.quant.methods._common import quantize_parsed

    specs = [parse_spec(f"{method}:bits={bits},group={group}") for bits in widths]
    if any(spec.method in ("gptq", "awq") for spec in specs):
        raise InterpError(f"the proxy quantizes each weight on its own: use rtn, nf or hqq, not {method}")
    check_examples(model, examples)
    if len(examples) < chunks:
        raise InterpError(f"the proxy splits the examples into {chunks} chunks: pass at least {chunks} examples")
    start_time = time.perf_counter()
    n_layers = hooks.n_layers(model)
    names = [(layer, role) for layer in range(n_layers) for group_roles in INPUT_GROUPS for role in group_roles
             if role in hooks.linear_weights(model, layer)]
    grams, tokens = [], np.zeros(chunks)
    bar = tqdm(total=chunks + len(names), desc="proxy sensitivity", unit="step", disable=not show_progress(progress))
    for chunk in range(chunks):  # the inputs' Gram matrices, one set per chunk
        gram, tokens[chunk] = _input_grams(model, examples.subset(list(range(chunk, len(examples), chunks))),
                                           batch_size)
        grams.append(gram)
        bar.update(1)
    out = np.zeros((len(names), len(widths), chunks))
    sizes = []
    for index, (layer, role) in enumerate(names):  # tr(ΔW H ΔWᵀ) = <ΔWᵀΔW, H>: one ΔWᵀΔW for every chunk
        W = hooks.linear_weights(model, layer)[role].read().detach().float()
        H = torch.stack([gram[layer, _group_of(role)] for gram in grams])  # [chunks, d_in, d_in]
        for w, spec in enumerate(specs):
            delta = quantize_parsed(W, spec) - W
            out[index, w] = (H * (delta.T @ delta)).sum(dim=(1, 2)).double().numpy()
        sizes.append(int(W.numel()))
        bar.update(1)
    bar.close()
    settings = {"examples": examples_hash(examples), "n": len(examples), "seq_len": examples.seq_len,
                "examples_settings": dict(examples.settings), "seconds": time.perf_counter() - start_time,
                "model_forwards": len(examples) / batch_size, "batch_size": batch_size, "chunks": chunks}
    return ProxySensitivity(str(specs[0]), [layer for layer, _ in names], [role for _, role in names], sizes,
                            list(widths), out, tokens, settings)


def _group_of(role: str) -> int:
    return next(i for i, roles in enumerate(INPUT_GROUPS) if role in roles)


def _input_grams(model: Model, rows: Examples, batch_size: int) -> tuple[dict[tuple[int, int], torch.Tensor], int]:
    """``XᵀX`` of each input group's input over every token of ``rows`` (one forward per batch), and the token count."""
    gram: dict[tuple[int, int], torch.Tensor] = {}

    def adder(key: tuple[int, int]) -> Any:
        def add(x: torch.Tensor, hook: Any) -> None:
            flat = x.detach().reshape(x.shape[0] * x.shape[1], -1).float().cpu()  # [batch * pos, d_in]
            gram[key] = gram[key] + flat.T @ flat if key in gram else flat.T @ flat

        return add

    fwd = []
    for layer in range(hooks.n_layers(model)):
        present = hooks.linear_weights(model, layer)
        for index, roles in enumerate(INPUT_GROUPS):
            role = next((r for r in roles if r in present), None)
            if role is not None:
                fwd.append((hooks.linear_input_hook(model, layer, role), adder((layer, index))))
    device = next(model.original_model.parameters()).device
    with torch.no_grad(), model.hooks(fwd_hooks=fwd):
        for first, last in batches(len(rows), batch_size):
            hooks.decoder_body(model)(input_ids=rows.tokens[first:last].to(device))
    return gram, int(rows.tokens.numel())


def split_half(values: np.ndarray, sizes: np.ndarray | None = None, n_boot: int = 1000, seed: int = 0
               ) -> dict[str, float]:
    """Split-half Spearman of per-item scores: even units against odd units, with a bootstrap interval.

    Args:
        values: ``[items, units]``, each unit's contribution (an example's score, or a chunk's
            summed error).
        sizes: ``[units]`` what each unit counts (tokens); a half's score is its values' sum over
            its sizes' sum. None: every unit counts 1 (the half's mean).
        n_boot, seed: bootstrap resamples; each draws the units of each half with replacement.

    Returns:
        ``rho`` (the two halves' Spearman over the items), its 95% percentile interval
        ``low``/``high``, and ``units`` per half.
    """
    from scipy.stats import rankdata

    sizes = np.ones(values.shape[1]) if sizes is None else np.asarray(sizes, dtype=np.float64)
    even, odd = np.arange(0, values.shape[1], 2), np.arange(1, values.shape[1], 2)

    def halves(pick_even: np.ndarray, pick_odd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # pick_*: [draws, units] indices -> [items, draws] scores of each half
        a = values[:, pick_even].sum(axis=2) / sizes[pick_even].sum(axis=1)
        b = values[:, pick_odd].sum(axis=2) / sizes[pick_odd].sum(axis=1)
        return a, b

    def rho(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        ra, rb = rankdata(a, axis=0), rankdata(b, axis=0)
        ra, rb = ra - ra.mean(axis=0), rb - rb.mean(axis=0)
        return (ra * rb).sum(axis=0) / np.sqrt((ra * ra).sum(axis=0) * (rb * rb).sum(axis=0))

    point = float(rho(*halves(even[None], odd[None]))[0])
    rng = np.random.default_rng(seed)
    draws = rho(*halves(rng.choice(even, (n_boot, len(even))), rng.choice(odd, (n_boot, len(odd)))))
    return {"rho": point, "low": float(np.percentile(draws, 2.5)), "high": float(np.percentile(draws, 97.5)),
            "units": len(even)}
