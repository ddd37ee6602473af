"""Bad input gets a clear error in interp's own words: the error type and a message naming the fix.

Each case asserts an ``InterpError`` subclass and a fragment of the message that tells the
user what to do, never a deep library traceback or a silent wrong result.
"""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

import interp
from interp import models
from interp.data import Examples, load_examples
from interp.errors import (
    ComponentError,
    DataError,
    InterpError,
    ModelLoadError,
    NonFiniteError,
    ResourceError,
    SpecError,
)
from interp.models import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _ex(n=2, t=8):
    tokens = torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(0))
    tokens[:, 0] = 256
    return Examples.from_tokens(tokens)


# -- models ---------------------------------------------------------------------------------

MODEL_CASES = [
    ("unknown name", lambda tmp: "llama-9000", ModelLoadError, "Unknown model 'llama-9000'"),
    ("missing gguf", lambda tmp: str(tmp / "nope.gguf"), ModelLoadError, "does not exist"),
    ("folder that is not a model", lambda tmp: str(tmp), ModelLoadError, "not a Hugging Face model folder"),
]


@pytest.mark.parametrize("name,make,error,fragment", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_bad_model_sources(name, make, error, fragment, tmp_path):
    with pytest.raises(error, match=fragment):
        interp.load_model(make(tmp_path))


def test_truncated_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("INTERP_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 40)
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        interp.load_model(str(bad))


def test_corrupt_safetensors_in_hf_folder(tmp_path):
    tiny = interp.tiny_model("llama")
    models.export_hf(tiny, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ModelLoadError, match="Could not load the model"):
        interp.load_model(str(tmp_path))


def test_tiny_model_kind():
    with pytest.raises(ModelLoadError, match="'llama' or 'gpt2'"):
        interp.tiny_model("mamba")


# -- data -----------------------------------------------------------------------------------


def _write(tmp, name, content, binary=False):
    path = tmp / name
    path.write_bytes(content) if binary else path.write_text(content)
    return path


DATA_CASES = [
    ("empty text", lambda t: _write(t, "e.txt", ""), {}, "contains no text"),
    ("whitespace text", lambda t: _write(t, "w.txt", " \n\n\t \n"), {}, "contains no text"),
    ("documents shorter than T", lambda t: _write(t, "s.txt", "tiny doc\n\nanother"), {"seq_len": 64},
     "have at least 63 tokens"),
    ("N larger than available", lambda t: _write(t, "n.txt", "x" * 100 + "\n\n" + "y" * 100), {"n": 5},
     "Asked for 5 examples"),
    ("non-UTF-8 file", lambda t: _write(t, "l.txt", "na\xefve".encode("latin-1"), True), {}, "not valid UTF-8"),
    ("JSONL without text", lambda t: _write(t, "x.jsonl", '{"content": "hi"}\n'), {}, "no 'text' field"),
    ("JSONL not JSON", lambda t: _write(t, "y.jsonl", "{oops\n"), {}, "not valid JSON"),
    ("missing file", lambda t: t / "absent.txt", {}, "not found"),
    ("unsupported suffix", lambda t: _write(t, "d.xlsx", "a,b"), {}, "Unsupported text file type"),
    ("dataset folder that is not a dataset", lambda t: (t / "ds").mkdir() or (t / "ds"), {},
     "not a dataset saved with save_to_disk"),
    ("seq_len below 2", lambda t: "wiki", {"seq_len": 1}, "seq_len must be at least 2"),
    ("n below 1", lambda t: "wiki", {"n": 0}, "positive number of examples"),
    ("unknown split", lambda t: "wiki", {"split": "train"}, "split must be"),
]


@pytest.mark.parametrize("name,make,kwargs,fragment", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_bad_text_sources(name, make, kwargs, fragment, tmp_path, tok):
    args = {"n": 1, "seq_len": 8, "split": "all"} | kwargs
    with pytest.raises(DataError, match=fragment):
        load_examples(make(tmp_path), tok, **args)


def test_sequence_longer_than_context(tiny_llama):
    ex = _ex(1, 300)  # tiny models have a context of 256
    with pytest.raises(InterpError, match="exceed this model's context of 256"):
        interp.nll(tiny_llama, ex)
    with pytest.raises(InterpError, match="Lower seq_len"):
        interp.probe(tiny_llama, ex, ["resid_mid"], ["norm"], progress=False)


# -- components -----------------------------------------------------------------------------

COMPONENT_CASES = [
    ("unknown component", {"components": ["resid"]}, "Unknown component 'resid'"),
    ("unknown reducer", {"reducers": ["median"]}, "Unknown reducer 'median'"),
    ("layer out of range", {"layers": [2]}, "has layers 0..1"),
    ("negative layer out of range", {"layers": [-3]}, "out of range"),
    ("attention reducer on a vector", {"components": ["resid_mid"], "reducers": ["entropy"]}, "applies to 'pattern'"),
    ("vector reducer on pattern", {"components": ["pattern"], "reducers": ["norm"]}, "for 'pattern' use"),
    ("batch size zero", {"batch_size": 0}, "batch_size must be at least 1"),
]


@pytest.mark.parametrize("name,kwargs,fragment", COMPONENT_CASES, ids=[c[0] for c in COMPONENT_CASES])
def test_bad_probe_requests(name, kwargs, fragment, tiny_llama):
    args = {"components": ["resid_mid"], "reducers": ["norm"], "progress": False} | kwargs
    with pytest.raises(ComponentError if "batch" not in name else InterpError, match=fragment):
        interp.probe(tiny_llama, _ex(), **args)


@pytest.mark.parametrize("component", ["gate", "up", "gate_pre", "gate_input"])
def test_gated_components_on_gpt2(component, tiny_gpt2):
    with pytest.raises(ComponentError, match="needs a gated MLP, but it has a plain MLP: GPT2LMHeadModel"):
        interp.probe(tiny_gpt2, _ex(), [component], ["norm"], progress=False)


# -- method specs ---------------------------------------------------------------------------

SPEC_CASES = [
    ("unknown method", "int8:bits=8", "unknown quantization method .int8.; valid methods: .*rtn"),
    ("nf bits out of range", "nf:bits=5,group=64", "bits"),
    ("rtn bits out of range", "rtn:bits=9,group=64", "bits"),
    ("malformed spec", "rtn:bits", "rtn"),
    ("unknown key", "rtn:bits=4,grp=64", "grp"),
]


@pytest.mark.parametrize("name,spec,fragment", SPEC_CASES, ids=[c[0] for c in SPEC_CASES])
def test_bad_method_specs(name, spec, fragment):
    from interp.quant import parse_spec

    with pytest.raises(SpecError, match=fragment):
        parse_spec(spec)


def test_group_not_dividing_input_dim():
    from interp.quant import quantize_weight

    with pytest.raises(SpecError, match="128"):
        quantize_weight(torch.randn(8, 576), "rtn:bits=4,group=128")


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_missing_calibration(method):
    from interp.quant import quantize_weight

    with pytest.raises(SpecError, match="calibration"):
        quantize_weight(torch.randn(8, 64), f"{method}:bits=4,group=64")


# -- non-finite values ----------------------------------------------------------------------


def test_nan_in_weights_is_reported_with_layer():
    model = interp.tiny_model("llama", seed=5)
    with torch.no_grad():
        model.original_model.model.layers[0].self_attn.o_proj.weight[:, 3] = float("inf")
    with pytest.raises(NonFiniteError, match="layer 0"):
        interp.probe(model, _ex(), ["resid_mid", "resid_post"], ["norm"], progress=False)
    with pytest.raises(NonFiniteError, match="NaN/inf NLL"):
        interp.nll(model, _ex())


def test_nan_weight_refused_by_quantizer():
    from interp.quant import quantize_weight

    w = torch.randn(4, 64)
    w[1, 2] = float("nan")
    with pytest.raises(NonFiniteError):
        quantize_weight(w, "rtn:bits=4,group=64")


# -- output folders and disks ---------------------------------------------------------------


def test_output_folder_not_writable(tmp_path, tiny_llama):
    if os.geteuid() == 0:
        target = "/proc/interp-cannot-write-here"  # even root cannot create files in /proc
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        target = str(locked / "out")
    res = interp.probe(tiny_llama, _ex(), ["resid_mid"], ["norm"], progress=False)
    with pytest.raises(ResourceError, match="Choose a writable folder"):
        res.save(target)


def test_disk_full_while_writing_results(tmp_path, monkeypatch, tiny_llama):
    from interp import io

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(io.os, "fsync", full)
    with pytest.raises(ResourceError, match="disk is full"):
        io.write_json(tmp_path / "r.json", {"a": 1})
    assert not (tmp_path / "r.json").exists()
    assert not list(tmp_path.glob("*.tmp"))  # no half-written file is left behind


def test_full_capture_refused_when_too_large(tiny_llama, monkeypatch):
    from interp.runtime import batching

    monkeypatch.setattr(batching, "available_memory_bytes", lambda: 1 << 20)  # pretend 1 MiB is free
    with pytest.raises(ResourceError, match="streaming reducer"):
        interp.probe(tiny_llama, _ex(64, 64), ["resid_mid"], ["full"], progress=False)


def test_cli_reports_errors_without_traceback(capsys):
    from interp.cli.main import main

    code = main(["probe", "--model", "no-such-model", "--out", "/tmp/interp-cli-err", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "Unknown model 'no-such-model'" in err and "Traceback" not in err


def test_examples_shape_checked():
    with pytest.raises(DataError, match=r"must be \[N, T\]"):
        Examples(tokens=torch.zeros(3, dtype=torch.long), texts=["a"] * 3, ids=["a", "b", "c"])
    with pytest.raises(DataError, match="same length"):
        Examples(tokens=torch.zeros(2, 4, dtype=torch.long), texts=["a"], ids=["a", "b"])


def test_json_results_have_no_nan(tmp_path):
    from interp.io import write_json

    write_json(tmp_path / "x.json", {"a": float("nan"), "b": [1.0, float("inf")]})
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": None, "b": [1.0, None]}
