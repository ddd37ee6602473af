"""The confirmatory protocol (interp.report.confirm): pre-registration checks, held-out examples, the
crossed-design statistics against naive loops, and the whole run and analysis on a tiny random model."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import interp
from interp.errors import InterpError
from interp.report import confirm, confirm_run
from interp.report import reproduction as rp


def _prereg(tmp_path, data, **overrides):
    d = {"name": "tiny", "model": "tiny", "data": str(data), "n": 40, "seq_len": 32, "seed": 5,
         "calibration_n": 6, "calibration_seeds": [1, 2, 3], "free_specs": ["rtn:bits=3,group=32"],
         "calibrated_specs": ["gptq:bits=3,group=32", "awq:bits=3,group=32"], "patched_spec": "gptq:bits=3,group=32",
         "exclude_seq_lens": [32], "exclude_prefix": 10, "top": 0.1, "min_d_large": 2, "n_boot": 60,
         "restoration_null_draws": 2, "split_fractions": [0.33, 0.5, 0.67], "batch_size": 8,
         "criteria": confirm.criteria_fingerprint(), **overrides}
    path = tmp_path / "prereg.json"
    path.write_text(json.dumps(d))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """300 documents of 40-90 random words (the byte tokenizer: at least 32 tokens each)."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "north", "field", "tower", "glass", "ember"]
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    with path.open("w") as f:
        for i in range(300):
            text = " ".join(rng.choice(words, size=int(rng.integers(40, 90))))
            f.write(json.dumps({"id": f"doc{i}", "text": text}) + "\n")
    return path


def test_fingerprint_is_stable_and_changes_with_a_criterion(monkeypatch):
    first = confirm.criteria_fingerprint()
    assert first == confirm.criteria_fingerprint()
    monkeypatch.setattr(rp, "LITTLE", 0.4)
    assert confirm.criteria_fingerprint() != first


def test_fingerprint_binds_the_code_of_rules_and_statistics(monkeypatch):
    """Same text and constants, different behaviour: a rule's code or a statistic's code changes the fingerprint."""
    first = confirm.criteria_fingerprint()

    def other_interval(samples, level=0.95):  # the percentile interval, written differently
        return tuple(np.percentile(samples, [50 - 50 * level, 50 + 50 * level]))

    monkeypatch.setattr(confirm.pr, "interval", other_interval)
    assert confirm.criteria_fingerprint() != first
    monkeypatch.undo()
    claim = rp.CLAIMS["kurtosis"]
    monkeypatch.setitem(rp.CLAIMS, "kurtosis", dataclasses.replace(claim, rule=lambda m: rp.judge("gate_input", m)))
    assert confirm.criteria_fingerprint() != first


