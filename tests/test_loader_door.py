"""The loading boundary (interp.loading, interp.reading): no model folder's code runs, no file outside the
folder is read, every read is bounded, and a results folder's settings.json is data.

Each hostile folder is a real tiny model folder written by ``save_pretrained`` with one thing added: an
``auto_map`` pointing at ``evil.py`` in the folder, which writes a sentinel file when imported. Standard
input answers ``y`` to transformers' "run the custom code? [y/N]" question, so the only thing between
the folder and its code running is interp.
"""

from __future__ import annotations

import ast
import io
import json
import os
import struct
from pathlib import Path

import pytest
import torch

import interp
from interp.errors import DataError, ModelLoadError, SpecError
from interp.loading import check_folder, pretrained
from interp.models import canonical_state_dict
from interp.reading import read_json, read_text

ROOT = Path(__file__).resolve().parents[1]


def _tiny_folder(folder: Path, extra_config: dict | None = None) -> Path:
    """A one-layer llama folder (config, safetensors, tokenizer) written by transformers itself."""
    import transformers

    from interp.models import tiny_tokenizer

    cfg = transformers.LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, bos_token_id=256, eos_token_id=257, **(extra_config or {}))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _plant_code(folder: Path, sentinel: Path, where: tuple[str, ...] = ("config", "tokenizer")) -> Path:
    """Add ``evil.py`` (writes ``sentinel`` on import) and ``auto_map`` entries naming it."""
    (folder / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(sentinel)!r}).write_text('the folder code ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evil'\n"
        "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    if "config" in where:  # a model type transformers does not ship: only the folder's code could build it
        _edit_json(folder / "config.json", model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig",
                                                                        "AutoModelForCausalLM": "evil.EvilModel"})
    if "tokenizer" in where:
        _edit_json(folder / "tokenizer_config.json", tokenizer_class="EvilTokenizer",
                   auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    return folder


def _edit_json(path: Path, **entries) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **entries}))


@pytest.fixture
def yes_on_stdin(monkeypatch):
    """Whatever asks on standard input gets 'y'."""
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 8))


@pytest.mark.parametrize("where", [("config",), ("tokenizer",), ("config", "tokenizer")])
def test_a_folder_with_an_auto_map_is_refused_and_its_code_never_runs(tmp_path, yes_on_stdin, where):
    sentinel = tmp_path / "sentinel"
    folder = _plant_code(_tiny_folder(tmp_path / "model"), sentinel, where)
    with pytest.raises(ModelLoadError, match="auto_map.*never runs a folder's code"):
        interp.load_model(folder)
    assert not sentinel.exists()


def test_trust_remote_code_false_alone_keeps_the_code_from_running(tmp_path, yes_on_stdin, monkeypatch):
    """Defence in depth: with the auto_map refusal switched off, transformers still gets
    trust_remote_code=False, so it does not ask, and the folder's code does not run (the folder then
    cannot be built, which is the right outcome for a model that exists only as its own code)."""
    import interp.loading

    sentinel = tmp_path / "sentinel"
    folder = _plant_code(_tiny_folder(tmp_path / "model"), sentinel)
    monkeypatch.setattr(interp.loading, "refuse_code", lambda folder: None)
    with pytest.raises(ModelLoadError):  # transformers ships no 'evil' model type, and the folder's is not run
        interp.load_model(folder)
    assert not sentinel.exists()


def test_a_compressed_tensors_checkpoint_with_an_auto_map_is_refused(tmp_path, yes_on_stdin):
    from interp.quant import quantize
    from interp.quant.export import export_compressed_tensors

    reference = interp.tiny_model("llama", n_layers=1)
    qmodel = quantize(reference, "rtn:bits=4,group=32,zero=int", progress=False)
    folder = export_compressed_tensors(qmodel, reference, tmp_path / "ct")
    assert interp.load_model(folder).checkpoint_info.format == "compressed-tensors"  # loads before the plant
    sentinel = tmp_path / "sentinel"
    _plant_code(folder, sentinel)
    with pytest.raises(ModelLoadError, match="auto_map"):
        interp.load_model(folder)
    assert not sentinel.exists()


