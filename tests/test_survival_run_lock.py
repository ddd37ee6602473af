"""Two survival runs of one model may share a folder (disjoint ``--only`` rows, one per core): the shared record
(``models.json``) is read, changed and written under one lock, so neither run loses the other's entry."""

from __future__ import annotations

import json
import threading
import time

import interp.models
import interp.runtime.batching
from interp.report.survival import run as survival_run


def _record_many(tmp_path, monkeypatch, n: int) -> dict:
    folder = survival_run.Folder(tmp_path / "run")
    monkeypatch.setattr(interp.models, "weights_digest", lambda model: f"digest-{model}")
    monkeypatch.setattr(interp.runtime.batching, "cpu_identity", lambda: "cpu")
    real_write = survival_run.write_json

    def slow_write(path, value):  # widen the window between the read and the write, as a slow disk would
        time.sleep(0.05)
        real_write(path, value)

    monkeypatch.setattr(survival_run, "write_json", slow_write)
    barrier = threading.Barrier(n)

    def one(i: int) -> None:
        barrier.wait()
        survival_run._record(folder, f"unit{i}", i, ["circuits"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return json.loads(folder.path("models.json").read_text())


def test_concurrent_records_keep_every_entry(tmp_path, monkeypatch):
    record = _record_many(tmp_path, monkeypatch, 6)
    assert sorted(record) == sorted(f"unit{i}" for i in range(6))
    assert all(record[f"unit{i}"]["weights_sha256"] == f"digest-{i}" for i in range(6))


def test_without_the_lock_entries_are_lost(tmp_path, monkeypatch):
    """The guard's own check: with the lock switched off, the same interleaving loses entries, so the test above
    can fail."""
    import contextlib

    monkeypatch.setattr(survival_run, "_folder_lock", lambda folder: contextlib.nullcontext())
    record = _record_many(tmp_path, monkeypatch, 6)
    assert len(record) < 6


def test_lock_leaves_no_file(tmp_path, monkeypatch):
    _record_many(tmp_path, monkeypatch, 1)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["models.json"]


def test_an_instance_made_again_keeps_the_earlier_record(tmp_path, monkeypatch, capsys):
    """Same weights: the stages are merged. Other weights (a fitted quantizer made again on another CPU): the
    earlier record is kept under ``earlier`` and the run says so."""
    folder = survival_run.Folder(tmp_path / "run")
    monkeypatch.setattr(interp.models, "weights_digest", lambda model: f"digest-{model}")
    cpu = iter(["amd", "amd", "intel"])
    monkeypatch.setattr(interp.runtime.batching, "cpu_identity", lambda: next(cpu))
    survival_run._record(folder, "gptq@seed61", "a", ["induction"])
    survival_run._record(folder, "gptq@seed61", "a", ["circuits"])
    entry = json.loads(folder.path("models.json").read_text())["gptq@seed61"]
    assert entry["weights_sha256"] == "digest-a" and entry["stages"] == ["circuits", "induction"]
    assert "earlier" not in entry
    capsys.readouterr()
    survival_run._record(folder, "gptq@seed61", "b", ["circuits"])
    entry = json.loads(folder.path("models.json").read_text())["gptq@seed61"]
    assert (entry["weights_sha256"], entry["cpu"], entry["stages"]) == ("digest-b", "intel", ["circuits"])
    assert [(e["weights_sha256"], e["stages"]) for e in entry["earlier"]] == [("digest-a", ["circuits", "induction"])]
    assert "made again" in capsys.readouterr().err


def test_the_page_lists_instances_made_more_than_once(tmp_path, monkeypatch):
    """What the run keeps reaches the page: each stage beside the weights it was measured on."""
    from interp.report.survival.page import _remade

    folder = survival_run.Folder(tmp_path / "run")
    monkeypatch.setattr(interp.models, "weights_digest", lambda model: f"{model}" * 12)
    cpu = iter(["AMD EPYC; avx512f", "Intel(R) Xeon(R) Processor; amx_tile"])
    monkeypatch.setattr(interp.runtime.batching, "cpu_identity", lambda: next(cpu))
    survival_run._record(folder, "awq@seed62", "a", ["induction"])
    assert _remade(folder.out) == ""  # made once: nothing to say
    survival_run._record(folder, "awq@seed62", "b", ["circuits"])
    text = _remade(folder.out)
    assert "- `awq@seed62`: induction on weights `aaaaaaaaaaaa` (AMD EPYC); circuits on weights `bbbbbbbbbbbb` " \
           "(Intel(R) Xeon(R) Processor)" in text


def test_only_names_a_row_or_one_instance():
    """--only takes a label (every instance) or an instance's id (that one), so two runs can split a row."""
    from interp.report.survival.roster import roster

    plan = next(e for e in roster("gemma3-270m") if e.label == "plan Q3_K_M")
    rtn = next(e for e in roster("gemma3-270m") if e.label == "rtn:bits=3,group=64")
    assert survival_run._named(plan, None) and survival_run._named(plan, ["plan Q3_K_M"])
    assert survival_run._named(plan, ["plan Q3_K_M@33"]) and not survival_run._named(rtn, ["plan Q3_K_M@33"])
    assert "plan Q3_K_M@33" in plan.ids()


def test_variants_only_beside_scores_of_the_same_weights(tmp_path, monkeypatch):
    """The tie compares an instance's scores with its restored variants: variants are made from the weights in
    hand, so they are measured only when every requested stage was measured on those same weights."""
    folder = survival_run.Folder(tmp_path / "run")
    monkeypatch.setattr(interp.models, "weights_digest", lambda model: f"digest-{model}")
    monkeypatch.setattr(interp.runtime.batching, "cpu_identity", lambda: "cpu")
    assert not survival_run._measured_on(folder, "awq@seed62", "a", ["induction"])  # nothing recorded
    survival_run._record(folder, "awq@seed62", "a", ["induction"])
    assert survival_run._measured_on(folder, "awq@seed62", "a", ["induction"])
    assert not survival_run._measured_on(folder, "awq@seed62", "b", ["induction"])  # made again, other weights
    survival_run._record(folder, "awq@seed62", "b", ["circuits"])  # the circuits measured on the new weights
    assert survival_run._measured_on(folder, "awq@seed62", "b", ["circuits"])
    assert not survival_run._measured_on(folder, "awq@seed62", "b", ["induction", "circuits"])  # induction on 'a'


def test_a_remeasured_stage_moves_to_superseded_and_the_page_says_so(tmp_path, monkeypatch):
    """Measured again on the weights in hand (``--remeasure``): the earlier record no longer claims the stage whose
    files now hold the later weights' numbers, and the page names it."""
    from interp.report.survival.page import _remade

    folder = survival_run.Folder(tmp_path / "run")
    monkeypatch.setattr(interp.models, "weights_digest", lambda model: f"{model}" * 12)
    monkeypatch.setattr(interp.runtime.batching, "cpu_identity", lambda: "cpu")
    survival_run._record(folder, "gptq@seed61", "a", ["induction", "circuits"])
    survival_run._record(folder, "gptq@seed61", "b", ["features"])
    survival_run._record(folder, "gptq@seed61", "b", ["induction"], replaced=True)
    entry = json.loads(folder.path("models.json").read_text())["gptq@seed61"]
    assert entry["stages"] == ["features", "induction"]
    assert [(e["stages"], e["superseded"]) for e in entry["earlier"]] == [(["circuits"], ["induction"])]
    assert "circuits on weights `aaaaaaaaaaaa` (cpu) (since measured again on the later weights: induction)" \
        in _remade(folder.out)
    assert survival_run._stale(folder, "gptq@seed61", "b", ["induction", "circuits", "features"]) == ["circuits"]


def _fake_run(tmp_path, monkeypatch, weights: str, remeasure: bool) -> dict:
    """The run's loop on one GPTQ instance with its model, quantizer and scores replaced by labels: ``weights``
    names the weights the quantizer gives this time, and each score file holds the weights it was measured on."""
    import numpy as np

    import interp.localize.restoration
    import interp.runtime.hooks

    codes = {"a": 1.0, "b": 2.0}
    monkeypatch.setattr(interp.models, "load_model", lambda name: "reference")
    monkeypatch.setattr(interp.models, "weights_digest", lambda model: f"digest-{model}")
    monkeypatch.setattr(interp.runtime.batching, "cpu_identity", lambda: "cpu")
    monkeypatch.setattr(interp.runtime.hooks, "n_layers", lambda model: 2)
    monkeypatch.setattr(interp.localize.restoration, "restore_layers",
                        lambda q, ref, layers, roles: f"{q}+{'/'.join(roles)}")
    monkeypatch.setattr(survival_run, "_start_record", lambda folder, model: None)
    monkeypatch.setattr(survival_run, "_token_set", lambda folder, model, ref: [1, 2])
    monkeypatch.setattr(survival_run, "_sequences", lambda folder, ref, ids: {"measurement": None, "selection": None})
    monkeypatch.setattr(survival_run, "make", lambda *a, **k: weights)

    def scores(model, seqs, ids):
        base, _, roles = model.partition("+")
        code = 0.0 if model == "reference" else 10 * codes[base] + (1 if "gate" in roles else 2) if roles \
            else codes[base]
        return np.full((1, 1, 1), code), np.full((1, 1, 1), code)

    monkeypatch.setattr(survival_run, "induction_scores", scores)
    out = tmp_path / "run"
    survival_run.run("gemma3-270m", out, ["induction"], ["gptq:bits=3,group=64@seed61"], None, progress=False,
                     variants=True, remeasure=remeasure)
    from safetensors.torch import load_file

    return {p.name: float(load_file(str(p))["pm"].item()) for p in sorted((out / "induction").glob("gptq*"))}


def test_remeasure_gives_the_tie_an_instance_and_variants_of_the_same_weights(tmp_path, monkeypatch, capsys):
    """Made again with other weights ('b' after 'a'), the instance's scores stay those of 'a' and the tie leaves it
    out; ``--remeasure`` measures it again on 'b', and then its variants, both from 'b'. With the one check of
    which weights a stage was measured on (``_stale``) switched off, the run would keep 'a''s scores beside 'b''s
    variants, which the last assertion refuses."""
    first = _fake_run(tmp_path, monkeypatch, "a", remeasure=False)
    assert first == {"gptq-bits-3-group-64@seed61#control.safetensors": 12.0,
                     "gptq-bits-3-group-64@seed61#named.safetensors": 11.0,
                     "gptq-bits-3-group-64@seed61.safetensors": 1.0}
    for p in (tmp_path / "run" / "induction").glob("*#*"):
        p.unlink()  # the variants of 'a' gone, as on a machine that measured only the instance
    capsys.readouterr()
    kept = _fake_run(tmp_path, monkeypatch, "b", remeasure=False)
    assert kept == {"gptq-bits-3-group-64@seed61.safetensors": 1.0}
    assert "not measured" in capsys.readouterr().err
    again = _fake_run(tmp_path, monkeypatch, "b", remeasure=True)
    assert again == {"gptq-bits-3-group-64@seed61#control.safetensors": 22.0,
                     "gptq-bits-3-group-64@seed61#named.safetensors": 21.0,
                     "gptq-bits-3-group-64@seed61.safetensors": 2.0}
    entry = json.loads((tmp_path / "run" / "models.json").read_text())["gptq:bits=3,group=64@seed61"]
    assert entry["weights_sha256"] == "digest-b" and entry["earlier"][0]["superseded"] == ["induction"]


def test_remeasure_without_only_is_refused_before_any_model_loads(tmp_path, monkeypatch, capsys):
    import interp.models

    def no(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(interp.models, "load_model", no)
    assert survival_run.main(["--model", "gemma3-270m", "--out", str(tmp_path / "o"), "--remeasure"]) != 0
    err = capsys.readouterr().err
    assert "--remeasure replaces committed scores: name the instances with --only" in err
    assert "Traceback" not in err and not (tmp_path / "o").exists()
