"""interp.patching: the engine's exactness (against the naive loop and against known
identities), the gate / gate-input semantics, clean/corrupt patching, attribution, and the
paper's experiments. Unit tier on tiny random models; integration tier on SmolLM2."""

from __future__ import annotations

import pytest
import torch

import interp
from interp import hooks as hk
from interp import patching as P
from interp.errors import ComponentError, DataError

ATOL = 1e-5

pytestmark = pytest.mark.usefixtures("one_thread")  # fixtures pair/rows/one_thread: conftest.py




def _no_hooks_left(model) -> bool:
    return all(not hp._forward_hooks for hp in model.hook_dict.values())


# ---------------------------------------------------------------------------------------
# Unit tier: identities


def test_unpatched_values_are_each_models_own_nll(pair, rows):
    reference, quantized = pair
    res = P.patch(quantized, reference, rows, [P.Patch("down", (1,))], batch_size=2)
    assert torch.allclose(res.target, interp.nll(quantized, rows).double(), atol=ATOL)
    assert torch.allclose(res.source, interp.nll(reference, rows).double(), atol=ATOL)


def test_patching_nothing_reproduces_the_target(pair, rows):
    reference, quantized = pair
    empty = [P.Patch(c, (1, 2), positions=()) for c in ("resid_post", "gate", "down")]
    res = P.patch(quantized, reference, rows, empty, batch_size=2)
    assert torch.allclose(res.values, res.target.expand_as(res.values), atol=ATOL)
    same = P.patch(quantized, quantized, rows, P.single_layer_patches(["attn_out", "gate_input"], [0, 3]))
    assert torch.allclose(same.values, same.target.expand_as(same.values), atol=ATOL)


def test_patching_every_resid_post_reproduces_the_source(pair, rows):
    reference, quantized = pair
    every = P.Patch("resid_post", tuple(range(4)))
    last = P.Patch("resid_post", (3,))
    res = P.patch(quantized, reference, rows, [every, last], batch_size=3)
    source_nll = interp.nll(reference, rows).double()
    assert torch.allclose(res.values, source_nll.expand_as(res.values), atol=ATOL)
    assert torch.allclose(res.recovery(), torch.ones(2, dtype=torch.float64), atol=1e-4)


def test_engine_equals_the_naive_loop(pair, rows):
    reference, quantized = pair
    jobs = (P.single_layer_patches(P.PATCHABLE, range(4))
            + P.joint_patches(P.PAPER_COMPONENTS, [2, 3])
            + [P.Patch("head", (1,), heads=(0, 2)), P.Patch("down", (2,), positions=(3, 5)),
               P.Patch("head", (2, 3), positions=(1, 4), heads=(3,))])
    fast = P.patch(quantized, reference, rows, jobs, batch_size=2, max_rows=6)
    naive = P.patch_naive(quantized, reference, rows, jobs, batch_size=3)
    full = P.patch(quantized, reference, rows, jobs, batch_size=5, fast=False)
    assert fast.settings["fast"] and not full.settings["fast"]
    assert (fast.values - naive.values).abs().max() < ATOL
    assert (full.values - naive.values).abs().max() < ATOL
    assert [p.label for p in fast.patches] == [p.label for p in jobs]
    assert _no_hooks_left(quantized) and _no_hooks_left(reference)


def test_decoder_runner_reproduces_the_forward(pair, rows):
    _, quantized = pair
    runner = P.DecoderRunner.for_model(quantized)
    cache, final = P._capture(quantized, rows.tokens, [("resid_pre", 0), ("resid_pre", 2)])
    with torch.no_grad():
        assert torch.allclose(runner.run(cache[("resid_pre", 0)], 0), final, atol=ATOL)
        assert torch.allclose(runner.run(cache[("resid_pre", 2)], 2), final, atol=ATOL)


def test_gate_pre_activation_patch_equals_patching_act_gate(pair, rows):
    """Route 2 replaces the activation module's output by act(source gate_pre)."""
    reference, quantized = pair
    layer = 2
    res = P.patch(quantized, reference, rows, [P.Patch("gate", (layer,))])
    cache, _ = P._capture(reference, rows.tokens, [("gate_pre", layer)])
    act = hk.activation_fn(quantized, layer)
    with torch.no_grad():
        replacement = act(cache[("gate_pre", layer)])
    handle = act.register_forward_hook(lambda module, args, out: replacement)
    try:
        via_activation = interp.nll(quantized, rows, batch_size=len(rows)).double()
    finally:
        handle.remove()
    assert torch.allclose(res.values[0], via_activation, atol=ATOL)
    assert not torch.allclose(res.values[0], res.target, atol=1e-4)


