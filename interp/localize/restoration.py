"""Layer restoration: put reference weights back into chosen blocks of a quantized model; what does it recover?

:func:`restore_layers` copies the reference weights back into chosen blocks of a quantized
model (on a deep copy). :func:`restoration_sweep` restores the top ``k`` blocks for growing
``k`` and measures perplexity on D_large. The paper's result is that restoring the top 7 of
40 layers barely helps (8.67 -> 8.05, reference 5.60): the damage is not local to the
layers where the curves split. The sweep reuses the quantized model's unrestored prefix:
the residual entering the lowest restored block is computed once per batch, and only the
blocks above it are run for each ``k``.

Example:
    >>> import interp, torch
    >>> from interp.localize.restoration import restoration_sweep
    >>> from interp.quant.apply import quantize
    >>> reference = interp.tiny_model("llama")
    >>> quantized = quantize(reference, "rtn:bits=3,group=64", progress=False)
    >>> ex = interp.Examples.from_tokens(torch.randint(0, 256, (2, 8)))
    >>> sweep = restoration_sweep(quantized, reference, ex)
    >>> sweep.table()["restored"].tolist()  # the top k blocks, for k = 0, 1, 2
    ['', '1', '0-1']
    >>> bool(abs(sweep.nll[-1] - sweep.reference_nll).max() < 1e-5)  # every block restored: the reference
    True
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from interp import validate
from interp.data import Examples
from interp.display import ResultDisplay
from interp.errors import ComponentError, InterpError
from interp.io import saving, write_csv
from interp.models import Model, copy_model
from interp.results import CheckedResult
from interp.runtime import hooks as hk
from interp.runtime import placement
from interp.runtime.batching import batches, check_context, device_of, show_progress
from interp.runtime.capture import capture
from interp.runtime.decoder import DecoderRunner
from interp.runtime.readout import Readout
from interp.runtime.scoring import nll
from interp.runtime.swap import BlockWeights, WeightStash, is_block_weights, swapped, write_block
from interp.typing import PerExample


def _block_pairs(restored: Any, reference: Model, layer: int) -> list[tuple[Tensor, Tensor]]:
    """Every parameter of block ``layer`` in both models, paired by name."""
    dst = dict(hk.blocks(restored)[layer].named_parameters())
    src = dict(hk.blocks(reference)[layer].named_parameters())
    if dst.keys() != src.keys() or any(dst[k].shape != src[k].shape for k in dst):
        raise ComponentError(f"Block {layer} of the two models differs in structure: they need the same architecture.")
    return [(dst[k], src[k]) for k in dst]


def _check_roles(quantized: Any, reference: Model, layers: Sequence[int], roles: Sequence[str]) -> list[str]:
    """``roles`` as a list, after checking each names a linear layer of both models' blocks ``layers``."""
    roles = list(roles)
    for layer in layers:
        dst, src = hk.linear_weights(quantized, layer), hk.linear_weights(reference, layer)
        unknown = sorted(set(roles) - set(dst))
        if unknown:
            raise ComponentError(f"Unknown linear roles {unknown}; this model has {sorted(dst)}.")
        for role in roles:
            if role not in src or src[role].read().shape != dst[role].read().shape:
                raise ComponentError(f"Block {layer} of the two models differs in structure ({role!r}): they need "
                                     "the same architecture.")
    return roles


def _rows_of(tensor: Tensor, rows: slice | Tensor | None) -> Tensor:
    """The output rows ``rows`` of a bias (``[out]``): all of it, a slice, or the listed ones."""
    if rows is None:
        return tensor
    if isinstance(rows, slice):
        return tensor[rows]
    return tensor.index_select(0, rows.to(tensor.device))


