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
from typing import Literal, Union

from interp import validate
from interp.errors import ComponentError
from interp.models import Model
from interp.runtime import hooks as hk
from interp.runtime.hooks import COMPONENT_RECORDS, PER_HEAD
from interp.validate import checked_class

PatchComponent = Literal[
    "resid_pre", "resid_mid", "resid_post", "attn_out", "head", "gate", "up", "down", "gate_input", "mlp_pre", "z",
    "q", "k", "v",
]  # the patchable records' names, for type checkers (a test checks that the two agree)
# Derived from the component records (interp.runtime.hooks.COMPONENT_RECORDS): every component
# is patchable except h (the normed MLP input is patched as gate_input, which reaches the gate
# alone), the attention pattern (a distribution, not an activation that flows on), gate_pre (the
# gate is patched after its activation function) and result (patch its heads' z instead).
NOT_PATCHABLE: tuple[str, ...] = tuple(n for n, r in COMPONENT_RECORDS.items() if not r.patchable)
PATCHABLE: tuple[str, ...] = tuple(n for n, r in COMPONENT_RECORDS.items() if r.patchable)
PAPER_COMPONENTS: tuple[str, ...] = ("attn_out", "gate", "up", "down", "gate_input")
PAPER_NAMES = {name: COMPONENT_RECORDS[name].label for name in PATCHABLE}
LayerSelection = Union[str, int, Sequence[int], None]


@checked_class(layers=lambda value, name, arguments: None, positions=lambda value, name, arguments: None,
               heads=lambda value, name, arguments: None)  # types here; ranges and emptiness in __post_init__'s words
@dataclass(frozen=True)
class Patch:
    """One patch job: a component at one or more layers, at all or some positions and heads.

    Attributes:
        component: a semantic name from :data:`PATCHABLE`.
        layers: layers patched together, in one run.
        positions: token positions to patch (default: all).
        heads: for a per-head component (``head``, ``z``), the heads to patch (default: all).
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
        if self.heads is not None and self.component not in PER_HEAD:
            raise ComponentError(f"heads= applies to the per-head components ({', '.join(sorted(PER_HEAD))}) only, "
                                 f"not {self.component!r}.")

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


def resolve_layers(model: Model, layers: LayerSelection) -> list[int]:
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
    return [Patch(c, (int(layer),), pos, tuple(heads) if heads is not None and c in PER_HEAD else None)
            for c in components for layer in layers]


def joint_patches(components: Sequence[str], layers: Sequence[int], heads: Sequence[int] | None = None) -> list[Patch]:
    """One patch per component, covering all ``layers`` at once (e.g. the upper half)."""
    return [Patch(c, tuple(int(x) for x in layers), None, tuple(heads) if heads is not None and c in PER_HEAD else None)
            for c in components]


def position_patches(component: str, layers: Sequence[int], positions: Sequence[int]) -> list[Patch]:
    """One patch per (layer, position): the classic layer x position grid."""
    return [Patch(component, (int(layer),), (int(p),)) for layer in layers for p in positions]

