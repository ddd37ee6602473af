"""Every ``.load`` of a persisted object checks its file against a schema (issue 45): interp.schema.conform.

A saved tuned lens, probe result, sensitivity table and pre-registration are written by interp, then
one key is dropped or given a value of the wrong kind (or the file is replaced by a pipe); loading it
must raise an InterpError naming the key, never a KeyError, a TypeError, a hang, or an object that
fails later. With ``conform`` switched off, the same inner check fails.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import interp
from interp.errors import InterpError

ROOT = Path(__file__).resolve().parents[1]
WRONG = [None, "x", 1.5, [1.5], {"a": 1}, True, [], -3, [["a"]]]


def _lens(folder: Path) -> Path:
    from interp.localize.tuned_lens import fit_tuned_lens

    rows = interp.Examples.from_tokens(torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0)))
    return fit_tuned_lens(interp.tiny_model("llama"), rows, progress=False).save(folder / "lens.safetensors")


def _probe(folder: Path) -> Path:
    rows = interp.Examples.from_tokens(torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(0)))
    return interp.probe(interp.tiny_model("llama"), rows, ["resid_post"], ["norm"], progress=False).save(folder / "p")


def _sensitivity(folder: Path) -> Path:
    from interp.quant import Sensitivity

    scores = Sensitivity("rtn:bits=4,group=32", [0, 0], ["q", "k"], [64, 64], np.ones((2, 3)))
    return scores.save(folder / "s")


def _quantized(folder: Path) -> Path:
    from interp.quant import quantize, save_quantized

    return save_quantized(quantize(interp.tiny_model("llama"), "rtn:bits=4,group=32", progress=False), folder / "q")


def _preregistration(folder: Path) -> Path:
    target = folder / "plan.json"
    shutil.copyfile(ROOT / "docs" / "preregistration" / "smollm2-confirmatory-1.json", target)
    return target


def _load(kind: str, path: Path) -> Any:
    from interp.localize.tuned_lens import TunedLens
    from interp.probes import ProbeResult
    from interp.quant import Sensitivity
    from interp.report.confirm import Preregistration

    if kind == "quantized":
        from interp.quant import load_quantized

        return load_quantized(interp.tiny_model("llama"), path)
    return {"lens": TunedLens.load, "probe": ProbeResult.load, "sensitivity": Sensitivity.load,
            "preregistration": Preregistration.load}[kind](path)


# kind -> (writer, the JSON record's file inside what the writer returns, the schema's keys)
KINDS = {
    "lens": (_lens, None, ("layers", "settings")),
    "probe": (_probe, "probe.json", ("layers", "ids", "settings")),
    "sensitivity": (_sensitivity, "sensitivity.json", ("spec", "settings")),
    "quantized": (_quantized, "quant.json", ("format", "weights_bytes", "weights_sha256", "spec", "reference_hash",
                                             "reference_name", "calibration")),  # the keys without a default
    "preregistration": (_preregistration, "", ("name", "model", "n", "seed", "calibration_seeds", "top",
                                                "split_fractions", "free_specs", "criteria", "batch_size")),
}


def _record(kind: str, path: Path) -> dict[str, Any]:
    if kind == "lens":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            return {k: json.loads(v) for k, v in (fh.metadata() or {}).items()}
    name = KINDS[kind][1]
    return json.loads((path / name if name else path).read_text())


def _rewrite(kind: str, path: Path, record: dict[str, Any]) -> None:
    if kind == "lens":
        from safetensors.torch import load_file, save_file

        save_file(load_file(str(path)), str(path), metadata={k: json.dumps(v) for k, v in record.items()})
        return
    name = KINDS[kind][1]
    (path / name if name else path).write_text(json.dumps(record))


def assert_load_refused(kind: str, path: Path, key: str) -> None:
    """The property's inner check: the load is an InterpError naming ``key``."""
    with pytest.raises(InterpError, match=key):
        _load(kind, path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    return {kind: writer(folder / kind if kind != "lens" else folder) for kind, (writer, _, _) in KINDS.items()
            if (folder / kind).mkdir(exist_ok=True) is None}


def _copy(path: Path, to: Path) -> Path:
    if path.is_dir():
        shutil.copytree(path, to)
    else:
        to.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, to)
    return to