def _restore_role(restored: Any, reference: Model, layer: int, role: str) -> None:
    """Copy the reference's ``role`` rows (weight and bias) into ``restored``, fused weights and their mirrors alike.

    A role held in a fused weight (Phi-3's ``qkv_proj`` and ``gate_up_proj``, GPT-2's
    ``c_attn``, GPT-NeoX's ``query_key_value``) is a block of rows of it (see
    :func:`interp.runtime.hooks.linear_weights`): only those rows are written, in the fused
    weight and in the bridge's split copy of it, so the other roles keep their weights.
    """
    dst, src = hk.linear_weights(restored, layer)[role], hk.linear_weights(reference, layer)[role]
    dst.write(src.read().detach())
    source_bias = getattr(src.module, "bias", None)
    bias = getattr(dst.module, "bias", None)
    if not isinstance(source_bias, Tensor) or not isinstance(bias, Tensor):
        return
    value = _rows_of(source_bias.detach(), src.rows).to(bias.device, bias.dtype)
    hk.write_rows(bias, dst.rows, value)
    mirrors = {id(mirror) for mirror in dst.mirrors}
    for module in hk.blocks(restored)[layer].modules():  # the bridge's split copies carry a bias of their own
        split_bias = getattr(module, "bias", None)
        if id(getattr(module, "weight", None)) in mirrors and isinstance(split_bias, Tensor):
            split_bias.copy_(value.to(split_bias.device, split_bias.dtype))


def restore_layers(quantized: Any, reference: Model, layers: Sequence[int], roles: Sequence[str] | None = None) -> Any:
    """A copy of ``quantized`` whose blocks ``layers`` carry the reference's weights again.

    Args:
        quantized: the damaged model (not modified).
        reference: the model to take weights from (not modified); same architecture.
        layers: block indices to restore (negative indices count from the end).
        roles: restore only these linear layers (``"gate"``, ``"up"``, ``"q"``, ...), weight and
            bias; default: every parameter of the block. A role held in a fused weight (Phi-3's
            ``qkv_proj`` and ``gate_up_proj``, GPT-2's ``c_attn``, GPT-NeoX's ``query_key_value``)
            is its block of rows there: only those rows are restored, the other roles' rows keep
            the quantized weights.

    Returns:
        A deep copy of ``quantized`` with ``restored_layers`` / ``restored_roles`` attributes.

    Raises:
        ComponentError: models of different depth or structure, or a role the blocks do not have
            (checked before anything is copied).

    Example:
        >>> import interp, torch
        >>> from interp.quant.apply import quantize
        >>> from interp.runtime import hooks
        >>> reference = interp.tiny_model("gpt2")  # q, k and v fused in one Conv1D
        >>> quantized = quantize(reference, "rtn:bits=3,group=32", progress=False)
        >>> restored = restore_layers(quantized, reference, [0], roles=["q"])
        >>> same = {r: bool(torch.equal(s.read(), hooks.linear_weights(reference, 0)[r].read()))
        ...         for r, s in hooks.linear_weights(restored, 0).items() if r in "qkv"}
        >>> same
        {'q': True, 'k': False, 'v': False}
    """
    if hk.n_layers(quantized) != hk.n_layers(reference):
        raise ComponentError("restore_layers needs two models with the same number of layers.")
    layers = list(layers)
    layers = hk.check_layers(quantized, layers) if layers else []  # restoring no block is the quantized model
    checked = _check_roles(quantized, reference, layers, roles) if roles is not None else None
    placement.refuse_offloaded(quantized, "restore_layers()", "Pass the quantized weights alone to "
                               "restoration_sweep (interp.quant.inplace.SavedWeights): they are swapped in place.")
    restored = copy_model(quantized)
    with torch.no_grad():
        for layer in layers:
            if checked is None:
                for dst, src in _block_pairs(restored, reference, layer):
                    dst.copy_(src.to(dst.device, dst.dtype))
            else:
                for role in checked:
                    _restore_role(restored, reference, layer, role)
    object.__setattr__(restored, "restored_layers", sorted(layers))
    object.__setattr__(restored, "restored_roles", checked)
    return restored


