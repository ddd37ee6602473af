"""llama-cpp-curve-1 (issue 47): the registered analysis on synthetic per-token data with known answers, the page
section against the committed data, and (with a llama.cpp build) the run's dry run end to end.

- :func:`resampled_percentiles` is ``numpy.percentile`` of each resample's positions, to the bit.
- Plans whose per-token KL is an exact multiple of the baseline's give that multiple as every ratio and every
  interval end; the verdicts follow the registered words at and around their thresholds, and a tail that is
  worse (a spike in p99.9, a lower same-top-token rate) stops the goal.
- The deciding bound is the interval end nearest its threshold in Monte Carlo SEs, read "on the boundary"
  within 2.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "docs"))

import build_llama_cpp_curve as page_builder  # noqa: E402
import llama_cpp_curve_analysis as curve  # noqa: E402

from interp.stats import Estimate, bootstrap_indices  # noqa: E402

BUILD = os.environ.get("LLAMA_CPP_BIN", "")
NO_BUILD = ("needs a llama.cpp build (LLAMA_CPP_BIN: llama-quantize, llama-imatrix, libllama.so; `make llama-cpp`) "
            "and llama-cpp-python's llama_cpp package importable (PYTHONPATH)")
HAVE_BUILD = bool(BUILD) and importlib.util.find_spec("llama_cpp") is not None


# ---------------------------------------------------------------------------------------
# Percentiles of resampled positions


@pytest.mark.parametrize("n,width,ties", [(8, 5, False), (24, 127, True), (3, 2, True)])
def test_resampled_percentiles_equal_numpy_on_every_resample(n, width, ties):
    rng = np.random.default_rng(n)
    values = rng.exponential(size=(n, width)).astype(np.float32).astype(np.float64)
    if ties:
        values = np.round(values, 1)  # many equal values: the order statistics must still be numpy's
    rows = bootstrap_indices(n, 200, seed=1)
    qs = (99.0, 99.9, 50.0, 0.0, 100.0)
    got = curve.resampled_percentiles(values, rows, qs)
    want = np.array([[np.percentile(values[r].ravel(), q) for q in qs] for r in rows])
    assert np.array_equal(got, want)
    everything = np.arange(n)[None]
    assert np.array_equal(curve.resampled_percentiles(values, everything, qs)[0], [np.percentile(values, q)
                                                                                  for q in qs])


def test_a_resample_without_the_top_values_reads_deeper():
    """One example holds every large value; resamples that leave it out need the whole order, not the top."""
    values = np.vstack([np.full(50, 100.0) + np.arange(50), np.random.default_rng(0).random((7, 50))])
    rows = np.array([[1, 2, 3, 4, 5, 6, 7, 1], [0, 0, 0, 0, 0, 0, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7]])
    got = curve.resampled_percentiles(values, rows, (99.0, 99.9, 10.0))
    want = np.array([[np.percentile(values[r].ravel(), q) for q in (99.0, 99.9, 10.0)] for r in rows])
    assert np.array_equal(got, want)


# ---------------------------------------------------------------------------------------
# Synthetic files with known answers


N, WIDTH, SEEDS = 64, 20, (41, 42, 43)


def _file(tokens: np.ndarray, same: np.ndarray | None = None, nbytes: int = 1000) -> curve.FileScores:
    same = np.ones(tokens.shape, dtype=bool) if same is None else same
    return curve.FileScores(tokens.mean(axis=1), tokens, same, nbytes)


def _bases(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(0.5, 1.5, size=(N, WIDTH)) for _ in SEEDS]


def _pairs(plans: list[curve.FileScores], bases: dict[str, list[curve.FileScores]]) -> dict[str, list[curve.Pair]]:
    return {b: list(zip(plans, files, strict=True)) for b, files in bases.items()}


def _judge(plans: list[np.ndarray], bases: dict[str, list[np.ndarray]], same: float = 1.0) -> dict:
    design = curve.Design(["Q4_K_M"], {"Q4_K_M": True}, SEEDS, n_boot=300, mc_seeds=(1, 2, 3, 4))
    mask = np.random.default_rng(5).random((N, WIDTH)) < same
    files = {b: [_file(x) for x in v] for b, v in bases.items()}
    return curve.judged_comparison(_pairs([_file(p, mask) for p in plans], files), design)


def test_a_plan_at_half_the_baselines_kl_everywhere_is_the_goal_with_every_ratio_exact():
    """Per-token KL exactly half each seed's baseline's (a power of two: exact in floating point): R is 0.5 and
    every tail ratio 0.5 in every resample, so each interval is the point."""
    bases = {"interp": _bases(0), "llama": _bases(1)}
    out = _judge([0.5 * b for b in bases["interp"]], bases)
    e = out["estimates"]
    for name in ("R_interp", "p99_interp", "p999_interp"):
        assert e[name]["estimate"] == e[name]["low"] == e[name]["high"] == 0.5
        assert e[name]["per_seed"] == [0.5, 0.5, 0.5]
    assert e["same_top_interp"]["estimate"] == e["same_top_llama"]["estimate"] == 0.0
    assert out["verdict"] == curve.GOAL and out["tails_worse"] == {"interp": [], "llama": []}


def test_a_plan_worse_than_the_baseline_loses():
    bases = {"interp": _bases(0), "llama": _bases(0)}
    out = _judge([1.25 * b for b in bases["interp"]], bases)
    assert out["estimates"]["R_interp"]["high"] == pytest.approx(-0.25, abs=1e-12)
    assert out["verdict"] == curve.LOSES


def test_a_worse_tail_stops_the_goal():
    """A quarter of the baseline's KL but 1% of positions spiking to 10: the mean falls by about 65% (the goal's
    reduction), the 99.9th percentile rises about sevenfold (worse), so the verdict is 'beats', not the goal."""
    bases = {"interp": _bases(0), "llama": _bases(1)}
    plans = []
    for b in bases["interp"]:
        p = 0.25 * b
        p[np.arange(13), np.arange(13) % WIDTH] = 10.0
        plans.append(p)
    out = _judge(plans, bases)
    assert out["estimates"]["R_interp"]["low"] >= 0.30 and out["estimates"]["R_llama"]["low"] >= 0.30
    assert out["estimates"]["p999_interp"]["low"] > 1 and "p999" in out["tails_worse"]["llama"]
    assert out["verdict"] == curve.BEATS


def test_a_lower_same_top_token_rate_is_worse():
    bases = {"interp": _bases(0), "llama": _bases(1)}
    out = _judge([0.5 * b for b in bases["interp"]], bases, same=0.9)
    assert out["estimates"]["same_top_interp"]["high"] < 0
    assert out["tails_worse"] == {"interp": ["same_top"], "llama": ["same_top"]}
    assert out["verdict"] == curve.BEATS


def test_the_goal_needs_both_baselines():
    """At half of interp-imatrix's KL but 0.9x llama-imatrix's, R_llama's lower end is 0.1: 'beats', not the goal;
    at 1.1x llama-imatrix's it 'loses' (either baseline suffices)."""
    interp_base = _bases(0)
    for factor, expected in ((0.9, curve.BEATS), (1.1, curve.LOSES)):
        llama_base = [0.5 * b / factor for b in interp_base]
        out = _judge([0.5 * b for b in interp_base], {"interp": interp_base, "llama": llama_base})
        assert out["estimates"]["R_llama"]["estimate"] == pytest.approx(1 - factor, abs=1e-12)
        assert out["verdict"] == expected


