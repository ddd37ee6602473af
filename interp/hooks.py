"""Semantic component names and the hook points that carry them.

This is the only module that knows transformer-lens hook-point strings. Everything else in
interp names activations by what they are:

============  ==================================================  =========================
name          meaning                                              shape
============  ==================================================  =========================
resid_pre     residual stream entering block l                     [batch, pos, d_model]
resid_mid     residual after attention, before the MLP norm       [batch, pos, d_model]
resid_post    residual leaving block l                             [batch, pos, d_model]
h             MLP input: RMSNorm2(resid_mid), gamma included       [batch, pos, d_model]
attn_out      attention output added to the residual               [batch, pos, d_model]
pattern       attention probabilities                              [batch, head, q, k]
head          per-head attention value mix ``z``                   [batch, pos, head, d_head]
gate_pre      gate projection W_gate h, before the activation     [batch, pos, d_mlp]
gate          act(W_gate h), computed from ``gate_pre``           [batch, pos, d_mlp]
up            up projection W_up h                                 [batch, pos, d_mlp]
down          MLP output (after the down projection)               [batch, pos, d_model]
gate_input    input to the gate projection (equals ``h``)          [batch, pos, d_model]
============  ==================================================  =========================

``attn_out`` and ``down`` are what each sub-layer adds to the residual stream. For
Gemma-3 that is *after* its post-attention and post-feed-forward norms; for llama-style
models there are no such norms. ``h`` is the output of the norm in front of the MLP
(``post_attention_layernorm`` in llama, ``pre_feedforward_layernorm`` in Gemma-3, whose
RMSNorm scales by ``1 + gamma``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

from interp.errors import ComponentError

Component = Literal[
    "resid_pre", "resid_mid", "resid_post", "h", "attn_out", "pattern", "head",
    "gate_pre", "gate", "up", "down", "gate_input",
]

# component -> hook point template. ``gate`` is read at gate_pre and transformed.
HOOK_POINTS: dict[str, str] = {
    "resid_pre": "blocks.{layer}.hook_resid_pre",
    "resid_mid": "blocks.{layer}.hook_resid_mid",
    "resid_post": "blocks.{layer}.hook_resid_post",
    "h": "blocks.{layer}.mlp.hook_in",
    "attn_out": "blocks.{layer}.hook_attn_out",
    "pattern": "blocks.{layer}.attn.hook_pattern",
    "head": "blocks.{layer}.attn.hook_z",
    "gate_pre": "blocks.{layer}.mlp.hook_pre",
    "gate": "blocks.{layer}.mlp.hook_pre",
    "up": "blocks.{layer}.mlp.hook_pre_linear",
    "down": "blocks.{layer}.hook_mlp_out",
    "gate_input": "blocks.{layer}.mlp.gate.hook_in",
}
GATED_ONLY = frozenset({"gate_pre", "gate", "up", "gate_input"})
COMPONENTS: tuple[str, ...] = tuple(HOOK_POINTS)


def n_layers(model: Any) -> int:
    return int(model.cfg.n_layers)


def check_layers(model: Any, layers: Iterable[int] | None) -> list[int]:
    """Validated layer indices (all layers when ``None``); negative indices count from the end."""
    total = n_layers(model)
    if layers is None:
        return list(range(total))
    out = []
    for layer in layers:
        idx = int(layer)
        if not -total <= idx < total:
            raise ComponentError(f"Layer {layer} is out of range: this model has layers 0..{total - 1}.")
        out.append(idx % total)
    return out


def _architecture(model: Any) -> str:
    info = getattr(model, "info", None)
    return info.architecture if info is not None else type(model).__name__


def is_gated(model: Any) -> bool:
    info = getattr(model, "info", None)
    if info is not None:
        return bool(info.gated_mlp)
    return "blocks.0.mlp.hook_pre_linear" in model.hook_dict


def hook_point(model: Any, component: str, layer: int) -> str:
    """The hook-point name for ``component`` at ``layer``, checked to exist on ``model``."""
    if component not in HOOK_POINTS:
        raise ComponentError(f"Unknown component {component!r}. Valid components: {', '.join(COMPONENTS)}.")
    if component in GATED_ONLY and not is_gated(model):
        raise ComponentError(
            f"Component {component!r} needs a gated MLP, but {_architecture(model)} has a plain MLP. "
            "Use 'down' (MLP output) or 'h' (MLP input) instead."
        )
    (layer,) = check_layers(model, [layer])
    name = HOOK_POINTS[component].format(layer=layer)
    if name not in model.hook_dict:
        raise ComponentError(f"{_architecture(model)} has no hook point {name} for component {component!r}.")
    return name


def mlp_module(model: Any, layer: int) -> Any:
    """The Hugging Face MLP module of block ``layer`` (with gate_proj/up_proj/down_proj)."""
    block = model.original_model.model.layers[layer]
    return block.mlp


def activation_fn(model: Any, layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's activation, so ``gate = act(gate_pre)``."""
    mlp = mlp_module(model, layer)
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "act", None)
    if act is None:
        raise ComponentError(f"Cannot find the MLP activation of {_architecture(model)} layer {layer}.")
    return act


