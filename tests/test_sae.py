"""interp's sparse autoencoders (interp.localize.sae*): the registered TopK SAE, SAELens folders, resumable
capture, the hand-written training step, and the quality and latent sums, each against a naive computation.

Tolerances: float64 comparisons use :func:`tolerances.rounding_tol` with the number of roundings in the longer
of the two evaluations (stated at each use); float32 ones likewise with float32's epsilon.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tolerances import EPS32, EPS64, rounding_tol

import interp
from interp.errors import ComponentError, DataError, InterpError, NonFiniteError
from interp.localize import sae_data, sae_train
from interp.localize.sae import JumpReLUSAE, ReLUSAE, TopKSAE, load_sae, sae_site
from interp.localize.sae_data import capture_activations, load_activations, sae_positions
from interp.localize.sae_metrics import QualityRows, latent_row_stats, latent_stats, sae_quality
from interp.localize.sae_train import _gradients, _State, fvu, train_sae
from interp.runtime import hooks as hk

SEP = 257  # the tiny tokenizer's EOS, the separator of packed rows


def _random_sae(d: int, d_sae: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 0,
                hook: str = "blocks.0.hook_resid_post", **extra) -> TopKSAE:
    g = torch.Generator().manual_seed(seed)
    W_dec = torch.nn.functional.normalize(torch.randn(d_sae, d, generator=g, dtype=torch.float64), dim=1)
    return TopKSAE(W_enc=(W_dec.T + 0.3 * torch.randn(d, d_sae, generator=g, dtype=torch.float64)).to(dtype),
                   b_enc=(0.1 * torch.randn(d_sae, generator=g, dtype=torch.float64)).to(dtype),
                   W_dec=W_dec.to(dtype), b_dec=(0.2 * torch.randn(d, generator=g, dtype=torch.float64)).to(dtype),
                   k=k, hook_name=hook, **extra)


def _naive_encode(sae: TopKSAE, x: list[float]) -> list[float]:
    """The registered TopK encoder, one latent at a time in Python floats (float64)."""
    W, b_enc, b_dec = sae.W_enc.double().tolist(), sae.b_enc.double().tolist(), sae.b_dec.double().tolist()
    pre = [sum((x[i] - b_dec[i]) * W[i][j] for i in range(len(x))) + b_enc[j] for j in range(sae.d_sae)]
    kept = sorted(range(sae.d_sae), key=lambda j: -pre[j])[: sae.k]
    return [max(pre[j], 0.0) if j in kept else 0.0 for j in range(sae.d_sae)]


def _naive_decode(sae: TopKSAE, z: list[float]) -> list[float]:
    W, b_dec = sae.W_dec.double().tolist(), sae.b_dec.double().tolist()
    return [sum(z[j] * W[j][i] for j in range(sae.d_sae)) + b_dec[i] for i in range(sae.d_in)]


def _packed_rows(n: int = 4, width: int = 14, seed: int = 0) -> interp.Examples:
    """Rows shaped like load_packed_examples's: BOS, byte tokens, separators between documents."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (n, width), generator=g)
    tokens[:, 0] = 256
    tokens[0, 5] = tokens[1, 3] = tokens[1, 9] = SEP
    if n > 3:
        tokens[3, width - 1] = SEP
    ex = interp.Examples.from_tokens(tokens)
    return interp.Examples(tokens=ex.tokens, texts=ex.texts, ids=ex.ids,
                           settings={"source": "tokens", "packed": True, "separator": SEP})


# ---------------------------------------------------------------------------------------
# The SAE


def test_topk_encode_decode_shapes_and_exactly_k():
    sae = _random_sae(8, 20, 3)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    z = sae.encode(x)
    assert z.shape == (2, 5, 20) and sae.decode(z).shape == (2, 5, 8)
    assert int((z != 0).sum(-1).max()) <= 3
    # with every pre-activation positive, exactly k latents fire, and they are the k largest
    shifted = TopKSAE(W_enc=sae.W_enc, b_enc=sae.b_enc + 100.0, W_dec=sae.W_dec, b_dec=sae.b_dec, k=3)
    z = shifted.encode(x)
    assert (z != 0).sum(-1).eq(3).all()
    pre = shifted.pre_activations(x)
    assert torch.equal(z.topk(3, dim=-1).values, pre.topk(3, dim=-1).values)
    values, indices = shifted.encode_sparse(x)
    assert values.shape == (2, 5, 3) and (indices.diff(dim=-1) > 0).all()
    assert torch.equal(torch.zeros_like(z).scatter_(-1, indices, values), z)
    # the sparse decoder sums the same k rows as the dense one: within float32 rounding of k + 1 terms
    scale = float((values.abs().unsqueeze(-1) * shifted.W_dec[indices].abs()).sum(-2).max() + shifted.b_dec.abs().max())
    assert float((shifted.decode_sparse(values, indices) - shifted.decode(z)).abs().max()) <= rounding_tol(
        2 * (3 + 1), scale, EPS32)


