"""What to patch: :class:`Patch` jobs, layer selections and the usual job lists.

Example:
    >>> from interp.localize.patching.patches import Patch, single_layer_patches, span
    >>> [p.label for p in single_layer_patches(["down"], [3, 4], positions=[0])]
    ['down@3 pos0', 'down@4 pos0']
    >>> span((15, 16, 17)), span((1, 5))
    ('15-17', '1,5')
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

from interp import validate
from interp.errors import ComponentError
from interp.runtime import hooks as hk
from interp.runtime.hooks import COMPONENTS

PatchComponent = Literal[
    "resid_pre", "resid_mid", "resid_post", "attn_out", "head", "gate", "up", "down", "gate_input", "mlp_pre",
]
# Every hook component can be patched except these: h (the normed MLP input is patched as
# gate_input, which reaches the gate alone), the attention pattern (a distribution, not an
# activation that flows on) and gate_pre (the gate is patched after its activation function).
NOT_PATCHABLE = ("h", "pattern", "gate_pre")
PATCHABLE: tuple[str, ...] = tuple(c for c in COMPONENTS if c not in NOT_PATCHABLE)
PAPER_COMPONENTS: tuple[str, ...] = ("attn_out", "gate", "up", "down", "gate_input")
PAPER_NAMES = {"attn_out": "attention", "gate": "gate", "up": "up", "down": "down (MLP out)",
               "gate_input": "gate input only", "head": "heads", "resid_pre": "resid_pre",
               "resid_mid": "resid_mid", "resid_post": "resid_post", "mlp_pre": "MLP pre-activation"}
LayerSelection = Union[str, int, Sequence[int], None]


@dataclass(frozen=True)
class Patch:
    """One patch job: a component at one or more layers, at all or some positions and heads.

    Attributes:
        component: a semantic name from :data:`PATCHABLE`.
        layers: layers patched together, in one run.
        positions: token positions to patch (default: all).
        heads: for ``head``, the heads to patch (default: all).
    """

    component: str
    layers: tuple[int, ...]
    positions: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.component not in PATCHABLE:
            raise ComponentError(f"Cannot patch {self.component!r}. Patchable components: {', '.join(PATCHABLE)}.")
        if not self.layers:
            raise ComponentError("A patch needs at least one layer.")
        if not all(validate.is_integer(layer) for layer in self.layers):
            raise ComponentError(f"Patch layers must be integer layer indices, got {self.layers!r}.")
        if self.heads is not None and self.component != "head":
            raise ComponentError(f"heads= applies to the 'head' component only, not {self.component!r}.")

    @property
    def start(self) -> int:
        """The lowest patched layer: the patched run starts there."""
        return min(self.layers)

    @property
    def label(self) -> str:
        text = f"{self.component}@{span(self.layers)}"
        if self.heads is not None:
            text += f" h{span(self.heads)}"
        if self.positions is not None:
            text += f" pos{span(self.positions)}"
        return text


def span(values: Sequence[int]) -> str:
    """``(15, 16, ..., 29)`` -> ``"15-29"``; other sets are listed."""
    ordered = sorted(values)
    if len(ordered) > 1 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))


def resolve_layers(model: Any, layers: LayerSelection) -> list[int]:
    """``None``/``"all"``, ``"upper_half"``, ``"lower_half"``, a layer, or a list of layers."""
    n = hk.n_layers(model)
    if layers is None or layers == "all":
        return list(range(n))
    if layers == "upper_half":
        return list(range(n // 2, n))
    if layers == "lower_half":
        return list(range(n // 2))
    if isinstance(layers, str):
        raise ComponentError(f"Unknown layer selection {layers!r}: use 'all', 'upper_half', 'lower_half' or indices.")
    return sorted(set(validate.layer_indices(layers, n)))


def single_layer_patches(components: Sequence[str], layers: Sequence[int], positions: Sequence[int] | None = None,
                         heads: Sequence[int] | None = None) -> list[Patch]:
    """One patch per (component, layer): a per-layer sweep."""
    pos = tuple(positions) if positions is not None else None
    return [Patch(c, (int(layer),), pos, tuple(heads) if heads is not None and c == "head" else None)
            for c in components for layer in layers]


def joint_patches(components: Sequence[str], layers: Sequence[int], heads: Sequence[int] | None = None) -> list[Patch]:
    """One patch per component, covering all ``layers`` at once (e.g. the upper half)."""
    return [Patch(c, tuple(int(x) for x in layers), None, tuple(heads) if heads is not None and c == "head" else None)
            for c in components]


def position_patches(component: str, layers: Sequence[int], positions: Sequence[int]) -> list[Patch]:
    """One patch per (layer, position): the classic layer x position grid."""
    return [Patch(component, (int(layer),), (int(p),)) for layer in layers for p in positions]