def test_gate_input_reaches_only_the_gate_projection(pair, rows):
    reference, quantized = pair
    layer = 1
    src, _ = P._capture(reference, rows.tokens, [("gate_input", layer)])
    tgt, _ = P._capture(quantized, rows.tokens, [("up", layer)])
    seen = {}

    def keep(name):
        def fn(x, hook):
            seen[name] = x.detach()
        return fn

    fwd = P._patch_hooks(quantized, [P.Patch("gate_input", (layer,))], src, len(rows))
    fwd += [(hk.hook_point(quantized, c, layer), keep(c)) for c in ("gate_pre", "up")]
    with torch.no_grad(), quantized.hooks(fwd_hooks=fwd):
        quantized.original_model(input_ids=rows.tokens)
    expected_gate = src[("gate_input", layer)] @ hk.gate_weight(quantized, layer).detach().T
    assert torch.allclose(seen["gate_pre"], expected_gate, atol=1e-5)
    assert torch.equal(seen["up"], tgt[("up", layer)])
    assert not torch.equal(hk.gate_weight(quantized, layer), hk.gate_weight(reference, layer))


def test_recovery_formula():
    res = P.PatchResult(values=torch.log(torch.tensor([[8.0, 8.0], [6.0, 6.0]], dtype=torch.float64)),
                        target=torch.log(torch.tensor([10.0, 10.0], dtype=torch.float64)),
                        source=torch.log(torch.tensor([5.0, 5.0], dtype=torch.float64)),
                        patches=[P.Patch("down", (1,)), P.Patch("gate", (1,))], ids=["a", "b"])
    assert torch.allclose(res.recovery(), torch.tensor([0.4, 0.8], dtype=torch.float64))
    table = res.table()
    assert list(table["perplexity"].round(6)) == [8.0, 6.0]
    assert table["target_perplexity"].iloc[0] == pytest.approx(10.0)


# ---------------------------------------------------------------------------------------
# Clean/corrupt


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 256, (3, 8), generator=gen)
    corrupt = clean.clone()
    corrupt[:, 2] = torch.randint(0, 256, (3,), generator=gen)
    return clean, corrupt, [5, 6, 7], [8, 9, 10]


def test_clean_corrupt_by_position(tiny_llama, prompts):
    clean, corrupt, answers, wrongs = prompts
    res = P.clean_corrupt(tiny_llama, clean, corrupt, answers, wrongs, "resid_pre", positions="each", max_rows=8)
    assert res.metric == "logit_diff" and len(res.patches) == 2 * 8
    naive = P.patch_naive(tiny_llama, tiny_llama, interp.Examples.from_tokens(corrupt), res.patches,
                          source_examples=interp.Examples.from_tokens(clean),
                          metric=P.LogitDiffMetric(answers, wrongs))
    assert (res.values - naive.values).abs().max() < ATOL
    table = res.table().set_index("patch")
    # at layer 0 only the changed position carries the difference; positions before it change nothing
    assert table.loc["resid_pre@0 pos2", "recovery"] == pytest.approx(1.0, abs=1e-5)
    assert table.loc["resid_pre@0 pos1", "recovery"] == pytest.approx(0.0, abs=1e-5)
    assert type(res.figure()).__name__ == "Figure"


def test_clean_corrupt_all_heads_equal_attn_out(tiny_llama, prompts):
    clean, corrupt, answers, wrongs = prompts
    heads = P.clean_corrupt(tiny_llama, clean, corrupt, answers, wrongs, "head", positions="all")
    attn = P.clean_corrupt(tiny_llama, clean, corrupt, answers, wrongs, "attn_out", positions="all")
    assert torch.allclose(heads.values, attn.values, atol=1e-4)
    subset = P.clean_corrupt(tiny_llama, clean, corrupt, answers, wrongs, "head", positions="all", heads=[0, 1])
    assert subset.patches[0].heads == (0, 1)


def test_clean_corrupt_needs_equal_shapes(tiny_llama, prompts):
    clean, corrupt, answers, wrongs = prompts
    with pytest.raises(DataError):
        P.clean_corrupt(tiny_llama, clean, corrupt[:, :-1], answers, wrongs)


# ---------------------------------------------------------------------------------------
# Attribution


def test_attribution_matches_exact_patching_for_small_differences(rows):
    """With an 8-bit copy the activations differ little: the linear estimate tracks the exact effect."""
    from interp.quant.apply import quantize

    reference = interp.tiny_model("llama", seed=3, n_layers=3)
    quantized = quantize(reference, "rtn:bits=4,group=64", progress=False)
    est = P.attribution(quantized, reference, rows, P.PAPER_COMPONENTS, batch_size=2)
    assert tuple(est.estimates.shape) == (15, len(rows))
    exact = P.layer_sweep(reference, quantized, rows)
    assert P.rank_agreement(est, exact) > 0.8
    exact_delta = (exact.values - exact.target).mean(dim=1)
    assert torch.corrcoef(torch.stack([est.estimates.mean(dim=1), exact_delta]))[0, 1] > 0.9
    assert type(est.figure()).__name__ == "Figure"
    assert _no_hooks_left(quantized)


