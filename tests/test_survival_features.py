"""The survival study's features stage (issue 48) on a tiny model: quality read against the registered bar, and the
survival rate against a naive per-latent count."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import interp
from interp.localize.sae import TopKSAE
from interp.localize.sae_metrics import LatentRowStats, latent_stats, sae_quality
from interp.quant.apply import quantize
from interp.report.survival.feature_counts import DEFINITIONS, SurvivalCounts, survive_counts
from interp.report.survival.features import _bar_reading, _share, feature_analysis
from interp.report.survival.registration import registration
from interp.report.survival.run import file_name
from interp.stats import Estimate

MODEL = "smollm2-135m"  # the roster's labels; the data below come from a tiny model


def _sae(d: int = 64, d_sae: int = 96, k: int = 8) -> TopKSAE:
    g = torch.Generator().manual_seed(0)
    w_dec = torch.randn(d_sae, d, generator=g)
    w_dec = w_dec / w_dec.norm(dim=1, keepdim=True)
    return TopKSAE(W_enc=w_dec.T.clone(), b_enc=torch.zeros(d_sae), W_dec=w_dec, b_dec=torch.zeros(d), k=k,
                   hook_name="blocks.1.hook_resid_post")


def test_bar_reading_uses_both_interval_ends():
    assert _bar_reading(Estimate(0.1, 0.05, 0.15), 0.2, "<=") == "met"
    assert _bar_reading(Estimate(0.3, 0.25, 0.35), 0.2, "<=") == "not met"
    assert _bar_reading(Estimate(0.2, 0.15, 0.25), 0.2, "<=") == "on the bar"
    assert _bar_reading(Estimate(0.9, 0.85, 0.95), 0.8, ">=") == "met"


def test_feature_analysis_counts_surviving_latents_as_a_naive_loop_does(tmp_path):
    model = interp.tiny_model("llama")
    tokens = torch.randint(0, 256, (12, 24), generator=torch.Generator().manual_seed(1))
    tokens[:, 0] = 256
    rows = interp.Examples.from_tokens(tokens)
    sae = _sae()
    folder = tmp_path / "features"
    folder.mkdir()
    for layer in (5, 15, 25):  # the registered layers name the files; the tiny SAE reads block 1 each time
        sae_quality(model, sae, rows).save(folder / f"quality-L{layer}.safetensors")
    label = "rtn:bits=3,group=64"
    quantized = quantize(model, "rtn:bits=3,group=32", progress=False)
    stats = latent_stats(sae, model, quantized, rows)
    SurvivalCounts.reduce(stats, [0, 1, 2], 200).save(folder / f"{file_name(label)}-L5.safetensors")
    reg = copy.deepcopy(registration())
    reg["intervals"]["n_boot"] = 200  # the committed resamples of this small test: seed 0, and 1-2 for MC error
    result = feature_analysis(tmp_path, MODEL, reg, seeds=[1, 2])
    assert len(result["quality"]) == 3 and set(result["quality"]["fvu_bar"]) <= {"met", "not met", "on the bar"}
    per_layer = result["survival"]
    row = per_layer[per_layer["definition"] == DEFINITIONS[0][0]].set_index(["method", "layer"]).loc[(label, 5)]
    # naive: per latent, over every position, correlation and firing rates from the two models' activations
    with torch.no_grad():
        _, a = model.run_with_cache(tokens, names_filter="blocks.1.hook_resid_post")
        _, b = quantized.run_with_cache(tokens, names_filter="blocks.1.hook_resid_post")
    za = sae.encode(a["blocks.1.hook_resid_post"][:, 1:].reshape(-1, 64)).double().numpy()
    zb = sae.encode(b["blocks.1.hook_resid_post"][:, 1:].reshape(-1, 64)).double().numpy()
    judged = (za > 0).sum(0) >= 20
    survive = []
    for j in np.flatnonzero(judged):
        fa, fb = (za[:, j] > 0).mean(), (zb[:, j] > 0).mean()
        rho = np.corrcoef(za[:, j], zb[:, j])[0, 1] if zb[:, j].std() > 0 else -1.0
        survive.append(rho >= 0.9 and 0.5 <= fb / fa <= 2)
    assert row["judged_latents"] == int(judged.sum()) > 0
    assert row["rate"] == np.mean(survive)
    assert row["rate_low"] <= row["rate"] <= row["rate_high"]
    pooled = result["pooled"]
    assert pooled.empty  # layers 15 and 25 have no instance file: pooled only over the same instances everywhere


def _synthetic_stats(seed: int, n_rows: int = 30, d_sae: int = 40, scale: float = 1.0) -> LatentRowStats:
    """Per-row sums of two models' latents drawn at random: reference a, quantized b = a + noise (some latents
    moved much, some not), 6-20 positions a row, as LatentRowStats keeps them (pairs where either fires)."""
    g = np.random.default_rng(seed)
    base = np.random.default_rng(99)  # the reference is the same for every instance
    sums = {k: np.zeros((n_rows, d_sae)) for k in ("sum_a", "sum_b", "sum_aa", "sum_bb", "sum_ab", "fire_a",
                                                       "fire_b")}
    positions = base.integers(6, 20, n_rows)
    offset = base.uniform(-3.5, 0.5, d_sae)  # some latents fire at fewer than 20 positions: not judged
    noise = scale * g.uniform(0.0, 0.8, d_sae)  # rho from about 1 down to about 0.7: thresholds split the latents
    for r in range(n_rows):
        a = np.maximum(base.normal(0, 1, (positions[r], d_sae)) + offset, 0)
        b = np.maximum(a + noise * g.normal(0, 1, a.shape), 0)
        for name, v in (("sum_a", a), ("sum_b", b), ("sum_aa", a * a), ("sum_bb", b * b), ("sum_ab", a * b),
                        ("fire_a", a > 0), ("fire_b", b > 0)):
            sums[name][r] = v.sum(0)
    row, latent = np.nonzero((sums["fire_a"] > 0) | (sums["fire_b"] > 0))
    values = {k: v[row, latent] for k, v in sums.items()}
    for k in ("fire_a", "fire_b"):
        values[k] = values[k].astype(np.int32)
    return LatentRowStats(row=row.astype(np.int32), latent=latent.astype(np.int32), **values,
                          positions=positions.astype(np.int64), d_sae=d_sae)


def _per_row_share(rho_min: float, rate: bool) -> object:
    """survival-1's statistic read straight from the per-row sums (LatentRowStats.correlation, firing_rates)."""
    def statistic(stats: LatentRowStats, rows: np.ndarray) -> np.ndarray:
        f_ref_all, _ = stats.firing_rates()
        judged = f_ref_all[0] * stats.totals()["n"][0, 0] >= 20
        rho = np.nan_to_num(stats.correlation(rows)[:, judged], nan=-1.0)
        f_ref, f_q = stats.firing_rates(rows)
        ok = rho >= rho_min
        if rate:
            ratio = f_q[:, judged] / f_ref[:, judged]
            ok &= (ratio >= 0.5) & (ratio <= 2.0)
        return ok.mean(axis=-1)
    return statistic


