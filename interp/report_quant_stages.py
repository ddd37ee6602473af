"""Report stages (c)-(h): quantization, agreement, norms and reversal, early exit, restoration, patching."""

from __future__ import annotations

from typing import Any

QUANT_STAGES: list[Any] = []


def quant_reproduction_rows(outputs: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    return []
