"""Content digests for caches: a cached result is reused only if everything it was computed from is identical.

:func:`cache_key` is the one place an interp cache key is made from what a result was computed from (the
report's stages and batch parts, the token cache). It takes each input as a digest of its *content*, never a
path, a name or a modification time, and always adds :func:`code_fingerprint`, the SHA-256 of interp's own
source, so that no cache can leave it out. A change to any input (the weights, the data, the tokenizer, the
code or a setting) gives another key, and the result is computed again.

Example:
    >>> from interp.digests import cache_key
    >>> a = cache_key(settings="n=4", data="d1")
    >>> a == cache_key(settings="n=4", data="d1"), a == cache_key(settings="n=4", data="d2")
    (True, False)

This is a base module: it imports only the standard library at top level.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent  # the interp package
CODE_SUFFIXES = (".py", ".j2", ".css", ".js", ".json")  # what interp runs and renders (templates included)


def file_digest(path: str | os.PathLike[str], chunk: int = 1 << 22) -> str:
    """The SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def files_digest(paths: Iterable[str | os.PathLike[str]]) -> str:
    """The SHA-256 of several files: each one's name and content digest, in name order."""
    digest = hashlib.sha256()
    for path in sorted(Path(p) for p in paths):
        digest.update(f"{path.name}\x00{file_digest(path)}\x01".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def texts_digest(texts: Iterable[str]) -> str:
    """The SHA-256 of a sequence of texts (their order and exact characters)."""
    digest = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """The SHA-256 of interp's source: every ``.py`` file and template of the package, by path and content.

    Any change to the code that computes a cached result (a fix, a new default) changes it."""
    digest = hashlib.sha256()
    for path in sorted(p for p in ROOT.rglob("*") if p.suffix in CODE_SUFFIXES and p.is_file()
                       and "__pycache__" not in p.parts):
        digest.update(f"{path.relative_to(ROOT).as_posix()}\x00".encode())
        digest.update(file_digest(path).encode())
    return digest.hexdigest()


def cache_key(**inputs: str) -> str:
    """The key under which a result computed from ``inputs`` (each a digest of its content, by name: ``weights``,
    ``data``, ``tokenizer``, ``settings``, ...) is cached, with :func:`code_fingerprint` always added.

    Two results share a key only if every input and the code are the same."""
    if not inputs or not all(isinstance(v, str) and v for v in inputs.values()):
        raise ValueError(f"cache_key needs each input as a non-empty digest string; got {inputs!r}")
    record = {**inputs, "code": code_fingerprint()}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]
