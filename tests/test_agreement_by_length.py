"""Agreement by length: the statistics on a simulated design, the prefix construction, and the committed run.

The simulated design has a known answer. Each example has a true error shared by every method
(agreement 1 without noise), and each token adds independent noise. Then the observed agreement must rise
with the number of targets, the split-half reliability must follow the Spearman-Brown prophecy, and
the disjoint-token correction must stay near 1 at every length.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from interp.quant import length as ln
from interp.quant import protocol as pr

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "reproduction" / "agreement_by_length"


def _design(n: int = 400, width: int = 255, noise: float = 3.0, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    truth = rng.normal(0.0, 1.0, size=(n, 1))
    ref = rng.normal(2.0, 1.0, size=(n, width))
    out = {"reference": ref}
    for name in ("rtn:bits=3,group=64", "nf:bits=3,group=64", "hqq:bits=3,group=64"):
        out[name] = ref + truth + rng.normal(0.0, noise, size=(n, width))
    return out


def test_simulated_design_agreement_rises_with_length_and_the_correction_stays_near_one():
    table = ln.table_from_tokens(_design(), [32, 64, 256], n_boot=300, seed=0)
    # the true per-example agreement of the design: var(truth) / (var(truth) + noise^2 / targets)
    expected = 1 / (1 + 9.0 / table["targets"])
    assert table["pearson"].is_monotonic_increasing
    for row, want in zip(table.itertuples(), expected, strict=True):
        assert row.pearson_low <= want <= row.pearson_high
        assert row.disattenuated_low <= 1.0 <= row.disattenuated_high
    # the change is paired (the same resamples at every length): it excludes 0 where the levels' intervals overlap
    assert table["pearson_change"].iloc[0] == 0.0
    assert table["pearson_change_low"].iloc[-1] > 0
    # Spearman-Brown. In this design a method's error is truth + its own token noise (the reference cancels), so
    # its reliability over m targets is exactly 1 / (1 + 9 / m). Allowed error: 4 standard errors of the estimate,
    # from the Fisher-z standard error of the half-length correlation (1 / sqrt(n - 3)), carried through
    # Spearman-Brown (derivative 2 / (1 + r)^2), over 3 methods averaged (1 / sqrt(3))
    m = table["targets"].to_numpy(dtype=float)
    theory = 1 / (1 + 9.0 / m)
    r_half = 1 / (1 + 18.0 / m)
    se = (1 - r_half**2) / np.sqrt(400 - 3) * 2 / (1 + r_half) ** 2 / np.sqrt(3)
    assert np.all(np.abs(table["mean_reliability"] - theory) <= 4 * se)
    k = m / m[0]
    carried = se[0] * k / (1 + (k - 1) * theory[0]) ** 2  # the prediction's error comes from the first length's
    assert np.all(np.abs(table["reliability_predicted"] - theory) <= 4 * carried + 1e-12)


def test_a_length_is_the_prefix_of_the_longest_row():
    """Row T reads the first T - 1 targets: the same numbers as pair_agreement on those columns, computed here."""
    tokens = _design(n=120, width=127, seed=1)
    table = ln.table_from_tokens(tokens, [64, 128], n_boot=50, seed=0)
    specs = [s for s in tokens if s != "reference"]
    for length in (64, 128):
        means = pd.DataFrame({s: (tokens[s][:, :length - 1] - tokens["reference"][:, :length - 1]).mean(axis=1)
                              for s in specs})
        r = np.corrcoef(means.to_numpy(), rowvar=False)
        naive = np.mean([r[0, 1], r[0, 2], r[1, 2]])
        assert table.loc[table["T"] == length, "pearson"].item() == pytest.approx(naive, rel=1e-12)


def test_lengths_outside_the_scored_rows_are_refused():
    with pytest.raises(ln.InterpError, match="lengths must lie in"):
        ln.table_from_tokens(_design(n=20, width=31), [16, 64], n_boot=10)
    with pytest.raises(ln.InterpError, match="reference"):
        ln.table_from_tokens({"rtn:bits=3": np.zeros((4, 8))}, [4], n_boot=10)


def test_saved_tokens_round_trip(tmp_path):
    tokens = {k: v.astype(np.float32) for k, v in _design(n=10, width=15).items()}
    ln.save_tokens(tmp_path / ln.RAW, tokens, {"order": list(tokens), "seed": 4})
    back, meta = ln.load_tokens(tmp_path / ln.RAW)
    assert list(back) == list(tokens) and meta["seed"] == 4
    assert all(np.array_equal(back[k], tokens[k]) for k in tokens)


def test_bad_arguments_exit_2_before_any_load(capsys, tmp_path):
    assert ln.main(["--out", str(tmp_path), "--lengths", "128,x"]) == 2
    assert "--lengths takes" in capsys.readouterr().err
    assert ln.main(["--out", str(tmp_path), "--specs", "rtn:bits=99"]) == 2
    assert ln.main(["--out", str(tmp_path), "--n", "0"]) == 2
    assert ln.main(["--out", str(tmp_path / "none"), "--analyse-only"]) == 2
    assert "run without --analyse-only first" in capsys.readouterr().err


@pytest.mark.parametrize("folder", ["agreement_by_length", "agreement_by_length_documents"])
def test_committed_table_recomputes_from_the_committed_tokens(folder):
    data = DATA.parent / folder
    tokens, meta = ln.load_tokens(data / ln.RAW)
    table = ln.table_from_tokens(tokens, meta["lengths"], n_boot=1000, seed=meta["seed"])
    committed = pd.read_csv(data / ln.TABLE)
    # the same float32 inputs and the same float64 code: only summation order can differ between CPUs (about 1e-15
    # relative over a few hundred terms); the CSV keeps 17 significant digits
    pd.testing.assert_frame_equal(table, committed, check_exact=False, rtol=1e-9, atol=1e-12)
    assert set(tokens) == {"reference", *[str(pr.parse_spec(s)) for s in ln.DEFAULT_SPECS]}
    assert meta["settings"].get("packed", False) == (folder == "agreement_by_length")


def _mixing_design(n: int = 400, windows: int = 4, width: int = 64, noise: float = 3.0, seed: int = 2
                   ) -> dict[str, np.ndarray]:
    """Packed rows: each window of a row is another document with its own true error, shared by the methods."""
    rng = np.random.default_rng(seed)
    truth = np.repeat(rng.normal(0.0, 1.0, size=(n, windows)), width, axis=1)
    ref = rng.normal(2.0, 1.0, size=(n, windows * width))
    out = {"reference": ref}
    for name in ("rtn:bits=3,group=64", "nf:bits=3,group=64", "hqq:bits=3,group=64"):
        out[name] = ref + truth + rng.normal(0.0, noise, size=ref.shape)
    return out


def test_when_windows_hold_different_documents_agreement_does_not_rise_and_windows_show_why():
    tokens = _mixing_design()
    table = ln.table_from_tokens(tokens, [65, 129, 257], n_boot=300, seed=0)
    # signal and noise both average over the windows: the design's agreement is 1 / (1 + 9 / 64) at every length
    want = 1 / (1 + 9.0 / 64)
    assert all(r.pearson_low <= want <= r.pearson_high for r in table.itertuples())
    assert table["pearson_change_low"].iloc[-1] < 0 < table["pearson_change_high"].iloc[-1]
    per_window, across = ln.windows(tokens, 64)
    # each window's agreement is the design's, within 4 standard errors of a Pearson r, (1 - r^2) / sqrt(n - 3)
    assert len(per_window) == 4 and np.all(np.abs(per_window["pearson"] - want) < 4 * (1 - want**2) / np.sqrt(397))
    # independent documents: a method's errors in two windows correlate at 0, within 4 standard errors (1/sqrt(n))
    assert np.all(np.abs(across["pearson_between_windows"]) < 4 / np.sqrt(400))
    # the one-document design of the first test: windows share the row's truth, so they correlate strongly
    _, shared = ln.windows(_design(n=400, width=256), 64)
    assert np.all(shared["pearson_between_windows"] > 0.3)
    with pytest.raises(ln.InterpError, match="need rows of at least"):
        ln.windows(tokens, 200)
