"""Prescription: a mixed-precision plan that gives each block linear weight one of two bit widths under a bit budget.

The quantization analyses diagnose *which* examples and components carry the error. This
module turns a measurement into a plan: given a method, two bit widths (e.g. GPTQ 3 and 4)
and a budget in average bits per weight, it picks the width of every block linear weight
(q, k, v, o, gate, up, down in each layer).

**Bit accounting.** A weight ``[d_out, d_in]`` quantized at ``b`` bits with group size ``g``
costs ``d_out * d_in * b`` bits of codes plus ``d_out * ceil(d_in / g)`` groups times the
group's overhead (:func:`group_overhead_bits`):

- ``gptq``, ``awq``, ``hqq``, ``rtn`` (float zero-point): a 16-bit scale and a 16-bit
  zero-point per group: 32 bits (at group 64, 0.5 bit per weight at any width);
- ``rtn`` with ``zero=int``: a 16-bit scale and a ``b``-bit integer zero-point;
- ``nf``: one 16-bit absmax scale per group.

AWQ's per-input-channel scales are taken as folded into the preceding operation, as AWQ's
deployed formats do, and cost nothing. The average bits per weight of a plan is the total of
these over all block linear weights divided by their parameter count. So the two ends of a
3/4-bit GPTQ plan at group 64 are 3.5 and 4.5 bits per weight, and a budget must lie strictly
between them.

**Allocation.** Every weight starts at the low width; raising weight ``i`` costs ``c_i`` bits
(the difference of its two totals, an integer) and is estimated to remove ``v_i`` nats of mean
NLL: its :mod:`~interp.quant.sensitivity` score at the low width (the NLL increase when it
alone is quantized). The weights are ranked by ``v_i / c_i`` (ties: layer, then role in
forward order) and taken in that order while they fit in the budget (a weight that does not
fit is skipped and the next one tried): a greedy 0/1 knapsack. The plan is deterministic. It
is *exact on the budget* in this sense: its average is at or below the budget, and no weight
left at the low width still fits (the remaining slack is smaller than the smallest of their
costs). The achieved average is reported; it is the largest the greedy order reaches, not
necessarily the largest any subset reaches. The greedy's estimated gain is within the largest
single ``v_i`` of the knapsack optimum (the classical bound for ratio-greedy), which the tests
check against brute force.

The same filling rule gives the comparison plans of the validation: a llama.cpp-style
heuristic (:func:`heuristic_order`) and random orders (:func:`random_order`), so every
strategy spends the same budget the same way and differs only in its order.

Example:
    >>> costs, values = [4, 4, 2], [1.0, 3.0, 1.6]
    >>> greedy_order(values, costs), fill([2, 1, 0], costs, capacity=6)  # 0.8 per bit, then 0.75, then 0.25
    ([2, 1, 0], [2, 1])
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from interp.errors import SpecError
from interp.quant.shapes import WeightShape
from interp.quant.spec import METHODS, MethodSpec, parse_spec
from interp.validate import checked, checked_class

if TYPE_CHECKING:
    from interp.data import Examples
    from interp.models import Model  # loads torch: the CLI imports this module while parsing options

__all__ = ["LlamaScores", "Plan", "WeightShape", "average_bits", "candidate_options", "choose_llama_types",
           "choose_options", "exact_options", "fill", "greedy_order", "group_overhead_bits", "heuristic_order",
           "llama_options", "plan_from_order", "prescribe", "random_order", "score_llama_options", "validate_request",
           "weight_bits"]

PLAN_FILE = "plan.json"
ROLE_ORDER = ("q", "k", "v", "o", "gate", "up", "down")


def group_overhead_bits(spec: MethodSpec, bits: int) -> int:
    """Bits of scale and zero-point stored per group at width ``bits`` (see the module docstring).

    Example:
        >>> group_overhead_bits(parse_spec("gptq:bits=3"), 3), group_overhead_bits(parse_spec("nf:bits=4"), 4)
        (32, 16)
        >>> group_overhead_bits(parse_spec("rtn:bits=3,zero=int"), 3)
        19
    """
    if spec.method == "nf":
        return 16
    if spec.params.get("zero") == "int":
        return 16 + bits
    return 32


def weight_bits(shape: WeightShape, spec: MethodSpec, bits: int) -> int:
    """Total bits of one weight at ``bits``: codes plus its groups' scales and zero-points."""
    groups = shape.d_out * math.ceil(shape.d_in / spec.group)
    return shape.size * bits + groups * group_overhead_bits(spec, bits)


def average_bits(shapes: Sequence[WeightShape], spec: MethodSpec, widths: Sequence[int]) -> float:
    """Average bits per weight over ``shapes`` quantized at ``widths`` (one per weight).

    Example:
        >>> shapes = [WeightShape(0, "q", 4, 64), WeightShape(0, "k", 2, 64)]
        >>> average_bits(shapes, parse_spec("gptq:bits=3"), [3, 4])  # (4*64*3 + 4*32 + 2*64*4 + 2*32) / 384
        3.8333333333333335
    """
    total = sum(weight_bits(s, spec, b) for s, b in zip(shapes, widths, strict=True))
    return total / sum(s.size for s in shapes)


# ---------------------------------------------------------------------------------------
# Orders and the one filling rule


def fill(order: Sequence[int], costs: Sequence[int], capacity: int) -> list[int]:
    """Items taken in ``order`` while they fit: each one whose cost fits the capacity left is taken, others skipped.

    Returns the taken items in the order they were taken.
    """
    taken, left = [], capacity
    for item in order:
        if costs[item] <= left:
            taken.append(item)
            left -= costs[item]
    return taken


