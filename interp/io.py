"""The one output writer: every file and folder interp writes goes through this module.

Guarantees (docs/reliability.md, "What interp never deletes"; tests/test_writer.py):

- **Nothing foreign is deleted or replaced.** A folder output is interp's only when it carries a
  marker (:data:`MARKER`, a small JSON naming the output's kind) that interp wrote when it created
  or first claimed the folder. An existing non-empty folder without the marker of the same kind is
  refused; inside an owned folder only interp's own named entries are ever replaced or removed.
- **Nothing is written outside ``--out``** (``_entry``). Only the output folder itself is
  resolved (``--out LINK`` writes into the folder the link points to; the link is never moved).
  Below it an entry is *replaced*, never written through: a file is renamed over whatever name is
  there (a symbolic link included, whose target is left alone), and a folder inside an output that
  is a link is refused. The root, the user's home, the working folder and its ancestors are refused.
- **Temporaries are recognised by a token, never by their name alone** (:func:`is_temporary`).
  Every temporary is a folder ``.NAME.partial-PID-HOST-TOKEN`` (``interp-stash-…`` for the weight
  stash) holding :data:`TOKEN_FILE`, a random secret whose SHA-256 begins with ``TOKEN``. A file is
  written inside such a folder and renamed into place. What a killed run leaves is removed the next
  time interp writes beside it, only when its token checks out and its process no longer runs on
  this host; a user's file or folder that merely looks like one is never touched.
- **An output is whole or visibly incomplete** (:func:`writing`). A run writing into an output
  folder first writes ``INCOMPLETE`` there and removes it last; a folder built whole elsewhere is
  renamed into place in one step. Readers of outputs (:func:`check_complete`) refuse a folder that
  still holds ``INCOMPLETE``.
- **Faults are one clear error.** ENOSPC, EDQUOT, EROFS, EACCES and EPERM, as an ``OSError`` or
  inside any library's own error type (safetensors' ``SafetensorError``, pyarrow, SQLite), become a
  :class:`~interp.errors.ResourceError` naming the path (:func:`fs_cause`), and the temporary is removed.
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from interp.errors import DataError, InterpError, ResourceError

MARKER = ".interp-output.json"
"""The file that makes a folder an interp output: ``{"interp_output": 1, "kind": ..., "files": [...]}``."""

INCOMPLETE = "INCOMPLETE"
"""Written first into an output folder by a run that writes into it in place, removed last (:func:`writing`)."""

TOKEN_FILE = ".interp-temp"
"""Inside every temporary folder: the secret whose SHA-256 begins with the folder name's token."""

STASH_PREFIX = "interp-stash"
FIX = "Choose an empty or new folder (--out on the command line)."
_FS_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
# the shape of interp's temporaries: ".NAME.partial-PID-HOST-TOKEN" and "interp-stash-PID-HOST-TOKEN". The
# name alone proves nothing (a user may name anything so): is_temporary also checks the token inside.
_TEMP = re.compile(r"^(?:\..+\.partial|" + STASH_PREFIX + r")-(?P<pid>\d{1,7})-(?P<host>[0-9a-f]{8})"
                   r"-(?P<token>[0-9a-f]{16})$")
_RESERVED = {MARKER, INCOMPLETE, TOKEN_FILE}  # interp's own names inside an output folder
_mine: set[str] = set()  # the temporaries this process made and has not removed yet
_writing: dict[str, int] = {}  # output folders this process is writing in place (nesting depth)
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


# what libraries that wrap the operating system's error put in their message (Rust's io::Error in safetensors and
# tokenizers: "Os { code: 28, kind: StorageFull, ... }" / "(os error 28)"; SQLite; pyarrow's strerror text)
_CODE_IN_TEXT = re.compile(r"(?:os error |\{ code: |\[Errno )(\d+)")
_TEXTS = {"no space left": errno.ENOSPC, "disk is full": errno.ENOSPC, "database or disk is full": errno.ENOSPC,
          "quota exceeded": errno.EDQUOT, "read-only file system": errno.EROFS, "readonly database": errno.EROFS,
          "permission denied": errno.EACCES, "operation not permitted": errno.EPERM}


