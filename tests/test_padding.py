"""Prompts of different lengths, padded left or right, give every row the value it has alone.

Run in float64 on a tiny llama: "the same" means equal to about 1e-10 (float64 rounding of a
2-layer forward over <= 40 positions is ~1e-15 per op; 1e-10 leaves five orders of margin for
the different matmul shapes of a padded batch).
"""

from __future__ import annotations

import pytest
import torch
from padding_rows import TEXTS, row_alone
from tolerances import EPS32, rounding_tol

import interp
from interp.data import examples_from_texts
from interp.errors import DataError

pytestmark = pytest.mark.numerical  # derived tolerances: CI reruns this file with one thread

EXACT = 1e-10  # float64 end to end, see the module docstring


@pytest.mark.parametrize("side", ["right", "left"])
def test_nll_of_padded_rows_equals_each_row_alone(model64, tok, side) -> None:
    ex = examples_from_texts(TEXTS, tok, padding=side)
    assert ex.padded and ex.attention_mask.sum(dim=1).tolist() == [1 + len(t.encode()) for t in TEXTS]
    batched = interp.nll(model64, ex, batch_size=3).double()
    alone = torch.cat([interp.nll(model64, row_alone(ex, i)).double() for i in range(len(TEXTS))])
    assert float((batched - alone).abs().max()) < 1e-6  # nll returns float32: one rounding of values ~5.6
    from interp.runtime.scoring import row_mean, token_nll_fn

    score = token_nll_fn(model64)
    with torch.no_grad():
        exact = row_mean(score(ex.tokens, ex.attention_mask), ex.attention_mask)
        exact_alone = torch.cat([row_mean(score(row_alone(ex, i).tokens)) for i in range(len(TEXTS))])
    assert float((exact - exact_alone).abs().max()) < EXACT


def test_left_and_right_padding_agree(model64, tok) -> None:
    from interp.runtime.scoring import row_mean, token_nll_fn

    score = token_nll_fn(model64)
    values = {}
    for side in ("left", "right"):
        ex = examples_from_texts(TEXTS, tok, padding=side)
        with torch.no_grad():
            values[side] = row_mean(score(ex.tokens, ex.attention_mask), ex.attention_mask)
    assert float((values["left"] - values["right"]).abs().max()) < EXACT


@pytest.mark.parametrize("side", ["right", "left"])
def test_score_honours_the_mask(model64, tok, side, tmp_path) -> None:
    from interp.quant.store import ScoreStore, score

    ex = examples_from_texts(TEXTS, tok, padding=side)
    errors = score(model64, ["rtn:bits=4,group=32"], ex, store=tmp_path / "padded", progress=False, batch_size=4)
    alone = []
    for i in range(len(TEXTS)):
        one = score(model64, ["rtn:bits=4,group=32"], row_alone(ex, i), store=tmp_path / f"alone{i}", progress=False)
        alone.append(float(one.iloc[0, 0]))
    # errors are differences of two float64 means stored as SQLite REAL (float64): exact to ~1e-12
    assert max(abs(a - b) for a, b in zip(errors.iloc[:, 0].tolist(), alone, strict=True)) < EXACT
    with ScoreStore(tmp_path / "padded") as st:
        tokens = st.token_nll("reference", ids=ex.ids)
    valid = ex.attention_mask[:, 1:] & ex.attention_mask[:, :-1]
    assert torch.equal(torch.tensor(tokens.notna().to_numpy()), valid)  # pad targets stored as NaN


