"""``interp report`` under torchrun against one process, and the commands that refuse torchrun.

One torchrun job (2 ranks on CPU, gloo, one torch thread each) runs the quick report on a tiny
random llama; the same report then runs here in one process, one thread. Every batched step of
every stage (the scoring, the probes, attention, early exit, restoration, the three patching
experiments) cuts its examples into the single-process run's batches, and every rank reads the
same gathered tensors, so rank 0's tables and numbers are those of one process byte for byte.
A resume in one process from the 2-rank run, with one batch file and the stage's marker deleted
as if the job had been killed there, recomputes that batch alone and gives the same bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from torchrun_helpers import documents, one_process_like_a_rank, torchrun

import interp
from interp.cli.main import main
from interp.errors import InterpError
from interp.report.context import MainRankOnly, ReportContext, ReportSettings

# 80 examples in batches of 2: 40 batches for the probes; D_large (the top 5%) is 4 examples, 2 batches
ARGS = ["report", "--quick", "--n", "80", "--seq-len", "16", "--batch-size", "2", "--no-static", "--quiet"]
STAGES = ("probes", "attention", "quantization", "agreement", "norms", "early_exit", "restoration", "patching")


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path, Path, Path]:
    """(the report's options, its model cache, the 2-rank report folder, the one-process report folder)."""
    tmp = tmp_path_factory.mktemp("report_dist")
    folder, data = tmp / "tiny", documents(tmp / "docs.txt", n=240)
    interp.models.export_hf(interp.tiny_model("llama", seed=0), folder)
    args = [*ARGS, "--model", str(folder), "--data", str(data), "--stages", ",".join(STAGES)]
    cache = tmp / "cache"
    result = torchrun(["-m", "interp", "--", *args, "--out", str(tmp / "dist")], cache)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with one_process_like_a_rank(cache):
        assert main([*args, "--out", str(tmp / "single")]) == 0
    return args, cache, tmp / "dist", tmp / "single"


def _same_report(a: Path, b: Path) -> None:
    tables = sorted(p.name for p in (a / "tables").glob("*.csv"))
    assert len(tables) > 20 and tables == sorted(p.name for p in (b / "tables").glob("*.csv"))
    for name in tables:
        assert (a / "tables" / name).read_bytes() == (b / "tables" / name).read_bytes(), name
    ra, rb = (json.loads((x / "results.json").read_text()) for x in (a, b))
    assert ra["numbers"] == rb["numbers"] and ra["reproduction"] == rb["reproduction"]


@pytest.mark.slow
def test_torchrun_report_equals_one_process(reports: tuple[list[str], Path, Path, Path]) -> None:
    _, _, dist, single = reports
    _same_report(dist, single)
    # every batched step left files named by example range, never by rank; both ranks computed some
    d_large = json.loads((dist / "results.json").read_text())["numbers"]["patching"]["d_large"]
    table = dist / "parts" / "patching" / "table"
    assert d_large == 4 and sorted(p.name for p in table.glob("*.safetensors")) == [
        "000000000-000000002.safetensors", "000000002-000000004.safetensors"]
    assert len(list((dist / "parts" / "probes").glob("*.safetensors"))) == 40
    assert (dist / "scores.sqlite").is_file() and not list(dist.glob("scores.rank1*-journal"))


@pytest.mark.slow
def test_report_resumes_in_one_process_from_two_ranks(reports: tuple[list[str], Path, Path, Path],
                                                      tmp_path: Path) -> None:
    args, cache, dist, single = reports
    out = tmp_path / "resumed"
    shutil.copytree(dist, out)
    parts = sorted((out / "parts" / "patching" / "table").glob("*.safetensors"))
    killed = parts[-1]  # rank 1's batch, as if the job had been killed before it was written
    killed.unlink()
    (out / "stages" / "patching" / "done.json").unlink()
    others = {p: p.stat().st_mtime_ns for p in (out / "parts").rglob("*.safetensors")}
    with one_process_like_a_rank(cache):
        assert main([*args, "--out", str(out)]) == 0
    assert killed.exists()
    assert {p: p.stat().st_mtime_ns for p in others} == others  # every other batch was read, not recomputed
    _same_report(out, single)


def test_a_stage_that_runs_a_batched_step_after_main_only_fails(tmp_path: Path) -> None:
    ctx = ReportContext(ReportSettings.quick(), tmp_path, progress=False)
    ctx.begin_stage()
    assert ctx.batched("probe") is ctx.shards
    ctx.main_only()  # rank 0 carries on
    with pytest.raises(InterpError, match="before the stage's main_only"):
        ctx.batched("probe")
    ctx.begin_stage()  # the next stage starts over
    assert ctx.batched("probe") is ctx.shards


def test_other_ranks_leave_a_stage_at_main_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ctx = ReportContext(ReportSettings.quick(), tmp_path, progress=None)
    assert ctx.progress is False  # no bars off rank 0
    ctx.begin_stage()
    with pytest.raises(MainRankOnly):
        ctx.main_only()


@pytest.mark.parametrize("argv", [["quantize", "--method", "rtn:bits=3", "--out", "q"],
                                  ["prescribe", "--budget", "3.5"], ["train-saobp", "--quick"],
                                  ["errors", "--scores", "nowhere"]])
def test_commands_that_do_not_shard_refuse_torchrun_before_loading(argv: list[str], tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")  # torchrun sets both (one without the other is refused)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"interp {argv[0]} does not split its work over processes" in err and "WORLD_SIZE=2" in err
    assert "interp report" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing was written
