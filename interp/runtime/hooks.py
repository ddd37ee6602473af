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
z             per-head attention output before ``W_O`` (= head)    [batch, pos, head, d_head]
result        per-head output ``z_h W_O[h]`` (o_proj bias left out) [batch, pos, head, d_model]
q, k, v       per-head query / key / value projections' outputs    [batch, pos, (kv_)head, d_head]
============  ==================================================  =========================

Each component is one :class:`ComponentRecord` in :data:`COMPONENT_RECORDS` (hook point,
width, the layouts it needs, whether it can be patched, its label, its per-head axes, its
native taps); the tables above and every list of names elsewhere are derived from them.

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

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from interp.architecture import decoder_layers_path, follow, plain_module_tree
from interp.errors import ComponentError
from interp.models import Model
from interp.validate import layer_indices

# ---------------------------------------------------------------------------------------
# The component registry: one record per component. Everything that needs to know about a
# component (probes, memory estimates, the native tap tables, patching, figures, CLI choices)
# reads its record, so adding a component is adding one record to COMPONENT_RECORDS.

Layout = Literal["gated", "plain", "serial"]
Width = Literal["d_model", "d_mlp", "heads_d_head", "kv_heads_d_head", "heads_d_model", "heads_keys"]
NativeLayout = Literal["pre_norm", "sandwich", "post_norm"]
Tap = tuple[str, str, int | None]  # (submodule path in the decoder layer, "in" | "out", output index)
Transform = Literal["", "activation", "per_head_out"]


@dataclass(frozen=True)
class ComponentRecord:
    """Everything interp knows about one component, in one place.

    Attributes:
        name: the semantic name (``"resid_pre"``, ``"gate"``, ``"z"``, ...).
        hook: the transformer-lens bridge hook-point template (``{layer}`` filled in).
        width: the per-position size of one capture: ``d_model``, ``d_mlp``,
            ``heads_d_head`` (``n_heads * d_head``), ``kv_heads_d_head`` (key/value heads, fewer
            under grouped-query attention), ``heads_d_model`` (``n_heads * d_model``)
            or ``heads_keys`` (``n_heads * seq_len``, the attention pattern).
        needs: the layouts the model must have: ``gated`` (a gated MLP), ``plain`` (a plain
            MLP) and ``serial`` (attention then MLP, not a parallel block).
        patchable: whether :class:`interp.localize.patching.Patch` may overwrite it.
        label: how figures and tables name it.
        shape: the capture's shape, as the docs write it.
        per_head: the axis names after ``[batch, pos]`` for per-head components
            (``("head", "d_head")``), empty otherwise; ``heads=`` patches select on the first.
        transform: how the value is derived from what the hook point carries: ``""`` (as
            it is), ``"activation"`` (the MLP activation applied: ``gate``) or
            ``"per_head_out"`` (each head's ``z`` through its slice of ``W_O``).
        native: where the component sits on the bridge-free Hugging Face tree
            (:func:`native_model`), by block layout; a layout left out means "use the bridge".

    Example:
        >>> record = COMPONENT_RECORDS["mlp_pre"]
        >>> record.width, sorted(record.needs), record.patchable
        ('d_mlp', ['plain'], True)
    """

    name: str
    hook: str
    width: Width
    needs: frozenset[str] = frozenset()
    patchable: bool = True
    label: str = ""
    shape: str = "[batch, pos, d_model]"
    per_head: tuple[str, ...] = ()
    transform: Transform = ""
    native: Mapping[str, Tap] = field(default_factory=dict)

    def per_position(self, model: Model, seq_len: int) -> int:
        """Values per token position in one layer's capture of ``model``."""
        dims = _dims(model)
        return {"d_model": dims["d_model"], "d_mlp": dims["d_mlp"], "heads_d_head": dims["n_heads"] * dims["d_head"],
                "kv_heads_d_head": dims["n_kv_heads"] * dims["d_head"],
                "heads_d_model": dims["n_heads"] * dims["d_model"], "heads_keys": dims["n_heads"] * seq_len}[self.width]


def _everywhere(tap: Tap) -> dict[str, Tap]:
    return {"pre_norm": tap, "sandwich": tap, "post_norm": tap}


