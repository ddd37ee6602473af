"""Models split with accelerate's device_map (interp.load_model(device_map=...)), on the CPU.

The map offloads blocks to disk: accelerate's hooks then load each offloaded block's
weights from its files before the block runs and drop them after, exactly as they move
weights between GPUs. Every analysis must give the undispatched model's numbers. The
models are float64 and the split changes where weights are stored, not the arithmetic
(the same kernels on the same values in the same order), so the comparisons are exact
(``torch.equal``); a tolerance would hide a weight that went missing in transit.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import interp
from interp.errors import InterpError, ModelLoadError
from interp.models import tiny_tokenizer
from interp.runtime import hooks, placement

N_LAYERS = 3
# block 0 and block 2 live on disk, block 1 and everything else in memory
MAP = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu", "model.layers.2": "disk",
       "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}


def _config() -> LlamaConfig:
    cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=N_LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=256,
                      eos_token_id=257, pad_token_id=258, tie_word_embeddings=True, attn_implementation="eager")
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


@pytest.fixture(scope="module")
def weights():
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_config()).to(torch.float64)
    return {k: v.clone() for k, v in hf.state_dict().items()}


def _hf(weights):
    hf = AutoModelForCausalLM.from_config(_config()).to(torch.float64).eval()
    hf.load_state_dict(weights)
    return hf


@pytest.fixture(scope="module")
def plain(weights):
    return interp.load_model(_hf(weights), tokenizer=tiny_tokenizer(), name="tiny64")


@pytest.fixture(scope="module")
def split(weights, tmp_path_factory):
    folder = tmp_path_factory.mktemp("offload")
    return interp.load_model(_hf(weights), tokenizer=tiny_tokenizer(), name="tiny64", device_map=MAP,
                             offload_folder=folder)


@pytest.fixture(scope="module")
def rows():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (6, 12), generator=g)
    tokens[:, 0] = 256
    return interp.Examples.from_tokens(tokens)


def _linear(model, layer):
    with placement.onloaded(model, [layer]):
        return {role: slot.read().detach().clone() for role, slot in hooks.linear_weights(model, layer).items()}


def test_the_map_really_offloads(split):
    assert placement.is_dispatched(split) and placement.offloaded_layers(split) == [0, 2]
    assert hooks.linear_weights(split, 0)["q"].read().is_meta  # nothing of block 0 in memory between forwards


@pytest.mark.numerical
def test_logits_and_nll_equal_the_undispatched_model(plain, split, rows):
    assert torch.equal(split(rows.tokens), plain(rows.tokens))
    assert torch.equal(interp.nll(split, rows, batch_size=4), interp.nll(plain, rows, batch_size=4))
    assert interp.models.model_hash(split) == interp.models.model_hash(plain)


@pytest.mark.numerical
def test_probes_attention_and_lens_equal(plain, split, rows):
    from interp.attention import analyze
    from interp.localize.lens import early_exit
    from interp.probes import probe

    args = {"components": ("resid_mid", "resid_post", "h", "gate"), "reducers": ("norm",), "progress": False}
    pd.testing.assert_frame_equal(probe(split, rows, **args).to_frame(), probe(plain, rows, **args).to_frame(),
                                  check_exact=True)
    a, b = analyze(split, rows, progress=False), analyze(plain, rows, progress=False)
    pd.testing.assert_frame_equal(a.table, b.table, check_exact=True)
    assert torch.equal(early_exit(split, rows, progress=False).nll, early_exit(plain, rows, progress=False).nll)


@pytest.mark.numerical
def test_patching_equals(plain, split, rows, weights):
    from interp.localize.patching.engine import patch
    from interp.localize.patching.patches import joint_patches

    other = {k: v + 0.01 * torch.sign(v) for k, v in weights.items()}  # a second model to patch from
    source = interp.load_model(_hf(other), tokenizer=tiny_tokenizer(), name="other")
    jobs = joint_patches(["down", "attn_out", "gate_input"], [0, 2])
    a = patch(split, source, rows, jobs, batch_size=4, progress=False)
    b = patch(plain, source, rows, jobs, batch_size=4, progress=False)
    assert torch.equal(a.values, b.values) and torch.equal(a.target, b.target) and torch.equal(a.source, b.source)


@pytest.mark.numerical
def test_one_copy_patching_on_the_split_model(plain, split, rows, tmp_path):
    """The quantized weights swapped into the offloaded reference per batch: the two-model table, exactly."""
    from interp.localize.patching import patching_table
    from interp.quant.apply import quantize_cached
    from interp.quant.inplace import SavedWeights, cached_variant
    from interp.runtime.swap import WeightStash

    spec = "rtn:bits=3,group=32"
    with WeightStash(split) as stash:
        folder = cached_variant(split, spec, stash=stash, cache_dir=tmp_path, progress=False)
        one = patching_table(split, SavedWeights(folder, split), rows, "all", batch_size=4, progress=False,
                             stash=stash)
    two = patching_table(plain, quantize_cached(plain, spec, cache_dir=tmp_path, progress=False), rows, "all",
                         batch_size=4, progress=False)
    assert torch.equal(one.values, two.values) and torch.equal(one.target, two.target)
    assert torch.equal(one.source, two.source)
    assert not torch.equal(one.target, one.source)  # the quantized weights were in place
    assert torch.equal(split(rows.tokens), plain(rows.tokens))  # and the reference is back


@pytest.fixture(scope="module")
def calibration():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 256, (4, 16), generator=g)
    tokens[:, 0] = 256
    return interp.Examples.from_tokens(tokens, ids=[f"c{i}" for i in range(4)])


@pytest.mark.numerical
def test_gptq_in_place_on_the_split_model_equals_quantize(plain, split, calibration):
    """Sequential calibration: block by block, one block onloaded at a time, the very weights of quantize()."""
    from interp.quant.apply import quantize
    from interp.quant.inplace import quantized_in_place

    expected = quantize(plain, "gptq:bits=3,group=32", calibration=calibration, progress=False)
    before = [_linear(split, layer) for layer in range(N_LAYERS)]
    with quantized_in_place(split, "gptq:bits=3,group=32", calibration, progress=False):
        assert placement.offloaded_layers(split) == [0, 2]  # the offloaded blocks went back to disk
        for layer in range(N_LAYERS):
            got, want = _linear(split, layer), _linear(expected, layer)
            assert all(torch.equal(got[role], want[role]) for role in want), layer
    for layer in range(N_LAYERS):  # the reference is back, bit for bit (disk blocks included)
        after = _linear(split, layer)
        assert all(torch.equal(after[role], before[layer][role]) for role in after)


@pytest.mark.numerical
def test_score_and_restoration_on_the_split_model(plain, split, rows, tmp_path):
    from interp.localize.restoration import restoration_sweep
    from interp.quant.apply import quantize_cached
    from interp.quant.inplace import SavedWeights, cached_variant
    from interp.quant.store import score
    from interp.runtime.swap import WeightStash

    specs = ["rtn:bits=3,group=32", "nf:bits=3,group=32"]
    a = score(split, specs, rows, store=tmp_path / "split", batch_size=4, progress=False)
    b = score(plain, specs, rows, store=tmp_path / "plain", batch_size=4, progress=False)
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert a.abs().to_numpy().min() > 0  # the variants were really in place while scoring
    assert torch.equal(split(rows.tokens), plain(rows.tokens))  # and the reference is back

    with WeightStash(split) as stash:
        folder = cached_variant(split, specs[0], stash=stash, cache_dir=tmp_path / "q", progress=False)
    sweep = restoration_sweep(SavedWeights(folder, split), split, rows, batch_size=4)
    quantized = quantize_cached(plain, specs[0], cache_dir=tmp_path / "q", progress=False)
    two_copies = restoration_sweep(quantized, plain, rows, batch_size=4)
    # the in-place sweep runs the two-copy sweep's forwards (the quantized prefix captured once, the
    # restored blocks run from it, the same readout) on the same bits, here through the offload hooks
    assert torch.equal(sweep.nll, two_copies.nll)
    assert torch.equal(sweep.reference_nll, two_copies.reference_nll)
    assert float((sweep.nll[0] - sweep.nll[-1]).abs().min()) > 1e-3  # restoring changed something


def test_analyses_that_copy_the_model_refuse_offloaded_blocks(split, plain, calibration):
    from interp.localize.restoration import restore_layers
    from interp.quant.apply import quantize

    with pytest.raises(InterpError, match="offloaded to CPU or disk"):
        quantize(split, "rtn:bits=3,group=32", progress=False)
    with pytest.raises(InterpError, match="offloaded to CPU or disk"):
        restore_layers(split, plain, [0])


@pytest.mark.parametrize("kwargs, message", [
    ({"device_map": "everywhere"}, "device_map must be one of"),
    ({"device_map": {"model.layers.0": "disk"}}, "offload_folder"),
    ({"device_map": "auto", "device": "cpu"}, "either device= or device_map="),
    ({"offload_folder": "x"}, "go with device_map"),
    ({"device_map": "auto", "max_memory": "1GiB"}, "max_memory must be a dict"),
])
def test_bad_placements_get_clear_errors(kwargs, message):
    with pytest.raises(ModelLoadError, match=message):
        interp.load_model("no-such-model", **kwargs)


def test_a_map_naming_unknown_modules_is_refused(weights, tmp_path):
    with pytest.raises(ModelLoadError, match="does not have"):
        interp.load_model(_hf(weights), tokenizer=tiny_tokenizer(), device_map={"model.blocks.0": "cpu"})


def test_a_saved_folder_loads_with_device_map(plain, weights, rows, tmp_path):
    """The file route: transformers' from_pretrained places and offloads while loading."""
    folder = interp.models.export_hf(plain, tmp_path / "hf")
    loaded = interp.load_model(folder, device_map=MAP, offload_folder=tmp_path / "off")  # float32, as files load
    assert placement.offloaded_layers(loaded) == [0, 2]
    assert torch.equal(loaded(rows.tokens), interp.load_model(folder)(rows.tokens))  # same float32 arithmetic


