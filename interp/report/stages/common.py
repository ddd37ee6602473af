"""What several report stages share: the quantized copies, the per-example errors, the D_large
split, and the one way a stage hands in its measurements for the reproduction table
(:func:`record_claims`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from interp.models import cache_dir
from interp.quant.analysis.error_split import ErrorSplit, error_split
from interp.quant.spec import parse_spec
from interp.report.context import ReportContext, StageOutput
from interp.report.reproduction import Measurement, measurement_to_dict

N_BOOT = 1000  # bootstrap resamples for every interval in the quantization stages


def setup(ctx: ReportContext) -> ErrorSplit:
    """Every method's per-example errors, D_large/D_ctrl and the quantized models: the one setup
    (:func:`interp.quant.error_split`) that the quantization, lens and patching stages share.

    D_large comes from the patched method's *own* error (the paper's localization protocol). The
    scores resume from ``OUT/scores.sqlite``; quantized weights live in the user cache
    (``$INTERP_CACHE/quantized``), shared across reports, so a report folder stays small (a
    quantized SmolLM2 copy is ~0.5 GB in float32).
    """
    if "setup" not in ctx.cache:
        ctx.collective("scoring")
        s = ctx.settings
        needs_cal = any(spec.needs_calibration for spec in s.specs)
        store, cache = ctx.out / "scores.sqlite", cache_dir() / "quantized"
        common: dict[str, Any] = dict(calibration=ctx.calibration if needs_cal else None, split_on=s.patch_spec,
                                      cache_dir=cache, seed=s.seed, batch_size=s.batch_size, progress=ctx.progress)
        if ctx.world_size > 1:  # torchrun: each rank scores its batches; every rank reads the merged store
            errors = _scored_over_ranks(ctx, store, cache, common["calibration"])
            ctx.cache["setup"] = error_split(ctx.model, list(s.specs), ctx.examples, errors=errors, **common)
        else:
            ctx.cache["setup"] = error_split(ctx.model, list(s.specs), ctx.examples, store=store, **common)
    return ctx.cache["setup"]


def _scored_over_ranks(ctx: ReportContext, store: Path, cache: Path, calibration: Any) -> pd.DataFrame:
    """Every method's per-example errors, scored by :func:`interp.quant.distributed.score_distributed`
    (whole batches per rank, merged into ``store`` by rank 0), read back by every rank."""
    from interp.quant.apply import model_hash
    from interp.quant.distributed import score_distributed
    from interp.quant.store import ScoreStore

    s = ctx.settings
    score_distributed(ctx.model, list(s.specs), ctx.examples, store, cache_dir=cache, batch_size=s.batch_size,
                      calibration=calibration, progress=ctx.progress)
    with ScoreStore(store) as scores:  # score_distributed returns on every rank after rank 0's merge
        return scores.errors_frame(model_hash(ctx.model), [str(spec) for spec in s.specs],
                                   ctx.examples.ids, complete=False)


def quantized_weights(ctx: ReportContext, spec: str) -> Any:
    """One copy of the weights: ``spec``'s quantized block weights alone (the cache folder, quantized
    there first if absent), which the stages swap into the reference (``ctx.stash`` keeps its own)."""
    return setup(ctx).weights(spec, ctx.stash)


def method_errors(ctx: ReportContext) -> pd.DataFrame:
    """Per-example errors for every method (resumable: the SQLite store keeps finished batches)."""
    return setup(ctx).errors


def patched_spec(ctx: ReportContext) -> str:
    return str(ctx.settings.patch_spec)


def short_spec(spec: str) -> str:
    """A spec as a figure title names it: ``"gptq:bits=3,group=64,..."`` -> ``"GPTQ 3-bit (group 64)"``."""
    parsed = parse_spec(spec)
    return f"{parsed.method.upper()} {parsed.bits}-bit (group {parsed.group})"


def d_large_split(ctx: ReportContext) -> Any:
    """D_large / D_ctrl chosen from the patched method's own error."""
    return setup(ctx).split


def spec_bits(spec: str) -> int:
    return int(parse_spec(spec).bits)


def record_claims(out: StageOutput, claims: dict[str, Measurement]) -> None:
    out.numbers["claims"] = {key: measurement_to_dict(m) for key, m in claims.items()}
