"""interp.localize.lens and .restoration: early exit (logit lens) and layer restoration. Unit tier on tiny random
models; integration tier on SmolLM2 (and Gemma-3 when installed)."""

from __future__ import annotations

import pytest
import torch

import interp
from interp.errors import ComponentError, InterpError
from interp.figures import draw
from interp.localize import lens, restoration
from interp.runtime import hooks as hk
from interp.runtime.scoring import token_nll

pytestmark = pytest.mark.usefixtures("one_thread")  # fixtures pair/rows/one_thread: conftest.py


# ---------------------------------------------------------------------------------------
# Early exit


def test_last_layer_exit_is_the_models_nll(pair, rows):
    reference, _ = pair
    res = lens.early_exit(reference, rows, at="resid_post", batch_size=2)
    assert tuple(res.nll.shape) == (4, 5) and res.layers == [0, 1, 2, 3]
    # same residual, norm and head as nll(); only the float32 log-sum-exp order differs (online slices vs
    # fused cross-entropy): a few ulp of logits ~10 over 259 terms, ~1e-6 nats; 1e-4 is a generous bound
    assert (res.nll[-1] - interp.nll(reference, rows)).abs().max() < 1e-4


def test_resid_mid_exit_decodes_with_final_norm_and_unembed(pair, rows):
    reference, _ = pair
    res = lens.early_exit(reference, rows, at="resid_mid", layers=[1, 3])
    seen = {}
    name = hk.hook_point(reference, "resid_mid", 3)
    with torch.no_grad(), reference.hooks(fwd_hooks=[(name, lambda x, hook: seen.setdefault("r", x))]):
        reference.original_model(input_ids=rows.tokens)
        logits = hk.final_norm(reference)(seen["r"]) @ hk.unembed_weight(reference).T
    expected = token_nll(logits, rows.tokens).mean(dim=1)
    assert res.layers == [1, 3]
    # float32: the online log-sum-exp against one fused log-softmax, values ~5.6 nats: ~1e-6 apart
    assert torch.allclose(res.nll[1], expected, atol=1e-5)


def test_readout_chunks_do_not_change_values(pair, rows):
    reference, _ = pair
    small = lens.early_exit(reference, rows, max_logits=300)  # one row of logits at a time
    large = lens.early_exit(reference, rows)
    # the same float32 sums regrouped by slice: reordering error of ~10 terms of ~1e-7 relative each
    assert torch.allclose(small.nll, large.nll, atol=1e-6)


def test_readout_applies_final_logit_softcapping(pair):
    reference, _ = pair
    readout = lens.Readout(reference)
    resid = torch.randn(3, hk.unembed_weight(reference).shape[1]) * 50
    with torch.no_grad():
        plain = readout.logits(resid)
        readout.softcap = 2.0
        capped = readout.logits(resid)
    assert torch.allclose(capped, torch.tanh(plain / 2.0) * 2.0)
    assert capped.abs().max() <= 2.0


def test_curves_table_figure_and_split(pair, rows):
    reference, quantized = pair
    sets = {"D_large": rows.subset([0, 1]), "D_ctrl": rows.subset([2, 3])}
    curves = lens.early_exit_curves({"reference": reference, "quantized": quantized}, sets)
    table = curves.table()
    assert list(table.columns) == ["reference / D_large", "reference / D_ctrl", "quantized / D_large",
                                   "quantized / D_ctrl", "gap / D_large", "gap / D_ctrl"]
    assert 0 <= curves.split_layer("D_large") <= 3
    figure = draw(curves)
    assert len(figure.data) == 4 and figure.data[1].line.dash == "dash"
    frame = curves.results["reference / D_large"].to_frame()
    assert list(frame.columns) == ["layer", "example", "nll"] and len(frame) == 4 * 2


def test_early_exit_errors(tiny_gpt2, rows, pair):
    # GPT-2 (ln_f, tied head) decodes as every family does: the last exit is the same final residual, norm and
    # head as nll(), only the log-sum-exp order differs (~1e-6), so its NLL to 1e-4
    assert torch.allclose(lens.early_exit(tiny_gpt2, rows).nll[-1], interp.nll(tiny_gpt2, rows), atol=1e-4)
    with pytest.raises(ComponentError, match="resid_mid"):
        lens.early_exit(pair[0], rows, at="attn_out")


def test_early_exit_leaves_no_hooks(pair, rows):
    reference, _ = pair
    lens.early_exit(reference, rows, layers=[0])
    assert all(not hp._forward_hooks for hp in reference.hook_dict.values())


# ---------------------------------------------------------------------------------------
# Layer restoration