def test_noise_around_the_baseline_is_not_resolved():
    rng = np.random.default_rng(3)
    bases = {"interp": _bases(0), "llama": _bases(1)}
    out = _judge([b * rng.uniform(0.5, 1.5, size=(N, 1)) for b in bases["interp"]], bases)
    r = out["estimates"]["R_interp"]
    assert r["low"] < 0 < r["high"] and out["verdict"] == curve.UNRESOLVED


@pytest.mark.parametrize("low,high,expected", [(0.30, 0.5, curve.GOAL), (0.2999, 0.5, curve.BEATS),
                                               (1e-9, 0.5, curve.BEATS), (0.0, 0.5, curve.UNRESOLVED),
                                               (-0.2, 0.0, curve.UNRESOLVED), (-0.2, -1e-9, curve.LOSES)])
def test_verdict_words_at_their_thresholds(low, high, expected):
    good = Estimate(0.5, 0.4, 0.6)
    est = {"R_interp": Estimate((low + high) / 2, low, high), "R_llama": good}
    for b in ("interp", "llama"):
        est |= {f"p99_{b}": Estimate(0.9, 0.8, 1.0), f"p999_{b}": Estimate(0.9, 0.8, 1.0),
                f"same_top_{b}": Estimate(0.0, -0.01, 0.0)}  # ends exactly at their thresholds: not worse
    assert curve.verdict(est) == expected
    assert curve.verdict({"R_plain": est["R_interp"]}, ["plain"], tails=False) == expected