def test_every_from_pretrained_in_interp_goes_through_the_door():
    """Each ``.from_pretrained(`` call in interp/ passes ``trust_remote_code=False`` as a literal keyword, and
    the only one is interp.loading.pretrained (the project's before-stop hook runs the first check too)."""
    calls = []
    for path in sorted((ROOT / "interp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "from_pretrained":
                literal = any(k.arg == "trust_remote_code" and isinstance(k.value, ast.Constant)
                              and k.value.value is False for k in node.keywords)
                calls.append((str(path.relative_to(ROOT)), node.lineno, literal))
    assert calls, "the AST walk found no from_pretrained call at all: it is not looking where the code is"
    assert [c for c in calls if not c[2]] == []
    assert {c[0] for c in calls} == {"interp/loading.py"}


def test_the_door_passes_trust_remote_code_false_and_it_cannot_be_overridden(tmp_path):
    seen = {}

    class Loader:
        @staticmethod
        def from_pretrained(folder, **kwargs):
            seen.update(kwargs)
            return "loaded"

    folder = _tiny_folder(tmp_path / "model")
    assert pretrained(Loader, folder) == "loaded"
    assert seen == {"trust_remote_code": False, "local_files_only": True}
    with pytest.raises(TypeError):
        pretrained(Loader, folder, trust_remote_code=True)


@pytest.mark.parametrize("name", ["../outside.safetensors", "ABSOLUTE", "sub/../../outside.safetensors"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(tmp_path, name):
    folder = _tiny_folder(tmp_path / "model")
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((folder / "model.safetensors").read_bytes())  # a valid file: only its place is wrong
    shard = str(outside) if name == "ABSOLUTE" else name
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": shard}}))
    with pytest.raises(ModelLoadError, match="outside the model folder|not a file name inside"):
        interp.load_model(folder)


def test_a_weights_symlink_out_of_the_folder_is_refused(tmp_path):
    folder = _tiny_folder(tmp_path / "model")
    moved = tmp_path / "elsewhere.safetensors"
    (folder / "model.safetensors").rename(moved)
    (folder / "model.safetensors").symlink_to(moved)
    with pytest.raises(ModelLoadError, match="outside the model folder"):
        interp.load_model(folder)


def test_an_index_inside_the_folder_loads(tmp_path):
    """The confinement refuses only what escapes: a valid index naming the folder's own shard loads."""
    folder = _tiny_folder(tmp_path / "model")
    check_folder(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model.safetensors"}}))
    check_folder(folder)


def test_truncated_weights_and_a_huge_safetensors_header_are_clear_errors(tmp_path):
    folder = _tiny_folder(tmp_path / "model")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        interp.load_model(folder)
    weights.write_bytes(struct.pack("<Q", 1 << 62) + b"{}")  # a header of 4 EiB
    with pytest.raises(ModelLoadError, match="header"):
        interp.load_model(folder)


def test_a_truncated_config_is_a_clear_error(tmp_path):
    folder = _tiny_folder(tmp_path / "model")
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        interp.load_model(folder)


def test_a_gguf_that_is_not_one_is_refused_before_it_is_read(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 1 << 40))  # counts no 24-byte file can hold
    with pytest.raises(ModelLoadError, match="malformed GGUF header"):
        interp.load_model(fake)
    fake.write_bytes(b"not a gguf at all" * 4)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        interp.load_model(fake)


# ---------------------------------------------------------------------------------------
# bounded reads


def test_devices_and_pipes_are_refused_before_they_are_read(tmp_path):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    for path, kind in [("/dev/zero", "character device"), (fifo, "pipe"), (tmp_path, "folder")]:
        with pytest.raises(DataError, match=kind):
            read_text(path, "the text source")
    with pytest.raises(DataError, match="character device"):
        interp.load_examples("/dev/zero", interp.models.tiny_tokenizer(), n=1, seq_len=4)
    with pytest.raises(DataError, match="pipe"):
        interp.load_examples(fifo, interp.models.tiny_tokenizer(), n=1, seq_len=4)


def test_a_file_larger_than_the_bound_is_refused_without_reading_it_whole(tmp_path):
    big = tmp_path / "big.json"
    with big.open("wb") as fh:  # sparse: 2 GiB of apparent size, no disk used
        fh.truncate(2 << 30)
    with pytest.raises(DataError, match="larger than the 64 MiB"):
        read_json(big, "settings")
    with pytest.raises(DataError, match="larger than the 1024 MiB"):
        read_text(big, "the text source")


def test_a_spec_file_that_is_a_device_is_refused(tmp_path):
    from interp.quant.spec import parse_spec

    with pytest.raises(SpecError, match="character device"):
        parse_spec("@/dev/zero")
    plan = tmp_path / "plan.json"
    plan.write_text('{"spec": "rtn:bits=4,group=32"')  # truncated
    with pytest.raises(SpecError, match="not valid JSON"):
        parse_spec(f"@{plan}")


# ---------------------------------------------------------------------------------------
# interp errors: settings.json is data


def _score_folder(folder: Path, model: str) -> Path:
    from interp.quant.store import REFERENCE, ScoreStore

    ids = [f"doc{i}" for i in range(4)]
    with ScoreStore(folder) as store:
        store.write_batch("m", REFERENCE, ids, [2.0, 3.0, 4.0, 5.0])
        store.write_batch("m", "rtn:bits=4,group=64", ids, [2.5, 3.5, 4.5, 5.5])
        store.write_batch("m", "rtn:bits=3,group=64", ids, [3.0, 3.5, 5.0, 5.5])
    (folder / "settings.json").write_text(json.dumps({
        "model": model, "specs": ["rtn:bits=4,group=64", "rtn:bits=3,group=64"],
        "examples": {"source": "wiki", "n": 4, "seq_len": 16, "seed": 0, "split": "eval"}}))
    return folder


def _errors(argv: list[str], capsys) -> tuple[int, str]:
    from interp.cli.main import main

    capsys.readouterr()
    try:
        code = main(["errors", *argv, "--quiet", "--n-boot", "10"])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_interp_errors_does_not_load_a_folder_that_only_settings_json_names(tmp_path, yes_on_stdin, capsys,
                                                                            monkeypatch):
    monkeypatch.setenv("INTERP_CACHE", str(tmp_path / "cache"))
    sentinel = tmp_path / "sentinel"
    evil = _plant_code(_tiny_folder(tmp_path / "model"), sentinel)
    scores = _score_folder(tmp_path / "scores", str(evil))
    code, err = _errors(["--scores", str(scores)], capsys)
    assert code == 2 and "settings.json names the model" in err and "--reference" in err
    code, err = _errors(["--scores", str(scores), "--reference", str(evil)], capsys)  # named by the user too
    assert code == 2 and "auto_map" in err
    assert not sentinel.exists()


def test_interp_errors_refuses_a_truncated_or_malformed_settings_json(tmp_path, capsys):
    scores = _score_folder(tmp_path / "scores", "smollm2-135m")
    text = (scores / "settings.json").read_text()
    for broken, why in [(text[: len(text) // 2], "not valid JSON"), ("[1, 2]", "not a JSON object"),
                        (json.dumps({**json.loads(text), "examples": "wiki"}), "examples")]:
        (scores / "settings.json").write_text(broken)
        code, err = _errors(["--scores", str(scores)], capsys)
        assert code == 2 and why in err, err
    os.remove(scores / "settings.json")
    os.mkfifo(scores / "settings.json")
    code, err = _errors(["--scores", str(scores), "--skip-norms"], capsys)
    assert code == 2 and "pipe" in err



# ---------------------------------------------------------------------------------------
# A model loads exactly or not at all (interp.loading.check_exact, on transformers' loading information)


def _exact_folder(folder: Path, tied: bool, layers: int) -> Path:
    """A tiny llama folder written by save_pretrained: tied (no lm_head saved) or untied, 1 or 2 layers."""
    import transformers

    from interp.models import tiny_tokenizer

    cfg = transformers.LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=2, num_key_value_heads=1, bos_token_id=256, eos_token_id=257,
                                   tie_word_embeddings=tied)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _rewrite(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def corrupt(folder: Path, how: str, pick: int) -> str:
    """Break ``folder`` one way; return a fragment the refusal must contain (the tensor or the config field)."""
    config = json.loads((folder / "config.json").read_text())
    tensors = _tensors(folder)
    if how == "drop":
        name = sorted(tensors)[pick % len(tensors)]
        del tensors[name]
        _rewrite(folder, tensors)
        return name.removesuffix(".weight")
    if how == "extra":
        _rewrite(folder, {**tensors, "model.layers.0.extra.weight": torch.zeros(3)})
        return "model.layers.0.extra.weight"
    if how == "more_layers":
        _edit_json(folder / "config.json", num_hidden_layers=config["num_hidden_layers"] + 1)
        return f"num_hidden_layers={config['num_hidden_layers'] + 1}"
    if how == "fewer_layers":
        _edit_json(folder / "config.json", num_hidden_layers=config["num_hidden_layers"] - 1)
        return f"num_hidden_layers={config['num_hidden_layers'] - 1}"
    if how == "flip_tie":  # untie a tied folder (no head saved), or tie an untied one (its own head saved)
        _edit_json(folder / "config.json", tie_word_embeddings=not config["tie_word_embeddings"])
        return "untied head" if config["tie_word_embeddings"] else "lm_head.weight that differs"
    if how == "shape":
        _edit_json(folder / "config.json", intermediate_size=2 * config["intermediate_size"])
        return "mlp.down_proj.weight (saved [32, 64], model [32, 128])"
    raise AssertionError(how)


CORRUPTIONS = ("drop", "extra", "more_layers", "fewer_layers", "flip_tie", "shape")


def assert_refused(folder: Path, fragment: str) -> None:
    """The property's inner check: loading the broken folder is a ModelLoadError naming what is wrong."""
    with pytest.raises(ModelLoadError, match="does not load exactly") as caught:
        interp.load_model(folder)
    assert fragment in str(caught.value), str(caught.value)


def test_an_intact_folder_loads_every_saved_tensor_exactly(tmp_path):
    for tied in (True, False):
        folder = _exact_folder(tmp_path / f"model-{tied}", tied, layers=2)
        params = canonical_state_dict(interp.load_model(folder))  # the bridge's tensors under their HF names
        saved = _tensors(folder)
        assert set(saved) <= set(params) and ("lm_head.weight" in saved) == (not tied)
        assert all(torch.equal(params[k], v) for k, v in saved.items())
        if tied:  # the head is the embedding, as the config says
            assert torch.equal(params["lm_head.weight"], saved["model.embed_tokens.weight"])


def test_a_tied_config_over_an_untied_head_is_refused_and_names_both(tmp_path):
    """The issue's case: transformers reports nothing (its loading information is empty) and replaces the saved
    head by the embedding; interp compares the two."""
    folder = _exact_folder(tmp_path / "model", tied=False, layers=1)
    _edit_json(folder / "config.json", tie_word_embeddings=True)
    assert_refused(folder, "ties lm_head.weight to model.embed_tokens.weight")


def test_a_tied_config_over_an_equal_saved_head_loads(tmp_path):
    folder = _exact_folder(tmp_path / "model", tied=True, layers=1)
    tensors = _tensors(folder)
    _rewrite(folder, {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()})
    params = canonical_state_dict(interp.load_model(folder))
    assert torch.equal(params["lm_head.weight"], tensors["model.embed_tokens.weight"])


def test_more_layers_in_the_config_than_saved_names_the_layers(tmp_path):
    folder = _exact_folder(tmp_path / "model", tied=True, layers=1)
    _edit_json(folder / "config.json", num_hidden_layers=3)
    assert_refused(folder, "num_hidden_layers=3, but the weights hold no tensor of layers [1, 2]")


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("how", CORRUPTIONS)
def test_every_corruption_is_refused(tmp_path, how, tied):
    layers = 2 if how == "fewer_layers" else 1
    folder = _exact_folder(tmp_path / "model", tied, layers)
    assert_refused(folder, corrupt(folder, how, pick=3))


def test_property_any_dropped_tensor_is_refused_and_named(tmp_path_factory):
    """Property: whichever saved tensor is dropped, of a tied or untied folder of 1 or 2 layers, the load is
    refused naming it (hypothesis, derandomized)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    counter = iter(range(10**6))

    @settings(max_examples=8, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(tied=st.booleans(), layers=st.integers(1, 2), how=st.sampled_from(CORRUPTIONS), pick=st.integers(0, 40))
    def prop(tied: bool, layers: int, how: str, pick: int) -> None:
        if how == "fewer_layers" and layers == 1:
            layers = 2
        folder = _exact_folder(tmp_path_factory.mktemp(f"exact-{next(counter)}"), tied, layers)
        assert_refused(folder, corrupt(folder, how, pick))

    prop()


def test_with_the_one_place_switched_off_the_corruptions_load_silently(tmp_path, monkeypatch):
    """The property test's inner check fails when interp.loading.check_exact is a no-op: the refusals come from
    that one place, not from transformers."""
    monkeypatch.setattr("interp.loading.check_exact", lambda *args, **kwargs: None)
    silent = []
    for how in ("drop", "extra", "more_layers", "fewer_layers", "flip_tie", "shape"):
        for tied in (True, False):
            folder = _exact_folder(tmp_path / f"{how}-{tied}", tied, 2 if how == "fewer_layers" else 1)
            fragment = corrupt(folder, how, pick=3)
            try:
                assert_refused(folder, fragment)
            except pytest.fail.Exception:
                silent.append((how, tied))
    assert len(silent) == 2 * 6, silent  # every one loads (randomly initialised, dropped or replaced tensors)
