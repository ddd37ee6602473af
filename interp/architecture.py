"""What a Hugging Face decoder looks like inside, read from its modules rather than from a name list.

Where the decoder layers sit (:func:`decoder_layers_path`), the bridge-free module tree
(:func:`plain_module_tree`), and each block's layout (``_layout``): attention and MLP
submodules, fused projections, gated or plain MLP, and whether a norm scales by ``1 + gamma``.
:mod:`interp.models` builds :class:`~interp.models.ModelInfo` from it, and
:mod:`interp.runtime.hooks` finds hook points with it.
"""

from __future__ import annotations

import copy
import functools
import types
from typing import Any

import torch

from interp.errors import ModelLoadError


def plain_module_tree(hf_model: torch.nn.Module) -> torch.nn.Module:
    """``hf_model`` with every transformer-lens wrapper swapped for the module it wraps.

    transformer-lens installs its wrappers *inside* the Hugging Face module tree. This
    rebuilds the tree from shallow copies: every parameter and buffer is the model's own
    tensor (no memory is copied), but no wrapper or hook point is on the path. A plain
    model comes back as an equivalent copy.
    """
    def unwrap(module: torch.nn.Module) -> torch.nn.Module:
        inner = getattr(module, "original_component", None)
        source = inner if isinstance(inner, torch.nn.Module) else module
        clone = copy.copy(source)  # shares the parameter and buffer tensors
        for key, value in vars(source).items():  # own hook tables: hooks put on the clone stay off the original
            if "hooks" in key and isinstance(value, dict):
                clone.__dict__[key] = copy.copy(value)
        clone._modules = {name: None if child is None else unwrap(child) for name, child in source._modules.items()}
        if "_hf_hook" in vars(source):  # accelerate's dispatch hook: its forward is bound to the source module
            _rebind_dispatch_hook(source, clone)
        return clone

    return unwrap(hf_model)


def _rebind_dispatch_hook(source: torch.nn.Module, clone: torch.nn.Module) -> None:
    """Point an accelerate-dispatched module's patched ``forward`` at ``clone``, so that the clone runs
    its own (unwrapped) children and hooks put on them fire; the weights still arrive through the hook."""
    old = vars(source)["_old_forward"]
    bound = types.MethodType(getattr(old, "__func__", old), clone)
    clone._old_forward = bound  # type: ignore[assignment]  # accelerate's attribute, not a submodule
    patched = vars(source)["forward"]
    clone.forward = functools.update_wrapper(functools.partial(patched.func, clone), bound)  # type: ignore[method-assign]


def decoder_layers_path(hf_model: Any) -> str:
    """Where the decoder layers of a causal LM live: ``"model.layers"``, ``"transformer.h"``, ..."""
    prefix = getattr(hf_model, "base_model_prefix", "") or "model"
    base = getattr(hf_model, prefix, None)
    for name in ("layers", "h", "blocks"):
        if isinstance(getattr(base, name, None), torch.nn.ModuleList):
            return f"{prefix}.{name}"
    raise ModelLoadError(
        f"{type(hf_model).__name__} keeps no list of decoder layers where interp looks ({prefix}.layers, "
        f"{prefix}.h); interp supports decoder-only causal LMs with one list of blocks."
    )


SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "gpt2", "gpt_neox")
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def check_supported(config: Any, name: str) -> None:
    """Refuse encoder-decoder and mixture-of-experts configs (an HF config or config.json's dict) by name.

    Both would otherwise load part-way: an encoder-decoder is no causal LM, and a MoE block's
    ``mlp`` is a router over experts, which interp would read as one plain MLP.
    """
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    model_type = str(get("model_type", "") or "")
    families = ", ".join(SUPPORTED)
    if get("is_encoder_decoder", False):
        raise ModelLoadError(f"{name} is an encoder-decoder model ({model_type or 'unknown type'}), which interp does "
                             f"not support: it analyses decoder-only causal LMs ({families}; see docs/models.md).")
    counted = {key: get(key) for key in _EXPERT_COUNTS}
    experts = {key: value for key, value in counted.items() if isinstance(value, int) and value > 1}
    if experts:
        counts = ", ".join(f"{key}={value}" for key, value in experts.items())
        raise ModelLoadError(f"{name} is a mixture-of-experts model ({model_type or 'unknown type'}: {counts}), which "
                             f"interp does not support: it needs one dense MLP per block ({families}; see "
                             "docs/models.md).")


def follow(obj: Any, dotted: str) -> Any:
    """The attribute at a dotted path, e.g. ``follow(model, "model.layers")``."""
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


_ATTENTION = ("self_attn", "attn", "attention")


_QKV_PER_HEAD = ("query_key_value",)  # GPT-NeoX / BLOOM: rows [head, (q, k, v), d_head]


_QKV_BLOCKED = ("qkv_proj", "c_attn", "Wqkv")  # rows [q | k | v]


def _is_norm(module: torch.nn.Module) -> bool:
    name = type(module).__name__.lower()
    return isinstance(module, torch.nn.LayerNorm) or "norm" in name