def test_the_deciding_bound_is_the_end_nearest_its_threshold_in_monte_carlo_errors():
    def record(r_low: float, p_low: float) -> dict:
        est = {"R_interp": (0.40, r_low, 0.50), "R_llama": (0.45, 0.40, 0.50), "p99_interp": (0.9, p_low, 1.1),
               "p999_interp": (0.9, 0.5, 1.2), "same_top_interp": (0.0, -0.01, 0.01),
               "p99_llama": (0.9, 0.5, 1.2), "p999_llama": (0.9, 0.5, 1.2), "same_top_llama": (0.0, -0.01, 0.01)}
        return {k: {"estimate": v[0], "low": v[1], "high": v[2]} for k, v in est.items()}

    registered = record(0.31, 0.95)
    replicas = [record(0.31 + d, 0.95 + d / 10) for d in (-0.01, 0.0, 0.01)]  # R_interp.low's MC SE 0.01
    out = curve.deciding_bound(curve.verdict, registered, replicas)
    bound = out["deciding_bound"]
    assert out["verdict"] == curve.GOAL and bound["bound"] == "R_interp.low" and bound["threshold"] == 0.30
    assert bound["mc_se"] == pytest.approx(0.01) and bound["distance_se"] == pytest.approx(1.0)
    assert out["reading"] == f"on the boundary: {curve.GOAL} / {curve.BEATS}"
    # 10 SEs from 0.30; p99_interp.low (0.05 below 1) and R_llama.low do not move over the replicas: infinitely far
    far = curve.deciding_bound(curve.verdict, record(0.40, 0.95), [record(0.40 + d, 0.95) for d in (-0.01, 0.01)])
    assert far["deciding_bound"]["bound"] == "R_interp.low" and far["reading"] == curve.GOAL
    assert far["deciding_bound"]["distance_se"] == pytest.approx(10 / math.sqrt(2))


def test_a_model_is_analysed_size_by_size_with_its_diagnostic_and_unfitted_sizes(tmp_path):
    """Two sizes: Q4_K_M judged, Q6_K a diagnostic (not judged) where the tail arm has no plan. The headline counts
    only judged sizes; every file gets a Pareto row; additivity is realized over predicted."""
    design = curve.Design(["Q4_K_M", "Q6_K"], {"Q4_K_M": True, "Q6_K": False}, SEEDS, n_boot=200, mc_seeds=(1, 2, 3),
                          no_plan={"Q6_K": ["plan_tail"]})
    scores = {}
    for i, size in enumerate(design.sizes):
        bases = _bases(i)
        scores[curve.stem(curve.PLAIN, size)] = _file(1.5 * bases[0], nbytes=900)
        for kind, scale in (("mix_interp_imatrix", 1.0), ("mix_llama_imatrix", 1.0), ("plan_mean", 0.5),
                            ("plan_tail", 0.5)):
            for seed, b in zip(SEEDS, bases, strict=True):
                if not (size == "Q6_K" and kind == "plan_tail"):
                    scores[curve.stem(kind, size, seed)] = _file(scale * b, nbytes=899)
    predicted = {curve.stem("plan_mean", "Q4_K_M", s): float(scores[curve.stem("plan_mean", "Q4_K_M", s)].kl.mean())
                 for s in SEEDS}
    result = curve.analyse_model(scores, design, predicted)
    assert result["primary"]["Q4_K_M"]["plan_mean"]["verdict"] == curve.GOAL
    assert result["primary"]["Q6_K"]["plan_mean"]["status"] == curve.NOT_JUDGED
    assert result["primary"]["Q6_K"]["plan_tail"]["status"] == curve.NO_PLAN
    assert result["headline"]["plan_mean"][curve.GOAL] == 1 and result["headline"]["plan_tail"][curve.NO_PLAN] == 1
    bases = _bases(0)
    expected = np.mean([1 - (0.5 * b).mean() / (1.5 * bases[0]).mean() for b in bases])
    plain = result["secondary"]["against_plain"]["Q4_K_M"]["plan_mean"]["estimates"]["R_plain"]
    assert plain["estimate"] == pytest.approx(expected, rel=1e-12)
    assert result["secondary"]["imatrix_choice"]["Q4_K_M"]["estimate"] == 0.0
    assert len(result["pareto"]) == 5 + 4 and all(x["ratio"] == 1.0 for x in result["secondary"]["additivity"])
    sizes = {"Q4_K_M": {"bytes": 900, "judged": True}, "Q6_K": {"bytes": 900, "judged": False}}
    section = page_builder.model_section("smollm2-135m", {**result, "sizes": {"sizes": sizes}, "n_boot": 200,
                                                          "examples": {"heldout_ids": list(range(N))}})
    assert f"**{curve.GOAL}" in section and curve.NO_PLAN in section and "Not run yet" not in section


# ---------------------------------------------------------------------------------------
# The page


def test_the_curve_section_is_generated_from_the_committed_data():
    page = (ROOT / "docs" / "prescribe.md").read_text()
    assert page_builder.render(page) == page, "run: python docs/build_llama_cpp_curve.py --write"
    block = page[page.index("<!-- curve1:begin -->"):page.index("<!-- curve1:end -->")]
    data = page_builder.results()
    for model in page_builder.MODELS:
        assert (f"#### {model}\n\n{page_builder.progress(model)}" in block) == (model not in data)
    edited = page.replace(block, block.replace("####", "#####", 1))
    assert edited != page and page_builder.render(edited) == page


