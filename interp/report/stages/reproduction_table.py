"""The reproduction table: every stage's claim measurements judged by the pre-registered rules."""

from __future__ import annotations

import pandas as pd

from interp.report import reproduction as rp
from interp.report.context import ReportSettings, StageOutput
from interp.report.reproduction import (
    CLAIMS,
    measurement_from_dict,
    reproduction_frame,
)

# the verdicts a smoke run keeps: none of them concludes anything about the data
KEPT_IN_SMOKE = (rp.NOT_TESTABLE, rp.BY_CONSTRUCTION, rp.DIAGNOSTIC)


def reproduction_table(outputs: dict[str, StageOutput], settings: ReportSettings, smoke: str = "") -> pd.DataFrame:
    """The pre-registered claims (:mod:`interp.report.reproduction`) judged on what the stages measured.

    With ``smoke`` (why the run concludes nothing, e.g. a ``--quick`` run), every verdict that would say
    something about the data is withheld: the row shows the measurement and "too few examples for a verdict".
    """

    measurements = {}
    for output in outputs.values():
        for key, value in (output.numbers.get("claims") or {}).items():
            measurements[key] = measurement_from_dict(value)
    table = reproduction_frame(measurements, list(CLAIMS))
    if smoke:
        withheld = ~table["verdict"].isin(KEPT_IN_SMOKE)
        table.loc[withheld, "verdict"] = rp.TOO_FEW
        table.loc[withheld, "why"] = smoke
    return table
