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
from collections.abc import Sequence
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

__all__ = ["Plan", "WeightShape", "average_bits", "choose_options", "fill", "greedy_order", "group_overhead_bits",
           "heuristic_order", "plan_from_order", "prescribe", "random_order", "validate_request", "weight_bits"]
# the llama.cpp plan's names (LlamaScores, candidate_options, ...) are in interp.quant.llama_plan's __all__

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
        from interp.io import saving, write_json

        with saving(Path(folder), "plan", own=(PLAN_FILE,)) as out:  # INCOMPLETE until it is written
            write_json(out / PLAN_FILE, self.to_dict())
        return out / PLAN_FILE


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


def __getattr__(name: str) -> Any:
    """The llama.cpp plan, still importable from here: it lives in :mod:`interp.quant.llama_plan`, which builds on
    this module's filling rule and shapes (looked up on use, so the two import no cycle)."""
    if name in _LLAMA_PLAN:
        import importlib

        return getattr(importlib.import_module("interp.quant.llama_plan"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_LLAMA_PLAN = ("LlamaPlan", "TYPE_SCORE_BITS", "llama_options", "WIDTH_TYPES", "exact_options", "candidate_options",
               "nominal_types", "check_llama_budget", "LlamaScores", "score_llama_options", "choose_llama_types",
               "prescribe_llama_cpp")
