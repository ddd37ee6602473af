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
- **Exact.** A model loads exactly or not at all (:func:`pretrained_model`, :func:`check_exact`): transformers'
  own loading information (``output_loading_info=True``) must name no missing, unexpected or mis-shaped tensor
  (each would be randomly initialised or dropped), and a head the config ties to the embedding must not
  differ from a head the folder holds. Each is a :class:`~interp.errors.ModelLoadError` naming the tensors.

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
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from interp.errors import ModelLoadError
from interp.reading import JSON_LIMIT, read_json, regular_file

__all__ = ["CODE_FILES", "INDEX_FILE", "check_exact", "check_folder", "check_gguf", "check_safetensors", "confined",
           "model_from_config", "pretrained", "pretrained_model", "refuse_code", "tied_pairs"]

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


# ---------------------------------------------------------------------------------------
# Exact loads: every tensor the model holds came from the folder, and every tensor the folder holds was used


def pretrained_model(loader: Any, folder: str | os.PathLike[str], **kwargs: Any) -> Any:
    """:func:`pretrained` for a model class (``AutoModelForCausalLM``), loaded exactly or not at all.

    transformers is asked for its loading information (``output_loading_info=True``; mis-shaped tensors
    are reported there rather than raised, ``ignore_mismatched_sizes=True``) and :func:`check_exact`
    refuses any load that is not exact. Warnings may stay silenced: nothing here reads them.
    """
    model, info = pretrained(loader, folder, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs)
    where = Path(folder) / kwargs["gguf_file"] if "gguf_file" in kwargs else Path(folder)
    check_exact(model, info, where, None if "gguf_file" in kwargs else saved_tensors(Path(folder)))
    return model


def saved_tensors(folder: Path) -> Callable[[str], Any]:
    """``name -> tensor`` (or None) read from ``folder``'s safetensors files, one tensor at a time (headers only
    until a tensor is asked for). The files were checked by :func:`check_folder`."""
    from safetensors import safe_open

    files = dict.fromkeys(_index_files(folder) + sorted(folder.glob("*.safetensors")))
    owner: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as fh:
            owner.update(dict.fromkeys(fh.keys(), path))

    def read(name: str) -> Any:
        if name not in owner:
            return None
        with safe_open(str(owner[name]), framework="pt") as fh:
            return fh.get_tensor(name)

    return read


_LAYER = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)\.")


def _listed(keys: Iterable[Any], limit: int = 6) -> str:
    items = sorted(str(k) for k in keys)
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _layers_in(keys: Iterable[str]) -> set[int]:
    return {int(m.group(1)) for key in keys if (m := _LAYER.search("." + key))}


def tied_pairs(model: Any) -> dict[str, str]:
    """``target -> source`` of the parameters ``model``'s config ties (``lm_head.weight -> model.embed_tokens.weight``).

    transformers' ``all_tied_weights_keys`` holds the ties it made; when a folder holds both tensors it may make
    none although the config says ``tie_word_embeddings``, so the class's declared ties count too.
    """
    pairs = dict(getattr(model, "all_tied_weights_keys", None) or {})
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    declared = getattr(model, "_tied_weights_keys", None)
    if getattr(config, "tie_word_embeddings", False) and isinstance(declared, Mapping):
        pairs.update({str(k): str(v) for k, v in declared.items() if str(k) not in pairs})
    return pairs


def check_exact(model: Any, info: Mapping[str, Any], where: Path | str,
                saved: Callable[[str], Any] | None = None) -> None:
    """Refuse a load that is not exact, naming the tensors (:class:`~interp.errors.ModelLoadError`).

    Args:
        model: the loaded transformers model.
        info: transformers' loading information (``missing_keys``, ``unexpected_keys``, ``mismatched_keys``,
            ``error_msgs``), or the same keys built from ``load_state_dict``'s answer.
        where: the folder or file, for the message.
        saved: ``name -> tensor or None``, the tensors the source holds (to compare a tied head with a saved one);
            None when they cannot be read one by one (a GGUF file).

    Example:
        >>> import torch, transformers
        >>> cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        ...                                num_attention_heads=2, tie_word_embeddings=False)
        >>> model = transformers.AutoModelForCausalLM.from_config(cfg)
        >>> check_exact(model, {"missing_keys": {"lm_head.weight"}}, "folder")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        interp.errors.ModelLoadError: folder does not load exactly: ... untied head (lm_head), but the weights ...
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    missing = {str(k) for k in info.get("missing_keys") or ()}
    unexpected = {str(k) for k in info.get("unexpected_keys") or ()}
    mismatched = list(info.get("mismatched_keys") or ())
    errors = [str(e) for e in info.get("error_msgs") or ()]
    problems: list[str] = []
    tied = tied_pairs(model)
    n_layers = getattr(config, "num_hidden_layers", None)
    absent = sorted(layer for layer in _layers_in(missing)
                    if all(k in missing for k in model.state_dict() if layer in _layers_in([k])))
    if absent and n_layers is not None:
        problems.append(f"config.json says num_hidden_layers={n_layers}, but the weights hold no tensor of "
                        f"layers {absent} (they would be randomly initialised); set num_hidden_layers to the layers "
                        "saved")
        missing = {k for k in missing if not (_layers_in([k]) & set(absent))}
    extra = sorted(layer for layer in _layers_in(unexpected) if n_layers is not None and layer >= n_layers)
    if extra:
        problems.append(f"config.json says num_hidden_layers={n_layers}, but the weights hold layers {extra} too "
                        "(they would be ignored); set num_hidden_layers to the layers saved")
        unexpected = {k for k in unexpected if not (_layers_in([k]) & set(extra))}
    heads = {k for k in missing if k.endswith("lm_head.weight")}
    if heads and not getattr(config, "tie_word_embeddings", False):
        named = _listed(h.removesuffix(".weight") for h in heads)
        problems.append(f"config.json says the model has an untied head ({named}), but the weights hold none (it "
                        "would be randomly initialised); set tie_word_embeddings to true if the head is the embedding")
        missing -= heads
    if missing:
        problems.append(f"tensors missing from the weights (they would be randomly initialised): {_listed(missing)}")
    if unexpected:
        problems.append(f"tensors in the weights that the model has no place for (they would be ignored): "
                        f"{_listed(unexpected)}")
    if mismatched:
        shown = [f"{m[0]} (saved {list(m[1])}, model {list(m[2])})" if isinstance(m, (tuple, list)) and len(m) == 3
                 else str(m) for m in mismatched]
        problems.append(f"tensors whose saved shape is not the one config.json gives: {_listed(shown, 4)}")
    if errors:
        problems.append(f"transformers reported: {'; '.join(errors)[:300]}")
    if saved is not None:
        for target, source in sorted(tied.items()):
            kept = saved(target)
            if kept is None:
                continue
            live = model.get_parameter(source)  # what the config says the head is (transformers may keep either)
            if live.is_meta:  # offloaded: compare the two saved tensors
                live = saved(source)
            if live is None or tuple(kept.shape) != tuple(live.shape) or not bool(
                    (kept.to(live.dtype) == live.detach().cpu()).all()):
                problems.append(f"config.json ties {target} to {source} (tie_word_embeddings), but the weights hold a "
                                f"{target} that differs from it (one of the two would be used or saved in place of "
                                "the other); set tie_word_embeddings to false")
    if problems:
        raise ModelLoadError(f"{where} does not load exactly: " + "; ".join(problems) + ". interp loads a model "
                             "exactly or not at all: fix config.json or the weights.")