def fs_cause(exc: BaseException) -> int | None:
    """The errno among ENOSPC, EDQUOT, EROFS, EACCES and EPERM behind ``exc``, or ``None``.

    An ``OSError`` carries it; a library's own error type (safetensors' ``SafetensorError``, SQLite's
    ``OperationalError``, pyarrow's) carries it in its message, here or in the errors it was raised from.
    interp's own errors are never reinterpreted.
    """
    seen = 0
    while exc is not None and seen < 8:
        seen += 1
        if isinstance(exc, InterpError):
            return None
        if isinstance(exc, OSError) and exc.errno in _FS_ERRORS:
            return int(exc.errno)
        text = str(exc)
        for match in _CODE_IN_TEXT.finditer(text):
            if int(match.group(1)) in _FS_ERRORS:
                return int(match.group(1))
        lowered = text.lower()
        for words, code in _TEXTS.items():
            if words in lowered:
                return code
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return None


def fs_error(exc: BaseException, path: str | os.PathLike[str]) -> ResourceError:
    """One clear :class:`~interp.errors.ResourceError` for a write that failed with ``exc`` on ``path``."""
    code = fs_cause(exc) if not isinstance(exc, OSError) or exc.errno not in _FS_ERRORS else exc.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        why = "the disk is full (or the quota is used up). Free some space and rerun: finished work is kept"
    elif code == errno.EROFS:
        why = "the file system is read-only. Choose a writable folder (--out; INTERP_CACHE for the cache)"
    elif code in (errno.EACCES, errno.EPERM):
        why = "permission denied. Choose a folder you can write to (--out), or fix its permissions"
    else:
        why = f"{getattr(exc, 'strerror', None) or exc}. Check the path and rerun"
    return ResourceError(f"Could not write {path}: {why}. Nothing half-written was left behind.")


@contextmanager
def _disk_errors(path: str | os.PathLike[str], *, every_os_error: bool = False) -> Iterator[None]:
    """The one translation of a failed write into a :class:`ResourceError` naming ``path``: a full, read-only or
    forbidden disk (:func:`fs_cause`), whether the OS said so or a library's own error type did (safetensors'
    ``SafetensorError``, SQLite, pyarrow); with ``every_os_error``, any ``OSError`` too. Anything else passes."""
    try:
        yield
    except InterpError:
        raise
    except Exception as exc:
        if (every_os_error and isinstance(exc, OSError)) or fs_cause(exc) is not None:
            raise fs_error(exc, path) from None
        raise


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


# ---------------------------------------------------------------------------------------
# Temporaries: a folder holding a token, never recognised by its name alone


