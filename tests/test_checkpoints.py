"""Quantized checkpoints in (interp.checkpoints): compressed-tensors, GPTQ and AWQ folders through load_model."""

from __future__ import annotations

import json

import pytest
import torch

import interp
from interp.errors import ModelLoadError
from interp.models import export_hf
from interp.quant import quantize

D_IN, D_OUT, GROUP = 128, 256, 32  # the tiny model's up_proj: [d_mlp=256, d_model=128]


@pytest.fixture(scope="module")
def model():
    return interp.tiny_model("llama", seed=0, hidden_size=128, intermediate_size=256)


def _known_grid(seed: int, bits: int = 4):
    """Integer levels, integer zero-points and scales for every block linear weight, made up in the test."""
    g = torch.Generator().manual_seed(seed)
    def grid(d_out, d_in):
        scale = (torch.rand(d_out, d_in // GROUP, generator=g) / 50 + 1e-3).to(torch.float16).float()  # fp16 scales
        return (torch.randint(0, 2**bits, (d_out, d_in), generator=g),
                torch.randint(0, 2**bits, (d_out, d_in // GROUP), generator=g), scale)

    return g, grid


def _expected(levels, zero, scale):
    """w[o, i] = (q[o, i] - zero[o, i // group]) * scale[o, i // group], one weight at a time over a few rows."""
    w = torch.empty(levels.shape)
    for o in range(levels.shape[0]):
        for i in range(levels.shape[1]):
            w[o, i] = (float(levels[o, i]) - float(zero[o, i // GROUP])) * float(scale[o, i // GROUP])
    return w


def _write_folder(model, tmp_path, tensors_for, quantization_config):
    """The tiny model as a library would write it: every block linear weight replaced by ``tensors_for``'s."""
    from safetensors.torch import load_file, save_file

    folder = export_hf(model, tmp_path / "plain")
    state = load_file(str(folder / "model.safetensors"))
    grids = {}
    for key in [k for k in state if k.endswith("proj.weight")]:
        d_out, d_in = state[key].shape
        name = key.removesuffix(".weight")
        tensors, grid = tensors_for(d_out, d_in)
        del state[key]
        state.update({f"{name}.{suffix}": value for suffix, value in tensors.items()})
        grids[key] = grid
    save_file(state, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    return folder, grids


def _pack_along_rows(values, bits):
    """Pack [n, cols] along the first dimension, 32/bits per int32 word, value k of a word at bits k*bits..."""
    per = 32 // bits
    words = torch.zeros(values.shape[0] // per, values.shape[1], dtype=torch.int64)
    for k in range(per):
        words |= values[k::per].to(torch.int64) << (bits * k)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_gptq_folder_loads_with_the_documented_dequantization(model, tmp_path):
    g, grid_for = _known_grid(1)

    def tensors_for(d_out, d_in):
        levels, zero, scale = grid_for(d_out, d_in)
        zero = zero.clamp(min=1)  # v1 stores zero - 1 in 4 unsigned bits, so a zero-point of 0 cannot be stored
        tensors = {  # GPTQ v1: qweight packs along d_in, qzeros along d_out storing zero - 1, scales [groups, d_out]
            "qweight": _pack_along_rows(levels.T.contiguous(), 4),
            "qzeros": _pack_along_rows(zero - 1, 4).T.contiguous(),
            "scales": scale.T.to(torch.float16).contiguous(),
            "g_idx": (torch.arange(d_in) // GROUP).to(torch.int32),
        }
        return tensors, (levels, zero, scale)

    folder, grids = _write_folder(model, tmp_path, tensors_for, {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                                                                 "desc_act": False, "sym": False,
                                                                 "checkpoint_format": "gptq"})
    loaded = interp.load_model(folder)
    info = loaded.checkpoint_info
    assert (info.format, info.bits, info.group, len(info.modules)) == ("gptq", 4, GROUP, 14)
    weight = loaded.original_model.model.layers[1].mlp.up_proj.weight
    levels, zero, scale = grids["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(weight[:3], _expected(levels[:3], zero[:3], scale[:3]))


def test_awq_folder_loads_with_the_documented_dequantization(model, tmp_path):
    g, grid_for = _known_grid(2)
    order = (0, 2, 4, 6, 1, 3, 5, 7)

    def pack_awq(values):  # [rows, cols] -> [rows, cols / 8]: output 8j + order[k] at bits 4k..4k+3 of word j
        words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
        for k in range(8):
            words |= values[:, order[k]::8].to(torch.int64) << (4 * k)
        return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)

    def tensors_for(d_out, d_in):
        levels, zero, scale = grid_for(d_out, d_in)
        tensors = {"qweight": pack_awq(levels.T), "qzeros": pack_awq(zero.T),
                   "scales": scale.T.to(torch.float16).contiguous()}
        return tensors, (levels, zero, scale)

    folder, grids = _write_folder(model, tmp_path, tensors_for, {"quant_method": "awq", "bits": 4,
                                                                 "group_size": GROUP, "version": "gemm",
                                                                 "zero_point": True})
    loaded = interp.load_model(folder)
    assert (loaded.checkpoint_info.format, loaded.checkpoint_info.layout) == ("awq", "gemm")
    levels, zero, scale = grids["model.layers.0.self_attn.o_proj.weight"]
    weight = loaded.original_model.model.layers[0].self_attn.o_proj.weight
    assert torch.equal(weight[:3], _expected(levels[:3], zero[:3], scale[:3]))


@pytest.mark.parametrize("layout", ["int-quantized", "pack-quantized"])
def test_compressed_tensors_export_loads_back_as_the_fake_quant_model(model, tmp_path, layout):
    from interp.quant.export import export_compressed_tensors

    qmodel = quantize(model, "rtn:bits=4,group=32,zero=int", progress=False)
    folder = export_compressed_tensors(qmodel, model, tmp_path / "ct", layout=layout)
    loaded = interp.load_model(folder)
    assert loaded.checkpoint_info.layout == layout and loaded.checkpoint_info.bits == 4
    tokens = torch.cat([torch.full((2, 1), 256), torch.randint(0, 256, (2, 12))], dim=1)
    for name, tensor in qmodel.original_model.state_dict().items():  # integer zero-points: every weight to the bit
        if name.endswith("proj.weight"):
            assert torch.equal(loaded.original_model.state_dict()[name], tensor), name
    assert torch.equal(loaded(tokens), qmodel(tokens))


def test_probes_and_scoring_run_on_a_loaded_checkpoint(model, tmp_path):
    from interp.quant.export import export_compressed_tensors

    qmodel = quantize(model, "rtn:bits=3,group=32", progress=False)
    loaded = interp.load_model(export_compressed_tensors(qmodel, model, tmp_path / "ct"))
    examples = interp.Examples.from_tokens(torch.cat([torch.full((3, 1), 256), torch.randint(0, 256, (3, 15))], 1),
                                           ids=["a", "b", "c"])
    nll_loaded, nll_fake = interp.nll(loaded, examples), interp.nll(qmodel, examples)
    # float zero-points: weights within a few float32 roundings of the fake-quant ones (test_export.py bounds them),
    # so the NLLs agree as two float32 evaluations of one model do: 1e-4 (the project's batch-invariance tolerance)
    assert float((nll_loaded - nll_fake).abs().max()) <= 1e-4


def test_an_unsupported_variant_is_a_clear_error(model, tmp_path):
    folder = export_hf(model, tmp_path / "plain")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GEMM"):
        interp.load_model(folder)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="holds no quantized weights"):
        interp.load_model(folder)


def test_cli_scores_a_checkpoint_folder_against_its_reference(model, tmp_path, capsys):
    import pandas as pd

    from interp.cli.main import main
    from interp.quant.export import export_compressed_tensors

    reference = export_hf(model, tmp_path / "reference")
    qmodel = quantize(model, "rtn:bits=3,group=32", progress=False)
    shipped = export_compressed_tensors(qmodel, model, tmp_path / "rtn3-ct")
    out, data = tmp_path / "scores", tmp_path / "docs.txt"
    data.write_text("\n\n".join(f"Document {i}: the quick brown fox jumps over the lazy dog." for i in range(8)))
    assert main(["score", "--model", str(reference), "--methods", f"rtn:bits=3,group=32;{shipped}", "--n", "4",
                 "--seq-len", "16", "--data", str(data), "--out", str(out), "--quiet"]) == 0
    errors = pd.read_csv(out / "errors.csv", index_col="example")
    assert list(errors.columns) == ["rtn:bits=3,group=32,zero=float", "checkpoint:rtn3-ct"]
    # the shipped checkpoint is the same rtn3 model (float zero-points: weights within a few float32 roundings),
    # so its per-example errors equal the spec's to the 1e-4 the project allows two float32 evaluations
    assert float((errors.iloc[:, 0] - errors.iloc[:, 1]).abs().max()) <= 1e-4
    settings = json.loads((out / "settings.json").read_text())
    assert settings["checkpoints"]["checkpoint:rtn3-ct"]["format"] == "compressed-tensors"


def test_a_bitsandbytes_4bit_model_in_memory_is_analysed_through_its_own_layers(model, tmp_path):
    import logging

    import transformers

    from interp.errors import ComponentError
    from interp.localize.patching.patches import Patch
    from interp.localize.restoration import restore_layers

    pytest.importorskip("bitsandbytes")  # a dev dependency, installed by `make install`
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    folder = export_hf(model, tmp_path / "plain")
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_compute_dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=torch.float32)
    shipped = interp.load_model(hf, tokenizer=model.tokenizer, name="bnb-nf4")
    info = shipped.checkpoint_info
    assert (info.format, info.layout, info.bits, len(info.modules)) == ("bitsandbytes", "nf4", 4, 14)
    kinds = [type(m).__name__ for m in shipped.original_model.modules()]
    assert kinds.count("Linear4bit") == 14 and "Linear" not in kinds[:-1]  # not dequantized (the head is plain)
    tokens = torch.cat([torch.full((3, 1), 256), torch.randint(0, 256, (3, 15), generator=torch.Generator()
                                                               .manual_seed(3))], 1)
    with torch.no_grad():
        assert torch.equal(shipped(tokens), hf(tokens).logits)  # the analyses see bitsandbytes' own arithmetic
    examples = interp.Examples.from_tokens(tokens, ids=["a", "b", "c"])
    errors = interp.nll(shipped, examples) - interp.nll(model, examples)
    assert bool(torch.isfinite(errors).all()) and float(errors.abs().max()) > 0
    assert interp.probe(shipped, examples) is not None
    assert interp.logit_lens(shipped, examples) is not None
    assert interp.patch(shipped, model, examples, [Patch("down", (1,))]) is not None
    with pytest.raises(ComponentError, match="differs in structure"):  # restoration needs nn.Linear blocks
        restore_layers(shipped, model, [1])
