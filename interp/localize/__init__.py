"""Localization: which layers and components carry a difference (lenses, restoration, patching, circuits).

``interp.localize.logit_attribution`` (direct logit attribution) is importable from here; the
other analyses live in their modules (:mod:`~interp.localize.patching`, :mod:`~interp.localize.lens`, ...).
"""

from interp.localize.dla import LogitAttribution, logit_attribution

__all__ = ["LogitAttribution", "logit_attribution"]