def test_committed_counts_give_the_intervals_of_the_per_row_sums(tmp_path):
    """survival-2's promise: intervals from the committed counts equal those from the per-row sums, for every
    definition and every committed seed, with several instances (crossed); other resamples are refused."""
    from interp.errors import DataError
    from interp.stats import bootstrap_indices, crossed_bootstrap

    stats = [_synthetic_stats(s) for s in range(3)]
    seeds, n_boot = [0, 5], 300
    counts = [SurvivalCounts.load(SurvivalCounts.reduce(s, seeds, n_boot).save(tmp_path / f"i{i}.safetensors"))
              for i, s in enumerate(stats)]
    judged = int(counts[0].judged.sum())
    assert 0 < judged < stats[0].d_sae
    for k, (_, rho_min, rate) in enumerate(DEFINITIONS):
        for seed in seeds:
            naive = crossed_bootstrap(stats, _per_row_share(rho_min, rate), 30, n_boot, seed).estimate
            committed = crossed_bootstrap([(c,) for c in counts], _share(k), 30, n_boot, seed).estimate
            # equal, not close: both are counts over the same judged latents in the same resamples (a rho within
            # float noise of a threshold could differ, which these draws do not have)
            assert (committed.value, committed.low, committed.high) == (naive.value, naive.low, naive.high)
    heads = [tuple(c.point()) for c in counts]
    assert len(set(heads)) > 1 and 0 < heads[0][0] < judged  # the instances differ, so a mix-up of instances would show
    with pytest.raises(DataError, match="bootstrap seeds"):
        counts[0].counts_for(bootstrap_indices(30, n_boot, 7))


