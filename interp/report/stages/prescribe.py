"""Stage (i): prescription: interp's mixed-precision plan against the heuristics at equal bits.

The held-out validation costs about an hour on two CPU cores (a per-weight sensitivity pass,
then 20 or more quantized models scored), far more than the rest of the report, so this section
reads the committed run of ``benchmarks/prescribe_validation.py`` (``docs/data/prescribe``, the
bundled SmolLM2 with GPTQ 3/4-bit) instead of measuring it again, as the SAOBP training section
reads its committed logs. For another model it says so and names the command that measures it.
Reading the files takes well under a second, so ``--quick`` keeps it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from interp.figures.prescribe import pareto_figure, sensitivity_by_half, sensitivity_figure
from interp.quant.prescribe import Validation
from interp.quant.sensitivity import Sensitivity
from interp.report.context import ReportContext, Stage, StageOutput

MEASURED_MODEL = "smollm2-135m"


def validation_folder() -> Path:
    return Path(__file__).resolve().parents[3] / "docs" / "data" / "prescribe"  # interp/report/stages/ -> root


def stage_prescribe(ctx: ReportContext) -> StageOutput:
    ctx.main_only()  # reads the committed validation run
    folder = validation_folder()
    out = StageOutput()
    if ctx.settings.model != MEASURED_MODEL or not (folder / "validation.csv").is_file():
        out.notes.append(f"Not measured for {ctx.settings.model}: run `python benchmarks/prescribe_validation.py "
                         f"--model {ctx.settings.model}` (about an hour on two CPU cores).")
        return out
    table = pd.read_csv(folder / "validation.csv")
    settings = json.loads((folder / "validation.json").read_text())
    validation = Validation(table, settings)
    out.tables["validation"] = table
    out.figures["pareto"] = pareto_figure(validation)
    if (folder / "sensitivity" / "sensitivity.json").is_file():
        scores = Sensitivity.load(folder / "sensitivity")
        out.figures["sensitivity"] = sensitivity_figure(scores)
        out.figures["sensitivity_halves"] = sensitivity_by_half(scores)
    compared = table[(table["strategy"] == "heuristic") & table.get("diff", pd.Series(dtype=float)).notna()]
    if compared.empty:
        out.notes.append("interp's own plan is not in the committed run yet, so nothing is compared with it.")
    for _, row in compared.iterrows():
        out.numbers[f"heuristic_minus_interp@{row['budget']:g}"] = [row["diff"], row["diff_low"], row["diff_high"]]
    out.notes.append(f"Committed run of benchmarks/prescribe_validation.py: {settings.get('method')}, "
                     f"{settings.get('n')} held-out examples; differences are the strategy minus interp's plan "
                     "(paired bootstrap, 95%).")
    return out


STAGE = Stage("prescribe", "(i) Prescription: a mixed-precision plan under a bit budget",
              "interp's plan (per-weight sensitivity, greedy under the budget) against uniform, llama.cpp-style "
              "and random allocations at equal average bits, on held-out examples.", stage_prescribe, reuse=False)
