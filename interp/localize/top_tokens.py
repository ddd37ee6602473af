"""The top decoded tokens per layer and position: the logit lens (or a tuned lens) as text.

Each layer's block output ``r_l`` is decoded into next-token probabilities: with the model's
own final norm and head, ``softmax(unembed(final_norm(r_l)))`` (the logit lens), or through a
fitted :class:`~interp.localize.tuned_lens.TunedLens` translator first,
``softmax(unembed(A_l r_l + b_l))``. The ``k`` most probable tokens at every layer and position
show where a prediction forms. The last layer's logit-lens row is the model's own prediction.

Example:
    >>> import interp
    >>> model = interp.tiny_model("llama")
    >>> top = interp.lens_top_tokens(model, "hello", k=3)
    >>> tuple(top.ids.shape)  # [layers, positions, k]
    (2, 6, 3)
    >>> bool((top.probs[:, :, 0] >= top.probs[:, :, 1]).all())
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float, Int64
from torch import Tensor

from interp.display import ResultDisplay
from interp.errors import InterpError
from interp.localize.prompts import Prompts, one_prompt, token_labels, token_strings
from interp.localize.tuned_lens import TunedLens
from interp.models import Model, model_name
from interp.results import CheckedResult
from interp.runtime import hooks as hk
from interp.runtime.batching import device_of
from interp.runtime.capture import capture
from interp.runtime.readout import Readout
from interp.validate import checked, count


@dataclass(frozen=True)
class TopTokens(CheckedResult, ResultDisplay):
    """The ``k`` most probable next tokens decoded at each layer and position of one prompt.

    Attributes:
        ids: ``[layers, positions, k]`` token ids, most probable first.
        probs: ``[layers, positions, k]`` their probabilities.
        layers: the rows' layers.
        labels: ``"position:token"`` of the prompt, one per position.
        strings: ``[layers][positions][k]`` the decoded tokens.
        lens: ``"logit"`` or ``"tuned"``.

    Made only finite, and with no cell whose top token is no more probable than ``1 / vocab``
    (``settings["vocab"]``): its logits were all equal, so the ranking is arbitrary (:mod:`interp.results`).
    """

    ids: Int64[Tensor, "layers positions k"]
    probs: Float[Tensor, "layers positions k"]
    layers: list[int]
    labels: list[str]
    strings: list[list[list[str]]]
    lens: str = "logit"
    settings: dict[str, Any] = field(default_factory=dict)

    def table(self) -> pd.DataFrame:
        """The top token per layer (rows) and position (columns)."""
        return pd.DataFrame([[cell[0] for cell in row] for row in self.strings],
                            index=pd.Index(self.layers, name="layer"), columns=self.labels)

    def to_frame(self) -> pd.DataFrame:
        """Long table: ``layer``, ``position``, ``rank``, ``token`` (its text), ``id``, ``prob``."""
        rows = [{"layer": layer, "position": p, "rank": r + 1, "token": self.strings[i][p][r],
                 "id": int(self.ids[i, p, r]), "prob": float(self.probs[i, p, r])}
                for i, layer in enumerate(self.layers) for p in range(len(self.labels))
                for r in range(self.ids.shape[2])]
        return pd.DataFrame(rows)

    def meaningless(self) -> str | None:
        """Cells whose ranking is arbitrary: a top probability of ``1 / vocab`` (to 8 float32 ulps), or k equal."""
        if self.probs.ndim != 3 or self.probs.numel() == 0:
            return None
        vocab = self.settings.get("vocab")
        top = self.probs[..., 0].double()
        if isinstance(vocab, int) and vocab > 1:
            flat = top * vocab <= 1 + 8 * 2.0**-24
        else:
            flat = (self.probs.amax(-1) == self.probs.amin(-1)) if self.probs.shape[-1] > 1 else top != top
        if not bool(flat.any()):
            return None
        cells = [(self.layers[i] if i < len(self.layers) else i, p) for i, p in flat.nonzero().tolist()][:6]
        return (f"the predictions at (layer, position) {cells} are uniform over the vocabulary: the logits were "
                "all equal, so no token ranks first. The model's final norm or head returns constants (its "
                "weights overflow or are zero).")


@checked
def lens_top_tokens(
    model: Model,
    prompt: Prompts,
    k: int = 5,
    *,
    lens: TunedLens | None = None,
    layers: Sequence[int] | None = None,
) -> TopTokens:
    """The top-``k`` tokens the logit lens (or ``lens``, a tuned lens) reads at each layer and position.

    Args:
        model: a bridge from :func:`interp.load_model`.
        prompt: one prompt (a string, or one row of token ids).
        k: tokens kept per cell.
        lens: a :class:`~interp.localize.tuned_lens.TunedLens` fitted for ``model``
            (:func:`~interp.localize.tuned_lens.fit_tuned_lens`); default the logit lens.
        layers: the layers decoded (default: all; a tuned lens decodes the layers it was fitted on).

    Returns:
        A :class:`~interp.localize.top_tokens.TopTokens`; ``interp.figures.draw(result)`` draws the top token per cell.

    Example:
        >>> import interp
        >>> model = interp.tiny_model("llama")
        >>> top = interp.lens_top_tokens(model, "hi", k=2, layers=[1])
        >>> top.table().shape  # one layer, three positions (BOS, h, i)
        (1, 3)
    """
    k = count(k, "k")
    tokens = one_prompt(model, prompt)
    readout = Readout(model)
    if k > readout.vocab:
        raise InterpError(f"k must be at most the vocabulary ({readout.vocab}); got {k}.")
    chosen = hk.check_layers(model, layers)
    if lens is not None:
        lens.check_fits(model)  # a lens fitted on another model is refused before the model runs
        missing = sorted(set(chosen) - set(lens.layers))
        if missing:
            raise InterpError(f"This tuned lens has no translator for layers {missing}; fit it on this model "
                              "(fit_tuned_lens) or pass layers= it covers.")
    device = device_of(model)
    if lens is not None:  # its translators move to the model once, not at every layer
        lens = TunedLens(lens.weight.to(device), lens.bias.to(device), lens.layers, lens.settings)
    with torch.no_grad():
        store, _ = capture(model, tokens[None].to(device), [("resid_post", layer) for layer in chosen])
        ids, probs = [], []
        for layer in chosen:
            resid = store[("resid_post", layer)][0]
            if lens is None:
                logits = readout.logits(resid)
            else:
                index = lens.layers.index(layer)
                logits = readout.head(lens.translate(index, resid.float()).to(readout.weight.dtype))
            top = torch.softmax(logits.double(), dim=-1).topk(k, dim=-1)
            ids.append(top.indices.cpu())
            probs.append(top.values.float().cpu())
    id_grid = torch.stack(ids)
    strings = [[token_strings(model, cell) for cell in row] for row in id_grid]
    return TopTokens(ids=id_grid, probs=torch.stack(probs), layers=chosen, labels=token_labels(model, tokens),
                     strings=strings, lens="logit" if lens is None else "tuned",
                     settings={"model": model_name(model), "k": k, "vocab": readout.vocab})
