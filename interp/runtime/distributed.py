"""Whole batches over the ranks of a ``torchrun`` job, merged in example order: :func:`map_batches`.

``torchrun --nproc-per-node K`` (and ``--nnodes``, see docs/scaling.md) starts K copies of
a command; each reads its rank from the environment (:func:`world`). Every per-example
analysis in interp (probe statistics, attention metrics, early exit, restoration, patching)
computes each example's values from the one forward batch that example sits in, and reduces
over examples (means over N, perplexities, recoveries) only at the end. That makes an exact
split possible:

1. **The batches are the single-process run's batches.** ``batches(n, batch_size)`` cuts the
   examples into the same ``[start, end)`` blocks whatever the world size; rank ``r`` takes a
   contiguous run of them (:func:`shard_bounds`). A forward's floating-point result can depend
   on which rows share a batch (GEMM blocking), so no other cut is used.
2. **Each batch's per-example values go to a file named by its example range**,
   ``<parts>/<start>-<end>.safetensors`` (safetensors, with the batch's JSON metadata), written
   atomically as soon as the batch is done. The name holds no rank: a run killed and resumed
   with another world size finds the finished batches and computes only the missing ones.
3. **Rank 0 reduces.** After a barrier, rank 0 reads every batch's file in example order and
   concatenates along the example axis (a copy, which changes no bit). The caller then runs the
   same reduction code on that tensor as a single-process run runs on its own: the inputs are
   bit-identical, so are the outputs. No partial sums are ever added across ranks, so there is
   no summation order to get wrong; a float64 mean over N is computed once, on rank 0.

What this does not cover: a different thread count per process or another device can change a
kernel's last bits (that is a different computation, not a different split); the tests compare
1-thread ranks against a 1-thread single process. The part files must be on a filesystem that
rank 0 sees (one machine, or a shared filesystem across nodes); a missing file is a clear
error, never a silent gap.

Example (world size 1, a folder for the parts):
    >>> import tempfile, torch, interp
    >>> from interp.runtime.distributed import map_batches
    >>> model = interp.tiny_model("llama")
    >>> ex = interp.Examples.from_tokens(torch.randint(0, 256, (5, 8), generator=torch.Generator().manual_seed(0)))
    >>> out = map_batches(lambda sub: ({"nll": interp.nll(model, sub)}, {}), ex, 2, tempfile.mkdtemp())
    >>> bool(torch.equal(out.tensors["nll"], interp.nll(model, ex, batch_size=2)))
    True
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from interp.data import Examples
from interp.errors import InterpError
from interp.io import claim_folder, remove_owned, write_file, write_json
from interp.runtime.batching import batches, show_progress
from interp.runtime.torchrun import TORCHRUN_VARIABLES, variable, world  # noqa: F401 (re-exported)

__all__ = ["world", "local_device", "cores", "shard_bounds", "process_group", "map_batches", "Gathered",
           "pin_threads", "agree"]

PART_SUFFIX = ".safetensors"
MANIFEST = "manifest.json"
PARTS_KIND = "batches"  # the kind in a parts folder's interp marker (interp.io.MARKER)


# ---------------------------------------------------------------------------------------
# Environment (the torchrun variables: interp.runtime.torchrun.world)


def local_device(device: str = "auto") -> str:
    """The device this rank should load its model on: ``cuda:LOCAL_RANK`` when CUDA is there, else ``cpu``.

    Args:
        device: ``"auto"`` (as above), ``"cuda"`` (becomes ``cuda:LOCAL_RANK``), or any explicit device.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return f"cuda:{world()[1]}"
    return device


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def pin_threads(threads: int | None = None) -> None:
    """Under torchrun: ``threads`` torch threads per rank, else (unless ``OMP_NUM_THREADS`` says)
    an equal share of this machine's cores, so the ranks do not oversubscribe them. Nothing without torchrun."""
    if world()[2] <= 1:
        if threads:
            torch.set_num_threads(threads)
        return
    if threads:
        torch.set_num_threads(threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        local = variable("LOCAL_WORLD_SIZE") or world()[2]
        torch.set_num_threads(max(1, cores() // max(1, local)))


def shard_bounds(n: int, batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """The block ``[start, end)`` of ``n`` examples that ``rank`` of ``world_size`` takes.

    Blocks are whole batches: the ``ceil(n / batch_size)`` batches of a single-process run
    are split into ``world_size`` contiguous runs of batches (sizes differ by at most one),
    so every block starts at a multiple of ``batch_size``. A rank's own batches are then
    exactly the single-process run's batches (the short last batch, if any, falls to the last
    rank). That matters because a forward's floating-point result can depend on which rows
    share a batch (GEMM blocking and reduction order change with the batch shape), so other
    batches could change the results in the last bits.
    """
    if batch_size < 1:
        raise InterpError(f"batch_size must be at least 1; got {batch_size}.")
    if not 0 <= rank < world_size:
        raise InterpError(f"rank {rank} is outside a world of size {world_size}.")
    n_batches = -(-n // batch_size)
    first = rank * n_batches // world_size
    last = (rank + 1) * n_batches // world_size
    return min(n, first * batch_size), min(n, last * batch_size)


@contextmanager
def process_group(device: torch.device | str | None = None) -> Iterator[Any]:
    """The default ``torch.distributed`` group for this job (``None`` without torchrun).

    Joins it from torchrun's environment when it is not joined yet (``nccl`` for a CUDA
    ``device``, ``gloo`` otherwise); an existing group is reused. The group is left when the
    process exits, not when the block ends: a second group joined from the same torchrun store in
    one process fails to connect, and a script may run several commands in a row.
    """
    if world()[2] <= 1:
        yield None
        return
    import torch.distributed as dist

    if dist.is_initialized():
        yield dist
        return
    where = torch.device(device) if device is not None else torch.device("cpu")
    if where.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(where)
        dist.init_process_group("nccl", device_id=where)
    else:
        dist.init_process_group("gloo")
    atexit.register(_leave, dist)
    yield dist


def _leave(dist: Any) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# Per-batch parts


@dataclass(frozen=True)
class Gathered:
    """Every batch's tensors concatenated along the example axis (axis 0), in example order.

    Attributes:
        tensors: name -> ``[N, ...]``.
        meta: the JSON metadata of the first batch (settings that do not depend on the batch).
    """

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


Compute = Callable[[Examples], tuple[Mapping[str, torch.Tensor], Mapping[str, Any]]]


def examples_digest(examples: Examples) -> str:
    """sha256 of the token rows, attention mask and ids: which examples, in which order."""
    h = hashlib.sha256()
    h.update(examples.tokens.contiguous().numpy().tobytes())
    h.update(str(tuple(examples.tokens.shape)).encode())
    if examples.attention_mask is not None:
        h.update(examples.attention_mask.contiguous().numpy().tobytes())
    h.update("\x00".join(examples.ids).encode())
    return h.hexdigest()


def part_name(start: int, end: int) -> str:
    return f"{start:09d}-{end:09d}{PART_SUFFIX}"


def _prepare(parts: Path, settings: dict[str, Any], rank: int) -> None:
    """Rank 0: start ``parts`` afresh unless its manifest is this run's (then its batches are reused)."""
    if rank != 0:
        return
    manifest = parts / MANIFEST
    try:
        same = json.loads(manifest.read_text(encoding="utf-8")) == json.loads(json.dumps(settings))
    except (OSError, ValueError):
        same = False
    claim_folder(parts, PARTS_KIND, adopt=_is_parts)  # a folder holding anything else is refused
    if not same:  # another run's batches (other examples, model or options): only its own files go
        remove_owned(parts, [p.name for p in parts.iterdir() if _is_part_file(p.name)] + [MANIFEST], PARTS_KIND)
        write_json(manifest, settings)


def _is_part_file(name: str) -> bool:
    return re.fullmatch(r"\d{9}-\d{9}" + re.escape(PART_SUFFIX), name) is not None


def _is_parts(folder: Path) -> bool:
    """A parts folder written before output folders carried interp's marker: a manifest and batch files only."""
    names = [p.name for p in folder.iterdir()]
    return MANIFEST in names and all(n == MANIFEST or _is_part_file(n) for n in names)


def _save_part(path: Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], rows: int) -> None:
    from safetensors.torch import save_file

    for name, value in tensors.items():
        if value.ndim == 0 or value.shape[0] != rows:
            raise InterpError(f"map_batches: {name!r} has shape {tuple(value.shape)}; its first axis must be the "
                              f"batch's {rows} examples.")
    flat = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    metadata = {"meta": json.dumps(dict(meta)), "names": json.dumps(list(tensors))}
    # atomic: a kill leaves the batch either finished or absent (its temporary is cleaned on the next run)
    write_file(path, lambda tmp: save_file(flat, str(tmp), metadata=metadata))


def _load_part(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors import safe_open

    if not path.is_file():
        raise InterpError(f"The batch file {path} is missing after every rank finished. On several machines the "
                          "output folder must be on a filesystem that all of them share (see docs/scaling.md).")
    with safe_open(str(path), framework="pt") as f:
        header = f.metadata() or {}
        # safetensors lists its tensors sorted by name: the order the batch gave them comes from the header
        names = json.loads(header.get("names", "[]"))
        tensors = {k: f.get_tensor(k) for k in names}
        meta = json.loads(header.get("meta", "{}"))
    return tensors, meta


def agree(dist: Any, failed: bool) -> None:
    """A barrier that also tells every rank whether any rank failed (then the others raise too)."""
    if dist is None:
        return
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if failed else 0], device=device)
    dist.all_reduce(flag)
    if int(flag.item()) and not failed:
        raise InterpError(f"Another rank failed while computing its batches ({int(flag.item())} of "
                          f"{world()[2]}); its own error says why. Finished batches are kept: rerun to resume.")


def map_batches(
    compute: Compute,
    examples: Examples,
    batch_size: int,
    parts: str | os.PathLike[str] | None,
    settings: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    desc: str = "batches",
    everywhere: bool = False,
) -> Gathered | None:
    """Run ``compute`` on each batch of ``examples`` (this rank's share of them) and gather the results.

    Args:
        compute: ``sub_examples -> (tensors, meta)``: ``tensors`` has the batch's examples on
            axis 0 (the same names and trailing shapes for every batch); ``meta`` is
            JSON-serialisable and the same for every batch.
        examples: all examples (every rank passes the same).
        batch_size: examples per batch (and per forward inside ``compute``).
        parts: folder for the per-batch files; required under torchrun. A rerun with the same
            ``settings`` (and examples) reuses the finished batches, with any world size;
            otherwise the folder is emptied first.
        settings: what makes two runs the same run (model, options); the examples' digest and
            ``batch_size`` are added.
        progress: a bar on rank 0.
        desc: the bar's label.
        everywhere: every rank reads the finished batches back and gets the :class:`Gathered`
            (for callers whose ranks all go on with the result, such as the report's stages);
            by default only rank 0 does.

    Returns:
        On rank 0 (on every rank with ``everywhere``) a :class:`Gathered`, ``None`` on the other
        ranks. Without torchrun it is the whole run in this process.
    """
    rank, _, size = world()
    if parts is None and size > 1:
        raise InterpError("map_batches under torchrun needs a folder for the per-batch files (parts=...).")
    grid = list(batches(len(examples), batch_size))
    if not grid:
        raise InterpError("map_batches needs at least one example.")
    start, end = shard_bounds(len(examples), batch_size, rank, size)
    mine = [(s, e) for s, e in grid if start <= s < end]
    folder = Path(parts) if parts is not None else None
    held: dict[tuple[int, int], tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
    with process_group() as dist:
        if folder is not None:
            _prepare(folder, {**dict(settings or {}), "examples": examples_digest(examples), "n": len(examples),
                              "batch_size": batch_size}, rank)
        if dist is not None:
            dist.barrier()  # the folder is ready (or emptied) before any rank writes into it
        bar = tqdm(total=len(mine), desc=desc, unit="batch", disable=rank != 0 or not show_progress(progress))
        try:
            for s, e in mine:
                path = folder / part_name(s, e) if folder is not None else None
                if path is None or not path.is_file():
                    tensors, meta = compute(examples.subset(list(range(s, e))))
                    if path is not None:
                        _save_part(path, tensors, meta, e - s)
                    else:
                        held[(s, e)] = ({k: v.detach().cpu() for k, v in tensors.items()}, dict(meta))
                bar.update(1)
        except BaseException:
            agree(dist, failed=True)  # the other ranks learn of it instead of waiting at a barrier
            raise
        finally:
            bar.close()
        agree(dist, failed=False)  # every batch is on disk (or some rank failed: then all stop)
        if rank != 0 and not everywhere:
            return None
        loaded = [held[(s, e)] if folder is None else _load_part(folder / part_name(s, e)) for s, e in grid]
    names = list(loaded[0][0])
    for (s, e), (tensors, _) in zip(grid, loaded, strict=True):
        if list(tensors) != names:
            raise InterpError(f"Batch {s}-{e} holds {sorted(tensors)}, batch 0 holds {sorted(names)}: the batch files "
                              "come from different runs; remove the parts folder and rerun.")
    return Gathered(tensors={k: torch.cat([t[k] for t, _ in loaded]) for k in names}, meta=loaded[0][1])