def _records(*records: ComponentRecord) -> dict[str, ComponentRecord]:
    return {r.name: r for r in records}


_Z_TAP: Tap = ("self_attn.o_proj", "in", None)
COMPONENT_RECORDS: dict[str, ComponentRecord] = _records(
    ComponentRecord("resid_pre", "blocks.{layer}.hook_resid_pre", "d_model", label="resid_pre",
                    native=_everywhere(("", "in", None))),
    ComponentRecord("resid_mid", "blocks.{layer}.hook_resid_mid", "d_model", frozenset({"serial"}), label="resid_mid",
                    native={"pre_norm": ("post_attention_layernorm", "in", None),
                            "sandwich": ("pre_feedforward_layernorm", "in", None), "post_norm": ("mlp", "in", None)}),
    ComponentRecord("resid_post", "blocks.{layer}.hook_resid_post", "d_model", label="resid_post",
                    native=_everywhere(("", "out", 0))),
    ComponentRecord("h", "blocks.{layer}.mlp.hook_in", "d_model", patchable=False, label="MLP input",
                    native={"pre_norm": ("post_attention_layernorm", "out", None),
                            "sandwich": ("pre_feedforward_layernorm", "out", None), "post_norm": ("mlp", "in", None)}),
    ComponentRecord("attn_out", "blocks.{layer}.hook_attn_out", "d_model", label="attention",
                    native={"pre_norm": ("self_attn", "out", 0), "sandwich": ("post_attention_layernorm", "out", None),
                            "post_norm": ("post_attention_layernorm", "out", None)}),
    ComponentRecord("pattern", "blocks.{layer}.attn.hook_pattern", "heads_keys", patchable=False,
                    label="attention pattern", shape="[batch, head, q, k]",
                    native=_everywhere(("self_attn", "out", 1))),
    ComponentRecord("head", "blocks.{layer}.attn.hook_z", "heads_d_head", label="heads",
                    shape="[batch, pos, head, d_head]", per_head=("head", "d_head"), native=_everywhere(_Z_TAP)),
    ComponentRecord("gate_pre", "blocks.{layer}.mlp.hook_pre", "d_mlp", frozenset({"gated"}), patchable=False,
                    label="gate pre-activation", shape="[batch, pos, d_mlp]",
                    native=_everywhere(("mlp.gate_proj", "out", None))),
    ComponentRecord("gate", "blocks.{layer}.mlp.hook_pre", "d_mlp", frozenset({"gated"}), label="gate",
                    shape="[batch, pos, d_mlp]", transform="activation",
                    native=_everywhere(("mlp.gate_proj", "out", None))),
    ComponentRecord("up", "blocks.{layer}.mlp.hook_pre_linear", "d_mlp", frozenset({"gated"}), label="up",
                    shape="[batch, pos, d_mlp]", native=_everywhere(("mlp.up_proj", "out", None))),
    ComponentRecord("down", "blocks.{layer}.hook_mlp_out", "d_model", label="down (MLP out)",
                    native={"pre_norm": ("mlp", "out", None), "sandwich": ("post_feedforward_layernorm", "out", None),
                            "post_norm": ("post_feedforward_layernorm", "out", None)}),
    ComponentRecord("gate_input", "blocks.{layer}.mlp.gate.hook_in", "d_model", frozenset({"gated"}),
                    label="gate input only", native=_everywhere(("mlp.gate_proj", "in", None))),
    ComponentRecord("mlp_pre", "blocks.{layer}.mlp.hook_pre", "d_mlp", frozenset({"plain"}),
                    label="MLP pre-activation", shape="[batch, pos, d_mlp]"),
    ComponentRecord("z", "blocks.{layer}.attn.hook_z", "heads_d_head", label="heads (z)",
                    shape="[batch, pos, head, d_head]", per_head=("head", "d_head"), native=_everywhere(_Z_TAP)),
    ComponentRecord("result", "blocks.{layer}.attn.hook_z", "heads_d_model", patchable=False,
                    label="per-head result", shape="[batch, pos, head, d_model]", per_head=("head", "d_model"),
                    transform="per_head_out", native=_everywhere(_Z_TAP)),
    # each head's query / key / value (the projections' outputs, before any q/k norm and rotary
    # embedding): the receivers of path patching. Keys and values have n_kv_heads heads.
    ComponentRecord("q", "blocks.{layer}.attn.q.hook_out", "heads_d_head", label="queries",
                    shape="[batch, pos, head, d_head]", per_head=("head", "d_head")),
    ComponentRecord("k", "blocks.{layer}.attn.k.hook_out", "kv_heads_d_head", label="keys",
                    shape="[batch, pos, kv_head, d_head]", per_head=("kv_head", "d_head")),
    ComponentRecord("v", "blocks.{layer}.attn.v.hook_out", "kv_heads_d_head", label="values",
                    shape="[batch, pos, kv_head, d_head]", per_head=("kv_head", "d_head")),
)

