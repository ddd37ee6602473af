"""Calibration text for the quantizers that need it, and each linear layer's inputs on it.

Calibrated methods (the registry records with ``needs_calibration``, see
:data:`interp.quant.spec.METHODS`) read each linear layer's inputs on calibration-split
examples, which :func:`interp.load_examples` keeps disjoint from the evaluation examples;
they are loaded only when a spec asks for them. :class:`LayerFeeder` and
:class:`PausedBlock` produce those inputs block by block for :func:`interp.quant.quantize`.

Example:
    >>> from interp.quant.calibration import needs_calibration
    >>> needs_calibration(["rtn:bits=3", "nf:bits=4"]), needs_calibration(["rtn:bits=3", "gptq:bits=3"])
    (False, True)
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from interp.data import Examples, counted_positions, left_aligned, load_examples
from interp.errors import ComponentError, InterpError
from interp.models import Model
from interp.quant.spec import MethodSpec, parse_spec
from interp.runtime import hooks
from interp.runtime.batching import batches

# The version of the calibration forwards (what LayerFeeder feeds each layer), part of a calibrated
# quantizer's cache key (interp.quant.apply.algorithm_version). 2: padded rows left-aligned and the
# block run with the model's own mask builder (the Gemma-3 feeder fix).
FEEDER_VERSION = 2


def needs_calibration(specs: Iterable[str | MethodSpec]) -> bool:
    """Whether any of ``specs`` names a method that needs calibration inputs."""
    return any(parse_spec(spec).needs_calibration for spec in specs)


def load_calibration(source: str | Path, tokenizer: Any, specs: Iterable[MethodSpec], n: int, seq_len: int,
                     seed: int = 0) -> Examples | None:
    """``n`` calibration-split examples of ``source`` when a spec (parsed, see :func:`~interp.quant.spec.parse_spec`)
    needs them, else None (nothing is read)."""
    if not any(spec.needs_calibration for spec in specs):
        return None
    return load_examples(source, tokenizer, n=n, seq_len=seq_len, seed=seed, split="calibration")


def calibration_from_settings(settings: Mapping[str, Any], tokenizer: Any,
                              specs: Iterable[str | MethodSpec]) -> Examples | None:
    """The calibration set a ``score`` folder's ``settings.json`` records, when a spec needs it (else None)."""
    recorded = settings.get("calibration")
    if not recorded:
        return None
    parsed = [parse_spec(spec) for spec in specs]  # this function's callers pass the specs a folder records
    return load_calibration(recorded["source"], tokenizer, parsed, n=recorded["n"], seq_len=recorded["seq_len"],
                            seed=recorded["seed"])


# ---------------------------------------------------------------------------------------
# The inputs of each linear layer on the calibration text, block by block


class _Stop(Exception):
    """Raised from a hook once the activation it wants is captured: the rest is skipped."""


