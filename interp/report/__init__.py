"""``interp report``: the offline HTML report that reproduces both papers' analyses.

- :mod:`interp.report.context`: :class:`~interp.report.context.ReportSettings`, the shared
  :class:`~interp.report.context.ReportContext`, ``Stage``;
- :mod:`interp.report.stages`: one module per section and their order;
- :mod:`interp.report.reproduction`: the pre-registered claims and the rules that judge them;
- :mod:`interp.report.run`: :func:`run_report` (resumable stage by stage);
- :mod:`interp.report.html`: the page and :func:`screenshot`.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

from interp.errors import InterpError
from interp.report.context import ReportSettings
from interp.report.html import screenshot
from interp.report.run import run_report

__all__ = ["ReportSettings", "report", "run_report", "screenshot"]


def report(out: str | Path, quick: bool = False, progress: bool | None = None, static: bool = True,
           **settings: Any) -> dict[str, Any]:
    """Run (or resume) the full report into ``out``; ``interp.report(...)`` calls this.

    Args:
        out: output folder (``index.html``, tables, figures, ``results.json``).
        quick: the fast smoke settings (``ReportSettings.quick()``).
        progress, static: as for :func:`run_report`.
        **settings: any :class:`ReportSettings` field, e.g. ``model="gemma3-270m"``, ``n=64``.

    Returns:
        The ``results.json`` content.
    """
    unknown = sorted(set(settings) - set(ReportSettings.__dataclass_fields__))
    if unknown:
        raise InterpError(f"Unknown report setting(s) {', '.join(unknown)}; valid: "
                          f"{', '.join(ReportSettings.__dataclass_fields__)}.")
    chosen = ReportSettings.quick(**settings) if quick else ReportSettings(**settings)
    return run_report(out, chosen, progress=progress, static=static)


class _CallablePackage(types.ModuleType):
    """Makes ``interp.report(...)`` run the report while ``interp.report`` stays this package."""

    def __call__(self, out: str | Path, **kwargs: Any) -> dict[str, Any]:
        return report(out, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
