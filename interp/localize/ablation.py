"""Ablation: knock a component out (zero, mean, or resample) and see what the model predicts without it.

Ablation replaces an activation by an uninformative value and runs the rest of the model as
usual. Three values are in common use:

- ``"zero"``: zero. Simple, but zero may be far from anything the model ever sees;
- ``"mean"``: its mean over a reference set (every real token of every reference row, BOS left
  out: the BOS residual is an outlier hundreds of times larger than the rest). The component
  then carries no information about *this* prompt but stays on-distribution;
- ``"resample"``: its value on another prompt, a reference row drawn at random (seeded) among
  those at least as long as the prompt, aligned at the last real token (Chan et al.'s causal
  scrubbing; resample ablation).

The selection is per layer (``layers=``), per head (``heads=``, for the per-head components
``z``/``head``, ``q``, ``k``, ``v``) and per position (``positions=``: non-negative from each
prompt's first real token, negative from its last); everything selected is ablated together in
one run. The value written is what the component's hook point carries: for ``gate`` that is
the gate's pre-activation (SiLU(0) = 0, so a zeroed gate is a closed gate).

The result holds the next-token logits at each prompt's last real token, ablated and clean, so
any metric can be read from it; with ``answer=``/``wrong=`` it also reports the logit difference.

Example:
    >>> import interp
    >>> model = interp.tiny_model("llama")
    >>> res = interp.ablate(model, ["hello there", "good night"], "z", "mean", layers=[1], heads=[0])
    >>> tuple(res.logits.shape)  # [prompts, vocab] at each prompt's last token
    (2, 259)
    >>> bool(res.kl().min() >= 0) and bool((res.logits != res.clean_logits).any())
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from interp.data import Examples, aligned_rows, real_lengths
from interp.display import ResultDisplay
from interp.errors import ComponentError, DataError, InterpError
from interp.localize.patching.patches import PATCHABLE
from interp.localize.prompts import Answers, Prompts, answer_ids, as_examples
from interp.models import Model, model_name
from interp.results import CheckedResult, distinct_answers
from interp.runtime import hooks as hk
from interp.runtime.batching import batches, device_of
from interp.runtime.readout import Readout
from interp.typing import Key
from interp.validate import checked

How = Literal["zero", "mean", "resample"]
HOWS = ("zero", "mean", "resample")


@dataclass(frozen=True)
class AblationResult(CheckedResult, ResultDisplay):
    """Next-token logits at each prompt's last real token, with the ablation and without.

    Attributes:
        logits: ``[N, vocab]`` with the component ablated.
        clean_logits: ``[N, vocab]`` without.
        ids: the prompts' ids.
        answers, wrongs: ``[N]`` token ids when given (then :meth:`logit_diff` reads them).
        settings: component, how, layers, heads, positions, the resample rows and seed.

    Made only finite: see :mod:`interp.results`.
    """

    # the clean model's ranking is read (the "top clean" column); an ablation may legitimately leave equal
    # logits (zeroing the last residual of a model without a bias), so the ablated ones are not ranked
    ranked = ("clean_logits",)

    logits: Float[Tensor, "n vocab"]
    clean_logits: Float[Tensor, "n vocab"]
    ids: list[str]
    answers: Tensor | None = None
    wrongs: Tensor | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    def kl(self) -> Float[Tensor, " n"]:
        """KL(clean || ablated) of the next-token distributions, per prompt (nats, float64)."""
        clean = torch.log_softmax(self.clean_logits.double(), dim=-1)
        ablated = torch.log_softmax(self.logits.double(), dim=-1)
        return (clean.exp() * (clean - ablated)).sum(dim=-1)

    def logit_diff(self) -> tuple[Float[Tensor, " n"], Float[Tensor, " n"]]:
        """``logit(answer) - logit(wrong)`` per prompt: ``(clean, ablated)``; needs ``answer=`` and ``wrong=``."""
        if self.answers is None or self.wrongs is None:
            raise InterpError("This ablation was run without answer= and wrong=: pass both to read a logit difference.")
        rows = torch.arange(len(self.ids), device=self.clean_logits.device)

        def diff(logits: Tensor) -> Tensor:
            return (logits[rows, self.answers] - logits[rows, self.wrongs]).double()

        return diff(self.clean_logits), diff(self.logits)

    def table(self) -> pd.DataFrame:
        """One row per prompt: KL, top token clean and ablated, and the logit differences when known."""
        frame = pd.DataFrame({"prompt": self.ids, "kl": self.kl().numpy(),
                              "top clean": self.clean_logits.argmax(-1).numpy(),
                              "top ablated": self.logits.argmax(-1).numpy()})
        if self.answers is not None and self.wrongs is not None:
            clean, ablated = self.logit_diff()
            frame["logit diff clean"], frame["logit diff ablated"] = clean.numpy(), ablated.numpy()
        return frame


def _checked(model: Model, component: str, how: str, layers: Sequence[int] | int | None,
             heads: Sequence[int] | None) -> tuple[list[int], list[int] | None]:
    if how not in HOWS:
        raise InterpError(f"how must be one of {', '.join(HOWS)}; got {how!r}.")
    if component not in PATCHABLE:
        raise ComponentError(f"Cannot ablate {component!r}. Components that can be ablated: {', '.join(PATCHABLE)}.")
    chosen = hk.check_layers(model, [layers] if isinstance(layers, int) else layers)
    for layer in chosen:
        hk.hook_point(model, component, layer)  # a ComponentError naming what the model has
    if heads is None:
        return chosen, None
    rec = hk.record(component)
    if not rec.per_head:
        raise ComponentError(f"heads= applies to the per-head components ({', '.join(sorted(hk.PER_HEAD))}) only, "
                             f"not {component!r}.")
    n = int(model.cfg.n_heads) if rec.per_head[0] == "head" else int(model.info.n_kv_heads or model.cfg.n_heads)
    picked = [heads] if isinstance(heads, int) else list(heads)
    if not picked or any(isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < n for h in picked):
        raise ComponentError(f"heads must be a non-empty list of integers in 0..{n - 1}; got {heads!r}.")
    return chosen, picked


def _position_mask(lengths: Tensor, width: int, positions: Sequence[int] | None, ids: Sequence[str]) -> Tensor:
    """``[B, width]``: the positions ablated in each left-aligned row of these real ``lengths``."""
    pos = torch.arange(width, device=lengths.device)
    if positions is None:
        return pos[None] < lengths[:, None]
    mask = torch.zeros(len(lengths), width, dtype=torch.bool, device=lengths.device)
    for q in positions:
        where = lengths + q if q < 0 else torch.full_like(lengths, q)
        bad = (where < 0) | (where >= lengths)
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise DataError(f"Position {q} is outside prompt {ids[row]!r} ({int(lengths[row])} real tokens); count "
                            "from the end (-1 is the last token) or use positions every prompt has.")
        mask[torch.arange(len(lengths), device=lengths.device), where] = True
    return mask


def _mean(model: Model, reference: Examples, keys: list[Key], batch_size: int) -> dict[Key, Tensor]:
    """Each key's mean over every real token of the reference rows but BOS (float64 sums)."""
    from interp.runtime.capture import capture

    sums: dict[Key, Tensor] = {}
    count = 0
    for start, end in batches(len(reference), batch_size):
        tokens, lengths = aligned_rows(reference, start, end, device_of(model))
        if lengths is None:
            lengths = torch.full((end - start,), tokens.shape[1], device=tokens.device)
        keep = torch.arange(tokens.shape[1], device=tokens.device)[None] < lengths[:, None]
        keep[:, 0] = lengths <= 1  # BOS out (a one-token row keeps it: it has nothing else)
        with torch.no_grad():
            store, _ = capture(model, tokens, keys)
        for key in keys:
            x = store[key]
            total = x[keep.to(x.device)].double().sum(dim=0)  # a no-op move unless a device_map splits the model
            sums[key] = total if key not in sums else sums[key] + total
        count += int(keep.sum())
    return {key: (total / count) for key, total in sums.items()}


