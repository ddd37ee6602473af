"""GPTQ and AWQ on every decoder family of tests/test_families.py, fused and Conv1D layers included.

The families' tiny random models (2 layers, d_model 64, d_mlp 128) are the ones
tests/test_families.py builds and saves; its fixtures are imported from there. Phi-3 keeps
q, k, v in one ``qkv_proj`` and gate, up in one ``gate_up_proj`` (each role a block of rows
of the fused weight), GPT-NeoX interleaves q, k, v per head in ``query_key_value``, and GPT-2
stores its ``Conv1D`` weights transposed, ``[in, out]``; the quantizers see each role as its
own ``[out, in]`` matrix (:func:`interp.runtime.hooks.linear_weights`).

For each family and method the checks are computed here, from the weights, not by the
quantizer's code:

* grid: in every quantized linear, each (output row, group of ``GROUP`` inputs) holds at most
  ``2^bits`` distinct values. GPTQ's values are the grid's points themselves, so they are
  counted exactly. AWQ folds its per-input-channel scale ``s`` back into the weight
  (``W_hat = RTN(W diag s) diag(1/s)``), so its grid lives in the scaled space: ``W_hat[:, i] * s_i``
  with ``s = mean|x|^alpha`` recomputed here from the layer's calibration inputs for each alpha
  AWQ tries; for one alpha every group must hold at most ``2^bits`` levels, values closer than
  1e-3 of a grid step counting as one (undoing ``/ s`` in float32 moves a value by ~1e-7 of
  itself; distinct levels are a whole step apart).
* every quantized weight changed, every other parameter (embeddings, norms, biases) is
  unchanged to the bit, and the quantized model's NLL is finite;
* ``score`` runs the spec through the disk cache and gives a finite error for every example.

Also: the calibration inputs that quantize reads for every block and group equal the
activations at the same hook points in one full forward of the model. A feeder that reused
the first block's attention mask for every block gave Gemma-2's full-attention layers the
sliding-window mask; this check caught it.

Last, ``restore_layers(..., roles=...)`` on fused weights: a role is its block of rows of the
fused weight (Phi-3's q/k/v rows of ``qkv_proj``, gate/up halves of ``gate_up_proj``, with the
row blocks taken from the config here), and only those rows are restored.
"""

from __future__ import annotations

import math

import pytest
import test_families
import torch

import interp
from interp.errors import ComponentError
from interp.quant import apply as qa
from interp.runtime import hooks as hk

# tests/test_families.py's families and module fixtures (the saved folders, the loaded models, one thread)
FAMILIES = test_families.FAMILIES
folders, models, _one_thread = test_families.folders, test_families.models, test_families._one_thread

GROUP = 32  # divides every tiny width: d_model 64, n_heads * d_head 64, d_mlp 128
SPECS = {"gptq": "gptq:bits=3,group=32", "awq": "awq:bits=4,group=32,grid=5"}
BITS = {"gptq": 3, "awq": 4}


@pytest.fixture(scope="module")
def calibration():
    tokens = torch.randint(0, 256, (6, 24), generator=torch.Generator().manual_seed(1))
    tokens[:, 0] = 256  # BOS
    return interp.Examples.from_tokens(tokens)


@pytest.fixture(scope="module")
def held_out():
    tokens = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(2))
    tokens[:, 0] = 256
    return interp.Examples.from_tokens(tokens)


@pytest.fixture(scope="module")
def quantized(models, calibration):
    """``(qmodel, inputs)`` per (family, method); ``inputs[(layer, role)]``: the float32 calibration inputs it read."""
    cache: dict[tuple[str, str], tuple[object, dict]] = {}

    def get(family: str, method: str):
        if (family, method) not in cache:
            inputs: dict[tuple[int, str], torch.Tensor] = {}
            original = qa._quantize_group

            def record(slots, roles, layer, spec, layer_inputs, info):
                for role in roles:  # a first block quantized twice (the re-run fallback) keeps the last
                    inputs[(layer, role)] = layer_inputs.X
                return original(slots, roles, layer, spec, layer_inputs, info)

            qa._quantize_group = record
            try:
                qmodel = qa.quantize(models(family), SPECS[method], calibration=calibration, progress=False)
            finally:
                qa._quantize_group = original
            cache[(family, method)] = (qmodel, inputs)
        return cache[(family, method)]

    return get


def _levels(values: torch.Tensor, tolerance: torch.Tensor) -> torch.Tensor:
    """Distinct values along the last axis, neighbours within ``tolerance`` (broadcast) counting as one."""
    ordered = values.sort(dim=-1).values
    gaps = ordered.diff(dim=-1)
    return 1 + (gaps > tolerance).sum(dim=-1)


def _grid_levels(weight: torch.Tensor, bits: int, scale: torch.Tensor | None = None) -> int:
    """The most levels any (row, group) of ``weight [out, in]`` holds (in the space scaled by ``scale [in]``)."""
    w = weight.double() if scale is None else weight.double() * scale.double()
    groups = w.reshape(w.shape[0], -1, GROUP)
    if scale is None:  # exact: the grid's points themselves
        return max(len(torch.unique(g)) for g in groups.reshape(-1, GROUP))
    step = (groups.amax(-1) - groups.amin(-1)) / (2**bits - 1)
    return int(_levels(groups, 1e-3 * step[..., None]).max())