@dataclass(frozen=True)
class RestorationResult(CheckedResult, ResultDisplay):
    """Perplexity on a set of examples with the top-k blocks restored, for each k.

    Attributes:
        ks: numbers of restored blocks.
        restored: the blocks restored for each k.
        nll: ``[len(ks), N]`` mean NLL per example (``ks[i] = 0`` is the quantized model).
        reference_nll: ``[N]`` the reference model's NLL.
        ids, settings: example ids and run settings.

    Made only finite: see :mod:`interp.results`.
    """

    ks: list[int]
    restored: list[list[int]]
    nll: Float[Tensor, "n_ks n_examples"]
    reference_nll: PerExample
    ids: list[str]
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if tuple(self.nll.shape) != (len(self.ks), len(self.ids)) or len(self.restored) != len(self.ks):
            raise InterpError(f"RestorationResult.nll has shape {tuple(self.nll.shape)}; expected "
                              f"[{len(self.ks)}, {len(self.ids)}].")
        super().__post_init__()  # finite (CheckedResult), after the shapes

    def perplexity(self) -> Float[Tensor, " n_ks"]:
        return torch.exp(self.nll.double().mean(dim=1))

    @property
    def reference_perplexity(self) -> float:
        return math.exp(float(self.reference_nll.double().mean()))

    def table(self) -> pd.DataFrame:
        """``k``, restored blocks, perplexity and recovery ``(ppl_q - ppl_k) / (ppl_q - ppl_ref)``."""
        ppl = self.perplexity().numpy()
        quantized = float(ppl[self.ks.index(0)]) if 0 in self.ks else math.nan
        denom = quantized - self.reference_perplexity
        return pd.DataFrame({
            "k": self.ks,
            "restored": [_span(layers) for layers in self.restored],
            "perplexity": ppl,
            "reference": self.reference_perplexity,
            "recovery": (quantized - ppl) / denom if denom else math.nan,
        })

    def save(self, folder: str | Path) -> Path:
        with saving(folder, "restoration", own=("restoration.csv",)) as out:  # INCOMPLETE until it is written
            write_csv(out / "restoration.csv", self.table(), index=False)
        return out


def _span(layers: Sequence[int]) -> str:
    """``[27, 28, 29]`` -> ``"27-29"``; non-contiguous sets are listed."""
    if not layers:
        return ""
    ordered = sorted(layers)
    if ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) > 1:
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))


def restoration_sweep(
    quantized: Any,
    reference: Model,
    examples: Examples,
    ks: Sequence[int] | None = None,
    order: Sequence[int] | None = None,
    batch_size: int = 8,
    progress: bool | None = None,
    stash: WeightStash | None = None,
) -> RestorationResult:
    """Perplexity with the reference weights restored in the top-k blocks, for each k.

    Args:
        quantized: the damaged model (not modified), or its block weights alone (a
            :class:`~interp.runtime.swap.BlockWeights` such as
            :class:`interp.quant.inplace.SavedWeights`): then they are swapped into
            ``reference`` block by block and no second copy of the model is held (see
            :mod:`interp.runtime.swap`; this also runs on a model split by a ``device_map``).
        reference: the model whose blocks are restored (not modified: bit-identical afterwards).
        examples: typically D_large.
        ks: numbers of blocks to restore (default ``0..n_layers``).
        order: the order in which blocks are restored (default: from the top down).
        batch_size: examples per forward.
        progress: show a progress bar.
        stash: with block weights as ``quantized``, the :class:`~interp.runtime.swap.WeightStash`
            that keeps the reference's own weights meanwhile. Give one to share it across calls
            (batches run one call each write every block to disk once, not once per call); by
            default each call makes its own in the system's temporary folder.

    Returns:
        A :class:`RestorationResult`; ``result.nll[i]`` equals
        ``interp.nll(restore_layers(quantized, reference, order[:ks[i]]), examples)``.
    """
    in_place = is_block_weights(quantized)
    model = reference if in_place else quantized
    n = hk.n_layers(model)
    order = hk.check_layers(model, order if order is not None else range(n - 1, -1, -1))
    ks = sorted({validate.integer(k, "ks") for k in (ks if ks is not None else range(n + 1))})
    if not ks:
        raise InterpError(f"ks is empty: give the numbers of blocks to restore, e.g. [0, 1, {len(order)}], or None "
                          f"for every k in 0..{len(order)}.")
    if ks[0] < 0 or ks[-1] > len(order):
        raise InterpError(f"ks must lie in 0..{len(order)}; got {ks}.")
    restored = [sorted(order[:k]) for k in ks]
    if in_place:
        values, reference_nll = _restored_nll_in_place(quantized, reference, examples, restored, batch_size, progress,
                                                       stash)
    else:
        values, reference_nll = restored_nll(quantized, reference, examples, restored, batch_size, progress)
    settings = {"order": order, "batch_size": batch_size, "examples": dict(examples.settings)}
    return RestorationResult(ks=ks, restored=restored, nll=values, reference_nll=reference_nll,
                             ids=list(examples.ids), settings=settings)