def _resample_rows(lengths: Tensor, reference_lengths: Tensor, seed: int, ids: Sequence[str], itself: bool) -> Tensor:
    """For each prompt, a reference row at least as long, drawn with a seeded generator (``itself``: the
    reference is the prompts, and a prompt other than the row's own is drawn where there is one)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i, length in enumerate(lengths.tolist()):
        fits = reference_lengths >= length
        if itself and bool(fits[i]) and int(fits.sum()) == 1:  # it could only draw its own activation: no ablation
            raise DataError(f"Resample ablation of prompt {ids[i]!r} ({length} tokens) can only draw the prompt itself "
                            "(no other prompt is as long), so nothing would be ablated. Pass more prompts of at "
                            "least that length, or a reference= set of them.")
        if itself:
            fits[i] = False
        eligible = fits.nonzero().flatten()
        if len(eligible) == 0:
            raise DataError(f"Resample ablation needs a reference row at least as long as prompt {ids[i]!r} "
                            f"({length} tokens); the longest has {int(reference_lengths.max())}. Pass a reference "
                            "set of longer (or equally long) prompts.")
        # host: a draw from the seeded CPU generator, the same rows on every device
        rows.append(int(eligible[torch.randint(len(eligible), (1,), generator=generator)]))
    return torch.tensor(rows, dtype=torch.long)  # host: row indices into the host-side reference examples


def _resampled(model: Model, reference: Examples, rows: Tensor, lengths: Tensor, width: int,
               keys: list[Key]) -> dict[Key, Tensor]:
    """The reference rows' activations moved to the prompts' positions (aligned at the last real token)."""
    from interp.runtime.capture import capture

    picked = reference.subset(rows)
    tokens, ref_lengths = aligned_rows(picked, 0, len(picked), device_of(model))
    if ref_lengths is None:
        ref_lengths = torch.full((len(picked),), tokens.shape[1], device=tokens.device)
    with torch.no_grad():
        store, _ = capture(model, tokens, keys)
    shift = ref_lengths - lengths.to(tokens.device)
    index = (torch.arange(width, device=tokens.device)[None] + shift[:, None]).clamp(0, tokens.shape[1] - 1)
    rows_at = torch.arange(len(rows), device=tokens.device)[:, None]
    # the activations stay where the model made them (moved only between the devices of a device_map)
    return {key: x[rows_at.to(x.device), index.to(x.device)] for key, x in store.items()}


def _writer(value: Callable[[Tensor], Tensor], mask: Tensor, heads: list[int] | None
            ) -> Callable[[Tensor, Any], Tensor]:
    def write(x: Tensor, hook: Any) -> Tensor:
        new = value(x).to(x.device, x.dtype).expand_as(x)
        where = mask.to(x.device)
        where = where.reshape(*where.shape, *([1] * (x.ndim - 2)))
        if heads is not None:
            chosen = torch.zeros(x.shape[2], dtype=torch.bool, device=x.device)
            chosen[heads] = True
            where = where & chosen.reshape(1, 1, -1, *([1] * (x.ndim - 3)))
        return torch.where(where, new, x)
    return write


def _last_logits(model: Model, readout: Readout, tokens: Tensor, lengths: Tensor,
                 hooks: list[tuple[str, Callable[..., Any]]]) -> Tensor:
    """Logits at each row's last real token, from one forward with ``hooks``."""
    final: dict[str, Tensor] = {}

    def keep(x: Tensor, hook: Any) -> None:
        final["resid"] = x

    last = hk.hook_point(model, "resid_post", hk.n_layers(model) - 1)
    with torch.no_grad():
        with model.hooks(fwd_hooks=[*hooks, (last, keep)]):
            hk.decoder_body(model)(input_ids=tokens)
        rows = torch.arange(tokens.shape[0], device=final["resid"].device)
        return readout.logits(final["resid"][rows, lengths.to(rows.device) - 1]).cpu()


