"""interp.localize.patching: the engine's exactness (against the naive loop and against known
identities), the gate / gate-input semantics, clean/corrupt patching, attribution, and the
paper's experiments. Unit tier on tiny random models; integration tier on SmolLM2."""

from __future__ import annotations

import math

import pytest
import torch

import interp
from interp.errors import ComponentError, DataError
from interp.figures import draw
from interp.localize import patching as P
from interp.runtime import hooks as hk

# Exactness is tested in float64 (models cast with .to(torch.float64)) with an NLL metric that
# stays in float64 (F64NLL below): the engine and the naive loop then differ only by float64
# reordering, ~1e-15 relative over a few layers of width 64 (and ~1e-13 over SmolLM2's 30
# layers of width 576). EXACT = 1e-10 sits far above that and far below any real bug (a
# wrong patch moves the NLL by >= 1e-4).
EXACT = 1e-10
EPS32 = torch.finfo(torch.float32).eps

pytestmark = pytest.mark.usefixtures("one_thread")  # fixtures pair/rows/one_thread: conftest.py


class F64NLL(P.NLLMetric):
    """The NLL metric with no float32 step: log-softmax of float64 logits (test-only, small vocab)."""

    def from_resid(self, readout, resid, tokens, index):
        return self.from_logits(readout.logits(resid), tokens, index)

    def from_logits(self, logits, tokens, index):
        logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
        return -logp.gather(-1, tokens[:, 1:, None].to(logp.device))[..., 0].mean(dim=1)


def nll64(model, rows):
    """Mean next-token NLL per row from the model's own float64 forward."""
    with torch.no_grad():
        logits = model.original_model(input_ids=rows.tokens).logits
    return F64NLL().from_logits(logits, rows.tokens, None)


def nll32_bound(model, rows):
    """Largest gap between two float32 evaluations of a row's mean NLL from the same float64 logits.

    interp.nll and NLLMetric round the logits z to float32 (each by <= |z| u, u = eps/2), sum
    exp(z - max) over V keys (<= (log2 V + V/256) u relative: blocked summation plus one
    rescale per vocabulary slice) and round the result (<= |NLL| u). Two such evaluations by
    different summation orders differ by at most twice the sum: 2 u (2 Zmax + log2 V + V/256
    + |NLL|) = eps (2 Zmax + log2 V + V/256 + |NLL|).
    """
    with torch.no_grad():
        logits = model.original_model(input_ids=rows.tokens).logits
    vocab = logits.shape[-1]
    z_max = float(logits.abs().max())
    return EPS32 * (2 * z_max + math.log2(vocab) + vocab / 256 + float(nll64(model, rows).abs().max()))


@pytest.fixture(scope="module")
def pair64(one_thread):
    """conftest's pair (tiny llama and its 3-bit RTN copy), in float64."""
    from interp.quant.apply import quantize

    reference = interp.tiny_model("llama", seed=0, n_layers=4).to(torch.float64)
    return reference, quantize(reference, "rtn:bits=3,group=64", progress=False)


@pytest.fixture(scope="module")
def tiny64(one_thread):
    return interp.tiny_model("llama", seed=0).to(torch.float64)


def _no_hooks_left(model) -> bool:
    return all(not hp._forward_hooks for hp in model.hook_dict.values())


# ---------------------------------------------------------------------------------------
# Unit tier: identities


@pytest.mark.numerical
def test_unpatched_values_are_each_models_own_nll(pair64, rows):
    """The default NLL metric (float32 log-sum-exp) agrees with interp.nll within the float32 bound."""
    reference, quantized = pair64
    res = P.patch(quantized, reference, rows, [P.Patch("down", (1,))], batch_size=2)
    for values, model in ((res.target, quantized), (res.source, reference)):
        bound = nll32_bound(model, rows)
        assert (values - interp.nll(model, rows).double()).abs().max() <= bound, bound
        assert (values - nll64(model, rows)).abs().max() <= bound  # and with the float64 truth


@pytest.mark.numerical
def test_patching_nothing_reproduces_the_target(pair64, rows):
    reference, quantized = pair64
    empty = [P.Patch(c, (1, 2), positions=()) for c in ("resid_post", "gate", "down")]
    res = P.patch(quantized, reference, rows, empty, batch_size=2, metric=F64NLL())
    assert (res.values - res.target).abs().max() < EXACT
    same = P.patch(quantized, quantized, rows, P.single_layer_patches(["attn_out", "gate_input"], [0, 3]),
                   metric=F64NLL())
    assert (same.values - same.target).abs().max() < EXACT


