"""Copies of a model (interp.models.copy_model): each owns what it runs, and they are the only deep copies.

After a forward, each transformer-lens block holds capture hooks whose closures point at the block's own
attention module. A plain ``copy.deepcopy`` shared them: the copy's forwards wrote ln1's input, with its autograd
graph, onto the original, so the next copy of the original failed with torch's "graph leaves" error (CI stop 61:
test_memory's order on one xdist worker), and the copy raised ReferenceError once the original was freed.
quantize(), load_quantized() and restore_layers() each copy the model.
"""

from __future__ import annotations

import ast
import copy
import gc
from pathlib import Path

import pytest
import torch

import interp
from interp import models
from interp.localize.restoration import restore_layers
from interp.quant.apply import quantize
from interp.quant.saving import load_quantized, save_quantized

ROOT = Path(__file__).resolve().parents[1]
SPEC = "rtn:bits=4,group=32"


def _tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (3, 12), generator=g)
    tokens[:, 0] = 256
    return tokens


def _graph_tensors(model) -> dict[str, int]:
    """Module attributes (not parameters or buffers) that hold a tensor with an autograd graph, by identity."""
    return {f"{name}.{key}": id(value) for name, module in model.named_modules() for key, value in vars(module).items()
            if isinstance(value, torch.Tensor) and not value.is_leaf}


def _used(kind: str = "llama"):
    """A tiny model after a forward with autograd on, as a notebook leaves it."""
    model = interp.tiny_model(kind, seed=0, n_layers=2)
    model(_tokens())
    return model


def test_the_case_is_live():
    """A plain deep copy of a used model, run with autograd on, leaves a graph on the original, which then cannot
    be deep-copied. Without this the tests below could pass vacuously (e.g. after a transformer-lens change)."""
    model = _used()
    copy.deepcopy(model)(_tokens())
    assert _graph_tensors(model)
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(model)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_copy_runs_alone_and_leaves_the_original_as_it_was(kind):
    model, tokens = _used(kind), _tokens()
    own = _graph_tensors(model)  # activations the original's own forward left (gpt2 keeps its pattern)
    clone = models.copy_model(model)
    clone(tokens)  # autograd on
    assert _graph_tensors(model) == own  # the copy's forward wrote nothing onto the original
    models.copy_model(model)  # copying it again works
    with torch.no_grad():
        want = model(tokens)
    del model
    gc.collect()
    with torch.no_grad():
        assert torch.equal(clone(tokens), want)  # the original is gone; the copy runs on its own


def test_copies_of_a_used_model_equal_copies_of_an_unused_one(tmp_path):
    model, fresh, tokens = _used(), interp.tiny_model("llama", seed=0, n_layers=2), _tokens()
    a = quantize(model, SPEC, progress=False)
    a(tokens)  # a forward on the copy, autograd on: the original must stay copyable
    b = quantize(fresh, SPEC, progress=False)
    loaded = load_quantized(model, save_quantized(a, tmp_path / "q"))
    restored = restore_layers(a, model, [0, 1])  # every block restored: the reference
    with torch.no_grad():
        assert torch.equal(a(tokens), b(tokens))
        assert torch.equal(loaded(tokens), b(tokens))
        assert torch.equal(restored(tokens), fresh(tokens))
        assert not torch.equal(a(tokens), fresh(tokens))  # the quantized copies really differ from the reference


def test_switching_the_unwiring_off_brings_the_failure_back(monkeypatch):
    monkeypatch.setattr(models, "_unwire_captures", lambda model: None)
    monkeypatch.setattr(models, "_transient_tensors", lambda value, found: None)
    model = _used()
    quantize(model, SPEC, progress=False)(_tokens())
    with pytest.raises(RuntimeError, match="graph leaves"):
        quantize(model, SPEC, progress=False)


def test_no_other_code_deep_copies():
    """One place copies models: every ``deepcopy`` call in interp/ is inside models.copy_model."""
    calls = []
    for path in sorted((ROOT / "interp").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        owners: dict[int, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    owners.setdefault(id(inner), node.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name == "deepcopy":
                    calls.append((path.relative_to(ROOT).as_posix(), owners.get(id(node))))
    assert calls == [("interp/models.py", "copy_model")], calls