def test_what_interp_wrote_loads_back(saved):
    for kind, path in saved.items():
        assert _load(kind, path) is not None, kind


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_property_a_missing_or_mistyped_key_is_refused_naming_it(kind, saved, tmp_path_factory):
    """Property: whichever schema key is dropped or given a value of another kind, the load raises an InterpError
    that names the key (hypothesis, derandomized)."""
    from interp.schema import fits

    keys = KINDS[kind][2]
    counter = iter(range(10**6))

    @settings(max_examples=12, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(key=st.sampled_from(keys), drop=st.booleans(), value=st.sampled_from(WRONG))
    def prop(key: str, drop: bool, value: Any) -> None:
        path = _copy(saved[kind], tmp_path_factory.mktemp(f"{kind}-{next(counter)}") / saved[kind].name)
        record = _record(kind, path)
        kinds = {"layers": "list[int]", "ids": "list[str]", "settings": "dict", "spec": "str"}
        from interp.quant.saving import RECORD_SCHEMA
        from interp.report.confirm import Preregistration
        from interp.schema import schema_of

        expected = {**kinds, **schema_of(Preregistration), **RECORD_SCHEMA}[key]
        if drop:
            del record[key]
        elif fits(value, expected):
            return  # a value of the right kind: nothing to refuse
        else:
            record[key] = value
        _rewrite(kind, path, record)
        assert_load_refused(kind, path, key)

    prop()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_pipe_in_place_of_the_file_is_refused_without_hanging(kind, saved, tmp_path):
    path = _copy(saved[kind], tmp_path / saved[kind].name)
    name = KINDS[kind][1]
    fifo = path / name if name else path
    os.remove(fifo)
    os.mkfifo(fifo)
    outcome: list[Any] = []

    def attempt() -> None:
        try:
            _load(kind, path)
            outcome.append("loaded")
        except InterpError as exc:
            outcome.append(exc)
        except Exception as exc:  # noqa: BLE001 - the finding
            outcome.append(repr(exc))

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():  # unblock the reader before failing
        with open(fifo, "wb"):
            pass
        pytest.fail(f"{kind}.load blocked on a pipe")
    assert isinstance(outcome[0], InterpError) and "pipe" in str(outcome[0]), outcome


def test_with_the_schema_switched_off_the_property_check_fails(saved, tmp_path, monkeypatch):
    """With interp.schema.conform returning its record unchecked, a mistyped registration loads as if valid:
    the refusals come from that one place."""
    monkeypatch.setattr("interp.schema.conform", lambda record, *args, **kwargs: dict(record))
    path = _copy(saved["preregistration"], tmp_path / "plan.json")
    record = _record("preregistration", path)
    record["seed"] = "0"
    _rewrite("preregistration", path, record)
    with pytest.raises(pytest.fail.Exception):
        assert_load_refused("preregistration", path, "seed")


# ---------------------------------------------------------------------------------------
# quant.json: load_quantized's record (issue 45)


def _corrupt_quant_json(saved: dict[str, Path], tmp_path: Path, text: str) -> Path:
    path = _copy(saved["quantized"], tmp_path / "q")
    (path / "quant.json").write_text(text)
    return path


def _quant_json(saved: dict[str, Path]) -> dict[str, Any]:
    return json.loads((saved["quantized"] / "quant.json").read_text())


@pytest.mark.parametrize("case", ["missing key", "wrong type", "not finite", "optional key mistyped",
                                  "trailing garbage", "not an object", "truncated", "another format"])
def test_a_corrupted_quant_json_is_a_clear_error_naming_the_file_and_the_key(saved, tmp_path, case):
    """load_quantized on a folder whose quant.json was edited, truncated or padded with garbage: one DataError that
    names quant.json (and the key when one is wrong), never a KeyError, a TypeError or a model."""
    from interp.errors import DataError

    record = _quant_json(saved)
    text = json.dumps(record)
    corrupt, fragment = {
        "missing key": (json.dumps({k: v for k, v in record.items() if k != "reference_hash"}),
                        '"reference_hash" is missing'),
        "wrong type": (json.dumps({**record, "spec": ["rtn"]}), '"spec" must be a string'),
        "not finite": (json.dumps({**record, "calibration_seconds": float("inf")}), '"calibration_seconds" must be'),
        "optional key mistyped": (json.dumps({**record, "layer_seconds": "fast"}), '"layer_seconds" must be a list'),
        "trailing garbage": (text + "\x00garbage{", "not valid JSON"),
        "not an object": (json.dumps([record]), "must hold a JSON object"),
        "truncated": (text[: len(text) // 2], "not valid JSON"),
        "another format": (json.dumps({**record, "format": 1}), '"format" is 1, not 2'),
    }[case]
    path = _corrupt_quant_json(saved, tmp_path, corrupt)
    with pytest.raises(DataError, match=fragment) as caught:
        _load("quantized", path)
    assert "quant.json" in str(caught.value) and "\n" not in str(caught.value)
    from interp.quant.saving import read_quant_info

    assert read_quant_info(path) is None  # the caches treat it as absent and quantize again


def test_extra_keys_in_quant_json_are_ignored_and_a_missing_default_reads_as_the_default(saved, tmp_path):
    """A key interp does not know is left alone (as in every record interp reads), and a QuantInfo field with a
    default that an older record lacks reads as that default."""
    record = {k: v for k, v in _quant_json(saved).items() if k != "algorithm"}
    path = _corrupt_quant_json(saved, tmp_path, json.dumps({**record, "written_by": "a later interp"}))
    assert _load("quantized", path).quant_info.algorithm == ""


def test_a_damaged_quant_json_in_the_cache_is_quantized_again(saved, tmp_path):
    """The quantized cache reads the same record: a damaged one is not an error there but an entry to make again."""
    from interp.quant import quantize_cached
    from interp.quant.apply import _cache_key
    from interp.quant.spec import parse_spec

    model = interp.tiny_model("llama")
    first = quantize_cached(model, "rtn:bits=4,group=32", cache_dir=tmp_path, progress=False)
    folder = tmp_path / _cache_key(model, parse_spec("rtn:bits=4,group=32"), None)
    (folder / "quant.json").write_text('{"format": 2, "spec": 4')
    again = quantize_cached(model, "rtn:bits=4,group=32", cache_dir=tmp_path, progress=False)
    assert again.quant_info.spec == first.quant_info.spec
    assert json.loads((folder / "quant.json").read_text())["spec"] == first.quant_info.spec  # written whole again


def test_with_the_schema_switched_off_a_corrupted_quant_json_is_a_raw_error(saved, tmp_path, monkeypatch):
    """The mutation check: with interp.schema.conform passing any record, a quant.json without its reference hash
    fails deep inside load_quantized with a KeyError."""
    monkeypatch.setattr("interp.schema.conform", lambda record, *args, **kwargs: dict(record))
    record = {k: v for k, v in _quant_json(saved).items() if k != "reference_hash"}
    path = _corrupt_quant_json(saved, tmp_path, json.dumps(record))
    with pytest.raises(KeyError, match="reference_hash"):
        _load("quantized", path)
