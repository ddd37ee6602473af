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
    >>> result.table().columns.tolist()
    ['layer', 'role', 'weights', 'score', 'low', 'high']
"""

from __future__ import annotations

import hashlib
import json
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
from interp.errors import InterpError
from interp.io import ensure_writable_dir, sanitize, write_json
from interp.models import Model
from interp.quant.apply import ROLES, cache_key, examples_hash, quantize, quantize_cached
from interp.quant.spec import MethodSpec, parse_spec
from interp.runtime import hooks
from interp.runtime.batching import batches, check_examples, show_progress
from interp.runtime.decoder import DecoderRunner
from interp.runtime.readout import Readout
from interp.runtime.scoring import row_mean

__all__ = ["Sensitivity", "sensitivity"]

SENSITIVITY_VERSION = 1  # part of the cache key: bump when the score's computation changes
TABLE_FILE = "sensitivity.csv"
INFO_FILE = "sensitivity.json"


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
        """One row per weight: layer, role, size, score and (with ``n_boot``) a 95% bootstrap interval over examples."""
        low = high = np.full(len(self.layers), np.nan)
        if n_boot:
            index = stats.bootstrap_indices(self.per_example.shape[1], n_boot, seed)
            boot = self.per_example[:, index].mean(axis=2)  # [weights, n_boot]
            low, high = np.percentile(boot, 2.5, axis=1), np.percentile(boot, 97.5, axis=1)
        return pd.DataFrame({"layer": self.layers, "role": self.roles, "weights": self.weights,
                             "score": self.scores, "low": low, "high": high})

    def grid(self) -> pd.DataFrame:
        """Scores as a ``layer x role`` table (roles in forward order)."""
        frame = self.table().pivot(index="layer", columns="role", values="score")
        return frame[[role for role in ROLES if role in frame.columns]]

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """``sensitivity.csv`` (per weight and example) and ``sensitivity.json`` (spec, settings)."""
        out = ensure_writable_dir(Path(folder))
        frame = pd.DataFrame(self.per_example, columns=[f"x{i}" for i in range(self.per_example.shape[1])])
        frame.insert(0, "weights", self.weights)
        frame.insert(0, "role", self.roles)
        frame.insert(0, "layer", self.layers)
        frame.to_csv(out / TABLE_FILE, index=False, float_format="%.9g")
        write_json(out / INFO_FILE, sanitize({"spec": self.spec, "settings": self.settings,
                                              "version": SENSITIVITY_VERSION}))
        return out

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> Sensitivity:
        info = json.loads((Path(folder) / INFO_FILE).read_text())
        frame = pd.read_csv(Path(folder) / TABLE_FILE)
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
        return _measure(model, quantize(model, spec, calibration=calibration, progress=False), spec, examples,
                        batch_size, progress)
    key = _key(model, spec, examples, calibration)
    folder = ensure_writable_dir(root / "sensitivity") / key
    with FileLock(str(folder) + ".lock"):
        if (folder / INFO_FILE).is_file():
            return Sensitivity.load(folder)
        low = quantize_cached(model, spec, calibration=calibration, cache_dir=root / "quantized", progress=progress)
        result = _measure(model, low, spec, examples, batch_size, progress)
        result.save(folder)
    return result


def _key(model: Model, spec: MethodSpec, examples: Examples, calibration: Examples) -> str:
    text = f"{cache_key(model, spec, calibration)}|{examples_hash(examples)}|v{SENSITIVITY_VERSION}"
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
