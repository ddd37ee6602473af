"""Per-example next-token NLL, computed without materialising a full log-softmax.

``nll(x) = mean over t = 1..T-1 of -log p(x_t | x_<t)``: position 0 is BOS and is never a
target. The log-probabilities come from ``logsumexp`` and a ``gather`` over position chunks,
so no ``[batch, pos, vocab]`` log-softmax copy is made. Examples never share a row and are
never padded, so an example's NLL does not depend on its batch (checked to 1e-4 in tests).
"""

from __future__ import annotations

from typing import Any

import torch
from tqdm.auto import tqdm

from interp.data import Examples
from interp.errors import NonFiniteError
from interp.probes import batches, check_context, show_progress


def token_nll(logits: torch.Tensor, tokens: torch.Tensor, chunk: int = 32) -> torch.Tensor:
    """``-log p(tokens[:, t+1] | ...)`` from ``logits[:, t]``: ``[B, T, V], [B, T] -> [B, T-1]``."""
    out = []
    targets = tokens[:, 1:]
    logits = logits[:, :-1]
    for start in range(0, targets.shape[1], chunk):
        block = logits[:, start : start + chunk].float()
        target = targets[:, start : start + chunk]
        lse = torch.logsumexp(block, dim=-1)
        picked = block.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        out.append(lse - picked)
    return torch.cat(out, dim=1)


def token_kl(ref_logits: torch.Tensor, logits: torch.Tensor, chunk: int = 32) -> torch.Tensor:
    """``KL(p_ref || p)`` per predicting position: ``[B, T, V] x 2 -> [B, T-1]``."""
    out = []
    for start in range(0, logits.shape[1] - 1, chunk):
        stop = min(start + chunk, logits.shape[1] - 1)
        log_p_ref = torch.log_softmax(ref_logits[:, start:stop].float(), dim=-1)
        log_p = torch.log_softmax(logits[:, start:stop].float(), dim=-1)
        out.append((log_p_ref.exp() * (log_p_ref - log_p)).sum(-1))
    return torch.cat(out, dim=1)


def model_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the underlying Hugging Face model (bridge hooks still fire)."""
    device = next(model.original_model.parameters()).device
    return model.original_model(input_ids=tokens.to(device)).logits


def nll(model: Any, examples: Examples, batch_size: int = 8, progress: bool | None = False) -> torch.Tensor:
    """Mean next-token NLL per example: ``Tensor [N]`` (nats).

    Args:
        model: a bridge from :func:`interp.load_model` (or a quantized copy).
        examples: fixed-length token rows.
        batch_size: examples per forward.
        progress: show a progress bar.
    """
    check_context(model, examples.tokens)
    out = torch.empty(len(examples), dtype=torch.float64)
    bar = tqdm(total=len(examples), desc="nll", unit="ex", disable=not show_progress(progress))
    with torch.no_grad():
        for start, end in batches(len(examples), batch_size):
            tokens = examples.tokens[start:end]
            per_token = token_nll(model_logits(model, tokens), tokens.to(_device(model)))
            out[start:end] = per_token.double().mean(dim=1).cpu()
            bar.update(end - start)
    bar.close()
    if not torch.isfinite(out).all():
        bad = [examples.ids[i] for i in torch.nonzero(~torch.isfinite(out)).flatten().tolist()[:3]]
        raise NonFiniteError(f"The model produced NaN/inf NLL for examples {bad}: check its weights.")
    return out.float()


def _device(model: Any) -> torch.device:
    return next(model.original_model.parameters()).device


def perplexity(nll_values: torch.Tensor) -> float:
    """Perplexity of a set of examples: ``exp`` of the mean per-example NLL."""
    return float(torch.exp(nll_values.double().mean()))
