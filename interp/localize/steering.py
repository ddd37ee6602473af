"""Steering by activation addition during generation (Turner et al. 2023, "ActAdd").

A steering vector ``v`` (``d_model``) is added, times ``alpha``, to the residual stream entering
block ``layer`` (``resid_pre``) at **every** position the model computes, prompt and generated
tokens alike, while it generates greedily. :func:`steering_vector` builds the usual ``v``: the
difference of two prompts' residuals at that layer (their last tokens).

The KV cache. With the cache, each step computes the new token's position alone; the prompt's
keys and values were computed, with the addition, in the first step. Without it, every step
recomputes every position, each with the addition. The two are the same computation in another
order, so their logits agree to rounding; a steering hook that adds only where it sees the
prompt (the known bug class: Neuronpedia's #163) would leave the generated positions unsteered
under the cache and the two would part by ``alpha``'s effect. ``tests/test_toolbox.py`` checks
the agreement on the reference, a 3-bit copy and a GGUF checkpoint in float64.

The forward runs on the bridge-free Hugging Face tree (:func:`interp.runtime.hooks.native_model`:
the model's own tensors, quantized weights included) with its own cache; the addition is a
forward pre-hook on the decoder layer, removed when the call returns.

Example:
    >>> import interp
    >>> model = interp.tiny_model("llama")
    >>> v = interp.steering_vector(model, "happy", "sad", layer=1)
    >>> out = interp.steer(model, "I feel", v, layer=1, alpha=4.0, max_new_tokens=3)
    >>> len(out.new_tokens), tuple(out.logits.shape)  # one logit row per generated token
    (3, (3, 259))
    >>> again = interp.steer(model, "I feel", v, layer=1, alpha=4.0, max_new_tokens=3, use_cache=False)
    >>> again.new_tokens == out.new_tokens
    True
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from interp.architecture import follow
from interp.display import ResultDisplay
from interp.errors import InterpError
from interp.localize.prompts import Prompts, one_prompt
from interp.models import Model, model_name
from interp.results import CheckedResult, check_values
from interp.runtime import hooks as hk
from interp.runtime.batching import check_context, device_of
from interp.runtime.capture import capture
from interp.validate import checked, count


@dataclass(frozen=True)
class SteeringResult(CheckedResult, ResultDisplay):
    """A greedy generation with a steering vector added.

    Attributes:
        prompt_tokens: ``[T]`` the prompt's ids (BOS first).
        new_tokens: the generated ids.
        logits: ``[new, vocab]`` the logits each generated token was chosen from.
        text: the generated text.
        settings: layer, alpha, the vector's norm, whether the KV cache was used.

    Made only finite, with no logit row of equal values (each token was chosen by argmax): see
    :mod:`interp.results`.
    """

    ranked = ("logits",)

    prompt_tokens: Tensor
    new_tokens: list[int]
    logits: Float[Tensor, "new vocab"]
    text: str
    settings: dict[str, Any] = field(default_factory=dict)

    def table(self) -> pd.DataFrame:
        """One row per generated token: step, id, its logit and the runner-up's margin."""
        top2 = self.logits.topk(2, dim=-1).values
        return pd.DataFrame({"step": range(len(self.new_tokens)), "token": self.new_tokens,
                             "logit": top2[:, 0].numpy(), "margin": (top2[:, 0] - top2[:, 1]).numpy()})


def _vector(model: Model, vector: Tensor) -> Tensor:
    d = int(model.cfg.d_model)
    if not isinstance(vector, Tensor) or vector.ndim != 1 or vector.shape[0] != d:
        shape = tuple(vector.shape) if isinstance(vector, Tensor) else type(vector).__name__
        raise InterpError(f"The steering vector must be a tensor [d_model] = [{d}]; got {shape}. Build one with "
                          "interp.steering_vector(model, positive, negative, layer).")
    if not bool(torch.isfinite(vector).all()):
        raise InterpError("The steering vector has NaN/inf entries.")
    return vector.detach()


