"""Activation patching on padded examples and on clean/corrupt pairs of different lengths.

Every padded row (left or right), patched or not, must get the value it has when its pair is
run alone, unpadded; a pair of different lengths is aligned at its last real token.

Tolerance. The tiny llama is cast to float64, and its two float32 steps are removed for float64
input by ``tests/float64_attention.py`` (see :func:`float64_throughout`): transformer-lens'
attention and Hugging Face's eager attention both take the softmax in float32, whose sum over
keys rounds differently for 9 keys than for 54 (most of them masked), and that alone moves a
row's NLL by ~4e-9 between a padded batch and the row alone. With the softmax in float64 the two
differ only by float64 reordering, ~1e-16 per op; the RMSNorm's float32 step is elementwise and
rounds equal inputs equally. EXACT = 1e-10 sits five orders above that (measured: <= 2e-15) and
far below any real bug (a patch moves the NLL by > 1e-3 here).
"""

from __future__ import annotations

import pytest
import torch
from tolerances import EPS32

import interp
from interp.architecture import plain_module_tree
from interp.data import Examples, examples_from_texts
from interp.errors import DataError
from interp.localize import patching as P
from interp.runtime import hooks as hk

pytestmark = [pytest.mark.numerical, pytest.mark.usefixtures("one_thread")]  # one_thread: conftest.py

EXACT = 1e-10  # float64 end to end, see the module docstring
CORRUPT = ["Paris is the capital of France.", "Hi there", "A somewhat longer prompt, with punctuation; and more.",
           "Quantization error varies by input."]
CLEAN = ["Rome is the capital of Italy!", "Hello you there", "A prompt", "Quantisation errors vary by input, a lot."]


def float64_throughout(model):
    """``model`` in float64, attention softmax included: ``tests/float64_attention.py`` (installed by
    conftest.py) keeps HF's eager attention and the bridge's softmax in float64 for float64 input."""
    model.original_model.to(torch.float64)
    # the premise of EXACT: a row's activations do not depend on what follows it
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    short, _ = P.capture(model, tokens[:, :9], [])
    long, _ = P.capture(model, tokens, [])
    final = ("resid_post", hk.n_layers(model) - 1)
    assert float((short[final] - long[final][:, :9]).abs().max()) < 1e-13, "a float32 step is left in the model"
    return model


@pytest.fixture(scope="module")
def model64(one_thread):
    return float64_throughout(interp.tiny_model("llama", seed=0))


@pytest.fixture(scope="module")
def quantized64(model64):
    from interp.quant.apply import quantize

    return float64_throughout(quantize(model64, "rtn:bits=3,group=64", progress=False))


class F64NLL(P.NLLMetric):
    """Mean NLL over each row's real targets, from float64 logits (no float32 step; test-only)."""

    def from_resid(self, readout, resid, tokens, index, lengths=None):
        return self.from_logits(readout.logits(resid), tokens, index, lengths)

    def from_logits(self, logits, tokens, index, lengths=None):
        logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
        nll = -logp.gather(-1, tokens[:, 1:, None].to(logp.device))[..., 0]
        if lengths is None:
            return nll.mean(dim=1)
        real = torch.arange(nll.shape[1], device=nll.device)[None] < (lengths.to(nll.device)[:, None] - 1)
        return (nll * real).sum(dim=1) / real.sum(dim=1)


def alone(ex: Examples, i: int) -> Examples:
    keep = ex.attention_mask[i]
    return Examples(tokens=ex.tokens[i][keep][None], texts=[ex.texts[i]], ids=[ex.ids[i]],
                    tokenizer=ex.tokenizer, vocab_size=ex.vocab_size)


JOBS = [P.Patch("resid_pre", (0,)), P.Patch("attn_out", (1,)), P.Patch("down", (1,)), P.Patch("up", (0,)),
        P.Patch("head", (1,), heads=(0, 2)), P.Patch("down", (0, 1)),
        P.Patch("down", (0,), positions=(-1,)),  # the answer position
        P.Patch("resid_pre", (1,), positions=(-3, -1)), P.Patch("head", (0,), positions=(-2,), heads=(1,))]


