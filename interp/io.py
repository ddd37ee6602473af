"""Small, safe file writing helpers: atomic JSON/CSV writes and checked output folders."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from interp.errors import DataError, ResourceError


def ensure_writable_dir(folder: str | Path) -> Path:
    """Create ``folder`` if needed and check that files can be written in it."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        # a probe file of this process's own: two processes checking one folder must not unlink each other's
        with tempfile.NamedTemporaryFile(dir=path, prefix=".interp-write-test-", delete=True) as probe_file:
            probe_file.write(b"ok")
    except OSError as exc:
        raise ResourceError(
            f"Cannot write to the output folder {path} ({exc.strerror}). Choose a writable folder with --out."
        ) from None
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename, so readers never see half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise ResourceError(f"The disk is full while writing {path}. Free space and rerun: "
                                "finished work is kept and will be reused.") from None
        raise ResourceError(f"Could not write {path} ({exc.strerror}).") from None


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
