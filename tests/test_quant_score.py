"""Per-example quantization error and the resumable score store (interp.quant.store)."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

import interp
from interp.errors import InterpError, SpecError
from interp.quant import apply as qa
from interp.quant.store import REFERENCE, ScoreStore, score

SPECS = ["rtn:bits=3,group=32", "nf:bits=3,group=32"]
CANONICAL = ["rtn:bits=3,group=32,zero=float", "nf:bits=3,group=32"]


@pytest.fixture(scope="module")
def model():
    return interp.tiny_model("llama", seed=0, n_layers=2)


@pytest.fixture(scope="module")
def examples():
    g = torch.Generator().manual_seed(2)
    return interp.Examples.from_tokens(torch.randint(0, 256, (10, 20), generator=g), ids=[f"e{i}" for i in range(10)])


def test_errors_equal_independent_nll_difference(model, examples, tmp_path):
    errors = score(model, SPECS, examples, store=tmp_path, batch_size=4, progress=False)
    assert list(errors.columns) == CANONICAL and list(errors.index) == examples.ids
    ref = interp.nll(model, examples, batch_size=4).double()
    for spec, name in zip(SPECS, CANONICAL, strict=True):
        quant = interp.nll(qa.quantize(model, spec, progress=False), examples, batch_size=4).double()
        # same float32 scorer, same batches: the store holds exactly these values rounded to float32 NLLs
        # (interp.nll returns float32: each NLL ~5.5 is off by <= 5.5 eps32 / 2 = 3.3e-7, a difference by 6.6e-7)
        torch.testing.assert_close(torch.tensor(errors[name].to_numpy()), quant - ref, atol=1e-6, rtol=0)
    assert errors.abs().to_numpy().max() > 1e-4  # quantization did something


def test_scores_are_batch_invariant(model, examples, tmp_path):
    one = score(model, SPECS[:1], examples, store=tmp_path / "a", batch_size=1, progress=False)
    four = score(model, SPECS[:1], examples, store=tmp_path / "b", batch_size=4, progress=False)
    # batch 1 vs 4: float32 GEMM blocking and LSE order only, <= eps32 (2 Zmax + log2 V + V/256 + NLL) ~ 4e-6
    # per NLL on the tiny model; 1e-4 is loose on purpose for other CPUs' kernels (still 1/10 of any error)
    pd.testing.assert_frame_equal(one, four, atol=1e-4, rtol=0)
    nll_one = ScoreStore(tmp_path / "a").nll_frame()
    nll_four = ScoreStore(tmp_path / "b").nll_frame()
    pd.testing.assert_frame_equal(nll_one, nll_four, atol=1e-4, rtol=0)  # as above


def test_rerun_skips_finished_batches_and_never_duplicates(model, examples, tmp_path):
    first = score(model, SPECS, examples, store=tmp_path, batch_size=3, progress=False)
    with ScoreStore(tmp_path) as st:
        n_batches = len(st.batch_log())
    assert n_batches == 3 * 4  # (reference + 2 specs) x ceil(10 / 3)
    again = score(model, SPECS, examples, store=tmp_path, batch_size=3, progress=False)
    pd.testing.assert_frame_equal(first, again, atol=0, rtol=0)
    db = sqlite3.connect(tmp_path / "scores.sqlite")
    assert db.execute("SELECT COUNT(*) FROM batches").fetchone()[0] == n_batches
    assert db.execute("SELECT COUNT(*) FROM scores").fetchone()[0] == 3 * 10
    # a new spec only computes its own batches, and the reference is reused
    score(model, SPECS + ["rtn:bits=4,group=32"], examples, store=tmp_path, batch_size=3, progress=False)
    log = ScoreStore(tmp_path).batch_log()
    assert len(log) == n_batches + 4 and (log["spec"] == REFERENCE).sum() == 4


def test_kl_matches_an_independent_computation(model, examples, tmp_path):
    score(model, SPECS[:1], examples, store=tmp_path, batch_size=5, kl=True, progress=False)
    kl = ScoreStore(tmp_path).kl_frame(ids=examples.ids)
    assert (kl[REFERENCE] == 0).all()
    qmodel = qa.quantize(model, SPECS[0], progress=False)
    with torch.no_grad():
        log_p = torch.log_softmax(model.original_model(input_ids=examples.tokens).logits[:, :-1].double(), -1)
        log_q = torch.log_softmax(qmodel.original_model(input_ids=examples.tokens).logits[:, :-1].double(), -1)
    expected = (log_p.exp() * (log_p - log_q)).sum(-1).mean(-1)
    # KL in float32 (per-position sums of V = 259 terms) vs float64 from the same float32 logits:
    # <= V eps32 * KL relative ~ 3e-5 (worst case) plus eps32 absolute from log-softmax rounding
    torch.testing.assert_close(torch.tensor(kl[CANONICAL[0]].to_numpy()), expected, atol=1e-6, rtol=1e-4)
    assert (expected > 0).all()


def test_kl_added_later_fills_the_column_without_new_rows(model, examples, tmp_path):
    score(model, SPECS[:1], examples, store=tmp_path, batch_size=5, progress=False)
    before = ScoreStore(tmp_path).nll_frame()
    score(model, SPECS[:1], examples, store=tmp_path, batch_size=5, kl=True, progress=False)
    st = ScoreStore(tmp_path)
    pd.testing.assert_frame_equal(before, st.nll_frame(), atol=0, rtol=0)
    assert st.kl_frame()[CANONICAL[0]].notna().all()


def test_store_refuses_other_rows_under_the_same_ids(model, examples, tmp_path):
    score(model, SPECS[:1], examples, store=tmp_path, batch_size=5, progress=False)
    longer = interp.Examples.from_tokens(torch.randint(0, 256, (10, 24)), ids=examples.ids)
    with pytest.raises(InterpError, match="another output folder"):
        score(model, SPECS[:1], longer, store=tmp_path, batch_size=5, progress=False)


def test_clear_errors(model, examples, tmp_path):
    with pytest.raises(SpecError, match="calibration"):
        score(model, ["gptq:bits=3,group=32"], examples, store=tmp_path, progress=False)
    with pytest.raises(SpecError, match="valid methods"):
        score(model, ["zip:bits=3"], examples, store=tmp_path, progress=False)
    (tmp_path / "bad.sqlite").write_bytes(b"this is not a database" * 100)
    with pytest.raises(InterpError, match="not a usable score store"):
        ScoreStore(tmp_path / "bad.sqlite").done("m", "s")


# ---------------------------------------------------------------------------------------
# kill -9 and resume

_SCRIPT = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    import interp
    from interp.quant.store import score
    model = interp.tiny_model("llama", seed=0, n_layers=2)
    g = torch.Generator().manual_seed(5)
    ex = interp.Examples.from_tokens(torch.randint(0, 256, (N_EXAMPLES, 16), generator=g),
                                     ids=[f"x{i}" for i in range(N_EXAMPLES)])
    score(model, SPECS, ex, store=sys.argv[1], batch_size=2, progress=False, cache_dir=sys.argv[2])
    print("finished")
""")


