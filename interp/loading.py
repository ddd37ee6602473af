"""The loading boundary: the one door through which interp hands a folder to transformers.

Every ``from_pretrained`` in interp is :func:`pretrained` (a test fails on any other call), and
every model built from a folder's config is :func:`model_from_config`. They guarantee:

- **No folder's code runs.** ``trust_remote_code=False`` is always passed, so transformers
  never asks "run the custom code? [y/N]" (a piped ``y`` would answer it), and a folder whose
  ``config.json``, ``tokenizer_config.json`` or processor config carries an ``auto_map`` (a
  pointer to Python files of its own) is refused before transformers opens it.
- **Nothing outside the folder is read.** Every weight file, whether found in the folder or
  named by ``model.safetensors.index.json``, must lie inside it once symlinks are resolved
  (a Hugging Face hub snapshot may link into its own repository's ``blobs/``).
- **Every read is bounded.** The JSON files are read through :mod:`interp.reading`;
  safetensors and GGUF headers are checked against the file's size before a library parses
  them, so a truncated file or a huge header is a clear :class:`~interp.errors.ModelLoadError`.
- **Offline.** ``local_files_only=True`` always.

Example:
    >>> import json, pathlib, tempfile
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (folder / "config.json").write_text(json.dumps({"auto_map": {"AutoConfig": "code.Config"}}))
    >>> check_folder(folder)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    interp.errors.ModelLoadError: .../config.json has an auto_map ({"AutoConfig": "code.Config"}): it asks to run ...
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from interp.errors import ModelLoadError
from interp.reading import JSON_LIMIT, read_json, regular_file

__all__ = ["CODE_FILES", "INDEX_FILE", "check_folder", "check_gguf", "check_safetensors", "confined",
           "model_from_config", "pretrained", "refuse_code"]

CODE_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json",
              "feature_extractor_config.json", "image_processor_config.json")
INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_HEADER_LIMIT = 100_000_000  # the safetensors format's own bound on the header
GGUF_MAGIC = b"GGUF"


def read_config(path: Path) -> Any:
    """A model folder's JSON file, bounded, with its errors as :class:`~interp.errors.ModelLoadError`."""
    return read_json(path, "the model file", JSON_LIMIT, ModelLoadError)


def _auto_map(value: Any, depth: int = 0) -> Any:
    """The first ``auto_map`` entry in ``value`` or in the dicts nested in it (``text_config``, ...)."""
    if not isinstance(value, Mapping) or depth > 3:
        return None
    if "auto_map" in value:
        return value["auto_map"]
    return next((found for v in value.values() if (found := _auto_map(v, depth + 1)) is not None), None)


def refuse_code(folder: Path) -> None:
    """Refuse a folder whose configs point at Python code of its own (``auto_map``): interp never runs it."""
    for name in CODE_FILES:
        path = folder / name
        if not path.exists():
            continue
        found = _auto_map(read_config(path))
        if found is not None:
            shown = json.dumps(found)[:120]
            raise ModelLoadError(f"{path} has an auto_map ({shown}): it asks to run Python code from the model "
                                 "folder, and interp never runs a folder's code. Use a model whose architecture "
                                 "transformers ships (and delete the auto_map if the folder does not need it).")


def _root(folder: Path) -> Path:
    """Where ``folder``'s files may lie: the folder, or for a hub snapshot (``models--X/snapshots/REV``) its repo."""
    resolved = folder.resolve()
    if resolved.parent.name == "snapshots" and resolved.parent.parent.name.startswith("models--"):
        return resolved.parent.parent
    return resolved


def confined(folder: Path, name: Any, what: str) -> Path:
    """``folder / name`` when ``name`` is a relative file name that stays inside ``folder`` (symlinks resolved)."""
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise ModelLoadError(f"{what} names the file {name!r}, which is not a file name inside {folder}; "
                             "a model folder may only name its own files.")
    path = folder / name
    if not path.resolve().is_relative_to(_root(folder)):
        raise ModelLoadError(f"{what} names {name!r}, which lies outside the model folder {folder}; interp reads "
                             "only the folder's own files. Copy the weights into the folder.")
    return path