def test_survive_counts_against_a_naive_loop():
    """Each definition's count, latent by latent in Python floats, on totals with every edge case: undefined rho
    (never fires in b), rate exactly 0.5 and 2.0, rho exactly on a threshold is not needed (floats)."""
    g = np.random.default_rng(3)
    d = 25
    a = np.maximum(g.normal(0, 1, (50, d)), 0)
    b = np.maximum(a + g.uniform(0, 1.5, d) * g.normal(0, 1, (50, d)), 0)
    b[:, 0] = 0  # latent 0 never fires in b: undefined rho, does not survive
    t = {"n": np.array([[50.0]]), "sum_a": a.sum(0)[None], "sum_b": b.sum(0)[None], "sum_aa": (a * a).sum(0)[None],
         "sum_bb": (b * b).sum(0)[None], "sum_ab": (a * b).sum(0)[None], "fire_a": (a > 0).sum(0)[None] * 1.0,
         "fire_b": (b > 0).sum(0)[None] * 1.0}
    judged = (a > 0).sum(0) >= 20
    got = survive_counts(t, judged)[0]
    for k, (_, rho_min, rate) in enumerate(DEFINITIONS):
        want = 0
        for j in np.flatnonzero(judged):
            rho = np.corrcoef(a[:, j], b[:, j])[0, 1] if b[:, j].std() > 0 else -1.0
            ratio = (b[:, j] > 0).sum() / (a[:, j] > 0).sum()
            want += bool(rho >= rho_min and (not rate or 0.5 <= ratio <= 2))
        assert got[k] == want, DEFINITIONS[k]
    assert judged[0] and 0 < got[0] < judged.sum()


def test_definitions_are_the_registered_numbers():
    """The thresholds in code are survival-1's (its survives and secondary texts), so an edit of either shows."""
    text = registration()["features"]["survival"]
    assert "rho_j >= 0.9 and 0.5 <= f'_j / f_j <= 2" == text["survives"]
    for _, rho_min, _ in DEFINITIONS[1:5]:
        assert f"{rho_min:g}" in text["secondary"]
    assert "rho alone" in text["secondary"]
    from interp.report.survival.features import SEARCH

    search = registration()["features"]["sae"]["search"]
    assert "latents in {4096, 8192} and k in {32, 64}" in search
    assert sorted(SEARCH) == [(a, b) for a in (4096, 8192) for b in (32, 64)]


def test_feature_tie_from_committed_counts_equals_the_per_row_computation(tmp_path):
    """survival-3's promise: T (repaired by named - by control, over each instance's broken latents, repair
    recomputed per resample) from the committed counts equals T from the per-row sums; feature_tie_analysis reads
    the files the run writes (instance, '#named', '#control') and gives that T."""
    from interp.report.survival.tie import feature_tie_analysis
    from interp.stats import crossed_bootstrap

    seeds, n_boot = [0, 1, 2], 200
    label = "gptq:bits=3,group=64"  # a tie method with 5 instances; 2 are measured here
    folder = tmp_path / "features"
    folder.mkdir()
    naive_data = []
    for i, uid in enumerate([f"{label}@seed61", f"{label}@seed62"]):
        inst = _synthetic_stats(10 + i)
        named = _synthetic_stats(20 + i, scale=0.3)  # smaller noise: repairs more
        control = _synthetic_stats(10 + i, scale=0.9)
        base = SurvivalCounts.reduce(inst, seeds, n_boot)
        base.save(folder / f"{file_name(uid)}-L5.safetensors")
        broken = base.broken_latents()
        for name, stats in (("named", named), ("control", control)):
            SurvivalCounts.reduce(stats, seeds, n_boot, broken).save(folder / f"{file_name(uid)}#{name}-L5.safetensors")
        naive_data.append((named, control, broken))

    def naive_t(data, rows):
        named, control, broken = data
        out = []
        for stats in (named, control):
            judged = stats.totals()["fire_a"][0] >= 20
            rho = np.nan_to_num(stats.correlation(rows), nan=-1.0)
            f_ref, f_q = stats.firing_rates(rows)
            with np.errstate(divide="ignore", invalid="ignore"):  # latents never firing: not judged
                ok = (rho >= 0.9) & (f_q / f_ref >= 0.5) & (f_q / f_ref <= 2.0)
            assert not (broken & ~judged).any()
            out.append(ok[:, broken].sum(axis=-1))
        return (out[0] - out[1]) / broken.sum()

    reg = copy.deepcopy(registration())
    reg["intervals"]["n_boot"] = n_boot
    rows = feature_tie_analysis(tmp_path, MODEL, 5, reg, seeds=[1, 2])
    assert [r["method"] for r in rows] == [label]
    row = rows[0]
    want = crossed_bootstrap(naive_data, naive_t, 30, n_boot, 0).estimate
    assert row["broken_units"] == sum(int(d[2].sum()) for d in naive_data) >= 3
    assert (row["T"], row["T_low"], row["T_high"]) == (want.value, want.low, want.high)
    assert row["T"] > 0  # the named variant was made closer to the reference, so the test can see a sign error