# Derived views, kept under their old names.
Component = Literal[
    "resid_pre", "resid_mid", "resid_post", "h", "attn_out", "pattern", "head",
    "gate_pre", "gate", "up", "down", "gate_input", "mlp_pre", "z", "result", "q", "k", "v",
]  # the registry's names, for type checkers (a test checks that the two agree)
HOOK_POINTS: dict[str, str] = {name: r.hook for name, r in COMPONENT_RECORDS.items()}
GATED_ONLY = frozenset(n for n, r in COMPONENT_RECORDS.items() if "gated" in r.needs)
PLAIN_ONLY = frozenset(n for n, r in COMPONENT_RECORDS.items() if "plain" in r.needs)
SERIAL_ONLY = frozenset(n for n, r in COMPONENT_RECORDS.items() if "serial" in r.needs)
COMPONENTS: tuple[str, ...] = tuple(COMPONENT_RECORDS)
PER_HEAD = frozenset(n for n, r in COMPONENT_RECORDS.items() if r.per_head)


def record(component: str) -> ComponentRecord:
    """The registry record of ``component``; a :class:`~interp.errors.ComponentError` naming the valid ones."""
    if component not in COMPONENT_RECORDS:
        raise ComponentError(f"Unknown component {component!r}. Valid components: {', '.join(COMPONENTS)}.")
    return COMPONENT_RECORDS[component]


