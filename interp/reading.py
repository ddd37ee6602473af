"""Reading files with a size bound: the one way interp reads a file a user or a folder names.

A path may name a pipe, a device (``/dev/zero``), a socket or a file far larger than any
text, plan or settings file: reading it whole would block or exhaust memory. Every reader
here refuses what is not a regular file before opening it for reading (a FIFO is opened
without blocking and checked again), and reads at most ``limit`` bytes, so a file that is
larger, or grows, or reports no size (``/proc``) is refused with a clear error instead.

Example:
    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "plan.json"
    >>> _ = path.write_text('{"spec": "rtn:bits=4"}')
    >>> read_json(path, "a plan", limit=1 << 10)
    {'spec': 'rtn:bits=4'}
    >>> read_json("/dev/zero", "a plan", limit=1 << 10)
    Traceback (most recent call last):
    ...
    interp.errors.DataError: a plan /dev/zero is a character device, not a regular file; give the path of a file.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from interp.errors import DataError, InterpError

__all__ = ["JSON_LIMIT", "TEXT_LIMIT", "read_bytes", "read_json", "read_text", "regular_file"]

MiB = 1 << 20
JSON_LIMIT = 64 * MiB  # settings, plans, configs and tokenizer configs: the largest real ones are a few MiB
TEXT_LIMIT = 1024 * MiB  # one text source: 1 GiB is ~250M tokens, far more than any analysis reads

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def regular_file(path: str | os.PathLike[str], what: str, error: type[InterpError] = DataError) -> Path:
    """``path`` when it names an existing regular file (after symlinks), else ``error`` saying what it is."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise error(f"{what} {path} cannot be read ({exc.strerror}); check the path.") from None
    if not stat.S_ISREG(mode):
        raise error(f"{what} {path} is {_kind(mode)}, not a regular file; give the path of a file.")
    return path


def read_bytes(path: str | os.PathLike[str], what: str, limit: int, error: type[InterpError] = DataError) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them (``what`` names it in errors).

    Raises:
        ``error``: a missing or unreadable path, anything but a regular file, or more than ``limit`` bytes.
    """
    path = regular_file(path, what, error)
    try:  # O_NONBLOCK: if the path was swapped for a FIFO since the check, opening it does not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"{what} {path} cannot be read ({exc.strerror}); check its permissions.") from None
    with os.fdopen(fd, "rb") as fh:
        mode = os.fstat(fh.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{what} {path} is {_kind(mode)}, not a regular file; give the path of a file.")
        if os.fstat(fh.fileno()).st_size > limit:
            raise _too_large(path, what, limit, error)
        try:
            data = fh.read(limit + 1)
        except OSError as exc:
            raise error(f"{what} {path} cannot be read ({exc.strerror}).") from None
    if len(data) > limit:  # it grew, or reports no size (/proc)
        raise _too_large(path, what, limit, error)
    return data


def _too_large(path: Path, what: str, limit: int, error: type[InterpError]) -> InterpError:
    return error(f"{what} {path} is larger than the {limit // MiB} MiB interp reads from such a file; "
                 "check that it is the file you meant (or split it into smaller ones).")


def read_text(path: str | os.PathLike[str], what: str, limit: int = TEXT_LIMIT,
              error: type[InterpError] = DataError, encoding: str = "utf-8") -> str:
    """The text of ``path`` (see :func:`read_bytes`); invalid UTF-8 is refused with the byte where it fails."""
    data = read_bytes(path, what, limit, error)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path} is not valid UTF-8 (byte {exc.start}). Re-encode it as UTF-8, e.g. "
                    f"`iconv -f latin1 -t utf-8 {Path(path).name} > fixed{Path(path).suffix}`.") from None


def read_json(path: str | os.PathLike[str], what: str, limit: int = JSON_LIMIT,
              error: type[InterpError] = DataError) -> Any:
    """The JSON value in ``path`` (see :func:`read_bytes`); a truncated or malformed file is ``error``."""
    text = read_text(path, what, limit, error, encoding="utf-8-sig")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{what} {path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                    "it may be truncated or hand-edited. Restore it or write it again.") from None
    except RecursionError:
        raise error(f"{what} {path} nests JSON too deeply to read.") from None
