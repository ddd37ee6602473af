"""Mixed-precision plans: the per-module bit map in a spec, per-weight sensitivity, the budgeted
allocation (against brute force), the bit accounting (against a hand count), the validation
statistics, and the ``interp prescribe`` command's checks."""

from __future__ import annotations

import copy
import importlib
import itertools
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

import interp
from interp.errors import InterpError, SpecError
from interp.quant.apply import quantize
from interp.quant.spec import MethodSpec, parse_spec
from interp.runtime import hooks

pr = importlib.import_module("interp.quant.prescribe")  # the module; interp.quant.prescribe is the function

# ---------------------------------------------------------------------------------------
# The per-module bit map in a spec


def test_plain_spec_strings_are_unchanged():
    assert str(parse_spec("gptq:bits=3")) == "gptq:bits=3,group=64,damp=0.01,act_order=1,block=128"
    assert parse_spec("rtn:bits=4").modules == {}


def test_bit_map_is_canonical_and_round_trips():
    spec = parse_spec("rtn:bits=3|12.down=4|0.v=4|0.q=3")
    assert str(spec) == "rtn:bits=3,group=64,zero=float|0.v=4|12.down=4"  # base-width entry dropped, by layer
    again = parse_spec(str(spec))
    assert again == spec and hash(again) == hash(spec)
    assert spec != parse_spec("rtn:bits=3|0.v=4")
    assert (spec.bits_for(12, "down"), spec.bits_for(12, "up")) == (4, 3)
    assert spec.for_module(0, "v") == parse_spec("rtn:bits=4")
    assert MethodSpec("rtn", 3, modules={"0.v": 4}) == parse_spec("rtn:bits=3|0.v=4")


@pytest.mark.parametrize("text, words", [
    ("nf:bits=3|0.v=5", "supports bits 3, 4"),
    ("rtn:bits=3|v=4", "LAYER.ROLE"),
    ("rtn:bits=3|0.v", "malformed module item"),
    ("rtn:bits=3|0.v=4|0.v=3", "given twice"),
    ("rtn:bits=3|0.v=four", "bits of module 0.v"),
])
def test_bad_bit_maps_get_clear_errors(text, words):
    with pytest.raises(SpecError, match=words):
        parse_spec(text)


def test_spec_from_a_plan_file(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps({"spec": "rtn:bits=3|1.up=4"}))
    assert parse_spec(f"@{tmp_path}/plan.json") == parse_spec("rtn:bits=3|1.up=4")
    with pytest.raises(SpecError, match="cannot read a plan"):
        parse_spec(f"@{tmp_path}/missing.json")


def test_quantize_with_a_bit_map_takes_each_weight_at_its_width(tiny_llama):
    """RTN quantizes each weight on its own, so every weight must equal the uniform model's at its width."""
    spec = parse_spec("rtn:bits=3,group=32|0.v=4|1.down=4|1.q=4")
    mixed = quantize(tiny_llama, spec, progress=False)
    uniform = {b: quantize(tiny_llama, f"rtn:bits={b},group=32", progress=False) for b in (3, 4)}
    for layer in range(hooks.n_layers(tiny_llama)):
        for role, slot in hooks.linear_weights(mixed, layer).items():
            want = hooks.linear_weights(uniform[spec.bits_for(layer, role)], layer)[role].read()
            assert torch.equal(slot.read(), want), (layer, role)
    assert mixed.quant_info.spec == str(spec)


def test_calibrated_bit_map_matches_uniform_where_inputs_agree(tiny_llama, rows):
    """GPTQ's first group (q, k, v of block 0) sees the same calibration inputs in every model, so a
    mixed plan's block-0 q, k, v must be the uniform model's at their own width, bit for bit."""
    spec = parse_spec("gptq:bits=3,group=32|0.k=4")
    mixed = quantize(tiny_llama, spec, calibration=rows, progress=False)
    uniform = {b: quantize(tiny_llama, f"gptq:bits={b},group=32", calibration=rows, progress=False) for b in (3, 4)}
    for role in ("q", "k", "v"):
        got = hooks.linear_weights(mixed, 0)[role].read()
        assert torch.equal(got, hooks.linear_weights(uniform[spec.bits_for(0, role)], 0)[role].read()), role