def test_a_run_in_progress_says_which_sizes_are_scored(tmp_path):
    """Before its result, a model's section says how far its kept state got: a size counts once its tensor-type
    records are written (after its last score), never from scores alone; with no run.json, 'Not run yet'."""
    assert page_builder.progress("m", tmp_path).startswith("Not run yet")
    (tmp_path / "run.json").write_text("{}")
    assert page_builder.progress("m", tmp_path).startswith("In progress: 0 of its sizes scored (none yet)")
    (tmp_path / "sizes.json").write_text(json.dumps({"sizes": {"Q2_K": {}, "Q3_K_S": {}, "Q3_K_M": {}}}))
    (tmp_path / "tensor_types").mkdir()
    (tmp_path / "tensor_types" / "mix_plain-Q3_K_M.json").write_text("{}")
    (tmp_path / "tensor_types" / "plan_mean-Q3_K_S-41.json").write_text("{}")  # Q3_K_S not finished
    assert page_builder.progress("m", tmp_path).startswith("In progress: 1 of 3 sizes scored (Q3_K_M).")
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "Q2_K.json").write_text(json.dumps({"done": 32, "of": 256}))
    assert "Being scored (saved so far): Q2_K: 32 of 256 examples." in page_builder.progress("m", tmp_path)


def test_sizes_that_make_one_file_are_named_and_told_apart_from_files_that_differ(tmp_path):
    """Two sizes whose plain mixes hold the same tensors are named together; whether their rows are one
    measurement is read from every file's scores; a size with other tensors is not named."""
    def record(size: str, kind: str) -> None:
        (tmp_path / f"mix_plain-{size}.json").write_text(json.dumps(
            {"file": f"mix_plain-{size}", "file_bytes": 10, "stands_for": [],
             "tensors": [{"name": "blk.0.ffn_down.weight", "type": kind, "weights": 256, "bytes": 110}]}))

    for size, kind in (("Q2_K", "q2_k"), ("Q3_K_S", "q2_k"), ("Q3_K_M", "q3_k")):
        record(size, kind)
    row = {"kind": "plan_mean", "bytes": [9], "mean_kl": {"estimate": 0.5}, "p99": [1.0], "p999": [2.0],
           "same_top": [0.7]}
    r = {"sizes": {"sizes": {z: {} for z in ("Q2_K", "Q3_K_S", "Q3_K_M")}},
         "pareto": [{**row, "size": z} for z in ("Q2_K", "Q3_K_S", "Q3_K_M")]}
    text = page_builder.same_files(r, tmp_path)
    assert "the same plain mix for Q2_K and Q3_K_S (and every file" in text and "Q3_K_M" not in text
    r["pareto"][1] = {**row, "size": "Q3_K_S", "mean_kl": {"estimate": 0.6}}
    assert "Q2_K and Q3_K_S (their plans' files or scores differ)" in page_builder.same_files(r, tmp_path)
    record("Q3_K_S", "q4_k")
    assert page_builder.same_files(r, tmp_path) == ""


def test_committed_curve_results_recompute_from_their_scores():
    """Each committed model's registered (seed-0) estimates, recomputed from its committed per-example and
    per-token scores."""
    import llama_cpp_curve as bench

    data = page_builder.results()
    if not data:
        pytest.skip("no committed llama-cpp-curve-1 result yet (the run has not been made)")
    for model, result in data.items():
        folder = page_builder.DATA / model
        assert result["registration_sha256"] == bench.plans.registration(bench.NAME)[1]
        for size, arms in result["primary"].items():
            names = [curve.stem(k, size, s) for s in result["seeds"] for k in (*curve.BASELINES.values(), *curve.ARMS)
                     if (folder / "scores" / f"{curve.stem(k, size, s)}.parquet").exists()]
            scores = bench.load_scores(folder / "scores", names)
            base = {b: [scores[curve.stem(k, size, s)] for s in result["seeds"]] for b, k in curve.BASELINES.items()}
            for arm, p in arms.items():
                if "estimates" not in p:
                    continue
                plans = [scores[curve.stem(arm, size, s)] for s in result["seeds"]]
                again = curve.estimates(_pairs(plans, base), result["n_boot"], 0)
                for name, value in p["estimates"].items():
                    for key in ("estimate", "low", "high"):
                        assert again[name][key] == pytest.approx(value[key], rel=1e-9, abs=1e-15)


# ---------------------------------------------------------------------------------------
# The dry run, end to end


