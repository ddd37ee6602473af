"""The one output writer: every file and folder interp writes goes through this module.

Guarantees (docs/reliability.md, "What interp never deletes"; tests/test_writer.py):

- **Nothing foreign is deleted or replaced.** A folder output is interp's only when it carries a
  marker (:data:`MARKER`, a small JSON naming the output's kind) that interp wrote when it created
  or first claimed the folder. An existing non-empty folder without the marker of the same kind is
  refused; inside an owned folder only interp's own named entries are ever replaced or removed.
- **Dangerous targets are refused** after symlinks are resolved: the root, the user's home, the
  working folder and its ancestors (so ``.``, ``..`` and ``~`` too). ``--out LINK`` is resolved
  first and the rules apply to the folder it points to; the link itself is never moved.
- **Writes are atomic.** A file is written to a temporary sibling ``.NAME.partial-PID-HOST-RAND``
  and renamed into place; a folder is built in such a sibling and renamed (or, when the target
  folder already exists, its entries moved in one by one). What a killed run leaves
  (``.NAME.partial-PID-…``, ``interp-stash-PID-…`` of a process that no longer runs on this host)
  is removed the next time interp writes beside it; nothing else is ever touched.
- **Faults are one clear error.** ENOSPC, EDQUOT, EROFS, EACCES and EPERM become a
  :class:`~interp.errors.ResourceError` naming the path, and the temporary sibling is removed.
- **The umask is honoured.** Temporary files and folders are created with ``os.open(..., 0o666)``
  and ``os.mkdir(..., 0o777)``, so the kernel applies the umask (and any default ACL) exactly as for
  any other file: 0644/0755 under umask 022, 0600/0700 under 077. No umask is read or changed.

This is a base module: it imports only :mod:`interp.errors` and the standard library at top level.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from interp.errors import DataError, ResourceError

MARKER = ".interp-output.json"
"""The file that makes a folder an interp output: ``{"interp_output": 1, "kind": ..., "files": [...]}``."""

STASH_PREFIX = "interp-stash"
FIX = "Choose an empty or new folder (--out on the command line)."
_FS_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
# interp's temporaries: ".NAME.partial-PID[-HOST-RAND]" and "interp-stash-PID[-HOST-RAND]"
_TEMP = re.compile(r"^(?:\..+\.partial|" + STASH_PREFIX + r")-(?P<pid>\d{1,7})(?:-(?P<host>[0-9a-f]{8})-[0-9a-z]+)?$")
_cleaned: set[str] = set()
_cleaned_lock = threading.Lock()


# ---------------------------------------------------------------------------------------
# Paths and errors


def resolve(path: str | os.PathLike[str]) -> Path:
    """``path`` with ``~`` expanded and every symlink resolved (also in a tail that does not exist yet)."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def _shown(given: str | os.PathLike[str], real: Path) -> str:
    text = os.fspath(given)
    return text if os.path.abspath(os.path.expanduser(text)) == str(real) else f"{text} (-> {real})"


def check_output_folder(path: str | os.PathLike[str]) -> Path:
    """The resolved ``path``, or a :class:`~interp.errors.ResourceError` when it is the root, the home folder, the
    working folder or one of its ancestors (after symlinks are resolved), or an existing file."""
    real = resolve(path)
    cwd = resolve(os.getcwd())
    home = os.environ.get("HOME")
    why = None
    if real == Path(real.anchor):
        why = "the root folder"
    elif home and real == resolve(home):
        why = "your home folder"
    elif real == cwd:
        why = "the working folder"
    elif real in cwd.parents:
        why = f"an ancestor of the working folder {cwd}"
    if why:
        raise ResourceError(f"Refusing to write into {_shown(path, real)}: it is {why}, and interp never writes "
                            f"into a folder it did not create. {FIX}")
    if real.exists() and not real.is_dir():
        raise ResourceError(f"The output folder {_shown(path, real)} is a file. {FIX}")
    return real