def test_bit_map_naming_a_missing_module_is_refused(tiny_llama):
    with pytest.raises(SpecError, match="does not have"):
        quantize(tiny_llama, "rtn:bits=3|7.v=4", progress=False)


# ---------------------------------------------------------------------------------------
# Sensitivity


def test_sensitivity_equals_swapping_one_weight_into_a_full_forward(model64, rows):
    """Independent check: each score against a plain full forward (from the tokens, not from a cached
    residual) of a copy with only that weight swapped. Float64 throughout (interp.nll would round
    to float32), so the two paths agree to float64 rounding of ~5-nat NLLs: 1e-10 nats."""
    from interp.quant.sensitivity import sensitivity
    from interp.runtime.scoring import row_mean, token_nll_fn

    def nll64(model):
        with torch.no_grad():
            return row_mean(token_nll_fn(model)(rows.tokens))

    result = sensitivity(model64, "rtn:bits=2,group=32", rows, progress=False, cache=False)
    low = quantize(model64, "rtn:bits=2,group=32", progress=False)
    reference = nll64(model64)
    assert len(result.names) == 7 * hooks.n_layers(model64)
    for index in (0, 5, len(result.names) - 1):
        layer, role = result.layers[index], result.roles[index]
        swapped = copy.deepcopy(model64)
        hooks.linear_weights(swapped, layer)[role].write(hooks.linear_weights(low, layer)[role].read())
        expected = (nll64(swapped) - reference).numpy()
        np.testing.assert_allclose(result.per_example[index], expected, rtol=0, atol=1e-10)


def test_sensitivity_is_cached_and_reloads(tiny_llama, rows, tmp_path):
    from interp.quant.sensitivity import sensitivity

    first = sensitivity(tiny_llama, "rtn:bits=2,group=32", rows, progress=False, cache_dir=tmp_path)
    assert list((tmp_path / "sensitivity").glob("rtn2-g32-*/sensitivity.csv"))
    again = sensitivity(tiny_llama, "rtn:bits=2,group=32", rows, progress=False, cache_dir=tmp_path)
    np.testing.assert_allclose(again.per_example, first.per_example, rtol=1e-8)  # CSV keeps 9 digits
    assert again.names == first.names
    with pytest.raises(InterpError, match="single-width"):
        sensitivity(tiny_llama, "rtn:bits=2|0.v=4", rows, progress=False, cache=False)


# ---------------------------------------------------------------------------------------
# Allocation against brute force


def _brute_force(values, costs, capacity):
    """The knapsack optimum by enumerating every subset."""
    best = 0.0
    for chosen in itertools.product((0, 1), repeat=len(values)):
        if sum(c for c, x in zip(costs, chosen, strict=True) if x) <= capacity:
            best = max(best, sum(v for v, x in zip(values, chosen, strict=True) if x))
    return best


def _instances(seed, count=60):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.integers(1, 9))
        costs = [int(c) for c in rng.integers(1, 20, size=n)]
        values = [float(v) for v in rng.uniform(0, 1, size=n)]
        yield values, costs, int(rng.integers(0, sum(costs) + 1))


def test_greedy_is_optimal_when_costs_are_equal():
    """With one cost for all items the ratio order is the value order, and taking the best k is optimal."""
    for values, costs, capacity in _instances(0):
        costs = [7] * len(values)
        taken = pr.fill(pr.greedy_order(values, costs), costs, capacity)
        assert math.isclose(sum(values[i] for i in taken), _brute_force(values, costs, capacity))


def test_greedy_is_feasible_maximal_and_within_one_item_of_the_optimum():
    """Ratio-greedy: within capacity, no skipped item still fits, and value >= OPT - max value
    (the first item the greedy prefix could not take bounds the LP relaxation)."""
    for values, costs, capacity in _instances(1):
        taken = pr.fill(pr.greedy_order(values, costs), costs, capacity)
        used = sum(costs[i] for i in taken)
        assert used <= capacity
        assert all(costs[i] > capacity - used for i in range(len(values)) if i not in taken)
        optimum = _brute_force(values, costs, capacity)
        assert sum(values[i] for i in taken) >= optimum - max(values) - 1e-12