def _awq_levels(weight: torch.Tensor, X: torch.Tensor, bits: int, grid: int = 5) -> int:
    """The fewest levels per group over AWQ's alphas, with ``s = mean|x|^alpha`` (its floor for silent channels)."""
    magnitude = X.double().abs().mean(0)
    base = magnitude.clamp(min=float(magnitude.max()) * 1e-6)
    return min(_grid_levels(weight, bits, base**alpha) for alpha in torch.linspace(0, 1, grid).tolist())


@pytest.mark.parametrize("method", list(SPECS))
@pytest.mark.parametrize("family", FAMILIES)
def test_quantize_every_family(family, method, models, quantized, held_out, calibration, tmp_path):
    from interp.quant.store import score

    model = models(family)
    qmodel, inputs = quantized(family, method)
    bits = BITS[method]
    written: set[int] = set()
    for layer in range(hk.n_layers(model)):
        reference_slots, slots = hk.linear_weights(model, layer), hk.linear_weights(qmodel, layer)
        assert reference_slots.keys() == slots.keys()
        for role, slot in slots.items():
            weight, original = slot.read().detach(), reference_slots[role].read().detach()
            assert weight.shape == original.shape and not torch.equal(weight, original), (layer, role)
            if method == "gptq":
                levels = _grid_levels(weight, bits)
            else:
                levels = _awq_levels(weight, inputs[(layer, role)], bits)
            assert levels <= 2**bits, (layer, role, levels)
            written.add(id(slot.module.weight))
            written.update(id(mirror) for mirror in slot.mirrors)
    # everything else as it was: embeddings, norms, biases, the unembedding
    reference_params = dict(model.named_parameters())
    for name, param in qmodel.named_parameters():
        if id(param) not in written:
            assert torch.equal(param, reference_params[name]), name
    assert torch.isfinite(interp.nll(qmodel, held_out)).all()
    table = score(model, [SPECS[method]], held_out, tmp_path / "store", calibration=calibration,
                  cache_dir=tmp_path / "q", progress=False)
    values = torch.tensor(table.to_numpy(dtype=float))
    assert values.shape[0] == len(held_out) and torch.isfinite(values).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_calibration_inputs_are_the_full_forwards(family, models, calibration):
    """What the feeder hands the quantizers for each block and group = one full forward's activations there."""
    from interp.quant.calibration import LayerFeeder

    model = models(family)
    feeder = LayerFeeder(model, calibration.tokens, batch_size=4)
    if family == "gemma2":  # sliding-window and full-attention blocks alternate: each gets its own mask
        assert feeder.kinds == ["sliding_attention", "full_attention"]
    groups = [[r for r in g if r in hk.linear_weights(model, 0)] for g in qa.SHARED_INPUT_GROUPS]
    names = {(layer, roles[0]): hk.linear_input_hook(model, layer, roles[0])
             for layer in range(hk.n_layers(model)) for roles in groups if roles}
    seen: dict[str, torch.Tensor] = {}

    def keeper(name):
        def keep(x, hook):
            seen[name] = x.detach().reshape(x.shape[0] * x.shape[1], -1).float()
        return keep

    with torch.no_grad(), model.hooks(fwd_hooks=[(name, keeper(name)) for name in names.values()]):
        model(calibration.tokens)
    for layer in range(hk.n_layers(model)):
        for roles in groups:
            if roles:
                got, expected = feeder.inputs(layer, roles[0]), seen[names[(layer, roles[0])]]
                scale = float(expected.abs().max())
                assert torch.allclose(got, expected, rtol=0, atol=1e-5 * scale), (layer, roles[0])
        feeder.advance(layer)


@pytest.mark.parametrize("family", FAMILIES)
def test_awq_scaling_is_a_no_op_before_rounding(family, models, calibration, held_out, monkeypatch):
    """AWQ scales nothing outside the weight it quantizes: with rounding switched off, W diag(s) diag(1/s) is W.

    Each role's ``[out, in]`` rows are read from the (fused, transposed) weight, multiplied
    and divided by ``s`` in float32, and written back in place: at most two float32 roundings
    (2^-23 relative each), and no other parameter moves. The search is made to pick
    ``alpha = 1`` (the last it tries), the largest scales: with no rounding every alpha has
    zero error and it would keep ``alpha = 0``, where ``s = 1``.
    """
    import itertools

    from interp.quant.methods import _common, awq

    monkeypatch.setattr(_common, "rtn_weights", lambda W, bits, group, integer_zero=False: W.clone())
    monkeypatch.setattr(awq, "_squared_output_error", lambda inputs: lambda delta, n=itertools.count(): -next(n))
    model = models(family)
    qmodel = qa.quantize(model, SPECS["awq"], calibration=calibration, progress=False)
    worst, moved = 0.0, 0
    for layer in range(hk.n_layers(model)):
        reference_slots = hk.linear_weights(model, layer)
        for role, slot in hk.linear_weights(qmodel, layer).items():
            weight, original = slot.read().detach().double(), reference_slots[role].read().detach().double()
            worst = max(worst, float(((weight - original).abs() / original.abs().clamp(min=1e-30)).max()))
            moved += int((weight != original).sum())
    assert worst <= 2 * 2**-23, worst
    assert moved > 0  # the scales were not all 1: the check has something to check
    difference = (interp.nll(qmodel, held_out).double() - interp.nll(model, held_out).double()).abs()
    assert float(difference.max()) < 1e-4 and math.isfinite(float(difference.max()))  # float32 NLL, ~1e-6 noise