def test_latent_survival_writes_the_committed_form_for_an_instance_and_its_variant(tmp_path):
    """The run's step on a tiny model: per-row sums go to the working folder, the committed form to raw/features;
    the reference is captured once for both calls; the variant's file carries its instance's broken latents."""
    from interp.models import weights_digest
    from interp.report.survival.features import latent_survival

    model = interp.tiny_model("llama")
    tokens = torch.randint(0, 256, (6, 24), generator=torch.Generator().manual_seed(2))
    tokens[:, 0] = 256
    rows = interp.Examples.from_tokens(tokens)
    saes = {5: _sae(), 15: _sae(k=4)}  # both read block 1 of the tiny model; the registered layers name the files
    quantized = quantize(model, "rtn:bits=2,group=32", progress=False)
    reg = copy.deepcopy(registration())
    reg["intervals"]["n_boot"] = 50
    reg["intervals"]["boundary"]["mc_seeds"] = [1]
    raw, working, context = tmp_path / "raw", tmp_path / "work", {}
    (raw / "features").mkdir(parents=True)
    working.mkdir()
    uid = "rtn:bits=3,group=64"
    latent_survival(model, quantized, saes, rows, raw, uid, context, working, reg)
    captured = context["reference_activations"]
    latent_survival(model, model, saes, rows, raw, f"{uid}#named", context, working, reg)  # restored: the reference
    assert context["reference_activations"] is captured
    for layer in saes:
        base = SurvivalCounts.load(raw / "features" / f"{file_name(uid)}-L{layer}.safetensors")
        named = SurvivalCounts.load(raw / "features" / f"{file_name(uid)}#named-L{layer}.safetensors")
        assert (working / f"{file_name(uid)}-{weights_digest(quantized)[:16]}-L{layer}.safetensors").is_file()
        assert base.counts.shape == (2, 50, len(DEFINITIONS)) and base.repaired is None
        broken = base.broken_latents()
        assert named.broken == int(broken.sum())
        assert broken.any()  # 2-bit RTN breaks some latents of the tiny model, so the check below can fail
        assert (named.repaired == broken.sum()).all()  # the reference against itself repairs every one