def test_greedy_order_breaks_ties_by_position():
    assert pr.greedy_order([2.0, 1.0, 2.0, 1.0], [2, 1, 2, 1]) == [0, 1, 2, 3]
    assert pr.greedy_order([1.0, 3.0, 2.0], [1, 1, 1]) == [1, 2, 0]


# ---------------------------------------------------------------------------------------
# Bit accounting against a hand count


SMOL_BLOCK = [("q", 576, 576), ("k", 192, 576), ("v", 192, 576), ("o", 576, 576), ("gate", 1536, 576),
              ("up", 1536, 576), ("down", 576, 1536)]


def test_bit_accounting_against_a_hand_count():
    spec = parse_spec("gptq:bits=3,group=64")
    q = pr.WeightShape(0, "q", 576, 576)
    # 576*576 codes at 3 bits = 995,328; 576 rows x 9 groups x (16-bit scale + 16-bit zero) = 165,888
    assert pr.weight_bits(q, spec, 3) == 995_328 + 165_888
    down = pr.WeightShape(0, "down", 576, 1536)
    # 884,736 codes at 4 bits = 3,538,944; 576 rows x 24 groups x 32 bits = 442,368
    assert pr.weight_bits(down, spec, 4) == 3_538_944 + 442_368
    shapes = [pr.WeightShape(layer, r, o, i) for layer in range(2) for r, o, i in SMOL_BLOCK]
    assert pr.average_bits(shapes, spec, [3] * len(shapes)) == 3.5  # 3 + 32/64 when 64 divides every d_in
    assert pr.average_bits(shapes, spec, [4] * len(shapes)) == 4.5
    nf = parse_spec("nf:bits=4,group=64")
    assert pr.weight_bits(q, nf, 4) == 576 * 576 * 4 + 576 * 9 * 16  # absmax scale only
    rtn = parse_spec("rtn:bits=3,group=64,zero=int")
    assert pr.weight_bits(q, rtn, 3) == 576 * 576 * 3 + 576 * 9 * (16 + 3)  # integer zero at the code width
    ragged = pr.WeightShape(0, "q", 2, 100)  # ceil(100 / 64) = 2 groups per row
    assert pr.weight_bits(ragged, spec, 3) == 2 * 100 * 3 + 2 * 2 * 32


def test_plan_stays_under_the_budget_and_fills_it():
    spec = parse_spec("gptq:bits=3,group=64")
    shapes = [pr.WeightShape(layer, r, o, i) for layer in range(6) for r, o, i in SMOL_BLOCK]
    values = list(np.random.default_rng(0).uniform(0, 1, len(shapes)))
    for budget in (3.6, 4.0, 4.37):
        plan = pr.plan_from_order(shapes, spec, (3, 4), budget, pr.greedy_order(values, [1] * len(shapes)),
                                  "interp", values)
        assert plan.ends == (3.5, 4.5) and plan.achieved <= budget
        total = sum(s.size for s in shapes)
        slack_bits = budget * total - plan.achieved * total
        cheapest_low = min(pr.weight_bits(s, spec, 4) - pr.weight_bits(s, spec, 3) for s in shapes
                           if plan.widths[s.name] == 3)
        assert slack_bits < cheapest_low  # exact on the budget: nothing left at 3 bits still fits
        assert parse_spec(plan.spec).bits_for(0, "q") == plan.widths["0.q"]


def test_heuristic_order_puts_v_and_down_first_then_the_ends():
    shapes = [pr.WeightShape(layer, r, o, i) for layer in range(16) for r, o, i in SMOL_BLOCK]
    order = [shapes[i] for i in pr.heuristic_order(shapes)]
    first = order[:32]
    assert {s.role for s in first} == {"v", "down"}
    # use_more_bits(i, 16): i < 2, i >= 14, or (i - 2) % 3 == 2  ->  0, 1, 4, 7, 10, 13, 14, 15
    assert sorted({s.layer for s in order[:16]}) == [0, 1, 4, 7, 10, 13, 14, 15]
    assert {s.layer for s in order[32:42]} == {0, 15}  # then the first and last layers' other weights


