"""Multi-process scoring under ``torchrun``: :func:`score_distributed`.

``torchrun --nproc-per-node K`` starts K copies of a script (or of ``interp score``); each
copy calls :func:`score_distributed` with the same arguments. Then:

1. Every rank joins a ``torch.distributed`` process group from the environment variables
   torchrun sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...): backend ``nccl`` when
   the model is on a CUDA device, ``gloo`` otherwise. On CPU each rank pins
   ``torch.set_num_threads(max(1, cores // world_size))`` so K ranks do not oversubscribe
   the cores.
2. Rank ``r`` takes one contiguous block of the examples (:func:`shard_bounds`) and scores
   it with :func:`interp.quant.store.score` into its own SQLite file
   ``<store>.rank{r}.sqlite`` (SQLite serialises writers on one file; one file per rank
   means no rank ever waits on another's lock).
3. After a barrier, rank 0 merges every shard's rows into the main store
   (:func:`merge_shards`; idempotent, so a rerun adds nothing twice) and returns the full
   DataFrame in the order of ``examples``. Other ranks return ``None``.

Resuming: the shard files stay. A rerun after a kill forms the same shards, and each rank's
:func:`~interp.quant.store.score` skips its finished batches. Quantized models are cached in
the folder beside the store (``quantized/``) under a file lock. Before scoring, the specs are
spread over the ranks (rank ``r`` quantizes specs ``r, r + K, ...`` in place), so K ranks
quantize K specs side by side; then every rank's scoring loads them from the cache.

Example (script ``run.py``, launched with ``torchrun --nproc-per-node 2 run.py``)::

    import interp
    from interp.quant.distributed import score_distributed

    model = interp.load_model("smollm2-135m", device=interp.quant.distributed.local_device())
    ex = interp.load_examples("wiki", model.tokenizer, n=1000, seq_len=128)  # or a .jsonl / .txt / dataset folder
    errors = score_distributed(model, ["rtn:bits=3,group=64"], ex, store="out/")
    if errors is not None:  # rank 0
        errors.to_csv("out/errors.csv")
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from interp import models
from interp.data import Examples, load_examples
from interp.errors import InterpError, SpecError
from interp.io import ensure_writable_dir
from interp.models import Model
from interp.quant.apply import model_hash
from interp.quant.calibration import load_calibration
from interp.quant.outputs import score_summary, write_score_outputs
from interp.quant.spec import MethodSpec
from interp.quant.store import STORE_FILE, ScoreStore, _unique_specs, score
from interp.runtime.batching import device_of
from interp.runtime.distributed import cores, local_device, shard_bounds, world

__all__ = ["score_distributed", "shard_bounds", "shard_path", "merge_shards", "local_device", "world"]


# ---------------------------------------------------------------------------------------
# Environment (world, local_device and shard_bounds live in interp.runtime.distributed, which
# every sharded command shares; they are re-exported here for scripts that import them from here)


def _init(model: Model) -> tuple[Any, bool]:
    """Join (or reuse) the default process group; returns (torch.distributed, whether we created it)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist, False
    device = device_of(model)
    backend = "nccl" if device.type == "cuda" and torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
        dist.init_process_group(backend, device_id=device)
    else:
        dist.init_process_group(backend)
    return dist, True


# ---------------------------------------------------------------------------------------
# Merging


def _main_path(store: Any) -> Path:
    if isinstance(store, ScoreStore):
        return store.path
    path = Path(store)
    return path if path.suffix in (".sqlite", ".db") else path / STORE_FILE


def shard_path(store: Any, rank: int) -> Path:
    """``<store>.rank{r}.sqlite`` beside the main store file (``out/scores.rank0.sqlite`` for a folder ``out/``)."""
    main = _main_path(store)
    return main.with_name(f"{main.stem}.rank{rank}.sqlite")