@pytest.mark.skipif(not HAVE_BUILD, reason=NO_BUILD)
def test_the_dry_run_makes_every_phase_and_resumes(tmp_path, monkeypatch):
    """Every phase on the tiny GGUF (2 sizes, 8 held-out examples, 2 seeds): each plan's file is at most every
    baseline of its seed and holds its tensor-type file's types; every file has per-position scores; a second run
    finds everything made and gives the same result."""
    import llama_cpp_curve as bench
    from safetensors.numpy import load_file

    from interp.quant.llama_cpp import read_tensor_types
    from interp.quant.llama_cpp_run import block_types

    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", BUILD)
    run, keep = tmp_path / "dry", tmp_path / "kept"
    result = bench.main(["--dry-run", "--run", str(run), "--keep", str(keep)])
    sizes = result["sizes"]["sizes"]
    assert list(sizes) == ["Q2_K", "Q4_K_M"] and all(v["judged"] for v in sizes.values())
    for name, plan in result["plans"].items():
        assert plan["fits"] and plan["bytes"] <= plan["limit"] == min(
            (run / "gguf" / f"{n}.gguf").stat().st_size for n in (
                curve.stem(curve.PLAIN, name.split("-")[1]),
                *(curve.stem(k, name.split("-")[1], int(name.split("-")[2])) for k in curve.BASELINES.values())))
        planned = {p.replace("\\", ""): t for p, t in read_tensor_types(run / f"{name}.txt")}
        assert {k: t for k, (t, _) in block_types(run / "gguf" / f"{name}.gguf").items()} == planned
    for path in (run / "scores").glob("*.safetensors"):
        arrays = load_file(str(path))
        assert arrays["kl"].shape == (8, 127) and arrays["kl"].dtype == np.float32 and arrays["same_top"].max() <= 1
    assert len(list((run / "scores").glob("*.parquet"))) == 2 * (1 + 2 * 2 + 2 * 2)
    assert sum(sum(c.values()) for c in result["headline"].values()) == 2 * 2
    assert set(result["examples"]["heldout_ids"]).isdisjoint(bench.earlier_ids(bench.OUT))
    made = {p: p.stat().st_mtime_ns for p in run.rglob("*.gguf")}
    again = bench.main(["--dry-run", "--run", str(run), "--keep", str(keep)])
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*.gguf")} == made  # nothing remade
    assert json.dumps(again["primary"], sort_keys=True) == json.dumps(result["primary"], sort_keys=True)
    assert len(json.loads((run / "run.json").read_text())["starts"]) == 2
    assert "dry-run" in page_builder.model_section("dry-run", again)
    # the --write path, into the dry run's own folder: each file's tensor types as llama-quantize stored them
    import llama_cpp_curve_tensors as tensors

    records = run / "written" / "tensor_types"
    assert sorted(p.stem for p in records.glob("*.json")) == sorted(
        [f"{k}-{size}" for k in curve.KINDS[:3] for size in sizes] + list(result["plans"]))
    for path in records.glob("*.json"):
        record = tensors.read_record(path)
        assert record["tensors"] == tensors.gguf_tensors(run / "gguf" / f"{record['file']}.gguf")
    section = page_builder.model_section("dry-run", again, records)
    assert "no tensor-type record" not in section
    assert ("Where the bits go" in section) == any(p.get("verdict") not in (None, curve.GOAL)
                                                   for arms in again["primary"].values() for p in arms.values())
    # another machine: only the kept state, one size's plan score and records lost; that size's GGUF files are
    # made again (the plan's with its recorded bytes), only the lost file is scored, and the result is the same
    assert not list(keep.rglob("*.gguf*")) or all(p.name.startswith("imatrix-") for p in keep.rglob("*.gguf"))
    lost = curve.stem("plan_mean", "Q2_K", 41)
    for path in [keep / "scores" / f"{lost}.parquet", keep / "scores" / f"{lost}.safetensors",
                 *(keep / "tensor_types").glob("*Q2_K*")]:
        path.unlink()
    elsewhere = tmp_path / "elsewhere"
    moved = bench.main(["--dry-run", "--run", str(elsewhere), "--keep", str(keep)])
    assert json.dumps(moved["primary"], sort_keys=True) == json.dumps(result["primary"], sort_keys=True)
    remade = sorted(p.stem for p in (elsewhere / "gguf").glob("*.gguf"))
    assert remade == sorted(["ref-f32", curve.stem(curve.PLAIN, "Q2_K"), *(n for n in moved["plans"] if "-Q2_K-" in n),
                             *(curve.stem(k, "Q2_K", seed) for seed in (41, 42) for k in curve.BASELINES.values())])
    assert (keep / "scores" / f"{lost}.parquet").is_file() and len(json.loads((keep / "run.json").read_text())[
        "starts"]) == 3