def test_preregistration_is_checked(tmp_path, corpus):
    p = confirm.Preregistration.load(_prereg(tmp_path, corpus))
    p.check_criteria()
    assert len(p.sha256) == 64
    with pytest.raises(InterpError, match="changed after pre-registration"):
        confirm.Preregistration.load(_prereg(tmp_path, corpus, criteria="0" * 64)).check_criteria()
    with pytest.raises(InterpError, match="at least 3 calibrated instances"):
        confirm.Preregistration.load(_prereg(tmp_path, corpus, calibration_seeds=[1, 2]))
    with pytest.raises(InterpError, match="patched_spec must be one of"):
        confirm.Preregistration.load(_prereg(tmp_path, corpus, patched_spec="rtn:bits=3,group=32"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(InterpError, match="lacks the pre-registration field"):
        confirm.Preregistration.load(bad)


@pytest.mark.parametrize("name", ["smollm2-confirmatory-2", "gemma3-confirmatory-1"])
def test_committed_preregistration_matches_the_rules(name):
    """The open registrations' fingerprint is today's: neither the rules nor the statistics changed after them."""
    p = confirm.Preregistration.load(confirm.PREREG_DIR / f"{name}.json")
    p.check_criteria()
    assert len(p.calibration_seeds) - 1 >= 5  # instance 0 selects, at least 5 are measured
    assert p.n >= 256


def test_an_exclusion_must_name_a_registration_on_the_same_model(tmp_path, corpus):
    """Held-out sets are recomputed with the run's tokenizer: excluding another model's registration would exclude
    other documents than the ones it used, so loading refuses it."""
    for name in ("smollm2-confirmatory-1", "no-such-registration"):
        with pytest.raises(InterpError, match="only a registration on the same model"):
            confirm.Preregistration.load(_prereg(tmp_path, corpus, exclude_preregistrations=[name]))


def test_registration_1_is_kept_and_refused_by_todays_code(tmp_path):
    """Registration 1 stays as it was (its column was judged under its rules), and neither a run nor an analysis
    under today's rules accepts it."""
    p = confirm.Preregistration.load(confirm.PREREG_DIR / "smollm2-confirmatory-1.json")
    summary = json.loads((confirm.REPO / "docs" / "data" / "reproduction" / "smollm2-confirmatory-1" / "summary.json")
                         .read_text())
    assert summary["criteria"] == p.criteria and summary["preregistration_sha256"] == p.sha256
    with pytest.raises(InterpError, match="changed after pre-registration"):
        confirm.analyse(p, tmp_path)


def test_heldout_examples_avoid_every_earlier_prefix(tmp_path, corpus):
    p = confirm.Preregistration.load(_prereg(tmp_path, corpus))
    tok = interp.models.tiny_tokenizer()
    held = confirm.heldout_examples(tok, p)
    earlier = interp.load_examples(str(corpus), tok, n=None, seq_len=32, seed=0, split="eval").ids[:10]
    assert len(held) == 40 and not set(held.ids) & set(earlier)
    assert len(set(held.ids)) == 40


def test_vectorised_recovery_and_margin_match_a_loop():
    """The patching statistics on a [B, n] row array equal the same formula per row set (float64, same sums)."""
    rng = np.random.default_rng(1)
    n = 12
    data = {"target": rng.normal(3, 0.3, n), "source": rng.normal(2, 0.3, n),
            "patched": {c: rng.normal(2.5, 0.3, n) for c in ("down", "gate", "up", "attn_out")},
            "gate_input": rng.normal(2.4, 0.3, n), "gate_weights_restored": rng.normal(2.9, 0.3, n)}
    rows = rng.integers(0, n, size=(5, n))
    got = confirm._recovery(data, rows, "gate")
    for b, r in enumerate(rows):
        t, s_, v = data["target"][r].mean(), data["source"][r].mean(), data["patched"]["gate"][r].mean()
        assert got[b] == pytest.approx((t - v) / (t - s_), abs=1e-12)
    claims, table = confirm._patch_claims([data, data], n_boot=30, seed=0)
    down = claims["patch_down"]
    assert down.estimates["instances"].value == 2
    assert rp.judge("patch_down", down).verdict == rp.INSTANCE_LIMITED
    assert table.loc[0, "between_instance_sd"] == 0.0


@pytest.mark.slow
def test_run_and_analyse_on_a_tiny_model(tmp_path, corpus, monkeypatch):
    """The whole protocol on a 2-layer random llama: every raw file written, a resumed run recomputes
    nothing, and the analysis judges every quantization claim."""
    monkeypatch.setenv("INTERP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(confirm_run, "load_model", lambda name: interp.tiny_model("llama"))  # the run loads it
    p = confirm.Preregistration.load(_prereg(tmp_path, corpus))
    out = confirm.run(p, tmp_path / "run", progress=False)
    files = sorted(x.name for x in (out / "localize").iterdir())
    assert files == ["early_exit#1.json", "early_exit#2.json", "norms.json", "patching#1.json", "patching#2.json",
                     "restoration#1.json", "restoration#2.json", "reversal#1.json", "reversal#2.json",
                     "reversal_all#1.json", "reversal_all#2.json"]
    assert len(list((out / "token_nll").iterdir())) == 1 + 1 + 2 * 3
    stamps = {x: x.stat().st_mtime_ns for x in out.rglob("*.json") if x.parent.name == "localize"}
    confirm.run(p, out, progress=False)  # resumes: nothing recomputed
    assert {x: x.stat().st_mtime_ns for x in stamps} == stamps
    starts = json.loads((out / "examples.json").read_text())["starts"]  # each (re)start kept, with what was done
    assert len(starts) == 2 and starts[0]["token_files_done"] == [] and len(starts[1]["token_files_done"]) == 8
    assert all(s["kernels"] and s["threads"] >= 1 and s["commit"] and s["cpu"] for s in starts)
    weights = json.loads((out / "models.json").read_text())  # one quantized model per scored label, reused
    assert len(weights["scored"]) == 1 + 2 * 3
    assert sorted(weights["localized"]) == [confirm._label(p.patched_spec, i) for i in (1, 2)]
    assert all(weights["scored"][label] == d for label, d in weights["localized"].items())
    other = confirm.Preregistration.load(_prereg(tmp_path, corpus, seed=p.seed + 1))  # other held-out examples
    with pytest.raises(InterpError, match="give this run its own --out folder"):
        confirm.run(other, out, progress=False)
    result = confirm.analyse(p, out)
    table = result["reproduction"].set_index("claim")
    quant = [c for c in rp.CLAIMS.values() if c.paper == rp.QUANT_PAPER and c.key != "early_exit_logit"]
    measured = table.loc[[c.claim for c in quant], "measured here"]
    assert all(m not in ("not run", "") for m in measured)
    assert set(table["verdict"]) <= set(rp.VERDICTS)
    assert result["instances"] == 3 and result["d_large"] >= 2
    # the early-exit arithmetic on planted lens curves (a random model's lens is worse than uniform): the gap is
    # 0 at layer 0 and 1 at layer 1, so the split is layer 1 and the share after it is (2 - 1) / 2 = 0.5
    for i in (1, 2):
        path = out / "localize" / f"early_exit#{i}.json"
        curves = json.loads(path.read_text())
        n_large, n_ctrl = len(curves["reference/large"][0]), len(curves["reference/ctrl"][0])
        curves.update({"reference/large": [[1.0] * n_large] * 2, "quantized/large": [[1.0] * n_large, [2.0] * n_large],
                       "reference/ctrl": [[1.0] * n_ctrl] * 2, "quantized/ctrl": [[1.0] * n_ctrl] * 2})
        path.write_text(json.dumps(curves))
    planted = confirm.analyse(p, out)
    row = planted["reproduction"].set_index("claim").loc[rp.CLAIMS["early_exit_tuned"].claim]
    assert "50% [50%, 50%]" in row["measured here"]
    controls = planted["controls_early_exit"]
    assert set(controls["share"]) == {0.5} and len(controls) == 6
    written = confirm.write_results(result, tmp_path / "data")
    assert (written / "reproduction.csv").exists() and json.loads((written / "summary.json").read_text())["n"] == 40
    # the committed raw data regenerate every committed table (what `confirm --analyse-only` does)
    committed = confirm.write_results(planted, tmp_path / "committed", raw_from=out)
    again = confirm.analyse(p, committed / "raw")
    for name in ("reproduction", "controls_restoration", "controls_early_exit", "controls_h_mse_all_examples",
                 "patching", "noise_ceiling_pairs"):
        assert again[name].equals(planted[name]), name
    meta = json.loads((committed / "raw" / "examples.json").read_text())
    assert len(meta["ids"]) == 40 and meta["threads"] >= 1 and meta["commit"] and meta["kernels"]


def test_a_localization_on_other_weights_than_scored_is_recorded_and_said(tmp_path, capsys):
    """A resumed run whose quantized-model cache is gone quantizes again; where the weights differ from the ones
    the per-token NLL was scored with, models.json keeps both digests and the run says so."""
    folder = confirm._Folder(tmp_path)
    a, b = interp.tiny_model("llama", seed=0), interp.tiny_model("llama", seed=0)
    confirm._record_weights(folder, "scored", "m#1", a)
    confirm._record_weights(folder, "localized", "m#1", b)  # the same weights: silent
    assert capsys.readouterr().err == ""
    b.original_model.lm_head.weight.data[0, 0] += 1e-3
    confirm._record_weights(folder, "localized", "m#1", b)
    assert "m#1 is localized on other weights" in capsys.readouterr().err
    record = json.loads((tmp_path / "models.json").read_text())
    assert record["scored"]["m#1"] != record["localized"]["m#1"]


def test_analysis_of_an_unfinished_run_is_a_clear_error_and_writes_nothing(tmp_path, corpus):
    p = confirm.Preregistration.load(_prereg(tmp_path, corpus))
    out = tmp_path / "run"
    (out / "localize").mkdir(parents=True)
    with pytest.raises(InterpError, match="norms.json is missing"):
        confirm._Folder(out).read("norms")
    assert not list((out / "localize").iterdir())
    assert p.n == 40


def test_the_documented_command_matches_registration_2(tmp_path):
    """``python -m interp.report.confirm`` (the command docs/reproduction.md shows) computes the same fingerprint as
    an import: under ``-m`` the module runs as ``__main__``, whose function names would otherwise enter the hash and
    refuse every registration. On an empty folder it stops with the project's own error, creating nothing."""
    import subprocess
    import sys

    prereg = confirm.PREREG_DIR / "smollm2-confirmatory-2.json"
    done = subprocess.run([sys.executable, "-m", "interp.report.confirm", str(prereg), "--out", str(tmp_path / "run"),
                           "--analyse-only"], capture_output=True, text=True, timeout=300, cwd=confirm.REPO)
    assert done.returncode == 2, done.stderr
    # errors go to stderr, as every module command's do (interp.errors.exit_status)
    assert done.stderr.startswith("error: ") and "holds no run" in done.stderr and "Traceback" not in done.stderr
    assert "changed after pre-registration" not in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_committed_run_in_progress_belongs_to_its_registration():
    """A run committed between sessions (``docs/data/reproduction/<name>/run-in-progress``) is the registration's own:
    its examples.json names the registration's SHA-256 and as many held-out ids as it asks for, every token file is
    one of the run's labels, and each (re)start is recorded."""
    for folder in sorted((confirm.REPO / "docs" / "data" / "reproduction").glob("*/run-in-progress")):
        p = confirm.Preregistration.load(confirm.PREREG_DIR / f"{folder.parent.name}.json")
        meta = json.loads((folder / "examples.json").read_text())
        assert meta["preregistration_sha256"] == p.sha256 and len(meta["ids"]) == p.n
        assert meta["starts"] and all(s["commit"] and s["kernels"] for s in meta["starts"])
        labels = ["reference", *[confirm._label(s, None) for s in p.free_specs],
                  *[confirm._label(s, i) for i in range(len(p.calibration_seeds)) for s in p.calibrated_specs]]
        stems = {confirm._Folder(folder).token_path(label).stem for label in labels}
        assert {f.stem for f in (folder / "token_nll").glob("*.parquet")} <= stems


def _committed_runs():
    return sorted((confirm.REPO / "docs" / "data" / "reproduction").glob("*/raw/examples.json"))


@pytest.mark.parametrize("examples", _committed_runs(), ids=lambda p: p.parent.parent.name)
def test_every_committed_registration_recomputes_from_its_raw_data(examples):
    """One command, ``confirm --analyse-only`` on the committed ``raw/`` folder, regenerates every committed table
    of a registration: the verdicts exactly, the numbers to a tolerance far below their printed precision (float64
    sums of at most a few thousand terms on another CPU's vector width move by about n * 2**-52 relative, under
    1e-12; 1e-9 leaves room and is still a million times finer than the three printed decimals)."""
    import pandas as pd

    folder = examples.parent.parent
    p = confirm.Preregistration.load(confirm.PREREG_DIR / f"{folder.name}.json")
    meta = json.loads(examples.read_text())
    assert meta["preregistration_sha256"] == p.sha256 and len(meta["ids"]) == p.n
    result = confirm.analyse(p, folder / "raw")
    committed = pd.read_csv(folder / "reproduction.csv")
    assert list(result["reproduction"]["verdict"]) == list(committed["verdict"])
    assert list(result["reproduction"]["claim"]) == list(committed["claim"])
    for name in ("controls_restoration", "controls_early_exit", "controls_h_mse_all_examples", "patching",
                 "noise_ceiling_pairs"):
        fresh, stored = result[name].reset_index(drop=True), pd.read_csv(folder / f"{name}.csv")
        assert list(fresh.columns) == list(stored.columns), name
        numeric = stored.select_dtypes("number").columns
        np.testing.assert_allclose(fresh[numeric].to_numpy(np.float64), stored[numeric].to_numpy(np.float64),
                                   rtol=1e-9, atol=1e-9, err_msg=name)
    summary = json.loads((folder / "summary.json").read_text())
    assert (summary["n"], summary["d_large"], summary["instances"]) == (result["n"], result["d_large"],
                                                                         result["instances"])


def test_a_committed_registration_is_complete():
    """Guards the test above from passing on nothing: registration 2's analysis is committed with its raw data."""
    assert any(p.parent.parent.name == "smollm2-confirmatory-2" for p in _committed_runs())