def test_topk_matches_the_registered_formula_in_float64():
    sae = _random_sae(6, 10, 2, torch.float64)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for row in x:
        z = _naive_encode(sae, row.tolist())
        # d + 1 roundings per pre-activation and per decoded value, in each of the two evaluations
        assert np.allclose(sae.encode(row).numpy(), z, rtol=0, atol=rounding_tol(2 * (6 + 2), 10.0, EPS64))
        assert np.allclose(sae.decode(torch.tensor(z, dtype=torch.float64)).numpy(), _naive_decode(sae, z), rtol=0,
                           atol=rounding_tol(2 * (10 + 2), 10.0, EPS64))


def test_sae_refuses_bad_shapes_and_k():
    sae = _random_sae(8, 20, 3)
    with pytest.raises(DataError, match="W_dec"):
        TopKSAE(W_enc=sae.W_enc, b_enc=sae.b_enc, W_dec=sae.W_dec.T, b_dec=sae.b_dec, k=3)
    with pytest.raises(DataError, match="k must be"):
        TopKSAE(W_enc=sae.W_enc, b_enc=sae.b_enc, W_dec=sae.W_dec, b_dec=sae.b_dec, k=21)


def test_sae_site_names_the_hook_and_refuses_others(tiny_llama):
    assert sae_site(tiny_llama, _random_sae(64, 8, 2, hook="blocks.1.hook_resid_post")) == ("resid_post", 1)
    with pytest.raises(ComponentError, match="not a hook point"):
        sae_site(tiny_llama, _random_sae(64, 8, 2, hook="blocks.1.attn.hook_pattern"))
    with pytest.raises(ComponentError, match="layer"):
        sae_site(tiny_llama, _random_sae(64, 8, 2, hook="blocks.7.hook_resid_post"))
    with pytest.raises(ComponentError, match="wide"):
        sae_site(tiny_llama, _random_sae(32, 8, 2, hook="blocks.1.hook_resid_post"))


# ---------------------------------------------------------------------------------------
# SAELens folders


def test_saelens_round_trip_is_identical(tmp_path):
    g = torch.Generator().manual_seed(3)
    top = _random_sae(8, 20, 3, scale=1.7, settings={"model": "tiny", "training": {"epochs": [1]}})
    jump = JumpReLUSAE(W_enc=top.W_enc, b_enc=top.b_enc, W_dec=top.W_dec, b_dec=top.b_dec,
                       threshold=torch.rand(20, generator=g), hook_name="blocks.1.hook_resid_post",
                       apply_b_dec_to_input=False)
    relu = ReLUSAE(W_enc=top.W_enc, b_enc=top.b_enc, W_dec=top.W_dec, b_dec=top.b_dec,
                   hook_name="blocks.0.hook_mlp_out")
    x = torch.randn(7, 8, generator=g)
    for i, sae in enumerate((top, jump, relu)):
        back = load_sae(sae.save(tmp_path / f"sae{i}"))
        assert type(back) is type(sae) and back.hook_name == sae.hook_name and back.scale == sae.scale
        assert back.apply_b_dec_to_input == sae.apply_b_dec_to_input and back.settings == sae.settings
        for name, value in sae._tensors().items():
            assert torch.equal(getattr(back, name), value), name
        assert torch.equal(back.encode(x), sae.encode(x)) and torch.equal(back.reconstruct(x), sae.reconstruct(x))
    cfg = json.loads((tmp_path / "sae0" / "cfg.json").read_text())
    assert (cfg["architecture"], cfg["d_in"], cfg["d_sae"], cfg["k"], cfg["activation_fn_kwargs"]) == \
        ("topk", 8, 20, 3, {"k": 3})
    assert cfg["hook_name"] == "blocks.0.hook_resid_post" and cfg["interp"]["input_scale"] == 1.7
    assert cfg["normalize_activations"] == "none"


