"""A score store that cannot return stale or foreign scores, and quantized folders that cannot be mislabelled.

- a changed token row behind the same example id is scored again, never served from the store;
- one store holds one reference model: a second is refused before anything is written;
- an SQLite file of another schema (or not SQLite at all) is refused with the fix;
- a quantized-model folder whose weights do not match its label is not loaded as that spec;
- two processes scoring into one store compute every batch once (leases), and store every row once.
"""

from __future__ import annotations

import multiprocessing
import sqlite3
from pathlib import Path

import pandas as pd
import pytest
import torch

import interp
from interp.errors import InterpError
from interp.io import MARKER
from interp.quant import score
from interp.quant.apply import INFO_FILE, WEIGHTS_FILE, cache_key, load_quantized, quantize, quantize_cached
from interp.quant.store import ScoreStore

SPEC = "rtn:bits=4,group=32"
pytestmark = pytest.mark.usefixtures("one_thread")


def _rows(n: int = 6, seed: int = 0, change: tuple[int, int] | None = None) -> interp.Examples:
    tokens = torch.randint(0, 256, (n, 12), generator=torch.Generator().manual_seed(seed))
    tokens[:, 0] = 256
    if change is not None:
        tokens[change] = (tokens[change] + 1) % 256
    return interp.Examples.from_tokens(tokens)


def test_a_changed_row_behind_the_same_id_is_scored_again(tiny_llama, tmp_path):
    first = score(tiny_llama, [SPEC], _rows(), tmp_path, batch_size=2, progress=False)
    again = score(tiny_llama, [SPEC], _rows(), tmp_path, batch_size=2, progress=False)
    pd.testing.assert_frame_equal(first, again, atol=0, rtol=0)  # unchanged rows: reused as they are
    logged = len(ScoreStore(tmp_path).batch_log())
    changed = _rows(change=(3, 5))  # same ids (row0..row5), one token of row3 differs
    after = score(tiny_llama, [SPEC], changed, tmp_path, batch_size=2, progress=False)
    fresh = score(tiny_llama, [SPEC], changed, tmp_path / "fresh", batch_size=2, progress=False)
    pd.testing.assert_frame_equal(after, fresh, atol=0, rtol=0)  # what a new store computes, to the bit
    assert after.loc["row3"].iloc[0] != first.loc["row3"].iloc[0]
    assert list(after.index) == changed.ids  # still indexed by example id
    with ScoreStore(tmp_path) as st:
        assert len(st.batch_log()) == logged + 2  # one batch (row2, row3) for the reference and one for the spec
        nll = st.nll_frame()
        assert list(nll.index) == changed.ids and not nll.isna().any().any()


def test_a_second_reference_model_is_refused_before_writing(tiny_llama, tmp_path):
    score(tiny_llama, [SPEC], _rows(), tmp_path, progress=False)
    with ScoreStore(tmp_path) as st:
        before = (st.nll_frame().copy(), len(st.batch_log()))
    other = interp.tiny_model("llama", seed=1)
    with pytest.raises(InterpError, match="one reference model"):
        score(other, [SPEC], _rows(), tmp_path, progress=False)
    with ScoreStore(tmp_path) as st:
        pd.testing.assert_frame_equal(st.nll_frame(), before[0])
        assert len(st.batch_log()) == before[1] and st.models() == [st.get_meta("reference_model")]


def test_foreign_sqlite_files_are_refused_with_the_fix(tiny_llama, tmp_path):
    other = tmp_path / "other.sqlite"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE scores (model TEXT, spec TEXT, example TEXT, nll REAL, kl REAL)")  # an older layout
    db.commit()
    db.close()
    with pytest.raises(InterpError, match="another --out"):
        ScoreStore(other)
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(InterpError, match="another --out"):
        score(tiny_llama, [SPEC], _rows(), junk, progress=False)


def test_a_mislabelled_quantized_folder_is_not_loaded_as_its_label(tiny_llama, tmp_path):
    """Old failure: death between the weights rename and the label write left weights of another spec."""
    wanted = quantize_cached(tiny_llama, SPEC, cache_dir=tmp_path, progress=False)
    folder = tmp_path / cache_key(tiny_llama, SPEC, None)
    assert sorted(p.name for p in folder.iterdir()) == [MARKER, INFO_FILE, WEIGHTS_FILE]
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]  # nothing half-written left behind
    imposter = quantize(tiny_llama, "rtn:bits=2,group=32", progress=False)
    from interp.quant.apply import save_quantized

    save_quantized(imposter, tmp_path / "imposter")
    (folder / WEIGHTS_FILE).write_bytes((tmp_path / "imposter" / WEIGHTS_FILE).read_bytes())  # same size
    with pytest.raises(InterpError, match="not the ones"):
        load_quantized(tiny_llama, folder)
    tokens = _rows().tokens
    again = quantize_cached(tiny_llama, SPEC, cache_dir=tmp_path, progress=False)  # detected, redone
    assert torch.equal(again(tokens), wanted(tokens))
    assert torch.equal(load_quantized(tiny_llama, folder)(tokens), wanted(tokens))  # and the folder repaired


def _writer(store: str, n: int) -> None:
    torch.set_num_threads(1)
    model = interp.tiny_model("llama", seed=0)
    score(model, [SPEC, "nf:bits=4,group=32"], _rows(n), store, batch_size=1, progress=False)


@pytest.mark.slow
def test_two_writers_compute_every_batch_once(tmp_path):
    n = 16
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_writer, args=(str(tmp_path), n)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=600)
    assert [w.exitcode for w in workers] == [0, 0]
    with ScoreStore(tmp_path) as st:
        log = st.batch_log()
        assert len(log) == 3 * n  # reference and two specs, one batch per row
        assert not log.duplicated(["spec", "first_example"]).any()
        rows = st._db.execute("SELECT spec, example, count(*) FROM scores GROUP BY spec, example").fetchall()
        assert len(rows) == 3 * n and all(count == 1 for _, _, count in rows)
        assert st._db.execute("SELECT count(*) FROM leases").fetchone()[0] == 0
        assert st.errors_frame().shape == (n, 2)
    assert Path(tmp_path / "scores.sqlite").is_file()