def _worst_against_alone(results, target, source, pairs):
    worst = 0.0
    for i, (t, s) in enumerate(pairs):
        one = P.patch(target, source, t, JOBS, source_examples=s, metric=F64NLL())
        for res in results:
            worst = max(worst, float((res.values[:, i] - one.values[:, 0]).abs().max()),
                        abs(float(res.target[i] - one.target[0])), abs(float(res.source[i] - one.source[0])))
    return worst


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_equal_each_row_alone(model64, quantized64, tok, side):
    """Cross-model patching (reference into its 3-bit copy) on one padded batch: the engine, its
    full-forward fallback and the naive loop each give every row its value alone."""
    ex = examples_from_texts(CORRUPT, tok, padding=side)
    assert ex.padded
    fast = P.patch(quantized64, model64, ex, JOBS, metric=F64NLL(), batch_size=3, max_rows=5)
    full = P.patch(quantized64, model64, ex, JOBS, metric=F64NLL(), batch_size=4, fast=False)
    naive = P.patch_naive(quantized64, model64, ex, JOBS, metric=F64NLL(), batch_size=3)
    assert fast.settings["fast"] and not full.settings["fast"]
    pairs = [(alone(ex, i), alone(ex, i)) for i in range(len(ex))]
    assert _worst_against_alone([fast, full, naive], quantized64, model64, pairs) < EXACT
    assert float((naive.values - naive.target).abs().max()) > 1e-3  # the patches do move the NLL
    # and the default float32 NLL metric agrees with the float64 one within its rounding
    default = P.patch(quantized64, model64, ex, JOBS[:3], batch_size=3)
    assert float((default.values - fast.values[:3]).abs().max()) < 1e-5


@pytest.mark.parametrize("side", ["left", "right"])
def test_pairs_of_different_lengths_equal_each_pair_alone(model64, tok, side):
    """Clean/corrupt pairs whose rows differ in length (and are padded on opposite sides): each
    pair's values equal that pair run alone, unpadded; positions are counted from each row's end."""
    corrupt = examples_from_texts(CORRUPT, tok, padding=side)
    clean = examples_from_texts(CLEAN, tok, padding="right" if side == "left" else "left")
    lengths = corrupt.attention_mask.sum(1), clean.attention_mask.sum(1)
    assert corrupt.seq_len != clean.seq_len  # and some pairs are longer on each side:
    assert bool((lengths[0] > lengths[1]).any() and (lengths[0] < lengths[1]).any())
    fast = P.patch(model64, model64, corrupt, JOBS, source_examples=clean, metric=F64NLL(), batch_size=3, max_rows=7)
    naive = P.patch_naive(model64, model64, corrupt, JOBS, source_examples=clean, metric=F64NLL(), batch_size=2)
    pairs = [(alone(corrupt, i), alone(clean, i)) for i in range(len(corrupt))]
    assert _worst_against_alone([fast, naive], model64, model64, pairs) < EXACT
    assert float((fast.values - fast.target).abs().max()) > 1e-3


@pytest.mark.parametrize("side", ["left", "right"])
def test_logit_difference_is_read_at_each_rows_answer_position(model64, tok, side):
    """LogitDiffMetric(position=-1) reads each row's last real token, padded or not."""
    corrupt = examples_from_texts(CORRUPT, tok, padding=side)
    clean = examples_from_texts(CLEAN, tok, padding=side)
    metric = P.LogitDiffMetric(answers=[5, 6, 7, 8], wrongs=[9, 10, 11, 12])
    jobs = [P.Patch("resid_pre", (1,), positions=(-1,)), P.Patch("attn_out", (0,))]
    res = P.patch(model64, model64, corrupt, jobs, source_examples=clean, metric=metric, batch_size=4)
    for i in range(len(corrupt)):
        one = P.patch(model64, model64, alone(corrupt, i), jobs, source_examples=alone(clean, i),
                      metric=P.LogitDiffMetric(answers=5 + i, wrongs=9 + i))
        # the metric rounds two float64 logits (equal to ~1e-16) to float32: one ulp each, 2 Zmax eps
        with torch.no_grad():
            z_max = float(model64.original_model(input_ids=alone(corrupt, i).tokens).logits.abs().max())
        assert float((res.values[:, i] - one.values[:, 0]).abs().max()) <= 2 * 2 * z_max * EPS32
        assert abs(float(res.target[i] - one.target[0])) <= 2 * 2 * z_max * EPS32


# ---------------------------------------------------------------------------------------
# An independent hand computation: plain torch hooks on the Hugging Face modules