def test_cli_quantize_with_a_device_map_saves_quantize_s_weights(weights, tmp_path, capsys):
    """``interp quantize --device-map JSON --offload-folder``: in place, block by block, the weights of quantize()."""
    import json

    from safetensors.torch import load_file

    from interp.cli.main import main
    from interp.quant.apply import quantize

    float32 = interp.load_model(_hf(weights).to(torch.float32), tokenizer=tiny_tokenizer())  # files load as float32
    folder = interp.models.export_hf(float32, tmp_path / "hf")
    text = tmp_path / "doc.txt"
    text.write_text("\n\n".join(f"Document {i} says something about the number {i * 7}." for i in range(12)))
    argv = ["quantize", "--model", str(folder), "--data", str(text), "--method", "rtn:bits=3,group=32",
            "--out", str(tmp_path / "q"), "--quiet", "--device-map", json.dumps(MAP),
            "--offload-folder", str(tmp_path / "off")]
    assert main(argv) == 0
    saved = load_file(str(tmp_path / "q" / "quantized.safetensors"))
    expected = quantize(interp.load_model(folder), "rtn:bits=3,group=32", progress=False)
    for layer in range(N_LAYERS):
        for role, weight in _linear(expected, layer).items():
            assert torch.equal(saved[f"{layer}.{role}"], weight), (layer, role)


@pytest.mark.parametrize("extra, message", [
    (["--device-map", "everywhere"], "neither auto"),
    (["--device-map", '{"model.layers.0": "disk"}'], "--offload-folder"),
    (["--offload-folder", "x"], "go with --device-map"),
    (["--device-map", "auto", "--max-memory", "0"], "DEVICE=SIZE"),
])
def test_cli_placement_errors(extra, message, tmp_path, capsys):
    from interp.cli.main import main

    argv = ["quantize", "--method", "rtn:bits=3", "--out", str(tmp_path / "q"), *extra]
    try:
        code = main(argv)  # a check's error: one line, exit status 2
    except SystemExit as exc:  # argparse's own (a bad value for an option's type)
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