def gate_weight(model: Any, layer: int) -> torch.Tensor:
    """The gate projection weight ``[d_mlp, d_model]`` of block ``layer``."""
    if not is_gated(model):
        raise ComponentError(f"{_architecture(model)} has no gate projection.")
    return mlp_module(model, layer).gate_proj.weight


def norm2_gamma(model: Any, layer: int) -> torch.Tensor:
    """The effective per-dimension scale of the norm in front of the MLP.

    Llama-style RMSNorm multiplies by ``gamma``; Gemma's multiplies by ``1 + gamma``. The
    value returned is the multiplier actually applied, so ``|scale|`` is comparable across
    architectures.
    """
    block = model.original_model.model.layers[layer]
    norm = getattr(block, "pre_feedforward_layernorm", None) or block.post_attention_layernorm
    weight = norm.weight.detach()
    if getattr(model, "info", None) is not None and model.info.family == "gemma3":
        return 1.0 + weight
    return weight


def linear_modules(model: Any, layer: int) -> dict[str, torch.nn.Module]:
    """The linear layers of block ``layer`` by role: q, k, v, o, gate, up, down."""
    block = model.original_model.model.layers[layer]
    attn, mlp = block.self_attn, block.mlp
    found = {
        "q": getattr(attn, "q_proj", None), "k": getattr(attn, "k_proj", None),
        "v": getattr(attn, "v_proj", None), "o": getattr(attn, "o_proj", None),
        "gate": getattr(mlp, "gate_proj", None), "up": getattr(mlp, "up_proj", None),
        "down": getattr(mlp, "down_proj", None),
    }
    return {role: _unwrap_linear(mod) for role, mod in found.items() if mod is not None}


def _unwrap_linear(module: Any) -> torch.nn.Module:
    """The plain ``nn.Linear`` under a transformer-lens ``LinearBridge`` wrapper."""
    inner = getattr(module, "original_component", None)
    return inner if isinstance(inner, torch.nn.Linear) else module


def hooks_active(model: Any) -> bool:
    """Is any hook registered on the bridge's hook points (by ``model.hooks``, ``add_hook``...)?"""
    return any(point._forward_hooks or point._forward_pre_hooks or point._backward_hooks
               for point in model.hook_dict.values())


def native_model(model: Any) -> torch.nn.Module:
    """The Hugging Face model under the bridge, with every wrapper swapped for what it wraps.

    transformer-lens installs its wrappers *inside* the Hugging Face module tree, so the
    plain model is no longer reachable as is. This rebuilds the tree from shallow copies:
    every parameter and buffer is the bridge's own tensor (no memory, and quantized or
    restored weights show through), but no hook point is on the path, and attention runs
    through Hugging Face's own code instead of the bridge's step-by-step re-implementation.
    Logits are bit-identical to the bridge's (tested); use it only for forwards that need
    no hooks (:func:`hooks_active`).
    """
    def unwrap(module: torch.nn.Module) -> torch.nn.Module:
        inner = getattr(module, "original_component", None)
        source = inner if isinstance(inner, torch.nn.Module) else module
        clone = copy.copy(source)  # shares the parameter and buffer tensors
        for key, value in vars(source).items():  # own hook tables: hooks put on the clone stay off the bridge
            if "hooks" in key and isinstance(value, dict):
                clone.__dict__[key] = copy.copy(value)
        clone._modules = {name: None if child is None else unwrap(child) for name, child in source._modules.items()}
        return clone

    return unwrap(model.original_model)


