"""The confirmatory protocol (interp.report.confirm): pre-registration checks, held-out examples, the
hierarchical bootstrap against a naive loop, and the whole run and analysis on a tiny random model."""

from __future__ import annotations

import json

import numpy as np
import pytest

import interp
from interp.errors import InterpError
from interp.report import confirm
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


def test_preregistration_is_checked(tmp_path, corpus):
    p = confirm.Preregistration.load(_prereg(tmp_path, corpus))
    p.check_criteria()
    assert len(p.sha256) == 64
    with pytest.raises(InterpError, match="criteria changed after pre-registration"):
        confirm.Preregistration.load(_prereg(tmp_path, corpus, criteria="0" * 64)).check_criteria()
    with pytest.raises(InterpError, match="at least 3 calibrated instances"):
        confirm.Preregistration.load(_prereg(tmp_path, corpus, calibration_seeds=[1, 2]))
    with pytest.raises(InterpError, match="patched_spec must be one of"):
        confirm.Preregistration.load(_prereg(tmp_path, corpus, patched_spec="rtn:bits=3,group=32"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(InterpError, match="lacks the pre-registration field"):
        confirm.Preregistration.load(bad)


def test_committed_preregistration_matches_the_rules():
    """The registered fingerprint is today's: the rules did not change after registration."""
    p = confirm.Preregistration.load(confirm.PREREG_DIR / "smollm2-confirmatory-1.json")
    p.check_criteria()
    assert p.n >= 512 and len(p.calibration_seeds) >= 3 and p.min_d_large >= 50


def test_heldout_examples_avoid_every_earlier_prefix(tmp_path, corpus):
    p = confirm.Preregistration.load(_prereg(tmp_path, corpus))
    tok = interp.models.tiny_tokenizer()
    held = confirm.heldout_examples(tok, p)
    earlier = interp.load_examples(str(corpus), tok, n=None, seq_len=32, seed=0, split="eval").ids[:10]
    assert len(held) == 40 and not set(held.ids) & set(earlier)
    assert len(set(held.ids)) == 40


def test_hierarchical_bootstrap_against_a_loop():
    rng = np.random.default_rng(1)
    data = [{"x": rng.normal(size=n)} for n in (7, 9, 8)]

    def mean(d, rows):
        return float(np.asarray(d["x"])[rows].mean())

    est = confirm.hierarchical(data, mean, n_boot=40, seed=3)
    loop_rng = np.random.default_rng(3)
    boot = []
    for _ in range(40):
        drawn = loop_rng.integers(0, 3, size=3)
        boot.append(np.mean([data[i]["x"][loop_rng.integers(0, len(data[i]["x"]), size=len(data[i]["x"]))].mean()
                             for i in drawn]))
    low, high = np.percentile(boot, [2.5, 97.5])
    assert est.value == pytest.approx(np.mean([d["x"].mean() for d in data]), abs=1e-12)
    assert (est.low, est.high) == pytest.approx((low, high), abs=1e-12)


@pytest.mark.slow
def test_run_and_analyse_on_a_tiny_model(tmp_path, corpus, monkeypatch):
    """The whole protocol on a 2-layer random llama: every raw file written, a resumed run recomputes
    nothing, and the analysis judges every quantization claim."""
    monkeypatch.setenv("INTERP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(confirm, "load_model", lambda name: interp.tiny_model("llama"))
    p = confirm.Preregistration.load(_prereg(tmp_path, corpus))
    out = confirm.run(p, tmp_path / "run", progress=False)
    files = sorted(x.name for x in (out / "localize").iterdir())
    assert files == ["early_exit#1.json", "early_exit#2.json", "norms.json", "patching#1.json", "patching#2.json",
                     "restoration#1.json", "restoration#2.json", "reversal#1.json", "reversal#2.json",
                     "reversal_all#1.json"]
    assert len(list((out / "token_nll").iterdir())) == 1 + 1 + 2 * 3
    stamps = {x: x.stat().st_mtime_ns for x in out.rglob("*.json") if x.parent.name == "localize"}
    confirm.run(p, out, progress=False)  # resumes: nothing recomputed
    assert {x: x.stat().st_mtime_ns for x in stamps} == stamps
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


def test_analysis_of_an_unfinished_run_is_a_clear_error_and_writes_nothing(tmp_path, corpus):
    p = confirm.Preregistration.load(_prereg(tmp_path, corpus))
    out = tmp_path / "run"
    (out / "localize").mkdir(parents=True)
    with pytest.raises(InterpError, match="norms.json is missing"):
        confirm._Folder(out).read("norms")
    assert not list((out / "localize").iterdir())
    assert p.n == 40
