"""Batching and the checks every model run makes first: context length, token ids, tokenizer,
memory; and the progress-bar rule.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from interp.data import Examples, tokenizer_fingerprint
from interp.errors import DataError, InterpError, NonFiniteError, ResourceError
from interp.models import Model
from interp.runtime.placement import execution_device


class StopForward(Exception):
    """Raised by the last needed hook so the rest of the forward (and the unembed) is skipped."""


def check_context(model: Model, tokens: torch.Tensor) -> None:
    """Token rows fit the model: at least one, at most its context long, and every id inside its vocabulary."""
    if tokens.ndim == 2 and tokens.shape[0] == 0:  # else an empty result, or a reshape error deep in a forward
        raise DataError("There are no examples (0 rows): pass at least one row of tokens.")
    n_ctx = getattr(getattr(model, "info", None), "n_ctx", None) or int(model.cfg.n_ctx)
    if tokens.shape[-1] > n_ctx:
        raise InterpError(
            f"Sequences of {tokens.shape[-1]} tokens exceed this model's context of {n_ctx}. Lower seq_len."
        )
    check_token_ids(model, tokens)


def model_vocab_size(model: Model) -> int:
    """Rows of the model's input embedding: token ids must lie in ``[0, vocab)``."""
    original = getattr(model, "original_model", model)
    embedding = original.get_input_embeddings() if hasattr(original, "get_input_embeddings") else None
    if embedding is not None and hasattr(embedding, "num_embeddings"):
        return int(embedding.num_embeddings)
    return int(model.cfg.d_vocab)


def check_token_ids(model: Model, tokens: torch.Tensor) -> None:
    if tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise DataError(f"Token ids must be integers, got a {tokens.dtype} tensor.")
    if tokens.ndim != 2 or tokens.shape[-1] < 2:
        raise DataError(f"Token rows must be [N, T] with T >= 2 (BOS + a token to predict); got shape "
                        f"{tuple(tokens.shape)}.")
    if tokens.numel() == 0:
        return
    vocab = model_vocab_size(model)
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise DataError(f"Token id {bad} is outside this model's vocabulary [0, {vocab}). The rows were made by "
                        "another tokenizer or edited by hand: tokenize with this model's tokenizer "
                        "(interp.load_examples(source, model.tokenizer, ...)).")


def check_examples(model: Model, examples: Examples) -> None:
    """Examples fit the model: context, token id range, and (when known) the same tokenizer.

    Call it at every entry point that runs a model on examples (nll, probe, patching, score).
    """
    if not isinstance(examples, Examples):
        raise DataError(f"Expected interp Examples (interp.load_examples, interp.examples_from_texts or "
                        f"Examples.from_tokens), got {type(examples).__name__}.")
    check_context(model, examples.tokens)
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None or not (examples.tokenizer or examples.vocab_size):
        return  # rows from Examples.from_tokens: only the id range can be checked

    if examples.vocab_size and examples.vocab_size != len(tokenizer):
        raise DataError(f"These examples were tokenized with a vocabulary of {examples.vocab_size} tokens, but the "
                        f"model's tokenizer has {len(tokenizer)}. Load them with this model's tokenizer.")
    if examples.tokenizer and examples.tokenizer != tokenizer_fingerprint(tokenizer):
        raise DataError(f"These examples were tokenized by another tokenizer (fingerprint {examples.tokenizer}, "
                        f"model's {tokenizer_fingerprint(tokenizer)}): their ids mean other tokens to this model. "
                        "Load them with interp.load_examples(source, model.tokenizer, ...).")


def non_finite_weights(model: Model) -> list[str]:
    """Names of the model's parameters that hold NaN or inf (the bridge's wrapper names left out)."""
    module = getattr(model, "original_model", model)
    named = module.named_parameters() if isinstance(module, torch.nn.Module) else ()
    # an offloaded weight (device_map) is a meta placeholder here: reading it would load the whole model
    return [name.replace("._original_component", "") for name, weight in named
            if not weight.is_meta and not _all_finite(weight)]


_FINITE_CHUNK = 1 << 22  # values checked at once: isfinite of a bfloat16 weight makes float32 and bool temporaries


def _all_finite(weight: torch.Tensor) -> bool:
    """``torch.isfinite(weight).all()``, 4M values at a time: on the whole of a 1B model's bfloat16 embedding the
    temporaries took 0.47 GiB, the peak of ``interp circuit``; in slices they take a few MiB."""
    flat = weight.detach().reshape(-1)
    return all(bool(torch.isfinite(flat[i : i + _FINITE_CHUNK]).all()) for i in range(0, flat.numel(), _FINITE_CHUNK))