def _run(store: Path, cache: Path, n_examples: int) -> subprocess.Popen:
    code = _SCRIPT.replace("N_EXAMPLES", str(n_examples)).replace("SPECS", repr(SPECS))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", code, str(store), str(cache)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _batches_done(store: Path) -> int:
    try:
        db = sqlite3.connect(store / "scores.sqlite", timeout=5)
        return int(db.execute("SELECT COUNT(*) FROM batches").fetchone()[0])
    except sqlite3.Error:
        return 0


@pytest.mark.slow
def test_kill_9_and_resume_gives_the_uninterrupted_result(tmp_path):
    n_examples, n_batches = 120, 3 * 60  # reference + 2 specs, batches of 2
    clean = _run(tmp_path / "clean", tmp_path / "cache", n_examples)
    assert "finished" in clean.communicate(timeout=600)[0]
    rng = random.Random(0)
    store = tmp_path / "killed"
    kills = []
    # kill at a random batch inside each third of the work, found by polling the store, so the
    # kills land mid-run however fast the machine is (a fixed sleep let a fast CI machine finish)
    for lo, hi in ((5, 55), (65, 115), (125, 170)):
        target = rng.randint(lo, hi)
        proc = _run(store, tmp_path / "cache", n_examples)
        while _batches_done(store) < target and proc.poll() is None:
            time.sleep(0.002)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            kills.append(_batches_done(store))
    # a kill that lands just after the last commit finds nothing left to interrupt; at least two
    # must have landed mid-run for the test to mean anything
    mid_run = [k for k in kills if 0 < k < n_batches]
    assert len(mid_run) >= 2, kills
    resumed = _run(store, tmp_path / "cache", n_examples)
    assert "finished" in resumed.communicate(timeout=600)[0]

    a, b = ScoreStore(tmp_path / "clean"), ScoreStore(store)
    pd.testing.assert_frame_equal(a.nll_frame(), b.nll_frame(), atol=0, rtol=0)
    assert b.nll_frame().shape == (n_examples, 3) and not b.nll_frame().isna().any().any()
    db = sqlite3.connect(store / "scores.sqlite")
    assert db.execute("SELECT COUNT(*) FROM scores").fetchone()[0] == 3 * n_examples
    # every batch was computed exactly once, across all the killed and resumed processes
    log = b.batch_log()
    assert len(log) == n_batches
    assert not log.duplicated(["spec", "first_example"]).any()
    assert log["pid"].nunique() >= 2