@pytest.mark.parametrize("bits, budget, words", [
    ((3, 3), 3.7, "two different bit widths"),
    ((3, 9), 3.7, "supports bits"),
    ((3, 4), 3.5, "strictly between"),
    ((3, 4), 4.5, "strictly between"),
])
def test_request_validation(bits, budget, words):
    with pytest.raises(SpecError, match=words):
        pr.validate_request("gptq", bits, budget, 64)


# ---------------------------------------------------------------------------------------
# The validation statistics


def test_compare_strategies_against_direct_means():
    rng = np.random.default_rng(0)
    n = 40
    errors = pd.DataFrame({"u3": rng.uniform(0.2, 0.4, n), "u4": rng.uniform(0.0, 0.1, n),
                           "a": rng.uniform(0.1, 0.3, n), "b": rng.uniform(0.1, 0.35, n)},
                          index=[f"x{i}" for i in range(n)])
    meta = {"u3": ("uniform", math.nan, 3.5), "u4": ("uniform", math.nan, 4.5),
            "a": ("interp", 4.0, 4.0), "b": ("heuristic", 4.0, 3.99)}
    large = ["x1", "x5", "x9", "x30"]
    table = pr.compare_strategies(errors, meta, large, "u3", "u4", n_boot=500).table.set_index("strategy")
    assert math.isclose(table.loc["heuristic", "diff"], errors["b"].mean() - errors["a"].mean())
    assert math.isclose(table.loc["heuristic", "large_diff"], errors.loc[large, "b"].mean()
                        - errors.loc[large, "a"].mean())
    gap = errors["u3"].mean() - errors["u4"].mean()
    assert math.isclose(table.loc["interp", "gap_closed"], (errors["u3"].mean() - errors["a"].mean()) / gap)
    row = table.loc["heuristic"]
    assert row["diff_low"] <= row["diff"] <= row["diff_high"]
    assert math.isnan(table.loc["interp", "diff"])  # the plan is not compared with itself


# ---------------------------------------------------------------------------------------
# The command line