class LayerFeeder:
    """Calibration activations entering one block at a time, for sequential quantization.

    Holds, per calibration batch, the hidden states entering the current block and the
    keyword arguments the model passes to that block (causal mask, rotary embeddings).
    Those are captured from the first block of each layer type (``config.layer_types``:
    Gemma-2 alternates sliding-window and full attention, Gemma-3 also keeps rotary
    embeddings per type), so each block is run with its own mask; a model without layer
    types passes every block the first block's. ``inputs`` and :meth:`advance` re-run
    the block from its start for each group of linear layers (the reference scheme);
    :meth:`paused` runs it once, pausing at each group (:class:`PausedBlock`).

    Padded calibration rows (``mask``: the examples' attention mask, True at real tokens)
    are left-aligned batch by batch and cut to the batch's longest row: under the causal
    mask their real tokens come first, keep their positions and never see the padding
    behind them, so each real position gets the activations it has with its row alone.
    ``keeps`` records, per batch, the real positions (None: all of them); the linear
    inputs are read at those positions only, so no pad position enters a statistic and
    every token count is a count of real tokens. Without a mask nothing changes.
    """

    def __init__(self, model: Model, tokens: torch.Tensor, batch_size: int,
                 mask: torch.Tensor | None = None) -> None:
        self.model = model
        self.block_list = hooks.blocks(model)
        # whether a PausedBlock gives the re-run's inputs on this model: decided on the first block
        self.pauses: bool | None = None
        self.states: list[tuple[torch.Tensor, dict[str, Any]]] = []
        # per batch: [B, T] bool, the real (counted) positions of the left-aligned rows; None: every position
        self.keeps: list[torch.Tensor | None] = []
        # each block's layer type, and per batch the keyword arguments of each type's blocks
        self.kinds = _layer_kinds(model, len(self.block_list))
        self._kwargs: list[dict[str, dict[str, Any]]] = []
        firsts: dict[str, int] = {}
        for index, kind in enumerate(self.kinds):
            firsts.setdefault(kind, index)
        last = max(firsts.values())
        device = next(model.original_model.parameters()).device
        captured: dict[str, Any] = {}

        def catcher(index: int) -> Any:
            def catch(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                if index == 0:
                    captured["hidden"] = (args[0] if args else kwargs["hidden_states"]).detach()
                rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                rest.update(past_key_values=None, use_cache=False)
                captured.setdefault("kwargs", {})[self.kinds[index]] = rest
                if index == last:
                    raise _Stop

            return catch

        handles = [self.block_list[index].register_forward_pre_hook(catcher(index), with_kwargs=True)
                   for index in sorted(firsts.values())]
        try:
            with torch.no_grad():
                for start, end in batches(len(tokens), batch_size):
                    rows, keep = _aligned(tokens[start:end], None if mask is None else mask[start:end])
                    try:
                        model.original_model(input_ids=rows.to(device), use_cache=False)
                    except _Stop:
                        pass
                    by_kind = captured.pop("kwargs")
                    self._kwargs.append(by_kind)
                    self.states.append((captured.pop("hidden"), by_kind[self.kinds[0]]))
                    self.keeps.append(keep)
        finally:
            for handle in handles:
                handle.remove()

    def inputs(self, layer: int, role: str) -> torch.Tensor:
        """``[n_tokens, d_in]``: the input of linear ``role`` of block ``layer`` on all calibration tokens."""
        name = hooks.linear_input_hook(self.model, layer, role)
        chunks: list[torch.Tensor] = []

        batch: dict[str, torch.Tensor | None] = {}

        def grab(x: torch.Tensor, hook: Any) -> None:
            chunks.append(_rows(x, batch["keep"]))
            raise _Stop

        with torch.no_grad(), self.model.hooks(fwd_hooks=[(name, grab)]):
            for (hidden, kwargs), keep in zip(self.states, self.keeps, strict=True):
                batch["keep"] = keep
                try:
                    self.block_list[layer](hidden, **kwargs)
                except _Stop:
                    pass
        return torch.cat(chunks)

    def outputs(self, layer: int) -> list[torch.Tensor]:
        """Block ``layer`` run on the states entering it, one output per batch."""
        with torch.no_grad():
            return [_hidden(self.block_list[layer](hidden, **kwargs)) for hidden, kwargs in self.states]

    def advance(self, layer: int, outputs: list[torch.Tensor] | None = None) -> None:
        """Move the states to the input of block ``layer + 1``: ``outputs`` of block ``layer``, or run it now."""
        outputs = self.outputs(layer) if outputs is None else outputs
        kind = self.kinds[min(layer + 1, len(self.kinds) - 1)]
        self.states = [(out, by_kind[kind]) for out, by_kind in zip(outputs, self._kwargs, strict=True)]

    def paused(self, layer: int, groups: Sequence[Sequence[str]]) -> PausedBlock:
        return PausedBlock(self, layer, groups)


def _layer_kinds(model: Model, n_layers: int) -> list[str]:
    """Each block's layer type from the model's config (``layer_types``); one type for all when it has none."""
    config = model.original_model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = getattr(config, "layer_types", None)
    if not isinstance(kinds, (list, tuple)) or len(kinds) != n_layers:
        return ["all"] * n_layers
    return [str(kind) for kind in kinds]


def _aligned(tokens: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rows, keep)``: a batch as the block forwards see it, and its real positions (None: all).

    Unpadded rows go as they are. Padded rows are left-aligned (:func:`interp.data.left_aligned`)
    and cut to the longest row; ``keep[b, t]`` is ``t < length[b]``.
    """
    if mask is None or bool(mask.all()):
        return tokens, None
    rows, lengths = left_aligned(tokens, mask.to(tokens.device))
    width = int(lengths.max())
    rows = rows[:, :width]
    keep = counted_positions(lengths, width, skip_first=False)
    return rows, None if bool(keep.all()) else keep


def _rows(x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """``[batch, pos, ..., d_in]`` -> float32 ``[n_tokens, d_in]`` on x's device: every position, or those ``keep``
    marks.

    The rows stay where the block computed them, so the quantizers' statistics (``X^T X``,
    ``mean |x|``) are formed there too (on the GPU for a model on a GPU).

    ``keep`` (``[batch, pos]`` bool) drops the pad positions of left-aligned padded rows
    before anything is accumulated, so ``n_tokens`` counts real tokens only.
    """
    x = x.detach()
    if keep is None:
        return x.reshape(x.shape[0] * x.shape[1], -1).float()
    real = x[keep.to(x.device)]  # [n_real, ..., d_in], rows in (batch, position) order
    return real.reshape(real.shape[0], -1).float()


def _hidden(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


class _Abort(Exception):
    """Raised inside a paused forward when the quantization stopped: its thread unwinds and ends."""


class OutOfOrder(InterpError):
    """The block reached the groups' input hooks in another order than expected, or not at all."""