def test_cli_quantize_score_errors_end_to_end(tmp_path, monkeypatch):
    """The three subcommands on a tiny exported model and a small text file."""
    from interp.cli.main import main
    from interp.models import export_hf

    monkeypatch.delenv("BROWSER_PATH", raising=False)
    model_dir = export_hf(interp.tiny_model("llama", seed=0, n_layers=2), tmp_path / "model")
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "north", "seven", "green"]
    docs = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(160)]
    (tmp_path / "docs.txt").write_text("\n\n".join(docs))
    common = ["--model", str(model_dir), "--data", str(tmp_path / "docs.txt"), "--seq-len", "24", "--quiet"]
    assert main(["quantize", *common, "--method", "gptq:bits=3,group=32", "--calibration-n", "8",
                 "--out", str(tmp_path / "q")]) == 0
    assert qa.read_quant_info(tmp_path / "q")["spec"].startswith("gptq:bits=3,group=32")
    out = tmp_path / "s"
    assert main(["score", *common, "--n", "40", "--methods", "rtn:bits=3,group=32,gptq:bits=3,group=32",
                 "--calibration-n", "8", "--batch-size", "8", "--out", str(out)]) == 0
    errors = pd.read_csv(out / "errors.csv", index_col="example")
    assert errors.shape == (40, 2) and errors.notna().all().all()
    settings = json.loads((out / "settings.json").read_text())
    assert settings["calibration"]["split"] == "calibration"
    assert not set(settings["calibration"]["ids"]) & set(errors.index)
    assert set(settings["quantizer_timing"]) == set(errors.columns)
    assert settings["dtype"] == "float32"  # errors reloads the model in the dtype the scores were made in
    assert main(["errors", "--out", str(out), "--n-boot", "50", "--quiet", "--reference", str(model_dir)]) == 0
    analysis = out / "analysis"
    for name in ("agreement", "split", "norm_correlation", "reversal"):
        assert (analysis / f"{name}.csv").is_file()
        json.loads((analysis / f"{name}.json").read_text())
    for name in ("agreement", "split", "norm_correlation", "reversal_norms", "reversal_mse_corr"):
        assert (analysis / f"{name}.html").is_file()
    assert main(["errors", "--out", str(tmp_path / "nothing")]) == 2