def test_cli_checks_the_request_before_loading_a_model(capsys, monkeypatch, tmp_path):
    from interp.cli.main import main

    monkeypatch.setattr(interp.models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    cases = ((["--budget", "3.5"], "strictly between"), (["--bits", "3,9", "--budget", "4"], "supports"),
             (["--bits", "3", "--budget", "4"], "two widths"), (["--method", "gptx", "--budget", "4"], "did you mean"))
    for argv, words in cases:
        try:
            code = main(["prescribe", "--out", str(tmp_path), *argv])
        except SystemExit as exc:  # argparse's own type errors
            code = exc.code
        assert code == 2, argv
        assert words in capsys.readouterr().err, argv


def test_prescribe_end_to_end_on_a_tiny_model(tiny_llama, rows, tmp_path):
    plan = pr.prescribe(tiny_llama, "rtn", (2, 4), 3.5, calibration=rows, group=32, progress=False,
                        cache_dir=tmp_path)
    assert plan.achieved <= 3.5 and plan.strategy == "interp"
    path = plan.save(tmp_path / "out")
    record = json.loads(path.read_text())
    assert record["achieved_average_bits"] == plan.achieved
    qmodel = quantize(tiny_llama, f"@{path}", progress=False)
    assert qmodel.quant_info.spec == plan.spec


def test_compressed_tensors_export_takes_a_plan_of_an_exportable_method_and_refuses_one_of_another(tiny_llama):
    from interp.quant.export import check_exportable

    check_exportable(parse_spec("rtn:bits=3|0.v=4"))  # each width becomes its own config group (test_export)
    with pytest.raises(SpecError, match="cannot be written as a compressed-tensors checkpoint"):
        check_exportable(parse_spec("nf:bits=3|0.v=4"))


def test_sensitivity_rows_are_the_first_rows_and_tokens(rows):
    cut = pr.sensitivity_rows(rows, 3, 7)
    assert torch.equal(cut.tokens, rows.tokens[:3, :7]) and cut.ids == rows.ids[:3]
    assert pr.sensitivity_rows(rows, None, None) is rows


def test_report_stage_reads_the_committed_validation(tmp_path):
    """The section draws the committed run for the bundled SmolLM2 and says 'not measured' for another model."""
    from interp.report.context import ReportContext, ReportSettings
    from interp.report.stages.prescribe import STAGE, validation_folder

    committed = pd.read_csv(validation_folder() / "validation.csv")
    out = STAGE.run(ReportContext(ReportSettings(), tmp_path, progress=False))
    assert out.tables["validation"].equals(committed) and "pareto" in out.figures
    other = STAGE.run(ReportContext(ReportSettings(model="gemma3-270m"), tmp_path, progress=False))
    assert not other.figures and "Not measured" in other.notes[0]


# ---------------------------------------------------------------------------------------
# The output-error proxy, split-half reliability, and the multiple-choice knapsack


def test_proxy_equals_the_output_error_on_directly_captured_inputs(tiny_llama):
    """tr(ΔW H ΔWᵀ) = ||X ΔWᵀ||² on each chunk's tokens, X captured here by GPTQ's own route (LayerFeeder,
    block by block), ΔW recomputed, summed in float64. The proxy accumulates H in float32 over 3 x 12
    tokens of O(1) activations: relative error ~1e-6, so 1e-4 is loose."""
    from interp.quant.calibration import LayerFeeder
    from interp.quant.methods import quantize_weight
    from interp.quant.sensitivity import proxy_sensitivity

    examples = interp.Examples.from_tokens(torch.randint(0, 256, (6, 12), generator=torch.Generator().manual_seed(1)))
    result = proxy_sensitivity(tiny_llama, examples, widths=(2, 4), group=16, chunks=2, progress=False)
    assert result.per_chunk.shape == (2 * 7, 2, 2) and result.tokens.tolist() == [36, 36]
    for chunk in range(2):
        rows = examples.subset(list(range(chunk, 6, 2)))
        feeder = LayerFeeder(tiny_llama, rows.tokens, batch_size=8)
        for index, (layer, role) in enumerate(zip(result.layers, result.roles, strict=True)):
            X = feeder.inputs(layer, role).double()
            W = hooks.linear_weights(tiny_llama, layer)[role].read().detach().float()
            for w, bits in enumerate((2, 4)):
                delta = (quantize_weight(W, f"rtn:bits={bits},group=16") - W).double()
                want = float(((X @ delta.T) ** 2).sum())
                assert result.per_chunk[index, w, chunk] == pytest.approx(want, rel=1e-4), (layer, role, bits)
            if role == "down" and layer + 1 < hooks.n_layers(tiny_llama):
                feeder.advance(layer)
    assert (result.scores()[:, 0] > result.scores()[:, 1]).all()  # 2-bit errs more than 4-bit on every weight


def test_split_half_is_one_for_identical_halves_and_matches_scipy():
    from scipy.stats import spearmanr

    from interp.quant.sensitivity import split_half

    rng = np.random.default_rng(0)
    base = rng.normal(size=(30, 1))
    same = split_half(np.repeat(base, 6, axis=1), n_boot=50)
    assert same["rho"] == pytest.approx(1.0) and same["low"] == pytest.approx(1.0)  # every draw ranks alike
    values = rng.normal(size=(30, 6))
    sizes = np.arange(1.0, 7.0)
    got = split_half(values, sizes, n_boot=200)
    want = spearmanr(values[:, ::2].sum(1) / sizes[::2].sum(), values[:, 1::2].sum(1) / sizes[1::2].sum())[0]
    assert got["rho"] == pytest.approx(want, abs=1e-12)  # same ranks; float64 Pearson of ranks
    assert got["low"] <= got["high"] and got["units"] == 3


def test_multiple_choice_knapsack_against_brute_force():
    rng = np.random.default_rng(3)
    for trial in range(20):
        items, options = 4, 3
        costs = rng.integers(1, 9, size=(items, options)).tolist()
        losses = (rng.integers(0, 64, size=(items, options)) / 8).tolist()  # dyadic: sums are exact
        for capacity in range(0, 30, 3):
            fits = [c for c in itertools.product(range(options), repeat=items)
                    if sum(costs[i][o] for i, o in enumerate(c)) <= capacity]
            if not fits:
                with pytest.raises(SpecError, match="no choice"):
                    pr.choose_options(losses, costs, capacity)
                continue
            best = min(sum(losses[i][o] for i, o in enumerate(c)) for c in fits)
            got = pr.choose_options(losses, costs, capacity)
            assert sum(costs[i][o] for i, o in enumerate(got)) <= capacity, (trial, capacity)
            assert sum(losses[i][o] for i, o in enumerate(got)) == best, (trial, capacity)


def test_knapsack_with_a_coarse_unit_still_fits():
    rng = np.random.default_rng(4)
    costs = rng.integers(10, 90, size=(6, 4)).tolist()
    losses = rng.random((6, 4)).tolist()
    for capacity in (200, 300, 400):
        got = pr.choose_options(losses, costs, capacity, unit=7)
        assert sum(costs[i][o] for i, o in enumerate(got)) <= capacity


def test_llama_cpp_plan_end_to_end_on_a_tiny_model(tiny_llama, tmp_path):
    """Types from the widths' options after the fallback, under the budget, a tighter budget never estimated
    better, and a tensor-type file llama-quantize's format reader (ours) takes with the model's names."""
    from interp.quant import llama_cpp as lc

    examples = interp.Examples.from_tokens(torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(2)))
    shapes = pr.model_shapes(tiny_llama)
    # width 64 forbids K-quants: 3 -> q4_0 (4.5), 4 -> q5_0 (5.5), 6 and 8 -> q8_0 (8.5)
    loose = pr.prescribe_llama_cpp(tiny_llama, 6.5, examples, widths=(3, 4, 6, 8), chunks=2, progress=False)
    tight = pr.prescribe_llama_cpp(tiny_llama, 5.0, examples, widths=(3, 4, 6, 8), chunks=2, progress=False)
    for plan in (loose, tight):
        assert plan.achieved <= plan.budget
        for s, options in zip(shapes, pr.llama_options(shapes, (3, 4, 6, 8)), strict=True):
            assert plan.types[s.name] in options
    # the tight choice also fits the loose table (rounded costs, more cells), so the DP's optimum there is no worse
    assert loose.estimated_loss <= tight.estimated_loss
    path = loose.save(tmp_path, shapes)
    items = lc.read_tensor_types(path, [lc.gguf_name(s.layer, s.role) for s in shapes])
    assert [t for _, t in items] == [loose.types[s.name] for s in shapes]
    assert json.loads((tmp_path / "llama_plan.json").read_text())["achieved_bits_per_weight"] == loose.achieved
    with pytest.raises(SpecError, match="outside what widths 4,6,8 allow on this model"):
        pr.prescribe_llama_cpp(tiny_llama, 5.0, examples, widths=(4, 6, 8), chunks=2, progress=False)


