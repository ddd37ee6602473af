"""Hand a quantized model to a runtime: write it as a compressed-tensors checkpoint.

interp's quantizers return *fake-quantized* weights: float tensors whose values lie on a
per-group grid ``w_hat = (q - zero) * scale``, ``q`` an integer level in ``0 .. 2^bits - 1``.
A runtime needs the grid itself: the integer levels, the scales and the zero-points. This
module recovers them from the quantized weights and writes a folder in the
`compressed-tensors <https://github.com/neuralmagic/compressed-tensors>`_ layout, which
``transformers.AutoModelForCausalLM.from_pretrained(folder)`` loads (with the
``compressed-tensors`` package installed) without anything from interp.

Recovering the grid. RTN and GPTQ with ``act_order=1`` (the default) use the min-max grid
of each group of the *reference* weights (GPTQ only picks other levels on it), so the grid
is refitted from the reference exactly as the quantizer fitted it, and the levels are
``round(w_hat / scale + zero)``. The export then checks that ``(q - zero) * scale``
reproduces every quantized weight to the bit; a weight that does not is refused. NF
(a non-uniform codebook), HQQ (optimised scales), AWQ (per-channel scales folded into the
weight) and GPTQ with ``act_order=0`` (grids fitted on the running weights) have no grid
that can be recovered this way, and are refused with a clear error.

The layout: ``int-quantized`` (compressed-tensors' "naive" format), one int8 per weight
holding the level shifted to the signed range, ``q - 2^(bits-1)``, with per-group scales and
zero-points (``zero - 2^(bits-1)``) beside it; the runtime computes ``(x_q - zp) * scale``.

- integer zero-points (``rtn:...,zero=int``): the zero-points are int8 and the runtime's
  weights equal interp's fake-quantized weights to the bit.
- float zero-points (interp's default for ``rtn`` and ``gptq``: hqq's and llama.cpp Q4_1's
  convention): the zero-points are float32. ``zero - 2^(bits-1)`` is rounded once in
  float32, so weights agree to a few float32 roundings, not to the bit.

Why not the packed layout (``pack-quantized``, ``bits`` int32 words per 32 weights)? It
stores integer zero-points only, and transformers 5.23 with compressed-tensors 0.20 cannot
load an asymmetric packed checkpoint: it allocates the zero-point unpacked
(``[d_out, n_groups]``) while the format packs it along ``d_out``, and the load stops on the
shape mismatch. :func:`export_compressed_tensors` can still write it (``layout=
"pack-quantized"``), for runtimes that read it and for the reader in
:mod:`interp.checkpoints`.

Example:
    >>> import pathlib, tempfile
    >>> import interp
    >>> from interp.quant import quantize
    >>> from interp.quant.export import export_compressed_tensors
    >>> model = interp.tiny_model("llama")
    >>> qmodel = quantize(model, "rtn:bits=4,group=32", progress=False)
    >>> folder = export_compressed_tensors(qmodel, model, pathlib.Path(tempfile.mkdtemp()) / "ct")
    >>> import json
    >>> json.loads((folder / "config.json").read_text())["quantization_config"]["format"]
    'int-quantized'
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from interp.errors import ComponentError, InterpError, SpecError
from interp.quant.spec import MethodSpec, parse_spec

if TYPE_CHECKING:
    from jaxtyping import Float, Int
    from torch import Tensor

    from interp.models import Model  # loads torch: for annotations only

# torch is imported inside the functions: the CLI reads EXPORT_FORMATS while parsing options.

__all__ = ["EXPORT_FORMATS", "GroupGrid", "check_exportable", "export_compressed_tensors", "recover_grid"]

EXPORT_FORMATS = ("interp", "compressed-tensors")
PACKED = "pack-quantized"
UNPACKED = "int-quantized"
EXPORT_KIND = "export-compressed-tensors"  # the kind in an export folder's interp marker (interp.io.MARKER)


@dataclass(frozen=True)
class GroupGrid:
    """One linear weight on its per-group grid: ``w_hat = (levels - zero) * scale``, group by group.

    Attributes:
        levels: integer levels ``0 .. 2^bits - 1``, ``[d_out, d_in]``.
        scale: float32 ``[d_out, n_groups]``.
        zero: float32 ``[d_out, n_groups]`` (whole numbers when the spec has ``zero=int``).
        bits: bits per level.
        group: consecutive input weights per group.
    """

    levels: Int[Tensor, "d_out d_in"]
    scale: Float[Tensor, "d_out n_groups"]
    zero: Float[Tensor, "d_out n_groups"]
    bits: int
    group: int

    @property
    def integer_zero(self) -> bool:
        import torch

        return bool(torch.equal(self.zero, self.zero.round()))

    def dequantize(self) -> Float[Tensor, "d_out d_in"]:
        """``(levels - zero) * scale`` in float32, by the same operations as the quantizers."""

        d_out, d_in = self.levels.shape
        grouped = self.levels.float().reshape(d_out, d_in // self.group, self.group)
        return ((grouped - self.zero[..., None]) * self.scale[..., None]).reshape(d_out, d_in)


def check_exportable(spec: MethodSpec) -> None:
    """Raise :class:`~interp.errors.SpecError` unless ``spec`` has a grid the export can recover.

    A plan (a spec with a per-module bit map) is exportable when its method is: each bit width
    becomes its own ``config_groups`` entry, naming its modules.
    """
    if spec.method == "rtn" or (spec.method == "gptq" and bool(spec.params["act_order"])):
        return
    why = {
        "nf": "its levels are a non-uniform NormalFloat codebook, not integers on an affine grid",
        "hqq": "its scales and zero-points are optimised by hqq and are not recoverable from the weights",
        "awq": "its per-input-channel scales are folded into the weight, so a group has no single affine grid",
        "gptq": "with act_order=0 each group's grid is fitted on the running weights, which are not kept",
    }.get(spec.method, "it is not a min-max grid method")
    raise SpecError(
        f"{spec} cannot be written as a compressed-tensors checkpoint: {why}. The compressed-tensors export "
        "supports rtn and gptq with act_order=1 (the default); save other specs with --format interp."
    )


def recover_grid(reference: Tensor, quantized: Tensor, spec: str | MethodSpec) -> GroupGrid:
    """The grid of one quantized weight, refitted from its reference weight and checked to the bit.

    Args:
        reference: the weight before quantization, ``[d_out, d_in]``.
        quantized: the fake-quantized weight ``spec`` made from it, same shape.
        spec: an exportable spec (rtn, or gptq with act_order=1).

    Raises:
        SpecError: the spec has no recoverable grid, or ``quantized`` is not on the refitted
            grid (it was not made by ``spec`` from ``reference``).

    Example:
        >>> import torch
        >>> from interp.quant import quantize_weight
        >>> W = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
        >>> grid = recover_grid(W, quantize_weight(W, "rtn:bits=3,group=32"), "rtn:bits=3,group=32")
        >>> int(grid.levels.min()), int(grid.levels.max()), bool(torch.equal(grid.dequantize(),
        ...     quantize_weight(W, "rtn:bits=3,group=32")))
        (0, 7, True)
    """
    import torch

    from interp.quant.methods._common import MinMaxGrid, checked_weight, grouped

    spec = parse_spec(spec)
    check_exportable(spec)
    weight = checked_weight(reference, spec)
    integer_zero = spec.method == "rtn" and spec.params.get("zero") == "int"
    fitted = MinMaxGrid.fit(grouped(weight, spec.group), spec.bits, dim=-1, integer_zero=integer_zero)
    target = quantized.detach().to("cpu", torch.float32)
    levels = (grouped(target, spec.group) * fitted.inv_scale + fitted.zero).round().clamp(0, fitted.max_level)
    grid = GroupGrid(levels.reshape(weight.shape).to(torch.int32), fitted.scale[..., 0].contiguous(),
                     fitted.zero[..., 0].contiguous(), spec.bits, spec.group)
    if not torch.equal(grid.dequantize(), target):
        worst = float((grid.dequantize() - target).abs().max())
        raise SpecError(f"the quantized weight is not on the {spec} grid of its reference (off by up to {worst:.3g}): "
                        "export the model that spec made from this reference")
    return grid


def _module_names(qmodel: Model) -> dict[int, str]:
    """``id(weight)`` -> the Hugging Face name of its module, for every parameter of the model."""
    from interp.models import canonical_state_dict

    return {id(tensor): name.removesuffix(".weight") for name, tensor in canonical_state_dict(qmodel).items()}


def _grids(qmodel: Model, reference: Model, spec: MethodSpec) -> dict[str, GroupGrid]:
    """Every quantized block weight's grid, under its module's Hugging Face name."""
    from interp.runtime import hooks

    names = _module_names(qmodel)
    grids = {}
    for layer in range(hooks.n_layers(qmodel)):
        ref_slots = hooks.linear_weights(reference, layer)
        for role, slot in hooks.linear_weights(qmodel, layer).items():
            weight = slot.module.weight
            if slot.rows is not None or slot.transposed or id(weight) not in names:
                raise ComponentError(
                    f"block {layer}'s {role} weight is fused or transposed ({type(slot.module).__name__}); the "
                    "compressed-tensors export supports models whose projections are separate nn.Linear layers."
                )
            grids[names[id(weight)]] = recover_grid(ref_slots[role].read(), slot.read(), spec.for_module(layer, role))
    return grids


def __getattr__(name: str) -> Any:  # the packers live in interp.checkpoints, which loads torch: on first use
    if name in ("pack_int32", "unpack_int32"):
        from interp import checkpoints

        return getattr(checkpoints, name)
    raise AttributeError(f"module 'interp.quant.export' has no attribute {name!r}")


def _tensors(grid: GroupGrid, layout: str) -> dict[str, Tensor]:
    """One module's tensors in the compressed-tensors layout (without its module prefix)."""
    import torch

    from interp.checkpoints import pack_int32  # loads torch: imported on use, so `interp --help` stays fast

    offset = 2 ** (grid.bits - 1)  # compressed-tensors stores levels in the signed range -2^(b-1) .. 2^(b-1) - 1
    if layout == UNPACKED:
        zero = (grid.zero - offset).to(torch.int8) if grid.integer_zero else grid.zero - offset
        return {"weight": (grid.levels - offset).to(torch.int8), "weight_scale": grid.scale, "weight_zero_point": zero}
    zero = grid.zero.round().to(torch.int64)  # whole levels 0 .. 2^bits - 1: the signed zero-point plus the offset
    return {
        "weight_packed": pack_int32(grid.levels, grid.bits),
        "weight_scale": grid.scale,
        "weight_zero_point": pack_int32(zero.T.contiguous(), grid.bits).T.contiguous(),  # packed along d_out
        "weight_shape": torch.tensor(list(grid.levels.shape), dtype=torch.int64, device=grid.levels.device),
    }