@pytest.mark.parametrize("side", ["right", "left"])
def test_score_with_kl_honours_the_mask(model64, tok, side, tmp_path) -> None:
    """The KL(p_ref || p_q) path scores padded rows as it scores each row alone (float64, EXACT)."""
    from interp.quant import parse_spec
    from interp.quant.store import ScoreStore, score

    ex = examples_from_texts(TEXTS, tok, padding=side)
    spec = str(parse_spec("rtn:bits=4,group=32"))  # the store's columns are canonical specs
    errors = score(model64, [spec], ex, store=tmp_path / "padded", kl=True, progress=False, batch_size=4)
    with ScoreStore(tmp_path / "padded") as st:
        kl = st.kl_frame(specs=[spec]).iloc[:, 0].tolist()
    for i in range(len(TEXTS)):
        folder = tmp_path / f"alone{i}"
        one = score(model64, [spec], row_alone(ex, i), store=folder, kl=True, progress=False)
        with ScoreStore(folder) as st:
            kl_alone = float(st.kl_frame(specs=[spec]).iloc[0, 0])
        assert abs(float(errors.iloc[i, 0]) - float(one.iloc[0, 0])) < EXACT
        assert abs(kl[i] - kl_alone) < EXACT and kl_alone > 0


def test_padding_changes_the_stored_row(tok) -> None:
    from interp.quant.store import row_hash

    right = examples_from_texts(TEXTS[:2], tok, padding="right")
    left = examples_from_texts(TEXTS[:2], tok, padding="left")
    assert row_hash(right.tokens[1], right.attention_mask[1]) != row_hash(left.tokens[1], left.attention_mask[1])
    assert row_hash(right.tokens[0], right.attention_mask[0]) == row_hash(right.tokens[0])  # longest row: no pad


def test_texts_of_equal_length_are_not_padded(model64, tok) -> None:
    # every entry point now honours the mask (attribution too: tests/test_patching.py checks padded rows
    # against each row alone), so there is no refusal left to test here
    same = examples_from_texts(["abcd", "efgh"], tok)
    assert not same.padded  # equal lengths: no padding, every entry point accepts it
    assert tuple(interp.probe(model64, same, ["resid_post"], ["norm"])["resid_post", "norm"].shape)[1] == 2


VECTOR = ["norm", "mean", "kurtosis", "abs_mean_dims"]
ATTENTION = ["entropy", "entropy_norm", "gtd", "sink_share", "effective_span"]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("exclude_bos", [True, False])
def test_probe_of_padded_rows_equals_each_row_alone(model64, tok, side, exclude_bos) -> None:
    """Every reducer, vector and attention, and the probe's NLL: a padded batch gives each row
    the value it has when run alone, unpadded (float64: EXACT)."""
    ex = examples_from_texts(TEXTS, tok, padding=side)
    comps = ["resid_mid", "resid_post", "h", "gate", "pattern"]
    kwargs = dict(reducers=VECTOR + ATTENTION, exclude_bos=exclude_bos, progress=False)
    batched = interp.probe(model64, ex, comps, batch_size=3, with_nll=True, **kwargs)
    for i in range(len(TEXTS)):
        alone = interp.probe(model64, row_alone(ex, i), comps, with_nll=True, **kwargs)
        for key in alone.stats:
            got, want = batched.stats[key][:, i], alone.stats[key][:, 0]
            assert torch.isfinite(got).all(), key
            assert float((got.double() - want.double()).abs().max()) < EXACT, (key, i)
        assert abs(float(batched.nll[i]) - float(alone.nll[0])) < 1e-6  # nll is stored in float32


@pytest.mark.parametrize("side", ["right", "left"])
def test_full_capture_of_padded_rows_sits_where_the_tokens_were(model64, tok, side) -> None:
    ex = examples_from_texts(TEXTS, tok, padding=side)
    batched = interp.probe(model64, ex, ["resid_post"], ["full"], progress=False)["resid_post", "full"]
    for i in range(len(TEXTS)):
        alone = interp.probe(model64, row_alone(ex, i), ["resid_post"], ["full"], progress=False)["resid_post", "full"]
        keep = ex.attention_mask[i]
        assert float((batched[:, i][:, keep] - alone[:, 0]).abs().max()) < EXACT
        assert torch.isnan(batched[:, i][:, ~keep]).all()  # pads are marked, never zeros that look like data


