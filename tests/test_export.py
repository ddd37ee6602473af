"""Export to compressed-tensors (interp.quant.export): the grid, the packing, and plain transformers loading it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import interp
from interp.errors import SpecError
from interp.models import export_hf
from interp.quant import quantize, quantize_weight
from interp.quant.export import export_compressed_tensors, pack_int32, recover_grid, unpack_int32
from interp.quant.spec import parse_spec

U32 = torch.finfo(torch.float32).eps / 2  # unit roundoff of float32, 2^-24

# hidden 128 and MLP 256: group 128 divides every d_in, as gptq:bits=4,group=128 needs
SPECS = ["rtn:bits=4,group=32", "rtn:bits=4,group=32,zero=int", "rtn:bits=8,group=32", "rtn:bits=3,group=32",
         "gptq:bits=4,group=128",
         # plans: one config group per bit width, each naming its modules
         "rtn:bits=3,group=32|0.v=4|1.down=8", "gptq:bits=3,group=128|0.down=4|1.v=4"]


def module_bits(spec: str, key: str) -> int:
    """The bit width ``spec`` gives the module of state-dict key ``model.layers.L.<...>.<role>_proj.weight``."""
    parts = key.split(".")
    return parse_spec(spec).bits_for(int(parts[2]), parts[4].removesuffix("_proj"))


@pytest.fixture(scope="module")
def model():
    return interp.tiny_model("llama", seed=0, hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def calibration():
    g = torch.Generator().manual_seed(1)
    return interp.Examples.from_tokens(torch.randint(0, 256, (6, 32), generator=g), ids=[f"c{i}" for i in range(6)])


@pytest.mark.parametrize("bits", range(1, 9))
def test_packing_is_compressed_tensors_own(bits):
    """The dense int32 packing, checked against the compressed-tensors library's packer (weights and zero-points)."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 2**bits, (5, 70), generator=g)  # 70: not a multiple of 32, so rows are padded
    signed = (values - 2 ** (bits - 1)).to(torch.int8)
    assert torch.equal(pack_int32(values, bits), helpers.pack_to_int32(signed, bits))
    assert torch.equal(pack_int32(values.T.contiguous(), bits).T, helpers.pack_to_int32(signed, bits, packed_dim=0))
    assert torch.equal(unpack_int32(pack_int32(values, bits), bits, 70), values.to(torch.int32))


@pytest.mark.parametrize("spec", ["rtn:bits=3,group=32", "rtn:bits=4,group=16,zero=int", "gptq:bits=4,group=32"])
def test_recovered_grid_reproduces_the_quantized_weight_to_the_bit(spec):
    g = torch.Generator().manual_seed(0)
    W, X = torch.randn(24, 64, generator=g), torch.randn(200, 64, generator=g)
    W_hat = quantize_weight(W, spec, calibration_inputs=X)
    grid = recover_grid(W, W_hat, spec)
    bits = int(spec.split("bits=")[1].split(",")[0])
    assert int(grid.levels.min()) >= 0 and int(grid.levels.max()) <= 2**bits - 1
    assert torch.equal(grid.dequantize(), W_hat)
    assert grid.integer_zero == spec.endswith("zero=int")


def test_a_weight_off_the_grid_is_refused():
    W = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    W_hat = quantize_weight(W, "rtn:bits=4,group=32")
    W_hat[3, 5] += 1e-3
    with pytest.raises(SpecError, match="not on the"):
        recover_grid(W, W_hat, "rtn:bits=4,group=32")


@pytest.mark.parametrize("spec", ["nf:bits=4,group=32", "hqq:bits=4,group=32", "awq:bits=4,group=32",
                                  "gptq:bits=4,group=32,act_order=0"])
def test_specs_without_a_recoverable_grid_are_refused(spec):
    W = torch.randn(8, 64)
    with pytest.raises(SpecError, match="cannot be written as a compressed-tensors checkpoint"):
        recover_grid(W, W, spec)


# The subprocess imports transformers and torch only: a user's runtime, with nothing from interp.
LOAD = textwrap.dedent("""
    import json, sys
    import torch, transformers
    from safetensors.torch import save_file
    folders, tokens_path, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    tokens = torch.load(tokens_path)
    result = {}
    for name, folder in folders.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
        with torch.no_grad():
            logp = model(tokens).logits[:, :-1].log_softmax(-1)
        nll = -logp.gather(-1, tokens[:, 1:, None])[..., 0].mean(1)
        result[name + "/nll"] = nll.contiguous()
        for key, value in model.state_dict().items():  # the forward above decompressed the weights
            if key.endswith("proj.weight"):
                result[name + "/" + key] = value.contiguous()
    assert not any(m == "interp" or m.startswith("interp.") for m in sys.modules), "interp was imported"
    save_file(result, out)
""")