def quantization_config(spec: MethodSpec, layout: str, targets: dict[str, int], integer_zero: bool) -> dict[str, Any]:
    """The ``quantization_config`` entry of ``config.json`` for a weight-only group-wise int grid.

    ``targets`` maps each quantized module's name to its bit width. One ``config_groups`` entry
    per width, named by its modules: ``group_0`` holds the spec's own width, and a plan's other
    widths follow in increasing order (``group_1``, ...).
    """
    widths = sorted(set(targets.values()), key=lambda b: (b != spec.bits, b))
    groups = {}
    for index, bits in enumerate(widths):
        weights: dict[str, Any] = {"num_bits": bits, "type": "int", "symmetric": False, "strategy": "group",
                                   "group_size": spec.group, "dynamic": False, "observer": "minmax"}
        if not integer_zero:
            weights["zp_dtype"] = "float32"
        groups[f"group_{index}"] = {"targets": sorted(name for name, b in targets.items() if b == bits),
                                    "weights": weights, "input_activations": None, "output_activations": None,
                                    "format": layout}
    return {
        "quant_method": "compressed-tensors",
        "format": layout,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": [],
        "kv_cache_scheme": None,
        "interp_spec": str(spec),
    }


def export_compressed_tensors(qmodel: Model, reference: Model, folder: str | os.PathLike[str],
                              layout: str = UNPACKED) -> Path:
    """Write ``qmodel`` (made by :func:`interp.quant.quantize` from ``reference``) as a compressed-tensors folder.

    The folder holds ``config.json`` (with a ``quantization_config``), ``model.safetensors``
    and the tokenizer. Only the block linear weights are quantized; embeddings, norms and
    the unembedding are stored as they are. The folder is written into a temporary sibling
    and renamed into place once complete (:func:`interp.output_folders.staged_folder`). An existing ``folder``
    must be empty or an earlier export: a folder holding other files is refused, and files interp
    did not write are never removed.

    Args:
        qmodel: the quantized model (it carries ``quant_info``).
        reference: the model it was quantized from (the grids are refitted from its weights).
        folder: where to write.
        layout: ``"int-quantized"`` (default: what transformers loads) or ``"pack-quantized"``
            (integer zero-points only; see the module docstring for why transformers 5.23 cannot
            load it back).

    Returns:
        The folder.

    Raises:
        SpecError: a spec without a recoverable integer grid (nf, hqq, awq, gptq with act_order=0).
        ComponentError: a model with fused or transposed projections.
        InterpError: ``qmodel`` is not a quantized model.
    """
    from safetensors.torch import load_file, save_file

    from interp.io import remove_temp, staged_folder, write_file, write_text
    from interp.models import export_hf

    info = getattr(qmodel, "quant_info", None)
    if info is None:
        raise InterpError("export_compressed_tensors needs a model returned by interp.quant.quantize (no quant_info).")
    spec = parse_spec(info.spec)
    check_exportable(spec)
    if layout not in (UNPACKED, PACKED):
        raise SpecError(f"layout must be {UNPACKED!r} or {PACKED!r}; got {layout!r}.")
    grids = _grids(qmodel, reference, spec)
    integer_zero = all(grid.integer_zero for grid in grids.values())
    if layout == PACKED and not integer_zero:
        raise SpecError(f"{PACKED} stores integer zero-points only, and {spec} has float ones: use "
                        f"{UNPACKED}, or quantize with rtn:...,zero=int.")
    out = Path(folder)
    with staged_folder(out, EXPORT_KIND) as tmp:
        export_hf(qmodel, tmp)
        tensors: dict[str, Tensor] = {}
        for path in sorted(tmp.glob("*.safetensors")):
            tensors.update(load_file(str(path)))
            remove_temp(path)
        for name, grid in grids.items():
            del tensors[f"{name}.weight"]
            tensors.update({f"{name}.{key}": value for key, value in _tensors(grid, layout).items()})
        flat = {k: v.contiguous() for k, v in tensors.items()}
        write_file(tmp / "model.safetensors", lambda p: save_file(flat, str(p), metadata={"format": "pt"}))
        for index in tmp.glob("*.safetensors.index.json"):
            remove_temp(index)
        config = json.loads((tmp / "config.json").read_text())
        targets = {name: grid.bits for name, grid in grids.items()}
        config["quantization_config"] = quantization_config(spec, layout, targets, integer_zero)
        write_text(tmp / "config.json", json.dumps(config, indent=2))
    return out