def listed(names: list[str], most: int = 3) -> str:
    """``a, b, c and 4 more``."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def check_finite_weights(model: Model, what: str) -> None:
    """Refuse a model with NaN/inf weights before a run whose output may not show them: a hooked forward
    does not always carry a NaN to its output (a NaN in one query weight gave finite patching values)."""
    bad = non_finite_weights(model)
    if bad:
        raise NonFiniteError(f"The {what} has NaN/inf in its weights ({listed(bad)}), so any number computed "
                             "from it is meaningless. Reload or repair the model.")


def available_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def check_memory(n_bytes: int, what: str, fraction: float = 0.5) -> None:
    """Refuse a capture that would use more than ``fraction`` of available memory."""
    budget = available_memory_bytes() * fraction
    if n_bytes > budget:
        raise ResourceError(
            f"{what} would need {n_bytes / 2**30:.1f} GiB, over {fraction:.0%} of available memory "
            f"({budget / 2**30:.1f} GiB). Use a streaming reducer (norm, mean, entropy, ...) instead "
            "of 'full', lower n or seq_len, or raise memory_fraction."
        )


def batches(n: int, batch_size: int) -> Iterable[tuple[int, int]]:
    if batch_size < 1:
        raise InterpError(f"batch_size must be at least 1; got {batch_size}.")
    for start in range(0, n, batch_size):
        yield start, min(n, start + batch_size)


def show_progress(progress: bool | None) -> bool:
    """Whether a long run draws its ``tqdm.auto`` bar: ``progress`` when given, else on in a
    terminal and in Jupyter (where stderr is no terminal, but the bar is a widget).

    Example:
        >>> show_progress(False), show_progress(True)
        (False, True)
    """
    if progress is not None:
        return progress
    return sys.stderr.isatty() or in_notebook()


def in_notebook() -> bool:
    """True inside a running IPython kernel (Jupyter, VS Code notebooks); IPython is not imported here."""
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    if get_ipython is None:
        return False
    try:
        shell = get_ipython()
    except Exception:  # noqa: BLE001 - a half-initialised IPython: treat as no kernel
        return False
    return getattr(shell, "kernel", None) is not None


def device_of(model: Model) -> torch.device:
    """Where the model's inputs go: the device of a bridge's (or a plain module's) first parameter,
    or, for a model split with accelerate's ``device_map``, the execution device of its first
    module (whose weights may be offloaded); CPU when it has none."""
    placed = execution_device(model)
    if placed is not None:
        return placed
    try:
        return next(getattr(model, "original_model", model).parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def kernels(device: torch.device | str = "cpu") -> str:
    """Which kernels torch runs on ``device``: ``"cpu-AVX512"``, ``"cpu-AVX2"``, ``"cuda-sm90"``...

    Float32 results depend on it: the kernels add in a different order, and a computation that
    amplifies rounding (GPTQ's column-by-column error feedback) lands on different weights.
    ``ATEN_CPU_CAPABILITY=avx2`` selects the AVX2 kernels on any AVX-512 CPU.

    Example:
        >>> kernels("cpu").startswith("cpu-")
        True
    """
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda-sm{major}{minor}"
    if device.type == "cpu":
        return f"cpu-{torch.backends.cpu.get_cpu_capability()}"
    return device.type


def cpu_identity() -> str:
    """What :func:`kernels` leaves out: the CPU's model name and its AVX-512 and AMX feature flags.

    Two CPUs with the same kernels label can still add float32 sums in another order (math libraries
    may pick code paths by CPU model and features), and a GPTQ-3 model quantized from the same calibration sample on two
    AVX-512 machines differs (docs/reproduction.md, "One machine's verdict is not the verdict").
    A record of a long run names the CPU with this, beside the kernels.

    Example:
        >>> isinstance(cpu_identity(), str)
        True
    """
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown (no /proc/cpuinfo)"
    lines = info.splitlines()
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    wide = sorted(f for f in flags if f.startswith(("avx512", "amx")))
    return f"{name}; {' '.join(wide) if wide else 'no AVX-512 or AMX flags'}"


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block on ``n`` torch intra-op threads, then restore the caller's count (even on error).

    Example:
        >>> before = torch.get_num_threads()
        >>> with torch_threads(1):
        ...     torch.get_num_threads()
        1
        >>> torch.get_num_threads() == before
        True
    """
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