def _write_saelens(folder, cfg, tensors):
    folder.mkdir()
    (folder / "cfg.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "sae_weights.safetensors"))
    return folder


def _jumprelu_folder(tmp_path, name="jump", **changes):
    g = torch.Generator().manual_seed(4)
    tensors = {"W_enc": torch.randn(6, 10, generator=g), "W_dec": torch.randn(10, 6, generator=g),
               "b_enc": torch.randn(10, generator=g), "b_dec": torch.randn(6, generator=g),
               "threshold": torch.rand(10, generator=g)}
    # as SAELens 6 writes it: the hook name in "metadata", "k"-less, a published SAE that keeps b_dec out
    cfg = {"architecture": "jumprelu", "d_in": 6, "d_sae": 10, "dtype": "float32", "device": "cpu",
           "apply_b_dec_to_input": False, "normalize_activations": "none", "reshape_activations": "none",
           "metadata": {"hook_name": "blocks.1.hook_resid_post", "model_name": "somebody's model",
                        "sae_lens_version": "6.5.0"}}
    cfg.update(changes.pop("cfg", {}))
    tensors.update(changes.pop("tensors", {}))
    for key in changes.pop("drop", ()):
        cfg.pop(key, None)
        tensors.pop(key, None)
    return _write_saelens(tmp_path / name, cfg, tensors), tensors


def test_loads_a_hand_written_saelens_jumprelu_folder(tmp_path):
    folder, t = _jumprelu_folder(tmp_path)
    sae = load_sae(folder)
    assert isinstance(sae, JumpReLUSAE) and sae.hook_name == "blocks.1.hook_resid_post" and sae.scale == 1.0
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    pre = x @ t["W_enc"].double() + t["b_enc"].double()  # no b_dec subtracted (apply_b_dec_to_input false)
    z = torch.where(pre > t["threshold"].double(), pre, torch.zeros_like(pre))
    got = sae.to(dtype=torch.float64).encode(x)
    assert torch.equal(got > 0, z > 0)
    assert float((got - z).abs().max()) <= rounding_tol(6 + 2, float(pre.abs().max()) + 1, EPS64)
    assert torch.allclose(sae.to(dtype=torch.float64).decode(z), z @ t["W_dec"].double() + t["b_dec"].double(),
                          rtol=0, atol=rounding_tol(10 + 2, float(z.abs().sum(1).max() + 1) * 4, EPS64))


def test_loads_a_pre_6_saelens_topk_folder(tmp_path):
    g = torch.Generator().manual_seed(6)
    tensors = {"W_enc": torch.randn(6, 10, generator=g), "W_dec": torch.randn(10, 6, generator=g),
               "b_enc": torch.randn(10, generator=g), "b_dec": torch.randn(6, generator=g),
               "scaling_factor": torch.ones(10)}
    cfg = {"architecture": "standard", "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 4}, "d_in": 6,
           "d_sae": 10, "hook_point": "blocks.0.hook_resid_pre", "hook_layer": 0, "normalize_activations": False}
    sae = load_sae(_write_saelens(tmp_path / "old", cfg, tensors))  # a unit scaling_factor, no normalisation
    assert isinstance(sae, TopKSAE) and sae.k == 4 and sae.hook_name == "blocks.0.hook_resid_pre"
    cfg["normalize_activations"] = True  # what SAELens reads as "expected_average_only_in"
    with pytest.raises(DataError, match="normalize_activations"):
        load_sae(_write_saelens(tmp_path / "scaled", cfg, tensors))


@pytest.mark.parametrize("change, error, words", [
    ({"drop": ["d_in"]}, DataError, '"d_in" is missing'),
    ({"cfg": {"d_sae": "10"}}, DataError, '"d_sae" must be an integer'),
    ({"cfg": {"architecture": "gated"}}, DataError, "architecture 'gated'"),
    ({"cfg": {"normalize_activations": "expected_average_only_in"}}, DataError, "normalize_activations"),
    ({"cfg": {"d_sae": 11}}, DataError, "d_sae 11"),
    ({"drop": ["metadata"]}, DataError, "no hook point"),
    ({"drop": ["threshold"]}, DataError, "missing \\['threshold'\\]"),
    ({"tensors": {"extra": torch.zeros(2)}}, DataError, "unexpected \\['extra'\\]"),
    ({"tensors": {"b_enc": torch.zeros(9)}}, DataError, "b_enc must be a float tensor of shape \\[10\\]"),
    ({"tensors": {"W_dec": torch.full((10, 6), math.nan)}}, NonFiniteError, "NaN"),
    ({"tensors": {"b_dec": torch.zeros(6, dtype=torch.int32)}}, DataError, "int32"),
])
def test_bad_saelens_folders_are_refused_in_interps_words(tmp_path, change, error, words):
    folder, _ = _jumprelu_folder(tmp_path, **change)
    with pytest.raises(error, match=words):
        load_sae(folder)


def test_missing_or_foreign_files_are_refused(tmp_path):
    with pytest.raises(DataError, match="cfg.json"):
        load_sae(tmp_path)
    folder, _ = _jumprelu_folder(tmp_path)
    (folder / "cfg.json").write_text("[1, 2]")
    with pytest.raises(DataError, match="JSON object"):
        load_sae(folder)
    (folder / "cfg.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        load_sae(folder)
    with pytest.raises(DataError, match="not a folder"):
        load_sae(folder / "sae_weights.safetensors")


# ---------------------------------------------------------------------------------------
# Capture


def test_sae_positions_leave_out_bos_separators_and_padding():
    tokens = torch.tensor([[256, 5, SEP, 6, 7], [256, 8, 9, SEP, 0]])
    keep = sae_positions(tokens, torch.tensor([5, 4]), SEP)
    assert keep.tolist() == [[False, True, False, True, True], [False, True, True, False, False]]


def test_capture_is_resumable_and_gives_the_same_bytes(tiny_llama, tmp_path, monkeypatch):
    rows = _packed_rows(n=5)
    whole = capture_activations(tiny_llama, rows, [0, 1], tmp_path / "whole", batch_size=2, rows_per_shard=2)
    real_write, written = sae_data.write_safetensors, []

    class Killed(Exception):
        pass

    def dies_on_the_third(path, tensors, metadata=None):
        if len(written) == 2:
            raise Killed
        written.append(path)
        return real_write(path, tensors, metadata)

    monkeypatch.setattr(sae_data, "write_safetensors", dies_on_the_third)
    with pytest.raises(Killed):
        capture_activations(tiny_llama, rows, [0, 1], tmp_path / "killed", batch_size=2, rows_per_shard=2)
    assert (tmp_path / "killed" / "INCOMPLETE").exists()
    with pytest.raises(DataError, match="incomplete"):
        load_activations(tmp_path / "killed", 0)
    monkeypatch.setattr(sae_data, "write_safetensors", real_write)
    resumed = capture_activations(tiny_llama, rows, [0, 1], tmp_path / "killed", batch_size=2, rows_per_shard=2)
    names = sorted(p.name for p in whole.iterdir() if p.name.startswith(("shard-", "capture")))
    assert names == ["capture.json", "shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    for name in names:
        assert (resumed / name).read_bytes() == (whole / name).read_bytes(), name
    with pytest.raises(DataError, match="other settings"):
        capture_activations(tiny_llama, rows, [0, 1], tmp_path / "killed", batch_size=1, rows_per_shard=2)


def test_captured_values_are_the_residuals_at_sae_positions(tiny_llama, tmp_path):
    rows = _packed_rows(n=4)
    acts = load_activations(capture_activations(tiny_llama, rows, [1], tmp_path / "c", dtype="float32"), 1)
    from interp.runtime.capture import capture

    with torch.no_grad():
        saved, _ = capture(tiny_llama, rows.tokens, [("resid_post", 1)])
    full = saved[("resid_post", 1)]
    keep = sae_positions(rows.tokens, None, SEP)
    assert torch.equal(acts.values, full[keep]) and acts.values.dtype == torch.float32
    assert (acts.positions > 0).all() and (rows.tokens[acts.rows.long(), acts.positions.long()] != SEP).all()
    some = load_activations(tmp_path / "c", 1, rows=[1, 3])
    assert torch.equal(some.values, full[keep & torch.tensor([False, True, False, True])[:, None]])
    with pytest.raises(DataError, match="not layer 0"):
        load_activations(tmp_path / "c", 0)


# ---------------------------------------------------------------------------------------
# Training


def _state(seed: int, n: int, d: int) -> _State:
    g = torch.Generator().manual_seed(seed)
    W_dec = torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)
    return _State(W_encT=torch.randn(n, d, generator=g, dtype=torch.float64),
                  b_enc=0.1 * torch.randn(n, generator=g, dtype=torch.float64), W_dec=W_dec,
                  b_dec=torch.randn(d, generator=g, dtype=torch.float64), m={}, v={},
                  since_fired=torch.zeros(n, dtype=torch.long))


@pytest.mark.parametrize("n_dead", [0, 4, 9])  # no AuxK term; every dead latent kept (4 <= k_aux); top k_aux of 9
def test_hand_written_gradients_match_autograd_with_the_projection(n_dead):
    B, d, n, k, k_aux = 16, 8, 24, 3, 5
    state = _state(0, n, d)
    x = torch.randn(B, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dead = torch.zeros(n, dtype=torch.bool)
    dead[torch.randperm(n, generator=torch.Generator().manual_seed(2))[:n_dead]] = True
    grads, mse, aux, fired = _gradients(state, x, k, dead, k_aux, 1 / 32)
    # the naive computation: dense latents, autograd, then the projection written out
    p = {name: t.clone().requires_grad_(True) for name, t in state.params().items()}
    pre = (x - p["b_dec"]) @ p["W_encT"].T + p["b_enc"]
    top = pre.topk(k, dim=1)
    recon = torch.zeros_like(pre).scatter(1, top.indices, top.values.relu()) @ p["W_dec"] + p["b_dec"]
    loss = (recon - x).square().sum(1).mean()
    naive_aux = torch.zeros(())
    if n_dead:
        dead_top = pre.masked_fill(~dead, -math.inf).topk(min(k_aux, n_dead), dim=1)
        z_aux = torch.zeros_like(pre).scatter(1, dead_top.indices, dead_top.values.relu())
        naive_aux = (z_aux @ p["W_dec"] - (x - recon).detach()).square().sum(1).mean()
    (loss + naive_aux / 32).backward()
    g_dec = p["W_dec"].grad
    g_dec = g_dec - (g_dec * state.W_dec).sum(1, keepdim=True) * state.W_dec
    # each entry sums at most B products of sums of at most d + n terms: B (d + n + 4) roundings, and values of
    # magnitude at most the largest gradient times B
    for name, naive in (("W_encT", p["W_encT"].grad), ("b_enc", p["b_enc"].grad), ("W_dec", g_dec),
                        ("b_dec", p["b_dec"].grad)):
        tol = rounding_tol(B * (d + n + 4), B * float(naive.abs().max()), EPS64)
        assert float((grads[name] - naive).abs().max()) <= tol, name
    assert abs(mse - float(loss)) <= rounding_tol(B * d, float(loss) * 2, EPS64)
    assert abs(aux - float(naive_aux)) <= rounding_tol(B * (d + k_aux), float(naive_aux) * 2 + 1e-300, EPS64)
    assert float((grads["W_dec"] * state.W_dec).sum(1).abs().max()) <= rounding_tol(
        2 * d + 4, float(grads["W_dec"].abs().max()), EPS64)  # nothing left along a decoder row
    assert torch.equal(fired, torch.zeros(n, dtype=torch.bool).index_fill(0, top.indices[top.values > 0], True))


def test_decoder_rows_stay_unit_norm_through_steps():
    state = _state(3, 24, 8)
    state = _State(**{k: v.float() for k, v in state.params().items()},
                   m={k: torch.zeros_like(v).float() for k, v in state.params().items()},
                   v={k: torch.zeros_like(v).float() for k, v in state.params().items()},
                   since_fired=state.since_fired)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(4))
    for _ in range(5):
        grads = _gradients(state, x, 3, None, 5, 1 / 32)[0]
        sae_train._adam(state, grads, 1e-2, (0.9, 0.999), 1e-8)
    # a float32 row norm of d squares, then one division: within (d + 4) float32 roundings of 1
    assert float((state.W_dec.double().norm(dim=1) - 1).abs().max()) <= rounding_tol(8 + 4, 1.0, EPS32)


def _dictionary_data(seed: int, n: int, d: int = 32, atoms: int = 48, active: int = 3):
    g = torch.Generator().manual_seed(seed)
    D = torch.nn.functional.normalize(torch.randn(atoms, d, generator=torch.Generator().manual_seed(99)), dim=1)
    chosen = torch.rand(n, atoms, generator=g).argsort(1)[:, :active]
    z = torch.zeros(n, atoms).scatter_(1, chosen, 1 + 2 * torch.rand(n, active, generator=g))
    return (z @ D + 0.5).half(), D


def test_training_recovers_a_known_sparse_dictionary():
    train, D = _dictionary_data(0, 12_000)
    validation, _ = _dictionary_data(1, 2_000)
    sae, log = train_sae(train, validation, latents=64, k=3, batch_size=256, hook_name="blocks.0.hook_resid_post",
                         progress=False)
    # a random 64-latent SAE explains ~40% of the variance; the rule must find the 48 directions
    assert log.initial_val_fvu > 0.4 and log.epochs[-1]["val_fvu"] < 0.15, log.epochs
    cosines = (torch.nn.functional.normalize(sae.W_dec, dim=1) @ D.T).max(0).values
    assert float((cosines > 0.9).float().mean()) >= 0.75
    assert fvu(sae, validation)[0] == log.epochs[-1]["val_fvu"]
    # the scale folded in: unit directions in the scaled space, c = sqrt(d / mean ||x||^2)
    assert sae.scale == pytest.approx(math.sqrt(32 / float(train.double().square().sum(1).mean())), rel=1e-12)
    assert float((sae.directions.double().norm(dim=1) - 1).abs().max()) <= rounding_tol(32 + 8, 1.0, EPS32)
    assert log.stopped and len(log.epochs) <= 10


def test_training_resumes_after_a_kill_and_gives_the_same_sae(tmp_path, monkeypatch):
    train, _ = _dictionary_data(2, 3_000)
    validation, _ = _dictionary_data(3, 500)
    run = {"latents": 32, "k": 3, "batch_size": 128, "max_epochs": 3, "progress": False}
    whole, whole_log = train_sae(train, validation, **run, checkpoint=tmp_path / "whole")
    real_save, saves = sae_train._save_state, []

    def dies_on_the_second(folder, state, log, epoch):
        if saves:
            raise KeyboardInterrupt
        saves.append(epoch)
        real_save(folder, state, log, epoch)

    monkeypatch.setattr(sae_train, "_save_state", dies_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        train_sae(train, validation, **run, checkpoint=tmp_path / "killed")
    assert (tmp_path / "killed" / "INCOMPLETE").exists()
    monkeypatch.setattr(sae_train, "_save_state", real_save)
    resumed, log = train_sae(train, validation, **run, checkpoint=tmp_path / "killed")
    for name, value in whole._tensors().items():
        assert torch.equal(getattr(resumed, name), value), name
    drop = [{k: v for k, v in e.items() if k != "seconds"} for e in whole_log.epochs]
    assert [{k: v for k, v in e.items() if k != "seconds"} for e in log.epochs] == drop
    assert json.loads((tmp_path / "killed" / "training_log.json").read_text())["stopped"] == log.stopped
    with pytest.raises(DataError, match="another SAE or data"):
        train_sae(train, validation, **{**run, "k": 4}, checkpoint=tmp_path / "killed")


def test_training_refuses_bad_data():
    with pytest.raises(DataError, match="one width"):
        train_sae(torch.ones(10, 4), torch.ones(3, 5), latents=8, k=2)
    with pytest.raises(InterpError, match="cannot exceed"):
        train_sae(torch.ones(10, 4), torch.ones(3, 4), latents=8, k=9)
    with pytest.raises(DataError, match="all zero"):
        train_sae(torch.zeros(10, 4), torch.ones(3, 4), latents=8, k=2)


# ---------------------------------------------------------------------------------------
# Quality and latent statistics


def _naive_quality(model, sae: TopKSAE, rows: interp.Examples, layer: int):
    """FVU, L0, dead share and CE recovered by loops over rows and positions, on the Hugging Face model itself."""
    native = hk.native_model(model)
    xs, hats, zs, nll = [], [], [], {"clean": [], "sae": [], "zero": []}
    for tokens in rows.tokens:
        keep = [t > 0 and int(tokens[t]) != SEP for t in range(len(tokens))]
        with torch.no_grad():
            hidden = native(input_ids=tokens[None], output_hidden_states=True).hidden_states[layer + 1][0]
        new = {"clean": None, "sae": hidden.clone(), "zero": hidden.clone()}
        for t in (t for t in range(len(tokens)) if keep[t]):
            z = _naive_encode(sae, hidden[t].tolist())
            x_hat = _naive_decode(sae, z)
            xs.append(hidden[t].tolist())
            hats.append(x_hat)
            zs.append(z)
            new["sae"][t] = torch.tensor(x_hat, dtype=hidden.dtype)
            new["zero"][t] = 0
        for kind, value in new.items():
            def replace(module, args, output, value=value):
                if value is None:
                    return output
                return (value[None], *output[1:]) if isinstance(output, tuple) else value[None]

            handle = native.model.layers[layer].register_forward_hook(replace)
            try:
                with torch.no_grad():
                    logits = native(input_ids=tokens[None]).logits[0].double()
            finally:
                handle.remove()
            logp = torch.log_softmax(logits, dim=-1)
            nll[kind] += [-float(logp[t, tokens[t + 1]]) for t in range(len(tokens) - 1)]
    x, x_hat, z = np.array(xs), np.array(hats), np.array(zs)
    fvu_ = ((x - x_hat) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()
    ce = {kind: np.mean(values) for kind, values in nll.items()}
    return {"fvu": fvu_, "l0": (z > 0).sum(1).mean(), "dead_share": ((z > 0).sum(0) == 0).mean(),
            "ce_recovered": (ce["zero"] - ce["sae"]) / (ce["zero"] - ce["clean"]),
            "ce_increase": ce["sae"] - ce["clean"]}


def test_quality_matches_naive_loops_in_float64(model64):
    rows = _packed_rows(n=3, width=10)
    sae = _random_sae(64, 24, 3, torch.float64, hook="blocks.0.hook_resid_post")
    # sized to this model's layer-0 residual (norm ~0.2), with a shift that leaves some kept pre-activations
    # negative (L0 below k) and some latents dead
    sae = TopKSAE(W_enc=5 * sae.W_enc, b_enc=0.1 * sae.b_enc - 0.5, W_dec=0.2 * sae.W_dec, b_dec=0.05 * sae.b_dec,
                  k=3, hook_name=sae.hook_name)
    got = sae_quality(model64, sae, rows, batch_size=2)
    naive = _naive_quality(model64, sae, rows, 0)
    values = got.values()
    assert 0 < values["l0"] < 3 and 0 < values["dead_share"] < 1
    # float64 throughout; a forward of this model chains well under 10^4 roundings of values below 10^2
    for name, expected in naive.items():
        assert abs(values[name] - expected) <= rounding_tol(10**4, 100 * (1 + abs(expected)), EPS64), name
    # a resample of the rows is the metric of the rows concatenated
    pick = np.array([[2, 0, 2]])
    again = _naive_quality(model64, sae, rows.subset([2, 0, 2]), 0)
    for name in ("fvu", "l0", "ce_recovered"):
        assert abs(got.metric(name, pick)[0] - again[name]) <= rounding_tol(10**4, 100 * (1 + abs(again[name])),
                                                                            EPS64), name
    assert got.metric("dead_share", pick)[0] == again["dead_share"]


def test_quality_rows_splice_from_the_layer_as_a_full_forward(tiny_llama, tmp_path, monkeypatch):
    from interp.localize import sae_metrics

    rows = _packed_rows(n=4, width=12)
    sae = _random_sae(64, 32, 4, hook="blocks.0.hook_resid_post")
    got = sae_quality(tiny_llama, sae, rows, batch_size=2)

    class HooksOnly(sae_metrics._Splicer):  # every splice a full forward with a hook
        def __init__(self, model, site):
            super().__init__(model, site)
            self.runner = None

    monkeypatch.setattr(sae_metrics, "_Splicer", HooksOnly)
    full = sae_quality(tiny_llama, sae, rows, batch_size=2)
    # the same float32 blocks from the same residual, called two ways: a few roundings of each logit apart
    for name in ("nll_sae", "nll_zero", "nll_clean"):
        assert np.allclose(getattr(got, name), getattr(full, name), rtol=rounding_tol(10**3, 1.0, EPS32), atol=0)
    back = QualityRows.load(got.save(tmp_path / "quality.safetensors"))
    assert back.values() == got.values() and back.settings == got.settings


def test_latent_sums_give_the_naive_pearson_and_firing_rates():
    g = torch.Generator().manual_seed(7)
    sae = _random_sae(8, 16, 3, torch.float64)
    a = torch.randn(40, 8, generator=g, dtype=torch.float64)
    b = a + 0.3 * torch.randn(40, 8, generator=g, dtype=torch.float64)
    rows = torch.arange(40) // 10  # 4 rows of 10 positions
    stats = latent_row_stats(sae, a, b, rows)
    za, zb = sae.encode(a).numpy(), sae.encode(b).numpy()
    assert stats.row.size == int(((za > 0) | (zb > 0)).reshape(4, 10, 16).any(1).sum())  # only pairs that fire
    for pick in (np.arange(4)[None], np.array([[3, 3, 0, 1]])):
        idx = np.concatenate([np.arange(10 * r, 10 * r + 10) for r in pick[0]])
        rho = stats.correlation(pick)[0]
        fa, fb = stats.firing_rates(pick)
        for j in range(16):
            x, y = za[idx, j], zb[idx, j]
            assert fa[0, j] == (x > 0).mean() and fb[0, j] == (y > 0).mean()
            if x.std() == 0 or y.std() == 0:
                assert math.isnan(rho[j])
            else:  # sums of 40 products, then a square root: 3 x 40 roundings of values below 10^2
                assert abs(rho[j] - np.corrcoef(x, y)[0, 1]) <= rounding_tol(120, 100.0, EPS64) / (x.std() * y.std())


def test_latent_stats_of_a_model_against_itself(tiny_llama, tmp_path):
    rows = _packed_rows(n=3, width=12)
    sae = _random_sae(64, 32, 4, hook="blocks.1.hook_resid_post")
    stats = latent_stats(sae, tiny_llama, tiny_llama, rows, batch_size=2)
    rho = stats.correlation()[0]
    fired = ~np.isnan(rho)
    assert fired.sum() > 0 and np.allclose(rho[fired], 1.0, rtol=0, atol=1e-12)
    fa, fb = stats.firing_rates()
    assert np.array_equal(fa, fb) and stats.positions.tolist() == [10, 9, 11]
    back = type(stats).load(stats.save(tmp_path / "latents.safetensors"))
    assert np.array_equal(back.sum_ab, stats.sum_ab) and back.d_sae == 32


def test_latent_stats_layers_match_one_sae_at_a_time(tiny_llama):
    """Several SAEs from one forward of the other model, and the reference captured once and reused, give each
    SAE's statistics exactly as :func:`latent_stats` does alone (same activations, same sums, in float64)."""
    import interp
    from interp.localize.sae_metrics import held_out_activations, latent_stats_layers

    rows = _packed_rows(n=5, width=12)
    other = interp.tiny_model("llama", seed=1)  # same shapes, other weights: latents move
    saes = [_random_sae(64, 32, 4, hook="blocks.0.hook_resid_post"),
            _random_sae(64, 48, 4, hook="blocks.1.hook_resid_post")]
    alone = [latent_stats(sae, tiny_llama, other, rows, batch_size=2) for sae in saes]
    captured = held_out_activations(tiny_llama, saes, rows, batch_size=2)
    for reference in (tiny_llama, captured):
        together = latent_stats_layers(saes, reference, other, rows, batch_size=2)
        for one, both in zip(alone, together, strict=True):
            assert one.d_sae == both.d_sae and np.array_equal(one.positions, both.positions)
            for name in ("row", "latent", "sum_a", "sum_b", "sum_aa", "sum_bb", "sum_ab", "fire_a", "fire_b"):
                assert np.array_equal(getattr(one, name), getattr(both, name)), name
    assert not np.allclose(alone[1].sum_a, alone[1].sum_b)  # the two models differ, so the test can see a mix-up
    with pytest.raises(DataError, match="batch size 2"):
        latent_stats_layers(saes, captured, other, rows, batch_size=3)
    with pytest.raises(DataError, match="sites"):
        latent_stats_layers(saes[:1], captured, other, rows, batch_size=2)