def _prefix(model: Model, runner: DecoderRunner, tokens: Tensor, starts: Sequence[int], verify: bool
            ) -> tuple[dict[Any, Tensor], Tensor]:
    """One forward of ``model``: the residuals entering blocks ``starts`` and the final hidden state.
    With ``verify`` (the first batch), also checks that the runner reproduces the model from a cached residual."""
    checks = [(c, layer) for layer in runner.check_layers() for c in ("resid_pre", "resid_post")]
    cache, final = capture(model, tokens, [("resid_pre", s) for s in starts] + (checks if verify else []))
    if verify and not runner.verify(cache):
        raise InterpError("Running decoder layers from a cached residual did not reproduce this model's forward; "
                          "use restore_layers() and interp.nll() instead.")
    return cache, final


def _restored_nll_in_place(quantized: BlockWeights, reference: Model, examples: Examples,
                           restored: Sequence[Sequence[int]], batch_size: int, progress: bool | None,
                           stash: WeightStash | None = None) -> tuple[Float[Tensor, "n_sets n_examples"], PerExample]:
    """:func:`restored_nll` with one copy of the weights.

    Per batch, the quantized weights go into every block and the residuals entering the lowest
    restored blocks are captured, as :func:`restored_nll` captures them from the quantized model;
    then for each set the reference's weights go back into its blocks (from the stash; only the
    blocks whose variant changes since the previous set are written) and the blocks from the
    set's lowest one up run on the cached residual. The same forwards on the same bits as the
    two-model path, so the same values; the reference runs last, with its own weights back.
    Architectures the decoder runner does not cover run each set as a full forward instead.
    """
    check_context(reference, examples.tokens)
    with contextlib.ExitStack() as scope:
        kept = stash if stash is not None else scope.enter_context(WeightStash(reference))
        runner = DecoderRunner.for_model(reference)
        if runner is None:
            return _restored_nll_full_forwards(quantized, reference, examples, restored, batch_size, progress, kept)
        readout, n = Readout(reference), hk.n_layers(reference)
        starts = sorted({min(s) for s in restored if s})
        device = device_of(reference)
        # on the model's device, to the host once at the end (not one copy per set and batch)
        out = torch.empty(len(restored), len(examples), dtype=torch.float64, device=device)
        reference_out = torch.empty(len(examples), dtype=torch.float64, device=device)
        bar = tqdm(total=len(examples), desc="restoration", unit="ex", disable=not show_progress(progress))
        with torch.no_grad():
            for start, end in batches(len(examples), batch_size):
                tokens = examples.tokens[start:end].to(device)
                with swapped(reference, quantized, stash=kept):
                    holds = ["quantized"] * n  # which variant each block carries now
                    cache, final = _prefix(reference, runner, tokens, starts, verify=start == 0)
                    for i, layers in enumerate(restored):
                        if not layers:
                            out[i, start:end] = readout.mean_nll(final, tokens)
                            continue
                        chosen, low = set(layers), min(layers)
                        for j in range(low, n):
                            want = "reference" if j in chosen else "quantized"
                            if holds[j] != want:
                                write_block(reference, j, kept.block(j) if want == "reference" else quantized.block(j))
                                holds[j] = want
                        final_i = runner.run(cache[("resid_pre", low)], low)
                        out[i, start:end] = readout.mean_nll(final_i, tokens)
                _, reference_final = capture(reference, tokens, [])
                reference_out[start:end] = readout.mean_nll(reference_final, tokens)
                bar.update(end - start)
        bar.close()
    return out.cpu(), reference_out.cpu()