@pytest.fixture(scope="module")
def loaded(model, calibration, tmp_path_factory):
    """Each spec exported, plus the fake-quant model as a plain folder, all loaded by plain transformers."""
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("export")
    folders, grids = {}, {}
    for spec in SPECS:
        qmodel = quantize(model, spec, calibration=calibration, progress=False)
        folders[spec] = str(export_compressed_tensors(qmodel, model, root / f"ct-{len(folders)}"))
        folders[spec + "/fake"] = str(export_hf(qmodel, root / f"fake-{len(folders)}"))
        grids[spec] = qmodel
    tokens = torch.cat([torch.full((4, 1), 256), torch.randint(0, 256, (4, 31), generator=torch.Generator()
                                                               .manual_seed(2))], dim=1)
    torch.save(tokens, root / "tokens.pt")
    run = subprocess.run([sys.executable, "-c", LOAD, json.dumps(folders), str(root / "tokens.pt"),
                          str(root / "out.safetensors")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return load_file(str(root / "out.safetensors")), folders


@pytest.mark.parametrize("spec", SPECS)
def test_plain_transformers_loads_the_export_with_interps_weights(spec, model, loaded):
    tensors, folders = loaded
    config = json.loads((interp.models.Path(folders[spec]) / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "int-quantized"
    groups = config["config_groups"]
    assert groups["group_0"]["weights"]["num_bits"] == parse_spec(spec).bits
    by_module = {name: group["weights"]["num_bits"] for group in groups.values() for name in group["targets"]}
    assert all(group["weights"]["group_size"] == parse_spec(spec).group for group in groups.values())
    assert len(by_module) == sum(len(group["targets"]) for group in groups.values())  # each module in one group
    assert by_module == {name: module_bits(spec, name + ".weight") for name in by_module}
    keys = [k.removeprefix(spec + "/fake/") for k in tensors if k.startswith(spec + "/fake/model.")]
    assert len(keys) == 14  # 2 blocks x (q, k, v, o, gate, up, down)
    for key in keys:
        exported, fake = tensors[f"{spec}/{key}"], tensors[f"{spec}/fake/{key}"]
        assert len(by_module) == 14 and key.removesuffix(".weight") in by_module
        if spec.endswith("zero=int"):
            assert torch.equal(exported, fake)  # (x_q - zp) * scale with whole zp: interp's operations exactly
        else:
            # Float zero-points: the runtime computes ((q - 2^(b-1)) - fl(z - 2^(b-1))) * s, interp (q - z) * s.
            # With D = q - z, each side rounds at most twice and fl(z - 2^(b-1)) once, so to first order
            # |exported - fake| <= u * s * (4 |D| + |z - 2^(b-1)|) = u * (4 |w| + |z s| + 2^(b-1) s), and
            # |z s| = |group min| <= max |w|: at most 5 u (max |w| + 2^b s). s <= the row's span, and 6 u leaves
            # room for the second-order terms.
            bits = module_bits(spec, key)
            row_span = fake.amax(1, keepdim=True) - fake.amin(1, keepdim=True)
            span = fake.abs().amax(1, keepdim=True) + 2**bits * row_span
            assert bool(((exported - fake).abs() <= 6 * U32 * span).all())


@pytest.mark.parametrize("spec", SPECS)
def test_the_exports_nll_equals_the_fake_quant_models(spec, loaded):
    tensors, _ = loaded
    exported, fake = tensors[f"{spec}/nll"], tensors[f"{spec}/fake/nll"]
    if spec.endswith("zero=int"):
        assert torch.equal(exported, fake)  # the same weights to the bit, through the same transformers code
    else:
        # The weights differ by a few float32 roundings (bound checked above), i.e. by less than one rounding of
        # a float32 dot product over d_in >= 128 terms; the forward passes then differ as two float32
        # evaluations of one model do, which the project bounds by 1e-4 nats (batch invariance, specs/quantization.md).
        assert float((exported - fake).abs().max()) <= 1e-4
    assert bool((exported > 0).all())


def test_cli_writes_a_compressed_tensors_folder(model, tmp_path, capsys):
    from interp.cli.main import main

    source = export_hf(model, tmp_path / "tiny")
    assert main(["quantize", "--model", str(source), "--method", "rtn:bits=4,group=32", "--format",
                 "compressed-tensors", "--out", str(tmp_path / "ct"), "--quiet"]) == 0
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    assert config["quantization_config"]["interp_spec"] == "rtn:bits=4,group=32,zero=float"


def test_cli_refuses_an_unexportable_spec_before_loading(tmp_path, capsys, monkeypatch):
    from interp.cli.main import main

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the spec was checked")

    monkeypatch.setattr(interp, "load_model", refuse)
    code = main(["quantize", "--model", "smollm2-135m", "--method", "nf:bits=4", "--format",
                 "compressed-tensors", "--out", str(tmp_path / "ct")])
    assert code != 0
    err = capsys.readouterr().err
    assert "cannot be written as a compressed-tensors checkpoint" in err and "Traceback" not in err
