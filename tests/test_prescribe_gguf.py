"""``interp prescribe --gguf``: one command from a plan to a llama.cpp file measured against llama.cpp's own mix.

- The registered plans come out of the command's allocation: registrations 2, 3 and 7's committed
  tensor-type files are what :func:`interp.quant.prescribe.choose_llama_types` picks from their
  committed Fisher scores, with the candidates ``--types`` names and the room ``--target-size MIX`` gives.
- Without a llama.cpp build the command writes the tensor-type file, the imatrix and the held-out
  text, and prints the commands (always runs, on a tiny GGUF written here: ``tests/tiny_gguf.py``).
- With a build (``LLAMA_CPP_BIN``, e.g. ``make llama-cpp``) it runs them: the plan's file is at most the
  mix's, holds the planned types, and the commands it records remake it byte for byte and print the KL it
  reported. On SmolLM2 the command the docs name reproduces registration 3's seed-31 plan file.
"""

from __future__ import annotations

import importlib
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from tiny_gguf import write_tiny_gguf

from interp.errors import ModelLoadError, SpecError, ToolError
from interp.quant import llama_cpp_run as run
from interp.quant.llama_cpp import gguf_name, read_tensor_types, tensor_type_lines

pr = importlib.import_module("interp.quant.prescribe")  # the module; interp.quant.prescribe is the function
ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "prescribe" / "llama-cpp"
BUILD = os.environ.get("LLAMA_CPP_BIN", "")
NO_BUILD = "needs a llama.cpp build: set LLAMA_CPP_BIN to the folder of llama-quantize and llama-perplexity " \
           "(`make llama-cpp` builds one)"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


def _registered(name: str) -> list[tuple[str, int, str]]:
    reg = json.loads((ROOT / "docs" / "preregistration" / f"{name}.json").read_text())
    return [(name, seed, size) for seed in reg["calibration"]["seeds"] for size in reg["sizes"]]


# ---------------------------------------------------------------------------------------
# Every registered plan from the command's allocation


@pytest.mark.parametrize("name,seed,size", [*_registered("llama-cpp-plans-2"), *_registered("llama-cpp-plans-3"),
                                            *_registered("llama-cpp-plans-7")])
def test_registered_plans_come_out_of_the_commands_allocation(name, seed, size):
    """Given a registration's committed sensitivity, the command's choice (``--types`` the registered candidates,
    ``--target-size SIZE``: the mix's block bytes by interp's rule) is the committed tensor-type file, item for item.

    The order of the items differs: the benchmark wrote them sorted by (layer, role name), the command writes
    them in the model's order. llama-quantize takes the first pattern that matches, and each item names one
    tensor exactly, so the order changes nothing."""
    from safetensors.numpy import load_file

    from interp.models import _bundled_gguf

    reg = json.loads((ROOT / "docs" / "preregistration" / f"{name}.json").read_text())
    try:
        shapes = run.gguf_shapes(_bundled_gguf(reg["model"]))
    except ModelLoadError as error:
        pytest.skip(f"{reg['model']} is not installed here ({error})")
    folder = DATA / name
    meta = json.loads((folder / f"sensitivity-{seed}.json").read_text())
    arrays = load_file(str(folder / f"sensitivity-{seed}.safetensors"))
    table = arrays["per_chunk"].sum(axis=2) / arrays["tokens"].sum()
    scored = {(layer, role): {t: float(table[w, o]) for o, t in enumerate(opts)}
              for w, (layer, role, opts) in enumerate(zip(meta["layers"], meta["roles"], meta["options"], strict=True))}
    options = pr.candidate_options(shapes, None, "fisher", types=reg["candidate_types"])
    losses = [[scored[s.layer, s.role][t] for t in opts] for s, opts in zip(shapes, options, strict=True)]
    capacity, mix = run.target_capacity(shapes, Path(), size, None, "fisher", reg["candidate_types"])
    assert mix == size
    plan = pr.choose_llama_types(pr.LlamaScores(shapes, options, losses), capacity_bytes=capacity)
    mine = tensor_type_lines(shapes, plan.types)
    registered = (folder / f"plan-{size}-{seed}.txt").read_text().split()
    assert sorted(mine) == sorted(registered)