@pytest.mark.skipif(not HAVE_BUILD, reason=NO_BUILD)
def test_llama_cpp_logits_do_not_depend_on_the_thread_count(tmp_path, monkeypatch):
    """The run scores with one thread by default (LLAMA_THREADS): the tiny model's logits are the same bits with
    1 and 2 threads, for the F32 file and a K-quant mix."""
    from tiny_gguf import write_tiny_gguf

    from interp.quant.llama_cpp_run import quantize

    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", BUILD)
    from llama_cpp import Llama

    source = write_tiny_gguf(tmp_path / "tiny.gguf")
    mix = quantize(Path(BUILD), source, tmp_path / "q3_k_m.gguf", "Q3_K_M")
    rows = np.random.default_rng(0).integers(3, 259, size=(2, 64)).tolist()
    for path in (source, mix):
        logits = []
        for threads in (1, 2):
            llm = Llama(model_path=str(path), n_ctx=64, n_batch=64, n_threads=threads, n_threads_batch=threads,
                        logits_all=True, verbose=False)
            for row in rows:
                llm.reset()
                llm.eval(row)
                logits.append(np.array(llm.scores[:63], dtype=np.float32))
            llm.close()
        assert np.array_equal(np.stack(logits[:2]), np.stack(logits[2:]))


# ---------------------------------------------------------------------------------------
# Scoring resumes after a kill (a fake llama_cpp, so this runs without a build)

class _Killed(Exception):
    pass


def _fake_llama_cpp(monkeypatch, seen: list[int], kill_at: int | None = None, nan_file: str | None = None):
    """A stand-in for llama_cpp.Llama: logits drawn from the file's bytes and the row, so every file and row has
    its own; ``seen`` gets the index (first token) of each row the reference evaluates; at ``kill_at`` it raises."""
    import hashlib
    import types

    class Llama:
        def __init__(self, model_path: str, n_ctx: int, **_: object) -> None:
            data = Path(model_path).read_bytes()
            self.seed = int.from_bytes(hashlib.sha256(data).digest()[:4], "little")
            self.is_ref = Path(model_path).stem == "ref-f32"
            self.nan = Path(model_path).stem == nan_file
            self.scores = np.zeros((0, 0), dtype=np.float32)

        def reset(self) -> None:
            pass

        def eval(self, row: list[int]) -> None:
            if self.is_ref:
                if kill_at is not None and row[0] == kill_at:
                    raise _Killed
                seen.append(row[0])
            self.scores = np.random.default_rng([self.seed, *row]).normal(size=(len(row), 13)).astype(np.float32)
            if self.nan:
                self.scores[1, 3] = np.nan

        def close(self) -> None:
            pass

    module = types.ModuleType("llama_cpp")
    module.Llama = Llama  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_cpp", module)


def _scoring_run(folder: Path, names: list[str]):
    import types

    (folder / "gguf").mkdir(parents=True)
    for i, name in enumerate(["ref-f32", *names]):
        (folder / "gguf" / f"{name}.gguf").write_bytes(bytes([i]) * (40 + i))
    return types.SimpleNamespace(run=folder, keep=None, gguf=lambda n: folder / "gguf" / f"{n}.gguf")


def _rows(n: int = 20, width: int = 6):
    import torch

    rows = torch.stack([torch.tensor([i] + [(7 * i + 3 * j) % 13 for j in range(1, width)]) for i in range(n)])
    return rows  # row i starts with token i, so the fake knows which example it evaluates


def _scores(folder: Path, names: list[str]) -> dict[str, dict[str, np.ndarray]]:
    import pandas as pd
    from safetensors.numpy import load_file

    out = {}
    for m in names:
        arrays = load_file(str(folder / "scores" / f"{m}.safetensors"))
        frame = pd.read_parquet(folder / "scores" / f"{m}.parquet")
        out[m] = {**arrays, **{c: frame[c].to_numpy() for c in ("kl", "nll", "ref_nll", "same_top")}}
    return out


def test_a_killed_size_resumes_at_its_last_save_with_the_uninterrupted_scores(tmp_path, monkeypatch):
    """Killed at example 13 with saves every 8, the rerun evaluates only examples 8-19 and writes exactly the
    uninterrupted run's scores; the partial is gone afterwards. Switching off the reuse (or its input check) fails
    this test or the next."""
    import llama_cpp_curve as bench

    names, rows = ["Q2_K", "plan_mean-Q2_K-41"], _rows()
    seen: list[int] = []
    _fake_llama_cpp(monkeypatch, seen)
    whole = _scoring_run(tmp_path / "whole", names)
    bench.score_group(whole, names, rows, "Q2_K", save_every=8)
    assert seen == list(range(20))

    seen.clear()
    _fake_llama_cpp(monkeypatch, seen, kill_at=13)
    killed = _scoring_run(tmp_path / "killed", names)
    with pytest.raises(_Killed):
        bench.score_group(killed, names, rows, "Q2_K", save_every=8)
    assert json.loads((killed.run / "partial" / "Q2_K.json").read_text())["done"] == 8
    assert not (killed.run / "scores").exists()

    seen.clear()
    _fake_llama_cpp(monkeypatch, seen)
    bench.score_group(killed, names, rows, "Q2_K", save_every=8)
    assert seen == list(range(8, 20))
    expected, got = _scores(whole.run, names), _scores(killed.run, names)
    for m in names:
        for key, value in expected[m].items():
            np.testing.assert_array_equal(got[m][key], value, err_msg=f"{m} {key}")
    assert not list((killed.run / "partial").iterdir())


