"""Attribution patching: the first-order (gradient) estimate of every (component, layer) patch at once.

``(source_act - target_act) . dMetric/dact``, from one forward and backward pass of the
target per batch: a fast prefilter before exact patching (:func:`rank_agreement` measures
how well it ranks the exact effects).

Example:
    >>> import interp, torch
    >>> from interp.localize.patching.attribution import attribution
    >>> from interp.quant.apply import quantize
    >>> source = interp.tiny_model("llama")
    >>> target = quantize(source, "rtn:bits=4,group=64", progress=False)
    >>> ex = interp.Examples.from_tokens(torch.randint(0, 256, (2, 8)))
    >>> est = attribution(target, source, ex, ["down", "gate"], progress=False)
    >>> est.table()[["component", "layer"]].values.tolist()
    [['down', 0], ['down', 1], ['gate', 0], ['gate', 1]]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from interp.data import Examples, aligned_rows, check_same_real_lengths
from interp.display import ResultDisplay
from interp.errors import ComponentError, DataError, InterpError
from interp.localize.patching.engine import _check_pair, _metric_values, _settings, _takes_lengths
from interp.localize.patching.metrics import Metric, _metric
from interp.localize.patching.patches import PAPER_COMPONENTS, LayerSelection, resolve_layers
from interp.localize.patching.results import PatchResult
from interp.models import Model
from interp.results import CheckedResult
from interp.runtime import hooks as hk
from interp.runtime.batching import batches, device_of, show_progress
from interp.runtime.capture import capture
from interp.runtime.readout import Readout
from interp.typing import Key, Tokens


@dataclass(frozen=True)
class AttributionResult(CheckedResult, ResultDisplay):
    """First-order estimates of each (component, layer) patch's effect on the metric.

    Attributes:
        estimates: ``[n_points, N]`` estimated ``metric(patched) - metric(target)`` per example.
        points: ``(component, layer)`` of each row.
        ids, metric, settings: as in :class:`~interp.localize.patching.results.PatchResult`.

    Made only finite: see :mod:`interp.results`.
    """

    estimates: Float[Tensor, "n_points n_examples"]
    points: list[Key]
    ids: list[str]
    metric: str = "nll"
    settings: dict[str, Any] = field(default_factory=dict)

    def table(self) -> pd.DataFrame:
        return pd.DataFrame({"component": [c for c, _ in self.points], "layer": [layer for _, layer in self.points],
                             "estimate": self.estimates.double().mean(dim=1).numpy()})


def attribution(
    target: Model,
    source: Model,
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

    Padded prompts are read as each prompt alone (rows left-aligned, the metric at each row's own
    positions); each target row and its source row must hold the same number of real tokens.
    """
    source_examples = source_examples if source_examples is not None else examples
    _check_pair(target, source, examples, source_examples)
    check_same_real_lengths(examples, source_examples, "Attribution patching compares each target row with a source "
                            "row of the same real length, position by position")
    metric_ = _metric(metric)
    if (examples.padded or source_examples.padded) and not _takes_lengths(metric_):
        raise DataError(f"The metric {type(metric_).__name__} takes no lengths=, so it cannot skip pad positions.")
    chosen = resolve_layers(target, layers)
    points = [(c, layer) for c in components for layer in chosen]
    for c, layer in points:
        if hk.record(c).per_head:
            raise ComponentError("attribution() covers whole components; patch heads exactly with patch_heads().")
        hk.hook_point(target, c, layer)
    readout = Readout(target)
    estimates = torch.empty(len(points), len(examples), dtype=torch.float64)  # host: results, one batch at a time
    device = device_of(target)
    for start, end in tqdm(list(batches(len(examples), batch_size)), desc="attribution", unit="batch",
                           disable=not show_progress(progress)):
        index = torch.arange(start, end)  # host: example indices; a metric picks its host-side answers with them
        tokens, lengths = aligned_rows(examples, start, end, device)  # padded rows: real tokens first, as alone
        source_tokens, _ = aligned_rows(source_examples, start, end, device)
        with torch.no_grad():
            source_cache, _ = capture(source, source_tokens, points)
        estimates[:, start:end] = _attribute_batch(target, readout, metric_, tokens, index, points, source_cache,
                                                   lengths)
    return AttributionResult(estimates=estimates, points=points, ids=list(examples.ids), metric=metric_.name,
                             settings=_settings(target, source, examples, batch_size))


def _attribute_batch(target: Model, readout: Readout, metric: Metric, tokens: Tokens, index: Tensor,
                     points: list[Key], source_cache: Mapping[Key, Tensor], lengths: Tensor | None = None
                     ) -> Float[Tensor, "n_points batch"]:
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
        values = _metric_values(metric, "from_resid", readout, acts[last], tokens, index, lengths=lengths)
        grads = torch.autograd.grad(values.sum(), [acts[p] for p in points], allow_unused=True)
    out = torch.zeros(len(points), tokens.shape[0], dtype=torch.float64, device=tokens.device)
    for i, (point, grad) in enumerate(zip(points, grads, strict=True)):
        if grad is not None:
            delta = source_cache[point] - acts[point].detach()
            out[i] = (delta * grad).flatten(start_dim=1).sum(dim=1).double()
    return out.cpu()  # one host copy per batch, not one per layer


def rank_agreement(estimated: AttributionResult, exact: PatchResult) -> float:
    """Spearman correlation between attribution estimates and exact single-layer patching effects.

    Compares the mean over examples of ``metric(patched) - metric(target)`` for every
    (component, layer) both results cover.
    """
    from scipy.stats import spearmanr  # imported here: scipy.stats takes over a second to import

    exact_delta = (exact.values - exact.target).double().mean(dim=1)
    lookup = {(p.component, p.layers[0]): float(d) for p, d in zip(exact.patches, exact_delta, strict=True)
              if len(p.layers) == 1 and p.positions is None and p.heads is None}
    est = estimated.table()
    pairs = [(float(e), lookup[(c, int(layer))]) for c, layer, e in est[["component", "layer", "estimate"]].values
             if (c, int(layer)) in lookup]
    if len(pairs) < 3:
        raise InterpError("rank_agreement needs at least 3 (component, layer) points present in both results.")
    return float(spearmanr([a for a, _ in pairs], [b for _, b in pairs]).statistic)

