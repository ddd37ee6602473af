"""A llama.cpp plan: a tensor type per block weight, chosen by the output-error proxy (or Fisher scores).

:func:`prescribe_llama_cpp` scores every candidate llama.cpp type of every block linear weight
(:func:`score_llama_options`) and picks one per weight under a budget (:func:`choose_llama_types`), with the
multiple-choice knapsack of :mod:`interp.quant.prescribe`; the :class:`LlamaPlan` it returns writes the
``--tensor-type-file`` llama-quantize reads. Every name here is importable from :mod:`interp.quant.prescribe` too.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from interp.errors import SpecError
from interp.quant.prescribe import choose_options, model_shapes
from interp.quant.shapes import WeightShape

if TYPE_CHECKING:
    from interp.data import Examples
    from interp.models import Model  # loads torch: the CLI imports this module while parsing options

__all__ = ["LlamaPlan", "LlamaScores", "candidate_options", "check_llama_budget", "choose_llama_types", "exact_options",
           "llama_options", "nominal_types", "prescribe_llama_cpp", "score_llama_options"]

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
        from interp.io import sanitize, saving, write_json
        from interp.quant.llama_cpp import write_tensor_types

        with saving(Path(folder), "llama-plan", own=("llama_plan.json", "tensor_types.txt")) as out:
            write_json(out / "llama_plan.json", sanitize({  # INCOMPLETE until both files are in
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
                        rounded: Rounded | None = None, imatrix: Any = None) -> LlamaScores:
    """Score every candidate type (:func:`candidate_options`) of every block linear weight.

    ``score="proxy"``: each type is scored by the output-error proxy (``proxy_sensitivity`` of the
    sensitivity module) at its width (RTN, group 32).

    ``score="fisher"``: each type is scored by :func:`~interp.quant.fisher.fisher_sensitivity`
    (KL nats per token) on the weight as llama.cpp stores it: ``rounded``'s weight where it gives
    one (llama.cpp's own, e.g. :func:`interp.quant.llama_cpp_run.pure_rounding`), else interp's
    rounding of every type, byte-identical to llama-quantize's
    (:func:`~interp.quant.llama_cpp.stored_weight`: gguf-py's for the legacy types, :mod:`interp.quant.kquants`
    for the K-quants). With ``imatrix`` (the :class:`~interp.quant.imatrix.ImportanceMatrix` the
    plan's file is quantized with, ``llama-quantize --imatrix``) interp rounds each weight with its
    entry, as llama-quantize does; a weight the matrix has no entry for is rounded without one,
    as llama-quantize does too.
    """
    from interp.quant.kquants import llama_importance
    from interp.quant.llama_cpp import gguf_name, stored_weight

    if score not in ("proxy", "fisher"):
        raise SpecError(f"score must be 'proxy' or 'fisher'; got {score!r}")
    shapes = model_shapes(model)
    options = candidate_options(shapes, widths, score, types, exclude)
    if score == "fisher":
        from interp.quant.fisher import fisher_sensitivity

        allowed = {s.name: opts for s, opts in zip(shapes, options, strict=True)}

        def stored(layer: int, role: str, W: Any) -> dict[str, Any]:
            exact = dict(rounded(layer, role, W)) if rounded is not None else {}
            name = gguf_name(layer, role)
            weights = llama_importance(imatrix, name) if imatrix is not None and name in imatrix.sums else None
            return {t: exact[t] if t in exact else stored_weight(W, t, weights) for t in allowed[f"{layer}.{role}"]}

        fisher = fisher_sensitivity(model, calibration, stored, chunks=chunks, batch_size=batch_size, seed=seed,
                                    progress=progress)
        table = fisher.scores()
        by_name = {name: {t: float(table[w, o]) for o, t in enumerate(fisher.options[w])}
                   for w, name in enumerate(fisher.names)}
        losses = [[by_name[s.name][t] for t in opts] for s, opts in zip(shapes, options, strict=True)]
        rounding = ("every type as llama-quantize stores it" if rounded is not None else
                    "every type as llama-quantize stores it, by interp's byte-identical rounding")
        rounding += ", with the importance matrix" if imatrix is not None else ""
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

    Either way over the block linear weights, and :func:`~interp.quant.prescribe.choose_options` picks (cost resolution:
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
                        rounded: Rounded | None = None, imatrix: Any = None) -> LlamaPlan:
    """llama.cpp types for every block linear weight under ``budget`` bits per weight.

    The candidates are :func:`candidate_options`: the ``widths``' types, or ``types``, less
    ``exclude``. ``score="proxy"``: each weight's options are the types its widths give it after
    llama.cpp's shape fallback, each scored by ``proxy_sensitivity`` (:mod:`interp.quant.sensitivity`)
    at that type's width (RTN, group 32).

    ``score="fisher"``: the options are every type of those widths the weight's input width stores
    as asked (Q4_0 and Q4_1 beside Q4_K...), each scored by
    :func:`~interp.quant.fisher.fisher_sensitivity` (KL nats per token) on the weight as llama.cpp
    would store it: ``rounded``'s weights where given (llama.cpp's own), else by interp's
    byte-identical rounding of every type (:func:`~interp.quant.llama_cpp.stored_weight`), with
    ``imatrix`` where the file is quantized with that importance matrix.

    Either way each option costs its type's bits per weight, and :func:`~interp.quant.prescribe.choose_options`
    picks the least summed score that fits (cost resolution: 1/50000 of the budget): see
    :func:`score_llama_options` and :func:`choose_llama_types`.
    """
    if score not in ("proxy", "fisher"):
        raise SpecError(f"score must be 'proxy' or 'fisher'; got {score!r}")
    check_llama_budget(model_shapes(model), widths, budget, score, types, exclude)  # before any scoring
    scores = score_llama_options(model, calibration, widths, chunks=chunks, batch_size=batch_size, progress=progress,
                                 score=score, seed=seed, types=types, exclude=exclude, rounded=rounded,
                                 imatrix=imatrix)
    return choose_llama_types(scores, budget)