@pytest.mark.numerical
def test_patching_every_resid_post_reproduces_the_source(pair64, rows):
    reference, quantized = pair64
    every = P.Patch("resid_post", tuple(range(4)))
    last = P.Patch("resid_post", (3,))
    res = P.patch(quantized, reference, rows, [every, last], batch_size=3, metric=F64NLL())
    assert (res.values - nll64(reference, rows)).abs().max() < EXACT
    gap = float((res.target - res.source).mean())
    # recovery = (target - value) / (target - source): an EXACT error over a gap of `gap` nats
    assert (res.recovery() - 1.0).abs().max() < EXACT / abs(gap) * 10, gap


@pytest.mark.numerical
def test_engine_equals_the_naive_loop(pair64, rows):
    reference, quantized = pair64
    jobs = (P.single_layer_patches([c for c in P.PATCHABLE if c in hk.components(quantized)], range(4))
            + P.joint_patches(P.PAPER_COMPONENTS, [2, 3])
            + [P.Patch("head", (1,), heads=(0, 2)), P.Patch("down", (2,), positions=(3, 5)),
               P.Patch("head", (2, 3), positions=(1, 4), heads=(3,))])
    fast = P.patch(quantized, reference, rows, jobs, batch_size=2, max_rows=6, metric=F64NLL())
    naive = P.patch_naive(quantized, reference, rows, jobs, batch_size=3, metric=F64NLL())
    full = P.patch(quantized, reference, rows, jobs, batch_size=5, fast=False, metric=F64NLL())
    assert fast.settings["fast"] and not full.settings["fast"]
    assert (fast.values - naive.values).abs().max() < EXACT
    assert (full.values - naive.values).abs().max() < EXACT
    assert (naive.values - naive.target).abs().max() > 1e-4  # the patches do move the NLL
    assert [p.label for p in fast.patches] == [p.label for p in jobs]
    assert _no_hooks_left(quantized) and _no_hooks_left(reference)


@pytest.mark.numerical
def test_a_planted_indexing_bug_in_the_engine_is_caught(pair64, rows, monkeypatch):
    """The naive loop shares no code with the engine's assignment: plant an off-by-one position in
    the engine's ``_assign`` and the engine-vs-naive comparison above fails by far more than EXACT."""
    from interp.localize.patching import engine

    reference, quantized = pair64
    jobs = [P.Patch("down", (1,), positions=(3, 5)), P.Patch("head", (2,), positions=(4,), heads=(1,))]
    honest = P.patch_naive(quantized, reference, rows, jobs, batch_size=5, metric=F64NLL())
    original = engine._assign

    def off_by_one(x, row, src, positions, heads):
        shifted = None if positions is None else (positions + 1) % src.shape[1]  # the planted bug
        view = x[row : row + src.shape[0]]
        if heads is None:
            view[:, positions] = src[:, shifted]
        else:
            original(x, row, src.roll(-1, dims=1), positions, heads)

    monkeypatch.setattr(engine, "_assign", off_by_one)
    buggy = P.patch(quantized, reference, rows, jobs, batch_size=5, metric=F64NLL())
    naive = P.patch_naive(quantized, reference, rows, jobs, batch_size=5, metric=F64NLL())
    assert torch.equal(naive.values, honest.values)  # the reference does not run the engine's assignment
    gap = (buggy.values - naive.values).abs().amax(dim=1)
    assert (gap > 1e3 * EXACT).all(), gap  # every planted-bug job is caught, far outside EXACT


@pytest.mark.numerical
def test_engine_equals_transformer_lens_own_serial_loop(pair64, rows):
    """The other baseline of benchmarks/bench_patching.py: run_with_cache for the source, then one
    run_with_hooks per patch whose hook returns the source's activation (float64: reordering only)."""
    reference, quantized = pair64
    jobs = P.single_layer_patches(P.PAPER_COMPONENTS, [0, 3])
    fast = P.patch(quantized, reference, rows, jobs, batch_size=2, metric=F64NLL())
    names = [hk.hook_point(quantized, job.component, job.layers[0]) for job in jobs]
    with torch.no_grad():
        _, cache = reference.run_with_cache(rows.tokens, names_filter=lambda name: name in names)
        for j, name in enumerate(names):
            logits = quantized.run_with_hooks(rows.tokens, fwd_hooks=[(name, lambda x, hook, src=cache[name]: src)])
            assert (fast.values[j] - F64NLL().from_logits(logits, rows.tokens, None)).abs().max() < EXACT, name
    assert _no_hooks_left(quantized) and _no_hooks_left(reference)


