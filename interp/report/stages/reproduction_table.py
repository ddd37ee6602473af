"""The reproduction table: every stage's claim measurements judged by the pre-registered rules."""

from __future__ import annotations

import pandas as pd

from interp.report.context import ReportSettings, StageOutput
from interp.report.reproduction import (
    CLAIMS,
    measurement_from_dict,
    reproduction_frame,
)


def reproduction_table(outputs: dict[str, StageOutput], settings: ReportSettings) -> pd.DataFrame:
    """The pre-registered claims (:mod:`interp.report.reproduction`) judged on what the stages measured."""

    measurements = {}
    for output in outputs.values():
        for key, value in (output.numbers.get("claims") or {}).items():
            measurements[key] = measurement_from_dict(value)
    return reproduction_frame(measurements, list(CLAIMS))