def _token_of(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()[:16]


def _make_temp(parent: Path, name: str, prefix: str | None = None, mode: int = 0o777) -> Path:
    """A new temporary folder of this process in ``parent``, holding its token (see :func:`is_temporary`)."""
    secret = secrets.token_hex(16)
    head = prefix if prefix is not None else f".{name[:100]}.partial"
    path = parent / f"{head}-{os.getpid()}-{_HOST}-{_token_of(secret)}"
    try:
        os.mkdir(path, mode)  # the umask applies (the weight stash asks for 0o700)
    except OSError as exc:
        raise fs_error(exc, parent / name if name else path) from None
    _mine.add(str(path))
    try:
        fd = os.open(path / TOKEN_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            os.write(fd, secret.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        _remove_temp(path)
        raise fs_error(exc, parent / name if name else path) from None
    return path


def is_temporary(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is one of interp's temporaries (of any process): a folder (not a link) whose name
    has the shape ``.NAME.partial-PID-HOST-TOKEN`` or ``interp-stash-PID-HOST-TOKEN`` *and* that holds
    :data:`TOKEN_FILE`, a secret whose SHA-256 begins with ``TOKEN``. A name alone proves nothing."""
    path = Path(path)
    match = _TEMP.match(path.name)
    if match is None:
        return False
    token = path / TOKEN_FILE
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode) or not stat.S_ISREG(os.lstat(token).st_mode):
            return False
        with open(token, "rb") as fh:
            secret = fh.read(65)
    except OSError:
        return False
    try:
        return len(secret) == 32 and _token_of(secret.decode("ascii")) == match.group("token")
    except UnicodeDecodeError:
        return False


def _stale(path: Path) -> bool:
    """A temporary that a process of this host left and that process no longer runs."""
    match = _TEMP.match(path.name)
    if match is None or match.group("host") != _HOST or not _pid_dead(int(match.group("pid"))):
        return False
    return is_temporary(path)


def clean_stale(folder: str | os.PathLike[str], force: bool = False) -> list[Path]:
    """Remove what a killed interp run left in ``folder``: its temporaries (:func:`is_temporary`: the token
    checks out) whose process no longer runs on this host. Nothing else is touched.

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
        path = Path(entry.path)
        if _stale(path):
            _remove_temp(path)
            if not os.path.lexists(path):
                removed.append(path)
    return removed


def _remove_temp(path: Path) -> None:
    """Delete one of interp's temporary folders: its contents first and its token last, so that a kill
    part-way leaves a folder that is still recognisably interp's (and is removed by the next run)."""
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        entries = []
    except OSError:
        return
    for entry in entries:
        if entry.name != TOKEN_FILE:
            _remove_tree(Path(entry.path))
    for step in (lambda: os.unlink(path / TOKEN_FILE), lambda: os.rmdir(path)):
        try:
            step()
        except FileNotFoundError:
            pass
        except OSError:
            return  # left as it is; its token (if still there) lets a later run remove it
    _mine.discard(str(path))


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
# Entries: only --out itself is resolved


def _output_root(folder: Path) -> Path | None:
    """The outermost folder among ``folder`` and its ancestors (as written, links not followed) that is an
    interp output (it holds :data:`MARKER`) or one of this process's temporaries; ``None`` when none is."""
    for candidate in (*reversed(folder.parents), folder):
        if str(candidate) in _mine or os.path.isfile(candidate / MARKER):
            return candidate
    return None


def _entry(path: str | os.PathLike[str], make: bool = True) -> Path:
    """Where writing ``path`` puts a new entry, with the folders on the way made: the one place that keeps
    every write inside its output folder.

    Only the output folder itself is resolved (``--out LINK`` is the folder the link points to). Below it
    nothing is followed: a folder on the way that is a symbolic link is refused, and the last name is
    returned unresolved, so the file is renamed over whatever is there (a link is replaced, its target is
    left alone). A path in no output folder has its parent folder resolved, and its last name is likewise
    replaced, never written through. With ``make=False`` nothing is created (only the links are refused).
    """
    given = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    if given.name in ("", ".", ".."):
        raise ResourceError(f"Cannot write {path}: it names a folder, not a file. Give a file name.")
    root = _output_root(given.parent)
    if root is None:
        folder = resolve(given.parent)
        if make:
            _make_dirs(folder)
        return folder / given.name
    folder = resolve(root)
    for part in given.parent.relative_to(root).parts:
        folder = folder / part
        try:
            info = os.lstat(folder)
        except FileNotFoundError:
            if not make:
                return resolve(given)  # nothing below exists, so no link either
            _make_dirs(folder)
            continue
        except OSError as exc:
            raise fs_error(exc, folder) from None
        if stat.S_ISLNK(info.st_mode):
            raise ResourceError(f"Cannot write {path}: {folder} inside the interp output {resolve(root)} is a "
                                "symbolic link, and interp writes only inside its output folder. Remove the link "
                                "(or choose another --out).")
        if not stat.S_ISDIR(info.st_mode):
            raise ResourceError(f"Could not create the folder {folder}: a file of that name is in the way. {FIX}")
    return folder / given.name


# ---------------------------------------------------------------------------------------
# Files


def _fill(tmp: Path, produce: Callable[[Path], None]) -> None:
    """The one low-level write: ``produce`` fills the temporary file ``tmp`` (already created, empty).

    Every file interp writes passes here; tests replace it to simulate a full disk."""
    produce(tmp)


def write_file(path: str | os.PathLike[str], produce: Callable[[Path], None]) -> Path:
    """Write ``path`` atomically: ``produce(tmp)`` writes a file of the same name inside a temporary folder
    beside it (:func:`is_temporary`), which is then renamed over ``path``.

    Nothing is written through a link: ``path``'s last name is replaced, whatever it is (see ``_entry``).
    On any failure the temporary is removed and ``path`` is as it was; a full disk, a read-only file system
    or a permission error, raised as an ``OSError`` or inside a library (safetensors, pyarrow, ...), is a
    :class:`~interp.errors.ResourceError` naming ``path``.
    """
    target = _entry(path)
    if target.name in _RESERVED - {MARKER, INCOMPLETE}:
        raise ResourceError(f"Cannot write {path}: {target.name} is a name interp reserves. Choose another name.")
    if target.is_dir() and not target.is_symlink():
        raise ResourceError(f"Cannot write the file {path}: a folder of that name is in the way. Choose another "
                            "file name.")
    clean_stale(target.parent)
    folder = _make_temp(target.parent, target.name)
    tmp = folder / target.name
    try:
        with _disk_errors(target, every_os_error=True):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any file
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
            os.close(fd)
            _fill(tmp, produce)
            if stat.S_IMODE(os.stat(tmp).st_mode) != mode:  # safetensors' save_file, for one, makes its file 0600
                os.chmod(tmp, mode)
            os.replace(tmp, target)  # over the name itself: a link there is replaced, not followed
    finally:
        _remove_temp(folder)
    return target


def write_many(paths: Sequence[str | os.PathLike[str]], produce: Callable[[list[Path]], None]) -> list[Path]:
    """Write several files of one folder with one call of a library that writes a batch (plotly's
    ``write_images``): ``produce(tmps)`` writes files of the same names inside one temporary folder, and
    each is then renamed over its path as :func:`write_file` does."""
    targets = [_entry(path) for path in paths]
    if not targets:
        return []
    parent = targets[0].parent
    if any(t.parent != parent for t in targets) or len({t.name for t in targets}) != len(targets):
        raise ValueError("write_many: the paths must be distinct files of one folder")
    clean_stale(parent)
    folder = _make_temp(parent, targets[0].name)
    tmps = [folder / t.name for t in targets]
    try:
        with _disk_errors(parent, every_os_error=True):
            fd = os.open(folder / f"{TOKEN_FILE}.mode", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask's mode
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
            os.close(fd)
            _fill(folder, lambda _: produce(tmps))
            for tmp, target in zip(tmps, targets, strict=True):
                if stat.S_IMODE(os.stat(tmp).st_mode) != mode:
                    os.chmod(tmp, mode)
                os.replace(tmp, target)
    finally:
        _remove_temp(folder)
    return targets


def copy_file(source: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """Copy the file ``source`` to ``path`` through :func:`write_file`."""
    def produce(tmp: Path) -> None:
        shutil.copyfile(source, tmp)

    return write_file(path, produce)


def copy_tree(source: str | os.PathLike[str], path: str | os.PathLike[str]) -> list[Path]:
    """Copy every regular file under the folder ``source`` to the same place under ``path``, each through
    :func:`write_file` (links in ``source`` are not followed)."""
    written = []
    for folder, _, files in os.walk(source, followlinks=False):
        rel = Path(folder).relative_to(source)
        for name in sorted(files):
            if stat.S_ISREG(os.lstat(Path(folder) / name).st_mode):
                written.append(copy_file(Path(folder) / name, Path(path) / rel / name))
    return written


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
    given = Path(os.path.abspath(os.fspath(path)))
    if not any(str(parent) in _mine for parent in given.parents):
        raise ValueError(f"remove_temp: {path} is not inside one of this process's temporary folders")
    _remove_tree(given)


def store_path(path: str | os.PathLike[str]) -> Path:
    """The path of a file that a library opens and writes in place (an SQLite store), checked like any entry
    (``_entry``): inside its output folder and never through a link (a link there is refused, since the
    store's content is the user's work so far and is not replaced)."""
    target = _entry(path)
    if os.path.islink(target):
        raise ResourceError(f"{path} is a symbolic link, and interp does not write through links in its output "
                            "folder. Remove the link (or choose another --out).")
    return target


def connect_sqlite(path: str | os.PathLike[str], **options: Any) -> Any:
    """An SQLite connection to ``path`` (a store written in place, so it can resume), opened through the
    writer's rules (:func:`store_path`); an unwritable folder is a :class:`~interp.errors.ResourceError`."""
    import sqlite3

    target = store_path(path)
    try:
        return sqlite3.connect(target, **options)
    except sqlite3.OperationalError as exc:
        if fs_cause(exc) is None:
            raise
        raise fs_error(exc, target) from None


class PrivateFolder:
    """A temporary folder of this process (``interp-stash-PID-HOST-TOKEN``, mode 0700), deleted by :meth:`cleanup`.

    If the process is killed, the next interp run that writes in the same parent folder removes it."""

    def __init__(self, parent: str | os.PathLike[str] | None = None, prefix: str = STASH_PREFIX) -> None:
        base = resolve(parent) if parent is not None else Path(tempfile.gettempdir())
        _make_dirs(base)
        clean_stale(base)
        # private by design: it holds a copy of the model's weights meanwhile
        self.path = _make_temp(base, "", prefix=prefix, mode=0o700)
        self.name = str(self.path)
        self._finalizer = weakref.finalize(self, _remove_temp, self.path)  # also when never closed

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
    """The entries of ``folder`` other than interp's marker and temporaries (whose token checks out)."""
    return sorted(name for name in os.listdir(folder) if name != MARKER and not is_temporary(folder / name))


def _own_names(names: Any) -> list[str]:
    """The names listed in a marker that are plain entries of the folder (a marker is data: nothing in it
    may point outside its folder)."""
    if not isinstance(names, list):
        return []
    return [n for n in names if isinstance(n, str) and n not in ("", ".", "..") and n not in _RESERVED
            and "/" not in n and os.sep not in n and "\x00" not in n]


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
    record = {"interp_output": 1, "kind": kind, "files": sorted(set(files) - _RESERVED)}
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
    temp = _make_temp(real.parent, real.name)
    tmp = temp / real.name  # the output being built: the token stays beside it, never in it
    try:
        with _disk_errors(real):
            os.mkdir(tmp, 0o777)  # the umask applies
            yield tmp
            _install(tmp, real, shown, kind, adopt)
    finally:
        _remove_temp(temp)


@contextmanager
def staged_files(folder: str | os.PathLike[str]) -> Iterator[Path]:
    """Write files of ``folder`` with a library that writes a whole folder (``save_pretrained``): it writes
    into a temporary folder inside ``folder`` (yielded), whose files are then renamed into place one by one,
    over the names there (never through a link), as :func:`write_file` does for one file."""
    parent = _entry(Path(folder) / TOKEN_FILE).parent  # the folder, made, resolved as any entry's
    clean_stale(parent)
    temp = _make_temp(parent, "files")
    tmp = temp / "files"  # the library's alone: the token stays beside it
    try:
        with _disk_errors(parent):
            os.mkdir(tmp, 0o777)
            yield tmp
            _umask_modes(tmp)
            for name in sorted(set(os.listdir(tmp)) - _RESERVED):
                _move_in(tmp / name, parent / name, parent)
    finally:
        _remove_temp(temp)


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
    new = sorted(set(os.listdir(tmp)) - _RESERVED)
    marker = _owned(real, shown, kind, adopt)  # again: the folder may have changed while the output was made
    if marker is None and not real.exists():
        _write_marker(tmp, kind, new)
        try:
            os.rename(tmp, real)  # the whole output in one step
            return
        except OSError as exc:  # another process made it meanwhile: merge into it like into any folder
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            marker = _owned(real, shown, kind, adopt)
    old = marker["files"] if marker else []
    _write_marker(real, kind, [*old, *new])  # first: a kill part-way leaves every entry accounted for
    with writing(real):  # entries go in one by one: INCOMPLETE until the last one is in
        for name in new:
            _move_in(tmp / name, real / name, real)
        for name in set(old) - set(new):
            _remove_tree(real / name)
        _write_marker(real, kind, new)


def _move_in(src: Path, dst: Path, folder: Path) -> None:
    """Put ``src`` at ``dst``: renamed over it, or, for a folder, the old one is first moved into a
    temporary (which a kill leaves recognisable, so the next run removes it)."""
    if (dst.is_dir() and not dst.is_symlink()) or (src.is_dir() and os.path.lexists(dst)):
        aside = _make_temp(folder, dst.name)
        try:
            os.rename(dst, aside / dst.name)
            os.rename(src, dst)
        finally:
            _remove_temp(aside)
    else:
        os.replace(src, dst)


# ---------------------------------------------------------------------------------------
# Whole or visibly incomplete


@contextmanager
def writing(folder: str | os.PathLike[str]) -> Iterator[Path]:
    """Write into the interp output ``folder`` in place: ``INCOMPLETE`` is written there first and
    removed when the block ends normally, so a kill or a failure at any point leaves a folder that says
    it is incomplete (:func:`check_complete`). Blocks nest (the outermost one removes the file).

    ``folder`` must already be an interp output (:func:`claim_folder`): interp marks only its own folders.
    """
    real = resolve(folder)
    if _read_marker(real) is None:
        raise ResourceError(f"{folder} is not an interp output folder (no {MARKER}); claim it first.")
    key = str(real)
    if key not in _writing:
        note = (f"An interp run (process {os.getpid()} on {socket.gethostname()}) is writing this folder, or was "
                "killed or failed while writing it: what is here may mix two runs. Rerun the same command to "
                "finish it; interp refuses to read the folder until then.\n")
        write_text(real / INCOMPLETE, note)
    _writing[key] = _writing.get(key, 0) + 1
    finished = False
    try:
        yield real
        finished = True
    finally:
        _writing[key] -= 1
        if _writing[key] == 0:
            del _writing[key]
            if finished:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(real / INCOMPLETE)


def is_complete(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds no ``INCOMPLETE`` (written by :func:`writing`)."""
    return not os.path.lexists(Path(folder) / INCOMPLETE)


def check_complete(folder: str | os.PathLike[str], what: str = "output") -> Path:
    """``folder``, or a :class:`~interp.errors.DataError` when it is an interp output that a run left incomplete.

    Every reader of a finished interp output calls this before reading it."""
    path = Path(folder)
    if not is_complete(path) and os.path.isfile(path / MARKER):
        raise DataError(f"The {what} in {folder} is incomplete: an interp run was killed or failed while writing it "
                        f"({INCOMPLETE} is there), so it may mix two runs. Rerun the command that wrote it.")
    return path


def ensure_writable_dir(folder: str | Path) -> Path:
    """Create ``folder`` if needed (nothing is removed or replaced) and check that files can be written in it."""
    path = Path(folder)
    try:
        _entry(path / TOKEN_FILE, make=False)  # inside an output, a link on the way is refused before anything
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


def write_csv(path: str | os.PathLike[str], frame: Any, **options: Any) -> Path:
    """Write a pandas frame as CSV through :func:`write_file` (``options`` go to ``DataFrame.to_csv``)."""
    return write_file(path, lambda tmp: frame.to_csv(tmp, **options))


def write_parquet(path: str | os.PathLike[str], frame: Any, **options: Any) -> Path:
    """Write a pandas frame as parquet through :func:`write_file`."""
    return write_file(path, lambda tmp: frame.to_parquet(tmp, **options))


def write_safetensors(path: str | os.PathLike[str], tensors: dict[str, Any],
                      metadata: dict[str, str] | None = None) -> Path:
    """Write tensors as safetensors through :func:`write_file` (a full disk inside safetensors is a
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