def test_cli_checks_a_llama_cpp_request_before_loading_a_model(capsys, monkeypatch, tmp_path):
    from interp.cli.main import main

    monkeypatch.setattr(interp.models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    cases = ((["--bits", "4,6,8", "--budget", "9"], "outside what widths 4,6,8 allow"),
             (["--bits", "4,7", "--budget", "5"], "at least two widths from"),
             (["--bits", "4,6", "--budget", "4"], "outside what widths"))
    for argv, words in cases:
        code = main(["prescribe", "--format", "llama.cpp", "--out", str(tmp_path), *argv])
        assert code == 2, argv
        assert words in capsys.readouterr().err, argv


def test_cli_writes_a_llama_cpp_tensor_type_file(tiny_llama, monkeypatch, tmp_path, capsys):
    """The command's llama.cpp branch end to end, the model and examples swapped for the tiny ones."""
    from interp.cli import common
    from interp.cli.main import main
    from interp.quant import llama_cpp as lc

    examples = interp.Examples.from_tokens(torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(5)))
    monkeypatch.setattr(common, "load_model_and_examples", lambda args, split="eval": (tiny_llama, examples))
    code = main(["prescribe", "--format", "llama.cpp", "--bits", "3,4,8", "--budget", "5.5", "--quiet",
                 "--out", str(tmp_path / "plan")])
    assert code == 0
    shapes = pr.model_shapes(tiny_llama)
    names = [lc.gguf_name(s.layer, s.role) for s in shapes]
    items = lc.read_tensor_types(tmp_path / "plan" / "tensor_types.txt", names)
    assert len(items) == len(shapes)
    assert lc.types_average_bits(shapes, {s.name: t for s, (_, t) in zip(shapes, items, strict=True)}) <= 5.5
    assert "llama-quantize --tensor-type-file" in capsys.readouterr().out