def greedy_order(values: Sequence[float], costs: Sequence[int]) -> list[int]:
    """Items by estimated gain per bit, highest first; ties keep the items' own order (a stable sort)."""
    return sorted(range(len(values)), key=lambda i: -float(values[i]) / costs[i])  # sorted() is stable


def heuristic_order(shapes: Sequence[WeightShape]) -> list[int]:
    """The llama.cpp-style priority: attention v and FFN down first, then the first and last layers.

    The rule follows how llama.cpp's ``_M`` k-quant mixes (``Q3_K_M``, ``Q4_K_M``;
    ``llama_tensor_get_type`` in its quantization code) give more bits to ``attn_v`` and
    ``ffn_down``, and, within those, to the layers its ``use_more_bits(i, n)`` picks
    (``i < n/8``, ``i >= 7n/8``, or every third layer between). Here, in tiers:

    1. v and down in the layers ``use_more_bits`` picks;
    2. v and down in the other layers;
    3. the remaining weights by the distance of their layer to the nearer end of the model
       (layer 0 and the last layer first), roles in forward order.

    Within a tier, layers go in increasing order.
    """
    n = 1 + max(s.layer for s in shapes)

    def more_bits(layer: int) -> bool:
        return layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2

    def key(index: int) -> tuple[int, int, int]:
        s = shapes[index]
        if s.role in ("v", "down"):
            return (0 if more_bits(s.layer) else 1, s.layer, ROLE_ORDER.index(s.role))
        return (2, min(s.layer, n - 1 - s.layer), s.layer * len(ROLE_ORDER) + ROLE_ORDER.index(s.role))

    return sorted(range(len(shapes)), key=key)


def random_order(n: int, seed: int) -> list[int]:
    """A uniformly random order of ``n`` items (``numpy.random.default_rng(seed)``)."""
    import numpy as np

    return [int(i) for i in np.random.default_rng(seed).permutation(n)]


# ---------------------------------------------------------------------------------------
# More than two widths: a multiple-choice knapsack


