"""Model loading: offline, exact against plain Hugging Face, cached by source hash."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

import interp
from interp import models
from interp.errors import ModelLoadError
from interp.runtime.hooks import native_model

pytestmark = pytest.mark.integration


def _plain_hf(attn_implementation):
    from transformers import AutoModelForCausalLM

    folder = next((models.cache_dir() / "models").glob("SmolLM2-135M-Instruct.Q4_1-*"))
    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, local_files_only=True, attn_implementation=attn_implementation).eval()


def test_logits_equal_plain_hf(smol):
    """Bit-identical to HF's eager attention (what the bridge runs); within 1e-4 of HF's SDPA default."""
    tokens = torch.tensor([[1, 504, 3575, 282, 4649, 314, 2, 77, 903]])
    with torch.no_grad():
        bridge_logits = smol(tokens)
        eager_logits = _plain_hf("eager")(tokens).logits
        sdpa_logits = _plain_hf("sdpa")(tokens).logits
    assert bridge_logits.shape == eager_logits.shape
    assert torch.equal(bridge_logits, eager_logits)
    # SDPA vs eager: float32 reordering over 30 layers, ~30 * sqrt(576) * 6e-8 * |logit ~ 20| ~ 9e-5
    assert torch.allclose(bridge_logits, sdpa_logits, atol=1e-4, rtol=0)


def test_capital_of_france_is_paris(smol):
    tokens = smol.tokenizer("The capital of France is", return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = smol(tokens)[0, -1]
    probs = logits.softmax(-1)
    top = int(probs.argmax())
    assert smol.tokenizer.decode([top]) == " Paris"
    assert probs[top] > 0.5


def test_model_info(smol):
    info = smol.info
    assert (info.architecture, info.n_layers, info.d_model, info.n_heads, info.d_mlp) == (
        "LlamaForCausalLM", 30, 576, 9, 1536)
    assert info.gated_mlp and info.bos_id == 1 and info.family == "llama"
    assert len(info.source_hash) == 64
    # RMSNorm gammas are kept as the model holds them (no folding into the weights)
    gamma = smol.original_model.model.layers[3].post_attention_layernorm.weight
    assert not torch.allclose(gamma, torch.ones_like(gamma))


def test_load_and_forward_with_sockets_blocked(no_network):
    model = interp.load_model("smollm2-135m")
    with torch.no_grad():
        out = model(torch.tensor([[1, 504, 3575]]))
    assert torch.isfinite(out).all()


def test_half_written_cache_is_rebuilt(smol, tmp_path, monkeypatch):
    """A truncated safetensors file in the cache is detected by the manifest and rebuilt."""
    src = next((models.cache_dir() / "models").glob("SmolLM2-135M-Instruct.Q4_1-*"))
    monkeypatch.setenv("INTERP_CACHE", str(tmp_path))
    dst = tmp_path / "models" / src.name
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    with weights.open("r+b") as fh:
        fh.truncate(weights.stat().st_size // 2)
    assert not models._manifest_ok(dst)
    model = interp.load_model("smollm2-135m")
    assert models._manifest_ok(dst)
    manifest = json.loads((dst / models.MANIFEST).read_text())
    assert manifest["files"]["model.safetensors"] == (src / "model.safetensors").stat().st_size
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([[1, 504]])), smol(torch.tensor([[1, 504]])))


def test_cache_key_follows_source_hash(tmp_path, monkeypatch):
    """Two different source files never share a cache folder."""
    monkeypatch.setenv("INTERP_CACHE", str(tmp_path))
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF-a")
    b.write_bytes(b"GGUF-b")
    assert models.file_sha256(a) != models.file_sha256(b)
    with pytest.raises(ModelLoadError, match="truncated"):
        models.converted_folder(a)
    # a failed conversion leaves no folder that could pass for a finished cache (the header check may refuse the
    # file before the cache folder exists at all)
    cached = tmp_path / "models"
    assert not cached.exists() or not any(models._manifest_ok(p) for p in cached.iterdir())


def test_a_full_disk_in_the_model_cache_is_one_resource_error(tmp_path, monkeypatch):
    """safetensors' own error type (not an OSError) from inside save_pretrained, while a GGUF is converted into
    the cache, is one ResourceError naming the cache folder; nothing half-written is left there."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    from interp.errors import ResourceError

    def full(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                              'space left on device" })')

    gguf = models._bundled_gguf("smollm2-135m")
    monkeypatch.setenv("INTERP_CACHE", str(tmp_path))
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    with pytest.raises(ResourceError, match=rf"Could not write {tmp_path}/models/.*: the disk is full") as caught:
        models.converted_folder(gguf)
    assert "\n" not in str(caught.value)
    assert [p.name for p in (tmp_path / "models").iterdir()] == []


def test_hf_folder_loads(smol, tmp_path):
    tiny = interp.tiny_model("llama", seed=3)
    models.export_hf(tiny, tmp_path)
    again = interp.load_model(str(tmp_path))
    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert torch.equal(again(tokens), tiny(tokens))


def test_not_a_model_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match="not a Hugging Face model folder"):
        interp.load_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="Unknown model 'gpt-17'"):
        interp.load_model("gpt-17")


def test_gemma_loads_and_predicts(gemma):
    """Gemma-3-270m: bridge logits equal its HF model's (eager), and it predicts real text far better than chance."""
    from transformers import AutoModelForCausalLM

    assert gemma.info.family == "gemma3" and gemma.info.n_layers == 18 and gemma.info.gated_mlp
    ex = interp.load_examples("wiki", gemma.tokenizer, n=2, seq_len=32)
    # an interrupted conversion leaves a ``.partial-*`` folder beside the finished one: skip it
    folder = next(p for p in (models.cache_dir() / "models").glob("gemma-3-270m-q4_k_m-*") if ".partial" not in p.name)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        # float32 reordering over 18 layers of width 640 (soft-capped logits ~< 30): ~18 * 25 * 6e-8 * 30 ~ 8e-4
        # worst case; measured < 1e-5, as both run the same eager kernels
        torch.testing.assert_close(gemma(ex.tokens), hf(ex.tokens).logits, rtol=0, atol=1e-4)
        # the bridge-free tree (used for hook-free scoring) gives the bridge's logits exactly
        assert torch.equal(native_model(gemma)(input_ids=ex.tokens).logits, gemma(ex.tokens))
    nll = interp.nll(gemma, ex)
    assert (nll < 0.5 * math.log(gemma.cfg.d_vocab)).all(), nll  # uniform guessing would give log(262144) = 12.5


test_gemma_loads_and_predicts = pytest.mark.gemma(test_gemma_loads_and_predicts)


def test_native_model_is_the_bridge_without_wrappers(smol, wiki_small):
    """Bit-identical logits, the same parameter tensors, and no bridge module or hook on the path."""
    from transformer_lens.model_bridge.generalized_components.base import GeneralizedComponent

    native = native_model(smol)
    assert not any(isinstance(m, GeneralizedComponent) for m in native.modules())
    bridge_params = {p.data_ptr() for p in smol.original_model.parameters()}
    assert {p.data_ptr() for p in native.parameters()} == bridge_params  # shared, not copied
    fired = []
    tokens = wiki_small.tokens[:2, :48]
    with torch.no_grad(), smol.hooks(fwd_hooks=[("blocks.3.hook_resid_post", lambda x, hook: fired.append(1))]):
        out = native(input_ids=tokens).logits
    assert not fired
    with torch.no_grad():
        assert torch.equal(out, smol.original_model(input_ids=tokens).logits)
