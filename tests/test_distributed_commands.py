"""``interp probe``, ``attention``, ``lens`` and ``patch`` under torchrun against one process.

One torchrun job (2 ranks on CPU, gloo, one torch thread each) runs the four commands in turn on
a tiny random llama; the same commands then run here in one process, one thread. Both sides
cut the examples into the same batches (interp.runtime.distributed), so each example's values
come from the same forward on the same rows, and every reduction over examples runs once, on
rank 0, over the same concatenated tensors. The comparisons are therefore exact: the CSV and
JSON outputs byte for byte, the probe's tensors with ``torch.equal`` (and against a direct
:func:`interp.probe` call). A resume with another world size (a batch file deleted as if the
job had been killed, then one process) must recompute only that batch and give the same bytes.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torchrun_helpers import documents, one_process_like_a_rank, torchrun

import interp
from interp.cli.main import main
from interp.errors import InterpError
from interp.io import read_safetensors
from interp.runtime.distributed import map_batches, part_name, shard_bounds

N, T, BATCH = 14, 16, 4  # 4 batches, the last one short: each rank of 2 takes 2
COMMON = ["--n", str(N), "--seq-len", str(T), "--batch-size", str(BATCH), "--quiet"]
COMMANDS = {
    "probe": ["probe", "--components", "resid_mid,resid_post,pattern", "--reducers", "norm,kurtosis,entropy"],
    "attention": ["attention", "--no-static", "--beta", "2"],
    "lens": ["lens", "--top", "0.5"],
    "patch": ["patch", "--top", "0.5", "--layers", "all", "--experiments", "table,gate-input,sweep,attribution"],
}
OUTPUTS = {
    "probe": ["summary.csv", "probe.parquet", "probe.json"],
    "attention": ["attention_by_head.csv", "attention_by_layer.csv", "attention.json"],
    "lens": ["early_exit.csv", "restoration.csv", "split.csv"],
    "patch": ["patching_table.csv", "gate_input_vs_weights.csv", "layer_sweep.csv", "attribution.csv"],
}

DRIVER = """
import sys
from interp.cli.main import main
folder, data, root = sys.argv[1:4]
commands = {commands!r}
for name, argv in commands.items():
    code = main([*argv, "--model", folder, "--data", data, *{common!r}, "--out", f"{{root}}/{{name}}"])
    assert code == 0, (name, code)