def _weights(model, layer: int) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in hk.blocks(model)[layer].named_parameters()}


def test_restore_layers_copies_and_never_mutates(pair):
    reference, quantized = pair
    before_q, before_r = _weights(quantized, 3), _weights(reference, 3)
    restored = restoration.restore_layers(quantized, reference, [3])
    assert restored is not quantized and restored.restored_layers == [3]
    for k, v in _weights(restored, 3).items():
        assert torch.equal(v, before_r[k])
    for k, v in _weights(restored, 2).items():
        assert torch.equal(v, _weights(quantized, 2)[k])
    for k, v in _weights(quantized, 3).items():
        assert torch.equal(v, before_q[k])
    assert any(not torch.equal(before_q[k], before_r[k]) for k in before_q)


def test_restore_only_the_gate_weights(pair):
    reference, quantized = pair
    restored = restoration.restore_layers(quantized, reference, [-1], roles=["gate"])
    mods, ref_mods, q_mods = (hk.linear_modules(m, 3) for m in (restored, reference, quantized))
    assert torch.equal(mods["gate"].weight, ref_mods["gate"].weight)
    assert torch.equal(mods["up"].weight, q_mods["up"].weight)
    with pytest.raises(ComponentError, match="roles"):
        restoration.restore_layers(quantized, reference, [0], roles=["gates"])


def test_restoration_sweep_equals_restored_copies(pair, rows):
    reference, quantized = pair
    res = restoration.restoration_sweep(quantized, reference, rows, ks=[0, 1, 3, 4], batch_size=2)
    assert res.restored == [[], [3], [1, 2, 3], [0, 1, 2, 3]]
    for i, layers in enumerate(res.restored):
        expected = interp.nll(restoration.restore_layers(quantized, reference, layers), rows).double()
        # the sweep reuses the unrestored prefix's activations (float32, same ops, different batching):
        # the two NLLs differ by reordering only, ~1e-6 nats for a 4-layer tiny model
        assert torch.allclose(res.nll[i], expected, atol=1e-5)
    assert torch.allclose(res.nll[0], interp.nll(quantized, rows).double(), atol=1e-5)
    assert torch.allclose(res.nll[-1], res.reference_nll, atol=1e-5)
    table = res.table()
    assert table["recovery"].iloc[0] == pytest.approx(0.0) and table["recovery"].iloc[-1] == pytest.approx(1.0)
    assert list(table["restored"]) == ["", "3", "1-3", "0-3"]
    assert type(draw(res)).__name__ == "Figure"
    with pytest.raises(InterpError, match="ks must lie"):
        restoration.restoration_sweep(quantized, reference, rows, ks=[9])


# ---------------------------------------------------------------------------------------
# Integration tier


@pytest.mark.integration
def test_smol_last_layer_exit_is_the_models_nll(smol):
    rows = interp.load_examples("wiki", smol.tokenizer, n=3, seq_len=32, seed=0)
    res = lens.early_exit(smol, rows, at="resid_post", layers=[0, 29])
    # float32 over 30 layers and a 49k vocabulary: the two heads' summation orders differ by ~1e-5 nats
    assert (res.nll[-1] - interp.nll(smol, rows)).abs().max() < 1e-4
    assert res.nll[0].mean() > res.nll[-1].mean() + 1.0  # layer 0 decodes far worse


@pytest.mark.integration
@pytest.mark.gemma
def test_gemma_exit_and_suffix_runner(gemma):
    from interp.localize import patching

    rows = interp.load_examples("wiki", gemma.tokenizer, n=2, seq_len=24, seed=0)
    res = lens.early_exit(gemma, rows, at="resid_post", layers=[-1])
    # as for SmolLM2: the same head, float32 summation order over 262k logits
    assert (res.nll[-1] - interp.nll(gemma, rows)).abs().max() < 1e-4
    runner = patching.DecoderRunner.for_model(gemma)
    cache, final = patching.capture(gemma, rows.tokens, [("resid_pre", 0)])
    with torch.no_grad():
        # the runner replays the same float32 blocks on the cached input: equal up to kernel ordering
        assert torch.allclose(runner.run(cache[("resid_pre", 0)], 0), final, atol=1e-4)


@pytest.mark.parametrize("bad", [[0.5], [], True, [5], "0,1"])
def test_early_exit_refuses_bad_layer_selections(tiny_llama, bad):
    import torch

    from interp.data import Examples
    from interp.errors import ComponentError
    from interp.localize.lens import early_exit

    ex = Examples.from_tokens(torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0)))
    with pytest.raises(ComponentError):
        early_exit(tiny_llama, ex, layers=bad)
