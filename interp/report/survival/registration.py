"""The survival study's registration, read once: its rules are numbers in the file, not constants here."""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from interp.errors import DataError

REPO = Path(__file__).resolve().parents[3]
DEFAULT = REPO / "docs" / "preregistration" / "survival-1.json"
MODELS = ("smollm2-135m", "gemma3-270m")


@lru_cache(maxsize=4)
def _read(path: str) -> tuple[dict[str, Any], str]:
    try:
        raw = Path(path).read_bytes()
    except OSError as error:
        raise DataError(f"cannot read the survival registration {path} ({error.strerror or error})") from None
    try:
        data = json.loads(raw)
    except ValueError as error:
        raise DataError(f"the survival registration {path} is not JSON ({error})") from None
    for key in ("name", "models", "quantized_models", "intervals", "induction", "circuits", "features"):
        if key not in data:
            raise DataError(f"the survival registration {path} has no {key!r}: is it a survival study's file?")
    return data, hashlib.sha256(raw).hexdigest()


def registration(path: str | Path | None = None) -> dict[str, Any]:
    """The registration's content (read once per path)."""
    return _read(str(path or DEFAULT))[0]


def sha256(path: str | Path | None = None) -> str:
    """The SHA-256 of the registration file, recorded by every run and checked by the analysis."""
    return _read(str(path or DEFAULT))[1]


def file_name(unit_id: str) -> str:
    """A file-safe name for a raw-data id (``gptq:bits=3,group=64@seed61`` -> ``gptq-bits-3-group-64@seed61``)."""
    import re

    return re.sub(r"[^A-Za-z0-9.@_#]+", "-", unit_id).strip("-")


def check_model(name: str) -> str:
    """``name`` if the registration covers it, else a DataError listing the covered models."""
    if name not in MODELS:
        raise DataError(f"the survival study covers {', '.join(MODELS)}; {name!r} is not one of them")
    return name