"""



@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, Path]:
    """(folder, data, torchrun outputs, single-process outputs); both with the same model cache."""
    tmp = tmp_path_factory.mktemp("dist_commands")
    folder, data = tmp / "tiny", documents(tmp / "docs.txt")
    interp.models.export_hf(interp.tiny_model("llama", seed=0), folder)
    cache = tmp / "cache"
    script = tmp / "driver.py"
    script.write_text(textwrap.dedent(DRIVER.format(commands=COMMANDS, common=COMMON)))
    result = torchrun([str(script), str(folder), str(data), str(tmp / "dist")], cache)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    with one_process_like_a_rank(cache):
        for name, argv in COMMANDS.items():
            assert main([*argv, "--model", str(folder), "--data", str(data), *COMMON,
                         "--out", str(tmp / "single" / name)]) == 0
    return folder, data, tmp / "dist", tmp / "single"


@pytest.mark.slow
@pytest.mark.parametrize("command", list(COMMANDS))
def test_torchrun_outputs_equal_one_process(runs: tuple[Path, Path, Path, Path], command: str) -> None:
    _, _, dist, single = runs
    for name in OUTPUTS[command]:
        assert (dist / command / name).read_bytes() == (single / command / name).read_bytes(), (command, name)
    # every batch was computed by the rank that owns it, into files named by example range, not by rank
    for stage in (dist / command / "parts").rglob("manifest.json"):
        files = sorted(p.name for p in stage.parent.glob("*.safetensors"))
        assert files and all("-" in f and "rank" not in f for f in files)


@pytest.mark.slow
def test_torchrun_probe_tensors_equal_the_library_call(runs: tuple[Path, Path, Path, Path]) -> None:
    folder, data, dist, _ = runs
    stats = read_safetensors(dist / "probe" / "stats.safetensors", "probe")
    model = interp.load_model(str(folder))
    examples = interp.load_examples(str(data), model.tokenizer, n=N, seq_len=T, seed=0, split="eval")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        direct = interp.probe(model, examples, ["resid_mid", "resid_post", "pattern"], ["norm", "kurtosis", "entropy"],
                              batch_size=BATCH, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert sorted(stats) == sorted(k.replace("/", ".") for k in direct.stats)
    for key, value in direct.stats.items():
        assert torch.equal(stats[key.replace("/", ".")], value), key


@pytest.mark.slow
def test_resume_with_another_world_size_recomputes_only_the_missing_batch(runs: tuple[Path, Path, Path, Path],
                                                                         tmp_path: Path) -> None:
    import shutil

    folder, data, dist, single = runs
    out = tmp_path / "lens"
    shutil.copytree(dist / "lens", out)
    stage = out / "parts" / "early_exit" / "quantized" / "D_large"
    parts = sorted(stage.glob("*.safetensors"))
    assert len(parts) >= 2
    killed = parts[-1]  # the last rank's batch, as if that rank had been killed before writing it
    kept = {p: p.stat().st_mtime_ns for p in parts[:-1]}
    killed.unlink()
    for name in OUTPUTS["lens"]:
        (out / name).unlink()
    with one_process_like_a_rank(dist.parent / "cache"):
        assert main([*COMMANDS["lens"], "--model", str(folder), "--data", str(data), *COMMON, "--out", str(out)]) == 0
    assert killed.exists()
    assert {p: p.stat().st_mtime_ns for p in kept} == kept  # finished batches were read, not recomputed
    for name in OUTPUTS["lens"]:
        assert (out / name).read_bytes() == (single / "lens" / name).read_bytes(), name


def test_map_batches_parts_are_keyed_by_example_range(tmp_path: Path) -> None:
    """One process: a batch file per single-process batch; a changed setting starts the folder afresh."""
    model = interp.tiny_model("llama", seed=0)
    g = torch.Generator().manual_seed(0)
    ex = interp.Examples.from_tokens(torch.randint(0, 256, (N, T), generator=g))
    calls: list[int] = []

    def compute(sub: interp.Examples) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        calls.append(len(sub))
        return {"nll": interp.nll(model, sub, batch_size=BATCH)}, {"rows": len(sub)}

    first = map_batches(compute, ex, BATCH, tmp_path, settings={"run": 1})
    assert first is not None
    assert torch.equal(first.tensors["nll"], interp.nll(model, ex, batch_size=BATCH))
    bounds = [(s, min(N, s + BATCH)) for s in range(0, N, BATCH)]
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [part_name(s, e) for s, e in bounds]
    assert calls == [e - s for s, e in bounds]
    again = map_batches(compute, ex, BATCH, tmp_path, settings={"run": 1})
    assert again is not None and calls == [e - s for s, e in bounds]  # all reused
    assert torch.equal(again.tensors["nll"], first.tensors["nll"])
    map_batches(compute, ex, BATCH, tmp_path, settings={"run": 2})  # another run: every batch again
    assert len(calls) == 2 * len(bounds)
    # each rank's share is whole batches of that same grid, for any world size
    for world_size in (1, 2, 3, 5):
        starts = [shard_bounds(N, BATCH, r, world_size)[0] for r in range(world_size)]
        assert all(s % BATCH == 0 for s in starts)


def test_map_batches_refuses_a_batch_without_the_example_axis_first(tmp_path: Path) -> None:
    ex = interp.Examples.from_tokens(torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(InterpError, match="first axis"):
        map_batches(lambda sub: ({"x": torch.zeros(2, len(sub))}, {}), ex, 3, tmp_path)


FAILING_DRIVER = """
import sys, torch
from interp.data import Examples
from interp.runtime.distributed import map_batches, world

def compute(sub):
    if world()[0] == 1:
        raise ValueError("rank 1 breaks")
    return {"x": sub.tokens.float()}, {}

map_batches(compute, Examples.from_tokens(torch.zeros(8, 4, dtype=torch.long)), 2, sys.argv[1])
"""


@pytest.mark.slow
def test_a_failing_rank_stops_the_others_instead_of_leaving_them_at_a_barrier(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FAILING_DRIVER)
    result = torchrun([str(script), str(tmp_path / "parts")], tmp_path / "cache", timeout=120)
    assert result.returncode != 0
    assert "rank 1 breaks" in result.stderr and "Another rank failed" in result.stderr
    assert len(list((tmp_path / "parts").glob("*.safetensors"))) == 2  # rank 0's finished batches are kept
