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
mlp_pre       plain MLPs: W_in h + b, before the activation        [batch, pos, d_mlp]
============  ==================================================  =========================

Which components a model has follows from its layout (:class:`interp.models.ModelInfo`):
``gate_pre``, ``gate``, ``up`` and ``gate_input`` need a gated MLP (separate ``gate_proj`` or
Phi-3's fused ``gate_up_proj``, whose output the bridge splits into gate and up);
``mlp_pre`` needs a plain one (GPT-2, GPT-NeoX); ``resid_mid`` does not exist in a parallel
block (GPT-NeoX: attention and MLP both read ``resid_pre``). :func:`components` lists them.

``attn_out`` and ``down`` are what each sub-layer adds to the residual stream. For
Gemma-3 that is *after* its post-attention and post-feed-forward norms; for llama-style
models there are no such norms. ``h`` is the output of the norm in front of the MLP
(``post_attention_layernorm`` in llama, ``pre_feedforward_layernorm`` in Gemma-3, whose
RMSNorm scales by ``1 + gamma``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from interp.architecture import decoder_layers_path, follow, plain_module_tree
from interp.errors import ComponentError
from interp.validate import layer_indices

Component = Literal[
    "resid_pre", "resid_mid", "resid_post", "h", "attn_out", "pattern", "head",
    "gate_pre", "gate", "up", "down", "gate_input", "mlp_pre",
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
    "mlp_pre": "blocks.{layer}.mlp.hook_pre",  # [batch, pos, d_mlp]
}
GATED_ONLY = frozenset({"gate_pre", "gate", "up", "gate_input"})
PLAIN_ONLY = frozenset({"mlp_pre"})
SERIAL_ONLY = frozenset({"resid_mid"})
COMPONENTS: tuple[str, ...] = tuple(HOOK_POINTS)


def n_layers(model: Any) -> int:
    return int(model.cfg.n_layers)


def check_layers(model: Any, layers: Iterable[int] | None) -> list[int]:
    """Validated layer indices (all layers when ``None``); negative indices count from the end.

    Bools, floats, strings and an empty selection are refused (:func:`interp.validate.layer_indices`).
    """

    return layer_indices(layers, n_layers(model))


def _architecture(model: Any) -> str:
    info = getattr(model, "info", None)
    return info.architecture if info is not None else type(model).__name__


def _info(model: Any) -> Any:
    return getattr(model, "info", None)


def family(model: Any) -> str:
    info = _info(model)
    return str(info.family) if info is not None else type(model).__name__


def is_gated(model: Any) -> bool:
    info = _info(model)
    if info is not None:
        return bool(info.gated_mlp)
    return "blocks.0.mlp.hook_pre_linear" in model.hook_dict


def components(model: Any) -> list[str]:
    """The components ``model`` has, in :data:`COMPONENTS` order."""
    info = _info(model)
    drop = set(PLAIN_ONLY if is_gated(model) else GATED_ONLY)
    if info is not None and info.parallel_residual:
        drop |= SERIAL_ONLY
    return [c for c in COMPONENTS if c not in drop]


def hook_point(model: Any, component: str, layer: int) -> str:
    """The hook-point name for ``component`` at ``layer``, checked to exist on ``model``."""
    if component not in HOOK_POINTS:
        raise ComponentError(f"Unknown component {component!r}. Valid components: {', '.join(COMPONENTS)}.")
    have = components(model)
    if component not in have:
        why = ("a gated MLP, but it has a plain MLP" if component in GATED_ONLY else
               "a plain (non-gated) MLP, but it has a gated MLP" if component in PLAIN_ONLY else
               "a serial block, but its attention and MLP both read resid_pre (parallel residual)")
        raise ComponentError(
            f"Component {component!r} needs {why}: {_architecture(model)} (family {family(model)}) has "
            f"{', '.join(have)}."
        )
    (layer,) = check_layers(model, [layer])
    name = HOOK_POINTS[component].format(layer=layer)
    if name not in model.hook_dict:
        raise ComponentError(f"{_architecture(model)} (family {family(model)}) has no hook point {name} for "
                             f"component {component!r}; it has {', '.join(have)}.")
    return name


def mlp_module(model: Any, layer: int) -> Any:
    """The Hugging Face MLP module of block ``layer``."""
    return blocks(model)[layer].mlp


def activation_fn(model: Any, layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's activation, so ``gate = act(gate_pre)`` (or ``act(mlp_pre)`` for a plain MLP)."""
    mlp = mlp_module(model, layer)
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "act", None) or getattr(mlp, "activation_fn", None)
    if act is None:
        raise ComponentError(f"Cannot find the MLP activation of {_architecture(model)} layer {layer}.")
    return act


def gate_weight(model: Any, layer: int) -> torch.Tensor:
    """The gate projection weight ``[d_mlp, d_model]`` of block ``layer`` (a view into a fused one)."""
    if not is_gated(model):
        raise ComponentError(f"{_architecture(model)} (family {family(model)}) has no gate projection: "
                             "its MLP is not gated.")
    return linear_weights(model, layer)["gate"].read()


def norm2_gamma(model: Any, layer: int) -> torch.Tensor:
    """The effective per-dimension scale of the norm in front of the MLP.

    Llama-style RMSNorm multiplies by ``gamma``; Gemma's multiplies by ``1 + gamma``
    (``info.norm_offset``, measured on the module at load). The value returned is the
    multiplier actually applied, so ``|scale|`` is comparable across architectures.
    """
    info = _info(model)
    name = info.mlp_norm if info is not None else "post_attention_layernorm"
    block = blocks(model)[layer]
    if not name or not hasattr(block, name):
        raise ComponentError(f"{_architecture(model)} (family {family(model)}) has no norm in front of its MLP "
                             "(its norms act on the sub-layer outputs), so there is no MLP-input gamma.")
    weight = getattr(block, name).weight.detach()
    offset = float(info.norm_offset) if info is not None else 0.0
    return weight + offset if offset else weight


# Attribute names of the linear layers, by role, in the families' Hugging Face modules.
# Which of them a block holds decides its layout (see interp.models.ModelInfo).
_ATTENTION_NAMES = ("self_attn", "attn", "attention")
_SEPARATE = {"q": ("q_proj",), "k": ("k_proj",), "v": ("v_proj",), "o": ("o_proj", "c_proj", "dense", "out_proj"),
             "gate": ("gate_proj",), "up": ("up_proj", "c_fc", "dense_h_to_4h", "fc1"),
             "down": ("down_proj", "c_proj", "dense_4h_to_h", "fc2")}
_FUSED_QKV = ("qkv_proj", "c_attn", "Wqkv", "query_key_value")
# the bridge's own (split) modules that must follow a fused weight: role -> (part, name)
_BRIDGE_SPLITS = {"q": ("attn", "q"), "k": ("attn", "k"), "v": ("attn", "v"), "gate": ("mlp", "gate"),
                  "up": ("mlp", "in")}


@dataclass(frozen=True)
class WeightSlot:
    """One logical linear layer's weight, ``[out, in]``, wherever the model stores it.

    ``module.weight`` holds it, possibly fused with others (``rows`` picks its output rows)
    and possibly transposed (GPT-2's ``Conv1D`` stores ``[in, out]``). ``mirrors`` are
    the transformer-lens bridge's split copies of a fused weight: its hooked forward
    multiplies by those, the bridge-free forward by ``module.weight``, so :meth:`write`
    updates both.
    """

    role: str
    module: torch.nn.Module
    rows: slice | torch.Tensor | None = None
    transposed: bool = False
    mirrors: tuple[torch.Tensor, ...] = ()

    def _matrix(self) -> torch.Tensor:
        weight = self.module.weight
        assert isinstance(weight, torch.Tensor)
        return weight.T if self.transposed else weight  # [out, in], a view

    def read(self) -> torch.Tensor:
        """``[out, in]``: a view of the stored weight (a copy for interleaved rows)."""
        matrix = self._matrix()
        if self.rows is None:
            return matrix
        if isinstance(self.rows, slice):
            return matrix[self.rows]
        return matrix.index_select(0, self.rows.to(matrix.device))

    def write(self, value: torch.Tensor) -> None:
        """Store ``value`` (``[out, in]``) in place, in the fused weight and every mirror."""
        with torch.no_grad():
            matrix = self._matrix()
            value = value.to(matrix.device, matrix.dtype)
            write_rows(matrix, self.rows, value)
            for mirror in self.mirrors:
                mirror.copy_(value)


def _child(module: Any, names: tuple[str, ...]) -> Any:
    return next((getattr(module, n) for n in names if getattr(module, n, None) is not None), None)


def _attention(block: Any) -> Any:
    return _child(block, _ATTENTION_NAMES)


def _fused_qkv_rows(model: Any, layout: str, d_out: int) -> dict[str, slice | torch.Tensor]:
    info = _info(model)
    n_heads, d_head = int(model.cfg.n_heads), int(getattr(info, "d_head", 0) or model.cfg.d_head)
    n_kv = int(getattr(info, "n_kv_heads", 0) or n_heads)
    if layout == "per_head":  # rows [head, (q, k, v), d_head]
        base = torch.arange(n_heads)[:, None] * 3 * d_head + torch.arange(d_head)[None, :]
        return {role: (base + i * d_head).flatten() for i, role in enumerate("qkv")}
    q, kv = n_heads * d_head, n_kv * d_head
    if q + 2 * kv != d_out:
        raise ComponentError(f"{_architecture(model)}: a fused q/k/v weight of {d_out} rows does not split into "
                             f"{q} + {kv} + {kv}.")
    return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}


def linear_weights(model: Any, layer: int) -> dict[str, WeightSlot]:
    """The linear weights of block ``layer`` by role (q, k, v, o, gate, up, down), each ``[out, in]``.

    Fused weights are split into their logical matrices (Phi-3's ``qkv_proj`` into q, k, v and
    ``gate_up_proj`` into gate, up; GPT-NeoX's head-interleaved ``query_key_value``), so a
    quantizer treats each as its own matrix and no group straddles two of them. A plain MLP has
    no ``gate``.
    """
    from transformers.pytorch_utils import Conv1D

    block = blocks(model)[layer]
    plain_attn, plain_mlp = _unwrap(_attention(block)), _unwrap(block.mlp)
    slots: dict[str, WeightSlot] = {}

    def add(role: str, module: Any, rows: slice | torch.Tensor | None = None) -> None:
        module = _unwrap(module)
        slots[role] = WeightSlot(role, module, rows, isinstance(module, Conv1D), _mirrors(block, role, module))

    fused = _child(plain_attn, _FUSED_QKV)
    if fused is not None:
        layout = "per_head" if getattr(plain_attn, "query_key_value", None) is fused else "blocked"
        d_out = fused.weight.shape[1] if isinstance(_unwrap(fused), Conv1D) else fused.weight.shape[0]
        for role, rows in _fused_qkv_rows(model, layout, int(d_out)).items():
            add(role, fused, rows)
    for role in ("q", "k", "v", "o"):
        module = _child(plain_attn, _SEPARATE[role])
        if role not in slots and module is not None:
            add(role, module)
    gate_up = getattr(plain_mlp, "gate_up_proj", None)
    if gate_up is not None:  # rows [gate | up], as Phi3MLP's chunk(2) reads them
        half = _unwrap(gate_up).weight.shape[0] // 2
        add("gate", gate_up, slice(0, half))
        add("up", gate_up, slice(half, 2 * half))
    for role in ("gate", "up", "down"):
        module = _child(plain_mlp, _SEPARATE[role])
        if role not in slots and module is not None:
            add(role, module)
    return {role: slots[role] for role in ("q", "k", "v", "o", "gate", "up", "down") if role in slots}


def _mirrors(block: Any, role: str, stored: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """The bridge's split copy of a fused weight (when it is not the stored module itself)."""
    if role not in _BRIDGE_SPLITS:
        return ()
    part, name = _BRIDGE_SPLITS[role]
    owner = _attention(block) if part == "attn" else block.mlp
    split = getattr(owner, name, None) if owner is not None and not isinstance(owner, torch.nn.Linear) else None
    inner = _unwrap(split) if isinstance(split, torch.nn.Module) else None
    weight = getattr(inner, "weight", None)
    if inner is None or inner is stored or not isinstance(weight, torch.Tensor):
        return ()
    return (weight,)


def linear_modules(model: Any, layer: int) -> dict[str, torch.nn.Module]:
    """The unfused linear layers of block ``layer`` by role: q, k, v, o, gate, up, down.

    Roles held in a fused weight are left out (see :func:`linear_weights`, which has them all).
    """
    return {role: slot.module for role, slot in linear_weights(model, layer).items() if slot.rows is None}


def _unwrap(module: Any) -> Any:
    """The module under a transformer-lens wrapper (any kind), or the module itself."""
    inner = getattr(module, "original_component", None)
    return inner if isinstance(inner, torch.nn.Module) else module


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

    return plain_module_tree(model.original_model)


# Where each component can be read on the bridge-free Hugging Face tree (native_model), for
# the block layouts whose module layout is known: (submodule path in the decoder layer, "in"
# for its first input or "out" for its output, tuple index of that output or None). Gemma's
# post-attention / post-feed-forward norms mean what enters the residual is their output;
# OLMo-2 has only those (the MLP reads resid_mid unnormalised).
_PRE_NORM_TAPS: dict[str, tuple[str, str, int | None]] = {
    "resid_pre": ("", "in", None), "resid_post": ("", "out", 0),
    "resid_mid": ("post_attention_layernorm", "in", None), "h": ("post_attention_layernorm", "out", None),
    "attn_out": ("self_attn", "out", 0), "pattern": ("self_attn", "out", 1),
    "head": ("self_attn.o_proj", "in", None),
    "gate_pre": ("mlp.gate_proj", "out", None), "gate": ("mlp.gate_proj", "out", None),
    "up": ("mlp.up_proj", "out", None), "down": ("mlp", "out", None),
    "gate_input": ("mlp.gate_proj", "in", None),
}
_SANDWICH_TAPS = {
    **_PRE_NORM_TAPS,
    "resid_mid": ("pre_feedforward_layernorm", "in", None), "h": ("pre_feedforward_layernorm", "out", None),
    "attn_out": ("post_attention_layernorm", "out", None), "down": ("post_feedforward_layernorm", "out", None),
}
_POST_NORM_TAPS = {
    **_PRE_NORM_TAPS,
    "resid_mid": ("mlp", "in", None), "h": ("mlp", "in", None),
    "attn_out": ("post_attention_layernorm", "out", None), "down": ("post_feedforward_layernorm", "out", None),
}


def _native_taps(model: Any) -> dict[str, tuple[str, str, int | None]] | None:
    """The tap table for ``model``'s block layout, or ``None`` (unknown layout: use the bridge)."""
    info = _info(model)
    if info is None or info.layers_path != "model.layers" or info.fused_qkv or info.fused_gate_up:
        return None
    if not info.gated_mlp or info.parallel_residual:
        return None
    if info.mlp_norm == "pre_feedforward_layernorm" and info.post_norms:
        return _SANDWICH_TAPS
    if info.mlp_norm == "post_attention_layernorm" and not info.post_norms:
        return _PRE_NORM_TAPS
    if not info.mlp_norm and info.post_norms:
        return _POST_NORM_TAPS
    return None


def native_tap(model: Any, native: torch.nn.Module, component: str, layer: int
               ) -> tuple[torch.nn.Module, str, int | None] | None:
    """``(module, "in" | "out", output index)`` carrying ``component`` on ``native``, or ``None``.

    ``None`` means "no known native location": the caller should use the bridge's hook points.
    ``head`` arrives flat (``[batch, pos, head * d_head]``) and needs a reshape.
    """
    taps = _native_taps(model)
    if taps is None or component not in taps:
        return None
    path, side, index = taps[component]
    module: Any = follow(native, _info(model).layers_path)[layer]
    for part in filter(None, path.split(".")):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module, side, index


def decoder_body(model: Any) -> Any:
    """The Hugging Face decoder body (``model.model``, ``transformer``, ``gpt_neox``...): embeddings to final norm."""
    hf = model.original_model
    return getattr(hf, getattr(hf, "base_model_prefix", "") or "model")


def blocks(model: Any) -> Any:
    """The Hugging Face decoder layers (a ``ModuleList``)."""
    info = _info(model)
    if info is not None:
        return follow(model.original_model, info.layers_path)

    return follow(model.original_model, decoder_layers_path(model.original_model))


_FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm")


def final_norm(model: Any) -> Any:
    """The norm after the last block (``norm``, ``ln_f``, ``final_layer_norm``); AttributeError if none."""
    body = decoder_body(model)
    found = _child(body, _FINAL_NORMS)
    if found is None:
        raise AttributeError(f"{_architecture(model)} has no final norm among {', '.join(_FINAL_NORMS)}")
    return found


def unembed(model: Any) -> Any:
    """The output head (``lm_head``, ``embed_out``...): a module with ``weight [vocab, d_model]``."""
    head = model.original_model.get_output_embeddings()
    if head is None:
        raise AttributeError(f"{_architecture(model)} has no output embeddings")
    return head


def unembed_weight(model: Any) -> torch.Tensor:
    return unembed(model).weight


def unembed_bias(model: Any) -> torch.Tensor | None:
    bias = getattr(_unwrap(unembed(model)), "bias", None)
    return bias if isinstance(bias, torch.Tensor) else None


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


def write_rows(target: torch.Tensor, rows: slice | torch.Tensor | None, value: torch.Tensor) -> None:
    """Copy ``value`` into ``target`` in place: all of it (``rows=None``), a block of rows (a slice,
    e.g. q of a fused qkv weight), or the rows an index tensor names (per-head interleaved layouts)."""
    if rows is None:
        target.copy_(value)
    elif isinstance(rows, slice):
        target[rows].copy_(value)
    else:
        target.index_copy_(0, rows.to(target.device), value)
