"""A method spec is parsed once, at the edge (issue 45 item 6).

The command line, the API's public functions and the report's settings parse a spec's text into a
:class:`~interp.quant.spec.MethodSpec`; everything inside takes that object. These tests count
:func:`~interp.quant.spec.parse_spec` wherever it is bound (modules import it by name) and every parse
of a spec's text (``interp.quant.spec._parse_text``, the one function that reads it, a plan file's spec
included), during one whole call, and show that the count would catch an inner function that parses again.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import pytest
import torch
import transformers as tf

import interp
import interp.quant.spec as spec_module
from interp.cli.main import main  # imported before any count: the commands' defaults are parsed at import
from interp.quant import apply as qa
from interp.quant.store import score

pytestmark = pytest.mark.usefixtures("one_thread")  # one_thread: conftest.py

SPECS = ["rtn:bits=3,group=32", "nf:bits=4,group=32"]


@dataclass
class Parses:
    calls: list[object] = field(default_factory=list)  # every parse_spec call's argument
    texts: list[str] = field(default_factory=list)  # every text parsed

    def strings(self) -> list[object]:
        return [c for c in self.calls if isinstance(c, str)]


@pytest.fixture
def parses(monkeypatch) -> Parses:
    """Count parse_spec in every interp module that bound the real one, and the parse of text itself."""
    real, real_text = spec_module.parse_spec, spec_module._parse_text
    seen = Parses()

    def counted(spec):
        seen.calls.append(spec)
        return real(spec)

    def counted_text(text):
        seen.texts.append(text)
        return real_text(text)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("interp") and getattr(module, "parse_spec", None) is real:
            monkeypatch.setattr(module, "parse_spec", counted)
    monkeypatch.setattr(spec_module, "_parse_text", counted_text)
    return seen


@pytest.fixture(scope="module")
def model():
    return interp.tiny_model("llama", seed=0, n_layers=2)


@pytest.fixture(scope="module")
def examples():
    g = torch.Generator().manual_seed(2)
    return interp.Examples.from_tokens(torch.randint(0, 256, (6, 16), generator=g))


def _plan(tmp_path) -> str:
    plan = tmp_path / "plan" / "plan.json"
    plan.parent.mkdir()
    plan.write_text(json.dumps({"spec": "rtn:bits=3,group=32|1.down=4", "widths": {"1.down": 4, "0.q": 3}}))
    return f"@{plan}"


def test_score_parses_each_spec_string_once(model, examples, tmp_path, parses):
    """One score call, a plan file's spec among its specs: one parse_spec call per string, none inside."""
    specs = [*SPECS, _plan(tmp_path)]
    errors = score(model, specs, examples, store=tmp_path / "store", batch_size=3, progress=False)
    assert errors.shape == (6, 3)
    assert parses.calls == specs  # the edge's own calls, and nothing below it calls parse_spec
    assert parses.texts == [*SPECS, "rtn:bits=3,group=32|1.down=4"]  # the plan's spec is read once, too


def test_quantize_and_its_cache_parse_once(model, examples, tmp_path, parses):
    """quantize (a calibrated method: its per-weight quantizer and the checks) and quantize_cached (the key,
    the algorithm's version, the quantizing and the saving): one parse each."""
    made = qa.quantize(model, "gptq:bits=3,group=32", calibration=examples, progress=False)
    cached = qa.quantize_cached(model, "rtn:bits=3,group=32", cache_dir=tmp_path, progress=False)
    interp.nll(made, examples, batch_size=3)
    interp.nll(cached, examples, batch_size=3)
    assert parses.calls == ["gptq:bits=3,group=32", "rtn:bits=3,group=32"]
    assert parses.texts == ["gptq:bits=3,group=32", "rtn:bits=3,group=32"]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("parse-once")
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=interp.models.TINY_VOCAB, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=64, bos_token_id=256, eos_token_id=257, pad_token_id=258)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    interp.models.tiny_tokenizer().save_pretrained(root / "model")
    docs = [f"Document {i}: " + " ".join(f"word{(i * 7 + j) % 23}" for j in range(12)) for i in range(30)]
    (root / "docs.txt").write_text("\n\n".join(docs) + "\n")
    return root


def test_the_score_command_parses_each_spec_string_once(model_folder, tmp_path, parses):
    """``interp score``: the options parse each spec (a plan file's too) once; the command passes them on parsed
    (the library's edge then gets a MethodSpec, which it does not parse)."""
    plan = _plan(tmp_path)
    assert main(["score", "--model", str(model_folder / "model"), "--data", str(model_folder / "docs.txt"),
                 "--n", "6", "--seq-len", "16", "--methods", f"{SPECS[0]};{plan}", "--batch-size", "3",
                 "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert (tmp_path / "out" / "errors.csv").is_file()
    assert parses.strings() == [SPECS[0], plan]
    assert parses.texts == [SPECS[0], "rtn:bits=3,group=32|1.down=4"]


@pytest.mark.parametrize("where", ["interp.quant.inplace._cache_key", "interp.quant.inplace._quantize_weights",
                                   "interp.quant.apply._algorithm_version"])
def test_an_inner_parse_is_caught(model, examples, tmp_path, parses, monkeypatch, where):
    """The count can fail: an inner function that parses its spec again, as the old code did at every level
    (the cache key, the block-by-block quantizer, the algorithm's version), makes score call parse_spec more
    than once per string."""
    module_name, _, name = where.rpartition(".")
    module = sys.modules[module_name]
    original = getattr(module, name)

    def parsing_again(*args, **kwargs):
        args = [spec_module.parse_spec(a) if isinstance(a, spec_module.MethodSpec) else a for a in args]
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, parsing_again)
    score(model, SPECS, examples, store=tmp_path / "store", batch_size=3, progress=False)
    assert parses.calls[:2] == SPECS
    assert len(parses.calls) > len(SPECS)  # what test_score_parses_each_spec_string_once refuses
