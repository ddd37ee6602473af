"""Multi-process scoring (interp.quant.distributed) against a single-process ``score`` run.

The torchrun test starts 2 ranks on CPU (gloo). Both sides use one torch thread per
process (2 cores / 2 ranks on the distributed side, ``set_num_threads(1)`` here), and the
shards are whole batches of the single-process run, so the forwards are the same
computations on the same inputs and the float32 token NLLs are bit-identical. An example's
NLL is the float64 mean of its T - 1 = 15 token NLLs and its error the difference of two such
means; only those float64 sums may run in another order, so the comparisons allow
``_mean_tol`` (~1e-14, see below) and no more. A real difference in batching moves the float32
token NLLs, i.e. shows up at ~1e-7 and above.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch

import interp
from interp.quant.distributed import merge_shards, shard_bounds, shard_path
from interp.quant.store import ScoreStore, score

SPECS = ["rtn:bits=3,group=64", "nf:bits=4,group=64"]
N, T, BATCH = 14, 16, 4  # 4 batches (the last one short): rank 0 gets 2, rank 1 gets 2

DRIVER = """
import sys, torch, interp
from interp.quant.distributed import score_distributed

folder, store, out = sys.argv[1:4]
model = interp.load_model(folder)
g = torch.Generator().manual_seed(0)
ex = interp.Examples.from_tokens(torch.randint(0, 256, ({n}, {t}), generator=g))
errors = score_distributed(model, {specs!r}, ex, store, batch_size={batch}, progress=False)
if errors is not None:
    errors.to_parquet(out)
