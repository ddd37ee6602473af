"""llama-cpp-curve-1 (issue 47): "where the bits go", measured from GGUF files.

- :func:`gguf_tensors` reads each tensor's type, weights and bytes; the bytes equal a hand count (F32 4 bytes a
  weight, F16 2, Q8_0 34 per block of 32, Q4_0 18 per 32), the arrays the test wrote, and the file's size less
  its header and the alignment padding.
- :func:`bits_table` groups a mix and its plans by role and third of the blocks; every number is checked
  against a naive count, and the shares of the mix's extra bytes are exact fractions.
- The page shows the table for a judged size whose verdict is not the goal, and only there; the ``--write``
  path records a size's mixes once and refuses mixes whose tensors differ.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "docs"))

import build_llama_cpp_curve as page_builder  # noqa: E402
import llama_cpp_curve_analysis as curve  # noqa: E402
import llama_cpp_curve_tensors as tensors  # noqa: E402

from interp.errors import DataError, SpecError  # noqa: E402

Q = gguf.GGMLQuantizationType
BY_HAND = {"f32": (4, 1), "f16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}  # bytes per this many weights
SHAPES = {"token_embd.weight": (32, 64), "output_norm.weight": (20,), **{
    f"blk.{i}.{role}.weight": (16, 64) for i in range(3) for role in ("attn_q", "ffn_down")},
    **{f"blk.{i}.attn_norm.weight": (20,) for i in range(3)}}
MIX = {"token_embd.weight": "q8_0", **{f"blk.{i}.attn_q.weight": "q8_0" for i in range(3)},
       "blk.0.ffn_down.weight": "q4_0", "blk.1.ffn_down.weight": "f16", "blk.2.ffn_down.weight": "q4_0"}
PLAN_A = {**MIX, "blk.0.ffn_down.weight": "q8_0", "blk.1.ffn_down.weight": "q4_0", "blk.2.attn_q.weight": "q4_0"}
PLAN_B = {**PLAN_A, "blk.0.ffn_down.weight": "f16"}


def by_hand(ggml_type: str, weights: int) -> int:
    per, block = BY_HAND[ggml_type]
    assert weights % block == 0
    return weights // block * per


def write_gguf(path: Path, types: dict[str, str]) -> dict[str, int]:
    """A GGUF of :data:`SHAPES` (unlisted tensors F32) with ``types``; returns each tensor's array bytes as written."""
    writer = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    written = {}
    for name, shape in SHAPES.items():
        values = rng.standard_normal(shape).astype(np.float32)
        kind = types.get(name, "f32")
        if kind == "f32":
            array, raw = values, None
        elif kind == "f16":
            array, raw = values.astype(np.float16), None
        else:
            array, raw = gguf.quants.quantize(values, Q[kind.upper()]), Q[kind.upper()]
        writer.add_tensor(name, array, raw_dtype=raw)
        written[name] = array.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def test_each_tensors_bytes_equal_a_hand_count_the_written_arrays_and_the_file_size(tmp_path):
    path = tmp_path / "mix.gguf"
    written = write_gguf(path, MIX)
    found = tensors.gguf_tensors(path)
    assert [t["name"] for t in found] == list(SHAPES)
    for t in found:
        weights = int(np.prod(SHAPES[t["name"]]))
        assert t["type"] == MIX.get(t["name"], "f32") and t["weights"] == weights
        assert t["bytes"] == by_hand(t["type"], weights) == written[t["name"]]
    header = gguf.GGUFReader(str(path)).data_offset
    padded = sum(-(-t["bytes"] // 32) * 32 for t in found)  # GGUF's default alignment
    assert any(t["bytes"] % 32 for t in found)  # the padding is exercised (a 20-weight F32 norm: 80 bytes)
    assert path.stat().st_size - header == padded
    record = tensors.tensor_record(path, ["mix"])
    assert record["file"] == "mix" and record["file_bytes"] == path.stat().st_size and record["tensors"] == found


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(SpecError, match="cannot read"):
        tensors.gguf_tensors(bad)


@pytest.mark.parametrize("name,row", [("blk.7.ffn_down.weight", ("ffn_down", "last")),
                                      ("blk.0.attn_q.weight", ("attn_q", "first")),
                                      ("blk.3.attn_q.weight", ("attn_q", "middle")),
                                      ("blk.2.attn_q.weight", ("attn_q", "first")),
                                      ("blk.5.attn_output.weight", ("attn_output", "middle")),
                                      ("blk.6.attn_q.weight", ("attn_q", "last")),
                                      ("token_embd.weight", ("token_embd", "all")),
                                      ("output.weight", ("output", "all")),
                                      ("blk.4.attn_norm.weight", (tensors.OTHER, "all")),
                                      ("blk.4.attn_q.bias", (tensors.OTHER, "all")),
                                      ("rope_freqs.weight", (tensors.OTHER, "all"))])
def test_rows_by_role_and_third_of_eight_blocks(name, row):
    """Eight blocks: 3 * layer // 8 puts 0-2 in the first third, 3-5 in the middle, 6-7 in the last."""
    assert tensors.row_of(name, 8) == row


def test_the_table_against_a_naive_count(tmp_path):
    """Three blocks (one a third). The mix spends more on blk.1.ffn_down (F16 against the plans' Q4_0: 1472 bytes)
    and blk.2.attn_q (Q8_0 against Q4_0: 512 bytes): shares 1472/1984 and 512/1984. The plans spend more on
    blk.0.ffn_down (Q8_0 and F16, mean 1568 bytes against 576)."""
    write_gguf(tmp_path / "m.gguf", MIX)
    mix = tensors.gguf_tensors(tmp_path / "m.gguf")
    plans = []
    for i, types in enumerate((PLAN_A, PLAN_B)):
        write_gguf(tmp_path / f"p{i}.gguf", types)
        plans.append(tensors.gguf_tensors(tmp_path / f"p{i}.gguf"))
    rows = {(r["role"], r["third"]): r for r in tensors.bits_table(mix, plans)}
    members = {("token_embd", "all"): ["token_embd.weight"],
               **{(role, third): [f"blk.{i}.{role}.weight"] for role in ("attn_q", "ffn_down")
                  for i, third in enumerate(tensors.THIRDS)},
               (tensors.OTHER, "all"): ["output_norm.weight", *(f"blk.{i}.attn_norm.weight" for i in range(3))]}
    assert list(rows) == [*members, (tensors.TOTAL, "all")]  # the row order: embedding, roles by third, other

    def count(types: dict[str, str], names: list[str]) -> int:
        return sum(by_hand(types.get(n, "f32"), int(np.prod(SHAPES[n]))) for n in names)

    for key, names in members.items():
        r = rows[key]
        weights = sum(int(np.prod(SHAPES[n])) for n in names)
        mix_bytes, plan_bytes = count(MIX, names), (count(PLAN_A, names) + count(PLAN_B, names)) / 2
        assert (r["weights"], r["mix_bytes"], r["plan_bytes"]) == (weights, mix_bytes, plan_bytes)
        assert r["mix_bits"] == 8 * mix_bytes / weights and r["plan_bits"] == 8 * plan_bytes / weights
        assert r["difference"] == r["mix_bits"] - r["plan_bits"]
    assert rows["ffn_down", "middle"]["mix_bits"] == 16.0 and rows["ffn_down", "middle"]["plan_bits"] == 4.5
    assert rows["ffn_down", "first"]["plan_bits"] == 12.25 and rows["ffn_down", "first"]["extra_share"] is None
    shares = {k: r["extra_share"] for k, r in rows.items() if r["extra_share"] is not None}
    assert shares == {("ffn_down", "middle"): 1472 / 1984, ("attn_q", "last"): 512 / 1984, (tensors.TOTAL, "all"): 1.0}
    assert rows[tensors.OTHER, "all"]["mix_bits"] == 32.0 and rows[tensors.OTHER, "all"]["mix_types"] == "f32 x4"
    assert rows["ffn_down", "first"]["plan_types"] == "f16 x1, q8_0 x1"
    total = rows[tensors.TOTAL, "all"]
    everything = list(SHAPES)
    assert total["weights"] == sum(int(np.prod(s)) for s in SHAPES.values())
    assert total["mix_bytes"] == count(MIX, everything) == sum(t["bytes"] for t in mix)
    assert total["plan_bytes"] == (count(PLAN_A, everything) + count(PLAN_B, everything)) / 2


def test_a_plan_of_another_model_is_refused(tmp_path):
    write_gguf(tmp_path / "m.gguf", MIX)
    mix = tensors.gguf_tensors(tmp_path / "m.gguf")
    with pytest.raises(DataError, match="other tensors"):
        tensors.bits_table(mix, [mix[:-1]])
    with pytest.raises(DataError, match="at least one plan"):
        tensors.bits_table(mix, [])


# ---------------------------------------------------------------------------------------
# The page and the --write path


SEEDS = (41, 42, 43)
N, WIDTH = 32, 10


def _result(factors: dict[str, float]) -> dict:
    """A model's result where, at each size, both arms' per-token KL is ``factor`` times both baselines'."""
    rng = np.random.default_rng(0)
    design = curve.Design(list(factors), dict.fromkeys(factors, True), SEEDS, n_boot=200, mc_seeds=(1, 2, 3))
    scores = {}
    for size, factor in factors.items():
        bases = [rng.uniform(0.5, 1.5, size=(N, WIDTH)) for _ in SEEDS]
        scores[curve.stem(curve.PLAIN, size)] = curve.FileScores(bases[0].mean(1), bases[0], np.ones((N, WIDTH), bool),
                                                                 1000)
        for kind, scale in (("mix_interp_imatrix", 1.0), ("mix_llama_imatrix", 1.0), ("plan_mean", factor),
                            ("plan_tail", factor)):
            for seed, b in zip(SEEDS, bases, strict=True):
                x = scale * b
                scores[curve.stem(kind, size, seed)] = curve.FileScores(x.mean(1), x, np.ones((N, WIDTH), bool), 999)
    result = curve.analyse_model(scores, design)
    sizes = {size: {"bytes": 1000, "judged": True} for size in factors}
    return {**result, "sizes": {"sizes": sizes}, "n_boot": 200, "seeds": list(SEEDS),
            "examples": {"heldout_ids": list(range(N))}}


def test_the_page_shows_where_the_bits_go_only_where_the_goal_is_not_met(tmp_path):
    """Q4_K_M at half the baselines' KL meets the goal; Q3_K_M at 0.9 of it does not (both arms). The plan_mean
    records are written, plan_tail's are not: its row says so."""
    folder = tmp_path / "tensor_types"
    folder.mkdir()
    write_gguf(tmp_path / "mix.gguf", MIX)
    (folder / "mix_plain-Q3_K_M.json").write_text(json.dumps(tensors.tensor_record(tmp_path / "mix.gguf")))
    for seed, types in zip(SEEDS, (PLAN_A, PLAN_B, PLAN_A), strict=True):
        write_gguf(tmp_path / f"plan-{seed}.gguf", types)
        (folder / f"plan_mean-Q3_K_M-{seed}.json").write_text(
            json.dumps(tensors.tensor_record(tmp_path / f"plan-{seed}.gguf")))
    result = _result({"Q4_K_M": 0.5, "Q3_K_M": 0.9})
    assert result["primary"]["Q4_K_M"]["plan_mean"]["verdict"] == curve.GOAL
    assert result["primary"]["Q3_K_M"]["plan_mean"]["verdict"] == curve.BEATS
    section = page_builder.model_section("smollm2-135m", result, folder)
    assert "Where the bits go" in section
    assert f"**Q3_K_M, plan (mean)** ({curve.BEATS}):" in section
    assert "**Q3_K_M, plan (worst 10%)**" in section and "no tensor-type record (mix_plain-Q3_K_M.json" not in section
    assert "no tensor-type record (plan_tail-Q3_K_M-41.json, plan_tail-Q3_K_M-42.json" in section
    assert "Q4_K_M, plan" not in section
    rows = tensors.bits_table(tensors.gguf_tensors(tmp_path / "mix.gguf"),
                              [tensors.gguf_tensors(tmp_path / f"plan-{s}.gguf") for s in SEEDS])
    assert page_builder.where_the_bits_go(rows) in section
    line = next(x for x in section.splitlines() if x.startswith("| ffn_down | middle |"))
    assert line == "| ffn_down | middle | 1024 | 16.000 (f16 x1) | 4.500 (q4_0 x3) | +11.500 | 74.2% |"  # 1472/1984
    passing = page_builder.model_section("smollm2-135m", _result({"Q4_K_M": 0.5}), folder)
    assert "Where the bits go" not in passing and "| ffn_down |" not in passing


def test_the_write_path_records_each_mix_kind_once_and_each_fitting_plan(tmp_path):
    """Without a build: files written here stand for llama-quantize's. A size's mixes share their tensors, so one
    record per kind and size; a plan that did not fit has none; a mix whose tensors differ is refused."""
    import llama_cpp_curve as bench

    run = tmp_path / "run"
    (run / "gguf").mkdir(parents=True)
    reg = {"calibration": {"seeds": [41, 42]}}
    s = bench.Setup(reg, "", "test", run / "source.gguf", ["Q3_K_M"], tmp_path, run)
    write_gguf(s.gguf("mix_plain-Q3_K_M"), MIX)
    for seed in (41, 42):
        for kind in curve.BASELINES.values():
            write_gguf(s.gguf(curve.stem(kind, "Q3_K_M", seed)), MIX)
        write_gguf(s.gguf(curve.stem("plan_mean", "Q3_K_M", seed)), PLAN_A)
    plans = {curve.stem(arm, "Q3_K_M", seed): {"fits": arm == "plan_mean"} for arm in curve.ARMS for seed in (41, 42)}
    (run / "plans.json").write_text(json.dumps(plans))
    written = bench.write_size_records(s, "Q3_K_M", tmp_path / "out", plans)
    assert sorted(p.stem for p in written) == sorted(bench.record_names(s, "Q3_K_M", plans))
    assert sorted(p.name for p in written) == ["mix_interp_imatrix-Q3_K_M.json", "mix_llama_imatrix-Q3_K_M.json",
                                               "mix_plain-Q3_K_M.json", "plan_mean-Q3_K_M-41.json",
                                               "plan_mean-Q3_K_M-42.json"]
    record = tensors.read_record(tmp_path / "out" / "mix_llama_imatrix-Q3_K_M.json")
    assert record["stands_for"] == ["mix_llama_imatrix-Q3_K_M-41", "mix_llama_imatrix-Q3_K_M-42"]
    assert record["tensors"] == tensors.gguf_tensors(s.gguf("mix_plain-Q3_K_M"))
    assert tensors.read_record(tmp_path / "out" / "plan_mean-Q3_K_M-42.json")["tensors"] == tensors.gguf_tensors(
        s.gguf("plan_mean-Q3_K_M-42"))
    write_gguf(s.gguf("mix_interp_imatrix-Q3_K_M-42"), PLAN_A)
    with pytest.raises(SystemExit, match="mix_interp_imatrix-Q3_K_M-42.gguf holds other tensor types"):
        bench.write_size_records(s, "Q3_K_M", tmp_path / "out", plans)


def _kept_setup(tmp_path, run_name="run", keep_name="keep"):
    import llama_cpp_curve as bench

    reg = {"calibration": {"seeds": [41, 42]}}
    return bench.Setup(reg, "sha-1", "test", tmp_path / "source.gguf", ["Q3_K_M"], tmp_path, tmp_path / run_name,
                       keep=tmp_path / keep_name)


def test_the_kept_state_goes_to_a_new_machine_and_back(tmp_path):
    """A run keeps its small files as it goes (never a GGUF file); a run in an empty folder on another machine
    restores exactly those, appends its start to run.json, and what it adds is kept in turn."""
    import llama_cpp_curve as bench

    first = _kept_setup(tmp_path)
    (first.run / "gguf").mkdir(parents=True)
    (first.run / "scores").mkdir()
    (first.run / "run.json").write_text(json.dumps({"registration_sha256": "sha-1", "model": "test", "starts": [1]}))
    (first.run / "imatrix-interp-41.gguf").write_bytes(b"imatrix")
    (first.run / "scores" / "mix_plain-Q3_K_M.parquet").write_bytes(b"scores")
    (first.run / "gguf" / "mix_plain-Q3_K_M.gguf").write_bytes(b"weights")
    (first.run / "calibration-41.txt").write_text("text")  # remade from the data; not kept
    bench.keep_state(first)
    assert [str(p) for p in bench.kept_files(first.keep)] == [
        "imatrix-interp-41.gguf", "run.json", "scores/mix_plain-Q3_K_M.parquet"]
    second = _kept_setup(tmp_path, "elsewhere")
    second.run.mkdir()
    assert bench.restore_state(second) == 3
    assert bench.kept_files(second.run) == bench.kept_files(first.keep)
    assert (second.run / "imatrix-interp-41.gguf").read_bytes() == b"imatrix"
    assert not (second.run / "gguf").exists() and bench.restore_state(second) == 0
    (second.run / "scores" / "mix_plain-Q3_K_M.safetensors").write_bytes(b"positions")
    bench.keep_state(second)
    assert (first.keep / "scores" / "mix_plain-Q3_K_M.safetensors").read_bytes() == b"positions"


def test_a_kept_state_of_another_run_is_refused_before_anything_is_copied(tmp_path):
    """Results are combined only with what was computed from identical inputs: a kept folder of another
    registration text or model, or a file present in both places with other bytes, stops the run."""
    import llama_cpp_curve as bench

    s = _kept_setup(tmp_path)
    s.keep.mkdir()
    s.run.mkdir()
    (s.keep / "run.json").write_text(json.dumps({"registration_sha256": "sha-0", "model": "test", "starts": []}))
    with pytest.raises(SystemExit, match="another registration text or model"):
        bench.restore_state(s)
    (s.keep / "run.json").write_text(json.dumps({"registration_sha256": "sha-1", "model": "test", "starts": []}))
    (s.keep / "imatrix-llama-41.gguf").write_bytes(b"one")
    (s.keep / "sizes.json").write_text("{}")
    (s.run / "imatrix-llama-41.gguf").write_bytes(b"two")
    with pytest.raises(SystemExit, match="differ in imatrix-llama-41.gguf"):
        bench.restore_state(s)
    assert not (s.run / "sizes.json").exists()  # nothing copied


def test_a_size_is_done_only_when_all_its_files_are_scored_and_recorded(tmp_path):
    """A resumed run remakes the GGUF files of the sizes not done only; 'done' needs every plan recorded, every
    file's two score files and every tensor-type record."""
    import llama_cpp_curve as bench

    s = _kept_setup(tmp_path)
    (s.run / "scores").mkdir(parents=True)
    (s.run / "tensor_types").mkdir()
    assert not bench.size_done(s, "Q3_K_M")
    plans = {curve.stem(arm, "Q3_K_M", seed): {"fits": arm == "plan_mean"} for arm in curve.ARMS for seed in (41, 42)}
    (s.run / "plans.json").write_text(json.dumps(plans))
    names = bench.file_names(s, "Q3_K_M", plans)
    assert len(names) == 1 + 2 * 2 + 2  # plain, two imatrix mixes per seed, the fitting plans
    for name in names:
        (s.run / "scores" / f"{name}.parquet").write_bytes(b"")
    assert not bench.size_done(s, "Q3_K_M")
    for name in names:
        (s.run / "scores" / f"{name}.safetensors").write_bytes(b"")
    for name in bench.record_names(s, "Q3_K_M", plans)[:-1]:
        (s.run / "tensor_types" / f"{name}.json").write_text("{}")
    assert not bench.size_done(s, "Q3_K_M")
    (s.run / "tensor_types" / f"{bench.record_names(s, 'Q3_K_M', plans)[-1]}.json").write_text("{}")
    assert bench.size_done(s, "Q3_K_M")
