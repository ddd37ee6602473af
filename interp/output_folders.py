"""Output folders: what makes a folder interp's, how an output is built and installed, and how a run that
writes into one in place leaves it whole or visibly incomplete. Part of the one writer (:mod:`interp.io`, which
re-exports every name here, so ``from interp.io import claim_folder`` works as before).

- **Nothing foreign is deleted or replaced.** A folder output is interp's only when it carries a
  marker (:data:`interp.io.MARKER`, a small JSON naming the output's kind) that interp wrote when it created or
  first claimed the folder. An existing non-empty folder without the marker of the same kind is
  refused; inside an owned folder only interp's own named entries are ever replaced or removed
  (:func:`claim_folder`, :func:`remove_owned`).
- **An output is whole or visibly incomplete** (:func:`writing`). A folder built whole elsewhere is
  renamed into place in one step (:func:`staged_folder`); a run writing into an output folder in place
  first writes ``INCOMPLETE`` there and removes it last. Readers of outputs (:func:`check_complete`)
  refuse a folder that still holds ``INCOMPLETE``.

Every file goes through :func:`interp.io.write_file`. The writer's one places (``_entry`` for where an entry
goes, ``is_temporary`` for what interp made) are looked up on :mod:`interp.io` when called, so that switching one
off there (as the tests' mutation checks do) switches it off here too.

This is a base module: it imports only :mod:`interp.io`, :mod:`interp.errors` and the standard library.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from interp import io as _writer
from interp.errors import DataError, ResourceError
from interp.io import (
    _RESERVED,
    FIX,
    INCOMPLETE,
    MARKER,
    TOKEN_FILE,
    _disk_errors,
    _make_dirs,
    _make_temp,
    _remove_temp,
    _remove_tree,
    _shown,
    check_output_folder,
    clean_stale,
    fs_error,
    resolve,
    write_bytes,
    write_text,
)

__all__ = ["Adopt", "check_complete", "claim_folder", "ensure_writable_dir", "is_complete", "remove_owned", "saving",
           "staged_files", "staged_folder", "writing"]

_writing: dict[str, int] = {}  # output folders this process is writing in place (nesting depth)


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
    return sorted(name for name in os.listdir(folder) if name != MARKER and not _writer.is_temporary(folder / name))


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
    over the names there (never through a link), as :func:`interp.io.write_file` does for one file."""
    parent = _writer._entry(Path(folder) / TOKEN_FILE).parent  # the folder, made, resolved as any entry's
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


@contextmanager
def saving(folder: str | os.PathLike[str], kind: str, own: Iterable[str] = ()) -> Iterator[Path]:
    """Write a library object's files into ``folder`` (its ``.save``), in place and visibly incomplete until the
    last one is in: the same :func:`writing` the commands run under, so a kill or a failure part-way leaves
    ``INCOMPLETE`` there, which the object's ``.load`` (:func:`check_complete`) refuses; a rerun completes it.

    ``folder`` (yielded as given) is made when needed and must be writable (:func:`ensure_writable_dir`). An interp
    output of any kind (a command's ``--out``, an earlier save) is written as it is; any other folder becomes a
    ``kind`` output first (:func:`claim_folder`): a new or empty one, or one holding only the files ``own`` names
    (this save's own, written before output folders carried a marker). A non-empty folder interp did not write is
    refused, as the root, the home folder and the working folder are.
    """
    path = ensure_writable_dir(Path(folder))
    if _read_marker(resolve(path)) is None:
        names = set(own)
        claim_folder(path, kind, adopt=(lambda found: set(_entries(found)) <= names) if names else None)
    with writing(path):
        yield path


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
        _writer._entry(path / TOKEN_FILE, make=False)  # inside an output, a link on the way is refused before anything
        path.mkdir(parents=True, exist_ok=True)
        # a probe file of this process's own: two processes checking one folder must not unlink each other's
        with tempfile.NamedTemporaryFile(dir=path, prefix=".interp-write-test-", delete=True) as probe_file:
            probe_file.write(b"ok")
    except OSError as exc:
        raise ResourceError(
            f"Cannot write to the output folder {path} ({exc.strerror}). Choose a writable folder with --out."
        ) from None
    return path