def merge_shards(store: Any, shards: Sequence[str | os.PathLike[str]]) -> int:
    """Copy every shard's scores and batch-log rows into ``store``, once; returns the score rows added.

    Scores are keyed by (model, spec, example), so copying again adds nothing (a KL value
    missing in the main store is filled in, as :meth:`interp.quant.store.ScoreStore.write_batch` does). Batch-log
    rows are copied only past the last shard row already merged (kept in the main store's
    ``meta`` as ``merged:<shard file name>``), so the log of the main store shows each
    computed batch exactly once, also after a rerun. Each shard is merged in one transaction.
    """
    own = not isinstance(store, ScoreStore)
    main = ScoreStore(store) if own else store
    added = 0
    try:
        db = main._db
        for shard in shards:
            shard = Path(shard)
            if not shard.exists():
                raise InterpError(f"The shard store {shard} is missing; rerun the distributed score.")
            key = f"merged:{shard.name}"
            db.execute("ATTACH DATABASE ? AS shard", (str(shard),))
            try:
                db.execute("BEGIN IMMEDIATE")
                before = db.total_changes
                db.execute(
                    "INSERT INTO main.scores (model, spec, example, row, nll, kl) "
                    "SELECT model, spec, example, row, nll, kl FROM shard.scores WHERE true "
                    "ON CONFLICT (model, spec, example, row) DO UPDATE SET kl = excluded.kl "
                    "WHERE scores.kl IS NULL AND excluded.kl IS NOT NULL")
                added += db.total_changes - before
                last = main.get_meta(key) or 0
                db.execute(
                    "INSERT INTO main.batches (model, spec, first_example, n, seconds, pid, finished) "
                    "SELECT model, spec, first_example, n, seconds, pid, finished FROM shard.batches "
                    "WHERE id > ? ORDER BY id", (last,))
                top = db.execute("SELECT max(id) FROM shard.batches").fetchone()[0]
                main.set_meta(key, max(last, top or 0))
                for k, v in db.execute("SELECT key, value FROM shard.meta WHERE key LIKE 'examples:%'"):
                    db.execute("INSERT OR IGNORE INTO main.meta (key, value) VALUES (?, ?)", (k, v))
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            finally:
                db.execute("DETACH DATABASE shard")
        return added
    finally:
        if own:
            main.close()


# ---------------------------------------------------------------------------------------
# Scoring