def test_fisher_plan_finds_the_type_a_reference_is_already_stored_in(rows):
    """A reference whose weights already sit on llama.cpp's Q4_1 grid loses nothing in Q4_1: the Fisher score of
    that option is exactly 0 (the stored weight equals the reference), every other option costs KL, so under a
    budget Q4_1 fits, the plan is all Q4_1 at zero estimated loss. The RTN proxy cannot see this."""
    import interp
    from interp.quant.llama_cpp import stored_weight
    from interp.quant.prescribe import model_shapes, prescribe_llama_cpp

    model = interp.tiny_model("llama", seed=3)
    for layer in range(hooks.n_layers(model)):
        for slot in hooks.linear_weights(model, layer).values():
            slot.write(stored_weight(slot.read(), "q4_1"))
    plan = prescribe_llama_cpp(model, 5.2, rows, widths=(4, 5, 8), chunks=1, batch_size=5, progress=False,
                               score="fisher")
    assert set(plan.types.values()) == {"q4_1"} and plan.estimated_loss == 0.0
    assert plan.achieved == 5.0 and len(plan.types) == len(model_shapes(model))
    cheaper = prescribe_llama_cpp(model, 4.8, rows, widths=(4, 5, 8), chunks=1, batch_size=5, progress=False,
                                  score="fisher")
    assert cheaper.achieved <= 4.8 and cheaper.estimated_loss > 0 and "q4_0" in cheaper.types.values()


def test_tail_allocation_against_enumeration():
    """choose_options_tail on random small instances, against every combination enumerated: the plan fits, its
    tail loss never exceeds the mean-optimal plan's, equals the enumerated minimum on most instances, and its
    first history entry is the mean-optimal plan's tail loss (recomputed by a sort)."""
    from interp.quant.prescribe import choose_options, choose_options_tail, tail_loss

    rng = np.random.default_rng(11)
    exact = strictly_better = 0
    for _ in range(40):
        items, examples = 5, 20
        options = [int(rng.integers(2, 4)) for _ in range(items)]
        costs = [sorted(rng.integers(1, 6, size=n).tolist()) for n in options]
        # cheaper options lose more on average, and each example is hurt by different items
        losses = [np.stack([rng.gamma(1.0, 1.0, examples) * (n - o) for o in range(n)]) for n in options]
        capacity = int(sum(c[0] for c in costs) + rng.integers(2, 8))

        def naive_tail(plan, losses=losses):
            total = sum(losses[i][o] for i, o in enumerate(plan))
            return float(np.sort(total)[-2:].mean())  # 10% of 20 examples: the worst 2

        fits = [p for p in itertools.product(*[range(n) for n in options])
                if sum(costs[i][o] for i, o in enumerate(p)) <= capacity]
        best_possible = min(naive_tail(p) for p in fits)
        plan, history = choose_options_tail(losses, costs, capacity, share=0.1)
        mean_plan = choose_options([t.mean(axis=1).tolist() for t in losses], costs, capacity)
        assert sum(costs[i][o] for i, o in enumerate(plan)) <= capacity
        assert naive_tail(plan) == pytest.approx(min(history), rel=1e-12)
        assert history[0] == pytest.approx(naive_tail(mean_plan), rel=1e-12)
        assert naive_tail(plan) <= naive_tail(mean_plan) + 1e-12
        assert naive_tail(plan) >= best_possible - 1e-12
        exact += naive_tail(plan) <= best_possible + 1e-12
        strictly_better += naive_tail(plan) < naive_tail(mean_plan) - 1e-12
    assert strictly_better >= 5  # the tail objective changes the plan on these instances
    assert exact >= 30, exact  # a local method, but it finds the enumerated optimum on most
    assert tail_loss([1.0, 5.0, 2.0, 9.0], share=0.5) == 7.0
    with pytest.raises(SpecError, match="examples"):
        choose_options_tail([np.ones((2, 3)), np.ones((2, 4))], [[1, 2], [1, 2]], 4)