def test_saved_scores_of_other_inputs_are_not_reused(tmp_path, monkeypatch):
    """One scored file's bytes changed after the save: the rerun starts again from example 0."""
    import llama_cpp_curve as bench

    names, rows = ["Q2_K", "plan_mean-Q2_K-41"], _rows()
    seen: list[int] = []
    _fake_llama_cpp(monkeypatch, seen, kill_at=13)
    s = _scoring_run(tmp_path / "run", names)
    with pytest.raises(_Killed):
        bench.score_group(s, names, rows, "Q2_K", save_every=8)
    s.gguf("plan_mean-Q2_K-41").write_bytes(b"other bytes")
    seen.clear()
    _fake_llama_cpp(monkeypatch, seen)
    bench.score_group(s, names, rows, "Q2_K", save_every=8)
    assert seen == list(range(20))



def test_the_key_names_the_code_that_runs_not_the_file_as_edited_since(tmp_path, monkeypatch):
    """The key's code part is the scoring source as imported. Reading the file at each call (inspect.getsource)
    keyed a run's later sizes with whatever lines the edited file had there: this test fails when partial_key reads
    the source again."""
    import inspect

    import llama_cpp_curve as bench

    names, rows = ["Q2_K", "plan_mean-Q2_K-41"], _rows()
    s = _scoring_run(tmp_path / "run", names)
    before = bench.partial_key(s, names, rows)
    monkeypatch.setattr(inspect, "getsource", lambda obj: "lines the file has after an edit")
    assert bench.partial_key(s, names, rows) == before
    monkeypatch.setattr(bench, "SCORING_SOURCE", bench.SCORING_SOURCE + "# other code")
    assert bench.partial_key(s, names, rows) != before  # the code is part of the key

def test_a_non_finite_score_writes_nothing(tmp_path, monkeypatch):
    import llama_cpp_curve as bench

    names, rows = ["Q2_K", "plan_mean-Q2_K-41"], _rows(n=4)
    _fake_llama_cpp(monkeypatch, [], nan_file="Q2_K")
    s = _scoring_run(tmp_path / "run", names)
    with pytest.raises(SystemExit, match="non-finite KL or NLL for Q2_K"):
        bench.score_group(s, names, rows, "Q2_K", save_every=8)
    assert not (s.run / "scores").exists()


def test_scores_equal_a_naive_kl_nll_and_top_token_per_position(tmp_path, monkeypatch):
    """The scored KL(ref || file), NLL and same-top rate equal a per-position loop over the fake's logits that
    normalises each distribution itself (softmax by division, no log-sum-exp). Both are float64 sums of 13
    terms of size <= ~10, so they agree to well under 1e-12 (about 13 x 10 x 2.2e-16 = 3e-14 per position)."""
    import hashlib

    import llama_cpp_curve as bench
    from safetensors.numpy import load_file

    names, rows = ["Q2_K", "plan_mean-Q2_K-41"], _rows(n=5)
    _fake_llama_cpp(monkeypatch, [])
    s = _scoring_run(tmp_path / "run", names)
    bench.score_group(s, names, rows, "Q2_K", save_every=8)

    def logits_of(name: str, row: list[int]) -> np.ndarray:
        seed = int.from_bytes(hashlib.sha256(s.gguf(name).read_bytes()).digest()[:4], "little")
        raw = np.random.default_rng([seed, *row]).normal(size=(len(row), 13)).astype(np.float32)
        return raw[:-1].astype(np.float64)

    frames = _scores(s.run, names)
    for i, row in enumerate(rows.tolist()):
        ref = logits_of("ref-f32", row)
        for m in names:
            z = logits_of(m, row)
            kl, nll, same = [], [], []
            for t in range(len(row) - 1):
                p = np.exp(ref[t]) / np.exp(ref[t]).sum()
                q = np.exp(z[t]) / np.exp(z[t]).sum()
                kl.append(sum(p[v] * np.log(p[v] / q[v]) for v in range(13)))
                nll.append(-np.log(q[row[t + 1]]))
                same.append(np.argmax(z[t]) == np.argmax(ref[t]))
            per_token = load_file(str(s.run / "scores" / f"{m}.safetensors"))["kl"][i]  # stored as float32
            np.testing.assert_allclose(per_token, kl, rtol=2 ** -23, atol=1e-12)
            assert abs(frames[m]["kl"][i] - np.mean(kl)) < 1e-12
            assert abs(frames[m]["nll"][i] - np.mean(nll)) < 1e-12
            assert frames[m]["same_top"][i] == np.mean(same)