def _dims(model: Model) -> dict[str, int]:
    cfg, info = model.cfg, _info(model)
    n_heads = int(cfg.n_heads)
    d_head = int(getattr(info, "d_head", 0) or getattr(cfg, "d_head", 0) or cfg.d_model // n_heads)
    n_kv = int(getattr(info, "n_kv_heads", 0) or getattr(cfg, "n_key_value_heads", 0) or n_heads)
    return {"d_model": int(cfg.d_model), "d_mlp": int(cfg.d_mlp), "n_heads": n_heads, "d_head": d_head,
            "n_kv_heads": n_kv}


def layouts(model: Model) -> frozenset[str]:
    """The layouts ``model`` has: ``gated`` or ``plain``, and ``serial`` unless its block is parallel."""
    info = _info(model)
    have = {"gated" if is_gated(model) else "plain"}
    if info is None or not info.parallel_residual:
        have.add("serial")
    return frozenset(have)


def n_layers(model: Model) -> int:
    return int(model.cfg.n_layers)


def check_layers(model: Model, layers: Iterable[int] | None) -> list[int]:
    """Validated layer indices (all layers when ``None``); negative indices count from the end.

    Bools, floats, strings and an empty selection are refused (:func:`interp.argument_checks.layer_indices`).
    """

    return layer_indices(layers, n_layers(model))


def _architecture(model: Model) -> str:
    info = getattr(model, "info", None)
    return info.architecture if info is not None else type(model).__name__


def _info(model: Model) -> Any:
    return getattr(model, "info", None)


def family(model: Model) -> str:
    info = _info(model)
    return str(info.family) if info is not None else type(model).__name__


def is_gated(model: Model) -> bool:
    info = _info(model)
    if info is not None:
        return bool(info.gated_mlp)
    return "blocks.0.mlp.hook_pre_linear" in model.hook_dict


def components(model: Model) -> list[str]:
    """The components ``model`` has, in :data:`COMPONENTS` order."""
    have = layouts(model)
    return [name for name, r in COMPONENT_RECORDS.items() if r.needs <= have]


_LAYOUT_NEEDS = {"gated": "a gated MLP, but it has a plain MLP",
                 "plain": "a plain (non-gated) MLP, but it has a gated MLP",
                 "serial": "a serial block, but its attention and MLP both read resid_pre (parallel residual)"}


def hook_point(model: Model, component: str, layer: int) -> str:
    """The hook-point name for ``component`` at ``layer``, checked to exist on ``model``."""
    rec = record(component)
    have = components(model)
    missing = sorted(rec.needs - layouts(model))
    if missing:
        raise ComponentError(
            f"Component {component!r} needs {_LAYOUT_NEEDS[missing[0]]}: {_architecture(model)} (family "
            f"{family(model)}) has {', '.join(have)}."
        )
    (layer,) = check_layers(model, [layer])
    name = rec.hook.format(layer=layer)
    if name not in model.hook_dict:
        raise ComponentError(f"{_architecture(model)} (family {family(model)}) has no hook point {name} for "
                             f"component {component!r}; it has {', '.join(have)}.")
    return name


def capture_bytes(model: Model, component: str, n_examples: int, seq_len: int, n_layers: int,
                  itemsize: int = 4) -> int:
    """Bytes of a ``full`` capture of ``component`` over ``n_layers`` layers (``itemsize`` bytes a value)."""
    return n_examples * seq_len * record(component).per_position(model, seq_len) * n_layers * itemsize


def reader(model: Model, component: str, layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> value``: turns what ``component``'s hook point (or native tap) carries into the component.

    Per-head components arrive flat on the native tap (o_proj's input, ``[batch, pos, head * d_head]``)
    and are split into heads; ``gate`` gets the MLP activation; ``result`` is each head's ``z``
    through its own slice of ``W_O`` (``[batch, pos, head, d_model]``, the o_proj bias left out).
    """
    rec = record(component)
    n_heads = _dims(model)["n_kv_heads" if rec.per_head[:1] == ("kv_head",) else "n_heads"]
    act = activation_fn(model, layer) if rec.transform == "activation" else None
    w_o = per_head_w_o(model, layer) if rec.transform == "per_head_out" else None

    def read(x: torch.Tensor) -> torch.Tensor:
        if rec.per_head and x.ndim == 3:
            x = x.reshape(*x.shape[:2], n_heads, -1)
        if act is not None:
            return act(x)
        if w_o is not None:
            return torch.einsum("bphd,hmd->bphm", x, w_o.to(x.dtype))
        return x

    return read


def per_head_w_o(model: Model, layer: int) -> torch.Tensor:
    """``W_O`` of block ``layer`` split by head: ``[head, d_model, d_head]`` (head ``h``'s ``z`` times
    ``W_O[h].T`` is what it writes, before the bias)."""
    weight = linear_weights(model, layer)["o"].read().detach()  # [d_model, head * d_head]
    return weight.reshape(weight.shape[0], _dims(model)["n_heads"], -1).permute(1, 0, 2)


def mlp_module(model: Model, layer: int) -> Any:
    """The Hugging Face MLP module of block ``layer``."""
    return blocks(model)[layer].mlp


def activation_fn(model: Model, layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's activation, so ``gate = act(gate_pre)`` (or ``act(mlp_pre)`` for a plain MLP)."""
    mlp = mlp_module(model, layer)
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "act", None) or getattr(mlp, "activation_fn", None)
    if act is None:
        raise ComponentError(f"Cannot find the MLP activation of {_architecture(model)} layer {layer}.")
    return act


def gate_weight(model: Model, layer: int) -> torch.Tensor:
    """The gate projection weight ``[d_mlp, d_model]`` of block ``layer`` (a view into a fused one)."""
    if not is_gated(model):
        raise ComponentError(f"{_architecture(model)} (family {family(model)}) has no gate projection: "
                             "its MLP is not gated.")
    return linear_weights(model, layer)["gate"].read()


def norm2_gamma(model: Model, layer: int) -> torch.Tensor:
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


def _fused_qkv_rows(model: Model, layout: str, d_out: int) -> dict[str, slice | torch.Tensor]:
    info = _info(model)
    n_heads, d_head = int(model.cfg.n_heads), int(getattr(info, "d_head", 0) or model.cfg.d_head)
    n_kv = int(getattr(info, "n_kv_heads", 0) or n_heads)
    if layout == "per_head":  # rows [head, (q, k, v), d_head]
        # the weight may be offloaded (meta): read() and write_rows() move these indices to the matrix's device
        # host: row indices of a fused weight, kept with its module
        base = torch.arange(n_heads)[:, None] * 3 * d_head + torch.arange(d_head)[None, :]
        return {role: (base + i * d_head).flatten() for i, role in enumerate("qkv")}
    q, kv = n_heads * d_head, n_kv * d_head
    if q + 2 * kv != d_out:
        raise ComponentError(f"{_architecture(model)}: a fused q/k/v weight of {d_out} rows does not split into "
                             f"{q} + {kv} + {kv}.")
    return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}


def linear_weights(model: Model, layer: int) -> dict[str, WeightSlot]:
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


def linear_modules(model: Model, layer: int) -> dict[str, torch.nn.Module]:
    """The unfused linear layers of block ``layer`` by role: q, k, v, o, gate, up, down.

    Roles held in a fused weight are left out (see :func:`linear_weights`, which has them all).
    """
    return {role: slot.module for role, slot in linear_weights(model, layer).items() if slot.rows is None}


def _unwrap(module: Any) -> Any:
    """The module under a transformer-lens wrapper (any kind), or the module itself."""
    inner = getattr(module, "original_component", None)
    return inner if isinstance(inner, torch.nn.Module) else module


def hooks_active(model: Model) -> bool:
    """Is any hook registered on the bridge's hook points (by ``model.hooks``, ``add_hook``...)?"""
    return any(point._forward_hooks or point._forward_pre_hooks or point._backward_hooks
               for point in model.hook_dict.values())


def native_model(model: Model) -> torch.nn.Module:
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
# the block layouts whose module layout is known, derived from the records' ``native`` field:
# (submodule path in the decoder layer, "in" for its first input or "out" for its output,
# tuple index of that output or None). Gemma's post-attention / post-feed-forward norms mean
# what enters the residual is their output; OLMo-2 has only those (the MLP reads resid_mid
# unnormalised).
def _taps(layout: str) -> dict[str, Tap]:
    return {name: r.native[layout] for name, r in COMPONENT_RECORDS.items() if layout in r.native}


_PRE_NORM_TAPS = _taps("pre_norm")
_SANDWICH_TAPS = _taps("sandwich")
_POST_NORM_TAPS = _taps("post_norm")


def _native_taps(model: Model) -> dict[str, tuple[str, str, int | None]] | None:
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


def native_tap(model: Model, native: torch.nn.Module, component: str, layer: int
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


def decoder_body(model: Model) -> Any:
    """The Hugging Face decoder body (``model.model``, ``transformer``, ``gpt_neox``...): embeddings to final norm."""
    hf = model.original_model
    return getattr(hf, getattr(hf, "base_model_prefix", "") or "model")


def blocks(model: Model) -> Any:
    """The Hugging Face decoder layers (a ``ModuleList``)."""
    info = _info(model)
    if info is not None:
        return follow(model.original_model, info.layers_path)

    return follow(model.original_model, decoder_layers_path(model.original_model))


_FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm")


def final_norm(model: Model) -> Any:
    """The norm after the last block (``norm``, ``ln_f``, ``final_layer_norm``); AttributeError if none."""
    body = decoder_body(model)
    found = _child(body, _FINAL_NORMS)
    if found is None:
        raise AttributeError(f"{_architecture(model)} has no final norm among {', '.join(_FINAL_NORMS)}")
    return found


def unembed(model: Model) -> Any:
    """The output head (``lm_head``, ``embed_out``...): a module with ``weight [vocab, d_model]``."""
    head = model.original_model.get_output_embeddings()
    if head is None:
        raise AttributeError(f"{_architecture(model)} has no output embeddings")
    return head


def unembed_weight(model: Model) -> torch.Tensor:
    return unembed(model).weight


def unembed_bias(model: Model) -> torch.Tensor | None:
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


def linear_input_hook(model: Model, layer: int, role: str) -> str:
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
