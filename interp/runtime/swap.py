"""Another set of block weights in a model for a while, with the model's own kept on disk.

Comparing a model with a variant of itself (a quantized copy, the same model with some
blocks restored) needs only one copy of the weights when the variant is swapped into the
model and swapped out again:

1. before block ``l`` changes, its linear weights are written to a :class:`WeightStash`,
   a temporary folder of safetensors files (one per block), so at most one block's
   weights are ever held twice in memory;
2. the variant's weights for block ``l`` are written in (:func:`swapped`, from any
   :class:`BlockWeights` source, read one block at a time);
3. on leaving the ``with`` block every stashed block is written back. The values come
   from safetensors files holding the exact bytes, so the model is bit-identical
   afterwards.

Only the block linear weights (q, k, v, o, gate, up, down: :func:`interp.runtime.hooks.linear_weights`)
are swapped; weight-only quantizers change nothing else. Blocks offloaded by a ``device_map``
are onloaded one at a time (:func:`interp.runtime.placement.onloaded`).

Example:
    >>> import interp, torch
    >>> from interp.runtime.swap import swapped
    >>> model, other = interp.tiny_model("llama", seed=0), interp.tiny_model("llama", seed=1)
    >>> class Other:
    ...     def block(self, layer):
    ...         return {role: slot.read() for role, slot in interp.runtime.hooks.linear_weights(other, layer).items()}
    >>> tokens = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    >>> before = model(tokens)
    >>> with swapped(model, Other(), layers=[0]):
    ...     inside = model(tokens)
    >>> bool(torch.equal(model(tokens), before)), bool(torch.equal(inside, before))
    (True, False)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file

from interp.errors import ComponentError
from interp.io import PrivateFolder, write_safetensors
from interp.models import Model
from interp.runtime import hooks, placement
from interp.validate import checked_class, is_block_weights  # noqa: F401 - is_block_weights: re-exported


class BlockWeights(Protocol):
    """A source of block linear weights: ``block(l)`` is ``{role: [out, in] tensor}`` for block ``l``."""

    def block(self, layer: int) -> dict[str, torch.Tensor]: ...


@checked_class
class WeightStash:
    """The block linear weights of ``model`` kept on disk while the model carries another variant.

    Args:
        model: the bridge whose weights are kept.
        folder: where the temporary stash folder goes (default: the system's temporary folder).

    :meth:`save` writes block ``l`` once (later calls for it do nothing: the stash holds the
    model's own weights, not whatever the block carries later); :meth:`restore_all` writes every
    saved block back. Use it as a context manager, or call :meth:`close`, to delete the folder.
    """

    def __init__(self, model: Model, folder: str | Path | None = None) -> None:
        self.model = model
        self._tmp = PrivateFolder(folder)  # interp-stash-PID-…: a killed run's is removed by the next one
        self.folder = self._tmp.path
        self.saved: set[int] = set()

    def _file(self, layer: int) -> Path:
        return self.folder / f"block{layer}.safetensors"

    def save(self, layer: int) -> None:
        (layer,) = hooks.check_layers(self.model, [layer])  # a layer the model lacks is a ComponentError
        if layer in self.saved:
            return
        with placement.onloaded(self.model, [layer]):
            # a copy per role: fused roles share storage, which safetensors refuses to write
            tensors = {role: slot.read().detach().to("cpu", copy=True).contiguous()
                       for role, slot in hooks.linear_weights(self.model, layer).items()}
        write_safetensors(self._file(layer), tensors)  # a full disk is a ResourceError naming the file
        self.saved.add(layer)

    def block(self, layer: int) -> dict[str, torch.Tensor]:
        """Block ``layer``'s saved weights (it must have been saved)."""
        if layer not in self.saved:
            raise ComponentError(f"Block {layer}'s weights were not saved in this stash (saved: {sorted(self.saved)}); "
                                 "call save(layer) first.")
        return load_file(str(self._file(layer)))

    def restore(self, layer: int) -> None:
        write_block(self.model, layer, self.block(layer))

    def restore_all(self) -> None:
        for layer in sorted(self.saved):
            self.restore(layer)

    def close(self) -> None:
        self._tmp.cleanup()

    def __enter__(self) -> WeightStash:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_block(model: Model, layer: int, values: dict[str, torch.Tensor]) -> None:
    """Write ``values`` (role -> ``[out, in]``) into block ``layer``'s linear weights, in place."""
    with torch.no_grad(), placement.onloaded(model, [layer]):
        slots = hooks.linear_weights(model, layer)
        for role, value in values.items():
            slots[role].write(value)




def _checked_roles(model: Model, layers: Sequence[int], roles: Iterable[str] | None) -> set[str] | None:
    if roles is None:
        return None
    wanted = set(roles)
    for layer in layers:
        unknown = sorted(wanted - set(hooks.linear_weights(model, layer)))
        if unknown:
            raise ComponentError(f"Unknown linear roles {unknown} for swapped(); block {layer} has "
                                 f"{sorted(hooks.linear_weights(model, layer))}.")
    return wanted


@contextlib.contextmanager
def swapped(model: Model, weights: BlockWeights, *, layers: Iterable[int] | None = None,
            roles: Iterable[str] | None = None, stash: WeightStash | None = None) -> Iterator[None]:
    """Inside the block, ``model``'s blocks ``layers`` (default: all) carry ``weights``; after it, their own.

    ``roles`` (e.g. every role but ``"gate"``) swaps only those linear weights of the blocks; the
    others keep the model's own (default: every role ``weights`` gives). ``stash`` may be shared by
    several swaps in a row or nested (each block is stashed once, before its first change, and
    every stashed block is written back on leaving each of them); without one, a temporary stash is
    made and deleted. Unknown roles are refused before anything changes.

    Example (the quantized model with its block-1 gate restored, as in
    :func:`interp.localize.patching.gate_input_vs_gate_weights`):

        >>> import interp, torch
        >>> model, other = interp.tiny_model("llama", seed=0), interp.tiny_model("llama", seed=1)
        >>> class Other:
        ...     def block(self, layer):
        ...         return {r: s.read() for r, s in hooks.linear_weights(other, layer).items()}
        >>> own_gate = hooks.linear_weights(model, 1)["gate"].read().clone()
        >>> other_up = hooks.linear_weights(other, 1)["up"].read()
        >>> with WeightStash(model) as stash, swapped(model, Other(), layers=[0], stash=stash), \\
        ...         swapped(model, Other(), layers=[1], roles=["q", "k", "v", "o", "up", "down"], stash=stash):
        ...     slots = hooks.linear_weights(model, 1)
        ...     torch.equal(slots["gate"].read(), own_gate), torch.equal(slots["up"].read(), other_up)
        (True, True)
    """
    chosen = list(range(hooks.n_layers(model)) if layers is None else sorted(set(layers)))
    wanted = _checked_roles(model, chosen, roles)
    own = stash is None
    active = WeightStash(model) if stash is None else stash
    try:
        for layer in chosen:
            active.save(layer)
            values = weights.block(layer)
            write_block(model, layer, values if wanted is None else {r: v for r, v in values.items() if r in wanted})
        yield
    finally:
        active.restore_all()
        if own:
            active.close()
