"""The sections of ``interp report``, in the order the page shows them.

A section is one module here that defines ``STAGE``: a :class:`~interp.report.context.Stage`
whose function maps a :class:`~interp.report.context.ReportContext` to a
:class:`~interp.report.context.StageOutput`. To add a section, write its module and add one
line to :data:`ORDER`. A stage that measures a pre-registered claim hands it in with
:func:`interp.report.stages.common.record_claims`; the reproduction table collects them.
"""

from __future__ import annotations

from interp.report.context import Stage
from interp.report.stages import (
    agreement,
    attention,
    early_exit,
    norms,
    patching,
    prescribe,
    probes,
    quantization,
    restoration,
    saobp_training,
)

ORDER = [probes, attention, saobp_training, quantization, agreement, norms, early_exit, restoration, patching,
         prescribe]
STAGES: list[Stage] = [module.STAGE for module in ORDER]

__all__ = ["ORDER", "STAGES"]