def test_candidates_from_types_fall_back_as_llama_cpp_does_and_exclusions_apply_after():
    from interp.quant.shapes import WeightShape

    shapes = [WeightShape(0, "q", 576, 576), WeightShape(0, "down", 576, 1536)]
    registered = ["q3_k", "q4_0", "q4_k", "q5_0", "q5_1", "q5_k", "q6_k", "q8_0"]
    # SmolLM2's widths: 576 takes no K-quant, so Q3_K, Q4_K, Q5_K, Q6_K store Q4_0, Q5_0, Q5_1, Q8_0
    assert pr.candidate_options(shapes, None, "fisher", types=registered) == [
        ["q4_0", "q5_0", "q5_1", "q8_0"], registered]
    # registration 3's candidates are registration 2's widths less Q4_1 (in the widths' order: cheapest first)
    by_widths = pr.candidate_options(shapes, (3, 4, 5, 6, 8), "fisher", exclude=["q4_1"])
    assert [sorted(opts) for opts in by_widths] == [["q4_0", "q5_0", "q5_1", "q8_0"], registered]
    with pytest.raises(SpecError, match="no candidate type is left for 1 weights, e.g. 0.q"):
        pr.candidate_options(shapes, None, "fisher", types=["q6_k"], exclude=["q8_0"])
    with pytest.raises(SpecError, match="outside what types q4_0,q8_0 allow for these types: 4.5000 to 8.5000"):
        pr.check_llama_budget(None, None, 4.0, "fisher", ["q4_0", "q8_0"])


def test_a_capacity_in_bytes_is_met_and_a_smaller_one_refused(tiny_llama):
    """Q4_0 loses (1 + layer) per weight of a tensor, Q8_0 nothing: with room for every layer-1 tensor at Q8_0 and
    less than any one more, the knapsack puts exactly layer 1 at Q8_0, within the bytes."""
    from interp.quant.llama_cpp import tensor_bytes

    shapes = pr.model_shapes(tiny_llama)
    options = pr.candidate_options(shapes, None, "proxy", types=["q4_0", "q8_0"])  # width 64: legacy types only
    assert all(opts == ["q4_0", "q8_0"] for opts in options)
    losses = [[float(s.size * (1 + s.layer)), 0.0] for s in shapes]
    scores = pr.LlamaScores(shapes, options, losses)
    extra = {s.name: tensor_bytes("q8_0", s.d_out, s.d_in) - tensor_bytes("q4_0", s.d_out, s.d_in) for s in shapes}
    room = scores.cheapest_bytes() + sum(extra[s.name] for s in shapes if s.layer == 1) + min(extra.values()) // 2
    plan = pr.choose_llama_types(scores, capacity_bytes=room)
    assert {s.name for s in shapes if plan.types[s.name] == "q8_0"} == {s.name for s in shapes if s.layer == 1}
    assert sum(tensor_bytes(plan.types[s.name], s.d_out, s.d_in) for s in shapes) <= room
    assert plan.settings["capacity_bytes"] == room and plan.budget == 8 * room / sum(s.size for s in shapes)
    with pytest.raises(SpecError, match="below their cheapest types"):
        pr.choose_llama_types(scores, capacity_bytes=scores.cheapest_bytes() - 1)


def test_fit_to_size_takes_the_excess_off_until_the_file_fits(tmp_path):
    """A file a fixed 100 bytes over what was chosen: one retry, with exactly the excess taken off."""
    chosen, sizes = [], []

    def write(room: int) -> Path:
        path = tmp_path / "f.bin"
        path.write_bytes(b"x" * (room + 100))
        sizes.append(room + 100)
        return path

    notes: list[int] = []
    got, path, slack = run.fit_to_size(lambda room: chosen.append(room) or room, write, 1000, 1050, notes.append)
    assert chosen == [1000, 950] and sizes == [1100, 1050] and (got, slack, notes) == (950, 50, [50])
    assert path.stat().st_size == 1050


def test_parse_kl_reads_llama_perplexity_and_refuses_a_cut_report():
    report = (ROOT / "tests" / "fixtures" / "llama_cpp" / "perplexity_kl_tiny.txt").read_text()
    got = run.parse_kl(report)
    assert got["chunks"] == 8 and 0 < got["mean_kl"] < got["kl_p99"] < got["kl_p999"]
    assert 0 < got["same_top"] < 100 and got["mean_kl_se"] > 0
    for end in ("====== KL divergence statistics", "Same top p"):  # the logging thread's tail lost at exit
        with pytest.raises(ToolError, match="printed no KL statistics"):
            run.parse_kl(report[:report.index(end)])