def _norm_offset(norm: torch.nn.Module, device: torch.device) -> float:
    """1.0 when an RMSNorm multiplies by ``1 + gamma`` (Gemma), 0.0 when by ``gamma``: measured, not looked up."""
    weight = getattr(norm, "weight", None)
    if isinstance(norm, torch.nn.LayerNorm) or not isinstance(weight, torch.Tensor):
        return 0.0
    if weight.is_meta:  # offloaded by a device_map: accelerate's hook holds the value (and loads it for the forward)
        hook: Any = norm._hf_hook
        weight = hook.weights_map["weight"]
        device = weight.device if device.type == "meta" else device
    eps = float(getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", None) or 1e-6)
    generator = torch.Generator().manual_seed(0)
    # host: drawn from a seeded CPU generator (the same probe input on every device), then moved once
    x = torch.randn(4, weight.shape[-1], generator=generator).to(device=device, dtype=weight.dtype)
    with torch.no_grad():
        y = norm(x).float()
    xf = x.float()
    normalized = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return float(round(float((y / normalized - weight.detach().float()).median())))


def _trace_block(plain: Any, layers_path: str) -> dict[str, Any]:
    """Which norm feeds the MLP, and whether outputs are normed or the block is parallel: one tiny forward."""
    block = follow(plain, layers_path)[0]
    attention = next(getattr(block, n) for n in _ATTENTION if hasattr(block, n))
    seen: dict[str, Any] = {}
    handles = [block.register_forward_pre_hook(
        lambda m, args, kwargs: seen.__setitem__("block_in", args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True)]
    handles.append(block.mlp.register_forward_pre_hook(lambda m, args: seen.__setitem__("mlp_in", args[0])))
    handles.append(attention.register_forward_hook(
        lambda m, args, out: seen.__setitem__("attn_out", out[0] if isinstance(out, tuple) else out)))
    norms = {name: child for name, child in block.named_children() if _is_norm(child)}
    for name, child in norms.items():
        handles.append(child.register_forward_hook(
            lambda m, args, out, name=name: seen.__setitem__(name, (args[0], out))))
    device = next(plain.parameters()).device
    try:
        with torch.no_grad():
            plain(input_ids=torch.tensor([[0, 1, 2]], device=device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    # identity first: a norm feeding the MLP hands it its very output tensor (equal values alone can
    # mislead: in a fresh model every LayerNorm has the same weights)
    def feeds(pairs: list[tuple[str, Any, Any]], target: Any) -> str:
        return next((n for n, a, b in pairs if b is target), "") or next(
            (n for n, a, b in pairs if b.shape == target.shape and torch.equal(b, target)), "")

    outputs = [(n, None, seen[n][1]) for n in norms if n in seen]
    inputs = [(n, None, seen[n][0]) for n in norms if n in seen]
    mlp_norm = feeds(outputs, seen["mlp_in"])
    return {
        "mlp_norm": mlp_norm,
        "post_norms": bool(feeds(inputs, seen["attn_out"])),
        "parallel_residual": bool(mlp_norm) and seen[mlp_norm][0] is seen["block_in"],
        "norm_module": norms.get(mlp_norm) or next(iter(norms.values()), None),
    }


def _layout(hf_model: Any) -> dict[str, Any]:
    """The block layout of a causal LM, read from its (unwrapped) module tree."""
    from transformers.pytorch_utils import Conv1D

    plain = plain_module_tree(hf_model)
    check_supported(hf_model.config, type(hf_model).__name__)
    layers_path = decoder_layers_path(plain)
    block = follow(plain, layers_path)[0]
    attention = next((getattr(block, n) for n in _ATTENTION if hasattr(block, n)), None)
    mlp = getattr(block, "mlp", None)
    if attention is None or mlp is None:
        raise ModelLoadError(f"{type(hf_model).__name__}: its blocks have no attention ({'/'.join(_ATTENTION)}) "
                             "or no mlp submodule; interp supports decoder blocks with both.")
    fused_qkv = ("per_head" if any(hasattr(attention, n) for n in _QKV_PER_HEAD)
                 else "blocked" if any(hasattr(attention, n) for n in _QKV_BLOCKED) else "")
    traced = _trace_block(plain, layers_path)
    norm = traced.pop("norm_module")
    device = next(plain.parameters()).device
    return {
        "layers_path": layers_path,
        "gated_mlp": hasattr(mlp, "gate_proj") or hasattr(mlp, "gate_up_proj"),
        "fused_gate_up": hasattr(mlp, "gate_up_proj"),
        "fused_qkv": fused_qkv,
        "conv1d": any(isinstance(m, Conv1D) for m in mlp.modules()),
        "norm": "layernorm" if isinstance(norm, torch.nn.LayerNorm) else "rmsnorm",
        "norm_offset": _norm_offset(norm, device) if norm is not None else 0.0,
        **traced,
    }


def _family(model_type: str, architecture: str) -> str:
    """A label for the model: the config's ``model_type`` (``gemma3_text`` reads ``gemma3``)."""
    label = (model_type or architecture).lower()
    return "gemma3" if label.startswith("gemma3") else label