def _index_files(folder: Path) -> list[Path]:
    """The shard files ``model.safetensors.index.json`` names, each confined to ``folder``."""
    index = folder / INDEX_FILE
    if not index.exists():
        return []
    record = read_config(index)
    weight_map = record.get("weight_map") if isinstance(record, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index} has no weight_map (an object from tensor name to shard file); it is "
                             "truncated or not a safetensors index.")
    names = sorted({v if isinstance(v, str) else repr(v) for v in weight_map.values()})
    return [confined(folder, name, str(index)) for name in names]


def check_safetensors(path: Path) -> None:
    """Refuse a safetensors file whose header is larger than the format allows or than the file, or malformed."""
    size = regular_file(path, "the weights file", ModelLoadError).stat().st_size
    head = _head(path, 8)
    if len(head) < 8:
        raise ModelLoadError(f"Could not load the model: {path} is {size} bytes, too short for a safetensors file "
                             "(it is truncated).")
    (length,) = struct.unpack("<Q", head)
    if length > SAFETENSORS_HEADER_LIMIT or 8 + length > size:
        raise ModelLoadError(f"Could not load the model: {path} claims a {length}-byte header in a {size}-byte "
                             "file (it is truncated or not a safetensors file).")
    try:
        header = json.loads(_head(path, 8 + length)[8:])
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict):
        raise ModelLoadError(f"Could not load the model: {path} has a malformed safetensors header (it is truncated "
                             "or not a safetensors file).")
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
               and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2), default=0)
    if 8 + length + end > size:
        raise ModelLoadError(f"Could not load the model: {path} is {size} bytes but its header places tensors up to "
                             f"byte {8 + length + end} (the file is truncated). Copy it again.")


def _head(path: Path, n: int) -> bytes:
    with path.open("rb") as fh:  # a regular file (checked by the caller): reading its first n bytes is bounded
        return fh.read(n)


def check_gguf(path: Path) -> None:
    """Refuse what is not a GGUF file (magic, version, counts that fit the file) before it is hashed or parsed."""
    size = regular_file(path, "the GGUF file", ModelLoadError).stat().st_size
    head = _head(path, 24)
    if head[:4] != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (it does not start with 'GGUF'); pass a valid .gguf file.")
    if len(head) < 24:
        raise ModelLoadError(f"{path} is truncated: {size} bytes, shorter than a GGUF header. Copy it again.")
    version, n_tensors, n_values = struct.unpack("<IQQ", head[4:24])
    if version not in (2, 3) or n_tensors * 24 + n_values * 12 > size:  # each entry takes at least that many bytes
        raise ModelLoadError(f"{path} has a malformed GGUF header (version {version}, {n_tensors} tensors, "
                             f"{n_values} values in {size} bytes): it is truncated or corrupt.")


def check_folder(folder: Path, weights: bool = True) -> None:
    """Everything :func:`pretrained` checks before transformers reads ``folder`` (see the module's guarantees).

    ``weights=False`` checks the configs only (a GGUF file's folder, whose other files are not read as weights).
    """
    refuse_code(folder)
    if not weights:
        return
    found = [confined(folder, p.name, str(folder)) for p in sorted(folder.glob("*.safetensors"))]
    shards = _index_files(folder) + found
    for path in dict.fromkeys(shards):
        check_safetensors(path)


def pretrained(loader: Any, folder: str | os.PathLike[str], **kwargs: Any) -> Any:
    """``loader.from_pretrained(folder, ...)`` (``AutoTokenizer``, ``AutoConfig``, ``AutoModelForCausalLM``, a
    processor) after :func:`check_folder`, offline and with ``trust_remote_code=False``, which cannot be overridden.

    ``gguf_file=`` checks the folder's configs only (the weights are the GGUF file, checked by :func:`check_gguf`).
    """
    path = Path(folder)
    if "gguf_file" in kwargs:
        check_gguf(path / kwargs["gguf_file"])
    check_folder(path, weights="gguf_file" not in kwargs)
    return loader.from_pretrained(path, trust_remote_code=False, local_files_only=True, **kwargs)


def model_from_config(config: Any, **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_config(config)`` with ``trust_remote_code=False`` (a config's ``auto_map``
    would otherwise make transformers ask to run the folder's code)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, trust_remote_code=False, **kwargs)