@pytest.mark.numerical
def test_decoder_runner_reproduces_the_forward(pair64, rows):
    _, quantized = pair64
    runner = P.DecoderRunner.for_model(quantized)
    cache, final = P.capture(quantized, rows.tokens, [("resid_pre", 0), ("resid_pre", 2)])
    with torch.no_grad():
        # residuals of norm ~10: float64 reordering error ~1e-14
        assert (runner.run(cache[("resid_pre", 0)], 0) - final).abs().max() < EXACT
        assert (runner.run(cache[("resid_pre", 2)], 2) - final).abs().max() < EXACT


@pytest.mark.numerical
def test_gate_pre_activation_patch_equals_patching_act_gate(pair64, rows):
    """Route 2 replaces the activation module's output by act(source gate_pre)."""
    reference, quantized = pair64
    layer = 2
    res = P.patch(quantized, reference, rows, [P.Patch("gate", (layer,))], metric=F64NLL())
    cache, _ = P.capture(reference, rows.tokens, [("gate_pre", layer)])
    act = hk.activation_fn(quantized, layer)
    with torch.no_grad():
        replacement = act(cache[("gate_pre", layer)])
    handle = act.register_forward_hook(lambda module, args, out: replacement)
    try:
        via_activation = nll64(quantized, rows)
    finally:
        handle.remove()
    assert (res.values[0] - via_activation).abs().max() < EXACT
    assert (res.values[0] - res.target).abs().max() > 1e-4  # the patch moved the NLL


@pytest.mark.numerical
def test_gate_input_reaches_only_the_gate_projection(pair64, rows):
    reference, quantized = pair64
    layer = 1
    src, _ = P.capture(reference, rows.tokens, [("gate_input", layer)])
    tgt, _ = P.capture(quantized, rows.tokens, [("up", layer)])
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
    assert (seen["gate_pre"] - expected_gate).abs().max() < EXACT  # one float64 matmul of width 64: ~1e-15
    assert torch.equal(seen["up"], tgt[("up", layer)])
    assert not torch.equal(hk.gate_weight(quantized, layer), hk.gate_weight(reference, layer))


def test_recovery_formula():
    res = P.PatchResult(values=torch.log(torch.tensor([[8.0, 8.0], [6.0, 6.0]], dtype=torch.float64)),
                        target=torch.log(torch.tensor([10.0, 10.0], dtype=torch.float64)),
                        source=torch.log(torch.tensor([5.0, 5.0], dtype=torch.float64)),
                        patches=[P.Patch("down", (1,)), P.Patch("gate", (1,))], ids=["a", "b"])
    # (log 10 - log 8) / (log 10 - log 5) in float64: a few ulp from 0.4 and 0.8
    assert torch.allclose(res.recovery(), torch.tensor([0.4, 0.8], dtype=torch.float64), rtol=0, atol=1e-12)
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


def logit_diff_bound(model, tokens):
    """LogitDiffMetric rounds two float64 logits to float32: each moves by <= |z| u, so two
    evaluations from float64 logits that agree to ~1e-15 differ by <= 2 * 2 Zmax u = 2 Zmax eps."""
    with torch.no_grad():
        z_max = float(model.original_model(input_ids=tokens).logits.abs().max())
    return 2 * z_max * EPS32


@pytest.mark.numerical
def test_clean_corrupt_by_position(tiny64, prompts):
    clean, corrupt, answers, wrongs = prompts
    res = P.clean_corrupt(tiny64, clean, corrupt, answers, wrongs, "resid_pre", positions="each", max_rows=8)
    assert res.metric == "logit_diff" and len(res.patches) == 2 * 8
    naive = P.patch_naive(tiny64, tiny64, interp.Examples.from_tokens(corrupt), res.patches,
                          source_examples=interp.Examples.from_tokens(clean),
                          metric=P.LogitDiffMetric(answers, wrongs))
    bound = logit_diff_bound(tiny64, torch.cat([clean, corrupt]))
    assert (res.values - naive.values).abs().max() <= bound
    table = res.table().set_index("patch")
    gap = float((res.target - res.source).abs().min())
    # at layer 0 only the changed position carries the difference; positions before it change nothing
    # (recovery errors: the float32 bound above over the clean-corrupt gap)
    assert table.loc["resid_pre@0 pos2", "recovery"] == pytest.approx(1.0, abs=2 * bound / gap)
    assert table.loc["resid_pre@0 pos1", "recovery"] == pytest.approx(0.0, abs=2 * bound / gap)
    assert type(draw(res)).__name__ == "Figure"


