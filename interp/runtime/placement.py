"""Models split over devices and disk with accelerate's ``device_map``: where their weights are.

A model loaded with ``device_map`` (:func:`interp.load_model`) carries accelerate's
``AlignDevicesHook`` on its modules. A block placed on a device holds its weights there; a
block *offloaded* to the CPU or to disk holds ``meta`` placeholders, and the hook loads
the real weights from accelerate's store (``weights_map``) before each forward and drops
them after it. Forwards therefore run unchanged on a dispatched model, and so does every
analysis that only reads activations.

Analyses that read or write *weights* (quantizing, scoring quantized variants in place,
restoring layers) do it through :func:`onloaded`: inside it the offloaded weights of the
chosen blocks are real tensors on their execution device, and on leaving it whatever they
hold then is written back to accelerate's store (into the ``.dat`` file accelerate wrote
for a disk-offloaded weight, in place into the CPU copy for a CPU-offloaded one). A weight
that accelerate reads straight from the source checkpoint (``from_pretrained`` can offload
that way) is redirected to a file of its own in the offload folder: a source checkpoint is
never modified, and memory holds one block at a time.

Example:
    >>> import interp, torch
    >>> from interp.runtime import placement
    >>> model = interp.tiny_model("llama")
    >>> placement.is_dispatched(model), placement.offloaded_layers(model)
    (False, [])
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from interp.errors import InterpError
from interp.models import Model
from interp.runtime.hooks import blocks


def _hf(model: Model) -> Any:
    return getattr(model, "original_model", model)


def device_map(model: Model) -> dict[str, Any]:
    """The model's accelerate ``device_map`` (module name -> device, ``"cpu"`` or ``"disk"``); ``{}`` if none."""
    found = getattr(_hf(model), "hf_device_map", None)
    return dict(found) if isinstance(found, dict) else {}


def is_dispatched(model: Model) -> bool:
    """Whether the model was placed by accelerate (a ``device_map`` with hooks on its modules)."""
    return bool(device_map(model)) and any("_hf_hook" in vars(m) for m in _hf(model).modules())


def _offload_hooks(module: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, Any]]:
    """(module, hook) for every submodule whose weights accelerate keeps off-device."""
    for sub in module.modules():
        hook = vars(sub).get("_hf_hook")  # its own: a transformer-lens wrapper forwards getattr to what it wraps
        if getattr(hook, "offload", False) and getattr(hook, "weights_map", None) is not None:
            yield sub, hook


def offloaded_layers(model: Model) -> list[int]:
    """Indices of the blocks that hold offloaded (``meta``) weights between forwards."""
    return [i for i, block in enumerate(blocks(model)) if next(_offload_hooks(block), None) is not None]


def execution_device(model: Model) -> torch.device | None:
    """Where a dispatched model wants its input ids: the execution device of its first hooked module."""
    if not device_map(model):
        return None
    for module in _hf(model).modules():
        hook = vars(module).get("_hf_hook")
        device = getattr(hook, "execution_device", None)
        if device is not None and any(True for _ in module.parameters(recurse=False)):
            return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    return None


def _store(weights_map: Any, name: str, value: torch.Tensor) -> None:
    """Write ``value`` where accelerate keeps the offloaded weight ``name`` of one module."""
    from accelerate.utils import offload_weight  # accelerate loads only for dispatched models

    loader, key = weights_map.dataset, weights_map.prefix + name
    kept = loader.state_dict.get(key)
    if isinstance(kept, torch.Tensor) and kept.shape == value.shape and kept.dtype == value.dtype:
        kept.copy_(value)  # offloaded to CPU memory: in place
    elif kept is None and loader.index is not None and key in loader.index and loader.save_folder:
        # offloaded to disk: accelerate's own raw file, written anew; a weight accelerate read from the
        # source checkpoint is redirected to such a file (the checkpoint itself is never written)
        offload_weight(value.detach().cpu(), key, loader.save_folder, index=loader.index)
    else:
        loader.state_dict[key] = value.detach().cpu().clone()


@contextlib.contextmanager
def onloaded(model: Model, layers: Iterable[int]) -> Iterator[None]:
    """The offloaded weights of blocks ``layers`` as real tensors, readable and writable in place.

    Forwards inside the block keep these tensors (the offload hooks are paused). On exit,
    every parameter of those modules is written back to accelerate's store and replaced by
    its ``meta`` placeholder again. A model without offloaded blocks passes through.
    """
    from accelerate.utils import set_module_tensor_to_device  # accelerate loads only for dispatched models

    held: list[tuple[torch.nn.Module, Any]] = []
    all_blocks = blocks(model)
    try:
        for layer in layers:
            for module, hook in list(_offload_hooks(all_blocks[layer])):
                for name, _ in module.named_parameters(recurse=False):
                    set_module_tensor_to_device(module, name, hook.execution_device, value=hook.weights_map[name])
                hook.offload = False
                held.append((module, hook))
        yield
    finally:
        with torch.no_grad():
            for module, hook in held:
                for name, param in list(module.named_parameters(recurse=False)):
                    _store(hook.weights_map, name, param.detach())
                    set_module_tensor_to_device(module, name, "meta")
                hook.offload = True


def refuse_offloaded(model: Model, what: str, instead: str) -> None:
    """Raise a clear error when ``what`` cannot run on a model with offloaded blocks (and say what can)."""
    layers = offloaded_layers(model) if is_dispatched(model) else []
    if layers:
        raise InterpError(
            f"{what} cannot run on a model whose blocks {layers} are offloaded to CPU or disk (device_map): "
            f"it would copy the whole model, and an offloaded block's weights are not in memory to copy. {instead}"
        )