def _restored_nll_full_forwards(quantized: BlockWeights, reference: Model, examples: Examples,
                                restored: Sequence[Sequence[int]], batch_size: int, progress: bool | None,
                                stash: WeightStash) -> tuple[Float[Tensor, "n_sets n_examples"], PerExample]:
    """One copy, without the decoder runner: for each set, the quantized weights go into the blocks
    outside it (the set keeps the reference's) and the whole model runs; the reference after."""
    n = hk.n_layers(reference)
    out = torch.empty(len(restored), len(examples), dtype=torch.float64)  # host: rows of nll(), a host result
    for i, layers in enumerate(restored):
        kept = set(layers)
        with swapped(reference, quantized, layers=[j for j in range(n) if j not in kept], stash=stash):
            out[i] = nll(reference, examples, batch_size, progress=progress)
    return out, nll(reference, examples, batch_size, progress=progress).double()


def restored_nll(
    quantized: Any,
    reference: Model,
    examples: Examples,
    restored: Sequence[Sequence[int]],
    batch_size: int = 8,
    progress: bool | None = None,
) -> tuple[Float[Tensor, "n_sets n_examples"], PerExample]:
    """NLL of ``quantized`` with the reference's blocks in place at each set of layers.

    The quantized model's residual entering the lowest restored block is computed once per
    batch; only the blocks above it run for each set. Returns ``(nll [n_sets, N], reference_nll [N])``.
    """
    check_context(quantized, examples.tokens)
    runner = DecoderRunner.for_model(quantized)
    if runner is None:
        per_set = [nll(restore_layers(quantized, reference, s), examples, batch_size) if s else
                   nll(quantized, examples, batch_size) for s in restored]
        return torch.stack(per_set).double(), nll(reference, examples, batch_size).double()
    readout, reference_readout = Readout(quantized), Readout(reference)
    q_blocks, r_blocks = hk.blocks(quantized), hk.blocks(reference)
    starts = sorted({min(s) for s in restored if s})
    device = device_of(quantized)
    # on the model's device, to the host once at the end (not one copy per set and batch)
    out = torch.empty(len(restored), len(examples), dtype=torch.float64, device=device)
    reference_out = torch.empty(len(examples), dtype=torch.float64, device=device)
    bar = tqdm(total=len(examples), desc="restoration", unit="ex", disable=not show_progress(progress))
    with torch.no_grad():
        for start, end in batches(len(examples), batch_size):
            tokens = examples.tokens[start:end].to(device)
            cache, final = _prefix(quantized, runner, tokens, starts, verify=start == 0)
            _, reference_final = capture(reference, tokens, [])
            reference_out[start:end] = reference_readout.mean_nll(reference_final, tokens)
            for i, layers in enumerate(restored):
                if layers:
                    chosen = set(layers)
                    modules = [r_blocks[j] if j in chosen else q_blocks[j] for j in range(len(q_blocks))]
                    final_i = runner.run(cache[("resid_pre", min(chosen))], min(chosen), modules)
                else:
                    final_i = final
                out[i, start:end] = readout.mean_nll(final_i, tokens)
            bar.update(end - start)
    bar.close()
    return out.cpu(), reference_out.cpu()