# ---------------------------------------------------------------------------------------
# Paper experiments, selections, errors


def test_paper_experiments_on_tiny_models(pair, rows):
    reference, quantized = pair
    table = P.patching_table(reference, quantized, rows)
    frame = table.table()
    assert list(frame["component"]) == list(P.PAPER_COMPONENTS) and set(frame["layers"]) == {"2-3"}
    comparison = P.gate_input_vs_gate_weights(reference, quantized, rows, layers="upper_half")
    ctab = comparison.table()
    assert list(ctab["setting"])[:2] == ["reference", "quantized"]
    assert ctab["recovery"].iloc[0] == pytest.approx(1.0) and ctab["recovery"].iloc[1] == pytest.approx(0.0)
    assert ctab["perplexity"].iloc[2] == pytest.approx(float(comparison.patched.aggregate()[0]))
    sweep = P.layer_sweep(reference, quantized, rows, components=["down", "gate"], layers=[1, 3])
    assert [p.label for p in sweep.patches] == ["down@1", "down@3", "gate@1", "gate@3"]
    for result in (table, comparison, sweep):
        assert type(result.figure()).__name__ == "Figure"


def test_thin_specialisations_and_layer_selection(pair, rows):
    reference, quantized = pair
    res = P.patch_down(quantized, reference, rows, "upper_half", joint=True)
    assert res.patches == [P.Patch("down", (2, 3))]
    assert P.resolve_layers(quantized, "lower_half") == [0, 1]
    assert P.resolve_layers(quantized, -1) == [3]
    assert P.patch_gate_input.__doc__ and "up projection" in P.patch_gate_input.__doc__


def test_save_writes_tables(pair, rows, tmp_path):
    reference, quantized = pair
    res = P.patch(quantized, reference, rows, [P.Patch("up", (1,))])
    res.save(tmp_path, "up")
    assert (tmp_path / "up.csv").is_file() and (tmp_path / "up_examples.csv").is_file()


def test_errors_name_the_problem(pair, rows, tiny_gpt2):
    reference, quantized = pair
    with pytest.raises(ComponentError, match="Patchable"):
        P.Patch("pattern", (0,))
    with pytest.raises(ComponentError, match="out of range"):
        P.patch(quantized, reference, rows, [P.Patch("down", (7,))])
    with pytest.raises(ComponentError, match="heads must lie"):
        P.patch(quantized, reference, rows, [P.Patch("head", (0,), heads=(9,))])
    with pytest.raises(ComponentError, match="positions must lie"):
        P.patch(quantized, reference, rows, [P.Patch("down", (0,), positions=(99,))])
    with pytest.raises(ComponentError, match="gated MLP"):
        P.patch(tiny_gpt2, tiny_gpt2, rows, [P.Patch("gate", (0,))])
    with pytest.raises(ComponentError, match="same architecture"):
        P.patch(quantized, interp.tiny_model("llama", n_layers=2), rows, [P.Patch("down", (0,))])
    with pytest.raises(ComponentError, match="upper_half"):
        P.resolve_layers(quantized, "top")


# ---------------------------------------------------------------------------------------
# Integration tier: the bundled SmolLM2 and a 3-bit copy


@pytest.fixture(scope="module")
def smol_pair(smol):
    from interp.quant.apply import quantize

    return smol, quantize(smol, "rtn:bits=3,group=64", progress=False)


@pytest.mark.integration
def test_smol_engine_is_exact(smol_pair):
    reference, quantized = smol_pair
    rows = interp.load_examples("wiki", reference.tokenizer, n=2, seq_len=24, seed=0)
    jobs = [P.Patch("resid_post", tuple(range(30))), P.Patch("gate", (28,)), P.Patch("gate_input", (20,)),
            P.Patch("attn_out", (29,)), P.Patch("down", (15, 16, 17))]
    fast = P.patch(quantized, reference, rows, jobs, batch_size=2)
    naive = P.patch_naive(quantized, reference, rows, jobs, batch_size=2)
    assert (fast.values - naive.values).abs().max() < ATOL
    assert torch.allclose(fast.values[0], interp.nll(reference, rows).double(), atol=ATOL)
    assert fast.target_value > fast.source_value  # 3-bit hurts
    assert fast.settings["fast"]