def test_find_build_takes_a_bin_folder_and_refuses_an_incomplete_one(tmp_path, monkeypatch):
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("llama-quantize", "llama-perplexity"):
        (bin_dir / tool).write_text("#!/bin/sh\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    assert run.find_build() is None
    assert run.find_build(tmp_path / "build") == bin_dir  # a CMake build folder: its bin/
    monkeypatch.setenv("LLAMA_CPP_BIN", str(bin_dir))
    assert run.find_build() == bin_dir
    (bin_dir / "llama-perplexity").chmod(0o644)  # there, but not executable
    with pytest.raises(ToolError, match=r"\(LLAMA_CPP_BIN\) has no llama-perplexity"):
        run.find_build()


# ---------------------------------------------------------------------------------------
# The importance matrix reaches llama-quantize in one place

FAKE_QUANTIZE = """#!/bin/sh
# records the folder it runs in and its arguments, then writes its target (the last-but-one argument)
pwd > "$FAKE_RECORD"
for a in "$@"; do echo "$a" >> "$FAKE_RECORD"; done
eval "target=\\${$(($# - 1))}"
echo made > "$target"
"""


def _fake_build(tmp_path: Path) -> Path:
    build = tmp_path / "bin"
    build.mkdir()
    (build / "llama-quantize").write_text(FAKE_QUANTIZE)
    (build / "llama-quantize").chmod(0o755)
    return build


def test_the_importance_matrix_goes_by_its_bare_name_from_its_own_folder(tmp_path, monkeypatch):
    """llama-quantize stores the --imatrix path as given, so quantize(imatrix=...) runs it in the matrix's folder
    with the bare name; a relative --tensor-type-file is made absolute first (the tool runs elsewhere)."""
    build, record = _fake_build(tmp_path), tmp_path / "record.txt"
    monkeypatch.setenv("FAKE_RECORD", str(record))
    for folder in (tmp_path / "m", tmp_path / "a much longer folder name" / "deeper"):
        folder.mkdir(parents=True)
        (folder / "imatrix.gguf").write_bytes(b"matrix")
        monkeypatch.chdir(tmp_path)
        (tmp_path / "types.txt").write_text("blk.0.ffn_down.weight=q4_k\n")
        made = run.quantize(build, tmp_path / "src.gguf", tmp_path / "out.gguf", "Q4_K_M", "--tensor-type-file",
                            "types.txt", imatrix=folder / "imatrix.gguf")
        assert made.read_text() == "made\n"
        lines = record.read_text().splitlines()
        assert Path(lines[0]).resolve() == folder.resolve()
        assert lines[1:5] == ["--imatrix", "imatrix.gguf", "--tensor-type-file", str(tmp_path / "types.txt")]


def test_a_matrix_given_as_a_flag_is_refused(tmp_path):
    build = _fake_build(tmp_path)
    with pytest.raises(ValueError, match="imatrix=PATH"):
        run.quantize(build, tmp_path / "src.gguf", tmp_path / "out.gguf", "Q4_K_M", "--imatrix", "x.gguf")
    assert not (tmp_path / "out.gguf").exists()


# ---------------------------------------------------------------------------------------
# The command without a build: the files and the exact commands


def _tiny_argv(model: Path, out: Path, *extra: str) -> list[str]:
    return ["prescribe", "--model", str(model), "--score", "fisher", "--types", "q3_k,q4_0,q4_k,q5_0,q5_1,q6_k,q8_0",
            "--target-size", "Q4_K_M", "--n", "8", "--seq-len", "32", "--kl-chunks", "4", "--kl-ctx", "64", "--quiet",
            "--gguf", str(out / "plan.gguf"), "--out", str(out), *extra]


def test_without_a_build_the_files_are_written_and_the_commands_printed(tiny_gguf, tmp_path, monkeypatch, capsys):
    from interp.cli.main import main

    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    out = tmp_path / "plan"
    assert main(_tiny_argv(tiny_gguf, out)) == 0
    printed = capsys.readouterr().out
    assert {p.name for p in out.iterdir()} >= {"tensor_types.txt", "llama_plan.json", "imatrix.gguf", "heldout.txt"}
    assert not (out / "plan.gguf").exists()  # nothing quantized without llama.cpp
    shapes = run.gguf_shapes(tiny_gguf)
    items = read_tensor_types(out / "tensor_types.txt", [gguf_name(s.layer, s.role) for s in shapes])
    assert len(items) == len(shapes)  # one item per block linear weight, each naming one of the model's
    commands = [shlex.split(line) for line in printed.splitlines() if line.startswith(("  llama-", "  cd "))]
    assert commands == run.prescribe_commands(None, tiny_gguf, out, out / "plan.gguf", "Q4_K_M", True, 64, 4)
    assert commands[0] == ["cd", str(out)]  # they run in --out: the matrix's bare name is what the files store
    assert ["--tensor-type-file", str(out / "tensor_types.txt")] == commands[2][3:5]
    assert ["--imatrix", "imatrix.gguf"] == commands[2][1:3]
    record = json.loads((out / "llama_plan.json").read_text())
    assert record["settings"]["capacity_bytes"] == run.mix_block_bytes(shapes, "Q4_K_M")
    assert record["achieved_bits_per_weight"] <= 8 * run.mix_block_bytes(shapes, "Q4_K_M") / sum(
        s.size for s in shapes)


# ---------------------------------------------------------------------------------------
# With a build: the full command


@pytest.mark.skipif(not BUILD, reason=NO_BUILD)
def test_with_a_build_the_plan_is_made_measured_and_its_commands_remake_it(tiny_gguf, tmp_path, monkeypatch, capsys):
    from interp.cli.main import main

    build = run.find_build(BUILD)
    out = tmp_path / "plan"
    assert main(_tiny_argv(tiny_gguf, out)) == 0
    printed = capsys.readouterr().out
    record = json.loads((out / "llama_cpp_kl.json").read_text())
    plan, mix = record["files"]["plan"], record["files"]["Q4_K_M"]
    assert plan["bytes"] == (out / "plan.gguf").stat().st_size <= mix["bytes"] == (out / "Q4_K_M-imatrix.gguf").stat(
        ).st_size
    for k in (plan, mix):
        assert 0 < k["mean_kl"] < k["kl_p99"] < k["kl_p999"] and 0 < k["same_top"] <= 100 and k["chunks"] == 4
    assert f"{plan['mean_kl']:.5f}" in printed and f"{mix['mean_kl']:.5f}" in printed
    # the file holds the planned types (llama-quantize applied every item)
    planned = {pattern.replace("\\", ""): t for pattern, t in read_tensor_types(out / "tensor_types.txt")}
    assert {name: t for name, (t, _) in run.block_types(out / "plan.gguf").items()} == planned
    # the recorded commands, run by hand, remake the plan's file byte for byte and print the same KL
    made = (out / "plan.gguf").read_bytes()
    (out / "plan.gguf").rename(tmp_path / "first.gguf")
    assert record["commands"][0] == shlex.join(["cd", record["commands_folder"]])
    for command in record["commands"][1:-2]:  # in the folder the first line names
        subprocess.run(shlex.split(command), capture_output=True, check=True, cwd=record["commands_folder"])
    assert (out / "plan.gguf").read_bytes() == made
    for command, expected in zip(record["commands"][-2:], (plan, mix), strict=True):
        for _ in range(8):  # llama.cpp's logging thread may lose a report's tail at exit (run._kl_run)
            done = subprocess.run(shlex.split(command), capture_output=True, text=True, check=True,
                                  cwd=record["commands_folder"])
            if "Same top p:" in done.stdout:  # the report's last line (the table header says "Same top p")
                break
        again = run.parse_kl(done.stdout)
        assert {k: again[k] for k in ("mean_kl", "kl_p99", "kl_p999", "same_top")} == {
            k: expected[k] for k in ("mean_kl", "kl_p99", "kl_p999", "same_top")}
    assert Path(shlex.split(record["commands"][1])[0]).parent == build.resolve()


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.skipif(not BUILD, reason=NO_BUILD)
def test_the_documented_command_reproduces_registration_3s_seed_31_plan(tmp_path, capsys):
    """docs/prescribe.md's command on SmolLM2 (about 10 min on 2 cores): its tensor-type file holds registration
    3's committed seed-31 Q4_K_M plan, item for item."""
    from interp.cli.main import main

    out = tmp_path / "smollm2"
    argv = ["prescribe", "--model", "smollm2-135m", "--score", "fisher", "--types",
            "q3_k,q4_0,q4_k,q5_0,q5_1,q5_k,q6_k,q8_0", "--n", "64", "--seq-len", "128", "--seed", "31",
            "--target-size", "Q4_K_M", "--no-imatrix", "--kl-chunks", "4", "--quiet",
            "--gguf", str(out / "plan-Q4_K_M.gguf"), "--out", str(out)]
    assert main(argv) == 0
    mine = (out / "tensor_types.txt").read_text().split()
    registered = (DATA / "llama-cpp-plans-3" / "plan-Q4_K_M-31.txt").read_text().split()
    assert sorted(mine) == sorted(registered)
    record = json.loads((out / "llama_cpp_kl.json").read_text())
    committed = json.loads((DATA / "llama-cpp-plans-3" / "result.json").read_text())["verdicts"]["Q4_K_M"]["bytes"]
    assert record["files"]["plan"]["bytes"] == committed["plans"][0]  # the registered file's size, to the byte
    assert record["files"]["Q4_K_M"]["bytes"] == committed["mix"]