print("rank done", torch.get_num_threads())
"""


def _mean_tol(nll: pd.DataFrame, means: int = 1) -> float:
    """Two float64 evaluations of ``means`` means of T - 1 float32 values each of size <= max|NLL|.

    A mean of n values takes n - 1 additions and a division: n roundings of values whose
    magnitudes add up to <= n max|NLL|, i.e. <= n u max|NLL| per evaluation (Higham, Accuracy and
    Stability of Numerical Algorithms, 2nd ed., 2002, section 4.2), any summation order; two
    evaluations differ by twice that, n eps max|NLL|. An error is a difference of 2 means.
    """
    return means * (T - 1) * torch.finfo(torch.float64).eps * float(nll.abs().to_numpy().max())


def _examples() -> interp.Examples:
    g = torch.Generator().manual_seed(0)
    return interp.Examples.from_tokens(torch.randint(0, 256, (N, T), generator=g))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp: Path, folder: Path, store: Path, out: Path) -> subprocess.CompletedProcess[str]:
    script = tmp / "driver.py"
    script.write_text(textwrap.dedent(DRIVER.format(n=N, t=T, specs=SPECS, batch=BATCH)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(script), str(folder), str(store), str(out)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.parametrize("n,batch,world", [(14, 4, 2), (12, 4, 2), (3, 8, 4), (100, 8, 3), (0, 8, 2)])
def test_shard_bounds_cover_in_whole_batches(n: int, batch: int, world: int) -> None:
    bounds = [shard_bounds(n, batch, r, world) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    for (_, e0), (s1, _) in zip(bounds, bounds[1:], strict=False):
        assert e0 == s1  # contiguous, disjoint
    for s, e in bounds:
        assert s % batch == 0 and (e % batch == 0 or e == n)


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, Path]:
    """One 2-rank torchrun of the driver: (tmp, HF folder, main store, the errors as parquet)."""
    tmp = tmp_path_factory.mktemp("dist")
    folder = tmp / "tiny"
    interp.models.export_hf(interp.tiny_model("llama", seed=0), folder)
    store, out = tmp / "dist", tmp / "errors.parquet"
    _torchrun(tmp, folder, store, out)
    return tmp, folder, store, out


@pytest.mark.slow
def test_torchrun_matches_single_process(torchrun_run: tuple[Path, Path, Path, Path]) -> None:
    tmp_path, folder, store, out = torchrun_run
    dist_errors = pd.read_parquet(out)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = score(interp.load_model(folder), SPECS, _examples(), store=tmp_path / "single",
                       batch_size=BATCH, progress=False)
    finally:
        torch.set_num_threads(threads)

    assert list(dist_errors.index) == list(single.index) == _examples().ids
    assert list(dist_errors.columns) == list(single.columns)
    assert not dist_errors.isna().any().any()
    with ScoreStore(tmp_path / "single") as st1:
        single_nll = st1.nll_frame(ids=_examples().ids)
    diff = (dist_errors - single).abs().to_numpy().max()
    assert diff <= _mean_tol(single_nll, means=2), diff

    with ScoreStore(store) as st:
        rows = st._db.execute("SELECT count(*), count(DISTINCT model || spec || example) FROM scores").fetchone()
        assert rows == (N * 3, N * 3)  # reference + 2 specs, no duplicates, none missing
        log = st.batch_log()
        # 4 batches x 3 passes, each computed once, by two different processes
        assert len(log) == 12 and log.pid.nunique() == 2
        assert not log.duplicated(["model", "spec", "first_example"]).any()
        nll = st.nll_frame(ids=_examples().ids)
    assert (nll - single_nll).abs().to_numpy().max() <= _mean_tol(single_nll)
    for r in range(2):
        assert shard_path(store, r).exists()


@pytest.mark.slow
def test_torchrun_rerun_computes_and_merges_nothing_again(torchrun_run: tuple[Path, Path, Path, Path]) -> None:
    tmp_path, folder, store, out = torchrun_run
    before = pd.read_parquet(out)
    _torchrun(tmp_path, folder, store, out)  # as after a kill: every batch is done
    with ScoreStore(store) as st:
        assert len(st.batch_log()) == 12
        assert st._db.execute("SELECT count(*) FROM scores").fetchone()[0] == N * 3
    assert (pd.read_parquet(out) - before).abs().to_numpy().max() == 0


def test_merge_is_idempotent_and_resumes_a_killed_shard(tmp_path: Path) -> None:
    model = interp.tiny_model("llama", seed=0)
    ex = _examples()
    main = tmp_path / "store"
    # shard 0 finished; shard 1 "killed" after its first batch (it scored only the reference on one batch)
    s0, e0 = shard_bounds(N, BATCH, 0, 2)
    s1, e1 = shard_bounds(N, BATCH, 1, 2)
    score(model, SPECS[:1], ex.subset(list(range(s0, e0))), store=shard_path(main, 0), batch_size=BATCH,
          progress=False)
    score(model, SPECS[:1], ex.subset(list(range(s1, s1 + BATCH))), store=shard_path(main, 1),
          batch_size=BATCH, progress=False)
    shards = [shard_path(main, 0), shard_path(main, 1)]
    first = merge_shards(main, shards)
    assert first == 2 * (e0 - s0) + 2 * BATCH
    assert merge_shards(main, shards) == 0
    with ScoreStore(main) as st:
        assert len(st.batch_log()) == 2 * 2 + 2 * 1
    # resume shard 1, then merge again: only the new rows and log lines arrive
    score(model, SPECS[:1], ex.subset(list(range(s1, e1))), store=shard_path(main, 1), batch_size=BATCH,
          progress=False)
    assert merge_shards(main, shards) == 2 * (e1 - s1 - BATCH)
    with ScoreStore(main) as st:
        log = st.batch_log()
        assert len(log) == 2 * 4 and not log.duplicated(["model", "spec", "first_example"]).any()
        errors = st.errors_frame(specs=None, ids=ex.ids)
        nll = st.nll_frame(ids=ex.ids)
    single = score(model, SPECS[:1], ex, store=tmp_path / "single", batch_size=BATCH, progress=False)
    assert (errors[single.columns] - single).abs().to_numpy().max() <= _mean_tol(nll, means=2)


# ---------------------------------------------------------------------------------------
# torchrun's variables are read strictly (interp.runtime.torchrun.world): empty, half-set or inconsistent ones are
# a clear error, never a silent rank 0 of 1


@pytest.mark.parametrize("env, fragment", [
    ({"RANK": "1", "WORLD_SIZE": ""}, "WORLD_SIZE='' is not a whole number"),
    ({"RANK": "", "WORLD_SIZE": "2"}, "RANK='' is not a whole number"),
    ({"RANK": "1"}, "WORLD_SIZE missing"),
    ({"WORLD_SIZE": "2"}, "RANK missing"),
    ({"LOCAL_RANK": "0"}, "RANK and WORLD_SIZE missing"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "disagree"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "disagree"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "not a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK='x'"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1"}, "disagree"),
])
def test_empty_or_half_set_torchrun_variables_are_a_clear_error(monkeypatch, env, fragment):
    from interp.errors import InterpError
    from interp.runtime.distributed import world

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(InterpError, match=fragment):
        world()


def test_the_command_line_reads_torchrun_variables_through_the_same_door(monkeypatch, capsys, tmp_path):
    from interp.cli.main import main

    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "")
    assert main(["quantize", "--method", "rtn:bits=3", "--out", "q"]) == 2
    err = capsys.readouterr().err
    assert "WORLD_SIZE='' is not a whole number" in err and "Traceback" not in err


def test_complete_torchrun_variables_are_read(monkeypatch):
    from interp.runtime.distributed import world

    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert world() == (3, 1, 4)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name)
    assert world() == (0, 0, 1)