def _hand_patched_nll(model, target_row: torch.Tensor, source_row: torch.Tensor, component: str, layer: int,
                      answer_only: bool) -> float:
    """Run the source row alone and keep one activation; run the target row alone with that
    activation written over its end-aligned positions (all shared ones, or the last); NLL by hand."""
    hf = plain_module_tree(model.original_model)
    block = hf.model.layers[layer]
    module = {"resid_pre": block, "attn_out": block.self_attn, "down": block.mlp}[component]
    kept = {}

    def first(output):
        return output[0] if isinstance(output, tuple) else output

    def keep_in(mod, args, kwargs):
        kept["x"] = (args[0] if args else kwargs["hidden_states"]).clone()

    def keep_out(mod, args, output):
        kept["x"] = first(output).clone()

    def overwrite(x):
        lt, ls = x.shape[1], kept["x"].shape[1]
        k = 1 if answer_only else min(lt, ls)
        x = x.clone()
        x[:, lt - k :] = kept["x"][:, ls - k :]
        return x

    def write_in(mod, args, kwargs):
        if args:
            return (overwrite(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": overwrite(kwargs["hidden_states"])}

    def write_out(mod, args, output):
        return (overwrite(output[0]), *output[1:]) if isinstance(output, tuple) else overwrite(output)

    pre = component == "resid_pre"
    with torch.no_grad():
        handle = (module.register_forward_pre_hook(keep_in, with_kwargs=True) if pre
                  else module.register_forward_hook(keep_out))
        hf(input_ids=source_row[None])
        handle.remove()
        handle = (module.register_forward_pre_hook(write_in, with_kwargs=True) if pre
                  else module.register_forward_hook(write_out))
        logits = hf(input_ids=target_row[None]).logits[0]
        handle.remove()
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return float(-logp.gather(-1, target_row[1:, None])[:, 0].mean())


@pytest.mark.parametrize("side", ["left", "right"])
def test_different_lengths_against_a_hand_computation(model64, tok, side):
    corrupt = examples_from_texts(CORRUPT, tok, padding=side)
    clean = examples_from_texts(CLEAN, tok, padding=side)
    points = [("resid_pre", 1), ("attn_out", 0), ("down", 1)]
    jobs = [P.Patch(c, (layer,)) for c, layer in points]
    jobs += [P.Patch(c, (layer,), positions=(-1,)) for c, layer in points]
    res = P.patch(model64, model64, corrupt, jobs, source_examples=clean, metric=F64NLL(), batch_size=4)
    for i in range(len(corrupt)):
        target_row = corrupt.tokens[i][corrupt.attention_mask[i]]
        source_row = clean.tokens[i][clean.attention_mask[i]]
        for j, job in enumerate(jobs):
            hand = _hand_patched_nll(model64, target_row, source_row, job.component, job.layers[0],
                                     answer_only=job.positions is not None)
            assert abs(float(res.values[j, i]) - hand) < EXACT, (job.label, i)


# ---------------------------------------------------------------------------------------
# Refusals, all before any forward


def test_mismatches_are_refused_before_any_forward(model64, tok):
    corrupt = examples_from_texts(CORRUPT, tok)
    clean = examples_from_texts(CLEAN, tok)
    calls = []
    handle = model64.original_model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(DataError, match="4 target and 3 source"):
            P.patch(model64, model64, corrupt, JOBS, source_examples=clean.subset([0, 1, 2]))
        with pytest.raises(DataError, match="4 target and 3 source"):
            P.patch_naive(model64, model64, corrupt, JOBS, source_examples=clean.subset([0, 1, 2]))
        # "Hi there" has 9 tokens: no position 12, and no position -10 (its source has 16)
        with pytest.raises(DataError, match="position 12 has no counterpart in example 'text1'"):
            P.patch(model64, model64, corrupt, [P.Patch("down", (0,), positions=(12,))], source_examples=clean)
        with pytest.raises(DataError, match="position -10 has no counterpart in example 'text1'"):
            P.patch(model64, model64, corrupt, [P.Patch("down", (0,), positions=(-10,))], source_examples=clean)
        with pytest.raises(DataError, match="takes no lengths"):
            P.patch(model64, model64, corrupt, JOBS, metric=_NoLengths())
        with pytest.raises(DataError, match="only 9 real tokens"):
            P.patch(model64, model64, corrupt, JOBS, metric=P.LogitDiffMetric(1, 2, position=20))
    finally:
        handle.remove()
    assert not calls


class _NoLengths(P.Metric):
    def from_resid(self, readout, resid, tokens, index):
        return resid.sum(dim=(1, 2)).double()

    def from_logits(self, logits, tokens, index):
        return logits.sum(dim=(1, 2)).double()