@pytest.mark.parametrize(("meets", "fvus", "trained", "chosen"), [
    ({(4096, 32)}, {}, [(4096, 32)], (4096, 32)),  # the registered SAE meets the bar: no search
    (set(), {(4096, 32): 0.3, (4096, 64): 0.25, (8192, 32): 0.22, (8192, 64): 0.27}, 4, (8192, 32)),  # none: least FVU
    ({(4096, 64), (8192, 64)}, {(4096, 32): 0.3, (4096, 64): 0.19, (8192, 32): 0.1, (8192, 64): 0.15}, 4,
     (8192, 64)),  # least FVU among those meeting the bar, not of all
])
def test_the_registered_search_over_latents_and_k(meets, fvus, trained, chosen, tmp_path, monkeypatch):
    """survival-1 features.sae.search, with training and quality replaced by stand-ins whose readings the test sets:
    which candidates are trained, which is kept, and the report of every candidate."""
    import json
    import types

    import interp.localize.sae_metrics as sae_metrics
    import interp.localize.sae_train as sae_train
    from interp.report.survival import features

    calls = []

    def fake_train(train, validation, latents, k, **kwargs):
        calls.append((latents, k))
        return types.SimpleNamespace(shape=(latents, k)), types.SimpleNamespace(to_dict=lambda: {"epochs": []})

    monkeypatch.setattr(sae_train, "train_sae", fake_train)
    monkeypatch.setattr(sae_metrics, "sae_quality", lambda model, sae, rows, progress=None: sae.shape)
    monkeypatch.setattr(features, "bar_readings", lambda shape, reg: ({"fvu": fvus.get(shape, 0.1)}, shape in meets))
    (tmp_path / "features").mkdir()
    kept = features._search(None, None, None, None, 5, tmp_path / "cache", tmp_path, registration())
    assert kept.shape == chosen
    assert calls == (trained if isinstance(trained, list) else list(features.SEARCH))
    report = json.loads((tmp_path / "features" / "candidates-L5.json").read_text())
    assert [(c["latents"], c["k"]) for c in report["candidates"] if c["chosen"]] == [chosen]
    assert report["searched"] == (len(calls) > 1)


def test_layer_shares_of_the_non_surviving_latents_from_a_naive_count(tmp_path):
    """The tie's descriptive feature statistic: each layer's share of the non-surviving judged latents (summed over
    a method's instances) beside its share of the judged latents, against a count from the per-row sums."""
    from interp.report.survival.registration import file_name
    from interp.report.survival.tie import layer_shares

    layers, method = (5, 15), "gptq:bits=3,group=64"
    ids = [f"{method}@seed61", f"{method}@seed62"]
    judged, lost = np.zeros(2), np.zeros(2)
    for i, uid in enumerate(ids):
        for k, layer in enumerate(layers):
            stats = _synthetic_stats(10 * i + k, scale=1.0 + k)  # the later layer loses more
            SurvivalCounts.reduce(stats, [0], 10).save(tmp_path / "features" / f"{file_name(uid)}-L{layer}.safetensors")
            ok = _per_row_share(0.9, True)  # the headline definition, read per latent from the per-row sums
            f_ref, _ = stats.firing_rates()
            is_judged = f_ref[0] * stats.totals()["n"][0, 0] >= 20
            share = float(ok(stats, np.arange(stats.n_rows)[None])[0])
            judged[k] += is_judged.sum()
            lost[k] += round((1 - share) * is_judged.sum())
    rows = layer_shares(tmp_path, "smollm2-135m", list(layers))
    assert [r["method"] for r in rows] == [method, method] and rows[0]["instances"] == 2
    assert [r["share_of_judged"] for r in rows] == pytest.approx(judged / judged.sum(), rel=1e-12)
    assert [r["share_of_not_surviving"] for r in rows] == pytest.approx(lost / lost.sum(), rel=1e-12)
    assert lost[1] > lost[0]  # the shares differ, so a swapped layer would show


