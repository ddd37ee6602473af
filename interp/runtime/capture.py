"""Capture named activations in one forward that stops after the last needed layer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from interp.models import Model
from interp.runtime import hooks as hk
from interp.typing import Key, Resid, Tokens


def capture(model: Model, tokens: Tokens, keys: Sequence[Key]) -> tuple[dict[Key, Tensor], Resid]:
    """Activations at ``keys`` and the final (pre-norm) residual, from one forward."""
    store: dict[Key, Tensor] = {}
    final_key = ("resid_post", hk.n_layers(model) - 1)

    def saver(key: Key) -> Callable[[Tensor, Any], None]:
        def save(x: Tensor, hook: Any) -> None:
            store[key] = x.detach()
        return save

    wanted = list(dict.fromkeys([*keys, final_key]))
    fwd = [(hk.hook_point(model, component, layer), saver((component, layer))) for component, layer in wanted]
    with model.hooks(fwd_hooks=fwd):
        hk.decoder_body(model)(input_ids=tokens)
    return store, store[final_key]
