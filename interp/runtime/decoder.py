"""DecoderRunner: runs a model's decoder blocks from a given residual, so a forward can start mid-
model (restoration, patching).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from interp.models import Model
from interp.runtime import hooks as hk
from interp.typing import Key, Resid


class DecoderRunner:
    """Runs decoder blocks ``start..L-1`` from a residual, calling them as the model's forward does.

    Llama-style models (Llama, Mistral, Qwen) call each layer with
    ``position_embeddings=(cos, sin)`` from the rotary module, a causal mask from
    ``create_causal_mask`` and ``position_ids``; Gemma-3 and other models with
    ``config.layer_types`` pick a full or sliding-window mask (and, for Gemma-3, rotary
    embeddings) per layer type. The blocks are the bridge's, so hooks fire as usual.
    """

    def __init__(self, model: Model) -> None:
        inner = model.original_model.model
        self.blocks = hk.blocks(model)
        self.config = inner.config
        self.rotary = inner.rotary_emb
        n = len(self.blocks)
        self.layer_types = list(getattr(self.config, "layer_types", None) or ["full_attention"] * n)
        rotary_forward = getattr(self.rotary, "original_component", None) or self.rotary
        self.rotary_by_type = "layer_type" in inspect.signature(rotary_forward.forward).parameters
        self._rotary: dict[tuple[Any, ...], Any] = {}
        self._masks: dict[tuple[Any, ...], Any] = {}
        self._model = model
        self._native: Any = None

    @classmethod
    def for_model(cls, model: Model) -> DecoderRunner | None:
        """A runner for blocks under ``model.layers`` with a rotary module (Llama, Mistral, Qwen, Gemma, Phi-3,
        OLMo-2...); ``None`` where the layer call is unknown. :meth:`verify` checks it on the first batch."""
        info = getattr(model, "info", None)
        if info is None or info.layers_path != "model.layers":
            return None
        inner = getattr(model.original_model, "model", None)
        if inner is None or not hasattr(inner, "rotary_emb"):
            return None
        if getattr(inner.config, "use_bidirectional_attention", False):
            return None
        return cls(model)

    def _layer_kwargs(self, layer: int, hidden: Tensor) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kind = self.layer_types[layer]
        rows, seq = hidden.shape[:2]
        position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0)
        rkey = (kind if self.rotary_by_type else "", seq, hidden.dtype, hidden.device)
        if rkey not in self._rotary:
            extra = (kind,) if self.rotary_by_type else ()
            self._rotary[rkey] = self.rotary(hidden[:1], position_ids, *extra)
        mkey = (kind, rows, seq, hidden.dtype, hidden.device)
        if mkey not in self._masks:
            make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
            self._masks[mkey] = make(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                     past_key_values=None, position_ids=position_ids)
        return {"attention_mask": self._masks[mkey], "position_embeddings": self._rotary[rkey],
                "position_ids": position_ids}

    def native_blocks(self) -> Any:
        """The decoder layers without the bridge's wrappers (:func:`interp.runtime.hooks.native_model`)."""
        if self._native is None:
            tree: Any = hk.native_model(self._model)
            self._native = tree.model.layers
        return self._native

    def block(self, layer: int, hidden: Resid, module: Any = None, native: bool = False) -> Resid:
        """Block ``layer`` (or ``module`` in its place) applied to ``hidden``.

        ``native=True`` runs the bridge-free layer: same output bit for bit, no hooks fire.
        """
        if module is None:
            module = self.native_blocks()[layer] if native else self.blocks[layer]
        out = module(hidden, **self._layer_kwargs(layer, hidden))
        return out[0] if isinstance(out, tuple) else out

    def run(self, hidden: Resid, start: int, modules: Sequence[Any] | None = None) -> Resid:
        """Blocks ``start..L-1``; ``modules[l]`` replaces block ``l`` when given."""
        for layer in range(start, len(self.blocks)):
            hidden = self.block(layer, hidden, None if modules is None else modules[layer])
        return hidden

    def check_layers(self) -> list[int]:
        """The last layer of each layer type: enough to check masks and rotary embeddings."""
        last: dict[str, int] = {}
        for layer, kind in enumerate(self.layer_types):
            last[kind] = layer
        return sorted(last.values())

    def verify(self, cache: Mapping[Key, Tensor]) -> bool:
        """Does one block from the cached ``resid_pre`` reproduce the cached ``resid_post``?"""
        for layer in self.check_layers():
            expected = cache[("resid_post", layer)]
            got = self.block(layer, cache[("resid_pre", layer)])
            scale = float(expected.abs().max()) or 1.0
            if not torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * scale):
                return False
        return True