# --- restore_layers on fused weights ------------------------------------------------------


@pytest.fixture(scope="module")
def phi3_pair(folders):
    """A float64 Phi-3 and its 3-bit RTN copy."""
    reference = interp.load_model(folders["phi3"])
    reference.original_model.to(torch.float64)
    return reference, qa.quantize(reference, "rtn:bits=3,group=32", progress=False)


def _qkv_rows(model) -> tuple[slice, slice, slice]:
    """Phi-3's ``qkv_proj`` row blocks, from the config: q (n_heads * d_head), then k and v (n_kv * d_head each)."""
    config = model.original_model.config
    d_head = config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * d_head, config.num_key_value_heads * d_head
    return slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)


def _fused(model, layer: int, name: str) -> torch.Tensor:
    block = hk._unwrap(hk.blocks(model)[layer])
    part = hk._unwrap(block.self_attn if name == "qkv_proj" else block.mlp)
    return hk._unwrap(getattr(part, name)).weight.detach()


def test_restore_one_role_of_a_fused_weight(phi3_pair):
    from interp.localize.restoration import restore_layers

    reference, quantized = phi3_pair
    q, k, v = _qkv_rows(reference)
    half = _fused(reference, 0, "gate_up_proj").shape[0] // 2
    restored = restore_layers(quantized, reference, [0], roles=["q", "up"])
    qkv, qkv_ref, qkv_q = (_fused(m, 0, "qkv_proj") for m in (restored, reference, quantized))
    assert torch.equal(qkv[q], qkv_ref[q])
    for rows in (k, v):  # still quantized, and the quantization did change them
        assert torch.equal(qkv[rows], qkv_q[rows]) and not torch.equal(qkv[rows], qkv_ref[rows])
    gate_up, gate_up_ref, gate_up_q = (_fused(m, 0, "gate_up_proj") for m in (restored, reference, quantized))
    assert torch.equal(gate_up[half:], gate_up_ref[half:]) and torch.equal(gate_up[:half], gate_up_q[:half])
    assert not torch.equal(gate_up[:half], gate_up_ref[:half])
    # the bridge's split copies follow (its hooked forward multiplies by them)
    for role in ("q", "k", "v", "gate", "up"):
        slot = hk.linear_weights(restored, 0)[role]
        for mirror in slot.mirrors:
            assert torch.equal(mirror, slot.read()), role
    # block 1 and the unquantized parameters untouched
    assert torch.equal(_fused(restored, 1, "qkv_proj"), _fused(quantized, 1, "qkv_proj"))
    assert torch.equal(_fused(quantized, 0, "qkv_proj"), qkv_q)  # the input was not modified
    assert restored.restored_roles == ["q", "up"]


def test_restore_every_role_is_the_reference(phi3_pair, held_out):
    from interp.localize.restoration import restore_layers
    from interp.runtime.scoring import row_mean, token_nll_fn

    reference, quantized = phi3_pair
    roles = list(hk.linear_weights(reference, 0))
    restored = restore_layers(quantized, reference, range(hk.n_layers(reference)), roles=roles)
    with torch.no_grad():
        expected = row_mean(token_nll_fn(reference)(held_out.tokens))
        got = row_mean(token_nll_fn(restored)(held_out.tokens))
        damaged = row_mean(token_nll_fn(quantized)(held_out.tokens))
    assert got.dtype == torch.float64 and float((got - expected).abs().max()) <= 1e-12
    assert float((damaged - expected).abs().max()) > 1e-6  # the quantization had moved it
    with pytest.raises(ComponentError, match="Unknown linear roles"):
        restore_layers(quantized, reference, [0], roles=["qkv"])


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "llama"])
def test_restore_one_role_elsewhere(family, models):
    """GPT-2's transposed c_attn (with a bias), GPT-NeoX's head-interleaved q/k/v, llama's separate q_proj."""
    from interp.localize.restoration import restore_layers

    reference = models(family)
    quantized = qa.quantize(reference, "rtn:bits=3,group=32", progress=False)
    restored = restore_layers(quantized, reference, [0], roles=["q"])
    for role, slot in hk.linear_weights(restored, 0).items():
        want = (reference if role == "q" else quantized)
        assert torch.equal(slot.read(), hk.linear_weights(want, 0)[role].read()), role
    assert torch.equal(hk.linear_weights(restored, 1)["q"].read(), hk.linear_weights(quantized, 1)["q"].read())