def fs_error(exc: OSError, path: str | os.PathLike[str]) -> ResourceError:
    """One clear :class:`~interp.errors.ResourceError` for a write that failed with ``exc`` on ``path``."""
    code = exc.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        why = "the disk is full (or the quota is used up). Free some space and rerun: finished work is kept"
    elif code == errno.EROFS:
        why = "the file system is read-only. Choose a writable folder (--out; INTERP_CACHE for the cache)"
    elif code in (errno.EACCES, errno.EPERM):
        why = "permission denied. Choose a folder you can write to (--out), or fix its permissions"
    else:
        why = f"{exc.strerror or exc}. Check the path and rerun"
    return ResourceError(f"Could not write {path}: {why}. Nothing half-written was left behind.")


def _pid_dead(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


def is_temporary(name: str) -> bool:
    """Whether ``name`` is one of interp's temporaries (of any process)."""
    return _TEMP.match(name) is not None


def _stale(name: str) -> bool:
    match = _TEMP.match(name)
    if match is None:
        return False
    host = match.group("host")
    return (host is None or host == _HOST) and _pid_dead(int(match.group("pid")))


def clean_stale(folder: str | os.PathLike[str], force: bool = False) -> list[Path]:
    """Remove what a killed interp run left in ``folder``: its temporaries (``.NAME.partial-PID-…``,
    ``interp-stash-PID-…``) whose process no longer runs on this host. Nothing else is touched.

    Each folder is scanned once per process unless ``force``; returns what was removed."""
    key = os.fspath(folder)
    with _cleaned_lock:
        if key in _cleaned and not force:
            return []
        _cleaned.add(key)
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for entry in entries:
        if not _stale(entry.name):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed.append(Path(entry.path))
        except OSError:
            continue  # another process cleaned it first, or it cannot be removed: left as it is
    return removed


def _temp_name(name: str, prefix: str | None = None) -> str:
    head = prefix if prefix is not None else f".{name[:100]}.partial"
    return f"{head}-{os.getpid()}-{_HOST}-{secrets.token_hex(4)}"


def _remove_tree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _make_dirs(folder: Path) -> None:
    """``mkdir -p`` with the umask's modes, every error as :func:`fs_error`."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ResourceError(f"Could not create the folder {folder}: a file of that name is in the way. {FIX}") from None
    except OSError as exc:
        raise fs_error(exc, folder) from None


# ---------------------------------------------------------------------------------------
# Files


def _fill(tmp: Path, produce: Callable[[Path], None]) -> None:
    """The one low-level write: ``produce`` fills the temporary file ``tmp`` (already created, empty).

    Every file interp writes passes here; tests replace it to simulate a full disk."""
    produce(tmp)


def write_file(path: str | os.PathLike[str], produce: Callable[[Path], None]) -> Path:
    """Write ``path`` atomically: ``produce(tmp)`` writes a temporary sibling, which is then renamed into place.

    ``path`` is resolved first (a symlink's target is written, the link is left as it is). On any
    failure the temporary sibling is removed and ``path`` is as it was; a full disk, a read-only file
    system or a permission error is a :class:`~interp.errors.ResourceError` naming ``path``.
    """
    target = resolve(path)
    if target.is_dir():
        raise ResourceError(f"Cannot write the file {path}: a folder of that name is in the way. Choose another "
                            "file name.")
    _make_dirs(target.parent)
    clean_stale(target.parent)
    tmp = target.parent / _temp_name(target.name)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any file
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        os.close(fd)
        _fill(tmp, produce)
        if stat.S_IMODE(os.stat(tmp).st_mode) != mode:  # safetensors' save_file, for one, makes its file 0600
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except OSError as exc:
        _remove_tree(tmp)
        raise fs_error(exc, target) from None
    except BaseException:
        _remove_tree(tmp)
        raise
    return target


def write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`write_file`), synced to disk before the rename."""

    def produce(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    return write_file(path, produce)


atomic_write_bytes = write_bytes


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return write_bytes(path, text.encode("utf-8"))


def remove_temp(path: str | os.PathLike[str]) -> None:
    """Delete a file inside one of this process's temporary folders (a staged folder being built).

    Anything else is refused: interp deletes only what it wrote."""
    real = resolve(path)
    if not any(is_temporary(parent.name) for parent in real.parents):
        raise ValueError(f"remove_temp: {path} is not inside one of interp's temporary folders")
    _remove_tree(real)


class PrivateFolder:
    """A temporary folder of this process (``interp-stash-PID-HOST-RAND``, mode 0700), deleted by :meth:`cleanup`.

    If the process is killed, the next interp run that writes in the same parent folder removes it."""

    def __init__(self, parent: str | os.PathLike[str] | None = None, prefix: str = STASH_PREFIX) -> None:
        base = resolve(parent) if parent is not None else Path(tempfile.gettempdir())
        _make_dirs(base)
        clean_stale(base)
        self.path = base / _temp_name("", prefix=prefix)
        try:
            os.mkdir(self.path, 0o700)  # private by design: it holds a copy of the model's weights meanwhile
        except OSError as exc:
            raise fs_error(exc, self.path) from None
        self.name = str(self.path)
        self._finalizer = weakref.finalize(self, _remove_tree, self.path)  # also when never closed

    def cleanup(self) -> None:
        self._finalizer()

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()


# ---------------------------------------------------------------------------------------
# Folders


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and data.get("interp_output") == 1 and isinstance(data.get("kind"), str):
        return data
    return None


def _entries(folder: Path) -> list[str]:
    """The entries of ``folder`` other than interp's marker and temporaries."""
    return sorted(name for name in os.listdir(folder) if name != MARKER and not is_temporary(name))


def _own_names(names: Any) -> list[str]:
    """The names listed in a marker that are plain entries of the folder (a marker is data: nothing in it
    may point outside its folder)."""
    if not isinstance(names, list):
        return []
    return [n for n in names if isinstance(n, str) and n not in ("", ".", "..", MARKER) and "/" not in n
            and os.sep not in n and "\x00" not in n]


Adopt = Callable[[Path], bool]


def _owned(real: Path, shown: str, kind: str, adopt: Adopt | None) -> dict[str, Any] | None:
    """The marker of ``real`` when it is an interp ``kind`` output; ``None`` when it is absent or empty;
    refused otherwise. ``adopt(folder)`` recognises an output written before markers existed."""
    if not real.exists():
        return None
    marker = _read_marker(real)
    if marker is not None:
        if marker["kind"] != kind:
            raise ResourceError(f"{shown} holds an interp {marker['kind']!r} output, not a {kind!r} one, and interp "
                                f"does not write one output over another. {FIX}")
        return {**marker, "files": _own_names(marker.get("files"))}
    try:
        names = _entries(real)
    except OSError as exc:
        raise fs_error(exc, real) from None
    if not names:
        return None
    if adopt is not None and adopt(real):
        return {"interp_output": 1, "kind": kind, "files": names, "adopted": True}
    count = f"{len(names)} entries" if len(names) > 1 else "1 entry"
    raise ResourceError(f"{shown} is not empty ({count}, e.g. {names[0]!r}) and is not an interp "
                        f"{kind!r} output (it has no {MARKER}): interp never deletes or replaces what it did not "
                        f"write. {FIX}")


def _write_marker(folder: Path, kind: str, files: Iterable[str]) -> None:
    record = {"interp_output": 1, "kind": kind, "files": sorted(set(files))}
    write_bytes(folder / MARKER, (json.dumps(record, indent=1) + "\n").encode())


def claim_folder(path: str | os.PathLike[str], kind: str, adopt: Adopt | None = None) -> Path:
    """Make ``path`` an interp ``kind`` output folder and return it, resolved.

    A new or empty folder gets the marker; an earlier ``kind`` output is reused as it is. The root,
    the home folder, the working folder and its ancestors, a file, another kind of interp output and
    any non-empty folder without the marker are refused with a :class:`~interp.errors.ResourceError`.
    """
    real = check_output_folder(path)
    marker = _owned(real, _shown(path, real), kind, adopt)
    made = [p for p in (real, *real.parents) if not p.exists()]  # the folders this call creates
    _make_dirs(real)
    clean_stale(real.parent)
    clean_stale(real)
    if marker is None or marker.get("adopted"):
        try:
            _write_marker(real, kind, marker["files"] if marker else [])
        except ResourceError:
            for folder in made:  # leave nothing behind: the folders made here, while still empty
                with contextlib.suppress(OSError):
                    os.rmdir(folder)
            raise
    return real


def remove_owned(folder: str | os.PathLike[str], names: Iterable[str], kind: str,
                 adopt: Adopt | None = None) -> None:
    """Delete the entries ``names`` (interp's own, by name) of the ``kind`` output ``folder``; refused
    when ``folder`` is not one. Absent names are skipped."""
    real = check_output_folder(folder)
    _owned(real, _shown(folder, real), kind, adopt)
    for name in _own_names(list(names)):
        _remove_tree(real / name)


@contextmanager
def staged_folder(path: str | os.PathLike[str], kind: str, adopt: Adopt | None = None) -> Iterator[Path]:
    """Build a ``kind`` output in a temporary sibling of ``path`` (yielded); install it when the block ends.

    A new ``path`` is the temporary folder renamed (one atomic step). An existing empty folder or
    earlier ``kind`` output keeps its other entries: interp's entries are moved in one by one, and
    the ones its previous marker listed that this output lacks are removed. Anything else at
    ``path`` is refused before the block runs (see :func:`claim_folder`).
    """
    real = check_output_folder(path)
    shown = _shown(path, real)
    _owned(real, shown, kind, adopt)
    _make_dirs(real.parent)
    clean_stale(real.parent)
    tmp = real.parent / _temp_name(real.name)
    try:
        os.mkdir(tmp, 0o777)  # the umask applies
        yield tmp
        _install(tmp, real, shown, kind, adopt)
    except OSError as exc:
        if exc.errno not in _FS_ERRORS:
            raise
        raise fs_error(exc, real) from None
    finally:
        _remove_tree(tmp)


def _umask_modes(tmp: Path) -> None:
    """Give every file and folder under ``tmp`` the umask's modes, as ``tmp`` itself has (made with 0o777):
    some writers (safetensors, for one) make their files 0600 whatever the umask."""
    folder_mode = stat.S_IMODE(os.stat(tmp).st_mode)
    for parent, dirs, files in os.walk(tmp):
        for name, mode in [*((d, folder_mode) for d in dirs), *((f, folder_mode & 0o666) for f in files)]:
            path = os.path.join(parent, name)
            info = os.lstat(path)
            if not stat.S_ISLNK(info.st_mode) and stat.S_IMODE(info.st_mode) != mode:
                os.chmod(path, mode)


def _install(tmp: Path, real: Path, shown: str, kind: str, adopt: Adopt | None) -> None:
    _umask_modes(tmp)
    new = sorted(os.listdir(tmp))
    marker = _owned(real, shown, kind, adopt)  # again: the folder may have changed while the output was made
    if marker is None and not real.exists():
        _write_marker(tmp, kind, new)
        try:
            os.rename(tmp, real)
            return
        except OSError as exc:  # another process made it meanwhile: merge into it like into any folder
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            marker = _owned(real, shown, kind, adopt)
    old = marker["files"] if marker else []
    _write_marker(real, kind, [*old, *new])  # first: a kill part-way leaves every entry accounted for
    for name in new:
        if name != MARKER:
            _move_in(tmp / name, real / name, real)
    for name in set(old) - set(new):
        _remove_tree(real / name)
    _write_marker(real, kind, [n for n in new if n != MARKER])


def _move_in(src: Path, dst: Path, folder: Path) -> None:
    if (dst.is_dir() and not dst.is_symlink()) or (src.is_dir() and os.path.lexists(dst)):
        aside = folder / _temp_name(dst.name)
        os.rename(dst, aside)
        os.rename(src, dst)
        _remove_tree(aside)
    else:
        os.replace(src, dst)


def ensure_writable_dir(folder: str | Path) -> Path:
    """Create ``folder`` if needed (nothing is removed or replaced) and check that files can be written in it."""
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


# ---------------------------------------------------------------------------------------
# Formats


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