class _HeldOut(list):
    tokens = None


def test_sizes_scores_only_the_named_sizes_in_their_order(tmp_path, monkeypatch):
    """``--sizes Q6_K,Q4_K_M``: phase_scores goes through those two sizes only, in that order (a second process
    scores from the other end of the curve), skipping one already done; a run without it goes through every size."""
    import types

    import llama_cpp_curve as bench

    scored: list[str] = []
    monkeypatch.setattr(bench, "size_done", lambda s, size: size == "Q4_K_M")
    monkeypatch.setattr(bench, "remake_plan", lambda *a: None)
    monkeypatch.setattr(bench, "file_names", lambda s, size, record: [f"mix_plain-{size}"])
    monkeypatch.setattr(bench, "score_group", lambda s, names, rows, size: scored.append(size))
    monkeypatch.setattr(bench, "write_size_records", lambda *a: [])
    monkeypatch.setattr(bench, "keep_state", lambda s: None)
    sizes = ["Q2_K", "Q4_K_M", "Q5_K_M", "Q6_K"]
    s = types.SimpleNamespace(run=tmp_path, sizes=sizes, seeds=[41], score_sizes=["Q6_K", "Q4_K_M", "Q2_K"])
    rows = _HeldOut()
    bench.phase_scores(s, rows, {})
    assert scored == ["Q6_K", "Q2_K"]
    scored.clear()
    s.score_sizes = None
    bench.phase_scores(s, rows, {})
    assert scored == ["Q2_K", "Q5_K_M", "Q6_K"]


def test_a_run_with_sizes_stops_after_its_scores_without_the_analysis(tmp_path, monkeypatch):
    import types

    import llama_cpp_curve as bench

    for phase in ("restore_state", "record_start", "keep_state", "phase_imatrices", "phase_imatrix_mixes",
                  "phase_sensitivity", "phase_plans", "phase_scores"):
        monkeypatch.setattr(bench, phase, lambda *a: {})
    monkeypatch.setattr(bench, "phase_mixes", lambda s: {"sizes": {}})
    monkeypatch.setattr(bench, "examples", lambda s, tokenizer: (None, {}))
    monkeypatch.setattr(bench.interp, "load_model", lambda name: types.SimpleNamespace(tokenizer=None))
    monkeypatch.setattr(bench, "analyse", lambda s: pytest.fail("analysed a run that scored part of the curve"))
    s = types.SimpleNamespace(run=tmp_path / "run", model="m", source=tmp_path, binary=tmp_path,
                              score_sizes=["Q6_K"])
    assert bench.run_model(s, write=False) == {"scored": ["Q6_K"]}
    assert not (s.run / "result.json").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--sizes", "Q9_K"], "name each size once, from Q2_K, Q3_K_S"),
    (["--sizes", "Q6_K,Q6_K"], "name each size once"),
    (["--sizes", " , "], "name each size once"),
    (["--sizes", "Q6_K", "--write"], "nothing to --write"),
])
def test_a_wrong_sizes_option_is_refused_before_any_work(tmp_path, monkeypatch, argv, message):
    import llama_cpp_curve as bench

    for tool in ("llama-quantize", "llama-imatrix"):
        (tmp_path / tool).write_text("")
    monkeypatch.setenv("LLAMA_CPP_BIN", str(tmp_path))
    monkeypatch.setattr(bench, "run_model", lambda *a: pytest.fail("work began before --sizes was checked"))
    with pytest.raises(SystemExit, match=message):
        bench.main(["--model", "smollm2-135m", *argv])


def test_the_mix_roles_diagnostic_agrees_with_the_curve_and_is_rendered(tmp_path):
    """The diagnostic scored plain Q3_K_M and Q3_K_L again in its own run: their mean KL must equal the curve's
    committed scores of the same files (same files, examples and code; the two runs agreed to 2e-15 per example),
    and the page's paragraph is rendered from its JSON (nothing without it)."""
    import build_llama_cpp_curve as page
    import pandas as pd

    r = json.loads(page.DIAGNOSTIC.read_text())
    scores = page.DATA / "smollm2-135m" / "scores"
    for label in ("Q3_K_M", "Q3_K_L"):
        curve = pd.read_parquet(scores / f"mix_plain-{label}.parquet")
        assert abs(r["files"][label]["mean_kl"] - float(curve["kl"].mean())) < 1e-12
        assert r["files"][label]["bytes"] == int(curve["bytes"].iloc[0])  # byte for byte the same file
    text = page.diagnostic_section()
    for label, f in r["files"].items():
        assert f"| {label} | {f['bytes']:,} | {f['mean_kl']:.4f} |" in text
    assert page.diagnostic_section(tmp_path / "absent.json") == ""