@checked(reference=lambda value, name, arguments: None)  # prompts, not a model: checked by as_examples
def ablate(
    model: Model,
    prompts: Prompts,
    component: str,
    how: How = "zero",
    *,
    layers: Sequence[int] | int | None = None,
    heads: Sequence[int] | int | None = None,
    positions: Sequence[int] | int | None = None,
    reference: Prompts | None = None,
    answer: Answers | None = None,
    wrong: Answers | None = None,
    seed: int = 0,
    batch_size: int = 8,
) -> AblationResult:
    """Ablate ``component`` (zero, mean or resample) at the selected layers, heads and positions.

    Args:
        model: a bridge from :func:`interp.load_model` (a quantized copy works the same).
        prompts: a string, a list of strings, token rows or Examples (padded rows are read as their
            real tokens alone).
        component: a patchable component name (``"z"`` for heads, ``"down"`` for the MLP output,
            ``"attn_out"``, ``"resid_pre"``...; see :mod:`interp.runtime.hooks`).
        how: ``"zero"``, ``"mean"`` (over ``reference``) or ``"resample"`` (from ``reference``).
        layers: the layers ablated (default: all), together.
        heads: for a per-head component, the heads ablated (default: all).
        positions: the positions ablated (default: every real position); negative counts from
            each prompt's last real token.
        reference: the prompts the mean is taken over or resampled from (default: ``prompts``; a
            resampled prompt then takes another prompt's activation where one is long enough).
        answer, wrong: optional answer tokens (strings or ids), one or one per prompt.
        seed: the resample draw's seed.
        batch_size: prompts per forward.

    Returns:
        An :class:`~interp.localize.ablation.AblationResult`.

    Example:
        >>> import interp
        >>> model = interp.tiny_model("llama")
        >>> res = interp.ablate(model, "the cat sat", "down", "zero", layers=[0], positions=[-1])
        >>> res.summary()[["prompt", "top clean"]].shape
        (1, 2)
    """
    chosen, picked = _checked(model, component, how, layers, heads)
    examples = as_examples(model, prompts)
    lengths = real_lengths(examples)
    pos = [positions] if isinstance(positions, int) else None if positions is None else list(positions)
    mask = _position_mask(lengths, examples.seq_len, pos, examples.ids)
    ref = examples if reference is None else as_examples(model, reference, "reference")
    answers = None if answer is None else answer_ids(model, answer, len(examples), "answer")
    wrongs = None if wrong is None else answer_ids(model, wrong, len(examples), "wrong")
    if answers is not None and wrongs is not None:
        distinct_answers(answers, wrongs, examples.ids)
    keys = [(component, layer) for layer in chosen]
    means = _mean(model, ref, keys, batch_size) if how == "mean" else {}
    rows = None
    if how == "resample":
        rows = _resample_rows(lengths, real_lengths(ref), seed, examples.ids, reference is None)
    readout, parts, clean_parts = Readout(model), [], []
    for start, end in batches(len(examples), batch_size):
        tokens, _ = aligned_rows(examples, start, end, device_of(model))
        # the position mask moves to the model once per batch, not in each layer's hook
        batch_lengths, batch_mask = lengths[start:end], mask[start:end, : tokens.shape[1]].to(tokens.device)
        if how == "resample":
            assert rows is not None
            source = _resampled(model, ref, rows[start:end], batch_lengths, tokens.shape[1], keys)
        hooks = []
        for key in keys:
            if how == "zero":
                value: Callable[[Tensor], Tensor] = torch.zeros_like
            elif how == "mean":
                value = (lambda m: lambda x: m)(means[key])
            else:
                value = (lambda s: lambda x: s)(source[key])
            hooks.append((hk.hook_point(model, *key), _writer(value, batch_mask, picked)))
        parts.append(_last_logits(model, readout, tokens, batch_lengths, hooks))
        clean_parts.append(_last_logits(model, readout, tokens, batch_lengths, []))
    settings = {"model": model_name(model), "component": component, "how": how, "layers": chosen, "heads": picked,
                "positions": pos, "reference": "prompts" if reference is None else f"{len(ref)} rows",
                "seed": seed, "resampled_rows": None if rows is None else rows.tolist()}
    return AblationResult(logits=torch.cat(parts), clean_logits=torch.cat(clean_parts), ids=list(examples.ids),
                          answers=answers, wrongs=wrongs, settings=settings)
