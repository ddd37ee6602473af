"""Files of one format each, written and read through the one writer (:mod:`interp.io`, which re-exports every
name here, so ``from interp.io import write_json`` works as before): CSV and parquet from pandas, safetensors,
JSON (NaN and inf become ``null``), and the reader of interp's own safetensors files.

Each writer is a ``produce`` handed to :func:`interp.io.write_file`, so a format adds nothing to the writer's
guarantees and takes nothing away: atomic, never through a link, a full disk inside the library one
:class:`~interp.errors.ResourceError`.

This is a base module: it imports only :mod:`interp.io`, :mod:`interp.errors` and the standard library at top
level (pandas, safetensors, NumPy and torch on use).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from interp.errors import DataError
from interp.io import atomic_write_bytes, write_file

__all__ = ["read_safetensors", "sanitize", "write_csv", "write_json", "write_parquet", "write_safetensors"]


def read_safetensors(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """The tensors of a safetensors file written by interp, or a :class:`~interp.errors.DataError` naming
    ``what`` and the fix.

    A zero-byte, truncated or foreign file is refused from its header (safetensors checks the
    header's claimed size against the file's before reading), so nothing large is allocated.
    """
    # imported on use: safetensors.torch imports torch, which the command line defers
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise DataError(f"Cannot read the {what} in {path} ({exc}): the file is missing, truncated or not a "
                        "safetensors file written by interp. Compute and save it again.") from None


def write_csv(path: str | os.PathLike[str], frame: Any, **options: Any) -> Path:
    """Write a pandas frame as CSV through :func:`interp.io.write_file` (``options`` go to ``DataFrame.to_csv``)."""
    return write_file(path, lambda tmp: frame.to_csv(tmp, **options))


def write_parquet(path: str | os.PathLike[str], frame: Any, **options: Any) -> Path:
    """Write a pandas frame as parquet through :func:`interp.io.write_file`."""
    return write_file(path, lambda tmp: frame.to_parquet(tmp, **options))


def write_safetensors(path: str | os.PathLike[str], tensors: dict[str, Any],
                      metadata: dict[str, str] | None = None) -> Path:
    """Write tensors as safetensors through :func:`interp.io.write_file` (a full disk inside safetensors is a
    :class:`~interp.errors.ResourceError` too)."""
    from safetensors.torch import save_file  # imported on use: it imports torch

    return write_file(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as JSON atomically; NaN and inf become ``null`` (JSON has no NaN)."""
    text = json.dumps(sanitize(obj), indent=1, default=_json_default, allow_nan=False)
    atomic_write_bytes(path, (text + "\n").encode())


def sanitize(obj: Any) -> Any:
    """Replace non-finite floats by None, recursively, so the result is valid JSON."""
    if isinstance(obj, dict):
        return {str(k): sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    return _clean(obj)


def _json_default(obj: Any) -> Any:
    import math

    import numpy as np
    import torch

    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu().numpy()
    if isinstance(obj, np.ndarray):
        return [_clean(x) for x in obj.tolist()]
    if isinstance(obj, (np.floating, np.integer)):
        return _clean(obj.item())
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    raise TypeError(f"Cannot write {type(obj).__name__} to JSON")


def _clean(x: Any) -> Any:
    import math

    if isinstance(x, list):
        return [_clean(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x

