"""``interp report``: the offline HTML report that reproduces both papers' analyses.

- :mod:`interp.report.context`: :class:`~interp.report.context.ReportSettings`, the shared
  :class:`~interp.report.context.ReportContext`, ``Stage``;
- :mod:`interp.report.stages`: one module per section and their order;
- :mod:`interp.report.reproduction`: the pre-registered claims and the rules that judge them;
- :mod:`interp.report.run`: :func:`run_report` (resumable stage by stage);
- :mod:`interp.report.html`: the page and :func:`screenshot`.
"""

from __future__ import annotations

from interp.report.context import ReportSettings
from interp.report.html import screenshot
from interp.report.run import run_report

__all__ = ["ReportSettings", "run_report", "screenshot"]