def score_distributed(
    reference: Model,
    specs: Sequence[str | MethodSpec],
    examples: Examples,
    store: str | os.PathLike[str],
    **score_kwargs: Any,
) -> pd.DataFrame | None:
    """:func:`interp.quant.store.score` split over the ranks of a ``torchrun`` job.

    Every rank calls it with the same arguments (same examples, same specs, same
    ``batch_size``). See the module docstring for what happens.

    Args:
        reference: this rank's full-precision bridge (on ``cuda:LOCAL_RANK`` for GPUs, see
            :func:`local_device`; on CPU for the ``gloo`` backend).
        specs, examples: as in :func:`~interp.quant.store.score`.
        store: folder or ``.sqlite`` file of the main store; shards go beside it.
        **score_kwargs: passed on to :func:`~interp.quant.store.score` (``calibration``,
            ``batch_size``, ``kl``, ``progress``, ``cache_dir``). ``cache_dir`` defaults to
            ``quantized/`` beside the main store for every rank.

    Returns:
        On rank 0 the full DataFrame (index ``example`` in the order of ``examples``, one
        column per canonical spec, ``NLL(quantized) - NLL(reference)``); ``None`` elsewhere.
        Without torchrun (``WORLD_SIZE`` unset or 1) it is plain ``score`` into ``store``.
    """
    rank, _, size = world()
    if size <= 1:
        return score(reference, specs, examples, store=store, **score_kwargs)
    if isinstance(store, ScoreStore):
        raise InterpError("score_distributed needs a store path (each rank opens its own shard), not an open store.")
    if len(set(examples.ids)) != len(examples.ids):
        raise InterpError("score needs unique example ids; these examples repeat some.")
    torch.set_num_threads(max(1, cores() // size))
    dist, created = _init(reference)
    try:
        parsed = _unique_specs(specs)  # parsed once, here
        names = [str(s) for s in parsed]
        key = model_hash(reference)
        # Rank 0 checks the main store first, so every rank fails together rather than hangs.
        problem: list[str | None] = [None]
        if rank == 0:
            try:
                with ScoreStore(store) as main:
                    main.check_examples(key, examples)
            except InterpError as exc:
                problem = [str(exc)]
        dist.broadcast_object_list(problem, src=0)
        if problem[0] is not None:
            raise InterpError(problem[0])

        batch_size = int(score_kwargs.get("batch_size", 8))
        start, end = shard_bounds(len(examples), batch_size, rank, size)
        kwargs = dict(score_kwargs)
        kwargs.setdefault("cache_dir", _main_path(store).parent / "quantized")
        _quantize_spread(dist, reference, parsed, kwargs, store, rank, size)
        if end > start:
            score(reference, parsed, examples.subset(list(range(start, end))),
                  store=shard_path(store, rank), **kwargs)
        dist.barrier()
        if rank != 0:
            dist.barrier()  # wait for rank 0's merge, so the job ends with a complete main store
            return None
        bounds = [shard_bounds(len(examples), batch_size, r, size) for r in range(size)]
        shards = [shard_path(store, r) for r, (s, e) in enumerate(bounds) if e > s]
        with ScoreStore(store) as main:
            merge_shards(main, shards)
            errors = main.errors_frame(key, names, examples.ids, complete=False)
        dist.barrier()  # pairs with the barrier of the other ranks below: they leave after the merge
        missing = errors.index[errors.isna().any(axis=1)]
        if len(missing):
            raise InterpError(f"After merging, {len(missing)} examples lack scores (first: {list(missing[:3])}).")
        return errors
    finally:
        if created:
            dist.destroy_process_group()


def _quantize_spread(dist: Any, reference: Model, specs: Sequence[MethodSpec], kwargs: dict[str, Any], store: Any,
                     rank: int, size: int) -> None:
    """Every spec quantized into the cache once, the specs spread over the ranks (rank ``r`` takes
    specs ``r, r + size, ...``, each in place: one copy of the weights), so the ranks quantize side by
    side instead of one after another; then each rank's scoring finds them all in the cache. The
    cache's file lock keeps two ranks off one folder; the weights do not depend on which rank (or
    thread count) made them. A failure on one rank stops all of them."""
    from interp.quant.inplace import _cached_variant
    from interp.runtime.distributed import agree
    from interp.runtime.swap import WeightStash

    mine = [spec for i, spec in enumerate(specs) if i % size == rank]
    calibration = kwargs.get("calibration")
    try:
        if mine:
            with WeightStash(reference, _main_path(store).parent) as stash:
                for spec in mine:
                    _cached_variant(reference, spec, calibration if spec.needs_calibration else None, stash=stash,
                                    cache_dir=kwargs["cache_dir"], progress=kwargs.get("progress"))  # as score() does
    except BaseException:
        agree(dist, failed=True)
        raise
    agree(dist, failed=False)


# ---------------------------------------------------------------------------------------
# CLI


def cli_score(args: Any) -> int:
    """``interp score`` under torchrun: every rank scores its shard; rank 0 writes the CSVs and settings."""
    rank, _, size = world()
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if args.methods.checkpoints:
        raise SpecError(f"checkpoints ({', '.join(args.methods.checkpoints)}) are scored by interp score in one "
                        "process, not under torchrun; give only method specs here.")
    specs = list(args.methods.specs)  # parsed with the options (interp.cli.quant.SpecList)
    out = ensure_writable_dir(args.out)
    start = time.time()
    if getattr(args, "device_map", None) is not None:  # this rank's replica spread by accelerate (docs/scaling.md)
        model = models.load_model(args.model, dtype=getattr(torch, args.dtype), device_map=args.device_map,
                                  max_memory=args.max_memory, offload_folder=args.offload_folder)
    else:
        device = local_device(args.device) if args.device in ("auto", "cuda") else args.device
        model = models.load_model(args.model, dtype=getattr(torch, args.dtype), device=device)
    examples = load_examples(args.data, model.tokenizer, n=args.n, seq_len=args.seq_len, seed=args.seed,
                             split="eval")
    calibration = load_calibration(args.data, model.tokenizer, specs, n=args.calibration_n,
                                   seq_len=args.calibration_seq_len or args.seq_len, seed=args.seed)
    errors = score_distributed(model, specs, examples, store=out, calibration=calibration,
                               batch_size=args.batch_size, kl=args.kl,
                               progress=(not args.quiet and None) if rank == 0 else False)
    if errors is None:
        return 0
    write_score_outputs(out, args.model, model, examples, calibration, specs, errors, args.batch_size, args.kl,
                        world_size=size, dtype=args.dtype)
    print(score_summary(out, errors, examples, len(specs), time.time() - start, world_size=size))
    return 0
