"""Each registration in docs/preregistration/ was committed on its own, at a commit where the package imports.

docs/preregistration/README.md says a registration is committed on its own, before its data. This checks it
from the history, for every registration file there now and every one added later:

- the commit that added the file touches nothing else (the README, which describes the registration and holds
  no code or data, may change with it);
- the package at that commit imports: the commit's ``interp/`` is extracted (``git archive``) into a temporary
  folder and, in a fresh interpreter whose path holds only that copy, ``import interp`` and every name in
  ``interp.__all__`` (the lazy attributes import their modules) must load. A registration fingerprints code, so
  the code it names must be a state that runs.

A clone without history (shallow, or no git) cannot show either, and the checks skip with that reason. The
registrations committed before this check existed and that do not meet it are exempt, each with the reason
read from the history; a test keeps each exemption honest (it fails once the history no longer shows why).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDER = "docs/preregistration"
BESIDE = {f"{FOLDER}/README.md"}  # may change in the same commit: the registration's description

# Registrations added before this check, in commits that also changed code: name -> (adding commit, why)
EXEMPT = {
    "smollm2-confirmatory-1.json": (
        "48b81cb", "added with interp/report/confirm.py, the code that runs it: the first registration and the "
                   "protocol were committed together"),
    "smollm2-confirmatory-2.json": (
        "ef6f0c9", "added inside an unrelated 16-file commit (issue 35's toolbox); at that commit interp.validate "
                   "lacks 'checked', which a file committed minutes later supplied, so the package does not import"),
    "llama-cpp-plans-4.json": (
        "ab17b2c", "added with interp/quant/imatrix.py, interp/cli/prescribe.py and their tests: the importance "
                   "matrix it registers"),
    "llama-cpp-plans-5.json": (
        "ba31fe9", "added with interp/quant/prescribe.py's tail-aware allocation and its test, which it registers"),
}


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True,
                          timeout=120).stdout


def _history_missing() -> str | None:
    """Why this checkout cannot show its history, or None."""
    try:
        shallow = _git("rev-parse", "--is-shallow-repository").strip()
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout: the registrations' commits cannot be read"
    if shallow == "true":
        return "a shallow clone: the commits that added the registrations are not here (fetch with --unshallow)"
    return None


NO_HISTORY = _history_missing()
needs_history = pytest.mark.skipif(NO_HISTORY is not None, reason=NO_HISTORY or "")


def _registrations() -> list[str]:
    return sorted(p.name for p in (ROOT / FOLDER).glob("*.json"))


def _added_in(name: str) -> str:
    """The commit that added ``docs/preregistration/NAME`` (the oldest one, should it have been re-added)."""
    commits = _git("log", "--diff-filter=A", "--format=%H", "--", f"{FOLDER}/{name}").split()
    if not commits:
        pytest.fail(f"{FOLDER}/{name} is not committed: a registration is committed on its own, before its data "
                    "(docs/preregistration/README.md)")
    return commits[-1]


def _touched(commit: str) -> set[str]:
    return set(_git("show", "--format=", "--name-only", "--no-renames", commit).split())


def _imports(commit: str) -> tuple[bool, str]:
    """Whether the package at ``commit`` imports: its interp/ alone, in a fresh interpreter, at low priority."""
    folder = Path(tempfile.mkdtemp(prefix="interp-at-commit-"))
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit, "interp"],
                                 capture_output=True, check=True, timeout=120).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True, timeout=120)
        code = ("import interp, pathlib, sys\n"
                f"assert pathlib.Path(interp.__file__).resolve().is_relative_to({str(folder.resolve())!r})\n"
                "for name in getattr(interp, '__all__', []):\n"
                "    getattr(interp, name)\n")
        env = {**os.environ, "PYTHONPATH": str(folder), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1"}
        run = subprocess.run(["nice", "-n", "15", sys.executable, "-c", code], cwd=folder, env=env,
                             capture_output=True, text=True, timeout=600)
        return run.returncode == 0, (run.stderr.strip().splitlines() or [""])[-1]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _checked() -> list[str]:
    return [n for n in _registrations() if n not in EXEMPT]


@needs_history
@pytest.mark.parametrize("name", _checked())
def test_a_registration_is_added_in_a_commit_of_its_own(name):
    commit = _added_in(name)
    other = _touched(commit) - {f"{FOLDER}/{name}"} - BESIDE
    assert not other, (f"{FOLDER}/{name} was added in {commit[:7]} together with {sorted(other)}: commit a "
                       "registration on its own (its README entry may come with it)")


@pytest.mark.slow
@needs_history
@pytest.mark.parametrize("name", _checked())
def test_the_package_imports_at_the_commit_that_adds_a_registration(name):
    commit = _added_in(name)
    ok, last = _imports(commit)
    assert ok, f"at {commit[:7]}, which adds {FOLDER}/{name}, the package does not import: {last}"


@needs_history
@pytest.mark.parametrize("name", sorted(EXEMPT))
def test_each_exemption_is_what_the_history_shows(name):
    """An exempt registration is still there, was added in the commit named, and that commit did change other
    files (otherwise it needs no exemption and the checks above should read it)."""
    prefix, why = EXEMPT[name]
    assert (ROOT / FOLDER / name).is_file(), f"{name} is exempt but no longer in {FOLDER}"
    commit = _added_in(name)
    assert commit.startswith(prefix), f"{name} was added in {commit[:7]}, not {prefix} as its exemption says"
    assert _touched(commit) - {f"{FOLDER}/{name}"} - BESIDE, f"{name}'s commit touches nothing else: drop it " \
                                                             f"from EXEMPT ({why})"


def test_every_registration_is_checked_or_exempt():
    """Guards the checks from passing on nothing: today's registrations are found, and a file added later is
    checked unless it is named in EXEMPT (which only registrations committed before this test may be)."""
    names = _registrations()
    assert {"smollm2-confirmatory-2.json", "gemma3-confirmatory-1.json"} <= set(names)
    assert set(EXEMPT) <= set(names)
    assert len(_checked()) >= 6