@dataclass
class _Run:
    """One batch's forward through the block, in its own thread."""

    hidden: torch.Tensor
    kwargs: dict[str, Any]
    keep: torch.Tensor | None = None  # the batch's real positions (None: all), see LayerFeeder
    arrived: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    resume: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    thread: threading.Thread | None = None
    next_group: int = 0
    captured: torch.Tensor | None = None
    output: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


class PausedBlock:
    """Block ``layer``'s forward on every calibration batch, run once, pausing at each group's input.

    Sequential quantization needs each group's input (q/k/v, o, gate/up, down) as the block
    produces it with the groups before it already quantized. :meth:`LayerFeeder.inputs`
    gets it by re-running the block from its start after each group: about 2.3 block
    forwards per block. Here each batch's forward runs in a thread of its own and waits at
    the group's input hook while the caller quantizes the group and writes its weights,
    then goes on with them: one forward, and the same operations on the same values, so
    the same tensors to the bit, provided the block reads each group's input hook before
    it computes any of the group's linear layers. :func:`interp.quant.quantize` checks
    that on the first block against :meth:`LayerFeeder.inputs` before relying on it.

    The threads take turns (the caller starts or resumes one and waits until it pauses),
    so only one runs at any time. Use it as a context manager: leaving it ends the threads.
    """

    def __init__(self, feeder: LayerFeeder, layer: int, groups: Sequence[Sequence[str]]) -> None:
        self.feeder, self.layer = feeder, layer
        self.groups = [list(g) for g in groups]
        self.runs = [_Run(hidden, kwargs, keep) for (hidden, kwargs), keep in zip(feeder.states, feeder.keeps,
                                                                                   strict=True)]
        self.aborted = False
        self._local = threading.local()
        hooks_by_name: dict[str, int] = {}
        for index, roles in enumerate(self.groups):
            for role in roles:
                try:
                    hooks_by_name.setdefault(hooks.linear_input_hook(feeder.model, layer, role), index)
                except ComponentError:
                    if role == roles[0]:
                        raise
        self._hooks = [(name, self._pause_at(index)) for name, index in hooks_by_name.items()]
        self._context: Any = None

    def __enter__(self) -> PausedBlock:
        self._context = self.feeder.model.hooks(fwd_hooks=self._hooks)
        self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.aborted = True
            for run in self.runs:
                if run.thread is not None and not run.done:
                    run.resume.release()
                    run.thread.join()
        finally:
            self._context.__exit__(*exc)

    def _pause_at(self, group: int) -> Any:
        def pause(x: torch.Tensor, hook: Any) -> None:
            run: _Run = self._local.run
            if group < run.next_group:
                return  # another layer of a group already captured: the same input
            if group != run.next_group:
                raise OutOfOrder(f"block {self.layer} reached the input of {self.groups[group]} before that of "
                                  f"{self.groups[run.next_group]}")
            run.captured, run.next_group = x.detach(), group + 1
            run.arrived.release()
            run.resume.acquire()
            if self.aborted:
                raise _Abort

        return pause

    def _body(self, run: _Run, threads: int) -> None:
        self._local.run = run
        # the caller's intra-op thread count: a new thread starts with the library default (all cores
        # for MKL), and a float reduction split over another number of threads rounds differently,
        # so the first block's bit-for-bit check against the re-run would fail and turn the fast path off
        torch.set_num_threads(threads)
        try:
            with torch.no_grad():
                run.output = _hidden(self.feeder.block_list[self.layer](run.hidden, **run.kwargs))
        except _Abort:
            pass
        except BaseException as exc:  # handed to the caller's thread
            run.error = exc
        finally:
            run.done = True
            run.arrived.release()

    def _step(self, run: _Run) -> None:
        """Start or resume ``run`` and wait until it pauses or ends."""
        if run.thread is None:
            run.thread = threading.Thread(target=self._body, args=(run, torch.get_num_threads()), daemon=True,
                                          name=f"calibration-block{self.layer}")
            run.thread.start()
        else:
            run.resume.release()
        run.arrived.acquire()
        if run.error is not None:
            raise run.error

    def inputs(self, group: int) -> torch.Tensor:
        """``[n_tokens, d_in]``: the input of group ``group`` (the groups in order, each once)."""
        chunks = []
        for run in self.runs:
            self._step(run)
            if run.done or run.next_group != group + 1 or run.captured is None:
                raise OutOfOrder(f"block {self.layer} did not reach the input of {self.groups[group]} in order")
            chunks.append(_rows(run.captured, run.keep))
            run.captured = None
        return torch.cat(chunks)

    def outputs(self) -> list[torch.Tensor]:
        """Let every forward finish (all groups quantized); the block's output per batch."""
        outputs = []
        for run in self.runs:
            self._step(run)
            if not run.done or run.output is None:
                raise OutOfOrder(f"block {self.layer} paused at an input after its last group")
            assert run.thread is not None
            run.thread.join()
            outputs.append(run.output)
        return outputs