def test_readings_of_committed_counts_against_numpy_on_the_raw_activations(tmp_path):
    """SurvivalCounts.readings (what notebook 10 reads): each judged latent's rho, rate ratio and rates, from the
    committed totals, equal numpy's Pearson correlation and counts on the raw activations; a latent the quantized
    model never fires has rho NaN and does not survive; latents below 20 reference positions are not listed."""
    g = np.random.default_rng(11)
    n_rows, d_sae = 20, 12
    per_row = [int(x) for x in g.integers(5, 9, n_rows)]
    a = np.maximum(g.normal(0, 1, (sum(per_row), d_sae)) + np.linspace(-2.5, 1.0, d_sae), 0)
    # rho from about 0.8 to 0.98 and some rates more than doubled: each part of the definition decides a latent
    b = np.maximum(a + g.uniform(0.0, 0.6, d_sae) * g.normal(0, 1, a.shape), 0)
    b[:, d_sae - 1] = 0  # the most frequent latent never fires in the quantized model
    row_of = np.repeat(np.arange(n_rows), per_row)
    sums = {name: np.stack([f[row_of == r].sum(0) for r in range(n_rows)])
            for name, f in (("sum_a", a), ("sum_b", b), ("sum_aa", a * a), ("sum_bb", b * b), ("sum_ab", a * b),
                            ("fire_a", a > 0), ("fire_b", b > 0))}
    row, latent = np.nonzero((sums["fire_a"] > 0) | (sums["fire_b"] > 0))
    values = {k: v[row, latent].astype(np.int32 if k.startswith("fire") else np.float64) for k, v in sums.items()}
    stats = LatentRowStats(row=row.astype(np.int32), latent=latent.astype(np.int32), **values,
                           positions=np.asarray(per_row, dtype=np.int64), d_sae=d_sae)
    counts = SurvivalCounts.load(SurvivalCounts.reduce(stats, [0], 10).save(tmp_path / "c.safetensors"))
    got = counts.readings().to_frame()
    judged = [j for j in range(d_sae) if (a[:, j] > 0).sum() >= 20]
    assert got["latent"].tolist() == judged and 0 < len(judged) < d_sae
    for _, r in got.iterrows():
        j = int(r["latent"])
        f_a, f_b = (a[:, j] > 0).mean(), (b[:, j] > 0).mean()
        assert r["rate_reference"] == pytest.approx(f_a, rel=1e-12)
        assert r["rate_quantized"] == pytest.approx(f_b, rel=1e-12, abs=0)
        assert r["rate_ratio"] == pytest.approx(f_b / f_a, rel=1e-12, abs=0)
        if b[:, j].std() == 0:
            assert np.isnan(r["rho"]) and not r["survives"]
            continue
        rho = np.corrcoef(a[:, j], b[:, j])[0, 1]
        # float64 sums of a few hundred O(1) products against numpy's two-pass formula: 1e-9 is many ulps wide
        assert r["rho"] == pytest.approx(rho, rel=1e-9, abs=1e-12)
        assert r["survives"] == bool(rho >= 0.9 and 0.5 <= f_b / f_a <= 2)
    assert 0 < got["survives"].sum() == counts.point()[0] < len(got) - 1  # some survive, some do not
    assert np.isnan(got.set_index("latent").loc[d_sae - 1, "rho"])
    # the one finite-results check: NaN only where documented (rho), nothing else
    from interp.errors import NonFiniteError
    from interp.report.survival.feature_counts import LatentReadings

    bad = got.copy()
    bad.loc[0, "rate_ratio"] = np.nan
    with pytest.raises(NonFiniteError, match="rate_ratio"):
        LatentReadings(bad)


def test_latent_rows_are_reused_only_for_the_same_weights(tmp_path):
    """The working per-row sums are a cache: an instance made again under the same name with other weights (GPTQ
    on another CPU) must be measured, not read from the earlier weights' rows. With the rows keyed by the name
    alone, the second call would return the 2-bit model's counts for the 3-bit one, which the last line refuses."""
    from interp.report.survival.features import latent_survival

    model = interp.tiny_model("llama")
    tokens = torch.randint(0, 256, (6, 24), generator=torch.Generator().manual_seed(3))
    tokens[:, 0] = 256
    rows = interp.Examples.from_tokens(tokens)
    saes = {5: _sae()}
    reg = copy.deepcopy(registration())
    reg["intervals"]["n_boot"] = 20
    reg["intervals"]["boundary"]["mc_seeds"] = [1]
    uid = "gptq:bits=3,group=64@seed61"
    counts = []
    for n, spec in enumerate(["rtn:bits=2,group=32", "rtn:bits=8,group=32"]):
        raw = tmp_path / f"raw{n}"  # the committed file gone, as when an instance is measured again
        (raw / "features").mkdir(parents=True)
        latent_survival(model, quantize(model, spec, progress=False), saes, rows, raw, uid, {}, tmp_path / "work", reg)
        counts.append(SurvivalCounts.load(raw / "features" / f"{file_name(uid)}-L5.safetensors"))
    assert len(list((tmp_path / "work").iterdir())) == 2
    assert counts[0].broken_latents().sum() > counts[1].broken_latents().sum()