# Where each component can be read on the bridge-free Hugging Face tree (native_model), for
# the families whose module layout is known: (submodule path in the decoder layer, "in" for
# its first input or "out" for its output, tuple index of that output or None). Gemma-3
# adds post-attention / post-feed-forward norms, so what enters the residual is their output.
_NATIVE_TAPS: dict[str, dict[str, tuple[str, str, int | None]]] = {
    "llama": {
        "resid_pre": ("", "in", None), "resid_post": ("", "out", 0),
        "resid_mid": ("post_attention_layernorm", "in", None), "h": ("post_attention_layernorm", "out", None),
        "attn_out": ("self_attn", "out", 0), "pattern": ("self_attn", "out", 1),
        "head": ("self_attn.o_proj", "in", None),
        "gate_pre": ("mlp.gate_proj", "out", None), "gate": ("mlp.gate_proj", "out", None),
        "up": ("mlp.up_proj", "out", None), "down": ("mlp", "out", None),
        "gate_input": ("mlp.gate_proj", "in", None),
    },
}
_NATIVE_TAPS["gemma3"] = {
    **_NATIVE_TAPS["llama"],
    "resid_mid": ("pre_feedforward_layernorm", "in", None), "h": ("pre_feedforward_layernorm", "out", None),
    "attn_out": ("post_attention_layernorm", "out", None), "down": ("post_feedforward_layernorm", "out", None),
}


def native_tap(model: Any, native: torch.nn.Module, component: str, layer: int
               ) -> tuple[torch.nn.Module, str, int | None] | None:
    """``(module, "in" | "out", output index)`` carrying ``component`` on ``native``, or ``None``.

    ``None`` means "no known native location": the caller should use the bridge's hook points.
    ``head`` arrives flat (``[batch, pos, head * d_head]``) and needs a reshape.
    """
    family = getattr(getattr(model, "info", None), "family", None)
    taps = _NATIVE_TAPS.get(str(family))
    if taps is None or component not in taps:
        return None
    path, side, index = taps[component]
    decoder: Any = native.model
    module: Any = decoder.layers[layer]
    for part in filter(None, path.split(".")):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module, side, index


def blocks(model: Any) -> Any:
    """The Hugging Face decoder layers (a ``ModuleList``)."""
    return model.original_model.model.layers


def final_norm(model: Any) -> Any:
    return model.original_model.model.norm


def unembed_weight(model: Any) -> torch.Tensor:
    return model.original_model.lm_head.weight


# Input of each linear layer of a block, by role (for calibration-based quantizers).
# ``q``/``k``/``v`` share one input (ln1's output), and so do ``gate``/``up`` (``h``);
# ``o``'s input is the per-head mix ``z`` ([batch, pos, head, d_head]); ``down``'s is
# act(gate) * up ([batch, pos, d_mlp]).
LINEAR_INPUT_HOOKS: dict[str, str] = {
    "q": "blocks.{layer}.attn.q.hook_in",
    "k": "blocks.{layer}.attn.k.hook_in",
    "v": "blocks.{layer}.attn.v.hook_in",
    "o": "blocks.{layer}.attn.o.hook_in",
    "gate": "blocks.{layer}.mlp.gate.hook_in",
    "up": "blocks.{layer}.mlp.in.hook_in",
    "down": "blocks.{layer}.mlp.out.hook_in",
}


def linear_input_hook(model: Any, layer: int, role: str) -> str:
    """The hook point carrying the input of linear layer ``role`` (q, k, v, o, gate, up, down) in block ``layer``."""
    if role not in LINEAR_INPUT_HOOKS:
        raise ComponentError(f"Unknown linear role {role!r}. Valid roles: {', '.join(LINEAR_INPUT_HOOKS)}.")
    (layer,) = check_layers(model, [layer])
    name = LINEAR_INPUT_HOOKS[role].format(layer=layer)
    if name not in model.hook_dict:
        raise ComponentError(f"{_architecture(model)} has no hook point {name} for the input of {role!r}.")
    return name
