"""At what scale the methods agree (interp.quant.error_scale): the statistics against loops, on designs with a
known answer, and the committed runs read as the page reads them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from interp.errors import InterpError
from interp.quant import error_scale as es
from interp.quant import length as ln
from interp.quant import protocol as pr

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "reproduction"
SPECS = ("rtn:bits=3,group=64", "nf:bits=3,group=64", "hqq:bits=3,group=64")


def _tokens(errors: list[np.ndarray], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ref = rng.normal(2.0, 1.0, size=errors[0].shape)
    return {"reference": ref, **{s: ref + e for s, e in zip(SPECS, errors, strict=True)}}


def test_autocorrelation_matches_a_loop():
    rng = np.random.default_rng(0)
    tokens = _tokens([rng.normal(size=(7, 12)) for _ in SPECS])
    got = es.autocorrelation(tokens, [1, 3, 11], n_boot=20, seed=0)
    for row in got.itertuples():
        per_method = []
        for s in SPECS:
            e = tokens[s] - tokens["reference"]
            c = e - e.mean()
            per_method.append(np.mean([c[i, t] * c[i, t + row.lag] for i in range(7) for t in range(12 - row.lag)])
                              / np.mean(c * c))
        assert row.autocorrelation == pytest.approx(np.mean(per_method), abs=1e-12)
        assert row.method_min == pytest.approx(min(per_method), abs=1e-12)
        assert row.low <= row.high


def test_window_agreement_and_adjacent_windows_match_a_loop():
    rng = np.random.default_rng(1)
    tokens = _tokens([rng.normal(size=(9, 20)) for _ in SPECS])
    got = es.by_window(tokens, [3, 5], n_boot=20, seed=0)
    for row in got.itertuples():
        w, count = row.width, 20 // row.width
        means = [np.stack([(tokens[s] - tokens["reference"])[:, j * w:(j + 1) * w].mean(axis=1)
                           for j in range(count)], axis=1) for s in SPECS]
        centered = [m - m.mean(axis=0) for m in means]
        pairs = [(SPECS.index(a), SPECS.index(b)) for a, b in pr.paper_pairs(list(SPECS))]
        want = np.mean([np.corrcoef(centered[i].ravel(), centered[j].ravel())[0, 1] for i, j in pairs])
        assert row.agreement == pytest.approx(want, abs=1e-12)
        adjacent = np.mean([np.corrcoef((m[:, :-1] - m[:, :-1].mean(axis=0)).ravel(),
                                        (m[:, 1:] - m[:, 1:].mean(axis=0)).ravel())[0, 1] for m in means])
        assert row.adjacent == pytest.approx(adjacent, abs=1e-12)
    assert got["change"].iloc[0] == 0 and got["token_noise_prediction"].iloc[0] == got["agreement"].iloc[0]


def test_an_ar1_error_shows_its_decay():
    """Each method's error an AR(1) series with coefficient 0.6: the autocorrelation at lag k is 0.6^k, within four
    of its bootstrap standard errors (the 95% half-width over 1.96)."""
    rng = np.random.default_rng(2)

    def ar1(n: int = 300, length: int = 64, phi: float = 0.6) -> np.ndarray:
        out = np.zeros((n, length))
        out[:, 0] = rng.normal(size=n) / np.sqrt(1 - phi**2)
        for t in range(1, length):
            out[:, t] = phi * out[:, t - 1] + rng.normal(size=n)
        return out

    got = es.autocorrelation(_tokens([ar1() for _ in SPECS]), [1, 2, 4, 8], n_boot=300, seed=0)
    for row in got.itertuples():
        se = (row.high - row.low) / (2 * 1.96)
        assert abs(row.autocorrelation - 0.6**row.lag) < 4 * se  # stationary from t = 0: no start-up bias


def test_token_noise_follows_spearman_brown_and_a_shared_token_structure_stays_flat():
    """Token noise (a row-level error shared by the methods plus independent token noise): agreement rises with
    the window as Spearman-Brown predicts. A shared part that varies token by token like each method's own part:
    agreement is the same at every width, far below the prediction."""
    rng = np.random.default_rng(3)
    n, length = 400, 128
    truth = np.repeat(rng.normal(size=(n, 1)), length, axis=1)
    noisy = es.by_window(_tokens([truth + rng.normal(0, 4.0, (n, length)) for _ in SPECS]), [4, 16, 64],
                         n_boot=300, seed=0)
    widest = noisy.iloc[-1]
    assert widest.low <= widest.token_noise_prediction <= widest.high
    assert noisy["agreement"].is_monotonic_increasing
    shared = rng.normal(size=(n, length))
    flat = es.by_window(_tokens([shared + rng.normal(size=(n, length)) for _ in SPECS]), [4, 16, 64], n_boot=300,
                        seed=0)
    widest = flat.iloc[-1]
    assert widest.change_low <= 0 <= widest.change_high
    assert widest.token_noise_prediction > widest.high


def test_bad_requests_are_refused_in_the_projects_words():
    rng = np.random.default_rng(4)
    tokens = _tokens([rng.normal(size=(5, 10)) for _ in SPECS])
    with pytest.raises(InterpError, match="lags"):
        es.autocorrelation(tokens, [0, 10])
    with pytest.raises(InterpError, match="need rows of at least"):
        es.by_window(tokens, [6])
    with pytest.raises(InterpError, match="no 'reference'"):
        es.autocorrelation({s: tokens[s] for s in SPECS}, [1])


@pytest.fixture(scope="module")
def committed():
    out = {}
    for folder in ("agreement_by_length_documents", "agreement_by_length"):
        tokens, _ = ln.load_tokens(DATA / folder / ln.RAW)
        length = tokens["reference"].shape[1]
        out[folder] = (es.by_window(tokens, [4, 16, 64, length // 2], n_boot=1000, seed=0),
                       es.autocorrelation(tokens, [1, 32], n_boot=1000, seed=0))
    return out


@pytest.mark.parametrize("folder", ["agreement_by_length_documents", "agreement_by_length"])
def test_the_committed_runs_say_what_the_page_reads(committed, folder):
    """docs/reproduction.md, "Read plainly": agreement hardly depends on the window (its change from 4 targets to
    half a row stays under 0.1 of Pearson) and stays far below the token-noise prediction; the per-token error's
    autocorrelation is present at lag 1 and, by lag 32, under a tenth of that."""
    widths, lags = committed[folder]
    widest = widths.iloc[-1]
    assert widest.change_high < 0.1
    assert widest.token_noise_prediction > widest.high + 0.2
    lag1, lag32 = lags.iloc[0], lags.iloc[1]
    assert lag1.low > 0 and lag32.autocorrelation < 0.1 * lag1.autocorrelation


def test_a_document_halves_correlate_and_a_packed_rows_do_not(committed):
    """The page: within a document a small remainder carries from one half to the other; the two halves of a packed
    row (mostly different documents) do not correlate."""
    documents = committed["agreement_by_length_documents"][0].iloc[-1]
    packed = committed["agreement_by_length"][0].iloc[-1]
    assert documents.adjacent_low > 0
    assert packed.adjacent_low <= 0 <= packed.adjacent_high
