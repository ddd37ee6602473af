"""Per-example quantization error, scored into a store that survives being killed.

``error(x) = NLL(x; quantized) - NLL(x; reference)``, where ``NLL`` is the mean next-token
negative log-likelihood of example ``x`` (see :mod:`interp.runtime.scoring`). :func:`score`
computes it for many method specs over one set of examples and keeps every per-example
NLL in a :class:`ScoreStore`:

- **Storage.** One SQLite file in WAL mode. Table ``scores`` is keyed by
  ``(model, spec, example)`` (``model`` is the reference's :func:`~interp.models.model_hash`;
  the reference itself is the spec ``"reference"``) and holds ``nll`` and, when asked, ``kl``.
- **Atomic batches.** Each batch of examples is written in one transaction, together with
  a row in the ``batches`` log. A killed run loses at most the batch in flight.
- **Resuming.** A rerun skips every batch whose examples are all stored. Batches are
  fixed slices of the example list, so a resumed run forms the same batches as an
  uninterrupted one and gives bit-identical results. The primary key makes a duplicate
  row impossible; the log shows that no finished batch was computed twice.
- **Cost.** The reference is scored once and reused for every spec. Quantized models come
  from the cache :func:`~interp.quant.apply.quantize_cached` keeps, so a resumed run does not
  quantize again.
  ``kl=True`` adds ``KL(p_ref || p_quant)`` (mean over predicting positions); it needs the
  reference *logits* of each batch, which are too large to keep (N x T x vocab floats), so
  the reference forward is recomputed for every batch of every spec: KL roughly doubles the
  cost of scoring.
- **One copy of the weights.** Each spec's weights are swapped into the reference block by
  block for its pass and swapped out after (the reference's own are stashed on disk and come
  back bit for bit: :mod:`interp.quant.inplace`); a missing spec is quantized in place the
  same way. Only ``kl=True`` holds a quantized copy beside the reference.

Example:
    >>> import interp, torch, tempfile
    >>> from interp.quant import score
    >>> model = interp.tiny_model("llama")
    >>> ex = interp.Examples.from_tokens(torch.randint(0, 256, (4, 16)))
    >>> errors = score(model, ["rtn:bits=4,group=32"], ex, store=tempfile.mkdtemp(), progress=False)
    >>> list(errors.columns), errors.shape
    (['rtn:bits=4,group=32,zero=float'], (4, 1))
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from interp import validate
from interp.data import Examples
from interp.errors import DataError, InterpError, NonFiniteError, SpecError
from interp.io import connect_sqlite, ensure_writable_dir, write_parquet
from interp.models import Model
from interp.quant.apply import _quantize_cached, model_hash
from interp.quant.inplace import _cached_variant, variant
from interp.quant.spec import MethodSpec, parse_spec
from interp.runtime import placement
from interp.runtime.batching import batches, check_examples, device_of, show_progress
from interp.runtime.scoring import (
    fast_forward,
    in_padded_layout,
    model_logits,
    per_token_honouring_mask,
    row_mean,
    target_mask,
    token_kl,
    token_nll,
    token_nll_fn,
)
from interp.runtime.swap import WeightStash
from interp.validate import checked, checked_class

REFERENCE = "reference"
STORE_FILE = "scores.sqlite"
# ``row`` is a content hash of the example's token ids (:func:`row_hash`): a score is reused
# only for the very same tokens, never for another text behind the same example id.
SCHEMA = """
CREATE TABLE IF NOT EXISTS scores (
    model TEXT NOT NULL, spec TEXT NOT NULL, example TEXT NOT NULL, row TEXT NOT NULL,
    nll REAL NOT NULL, kl REAL,
    PRIMARY KEY (model, spec, example, row)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS batches (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    model TEXT NOT NULL, spec TEXT NOT NULL, first_example TEXT NOT NULL,
    n INTEGER NOT NULL, seconds REAL NOT NULL, pid INTEGER NOT NULL, finished REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    batch TEXT PRIMARY KEY, pid INTEGER NOT NULL, expires REAL NOT NULL
) WITHOUT ROWID;
"""
COLUMNS = {
    "scores": ["model", "spec", "example", "row", "nll", "kl"],
    "batches": ["id", "model", "spec", "first_example", "n", "seconds", "pid", "finished"],
    "meta": ["key", "value"],
    "leases": ["batch", "pid", "expires"],
}
LEASE_SECONDS = 900.0  # a writer that died mid-batch holds it this long at most


def row_hash(tokens: torch.Tensor, mask: torch.Tensor | None = None) -> str:
    """Content hash of one token row (sha256 of its int64 bytes, 16 hex digits).

    A padded row also hashes its attention mask, so the same ids padded differently are
    different rows; an unpadded row hashes as before.
    """
    data = tokens.to(torch.int64).cpu().contiguous().numpy().tobytes()
    if mask is not None and not bool(mask.all()):
        data += b"mask" + mask.to(torch.bool).cpu().contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def row_hashes(examples: Examples) -> list[str]:
    masks = examples.attention_mask
    return [row_hash(row, None if masks is None else masks[i]) for i, row in enumerate(examples.tokens)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@checked_class(model=lambda value, name, arguments: None)  # a model's name here (str), not a model
class ScoreStore:
    """A SQLite store of per-example NLL (and KL) by (model, spec, example).

    Args:
        path: a folder (the file is ``scores.sqlite`` inside it) or a ``.sqlite``/``.db`` file.

    Several processes may read while one writes (WAL mode); writers wait for each other.

    Example:
        >>> import pathlib, tempfile, torch
        >>> import interp
        >>> from interp.quant import ScoreStore, score
        >>> model = interp.tiny_model("llama")
        >>> ex = interp.Examples.from_tokens(torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0)))
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "scores.sqlite"
        >>> _ = score(model, ["rtn:bits=4,group=32"], ex, store=path, progress=False)
        >>> store = ScoreStore(path)
        >>> store.specs(), store.errors_frame().shape
        (['reference', 'rtn:bits=4,group=32,zero=float'], (4, 1))
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        if path.suffix in (".sqlite", ".db"):
            ensure_writable_dir(path.parent)  # a ResourceError, not an OSError, when the folder is a file
            self.path = path
        else:
            self.path = ensure_writable_dir(path) / STORE_FILE
        self.folder = self.path.parent
        try:
            self._db = connect_sqlite(self.path, timeout=120, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._check_schema()
            self._db.executescript(SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise InterpError(f"{self.path} is not a usable score store ({exc}). It is not an SQLite file "
                              "written by interp: use another --out (or move the file away).") from None

    def _check_schema(self) -> None:
        """Refuse an SQLite file whose tables are not this store's (another program's, or an older interp's)."""
        tables = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        tables.discard("sqlite_sequence")
        foreign = sorted(tables - set(COLUMNS))
        wrong = sorted(t for t in tables & set(COLUMNS)
                       if [r[1] for r in self._db.execute(f"PRAGMA table_info({t})")] != COLUMNS[t])
        if foreign or wrong:
            self._db.close()
            raise InterpError(
                f"{self.path} is an SQLite file but not a score store of this interp version (unexpected tables "
                f"{foreign or wrong}; an older store has no token-row hashes). Use another --out, or move the "
                "file away to score again from scratch."
            )

    # -- context management ---------------------------------------------------------
    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "ScoreStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- metadata -------------------------------------------------------------------
    def get_meta(self, key: str) -> Any:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else None

    def set_meta(self, key: str, value: Any) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def check_examples(self, model: str, examples: Examples) -> None:
        """Record (or check) which token rows this store's example ids stand for, per model.

        Example ids name documents; the same id at another ``seq_len`` is another row, so
        mixing them in one store would silently mix results.
        """
        signature = {"seq_len": examples.seq_len, "source": str(examples.settings.get("source", ""))}
        key = f"examples:{model}"
        stored = self.get_meta(key)
        if stored is None:
            self.set_meta(key, signature)
        elif stored != signature:
            raise InterpError(
                f"The store {self.path} holds scores for examples {stored}, not {signature}. "
                "Use another output folder for a different data source or sequence length."
            )

    def check_model(self, model: str) -> None:
        """Record (or check) the one reference model this store holds; refuse a second before any write."""
        stored = self.get_meta("reference_model")
        others = [m for m in self.models() if m != model]
        if (stored is not None and stored != model) or others:
            raise InterpError(
                f"The store {self.path} holds scores of reference model {stored or others[0]}, not of this one "
                f"({model}). One store holds one reference model: use another output folder for this model."
            )
        if stored is None:
            self.set_meta("reference_model", model)

    # -- reading --------------------------------------------------------------------
    def done(self, model: str, spec: str, need_kl: bool = False) -> set[tuple[str, str]]:
        """(example id, row hash) pairs already scored for (model, spec) (with KL, if ``need_kl``)."""
        query = "SELECT example, row FROM scores WHERE model = ? AND spec = ?"
        if need_kl:
            query += " AND kl IS NOT NULL"
        return {(row[0], row[1]) for row in self._db.execute(query, (model, spec))}

    def models(self) -> list[str]:
        return [row[0] for row in self._db.execute("SELECT DISTINCT model FROM scores ORDER BY model")]

    def specs(self, model: str | None = None) -> list[str]:
        model = self._model(model)
        rows = self._db.execute("SELECT DISTINCT spec FROM scores WHERE model = ? ORDER BY spec", (model,))
        return [row[0] for row in rows]

    def _model(self, model: str | None) -> str:
        if model is not None:
            return model
        models = self.models()
        if len(models) != 1:
            raise InterpError(f"The store {self.path} holds {len(models)} models ({models}); say which one.")
        return models[0]

    def _frame(self, column: str, model: str | None, specs: Sequence[str] | None,
               ids: Sequence[str] | None) -> pd.DataFrame:
        model = self._model(model)
        # Only scores of the token row the reference was last scored on count for an example id
        # (a changed text behind an id leaves its old scores behind, unused).
        rows = self._db.execute(
            f"SELECT s.example, s.spec, s.{column} FROM scores s JOIN scores r ON r.model = s.model "
            "AND r.example = s.example AND r.row = s.row AND r.spec = ? WHERE s.model = ?",
            (REFERENCE, model)).fetchall()
        long = pd.DataFrame(rows, columns=["example", "spec", column])
        wide = long.pivot(index="example", columns="spec", values=column)
        wide.columns.name = None
        if specs is not None:
            wide = wide.reindex(columns=list(specs))
        if ids is not None:
            wide = wide.reindex(index=list(ids))
        wide.index.name = "example"
        return wide.astype("float64")

    def nll_frame(self, model: str | None = None, specs: Sequence[str] | None = None,
                  ids: Sequence[str] | None = None) -> pd.DataFrame:
        """Per-example NLL: index example id, one column per spec (``"reference"`` included)."""
        return self._frame("nll", model, specs, ids)

    def kl_frame(self, model: str | None = None, specs: Sequence[str] | None = None,
                 ids: Sequence[str] | None = None) -> pd.DataFrame:
        """Per-example KL(p_ref || p_quant); NaN where it was not computed."""
        return self._frame("kl", model, specs, ids)

    def errors_frame(self, model: str | None = None, specs: Sequence[str] | None = None,
                     ids: Sequence[str] | None = None, complete: bool = True) -> pd.DataFrame:
        """``NLL(quantized) - NLL(reference)`` per example and spec.

        Args:
            complete: keep only examples scored by the reference and every listed spec.
        """
        nll = self.nll_frame(model, None, ids)
        if REFERENCE not in nll.columns:
            raise InterpError(f"The store {self.path} has no reference scores yet; run score first.")
        chosen = list(specs) if specs is not None else [c for c in nll.columns if c != REFERENCE]
        errors = nll.reindex(columns=chosen).sub(nll[REFERENCE], axis=0)
        return errors.dropna(how="any") if complete else errors

    def batch_log(self) -> pd.DataFrame:
        """One row per computed batch: model, spec, first example, n, seconds, pid, finished."""
        rows = self._db.execute("SELECT id, model, spec, first_example, n, seconds, pid, finished FROM batches")
        return pd.DataFrame(rows.fetchall(),
                            columns=["id", "model", "spec", "first_example", "n", "seconds", "pid", "finished"])

    def token_nll(self, spec: str, model: str | None = None, ids: Sequence[str] | None = None) -> pd.DataFrame:
        """Per-token NLL of one spec (``"reference"`` included): index example, one column per target position.

        Stored as parquet beside the SQLite file (``token_nll/<model>/<spec>/<batch>.parquet``), one
        file per scored batch. Rows scored before per-token storage existed are absent.
        """
        folder = self._token_dir(self._model(model), spec)
        files = sorted(folder.glob("*.parquet")) if folder.is_dir() else []
        if not files:
            raise InterpError(f"The store {self.path} has no per-token NLL for {spec}; score it again with "
                              "this version of interp (older stores kept only per-example means).")
        frame = pd.concat([pd.read_parquet(f) for f in files])
        frame = frame[~frame.index.duplicated(keep="last")]
        frame.index.name = "example"
        return frame.reindex(index=list(ids)) if ids is not None else frame

    def _token_dir(self, model: str, spec: str) -> Path:
        import hashlib
        import re

        slug = re.sub(r"[^A-Za-z0-9]+", "_", spec).strip("_")[:60]
        return self.folder / "token_nll" / model / f"{slug}-{hashlib.sha256(spec.encode()).hexdigest()[:8]}"

    def write_token_nll(self, model: str, spec: str, ids: Sequence[str], values: torch.Tensor) -> None:
        """Store one batch's per-token NLL ``[B, T-1]`` (float32) as one parquet file, atomically."""
        import hashlib

        if values.ndim != 2 or len(ids) != values.shape[0]:
            raise DataError(f"write_token_nll stores one row of per-token NLL per example id: got {len(ids)} id(s) "
                            f"for values of shape {list(values.shape)}")
        folder = self._token_dir(model, spec)
        frame = pd.DataFrame(values.float().numpy(), index=pd.Index([str(i) for i in ids], name="example"),
                             columns=[f"t{t + 1}" for t in range(values.shape[1])])
        name = hashlib.sha256("\x00".join(map(str, ids)).encode()).hexdigest()[:16]
        write_parquet(folder / f"{name}.parquet", frame)

    # -- writing --------------------------------------------------------------------
    def take_lease(self, batch: str, done: Callable[[], bool], seconds: float = LEASE_SECONDS) -> bool:
        """Lease ``batch`` to this process unless it is done or leased by another live writer.

        Returns True when this process should compute the batch now. A lease whose writer died
        (its pid is gone) or that expired is taken over. ``done()`` is asked inside the same
        write transaction, so a batch stored by another writer a moment ago is not taken again.
        """
        now, pid = time.time(), os.getpid()
        self._db.execute("BEGIN IMMEDIATE")
        try:
            if done():
                return False
            held = self._db.execute("SELECT pid, expires FROM leases WHERE batch = ?", (batch,)).fetchone()
            if held is not None and held[0] != pid and held[1] > now and _alive(int(held[0])):
                return False
            self._db.execute("INSERT OR REPLACE INTO leases (batch, pid, expires) VALUES (?, ?, ?)",
                             (batch, pid, now + seconds))
            return True
        finally:
            self._db.execute("COMMIT")

    def release_lease(self, batch: str) -> None:
        self._db.execute("DELETE FROM leases WHERE batch = ? AND pid = ?", (batch, os.getpid()))

    def write_batch(self, model: str, spec: str, ids: Sequence[str], nll: Sequence[float],
                    kl: Sequence[float] | None = None, seconds: float = 0.0, rows: Sequence[str] | None = None,
                    lease: str | None = None) -> None:
        """Store one batch atomically: its scores, its log row and the release of its lease, or nothing.

        ``rows`` are the :func:`interp.quant.store.row_hash` of each example's tokens (``""`` when unknown).
        """
        for what, values in (("nll", nll), ("kl", kl), ("rows", rows)):
            if values is not None and len(values) != len(ids):
                raise DataError(f"write_batch needs one {what} value per id: {len(ids)} ids, {len(values)} values.")
        if not ids:
            raise DataError("write_batch needs at least one example id.")
        kl_values: Sequence[float | None] = kl if kl is not None else [None] * len(ids)
        hashes = list(rows) if rows is not None else [""] * len(ids)
        records = [(model, spec, str(i), h, float(v), None if k is None else float(k))
                   for i, h, v, k in zip(ids, hashes, nll, kl_values, strict=True)]
        try:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany(
                "INSERT INTO scores (model, spec, example, row, nll, kl) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (model, spec, example, row) DO UPDATE SET kl = excluded.kl "
                "WHERE scores.kl IS NULL AND excluded.kl IS NOT NULL",
                records,
            )
            if spec == REFERENCE:  # the reference's newest row defines each example id (see _frame)
                self._db.executemany(
                    "DELETE FROM scores WHERE model = ? AND spec = ? AND example = ? AND row != ?",
                    [(model, spec, str(i), h) for i, h in zip(ids, hashes, strict=True)])
            if lease is not None:
                self._db.execute("DELETE FROM leases WHERE batch = ?", (lease,))
            self._db.execute(
                "INSERT INTO batches (model, spec, first_example, n, seconds, pid, finished) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (model, spec, str(ids[0]), len(ids), float(seconds), os.getpid(), time.time()),
            )
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise


# ---------------------------------------------------------------------------------------
# Scoring


def _unique_specs(specs: Sequence[str | MethodSpec]) -> list[MethodSpec]:
    """The specs parsed (the one parse of each, at :func:`score`'s edge), without repeats."""
    return _unique([parse_spec(s) for s in specs])


def _unique(parsed: Sequence[MethodSpec]) -> list[MethodSpec]:
    """Parsed specs without repeats, in their order; at least one."""
    if not parsed:
        raise SpecError("score needs at least one method spec, e.g. ['rtn:bits=3,group=64'].")
    return list(dict.fromkeys(parsed))


def _pending(store: ScoreStore, model: str, spec: str, ids: Sequence[str], rows: Sequence[str],
             chunks: Sequence[tuple[int, int]], need_kl: bool) -> list[tuple[int, int]]:
    done = store.done(model, spec, need_kl)
    return [(s, e) for s, e in chunks if not all(pair in done for pair in zip(ids[s:e], rows[s:e], strict=True))]


def _batch_key(model: str, spec: str, ids: Sequence[str], rows: Sequence[str]) -> str:
    text = "\x00".join([model, spec, *ids, *rows])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _scorer(model: Model, reference: Model | None
            ) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
    """``(tokens, mask=None) -> (mean NLL per row, mean KL(p_ref || p_model) per row or None, token NLL [B, T-1])``.

    Without KL the NLL comes from the chunked, bridge-free scorer; with KL both models'
    full logits are needed, from their bridge-free forwards when no hook is registered.
    The per-token NLL is kept (float32; NaN at padded targets) for the split-half
    reliability of the errors. Padded rows average over their real targets only.
    """
    def finish(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        kept = values.float().cpu()
        return kept if mask is None else kept.masked_fill(~target_mask(mask.cpu()), float("nan"))

    if reference is None:
        per_token = token_nll_fn(model)

        def score_nll(tokens: torch.Tensor, mask: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
            values = per_token(tokens, mask)
            return row_mean(values, mask).cpu(), None, finish(values, mask)

        return score_nll
    run, run_ref = fast_forward(model), fast_forward(reference)

    def score_with_kl(tokens: torch.Tensor, mask: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        per_kl: list[torch.Tensor] = []

        def nll_and_kl(rows: torch.Tensor) -> torch.Tensor:  # padded rows arrive left-aligned
            logits = model_logits(model, rows, run)
            per_kl.append(token_kl(model_logits(reference, rows, run_ref), logits))
            return token_nll(logits, rows.to(logits.device))

        values = per_token_honouring_mask(nll_and_kl, tokens, mask)
        kl_values = per_kl[0] if mask is None else in_padded_layout(per_kl[0], mask)
        return row_mean(values, mask).cpu(), row_mean(kl_values, mask).cpu(), finish(values, mask)

    return score_with_kl


def _run_pass(store: ScoreStore, key: str, spec: str, model: Model, reference: Model | None,
              examples: Examples, todo: Sequence[tuple[int, int]], bar: Any, need_kl: bool = False,
              poll_seconds: float = 0.2) -> None:
    """Score the ``todo`` batches, each at most once across concurrent writers.

    Each batch is leased in the store before it is computed; batches leased by another live
    writer are skipped and retried after the others, until that writer stores them (or its
    lease lapses and this process takes the batch over).
    """
    if not todo:
        return
    rows = row_hashes(examples)
    score_batch = _scorer(model, reference)
    device = device_of(model)
    waiting = list(todo)
    while waiting:
        deferred = []
        for start, end in waiting:
            ids, hashes = examples.ids[start:end], rows[start:end]
            lease = _batch_key(key, spec, ids, hashes)
            def stored(ids: Sequence[str] = ids, hashes: Sequence[str] = hashes) -> bool:
                have = store.done(key, spec, need_kl)
                return all(pair in have for pair in zip(ids, hashes, strict=True))

            if store.take_lease(lease, stored):
                _score_batch(store, key, spec, score_batch, examples, (start, end), hashes, lease, reference, device)
            elif not stored():
                deferred.append((start, end))
                continue
            bar.update(1)
        if deferred:
            time.sleep(poll_seconds)
        waiting = deferred


def _score_batch(store: ScoreStore, key: str, spec: str, score_batch: Any, examples: Examples,
                 span: tuple[int, int], hashes: Sequence[str], lease: str, reference: Model | None,
                 device: Any) -> None:
    start, end = span
    try:
        tick = time.perf_counter()
        with torch.no_grad():
            mask = None if examples.attention_mask is None else examples.attention_mask[start:end].to(device)
            nll, kl, per_token = score_batch(examples.tokens[start:end].to(device), mask)
        if not torch.isfinite(nll).all() or (kl is not None and not torch.isfinite(kl).all()):
            raise NonFiniteError(f"{spec} gave NaN/inf NLL or KL on examples {examples.ids[start:end][:3]}: "
                                 "check the quantized weights.")
        if reference is None and spec == REFERENCE:
            kl = torch.zeros_like(nll)
        # the token-level sidecar goes first: a kill between the two leaves the batch pending,
        # and its rerun rewrites the same file
        store.write_token_nll(key, spec, examples.ids[start:end], per_token)
        store.write_batch(key, spec, examples.ids[start:end], nll.tolist(),
                          None if kl is None else kl.tolist(), time.perf_counter() - tick, rows=hashes, lease=lease)
    except BaseException:
        store.release_lease(lease)
        raise


def _score_spec(store: ScoreStore, key: str, spec: MethodSpec, reference: Model, examples: Examples,
                todo: Sequence[tuple[int, int]], bar: Any, kl: bool, calibration: Examples | None, cache: Path,
                progress: bool | None, stash: WeightStash) -> None:
    """Score one spec's pending batches with its weights swapped into ``reference`` (one copy of the weights).

    KL needs both models' logits in every batch, so it keeps a quantized copy beside the
    reference (two copies of the weights; refused for a model with offloaded blocks).
    """
    if kl:
        placement.refuse_offloaded(reference, "score(kl=True)", "Score without KL on a split model, or place every "
                                   "block on a device (KL holds the reference and a quantized copy at once).")
        qmodel = _quantize_cached(reference, spec, calibration, cache_dir=cache, progress=progress)
        _run_pass(store, key, str(spec), qmodel, reference, examples, todo, bar, need_kl=True)
        return
    folder = _cached_variant(reference, spec, calibration, stash=stash, cache_dir=cache, progress=progress)
    with variant(reference, folder, stash=stash, reference_hash=key):
        _run_pass(store, key, str(spec), reference, None, examples, todo, bar)


@checked
def score(
    reference: Model,
    specs: Sequence[str | MethodSpec],
    examples: Examples,
    store: str | os.PathLike[str] | ScoreStore,
    calibration: Examples | None = None,
    batch_size: int = 8,
    kl: bool = False,
    progress: bool | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> pd.DataFrame:
    """Per-example quantization error for each spec, resumable.

    Args:
        reference: the full-precision bridge.
        specs: method specs, e.g. ``["rtn:bits=3", "gptq:bits=3,group=64"]``.
        examples: evaluation examples (their ids must be unique).
        store: a folder or ``.sqlite`` file for the :class:`~interp.quant.store.ScoreStore`, or an open store.
        calibration: calibration-split examples, needed when a spec is gptq or awq.
        batch_size: examples per forward. Keep it fixed across resumed runs: batches are
            fixed slices of ``examples``.
        kl: also store ``KL(p_ref || p_quant)`` (recomputes reference logits per batch).
        progress: a progress bar over batches.
        cache_dir: where quantized models are cached (default: ``quantized/`` beside the store).

    Returns:
        DataFrame, index ``example`` (ids in the order of ``examples``), one float64 column
        per canonical spec: ``NLL(quantized) - NLL(reference)``.

    Example:
        >>> import pathlib, tempfile, torch
        >>> import interp
        >>> from interp.quant import score
        >>> model = interp.tiny_model("llama")
        >>> ex = interp.Examples.from_tokens(torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0)))
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "scores.sqlite"
        >>> errors = score(model, ["rtn:bits=4,group=32", "nf:bits=4,group=32"], ex, store=path, progress=False)
        >>> errors.columns.tolist(), errors.index.tolist()  # NLL(quantized) - NLL(reference) per example
        (['rtn:bits=4,group=32,zero=float', 'nf:bits=4,group=32'], ['row0', 'row1', 'row2', 'row3'])
    """
    return _score(reference, _unique_specs(specs), examples, store, calibration, batch_size, kl, progress, cache_dir)


def _score(reference: Model, parsed: list[MethodSpec], examples: Examples, store: str | os.PathLike[str] | ScoreStore,
           calibration: Examples | None = None, batch_size: int = 8, kl: bool = False, progress: bool | None = None,
           cache_dir: str | os.PathLike[str] | None = None) -> pd.DataFrame:
    """:func:`score` for parsed specs without repeats (what :func:`~interp.quant.analysis.error_split.error_split`
    passes, having parsed them itself)."""
    if calibration is None and any(s.needs_calibration for s in parsed):
        needing = [str(s) for s in parsed if s.needs_calibration]
        raise SpecError(f"{', '.join(needing)} need calibration examples: pass calibration="
                        "interp.load_examples(..., split='calibration').")
    if len(set(examples.ids)) != len(examples.ids):
        raise InterpError("score needs unique example ids; these examples repeat some.")
    check_examples(reference, examples)
    batch_size = validate.batch_size(batch_size)
    own_store = not isinstance(store, ScoreStore)
    st = store if isinstance(store, ScoreStore) else ScoreStore(store)
    try:
        key = model_hash(reference)
        st.check_model(key)  # before anything is written
        st.check_examples(key, examples)
        chunks = list(batches(len(examples), batch_size))
        names = [str(s) for s in parsed]
        rows = row_hashes(examples)
        plan = {REFERENCE: _pending(st, key, REFERENCE, examples.ids, rows, chunks, False)}
        plan.update({name: _pending(st, key, name, examples.ids, rows, chunks, kl) for name in names})
        cache = Path(cache_dir) if cache_dir is not None else st.folder / "quantized"
        bar = tqdm(total=sum(len(v) for v in plan.values()), desc="score", unit="batch",
                   disable=not show_progress(progress))
        _run_pass(st, key, REFERENCE, reference, None, examples, plan[REFERENCE], bar)
        with WeightStash(reference, st.folder) as stash:
            for spec in parsed:
                if plan[str(spec)]:
                    bar.set_postfix_str(spec.method + str(spec.bits))
                    _score_spec(st, key, spec, reference, examples, plan[str(spec)], bar, kl,
                                calibration if spec.needs_calibration else None, cache, progress, stash)
        bar.close()
        return st.errors_frame(key, names, examples.ids, complete=False)
    finally:
        if own_store:
            st.close()
