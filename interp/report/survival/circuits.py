"""The survival study's circuits: the reference's filter, its circuit, and every edge's per-pair effect.

An edge's effect on one pair is path patching's change of the logit difference ``logit(answer) - logit(wrong)``
when the sender is patched from the corrupt prompt along that edge only
(:func:`interp.localize.circuit.path_patch`), per pair, so the analysis can resample pairs.

Example:
    >>> import interp
    >>> import pandas as pd
    >>> from interp.report.survival.circuits import edge_effects
    >>> model = interp.tiny_model("llama")
    >>> edges = pd.DataFrame({"edge": ["head 0.1 -> logits"], "sender": ["head 0.1"], "receiver": ["logits"]})
    >>> effects, clean = edge_effects(model, ["When Mary and John went, John gave it to"],
    ...                               ["When Mary and John went, Anna gave it to"], [77], [74], edges)
    >>> effects.shape, clean.shape  # [edges, pairs], [pairs]
    ((1, 1), (1,))
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from interp.data import examples_from_texts
from interp.models import Model
from interp.report.survival.units import Pairs
from interp.runtime.batching import batches, device_of

__all__ = ["edge_effects", "last_logit_diffs", "passing"]


def last_logit_diffs(model: Model, texts: Sequence[str], answers: Sequence[int], wrongs: Sequence[int],
                     batch_size: int = 8) -> np.ndarray:
    """``logit(answer) - logit(wrong)`` at each prompt's last token (float64), prompts run in padded batches."""
    out = []
    device = device_of(model)
    for start, end in batches(len(texts), batch_size):
        ex = examples_from_texts(list(texts[start:end]), model.tokenizer)
        tokens = ex.tokens.to(device)
        last = (ex.attention_mask.sum(dim=1) - 1 if ex.attention_mask is not None
                else torch.full((len(tokens),), tokens.shape[1] - 1, device=device))
        with torch.no_grad():  # right padding: a causal model's last real position never sees the pads
            logits = model.original_model(input_ids=tokens).logits[torch.arange(len(tokens), device=device), last]
        a = torch.as_tensor(list(answers[start:end]), device=device)
        w = torch.as_tensor(list(wrongs[start:end]), device=device)
        rows = torch.arange(len(tokens), device=device)
        out.append((logits[rows, a].double() - logits[rows, w].double()).cpu())
    return torch.cat(out).numpy()


def passing(model: Model, pairs: Pairs, both_ways: bool, needed: int, chunk: int = 64, batch_size: int = 8
            ) -> tuple[list[int], dict[str, list[float]]]:
    """Indices of the candidates that pass the reference filter, in order, stopping once ``needed`` pass: the clean
    logit difference > 0 (and, with ``both_ways``, the corrupt one < 0). Also every computed difference."""
    kept: list[int] = []
    seen: dict[str, list[float]] = {"clean": [], "corrupt": []}
    for start in range(0, len(pairs), chunk):
        part = pairs.take(range(start, min(start + chunk, len(pairs))))
        clean = last_logit_diffs(model, part.clean, part.answers, part.wrongs, batch_size)
        seen["clean"] += clean.tolist()
        ok = clean > 0
        if both_ways:
            corrupt = last_logit_diffs(model, part.corrupt, part.answers, part.wrongs, batch_size)
            seen["corrupt"] += corrupt.tolist()
            ok &= corrupt < 0
        kept += [start + i for i in np.flatnonzero(ok).tolist()]
        if len(kept) >= needed:
            break
    return kept, seen


def edge_effects(model: Model, clean: Sequence[str], corrupt: Sequence[str], answers: Sequence[int],
                 wrongs: Sequence[int], edges: pd.DataFrame, batch_size: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """``(effects [edges, pairs], clean logit difference [pairs])``: each edge's path-patching effect per pair, the
    edges into one receiver patched in one call."""
    from interp.localize.circuit import path_patch

    a = torch.as_tensor(list(answers))  # host: token ids; path_patch moves them with each batch
    w = torch.as_tensor(list(wrongs))  # host: as above
    effects = np.full((len(edges), len(clean)), np.nan)
    target = None
    for receiver, group in edges.reset_index(drop=True).groupby("receiver", sort=False):
        receivers = "logits" if receiver == "logits" else [str(receiver)]
        result = path_patch(model, list(clean), list(corrupt), a, w, list(group["sender"]), receivers,
                            batch_size=batch_size)
        values = (result.values - result.target).double().cpu().numpy()
        for row, index in enumerate(group.index):
            effects[index] = values[row]
        target = result.target.double().cpu().numpy()
    assert target is not None and np.isfinite(effects).all()
    return effects, target