def choose_options(losses: Sequence[Sequence[float]], costs: Sequence[Sequence[int]], capacity: int,
                   unit: int = 1) -> list[int]:
    """One option per item minimizing the summed loss with the summed cost at most ``capacity``.

    Dynamic programming over cost (a multiple-choice knapsack): exact when ``unit`` is 1;
    with a larger ``unit`` every cost is rounded *up* to a multiple of it and the capacity
    down, so the choice always fits and is optimal for the rounded instance (its loss is at
    most the optimum at ``capacity - items * unit``).

    Args:
        losses: ``[items][options]`` estimated loss of each option (e.g. the proxy at each width).
        costs: ``[items][options]`` integer cost (bits) of each option.
        capacity: the most the chosen options may cost in total.
        unit: cost resolution; the table has ``capacity // unit + 1`` cells per item.

    Raises:
        SpecError: no choice fits (even the cheapest options together cost more than ``capacity``).

    Example:
        >>> choose_options([[3.0, 1.0, 0.0], [2.0, 0.5, 0.0]], [[1, 2, 3], [1, 2, 3]], capacity=4)
        [1, 1]
    """
    import numpy as np

    cells = capacity // unit
    if cells < 0:
        raise SpecError(f"capacity {capacity} is negative: no choice of options fits")
    best = np.zeros(cells + 1)  # best[c]: least loss of the items so far at cost <= c * unit
    choices = []
    for item_losses, item_costs in zip(losses, costs, strict=True):
        new = np.full(cells + 1, np.inf)
        pick = np.zeros(cells + 1, dtype=np.int64)
        for option, (loss, cost) in enumerate(zip(item_losses, item_costs, strict=True)):
            need = -(-int(cost) // unit)  # rounded up
            if need > cells:
                continue
            candidate = best[:cells + 1 - need] + float(loss)
            better = candidate < new[need:]
            new[need:][better] = candidate[better]
            pick[need:][better] = option
        best = new
        choices.append(pick)
    if not np.isfinite(best[cells]):
        raise SpecError(f"no choice of options fits in {capacity} bits: the cheapest options cost more")
    out, cell = [], cells
    for item_costs, pick in zip(reversed(list(costs)), reversed(choices), strict=True):
        option = int(pick[cell])
        out.append(option)
        cell -= -(-int(item_costs[option]) // unit)
    return out[::-1]


def tail_loss(per_example: Any, share: float = 0.1) -> float:
    """The mean of the largest ``share`` of per-example losses (at least one): the CVaR at ``1 - share``."""
    import numpy as np

    values = np.sort(np.asarray(per_example, dtype=np.float64))
    k = max(1, int(round(share * values.size)))
    return float(values[-k:].mean())


def choose_options_tail(losses: Any, costs: Sequence[Sequence[int]], capacity: int, share: float = 0.1,
                        unit: int = 1, rounds: int = 50) -> tuple[list[int], list[float]]:
    """One option per item minimizing the predicted loss of the worst ``share`` of examples, within ``capacity``.

    A plan's predicted loss on example ``e`` is the sum over items of its chosen option's loss on
    ``e``; the objective is the mean over the examples where that sum is largest
    (:func:`tail_loss`). That is the largest mean loss over any ``share`` of the examples, a game
    between the plan and an adversary who picks the examples, so no single knapsack solves it.
    This plays the game by fictitious play: start from the plan of least mean loss; each round the
    adversary's answer is the current plan's worst examples, the examples are weighted by how often
    they were an answer so far, and the next plan is the knapsack (:func:`choose_options`) on the
    items' losses under those weights. It returns the best plan seen over ``rounds``, so its tail
    loss is never above the mean-optimal plan's. The exact minimum is not guaranteed: on random
    small instances it found the enumerated optimum 34 times in 40 (tests/test_prescribe.py), where
    re-solving for the current worst examples alone found it 20 times.

    Args:
        losses: ``[items][options][examples]`` (a list per item of ``[options, examples]`` arrays;
            items may have different option counts).
        costs, capacity, unit: as for :func:`choose_options`.
        share: the worst share of examples the objective averages (0.1: the worst 10%).
        rounds: how many answers the adversary gives.

    Returns:
        The chosen option per item, and the tail loss of each plan visited (the first is the
        mean-optimal plan's).
    """
    import numpy as np

    tables = [np.asarray(item, dtype=np.float64) for item in losses]
    if not tables or any(t.ndim != 2 for t in tables) or len({t.shape[1] for t in tables}) != 1:
        raise SpecError("losses must be [items][options][examples], every item with the same examples")
    if not 0 < share <= 1:
        raise SpecError(f"share must be in (0, 1], got {share}")
    n_examples = tables[0].shape[1]
    k = max(1, int(round(share * n_examples)))

    def per_example(plan: list[int]) -> np.ndarray:
        return np.sum([t[o] for t, o in zip(tables, plan, strict=True)], axis=0)

    plan = choose_options([t.mean(axis=1).tolist() for t in tables], costs, capacity, unit)
    best, history = plan, [tail_loss(per_example(plan), share)]
    weights = np.zeros(n_examples)
    for played in range(rounds):
        answer = np.zeros(n_examples)
        answer[np.argsort(per_example(plan), kind="stable")[-k:]] = 1 / k
        weights = (weights * played + answer) / (played + 1)
        plan = choose_options([(t @ weights).tolist() for t in tables], costs, capacity, unit)
        history.append(tail_loss(per_example(plan), share))
        if history[-1] < min(history[:-1]):
            best = plan
    return best, history


# ---------------------------------------------------------------------------------------
# Plans


@checked_class(estimated_gain=lambda value, name, arguments: None)  # NaN: no gain estimated
@dataclass(frozen=True)
class Plan:
    """A bit width per block linear weight, and what it costs.

    Attributes:
        spec: the method spec with its per-module bit map: what :func:`interp.quant.quantize` takes.
        widths: ``"layer.role"`` -> bits for every weight.
        budget: the average bits per weight asked for.
        achieved: the plan's average bits per weight (scales and zero-points counted).
        ends: the averages of the all-low and all-high plans.
        strategy: ``"interp"`` (sensitivity greedy), ``"heuristic"``, ``"random"``...
        settings: how it was made (bits, sensitivity spec and examples, seed).

    Example:
        >>> import torch
        >>> import interp
        >>> from interp.quant import prescribe
        >>> model = interp.tiny_model("llama")
        >>> generator = torch.Generator().manual_seed(0)
        >>> cal = interp.Examples.from_tokens(torch.randint(0, 256, (4, 16), generator=generator))
        >>> plan = prescribe(model, "rtn", bits=(2, 4), budget=3.5, calibration=cal, group=32, progress=False)
        >>> plan.ends[0] < plan.achieved <= 3.5 < plan.ends[1], sorted(set(plan.widths.values()))
        (True, [2, 4])
    """

    spec: str
    widths: dict[str, int]
    budget: float
    achieved: float
    ends: tuple[float, float]
    strategy: str
    estimated_gain: float = math.nan
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        from interp.io import sanitize

        return sanitize({"spec": self.spec, "strategy": self.strategy, "budget": self.budget,
                         "achieved_average_bits": self.achieved, "ends_average_bits": list(self.ends),
                         "estimated_gain_nats": self.estimated_gain, "widths": self.widths,
                         "settings": self.settings})

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write ``plan.json``; ``interp quantize ... --method @FOLDER/plan.json`` quantizes with it."""
        from interp.io import ensure_writable_dir, write_json

        path = ensure_writable_dir(Path(folder)) / PLAN_FILE
        write_json(path, self.to_dict())
        return path


def plan_from_order(shapes: Sequence[WeightShape], spec: MethodSpec, bits: tuple[int, int], budget: float,
                    order: Sequence[int], strategy: str, values: Sequence[float] | None = None,
                    settings: dict[str, Any] | None = None) -> Plan:
    """The plan that raises weights to ``bits[1]`` in ``order`` while the budget allows (:func:`fill`)."""
    low, high = bits
    base = [weight_bits(s, spec, low) for s in shapes]
    costs = [weight_bits(s, spec, high) - b for s, b in zip(shapes, base, strict=True)]
    total = sum(s.size for s in shapes)
    capacity = math.floor(budget * total) - sum(base)  # integer bits: the average stays <= budget
    taken = set(fill(order, costs, capacity))
    widths = [high if i in taken else low for i in range(len(shapes))]
    modules = {s.name: w for s, w in zip(shapes, widths, strict=True)}
    mixed = MethodSpec(spec.method, low, spec.group, spec.params, modules)
    ends = (average_bits(shapes, spec, [low] * len(shapes)), average_bits(shapes, spec, [high] * len(shapes)))
    gain = float(sum(values[i] for i in taken)) if values is not None else math.nan
    return Plan(str(mixed), modules, float(budget), average_bits(shapes, spec, widths), ends, strategy, gain,
                dict(settings or {}))


def validate_request(method: str, bits: Sequence[int], budget: float, group: int = 64,
                     shapes: Sequence[WeightShape] | None = None) -> tuple[MethodSpec, tuple[int, int]]:
    """Check a prescription request before any model loads; return the low-width spec and ``(low, high)``.

    Raises:
        SpecError: an unknown method, not two distinct widths the method supports, or a budget not
            strictly between the two ends' averages (computed from ``shapes`` when given, else
            from the per-weight formula, which equals it when ``group`` divides every ``d_in``).
    """
    if len(bits) != 2 or bits[0] == bits[1]:
        raise SpecError(f"give two different bit widths, low and high, e.g. 3,4; got {','.join(map(str, bits))}")
    low, high = sorted(int(b) for b in bits)
    spec = parse_spec(f"{method}:bits={low},group={group}")  # unknown method or unsupported low width
    if high not in METHODS[spec.method].bits:
        raise SpecError(f"{spec.method} supports bits {METHODS[spec.method].bits_text()}, got bits={high}")
    if shapes:
        ends = (average_bits(shapes, spec, [low] * len(shapes)), average_bits(shapes, spec, [high] * len(shapes)))
    else:
        ends = (low + group_overhead_bits(spec, low) / group, high + group_overhead_bits(spec, high) / group)
    if not (isinstance(budget, (int, float)) and ends[0] < budget < ends[1]):
        raise SpecError(
            f"budget {budget} bits per weight must lie strictly between the all-{low}-bit and all-{high}-bit "
            f"averages, {ends[0]:g} and {ends[1]:g} ({spec.method} at group {group}: scales and zero-points "
            f"cost {group_overhead_bits(spec, low)} bits per group of {group})")
    return spec, (low, high)


def model_shapes(model: Model) -> list[WeightShape]:
    """Every block linear weight of ``model``, in (layer, role) forward order."""
    from interp.runtime import hooks

    out = []
    for layer in range(hooks.n_layers(model)):
        slots = hooks.linear_weights(model, layer)
        for role in ROLE_ORDER:
            if role in slots:
                d_out, d_in = slots[role].read().shape
                out.append(WeightShape(layer, role, int(d_out), int(d_in)))
    return out


def sensitivity_rows(calibration: Examples, n: int | None, seq_len: int | None) -> Examples:
    """The first ``n`` calibration examples, cut to their first ``seq_len`` tokens (None: all)."""
    rows = calibration if n is None else calibration.subset(list(range(min(n, len(calibration)))))
    if seq_len is None or seq_len >= rows.seq_len:
        return rows
    from interp.data import Examples

    return Examples.from_tokens(rows.tokens[:, :seq_len], ids=rows.ids)


@checked
def prescribe(model: Model, method: str = "gptq", bits: Sequence[int] = (3, 4), budget: float = 4.0,
              calibration: Examples | None = None, group: int = 64, sensitivity_n: int | None = None,
              sensitivity_seq_len: int | None = None, batch_size: int = 8, progress: bool | None = None,
              cache_dir: str | os.PathLike[str] | None = None) -> Plan:
    """A mixed-precision plan for ``model`` under ``budget`` average bits per weight.

    Args:
        model: the reference bridge.
        method: a registered quantizer (``gptq``, ``awq``, ``rtn``, ``nf``, ``hqq``).
        bits: the two widths, e.g. ``(3, 4)``.
        budget: average bits per weight, scales and zero-points counted (module docstring).
        calibration: calibration examples (``split="calibration"``): the calibrated method's
            calibration, and the examples the sensitivity is measured on.
        group: group size.
        sensitivity_n: measure the sensitivity on the first this many calibration examples
            (default all): its cost grows with it.
        sensitivity_seq_len: and on their first this many tokens (default all).
        cache_dir: the root of the quantized-model and sensitivity caches (default ``$INTERP_CACHE``).

    Returns:
        The :class:`Plan`; ``plan.spec`` quantizes with it: ``interp.quant.quantize(model, plan.spec, ...)``.

    Example:
        >>> import torch
        >>> import interp
        >>> from interp.quant import prescribe
        >>> model = interp.tiny_model("llama")
        >>> tokens = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(0))
        >>> rows = interp.Examples.from_tokens(tokens)
        >>> plan = prescribe(model, "rtn", bits=(2, 4), budget=3.5, calibration=rows, group=32, progress=False)
        >>> plan.achieved <= 3.5, sorted(set(plan.widths.values()))
        (True, [2, 4])
    """
    from interp.quant.sensitivity import sensitivity

    shapes = model_shapes(model)
    spec, widths = validate_request(method, bits, budget, group, shapes)
    if calibration is None:
        raise SpecError("prescribe measures sensitivity on calibration text: pass calibration=interp.load_examples("
                        "..., split='calibration')")
    rows = sensitivity_rows(calibration, sensitivity_n, sensitivity_seq_len)
    scores = sensitivity(model, spec, rows, calibration=calibration, batch_size=batch_size, progress=progress,
                         cache_dir=cache_dir)
    by_name = dict(zip(scores.names, scores.scores, strict=True))
    values = [float(by_name[s.name]) for s in shapes]
    costs = [weight_bits(s, spec, widths[1]) - weight_bits(s, spec, widths[0]) for s in shapes]
    settings = {"method": spec.method, "group": group, "bits": list(widths), "sensitivity_spec": scores.spec,
                "sensitivity_examples": scores.settings.get("n"), "sensitivity_seconds": scores.settings.get("seconds"),
                "calibration": dict(calibration.settings), "score": "NLL increase with only that weight quantized "
                                                                    "at the low width (nats)"}
    return plan_from_order(shapes, spec, widths, budget, greedy_order(values, costs), "interp", values, settings)


# ---------------------------------------------------------------------------------------
# Validation: strategies compared at equal budgets on held-out examples


@dataclass(frozen=True)
class Validation:
    """Held-out comparison of allocation strategies, one row per (budget, strategy).

    ``table`` columns: ``budget``, ``strategy``, ``average_bits``, ``mean_error`` (mean per-example
    NLL increase over the reference, nats), ``diff``/``diff_low``/``diff_high`` (strategy minus
    interp's plan, paired bootstrap 95% interval; negative: the strategy is better), the same three
    on D_large (``large_*``), and ``gap_closed``/``gap_low``/``gap_high``: the share of the
    all-low-to-all-high gap in mean error the strategy closes. The two ends have ``budget`` NaN.
    """

    table: Any  # pandas.DataFrame
    settings: dict[str, Any] = field(default_factory=dict)


def compare_strategies(errors: Any, meta: dict[str, tuple[str, float, float]], large_ids: Sequence[Any],
                       low: str, high: str, reference: str = "interp", n_boot: int = 2000, seed: int = 0
                       ) -> Validation:
    """Mean and D_large error of each strategy, paired-bootstrap against ``reference`` at the same budget.

    Args:
        errors: a DataFrame of per-example errors (rows: examples, columns: plan names).
        meta: plan name -> (strategy, budget, achieved average bits); the all-low and all-high
            plans (``low``, ``high``) have budget NaN.
        large_ids: the D_large rows (index labels of ``errors``).
        low, high: the columns of the two ends (the gap's endpoints).
        reference: the strategy every other is compared with at its budget.
        n_boot, seed: bootstrap resamples (the same example draws for every statistic).
    """
    import numpy as np
    import pandas as pd

    from interp import stats

    values = errors.to_numpy(dtype=np.float64)
    columns = list(errors.columns)
    large = np.asarray([errors.index.get_loc(i) for i in large_ids])
    index = stats.bootstrap_indices(len(errors), n_boot, seed)
    index_large = stats.bootstrap_indices(len(large), n_boot, seed + 1)
    boot = values[index].mean(axis=1)  # [n_boot, plans]
    boot_large = values[large][index_large].mean(axis=1)
    gap = boot[:, columns.index(low)] - boot[:, columns.index(high)]
    point_gap = values[:, columns.index(low)].mean() - values[:, columns.index(high)].mean()
    by_budget = {(s, b): name for name, (s, b, _) in meta.items()}
    rows = []
    for name, (strategy, budget, achieved) in meta.items():
        j = columns.index(name)
        ref = by_budget.get((reference, budget))
        row = {"budget": budget, "strategy": strategy, "average_bits": achieved, "mean_error": values[:, j].mean(),
               "large_error": values[large, j].mean()}
        if ref is not None and ref != name:
            k = columns.index(ref)
            for prefix, sample, point in (("", boot, values), ("large_", boot_large, values[large])):
                d = sample[:, j] - sample[:, k]
                row.update({f"{prefix}diff": point[:, j].mean() - point[:, k].mean(),
                            f"{prefix}diff_low": np.percentile(d, 2.5), f"{prefix}diff_high": np.percentile(d, 97.5)})
        closed = (boot[:, columns.index(low)] - boot[:, j]) / gap
        row.update({"gap_closed": (values[:, columns.index(low)].mean() - values[:, j].mean()) / point_gap,
                    "gap_low": np.percentile(closed, 2.5), "gap_high": np.percentile(closed, 97.5)})
        rows.append(row)
    table = pd.DataFrame(rows)
    return Validation(table, {"n": len(errors), "n_large": len(large), "n_boot": n_boot, "seed": seed,
                              "reference": reference, "low": low, "high": high})


# ---------------------------------------------------------------------------------------
# A llama.cpp plan: a tensor type per block weight, chosen by the output-error proxy


@dataclass(frozen=True)
class LlamaPlan:
    """A llama.cpp type per block linear weight (after the shape fallback) and what it costs.

    Attributes:
        types: ``"layer.role"`` -> ggml type, e.g. ``"12.down": "q6_k"``.
        budget, achieved: asked and reached bits per weight over the block linear weights.
        ends: the averages with every weight at its cheapest and at its dearest option.
        baselines: llama.cpp's own mixes' averages on this model (``Q4_K_M``...).
        estimated_loss: the summed proxy of the chosen options.
        settings: widths, proxy examples and seconds.
    """

    types: dict[str, str]
    budget: float
    achieved: float
    ends: tuple[float, float]
    baselines: dict[str, float]
    estimated_loss: float
    settings: dict[str, Any] = field(default_factory=dict)

    def save(self, folder: str | os.PathLike[str], shapes: Sequence[WeightShape]) -> Path:
        """Write ``tensor_types.txt`` (``llama-quantize --tensor-type-file``) and ``llama_plan.json``."""
        from interp.io import ensure_writable_dir, sanitize, write_json
        from interp.quant.llama_cpp import write_tensor_types

        out = ensure_writable_dir(Path(folder))
        write_json(out / "llama_plan.json", sanitize({
            "types": self.types, "budget": self.budget, "achieved_bits_per_weight": self.achieved,
            "ends_bits_per_weight": list(self.ends), "llama_cpp_mixes_bits_per_weight": self.baselines,
            "estimated_loss": self.estimated_loss, "settings": self.settings}))
        return write_tensor_types(out / "tensor_types.txt", shapes, self.types)


# the width each stored type is scored at (the proxy's RTN grid of that many bits)
TYPE_SCORE_BITS = {"q2_k": 2, "q3_k": 3, "q4_0": 4, "q4_1": 4, "q4_k": 4, "q5_0": 5, "q5_1": 5, "q5_k": 5,
                   "q6_k": 6, "q8_0": 8}


def llama_options(shapes: Sequence[WeightShape], widths: Sequence[int]) -> list[list[str]]:
    """Per weight, the distinct stored llama.cpp types the ``widths`` give it (fallback applied), cheapest first."""
    from interp.quant.llama_cpp import bits_per_weight, type_for_bits

    options = []
    for s in shapes:
        types = dict.fromkeys(type_for_bits(b, s.d_in) for b in sorted(widths))
        options.append(sorted(types, key=bits_per_weight))
    return options


# per width, the llama.cpp types of that many bits: the K-quant (BITS_TYPES) and the legacy types beside it
WIDTH_TYPES = {2: ("q2_k",), 3: ("q3_k",), 4: ("q4_k", "q4_0", "q4_1"), 5: ("q5_k", "q5_0", "q5_1"), 6: ("q6_k",),
               8: ("q8_0",)}


def exact_options(shapes: Sequence[WeightShape], widths: Sequence[int]) -> list[list[str]]:
    """Per weight, every llama.cpp type of the ``widths`` its input width stores as asked (K-quant or legacy),
    falling back as llama.cpp does where none of a width's types fits; cheapest first."""
    from interp.quant.llama_cpp import GGML_TYPES, bits_per_weight, fallback

    options = []
    for s in shapes:
        found: dict[str, None] = {}
        for bits in sorted(widths):
            fits = [t for t in WIDTH_TYPES[bits] if s.d_in % GGML_TYPES[t][0] == 0]
            found.update(dict.fromkeys(fits or [fallback(WIDTH_TYPES[bits][0], s.d_in)]))
        options.append(sorted(found, key=bits_per_weight))
    return options


def candidate_options(shapes: Sequence[WeightShape], widths: Sequence[int] | None, score: str = "proxy",
                      types: Sequence[str] | None = None, exclude: Sequence[str] = ()) -> list[list[str]]:
    """Per weight, the llama.cpp types a plan may give it.

    With ``types``: each listed type, or where the weight's input width does not take it, the type
    llama.cpp stores instead (:func:`~interp.quant.llama_cpp.fallback`: Q4_K -> Q5_0...), without
    repeats, in the listed order. Otherwise the ``widths``' types: :func:`exact_options` for the
    Fisher score, :func:`llama_options` for the proxy. ``exclude`` then removes types (after the
    fallback, so an excluded type never comes back as another's stand-in).

    Raises:
        SpecError: a type llama.cpp does not know, or a weight left with no type.

    Example:
        >>> shapes = [WeightShape(0, "q", 576, 576), WeightShape(0, "down", 576, 1536)]
        >>> candidate_options(shapes, None, types=["q4_k", "q4_0", "q6_k"], exclude=["q8_0"])
        [['q5_0', 'q4_0'], ['q4_k', 'q4_0', 'q6_k']]
    """
    from interp.quant.llama_cpp import check_type, fallback

    dropped = {check_type(t) for t in exclude}
    if types:
        wanted = [check_type(t) for t in types]
        base = [list(dict.fromkeys(fallback(t, s.d_in) for t in wanted)) for s in shapes]
    else:
        base = exact_options(shapes, widths or ()) if score == "fisher" else llama_options(shapes, widths or ())
    out = [[t for t in opts if t not in dropped] for opts in base]
    empty = [(s, opts) for s, opts, kept in zip(shapes, base, out, strict=True) if not kept]
    if empty:
        s, opts = empty[0]
        raise SpecError(f"no candidate type is left for {len(empty)} weights, e.g. {s.name} (input width {s.d_in}, "
                        f"which stores {', '.join(opts)}): --exclude-types removed them all")
    return out


def nominal_types(widths: Sequence[int] | None, types: Sequence[str] | None = None,
                  exclude: Sequence[str] = ()) -> list[str]:
    """The types a request names before any shape is known: ``types``, or the widths' llama.cpp types, less
    ``exclude`` (SpecError for an unknown name or nothing left)."""
    from interp.quant.llama_cpp import BITS_TYPES, check_type

    dropped = {check_type(t) for t in exclude}
    named = [check_type(t) for t in types] if types else [t for b in widths or () for t in WIDTH_TYPES.get(b, ())]
    left = [t for t in dict.fromkeys(named) if t not in dropped]
    if not left:
        raise SpecError(f"--exclude-types {','.join(sorted(dropped))} leaves no candidate type of "
                        f"{','.join(named) or ','.join(BITS_TYPES[b] for b in widths or () if b in BITS_TYPES)}")
    return left


def check_llama_budget(shapes: Sequence[WeightShape] | None, widths: Sequence[int] | None, budget: float,
                       score: str = "proxy", types: Sequence[str] | None = None,
                       exclude: Sequence[str] = ()) -> tuple[float, float]:
    """The cheapest and dearest averages the candidates allow (nominal types without ``shapes``); SpecError outside.

    The candidates are :func:`candidate_options` (``types``, or the ``widths``' types, less ``exclude``).
    Without ``shapes`` the ends are the cheapest listed type and the dearest type a listed one can
    fall back to, so a budget refused here is refused on every model."""
    from interp.quant.llama_cpp import BITS_TYPES, FALLBACK, bits_per_weight

    if not types:
        bad = [b for b in widths or () if b not in BITS_TYPES or BITS_TYPES[b] not in TYPE_SCORE_BITS]
        if bad or len(set(widths or ())) < 2:
            raise SpecError(f"give at least two widths from {', '.join(str(b) for b in (2, 3, 4, 5, 6, 8))} for "
                            f"llama.cpp types; got {','.join(map(str, widths or ()))}")
    if shapes:
        total = sum(s.size for s in shapes)
        choices = candidate_options(shapes, widths, score, types, exclude)
        per = [sorted(bits_per_weight(t) for t in opts) for opts in choices]
        ends = (sum(s.size * p[0] for s, p in zip(shapes, per, strict=True)) / total,
                sum(s.size * p[-1] for s, p in zip(shapes, per, strict=True)) / total)
    elif types or exclude:
        named = nominal_types(widths, types, exclude)
        ends = (min(bits_per_weight(t) for t in named),
                max(bits_per_weight(FALLBACK.get(t, t)) for t in named) if types else
                max(bits_per_weight(t) for t in named))
    else:
        ends = (bits_per_weight(BITS_TYPES[min(widths or ())]), bits_per_weight(BITS_TYPES[max(widths or ())]))
    if not (isinstance(budget, (int, float)) and ends[0] <= budget <= ends[1]):
        where = ("on this model (llama.cpp's shape fallback counted)" if shapes else
                 "for these types" if types or exclude else "for these widths' types")
        what = f"types {','.join(types)}" if types else f"widths {','.join(map(str, widths or ()))}"
        if exclude:
            what += f" less {','.join(exclude)}"
        raise SpecError(f"budget {budget} bits per weight is outside what {what} allow {where}: {ends[0]:.4f} to "
                        f"{ends[1]:.4f}")
    return ends


# (layer, role, W) -> {type: the weight as llama.cpp stores it in that type, dequantized}, for the types it knows
Rounded = Callable[[int, str, Any], Mapping[str, Any]]


@dataclass(frozen=True)
class LlamaScores:
    """What a llama.cpp plan is chosen from: each block linear weight's candidate types and their scores.

    Attributes:
        shapes: the block linear weights, in the model's order.
        options: per weight, its candidate types (:func:`candidate_options`).
        losses: per weight and option, the score (the proxy, or KL nats per token for ``fisher``).
        settings: how the scores were made.
    """

    shapes: list[WeightShape]
    options: list[list[str]]
    losses: list[list[float]]
    settings: dict[str, Any] = field(default_factory=dict)

    def cheapest_bytes(self) -> int:
        """Bytes of the block linear weights with every weight at its cheapest candidate."""
        from interp.quant.llama_cpp import tensor_bytes

        return sum(min(tensor_bytes(t, s.d_out, s.d_in) for t in opts)
                   for s, opts in zip(self.shapes, self.options, strict=True))


def score_llama_options(model: Model, calibration: Examples, widths: Sequence[int] | None = (3, 4, 5, 6, 8),
                        chunks: int = 8, batch_size: int = 8, progress: bool | None = None, score: str = "proxy",
                        seed: int = 0, types: Sequence[str] | None = None, exclude: Sequence[str] = (),
                        rounded: Rounded | None = None) -> LlamaScores:
    """Score every candidate type (:func:`candidate_options`) of every block linear weight.

    ``score="proxy"``: each type is scored by the output-error proxy (``proxy_sensitivity`` of the
    sensitivity module) at its width (RTN, group 32).

    ``score="fisher"``: each type is scored by :func:`~interp.quant.fisher.fisher_sensitivity`
    (KL nats per token) on the weight as llama.cpp stores it: ``rounded``'s weight where it gives
    one (llama.cpp's own, e.g. :func:`interp.quant.llama_cpp_run.pure_rounding`), else exactly for
    the legacy types (:func:`~interp.quant.llama_cpp.stored_weight`) and through the RTN stand-in at
    the type's width for K-quants.
    """
    from interp.quant.llama_cpp import LEGACY_TYPES, stored_weight

    if score not in ("proxy", "fisher"):
        raise SpecError(f"score must be 'proxy' or 'fisher'; got {score!r}")
    shapes = model_shapes(model)
    options = candidate_options(shapes, widths, score, types, exclude)
    if score == "fisher":
        from interp.quant.fisher import fisher_sensitivity
        from interp.quant.methods import quantize_weight

        allowed = {s.name: opts for s, opts in zip(shapes, options, strict=True)}

        def stored(layer: int, role: str, W: Any) -> dict[str, Any]:
            exact = dict(rounded(layer, role, W)) if rounded is not None else {}
            return {t: exact[t] if t in exact else stored_weight(W, t) if t in LEGACY_TYPES else
                    quantize_weight(W, f"rtn:bits={TYPE_SCORE_BITS[t]},group=32") for t in allowed[f"{layer}.{role}"]}

        fisher = fisher_sensitivity(model, calibration, stored, chunks=chunks, batch_size=batch_size, seed=seed,
                                    progress=progress)
        table = fisher.scores()
        by_name = {name: {t: float(table[w, o]) for o, t in enumerate(fisher.options[w])}
                   for w, name in enumerate(fisher.names)}
        losses = [[by_name[s.name][t] for t in opts] for s, opts in zip(shapes, options, strict=True)]
        rounding = ("every type as llama-quantize stores it" if rounded is not None else
                    "legacy types exact, K-quants by RTN group 32")
        spent, how = fisher.settings["seconds"], ("1/2 g² (ΔW x)² per token (KL nats), g the output gradient of "
                                                  f"sampled labels; {rounding}")
    else:
        from interp.quant.sensitivity import proxy_sensitivity

        score_bits = sorted({TYPE_SCORE_BITS[t] for opts in options for t in opts})
        proxy = proxy_sensitivity(model, calibration, tuple(score_bits), chunks=chunks, batch_size=batch_size,
                                  progress=progress)
        scores = dict(zip(proxy.names, proxy.scores(), strict=True))
        losses = [[float(scores[s.name][score_bits.index(TYPE_SCORE_BITS[t])]) for t in opts]
                  for s, opts in zip(shapes, options, strict=True)]
        spent, how = proxy.settings["seconds"], "tr(ΔW H ΔWᵀ) per calibration token at the type's width (RTN, group 32)"
    settings = {"widths": list(widths) if widths and not types else None, "types": list(types) if types else None,
                "exclude_types": list(exclude), "score_name": score, "score_examples": len(calibration),
                "score_seconds": spent, "calibration": dict(calibration.settings), "score": how}
    return LlamaScores(shapes, options, losses, settings)


def choose_llama_types(scores: LlamaScores, budget: float | None = None, capacity_bytes: int | None = None
                       ) -> LlamaPlan:
    """The least summed score whose cost fits: ``budget`` bits per weight, or ``capacity_bytes`` bytes.

    Either way over the block linear weights, and :func:`choose_options` picks (cost resolution:
    1/50000 of the capacity). With ``budget`` each option costs its bits; with ``capacity_bytes``
    its bytes (what llama.cpp writes; the registered runs' accounting), and the plan's ``budget``
    is that capacity in bits per weight.

    Raises:
        SpecError: neither or both given, or a capacity below every weight's cheapest candidate.
    """
    from interp.quant.llama_cpp import MIXES, bits_per_weight, mix_types, tensor_bytes, types_average_bits

    if (budget is None) == (capacity_bytes is None):
        raise SpecError("give a budget in bits per weight or a capacity in bytes, not both")
    shapes, options, losses = scores.shapes, scores.options, scores.losses
    total = sum(s.size for s in shapes)
    per = [sorted(bits_per_weight(t) for t in opts) for opts in options]
    ends = (sum(s.size * p[0] for s, p in zip(shapes, per, strict=True)) / total,
            sum(s.size * p[-1] for s, p in zip(shapes, per, strict=True)) / total)
    if budget is not None:
        costs = [[round(s.size * bits_per_weight(t)) for t in opts] for s, opts in zip(shapes, options, strict=True)]
        capacity = math.floor(budget * total)
    else:
        costs = [[tensor_bytes(t, s.d_out, s.d_in) for t in opts] for s, opts in zip(shapes, options, strict=True)]
        capacity = int(capacity_bytes or 0)
        if capacity < scores.cheapest_bytes():
            raise SpecError(f"{capacity} bytes for the block linear weights is below their cheapest types' "
                            f"{scores.cheapest_bytes()} bytes ({ends[0]:.4f} bits per weight)")
        budget = 8 * capacity / total
    chosen = choose_options(losses, costs, capacity, unit=max(1, capacity // 50000))
    types = {s.name: opts[o] for s, opts, o in zip(shapes, options, chosen, strict=True)}
    baselines = {mix: types_average_bits(shapes, mix_types(shapes, mix)) for mix in MIXES}
    settings = {**scores.settings, **({"capacity_bytes": capacity} if capacity_bytes is not None else {})}
    return LlamaPlan(types, float(budget), types_average_bits(shapes, types), ends, baselines,
                     float(sum(loss[o] for loss, o in zip(losses, chosen, strict=True))), settings)


def prescribe_llama_cpp(model: Model, budget: float, calibration: Examples,
                        widths: Sequence[int] | None = (3, 4, 5, 6, 8), chunks: int = 8, batch_size: int = 8,
                        progress: bool | None = None, score: str = "proxy", seed: int = 0,
                        types: Sequence[str] | None = None, exclude: Sequence[str] = (),
                        rounded: Rounded | None = None) -> LlamaPlan:
    """llama.cpp types for every block linear weight under ``budget`` bits per weight.

    The candidates are :func:`candidate_options`: the ``widths``' types, or ``types``, less
    ``exclude``. ``score="proxy"``: each weight's options are the types its widths give it after
    llama.cpp's shape fallback, each scored by :func:`~interp.quant.sensitivity.proxy_sensitivity`
    at that type's width (RTN, group 32).

    ``score="fisher"``: the options are every type of those widths the weight's input width stores
    as asked (Q4_0 and Q4_1 beside Q4_K...), each scored by
    :func:`~interp.quant.fisher.fisher_sensitivity` (KL nats per token) on the weight as llama.cpp
    would store it: ``rounded``'s weights where given (llama.cpp's own), else exactly for the
    legacy types (:func:`~interp.quant.llama_cpp.stored_weight`) and through the RTN stand-in at
    the type's width for K-quants.

    Either way each option costs its type's bits per weight, and :func:`choose_options` picks the
    least summed score that fits (cost resolution: 1/50000 of the budget): see
    :func:`score_llama_options` and :func:`choose_llama_types`.
    """
    if score not in ("proxy", "fisher"):
        raise SpecError(f"score must be 'proxy' or 'fisher'; got {score!r}")
    check_llama_budget(model_shapes(model), widths, budget, score, types, exclude)  # before any scoring
    scores = score_llama_options(model, calibration, widths, chunks=chunks, batch_size=batch_size, progress=progress,
                                 score=score, seed=seed, types=types, exclude=exclude, rounded=rounded)
    return choose_llama_types(scores, budget)