@contextmanager
def _adding(layer_module: torch.nn.Module, addition: Tensor) -> Iterator[None]:
    """Add ``addition`` to the hidden states entering ``layer_module``, at every position, while inside."""
    def pre_hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            hidden = args[0]
            return (hidden + addition.to(hidden.device, hidden.dtype), *args[1:]), kwargs
        hidden = kwargs["hidden_states"]
        return args, {**kwargs, "hidden_states": hidden + addition.to(hidden.device, hidden.dtype)}

    handle = layer_module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _greedy(native: Any, tokens: Tensor, steps: int, use_cache: bool) -> tuple[list[int], Tensor]:
    """Greedy decoding on the plain Hugging Face model: the chosen ids and the logits they came from."""
    chosen: list[int] = []
    rows: list[Tensor] = []
    sequence, past = tokens[None], None
    with torch.no_grad():
        for _ in range(steps):
            if use_cache:
                step_input = sequence if past is None else sequence[:, -1:]
                out = native(input_ids=step_input, past_key_values=past, use_cache=True)
                past = out.past_key_values
            else:
                out = native(input_ids=sequence, use_cache=False)
            logits = out.logits[0, -1].cpu()
            rows.append(logits)
            chosen.append(int(logits.argmax()))
            sequence = torch.cat([sequence, torch.tensor([[chosen[-1]]], device=sequence.device)], dim=1)
    return chosen, torch.stack(rows)


@checked
def steer(
    model: Model,
    prompt: Prompts,
    vector: Tensor,
    layer: int,
    alpha: float = 1.0,
    max_new_tokens: int = 20,
    *,
    use_cache: bool = True,
) -> SteeringResult:
    """Generate greedily from ``prompt`` with ``alpha * vector`` added to ``resid_pre`` of ``layer`` everywhere.

    Args:
        model: a bridge from :func:`interp.load_model`: the reference, a quantized copy
            (:func:`interp.quantize`) or any checkpoint it loads (a ``.gguf`` file included).
        prompt: one prompt (a string, or one row of token ids).
        vector: ``[d_model]``, e.g. from :func:`steering_vector`.
        layer: the block whose input is steered.
        alpha: the vector's multiplier (``0`` generates unsteered).
        max_new_tokens: tokens generated.
        use_cache: use the KV cache (the logits are the same without it, to rounding).

    Returns:
        A :class:`~interp.localize.steering.SteeringResult`.

    Example:
        >>> import interp, torch
        >>> model = interp.tiny_model("llama")
        >>> plain = interp.steer(model, "ab", torch.zeros(64), layer=0, max_new_tokens=2)
        >>> bool(torch.equal(plain.logits[0], model(plain.prompt_tokens[None])[0, -1]))  # a zero vector changes nothing
        True
    """
    steps = count(max_new_tokens, "max_new_tokens")
    (chosen_layer,) = hk.check_layers(model, [layer])
    tokens = one_prompt(model, prompt).to(device_of(model))
    addition = (float(alpha) * _vector(model, vector)).to(tokens.device)  # once, not at every generated token
    check_context(model, torch.zeros(1, len(tokens) + steps, dtype=torch.long, device=tokens.device))
    native = hk.native_model(model)
    block = follow(native, model.info.layers_path)[chosen_layer]
    with _adding(block, addition):
        new, logits = _greedy(native, tokens, steps, use_cache)
    settings = {"model": model_name(model), "layer": chosen_layer, "alpha": float(alpha),
                "vector_norm": float(vector.norm()), "use_cache": use_cache, "decoding": "greedy"}
    return SteeringResult(prompt_tokens=tokens.cpu(), new_tokens=new, logits=logits,
                          text=model.tokenizer.decode(new), settings=settings)


@checked
def steering_vector(model: Model, positive: Prompts, negative: Prompts, layer: int) -> Tensor:
    """``resid_pre[layer](positive) - resid_pre[layer](negative)`` at each prompt's last token (a string each,
    or one row of ids): the contrast ActAdd adds.

    Example:
        >>> import interp
        >>> v = steering_vector(interp.tiny_model("llama"), "love", "hate", layer=1)
        >>> tuple(v.shape)
        (64,)
    """
    (chosen,) = hk.check_layers(model, [layer])
    pair = [one_prompt(model, prompt) for prompt in (positive, negative)]
    if torch.equal(pair[0], pair[1]):  # a degenerate question, refused before the model runs
        raise InterpError("positive and negative are the same tokens, so the steering vector would be zero: "
                          "pass two prompts that differ in what the vector should add.")
    ends = []
    for tokens in pair:
        tokens = tokens.to(device_of(model))
        with torch.no_grad():
            store, _ = capture(model, tokens[None], [("resid_pre", chosen)])
        ends.append(store[("resid_pre", chosen)][0, -1].cpu())
    return check_values(ends[0] - ends[1], "The steering vector")  # a finite vector, or refused (interp.results)