@pytest.mark.parametrize("side", ["right", "left"])
def test_attention_analysis_with_saobp_honours_the_mask(model64, tok, side) -> None:
    from interp.attention import analyze

    ex = examples_from_texts(TEXTS, tok, padding=side)
    batched = analyze(model64, ex, saobp_beta=3.0, batch_size=3, progress=False)
    means = [analyze(model64, row_alone(ex, i), saobp_beta=3.0, progress=False).table for i in range(len(TEXTS))]
    metrics = ATTENTION
    expected = sum(t[metrics].to_numpy() for t in means) / len(means)  # the table averages over examples
    assert abs(batched.table[metrics].to_numpy() - expected).max() < EXACT
    assert abs(batched.nll_saobp.double() - torch.cat([analyze(model64, row_alone(ex, i), saobp_beta=3.0,
               progress=False).nll_saobp.double() for i in range(len(TEXTS))])).max() < 1e-6


def test_bad_text_input_is_refused(tok) -> None:
    for texts in ([], "just one string", ["ok", ""], ["ok", None], ["ok", 3]):
        with pytest.raises(DataError):
            examples_from_texts(texts, tok)
    with pytest.raises(DataError):
        examples_from_texts(["ok"], tok, padding="middle")
    with pytest.raises(DataError):
        examples_from_texts(["ok"], tok, max_len=1)
    with pytest.raises(DataError):
        examples_from_texts(["a", "b"], tok, ids=["x", "x"])
    cut = examples_from_texts(["a long text to cut"], tok, max_len=5)
    assert cut.tokens.shape == (1, 5)


def _stored(values: torch.Tensor) -> float:
    """Two float32 roundings of the same float64 value differ by at most one ulp: EPS32 * |v|."""
    return rounding_tol(1, float(values.abs().max()), EPS32) + EXACT


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("at", ["resid_mid", "resid_post"])
def test_early_exit_of_padded_rows_equals_each_row_alone(model64, tok, side, at) -> None:
    """The logit lens averages each row's real targets only: a padded batch equals each row run
    alone (float64 inside; the result is stored in float32, hence one ulp)."""
    from interp.localize.lens import early_exit

    ex = examples_from_texts(TEXTS, tok, padding=side)
    batched = early_exit(model64, ex, at=at, batch_size=3, progress=False).nll
    alone = torch.cat([early_exit(model64, row_alone(ex, i), at=at, progress=False).nll for i in range(len(TEXTS))], 1)
    assert torch.isfinite(batched).all()
    assert float((batched.double() - alone.double()).abs().max()) <= _stored(alone)
    if at == "resid_post":  # the last layer's exit is the model's own NLL, padded or not
        assert float((batched[-1].double() - interp.nll(model64, ex).double()).abs().max()) < 1e-6


@pytest.mark.parametrize("side", ["right", "left"])
def test_tuned_lens_fit_and_exit_ignore_padding(model64, tok, side) -> None:
    """The tuned lens's least-squares fit reads real positions only (so a padded calibration set
    fits the same translators as the concatenated rows), and its exit averages real targets."""
    from interp.localize.tuned_lens import fit_tuned_lens, tuned_early_exit

    calib = examples_from_texts(TEXTS * 4, tok, padding=side)  # enough tokens for a d+1 system
    lens = fit_tuned_lens(model64, calib, batch_size=5, progress=False)
    one_by_one = fit_tuned_lens(model64, examples_from_texts(TEXTS * 4, tok, padding=side), batch_size=1,
                                progress=False)
    assert lens.settings["tokens"] == int(calib.attention_mask.sum()) - len(calib)  # real tokens, BOS out
    # batches of 5 and of 1 pad differently: the same Gram sums in another order, solved in float64
    # and stored in float32, so each weight may differ by one float32 ulp at most
    ulp = rounding_tol(1, torch.maximum(lens.weight.abs(), one_by_one.weight.abs()), EPS32)
    assert bool(((lens.weight - one_by_one.weight).abs() <= ulp).all())
    ex = examples_from_texts(TEXTS, tok, padding=side)
    batched = tuned_early_exit(model64, lens, ex, batch_size=3, progress=False).nll
    alone = torch.cat([tuned_early_exit(model64, lens, row_alone(ex, i), progress=False).nll
                       for i in range(len(TEXTS))], 1)
    assert float((batched.double() - alone.double()).abs().max()) <= _stored(alone)
