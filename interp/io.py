"""The one output writer: every file and folder interp writes goes through this module.

It is split along responsibilities: this module holds the writer's machinery (paths and the one translation of
a failed write, the temporaries and the ledger of this process's own, where an entry goes, and the atomic file
writes every other write is built on); :mod:`interp.output_folders` holds output folders (the marker that makes
a folder interp's, staged outputs, whole-or-``INCOMPLETE``) and :mod:`interp.file_formats` the writers and
readers of one format each (CSV, parquet, safetensors, JSON). Every name of both is importable from here.

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
- **An output is whole or visibly incomplete** (:func:`interp.output_folders.writing`). A run writing
  into an output folder first writes ``INCOMPLETE`` there and removes it last; a folder built whole
  elsewhere is renamed into place in one step. Readers of outputs
  (:func:`interp.output_folders.check_complete`) refuse a folder that still holds ``INCOMPLETE``.
- **Faults are one clear error.** ENOSPC, EDQUOT, EROFS, EACCES and EPERM, as an ``OSError`` or
  inside any library's own error type (safetensors' ``SafetensorError``, pyarrow, SQLite), become a
  :class:`~interp.errors.ResourceError` naming the path (:func:`fs_cause`), and the temporary is removed.
- **The umask is honoured.** Temporary files and folders are created with ``os.open(..., 0o666)``
  and ``os.mkdir(..., 0o777)``, so the kernel applies the umask (and any default ACL) exactly as for
  any other file: 0644/0755 under umask 022, 0600/0700 under 077. No umask is read or changed.

This is a base module: it imports only :mod:`interp.errors` and the standard library at top level.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from interp.errors import InterpError, ResourceError

MARKER = ".interp-output.json"
"""The file that makes a folder an interp output: ``{"interp_output": 1, "kind": ..., "files": [...]}``."""

INCOMPLETE = "INCOMPLETE"
"""Written first into an output folder by a run that writes into it in place, removed last
(:func:`interp.output_folders.writing`)."""

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
# The rest of the writer, importable from here as before

_FOLDERS = ("Adopt", "check_complete", "claim_folder", "ensure_writable_dir", "is_complete", "remove_owned",
            "saving", "staged_files", "staged_folder", "writing", "_read_marker", "_write_marker", "_owned", "_install")
_FORMATS = ("read_safetensors", "sanitize", "write_csv", "write_json", "write_parquet", "write_safetensors")


def __getattr__(name: str) -> Any:
    """Output folders (:mod:`interp.output_folders`) and the format writers (:mod:`interp.file_formats`), still
    importable from here: both build on this module's entries and files (looked up on use, so they import no cycle)."""
    home = "interp.output_folders" if name in _FOLDERS else "interp.file_formats" if name in _FORMATS else None
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(home), name)