@pytest.mark.numerical
def test_clean_corrupt_all_heads_equal_attn_out(tiny64, prompts):
    clean, corrupt, answers, wrongs = prompts
    heads = P.clean_corrupt(tiny64, clean, corrupt, answers, wrongs, "head", positions="all")
    attn = P.clean_corrupt(tiny64, clean, corrupt, answers, wrongs, "attn_out", positions="all")
    assert (heads.values - attn.values).abs().max() <= logit_diff_bound(tiny64, torch.cat([clean, corrupt]))
    subset = P.clean_corrupt(tiny64, clean, corrupt, answers, wrongs, "head", positions="all", heads=[0, 1])
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
    assert type(draw(est)).__name__ == "Figure"
    assert _no_hooks_left(quantized)


def test_attribution_takes_padded_prompts_as_each_prompt_alone(tiny64, tok):
    """Padded prompts (left and right) give each prompt's estimate alone, unpadded; pairs whose real
    lengths differ are refused before any forward."""
    from padding_rows import TEXTS, row_alone

    target = interp.examples_from_texts(TEXTS, tok, padding="left")
    source = interp.examples_from_texts([t[::-1] for t in TEXTS], tok, padding="right")  # same lengths, reversed
    metric = P.LogitDiffMetric(ord("e"), ord(" "))
    est = P.attribution(tiny64, tiny64, target, ["down", "attn_out"], source_examples=source, metric=metric)
    for i in range(len(TEXTS)):
        alone = P.attribution(tiny64, tiny64, row_alone(target, i), ["down", "attn_out"],
                              source_examples=row_alone(source, i), metric=metric)
        # float64 model; the metric rounds its logits to float32 (LogitDiffMetric), and the same row
        # batched or alone may round differently by one float32 ulp of the O(1) logits: the estimate
        # (activation difference . gradient of that metric) differs by at most ~EPS32 relative
        scale = alone.estimates[:, 0].abs().max()
        assert (est.estimates[:, i] - alone.estimates[:, 0]).abs().max() <= 8 * EPS32 * max(float(scale), 1.0)
    assert est.estimates.abs().max() > 1e-6
    with pytest.raises(DataError, match="same real length"):
        P.attribution(tiny64, tiny64, target, ["down"], source_examples=interp.examples_from_texts(
            ["x", *TEXTS[1:]], tok), metric=metric)


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
        assert type(draw(result)).__name__ == "Figure"


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
def smol_pair64():
    """SmolLM2 and its 3-bit copy in float64 (its own load: the session's float32 smol stays as it is)."""
    from interp.quant.apply import quantize

    reference = interp.load_model("smollm2-135m").to(torch.float64)  # load_model offers float32/16 only
    return reference, quantize(reference, "rtn:bits=3,group=64", progress=False)


@pytest.mark.integration
@pytest.mark.numerical
def test_smol_engine_is_exact(smol_pair64):
    reference, quantized = smol_pair64
    rows = interp.load_examples("wiki", reference.tokenizer, n=2, seq_len=16, seed=0)
    jobs = [P.Patch("resid_post", tuple(range(30))), P.Patch("gate", (28,)), P.Patch("gate_input", (20,)),
            P.Patch("attn_out", (29,)), P.Patch("down", (15, 16, 17))]
    fast = P.patch(quantized, reference, rows, jobs, batch_size=2, metric=F64NLL())
    naive = P.patch_naive(quantized, reference, rows, jobs, batch_size=2, metric=F64NLL())
    assert (fast.values - naive.values).abs().max() < EXACT
    assert (fast.values[0] - nll64(reference, rows)).abs().max() < EXACT
    assert fast.target_value > fast.source_value  # 3-bit hurts
    assert fast.settings["fast"]
