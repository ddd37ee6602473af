"""The one output writer (interp.io): what interp never deletes, replaces or leaves half-written.

- a property test: for random trees of a user's files (nested folders, a symlink, a read-only
  folder), any sequence of writer calls leaves every pre-existing file, folder and link as it was;
- every command with an ``--out`` (enumerated from the CLI's registry, so a new command is covered
  without editing this file) over hostile folders: exit 2, one line, no traceback, nothing changed;
- one real ``interp quantize --out`` on a tiny model folder;
- the umask, a SIGKILLed writer's leftovers, and an AST guard that every delete, rename and
  temporary goes through interp/io.py ("one door per effect", /work/shared/DESIGN.md).
"""

from __future__ import annotations

import argparse
import ast
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from interp import io
from interp.errors import DataError, ResourceError

sys.path.insert(0, str(Path(__file__).parent))
from test_cli_hostile import intercept_work, run_cli  # noqa: E402  (the CLI table's own harness)

REPO = Path(__file__).resolve().parents[1]


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


DEAD = dead_pid()  # a process of this host that no longer runs


# ---------------------------------------------------------------------------------------
# Snapshots of a user's tree


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` (not following links): its type, mode, and bytes or link target."""
    seen: dict[str, tuple] = {}
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            path = Path(folder) / name
            info = path.lstat()
            rel = str(path.relative_to(root))
            if stat.S_ISLNK(info.st_mode):
                seen[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(info.st_mode):
                seen[rel] = ("dir", stat.S_IMODE(info.st_mode))
            else:
                seen[rel] = ("file", stat.S_IMODE(info.st_mode), path.read_bytes())
    return seen


def unchanged(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """The pre-existing paths that changed or went (new paths are allowed)."""
    return [path for path, what in before.items() if after.get(path) != what]


@contextmanager
def working_folder(path: Path) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def user_tree(root: Path, files: list[tuple[str, bytes]]) -> None:
    """A user's files: the drawn ones, plus a nested folder, a symlink to a folder, a read-only folder, and
    files and folders named exactly like interp's temporaries of a dead process of this host."""
    (root / "docs").mkdir()
    look_alikes(root, DEAD)
    look_alikes(root / "docs", DEAD)
    (root / "docs" / "deep").mkdir()
    (root / "docs" / "deep" / "notes.txt").write_bytes(b"keep me")
    for name, data in files:
        (root / name).write_bytes(data)
    (root / "link").symlink_to(root / "docs", target_is_directory=True)
    (root / "ro").mkdir()
    (root / "ro" / "frozen.txt").write_bytes(b"read-only")
    (root / "ro").chmod(0o555)
    (root / "empty").mkdir()


# ---------------------------------------------------------------------------------------
# Property: no sequence of writer calls changes a pre-existing path

TARGETS = [".", "..", "docs", "docs/deep", "link", "link/deep", "ro", "empty", "new", "docs/new", "link/new",
           "a.txt", "~"]
KINDS = ["report", "quantized"]
NAMES = ["a.txt", "notes.txt", "deep", "w.bin", io.MARKER]

user_names = st.sampled_from(["a.txt", "b.csv", "c.json", "quant.json", "index.html"])
ops = st.lists(st.one_of(
    st.tuples(st.just("claim"), st.sampled_from(TARGETS), st.sampled_from(KINDS), st.lists(st.sampled_from(NAMES))),
    st.tuples(st.just("stage"), st.sampled_from(TARGETS), st.sampled_from(KINDS), st.lists(st.sampled_from(NAMES)),
              st.booleans()),
    st.tuples(st.just("remove"), st.sampled_from(TARGETS), st.sampled_from(KINDS), st.lists(st.sampled_from(NAMES))),
    st.tuples(st.just("stash"), st.sampled_from(TARGETS)),
), min_size=1, max_size=6)


class Failed(Exception):
    """Raised inside a staged folder: the work failed part-way."""


def apply_op(op: tuple) -> None:
    kind_of = op[0]
    if kind_of == "claim":
        folder = io.claim_folder(op[1], op[2])
        for name in op[3]:
            if name != io.MARKER and not (folder / name).is_dir():
                io.write_bytes(folder / name, b"interp " + name.encode())
    elif kind_of == "stage":
        with io.staged_folder(op[1], op[2]) as tmp:
            for name in op[3]:
                if name != io.MARKER:
                    io.write_bytes(tmp / name, b"staged " + name.encode())
            if op[4]:
                raise Failed
    elif kind_of == "remove":
        io.remove_owned(op[1], op[3], op[2])
    else:
        io.PrivateFolder(op[1]).cleanup()


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(files=st.lists(st.tuples(user_names, st.binary(max_size=16)), max_size=4, unique_by=lambda f: f[0]),
       sequence=ops)
def test_no_writer_call_changes_a_users_file(files, sequence):
    with tempfile.TemporaryDirectory() as top:
        root = Path(top) / "home"
        root.mkdir()
        user_tree(root, files)
        before = snapshot(Path(top))
        try:
            with working_folder(root):
                old_home = os.environ.get("HOME")
                os.environ["HOME"] = str(root / "docs")  # "~" is a user's folder too
                try:
                    for op in sequence:
                        try:
                            apply_op(op)
                        except (ResourceError, Failed):
                            pass  # a refusal (or a failed piece of work) is allowed; a change is not
                finally:
                    if old_home is None:
                        del os.environ["HOME"]
                    else:
                        os.environ["HOME"] = old_home
            after = snapshot(Path(top))
            assert unchanged(before, after) == []
            leftovers = [p for p in after if io.is_temporary(Path(top) / p)]
            assert leftovers == []  # nothing half-written: every temporary was renamed into place or removed
        finally:
            (root / "ro").chmod(0o755)


def test_refusals_name_the_folder_and_the_fix(tmp_path, monkeypatch):
    user, home, other = tmp_path / "user", tmp_path / "home", tmp_path / "other"
    for folder in (user, home, other):
        folder.mkdir()
    (user / "thesis.tex").write_text("years of work")
    (other / "data.csv").write_text("1,2")
    monkeypatch.chdir(user)
    monkeypatch.setenv("HOME", str(home))
    cases = {"../other": "not empty", ".": "working folder", "..": "ancestor of the working folder",
             "~": "home folder", "/": "root folder", "thesis.tex": "is a file"}
    for target, why in cases.items():
        with pytest.raises(ResourceError, match=why) as caught:
            io.claim_folder(target, "report")
        assert "Choose an empty or new folder" in str(caught.value) and "\n" not in str(caught.value)
    io.claim_folder(tmp_path / "fresh", "quantized")
    with pytest.raises(ResourceError, match="'quantized' output, not a 'report' one"):
        io.claim_folder(tmp_path / "fresh", "report")
    assert (user / "thesis.tex").read_text() == "years of work"


def test_a_symlink_is_resolved_and_never_moved(tmp_path):
    real = tmp_path / "real"
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)  # a link to a folder that does not exist yet
    with io.staged_folder(link, "quantized") as tmp:
        io.write_bytes(tmp / "w.bin", b"1")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert (real / "w.bin").read_bytes() == b"1"
    (real / "mine.txt").write_text("user")
    with io.staged_folder(link, "quantized") as tmp:  # an earlier output of the same kind: interp's files replaced
        io.write_bytes(tmp / "v.bin", b"2")
    assert link.is_symlink()
    assert sorted(p.name for p in real.iterdir()) == [io.MARKER, "mine.txt", "v.bin"]  # w.bin was interp's


def test_full_disk_is_one_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    def full(tmp, produce):
        raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "out"
    monkeypatch.setattr(io, "_fill", full)
    with pytest.raises(ResourceError, match=r"Could not write .*out.*disk is full"):
        io.claim_folder(out, "report")
    assert list(tmp_path.iterdir()) == []  # not even the empty folder it had made
    with pytest.raises(ResourceError, match="disk is full"), io.staged_folder(out, "quantized") as tmp:
        io.write_bytes(tmp / "w.bin", b"1")
    assert list(tmp_path.iterdir()) == []
    for code, words in [(errno.EROFS, "read-only"), (errno.EACCES, "permission denied"),
                        (errno.EDQUOT, "quota")]:
        monkeypatch.setattr(io, "_fill", lambda tmp, produce, code=code: (_ for _ in ()).throw(OSError(code, "x")))
        with pytest.raises(ResourceError, match=words):
            io.write_bytes(tmp_path / "f.json", b"{}")
        assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------
# Every command with an --out, over hostile folders

REQUIRED = {"--method": "rtn:bits=4,group=32", "--budget": "3.75"}  # values for the other required options
# options a command's own checks ask for (a command missing here fails the new-folder control below, by name)
EXTRA = {"circuit": ["--clean", "The capital of France is", "--corrupt", "The capital of Italy is",
                     "--answer", " Paris", "--wrong", " Rome"],
         "tensor-types": [str(Path(__file__).parent / "fixtures" / "llama_cpp" / "smol_layer0_types.txt")],
         "prescribe": ["--budget", "3.75"]}  # or --target-bpw / --target-size: one of them, checked by the command


def out_commands() -> list[str]:
    """Every registered command whose ``--out`` names its output folder (``errors``' names its input)."""
    import interp.cli.main  # noqa: F401 - registers every command
    from interp.cli.common import COMMANDS

    names = []
    for name, (_, configure, _) in sorted(COMMANDS.items()):
        parser = argparse.ArgumentParser()
        configure(parser)
        if any("--out" in a.option_strings and a.dest == "out" for a in parser._actions):
            names.append(name)
    return names


def argv_for(name: str, out: str) -> list[str]:
    from interp.cli.common import COMMANDS

    parser = argparse.ArgumentParser()
    COMMANDS[name][1](parser)
    argv = [name, "--out", out, *EXTRA.get(name, [])]
    for action in parser._actions:
        if action.required and action.option_strings and action.dest != "out":  # positionals come from EXTRA
            option = action.option_strings[0]
            assert option in REQUIRED, f"{name} requires {option}: add a valid value to REQUIRED"
            argv += [option, REQUIRED[option]]
    return argv


HOSTILE = ["foreign", "dot", "home", "symlink", "read-only", "full"]


def hostile_target(case: str, top: Path, monkeypatch) -> str:
    user = top / "user"
    if case == "dot":
        monkeypatch.chdir(user)
        return "."
    if case == "home":
        monkeypatch.setenv("HOME", str(user))
        return "~"
    if case == "symlink":
        (top / "link").symlink_to(user, target_is_directory=True)
        return str(top / "link")
    if case == "read-only":
        return str(user / "ro")
    if case == "full":
        monkeypatch.setattr(io, "_fill", lambda tmp, produce: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
        return str(top / "new")
    return str(user)


@pytest.mark.parametrize("name", out_commands())
def test_every_out_command_refuses_hostile_folders(name, tmp_path, monkeypatch, capsys):
    intercept_work(monkeypatch)
    monkeypatch.setenv("INTERP_CACHE", str(tmp_path / "cache"))
    fresh = run_cli(argv_for(name, str(tmp_path / "fresh")), capsys)
    assert fresh.kind == "work", fresh  # the checks pass on a new folder: a refusal below is the folder's doing
    for case in HOSTILE:
        top = tmp_path / case
        (top / "user" / "ro").mkdir(parents=True)
        (top / "user" / "report.csv").write_text("a user's table")
        (top / "user" / "ro" / "frozen.txt").write_text("read-only")
        (top / "user" / "ro").chmod(0o555)
        before = snapshot(top)
        with monkeypatch.context() as patch:
            outcome = run_cli(argv_for(name, hostile_target(case, top, patch)), capsys)
            after = snapshot(top)
        (top / "user" / "ro").chmod(0o755)
        lines = [line for line in outcome.err.splitlines() if line.strip()]
        assert outcome.kind == "exit" and outcome.code == 2, (name, case, outcome)
        assert len(lines) == 1 and "Traceback" not in outcome.err and "error:" in lines[0], (name, case, outcome)
        assert unchanged(before, after) == [], (name, case)


@pytest.mark.slow
def test_quantize_on_a_tiny_model_folder_keeps_a_users_files(tmp_path, monkeypatch, capsys):
    """One real run: a user's folder is refused, a new one is written (umask modes), and a rerun of the
    same kind replaces interp's files and leaves one the user dropped in."""
    import interp
    from interp.models import export_hf

    monkeypatch.setenv("INTERP_CACHE", str(tmp_path / "cache"))
    model_dir = tmp_path / "tiny"
    export_hf(interp.tiny_model("llama"), model_dir)
    user = tmp_path / "user"
    user.mkdir()
    (user / "results.csv").write_text("mine")
    base = ["quantize", "--model", str(model_dir), "--method", "rtn:bits=4,group=32", "--n", "2", "--seq-len", "16",
            "--quiet"]
    with umask(0o022):
        refused = run_cli([*base, "--out", str(user)], capsys)
        assert (refused.kind, refused.code) == ("exit", 2) and "not empty" in refused.err
        assert sorted(p.name for p in user.iterdir()) == ["results.csv"]
        out = tmp_path / "q"
        assert run_cli([*base, "--out", str(out)], capsys).code == 0
        (out / "notes.txt").write_text("the user's")
        assert run_cli([*base, "--out", str(out)], capsys).code == 0
    assert sorted(p.name for p in out.iterdir()) == [io.MARKER, "notes.txt", "quant.json", "quantized.safetensors"]
    assert (out / "notes.txt").read_text() == "the user's"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.name != "notes.txt"} == {0o644}


# ---------------------------------------------------------------------------------------
# The umask, a killed writer, and the one door


@pytest.mark.parametrize(("mask", "file_mode", "folder_mode"), [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_files_and_folders_honour_the_umask(tmp_path, mask, file_mode, folder_mode):
    import torch
    from safetensors.torch import save_file  # it makes its files 0600 whatever the umask

    tensors = {"w": torch.zeros(2)}
    with umask(mask):
        claimed = io.claim_folder(tmp_path / "claimed" / "sub", "report")
        io.write_json(claimed / "results.json", {"a": 1})
        io.write_file(claimed / "w.safetensors", lambda p: save_file(tensors, str(p)))
        with io.staged_folder(tmp_path / "staged", "quantized") as tmp:
            (tmp / "inner").mkdir()
            io.write_bytes(tmp / "inner" / "w.bin", b"1")
            save_file(tensors, str(tmp / "direct.safetensors"))  # a writer inside the folder, not through io
    staged = tmp_path / "staged"
    folders = [tmp_path / "claimed", claimed, staged, staged / "inner"]
    files = [claimed / "results.json", claimed / io.MARKER, claimed / "w.safetensors", staged / "inner" / "w.bin",
             staged / "direct.safetensors", staged / io.MARKER]
    assert {stat.S_IMODE(p.stat().st_mode) for p in folders} == {folder_mode}
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {file_mode}




DIES = """
import os, sys
from pathlib import Path
from interp import io
parent = Path(sys.argv[1])
stash = io.PrivateFolder(parent)
made = [io._make_temp(parent, "results.json"), stash.path]
(made[0] / "results.json").write_text("half")
(made[1] / "inner").mkdir()
print(" ".join(map(str, made)), flush=True)
os._exit(0)  # like a kill: no finalizer, no cleanup
"""


def look_alikes(folder: Path, pid: int) -> list[Path]:
    """A user's files and folders named exactly like interp's temporaries of a dead process of this host,
    without a token that checks out (none, a wrong one, one in a file that is not a regular file)."""
    shape = f"{pid}-{io._HOST}-0123456789abcdef"
    paths = [folder / f".results.json.partial-{shape}", folder / f"interp-stash-{shape}",
             folder / f".out.partial-{pid}", folder / ".X.partial-foo", folder / "notes.partial-1",
             folder / "interp-stash-mine"]
    paths[0].write_text("a user's file")
    paths[1].mkdir()
    (paths[1] / io.TOKEN_FILE).write_text("f" * 32)  # a token, but not the secret of the name's token
    (paths[1] / "thesis.tex").write_text("years of work")
    paths[2].mkdir()
    (paths[2] / "data.csv").write_text("1,2")
    for path in paths[3:]:
        path.write_text("user")
    return paths


def test_a_dead_runs_temporaries_are_cleaned_and_nothing_else(tmp_path):
    child = subprocess.run([sys.executable, "-c", DIES, str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                           check=True)
    temporaries = [Path(p) for p in child.stdout.split()]
    assert all(io.is_temporary(p) for p in temporaries)
    users = look_alikes(tmp_path, dead_pid())
    alive = io._make_temp(tmp_path, "other")  # this process: still running
    before = snapshot(tmp_path)
    io.write_json(tmp_path / "results.json", {"a": 1})
    assert not any(p.exists() for p in temporaries)
    assert alive.exists() and not any(io.is_temporary(p) for p in users)
    assert unchanged({k: v for k, v in before.items() if not k.startswith(tuple(p.name for p in temporaries))},
                     snapshot(tmp_path)) == []
    io._remove_temp(alive)


def test_a_look_alike_is_deleted_when_temporaries_are_known_by_name_alone(tmp_path, monkeypatch):
    """The mutation check of the test above: with :func:`interp.io.is_temporary` reading the name alone
    (the rule before this change), the same write deletes a user's look-alike files."""
    users = look_alikes(tmp_path, dead_pid())
    monkeypatch.setattr(io, "is_temporary", lambda path: io._TEMP.match(Path(path).name) is not None)
    io.write_json(tmp_path / "results.json", {"a": 1})
    assert [p.name for p in users if not p.exists()] == [users[1].name]  # the look-alike folder and its thesis


KILLED = """
import os, sys, time
from interp import io
with io.staged_folder(sys.argv[1], "quantized") as tmp:
    io.write_bytes(tmp / "w.bin", b"half of it")
    print(tmp, flush=True)
    time.sleep(60)
"""


def test_a_sigkilled_export_leaves_a_partial_folder_that_the_next_run_removes(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", KILLED, str(tmp_path / "out")], stdout=subprocess.PIPE,
                             text=True, cwd=REPO)
    partial = Path(child.stdout.readline().strip())
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    assert partial.is_dir() and partial.parent.parent == tmp_path and not (tmp_path / "out").exists()
    assert io.is_temporary(partial.parent)  # the output being built sits in a temporary that holds the token
    with io.staged_folder(tmp_path / "out", "quantized") as tmp:
        io.write_bytes(tmp / "w.bin", b"whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (tmp_path / "out" / "w.bin").read_bytes() == b"whole"


# every call that deletes, renames or makes a temporary; outside the writer's modules none may appear
WRITER_MODULES = {"interp/io.py", "interp/output_folders.py"}  # the writer, split along responsibilities
MODULE_CALLS = {("shutil", "rmtree"), ("shutil", "move"), ("os", "replace"), ("os", "rename"), ("os", "remove"),
                ("os", "unlink"), ("os", "rmdir"), ("os", "removedirs"), ("tempfile", "mkstemp"),
                ("tempfile", "mkdtemp"), ("tempfile", "TemporaryDirectory"), ("tempfile", "NamedTemporaryFile")}
FORBIDDEN_NAMES = {name for _, name in MODULE_CALLS}
PATH_METHODS = {"unlink", "rmdir"}  # Path's: no other type in interp has them
ALLOWED: dict[str, str] = {}  # "path:line": why (genuinely process-private temporaries only); none today


def door_violations(source: str, filename: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and node.module in {"os", "shutil", "tempfile"}:
            found += [f"{filename}:{node.lineno} from {node.module} import {a.name}" for a in node.names
                      if a.name in FORBIDDEN_NAMES]
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        attr, owner = node.func.attr, node.func.value
        if isinstance(owner, ast.Name) and (owner.id, attr) in MODULE_CALLS:
            found.append(f"{filename}:{node.lineno} {owner.id}.{attr}")
        elif attr in PATH_METHODS:
            found.append(f"{filename}:{node.lineno} .{attr}()")
        # Path.rename/replace(target): one argument, called on a name (str.replace takes two; pandas'
        # rename is called with columns= or on an expression)
        elif attr in {"rename", "replace"} and isinstance(owner, ast.Name) and len(node.args) == 1 \
                and not node.keywords:
            found.append(f"{filename}:{node.lineno} {owner.id}.{attr}()")
    return found


def test_every_delete_rename_and_temporary_goes_through_the_writer():
    found = []
    for path in sorted((REPO / "interp").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel not in WRITER_MODULES:
            found += door_violations(path.read_text(), rel)
    assert [f for f in found if f.split(" ")[0] not in ALLOWED] == []


def test_the_guard_catches_each_spelling():
    source = ("import os, shutil, tempfile\nfrom shutil import rmtree\nshutil.rmtree(p)\nos.replace(a, b)\n"
              "tempfile.mkdtemp()\np.unlink()\ntmp.rename(target)\ntmp.replace(target)\ns.replace('a', 'b')\n"
              "frame.rename(columns={})\n")
    assert [v.split(" ", 1)[1] for v in door_violations(source, "x.py")] == [
        "from shutil import rmtree", "shutil.rmtree", "os.replace", "tempfile.mkdtemp", ".unlink()",
        "tmp.rename()", "tmp.replace()"]


# ---------------------------------------------------------------------------------------
# Every file goes through the writer

# the calls that write a file (pandas, plotly, safetensors, transformers, torch, numpy, sqlite, pathlib, shutil)
WRITE_METHODS = {"write_text", "write_bytes", "to_csv", "to_parquet", "to_feather", "to_excel", "to_json",
                 "to_pickle", "save_file", "save_pretrained", "write_html", "write_image", "write_images",
                 "savetxt", "savez", "copyfile", "copy2", "copytree", "touch"}
MODULE_WRITES = {("torch", "save"), ("np", "save"), ("numpy", "save"), ("sqlite3", "connect"), ("shutil", "copy")}
THROUGH = {"write_file", "write_many"}  # a lambda or function handed to these writes a temporary of the writer
STAGED = {"staged_folder", "staged_files"}  # in `with staged_folder(...) as tmp:` a library writes interp's temporary
# "path:line": why a write outside the writer is allowed
WRITE_ALLOWED: dict[str, str] = {}


def _call_name(node: ast.AST) -> str:
    func = node.func if isinstance(node, ast.Call) else node
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _writes(node: ast.Call) -> str | None:
    """What ``node`` writes, when it is a call that writes a file; ``None`` otherwise."""
    func = node.func
    if isinstance(func, ast.Name) and func.id == "open" or isinstance(func, ast.Attribute) and func.attr == "open":
        modes = [a for a in node.args[1:2]] + [k.value for k in node.keywords if k.arg == "mode"]
        if isinstance(func, ast.Attribute) and not isinstance(func.value, ast.Name | ast.Attribute | ast.Call):
            return None
        if isinstance(func, ast.Attribute):
            modes = [a for a in node.args[:1]] + [k.value for k in node.keywords if k.arg == "mode"]
        if any(isinstance(m, ast.Constant) and isinstance(m.value, str) and set(m.value) & set("wax+")
               for m in modes):
            return "open(..., 'w')"
        return None
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
            and (func.value.id, func.attr) in MODULE_WRITES:
        return f"{func.value.id}.{func.attr}"
    if isinstance(func, ast.Attribute) and func.attr in WRITE_METHODS:
        if func.attr in {"to_csv", "to_json"} and not node.args and not any(
                k.arg in {"path_or_buf", "path"} for k in node.keywords):
            return None  # returns the text
        if func.attr == "write_text" and isinstance(func.value, ast.Name) and func.value.id == "io":
            return None  # interp.io.write_text
        if func.attr == "write_bytes" and isinstance(func.value, ast.Name) and func.value.id == "io":
            return None
        return f".{func.attr}()"
    if isinstance(func, ast.Name) and func.id in {"save_file", "copyfile", "copy2", "copytree"}:
        return f"{func.id}()"
    return None


def _through_the_writer(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether ``node`` sits in a lambda or function handed to write_file/write_many, or in a staged folder."""
    child, parent = node, parents.get(node)
    while parent is not None:
        if isinstance(child, ast.Lambda) and isinstance(parent, ast.Call) and _call_name(parent) in THROUGH:
            return True
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            scope = parents.get(child)
            for call in ast.walk(scope) if scope is not None else []:
                if isinstance(call, ast.Call) and _call_name(call) in THROUGH and any(
                        isinstance(a, ast.Name) and a.id == child.name for a in call.args):
                    return True
        if isinstance(parent, ast.With | ast.AsyncWith) and child in parent.body and any(
                isinstance(item.context_expr, ast.Call) and _call_name(item.context_expr) in STAGED
                for item in parent.items):
            return True
        child, parent = parent, parents.get(parent)
    return False


def write_violations(source: str, filename: str) -> list[str]:
    tree = ast.parse(source, filename)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (what := _writes(node)) and not _through_the_writer(node, parents):
            found.append((node.lineno, node.col_offset, f"{filename}:{node.lineno} {what}"))
    return [f for *_, f in sorted(found)]


def test_every_file_write_goes_through_the_writer():
    """No module but the writer's (``WRITER_MODULES``) writes a file itself: every pandas, plotly, safetensors,
    transformers, torch, numpy, SQLite and plain write is a ``produce`` handed to :func:`interp.io.write_file`
    (or ``write_many``), or a library writing into a staged folder's temporary."""
    found = []
    for path in sorted((REPO / "interp").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel not in WRITER_MODULES:
            found += write_violations(path.read_text(), rel)
    assert [f for f in found if f.split(" ")[0] not in WRITE_ALLOWED] == []


def test_the_write_guard_catches_each_spelling():
    """The mutation check of the guard: each way of writing a file outside the writer is found, and the same
    calls handed to the writer are not."""
    source = ("import sqlite3, torch\n"
              "frame.to_csv(out / 'a.csv')\nfig.write_html(out / 'a.html')\nsave_file(t, str(p))\n"
              "model.save_pretrained(out)\n(out / 'x').write_text('a')\ntorch.save(t, p)\nsqlite3.connect(p)\n"
              "open(p, 'w')\nwith open(p, mode='ab') as fh: pass\np.open('w')\nshutil.copy(a, b)\n"
              "text = frame.to_csv(index=False)\nopen(p)\np.open()\n"
              "write_file(p, lambda tmp: frame.to_csv(tmp))\n"
              "def produce(tmp):\n    save_file(t, str(tmp))\nwrite_file(p, produce)\n"
              "with staged_folder(out, 'k') as tmp:\n    model.save_pretrained(tmp)\n"
              "with staged_files(out) as tmp:\n    model.save_pretrained(tmp)\n")
    assert [v.split(" ", 1)[1] for v in write_violations(source, "x.py")] == [
        ".to_csv()", ".write_html()", "save_file()", ".save_pretrained()", ".write_text()", "torch.save",
        "sqlite3.connect", "open(..., 'w')", "open(..., 'w')", "open(..., 'w')", "shutil.copy"]


# ---------------------------------------------------------------------------------------
# Inside an output an entry is replaced, never written through (interp.io._entry)

FILE_LINKS = ["results.json", "index.html"]
FOLDER_LINKS = ["tables", "figures"]
WRITES = ["json", "html", "table", "figures", "staged", "files", "folder"]


def write_op(out: Path, op: str) -> None:
    if op == "json":
        io.write_json(out / "results.json", {"run": 2})
    elif op == "html":
        io.write_text(out / "index.html", "<p>run 2</p>")
    elif op == "table":
        io.write_bytes(out / "tables" / "a.csv", b"run,2\n")
    elif op == "figures":
        io.write_many([out / "figures" / "a.png", out / "figures" / "b.svg"],
                      lambda tmps: [p.write_bytes(b"run 2") for p in tmps])
    elif op == "folder":
        io.write_bytes(io.ensure_writable_dir(out / "tables" / "sub") / "b.csv", b"run,2\n")
    elif op == "staged":
        with io.staged_folder(out, "report") as tmp:
            io.write_json(tmp / "results.json", {"run": 2})
            io.write_bytes(tmp / "tables" / "a.csv", b"run,2\n")
    else:
        with io.staged_files(out) as tmp:
            (tmp / "index.html").write_text("<p>run 2</p>")


def links_written_through(top: Path, links: list[str], ops: list[str]) -> list[str]:
    """What goes wrong when an earlier ``report`` output holds ``links`` out of it and ``ops`` write it again:
    files outside the output that changed, and file links that are still links after being written."""
    outside = top / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "victim").write_text("the user's file")
    (outside / "dir" / "a.csv").write_text("the user's table")
    out = io.claim_folder(top / "out", "report")
    for name in links:
        (out / name).symlink_to(outside / "victim" if name in FILE_LINKS else outside / "dir")
    before = snapshot(outside)
    for op in ops:
        try:
            write_op(out, op)
        except ResourceError as exc:  # a refusal is allowed (a folder link on the way), a write through is not
            assert "symbolic link" in str(exc) and "\n" not in str(exc)
    after = snapshot(outside)  # nothing outside may change, and nothing may be added there either
    problems = [f"outside: {p}" for p in sorted(set(before) | set(after)) if before.get(p) != after.get(p)]
    written = {"json": ["results.json"], "html": ["index.html"], "staged": ["results.json"], "files": ["index.html"]}
    for name in {n for op in ops for n in written.get(op, [])} & set(links):
        if (out / name).is_symlink():
            problems.append(f"still a link: {name}")
    return problems


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(links=st.lists(st.sampled_from(FILE_LINKS + FOLDER_LINKS), unique=True, min_size=1),
       ops=st.lists(st.sampled_from(WRITES), min_size=1, max_size=4))
def test_nothing_is_written_through_a_link_inside_an_earlier_output(links, ops):
    with tempfile.TemporaryDirectory() as top:
        assert links_written_through(Path(top), links, ops) == []


def test_a_link_named_like_an_output_file_is_replaced_and_its_target_kept(tmp_path):
    """The case from the issue: ``results.json -> /outside/victim`` in an earlier output; the rerun leaves the
    victim as it was and puts a regular file in the link's place."""
    assert links_written_through(tmp_path, ["results.json"], ["json"]) == []
    assert (tmp_path / "outside" / "victim").read_text() == "the user's file"
    assert not (tmp_path / "out" / "results.json").is_symlink()
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == {"run": 2}


def test_a_link_is_written_through_when_every_path_is_resolved(tmp_path, monkeypatch):
    """The mutation check: with :func:`interp.io._entry` resolving the whole path (the rule before this change),
    the property above finds the victim overwritten."""

    def resolve_all(path):
        target = io.resolve(path)
        io._make_dirs(target.parent)
        return target

    monkeypatch.setattr(io, "_entry", resolve_all)
    assert links_written_through(tmp_path, ["results.json"], ["json"]) == ["outside: victim",
                                                                           "still a link: results.json"]


# ---------------------------------------------------------------------------------------
# A full disk inside a library is one ResourceError (interp.io.fs_cause)

SAFETENSORS_FULL = ('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left '
                    'on device" })')


def library_failures() -> list[tuple[str, BaseException, str]]:
    import sqlite3

    from safetensors import SafetensorError

    return [("safetensors", SafetensorError(SAFETENSORS_FULL), "disk is full"),
            ("pyarrow", OSError("Failed to write: No space left on device"), "disk is full"),
            ("sqlite", sqlite3.OperationalError("database or disk is full"), "disk is full"),
            ("tokenizers", Exception("Read-only file system (os error 30)"), "read-only"),
            ("wrapped", RuntimeError("save failed"), "quota")]


def raise_(exc: BaseException):
    def produce(*_):
        if str(exc) == "save failed":  # raised from a quota error, as libraries chain them
            raise exc from OSError(errno.EDQUOT, "Disk quota exceeded")
        raise exc
    return produce


@pytest.mark.parametrize("case", range(5))
def test_a_full_disk_inside_any_library_is_one_resource_error(tmp_path, case):
    name, exc, words = library_failures()[case]
    with pytest.raises(ResourceError, match=rf"Could not write .*w\.bin: .*{words}") as caught:
        io.write_file(tmp_path / "w.bin", raise_(exc))
    assert "\n" not in str(caught.value)
    with pytest.raises(ResourceError, match=words), io.staged_folder(tmp_path / "out", "quantized") as tmp:
        raise_(exc)(tmp)
    with pytest.raises(ResourceError, match=words), io.staged_files(tmp_path / "files") as tmp:
        raise_(exc)(tmp)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["files"]  # no temporary left, no output installed
    assert list((tmp_path / "files").iterdir()) == []


def test_a_library_error_stays_raw_when_only_oserror_is_read(tmp_path, monkeypatch):
    """The mutation check: with :func:`interp.io.fs_cause` reading only an ``OSError``'s errno (the rule before
    this change), safetensors' own error type escapes as a raw error."""
    from safetensors import SafetensorError

    monkeypatch.setattr(io, "fs_cause", lambda exc: exc.errno if isinstance(exc, OSError) else None)
    with pytest.raises(SafetensorError):
        io.write_file(tmp_path / "w.bin", raise_(SafetensorError(SAFETENSORS_FULL)))


def test_another_library_error_is_not_reinterpreted(tmp_path):
    with pytest.raises(ValueError, match="bad tensor"):
        io.write_file(tmp_path / "w.bin", raise_(ValueError("bad tensor")))
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------
# Whole or visibly incomplete after a kill at any point (interp.io.writing)

OUTPUT_FILES = ["results.json", "index.html", "tables/a.csv"]

KILL_AT = """
import contextlib, os, signal, sys
from pathlib import Path
from interp import io
out, how, kill_at, mutate, run = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
steps = []

def counted(name, fn):
    def step(*args, **kwargs):
        steps.append(name)
        if len(steps) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kwargs)
    return step

for name in ("open", "write", "mkdir", "replace", "rename", "unlink", "rmdir", "fsync"):
    setattr(os, name, counted(name, getattr(os, name)))
if mutate:  # the one place switched off: writing() marks nothing
    io.writing = contextlib.contextmanager(lambda folder: (yield Path(folder)))
files = sys.argv[6].split(",")
if how == "in place":
    with io.writing(out):
        for name in files:
            io.write_text(Path(out) / name, run)
else:
    with io.staged_folder(out, "report") as tmp:
        for name in files:
            io.write_text(tmp / name, run)
print(" ".join(steps))
"""


def write_killed(out: Path, how: str, kill_at: int, run: str, mutate: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KILL_AT, str(out), how, str(kill_at), str(int(mutate)), run,
                           ",".join(OUTPUT_FILES)], capture_output=True, text=True, cwd=REPO, timeout=60)


def earlier_output(top: Path) -> Path:
    out = io.claim_folder(top / "out", "report")
    for name in OUTPUT_FILES:
        io.write_text(out / name, "run 1")
    (top / "user.txt").write_text("the user's")
    return out


def whole_or_flagged(top: Path, out: Path) -> list[str]:
    """The invariant after a kill: every file outside the output as it was, and the output either whole (all of
    one run) or holding INCOMPLETE, which a reader refuses."""
    problems = []
    if (top / "user.txt").read_text() != "the user's":
        problems.append("a file outside the output changed")
    if io.is_complete(out):
        runs = {(out / name).read_text() for name in OUTPUT_FILES}
        if len(runs) != 1:
            problems.append(f"no INCOMPLETE, but the files mix runs: {sorted(runs)}")
    else:
        with pytest.raises(DataError, match="incomplete"):
            io.check_complete(out)
    return problems


def kill_points(how: str) -> int:
    with tempfile.TemporaryDirectory() as top:
        done = write_killed(earlier_output(Path(top)), how, 0, "run 2")
        assert done.returncode == 0, done.stderr
        return len(done.stdout.split())


@pytest.fixture(scope="module")
def n_steps() -> dict[str, int]:
    return {how: kill_points(how) for how in ("in place", "staged")}


@settings(max_examples=24, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                   HealthCheck.function_scoped_fixture])
@given(how=st.sampled_from(["in place", "staged"]), where=st.floats(0, 1, exclude_max=True))
def test_an_output_is_whole_or_says_it_is_incomplete_after_a_kill_at_any_point(n_steps, how, where):
    kill_at = 1 + int(where * n_steps[how])  # one of the run's file-system steps
    with tempfile.TemporaryDirectory() as top:
        out = earlier_output(Path(top))
        killed = write_killed(out, how, kill_at, "run 2")
        assert killed.returncode == -signal.SIGKILL, (kill_at, killed.stderr)
        assert whole_or_flagged(Path(top), out) == [], (how, kill_at)
        rerun = write_killed(out, how, 0, "run 2")  # the rerun finishes it, and leaves no temporary
        assert rerun.returncode == 0, rerun.stderr
        assert io.is_complete(out) and {(out / n).read_text() for n in OUTPUT_FILES} == {"run 2"}
        leftovers = [p for p in Path(top).rglob("*") if io.is_temporary(p)]
        assert leftovers == []


def test_a_kill_leaves_a_mixed_output_that_looks_whole_without_the_marker(n_steps):
    """The mutation check: with :func:`interp.io.writing` marking nothing, a kill between two files leaves
    an output that mixes two runs and looks complete."""
    with tempfile.TemporaryDirectory() as top:
        out = earlier_output(Path(top))
        steps = write_killed(out, "in place", 0, "run 1", mutate=True).stdout.split()  # the steps of a run
    second_file = [i for i, step in enumerate(steps) if step == "replace"][1]  # kill_at is 1-based: just before it
    with tempfile.TemporaryDirectory() as top:
        out = earlier_output(Path(top))
        killed = write_killed(out, "in place", second_file, "run 2", mutate=True)
        assert killed.returncode == -signal.SIGKILL
        assert whole_or_flagged(Path(top), out) == ["no INCOMPLETE, but the files mix runs: ['run 1', 'run 2']"]


# ---------------------------------------------------------------------------------------
# A library object's .save(folder) is whole or visibly incomplete too (interp.output_folders.saving)


def _savers() -> dict[str, tuple]:
    """name -> (make(version), save(obj, folder), the file it writes last, load(folder) or None), built by hand."""
    import numpy as np
    import torch

    from interp.localize.patching.patches import Patch
    from interp.localize.patching.results import PatchResult
    from interp.localize.restoration import RestorationResult
    from interp.probes import ProbeResult
    from interp.quant import Sensitivity
    from interp.quant.llama_plan import LlamaPlan
    from interp.quant.shapes import WeightShape

    ids = ["a", "b", "c"]
    shapes = [WeightShape(0, "q", 64, 64), WeightShape(0, "k", 64, 64)]
    return {
        "probe": (lambda v: ProbeResult({"resid_post/norm": torch.full((2, 3), float(v))}, [0, 1], ids, {"v": v}),
                  lambda obj, folder: obj.save(folder), "probe.parquet", ProbeResult.load),
        "sensitivity": (lambda v: Sensitivity("rtn:bits=4,group=32", [0, 0], ["q", "k"], [64, 64],
                                              np.full((2, 3), float(v))),
                        lambda obj, folder: obj.save(folder), "sensitivity.json", Sensitivity.load),
        "patch": (lambda v: PatchResult(torch.full((1, 3), float(v)), torch.zeros(3), torch.ones(3),
                                        [Patch("resid_post", (0,))], ids, "logit_diff", {"v": v}),
                  lambda obj, folder: obj.save(folder, "up"), "up.json", None),
        "restoration": (lambda v: RestorationResult([0, 1], [[], [0]], torch.full((2, 3), 1.0 + v), torch.ones(3),
                                                    ids),
                        lambda obj, folder: obj.save(folder), "restoration.csv", None),
        "llama plan": (lambda v: LlamaPlan({"0.q": "q4_k", "0.k": "q6_k" if v == 1 else "q8_0"}, 5.0, 4.9 + v / 100,
                                           (3.0, 8.0), {"Q4_K_M": 4.8}, 0.1 * v),
                       lambda obj, folder: obj.save(folder, shapes), "tensor_types.txt", None),
    }


def saved_files(folder: Path) -> dict[str, bytes]:
    """The files a save wrote in ``folder`` (interp's marker and INCOMPLETE aside)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name not in (io.MARKER, io.INCOMPLETE)}


def fail_writing(name: str):
    """A ``_fill`` whose write of the file ``name`` fails (a full disk), every other write going through."""
    real = io._fill

    def fill(tmp: Path, produce):
        if tmp.name == name:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tmp, produce)

    return fill


def save_failed_part_way(name: str, top: Path, monkeypatch) -> tuple[Path, dict[int, dict[str, bytes]]]:
    """Save version 1 into ``top/out``, then version 2 failing at its last file; also a whole save of each
    version elsewhere, whose files are what a whole output holds."""
    make, save, last, _ = _savers()[name]
    whole = {}
    for version in (1, 2):
        save(make(version), top / f"whole{version}")
        whole[version] = saved_files(top / f"whole{version}")
    assert whole[1] != whole[2] and all(last in files for files in whole.values())
    out = top / "out"
    save(make(1), out)
    with monkeypatch.context() as patched:
        patched.setattr(io, "_fill", fail_writing(last))
        with pytest.raises(ResourceError, match="disk is full"):
            save(make(2), out)
    return out, whole


def whole_or_flagged_save(out: Path, whole: dict[int, dict[str, bytes]]) -> list[str]:
    """The invariant after a save failed part-way: the folder is one version's files whole, or it says it is
    incomplete (and a check of it refuses it)."""
    if not io.is_complete(out):
        with pytest.raises(DataError, match="incomplete"):
            io.check_complete(out)
        return []
    files = saved_files(out)
    versions = sorted({v for name, data in files.items() for v in (1, 2) if whole[v].get(name) == data})
    return [] if any(files == whole[v] for v in (1, 2)) else [f"no INCOMPLETE, but the files mix versions {versions}"]


@pytest.mark.parametrize("name", ["probe", "sensitivity", "patch", "restoration", "llama plan"])
def test_a_library_save_that_fails_part_way_says_so_and_a_rerun_completes_it(name, tmp_path, monkeypatch):
    out, whole = save_failed_part_way(name, tmp_path, monkeypatch)
    assert not io.is_complete(out) and whole_or_flagged_save(out, whole) == []
    make, save, last, load = _savers()[name]
    if load is not None:  # the object's own .load refuses what a failed save left
        with pytest.raises(DataError, match="incomplete"):
            load(out)
    save(make(2), out)  # the rerun
    assert io.is_complete(out) and saved_files(out) == whole[2]
    assert [p for p in tmp_path.rglob("*") if io.is_temporary(p)] == []
    if load is not None:
        assert load(out) is not None


def test_a_library_save_into_a_folder_interp_did_not_write_is_refused(tmp_path):
    """Saving claims the folder as interp's first (a command's --out, already one, is written as it is): a folder
    holding a user's files is refused and left as it was; one holding only this save's own files is taken over."""
    make, save, _, _ = _savers()["probe"]
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    with pytest.raises(ResourceError, match="is not empty"):
        save(make(1), user)
    assert sorted(p.name for p in user.iterdir()) == ["thesis.tex"]
    earlier = tmp_path / "earlier"  # saved before output folders carried interp's marker
    save(make(1), earlier)
    (earlier / io.MARKER).unlink()
    save(make(2), earlier)
    assert (earlier / io.MARKER).is_file()
    report = io.claim_folder(tmp_path / "report", "report")  # another kind of interp output: written in place
    save(make(1), report)
    assert (report / "probe.json").is_file() and io.is_complete(report)


def test_a_failed_save_mixes_two_versions_and_looks_whole_without_the_marker(tmp_path, monkeypatch):
    """The mutation check: with :func:`interp.output_folders.writing` marking nothing, the same failure leaves a
    folder that mixes two saves and looks complete."""
    import interp.output_folders

    monkeypatch.setattr(interp.output_folders, "writing", contextmanager(lambda folder: (yield Path(folder))))
    out, whole = save_failed_part_way("probe", tmp_path, monkeypatch)
    assert whole_or_flagged_save(out, whole) == ["no INCOMPLETE, but the files mix versions [1, 2]"]
