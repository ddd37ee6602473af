"""The one place the docs' page builders write or check what they generate (``docs/build_*.py``).

A builder renders every generated file from committed data; ``refresh`` writes them atomically
(``interp.io.write_text``: never through a link, never half a page) with ``--write``, or else reports which
differ from what the data give, with the command that refreshes them. Figures are made only on ``--write``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def refresh(files: Mapping[Path, str], command: str, write: bool, figures: Callable[[], None] | None = None) -> int:
    """Write ``files`` (path -> fresh text) when ``write``, then run ``figures``; otherwise 1 and a message naming
    the stale files and ``command`` when any file differs from its fresh text, else 0."""
    from interp.io import write_text

    if write:
        for path, text in files.items():
            write_text(path, text)
        if figures is not None:
            figures()
        return 0
    stale = [str(path.relative_to(ROOT)) for path, text in files.items()
             if not path.is_file() or path.read_text() != text]
    if stale:
        print(f"{', '.join(stale)} differ{'s' if len(stale) == 1 else ''} from the committed data: run {command}")
        return 1
    return 0
