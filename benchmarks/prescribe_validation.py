"""Validate interp's mixed-precision plan on held-out examples against the alternatives at the same budget.

On the bundled SmolLM2 with GPTQ 3/4-bit (group 64), for each budget: interp's plan
(sensitivity greedy, :func:`interp.quant.prescribe`), the llama.cpp-style heuristic, five
random allocations (seeds 0-4), and the two ends (all 3-bit, all 4-bit). Every plan is
assembled from the two uniform GPTQ models (each weight takes its value from the uniform
model of its width), so all strategies are built the same way and differ only in which
weights get 4 bits; ``--sequential`` also quantizes interp's middle plan with a true
mixed-width GPTQ pass (``quantize(model, plan.spec)``) to measure what assembling costs.

Per-example NLLs are written as they are computed (``nll/<plan>.csv``), so a killed run
resumes; ``--strategies`` picks which plans this process computes (two processes can share
the work), and every run ends by summarising whatever exists into ``validation.csv`` /
``validation.json`` and the table in ``docs/prescribe.md``.

    OMP_NUM_THREADS=1 python benchmarks/prescribe_validation.py
"""

from __future__ import annotations

import argparse
import copy
import importlib
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import interp  # noqa: E402
from interp.io import sanitize, write_json  # noqa: E402
from interp.quant.apply import quantize, quantize_cached  # noqa: E402
from interp.runtime import hooks  # noqa: E402

pr = importlib.import_module("interp.quant.prescribe")  # the module (interp.quant.prescribe is the function)

DEFAULT_OUT = ROOT / "docs" / "data" / "prescribe"
DOC = ROOT / "docs" / "prescribe.md"
STRATEGIES = ("uniform", "heuristic", "random", "interp")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="gptq")
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--budgets", default="3.75,4.0,4.25", help="average bits per weight, scales and zeros counted")
    p.add_argument("--n", type=int, default=64, help="held-out (eval split) examples")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--calibration-n", type=int, default=32, help="GPTQ calibration examples (128 tokens)")
    p.add_argument("--sensitivity-n", type=int, default=8, help="calibration examples the sensitivity is measured on")
    p.add_argument("--sensitivity-seq-len", type=int, default=64, help="and their first this many tokens")
    p.add_argument("--draws", type=int, default=5, help="random allocations per budget")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--sequential", action="store_true", help="also a true mixed-width GPTQ pass of the middle plan")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args()


def assemble(reference: Any, by_bits: dict[int, Any], widths: dict[str, int]) -> Any:
    """A copy of ``reference`` whose weight ``layer.role`` is the uniform ``widths[...]``-bit model's."""
    model = copy.deepcopy(reference)
    for name, bits in widths.items():
        layer, role = name.split(".")
        source = hooks.linear_weights(by_bits[bits], int(layer))[role].read()
        hooks.linear_weights(model, int(layer))[role].write(source)
    return model


def score(name: str, make: Any, examples: Any, folder: Path) -> None:
    """Per-example NLL of the model ``make()`` builds, written to ``folder/<name>.csv`` (skipped if there)."""
    path = folder / f"{name}.csv"
    if path.exists():
        return
    tick = time.perf_counter()
    values = interp.nll(make(), examples, batch_size=8).double().numpy()
    pd.DataFrame({"id": examples.ids, "nll": values}).to_csv(path, index=False, float_format="%.9g")
    print(f"{name}: mean NLL {values.mean():.4f} ({time.perf_counter() - tick:.0f} s)", flush=True)


def main() -> int:
    args = parse()
    budgets = [float(b) for b in args.budgets.split(",")]
    wanted = set(args.strategies.split(","))
    folder = args.out / "nll"
    folder.mkdir(parents=True, exist_ok=True)
    model = interp.load_model(args.model)
    calibration = interp.load_examples("wiki", model.tokenizer, n=args.calibration_n, seq_len=128, seed=0,
                                       split="calibration")
    examples = interp.load_examples("wiki", model.tokenizer, n=args.n, seq_len=args.seq_len, seed=0, split="eval")
    shapes = pr.model_shapes(model)
    spec, (low, high) = pr.validate_request(args.method, (3, 4), budgets[0], args.group, shapes)
    by_bits = {b: quantize_cached(model, f"{args.method}:bits={b},group={args.group}", calibration=calibration)
               for b in (low, high)}
    plans: dict[str, pr.Plan] = {}
    for budget in budgets:
        plans[f"heuristic@{budget}"] = pr.plan_from_order(shapes, spec, (low, high), budget,
                                                          pr.heuristic_order(shapes), "heuristic")
        for seed in range(args.draws):
            plans[f"random{seed}@{budget}"] = pr.plan_from_order(shapes, spec, (low, high), budget,
                                                                 pr.random_order(len(shapes), seed), "random",
                                                                 settings={"seed": seed})
    if "uniform" in wanted:
        score("reference", lambda: model, examples, folder)
        for b in (low, high):
            score(f"uniform-{b}", lambda b=b: by_bits[b], examples, folder)
    for name, plan in plans.items():
        if plan.strategy in wanted:
            score(name, lambda plan=plan: assemble(model, by_bits, plan.widths), examples, folder)
    if "interp" in wanted or all((folder / f"interp@{b}.csv").exists() for b in budgets):
        for budget in budgets:
            plan = pr.prescribe(model, args.method, (low, high), budget, calibration=calibration, group=args.group,
                                sensitivity_n=args.sensitivity_n, sensitivity_seq_len=args.sensitivity_seq_len)
            plans[f"interp@{budget}"] = plan
            plan.save(args.out / f"plan-{budget}")
            if "interp" in wanted:
                score(f"interp@{budget}", lambda plan=plan: assemble(model, by_bits, plan.widths), examples, folder)
        if args.sequential:
            middle = plans[f"interp@{budgets[len(budgets) // 2]}"]
            score(f"interp-sequential@{middle.budget}",
                  lambda: quantize(model, middle.spec, calibration=calibration), examples, folder)
    summarize(args, plans, examples, shapes, spec, (low, high))
    return 0


def summarize(args: argparse.Namespace, plans: dict[str, pr.Plan], examples: Any, shapes: list[pr.WeightShape],
              spec: Any, bits: tuple[int, int]) -> None:
    folder = args.out / "nll"
    nll = {p.stem: pd.read_csv(p).set_index("id")["nll"] for p in sorted(folder.glob("*.csv"))}
    if not {"reference", f"uniform-{bits[0]}", f"uniform-{bits[1]}"} <= set(nll):
        print("the reference and the two ends are not scored yet: nothing to summarise")
        return
    errors = pd.DataFrame({name: values - nll["reference"] for name, values in nll.items() if name != "reference"})
    ends = {f"uniform-{b}": pr.average_bits(shapes, spec, [b] * len(shapes)) for b in bits}
    meta: dict[str, tuple[str, float, float]] = {name: ("uniform", math.nan, avg) for name, avg in ends.items()}
    for budget in sorted({p.budget for p in plans.values()}):
        draws = [n for n in errors if n.startswith("random") and n.endswith(f"@{budget}") and n in plans]
        if draws:  # a random allocation's expected error: the per-example mean over the draws
            errors[f"random@{budget}"] = errors[draws].mean(axis=1)
            meta[f"random@{budget}"] = ("random", budget, sum(plans[d].achieved for d in draws) / len(draws))
        for strategy in ("heuristic", "interp", "interp-sequential"):
            name = f"{strategy}@{budget}"
            source = plans.get(name) or plans.get(f"interp@{budget}")
            if name in errors and source is not None:
                meta[name] = (strategy, budget, source.achieved)
    split = interp.quant.split_large_ctrl(errors[f"uniform-{bits[0]}"], examples, top=0.10, seed=0)
    columns = list(meta)
    result = pr.compare_strategies(errors[columns], meta, split.large_ids, f"uniform-{bits[0]}",
                                   f"uniform-{bits[1]}")
    table = result.table
    draws_table = pd.DataFrame([{"plan": n, "budget": plans[n].budget, "average_bits": plans[n].achieved,
                                 "mean_error": errors[n].mean()} for n in errors if n.startswith("random")
                                and n in plans])
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "validation.csv", index=False, float_format="%.6g")
    draws_table.to_csv(args.out / "random_draws.csv", index=False, float_format="%.6g")
    errors.to_csv(args.out / "errors.csv", float_format="%.9g")
    write_json(args.out / "validation.json", sanitize({
        **result.settings, "model": args.model, "method": str(spec), "bits": list(bits),
        "held_out": dict(examples.settings), "d_large": split.to_dict(), "ends_average_bits": ends,
        "plans": {n: {"strategy": p.strategy, "budget": p.budget, "achieved": p.achieved} for n, p in plans.items()},
    }))
    if DOC.exists():
        write_table(table)
    print(table.round(4).to_string())
    figures(args, result, bits, spec, with_sensitivity=any(p.strategy == "interp" for p in plans.values()))


def figures(args: argparse.Namespace, result: Any, bits: tuple[int, int], spec: Any, with_sensitivity: bool) -> None:
    """The Pareto PNG and, once interp's plans exist, the sensitivity behind them (cached) and its PNGs."""
    from interp.figures import export_static
    from interp.figures.prescribe import pareto_figure, sensitivity_by_half, sensitivity_figure
    from interp.quant.sensitivity import sensitivity

    export_static({"prescribe_pareto": pareto_figure(result)}, ROOT / "docs" / "img", formats=("png",))
    if not with_sensitivity:
        return
    model = interp.load_model(args.model)
    calibration = interp.load_examples("wiki", model.tokenizer, n=args.calibration_n, seq_len=128, seed=0,
                                       split="calibration")
    rows = pr.sensitivity_rows(calibration, args.sensitivity_n, args.sensitivity_seq_len)
    scores = sensitivity(model, f"{spec.method}:bits={bits[0]},group={spec.group}", rows, calibration=calibration)
    scores.save(args.out / "sensitivity")
    scores.table(n_boot=1000).to_csv(args.out / "sensitivity_table.csv", index=False, float_format="%.6g")
    agreement(scores)
    export_static({"prescribe_sensitivity": sensitivity_figure(scores),
                   "prescribe_sensitivity_halves": sensitivity_by_half(scores)}, ROOT / "docs" / "img",
                  formats=("png",))


def write_table(table: pd.DataFrame) -> None:
    """The validation table between the markers in docs/prescribe.md, generated from the data."""
    lines = ["| budget | strategy | avg bits | mean error (nats) | - interp [95% CI] | D_large error | "
             "- interp on D_large [95% CI] | gap closed [95% CI] |", "|---|---|---:|---:|---|---:|---|---|"]

    def interval(row: Any, prefix: str) -> str:
        if not isinstance(row.get(f"{prefix}diff"), float) or math.isnan(row[f"{prefix}diff"]):
            return ""
        return f"{row[f'{prefix}diff']:+.4f} [{row[f'{prefix}diff_low']:+.4f}, {row[f'{prefix}diff_high']:+.4f}]"

    for _, row in table.iterrows():
        budget = "end" if math.isnan(row["budget"]) else f"{row['budget']:g}"
        lines.append(f"| {budget} | {row['strategy']} | {row['average_bits']:.3f} | {row['mean_error']:.4f} | "
                     f"{interval(row, '')} | {row['large_error']:.4f} | {interval(row, 'large_')} | "
                     f"{100 * row['gap_closed']:.0f}% [{100 * row['gap_low']:.0f}%, {100 * row['gap_high']:.0f}%] |")
    replace_block("validation", "\n".join(lines + ["", *verdicts(table)]))


def replace_block(name: str, body: str) -> None:
    """Put ``body`` between ``<!-- NAME:begin ... -->`` and ``<!-- NAME:end -->`` in docs/prescribe.md."""
    text = DOC.read_text()
    block = f"<!-- {name}:begin (benchmarks/prescribe_validation.py) -->\n{body}\n<!-- {name}:end -->"
    text = re.sub(rf"<!-- {name}:begin.*?<!-- {name}:end -->", lambda _: block, text, flags=re.S)
    DOC.write_text(text)


def verdicts(table: pd.DataFrame) -> list[str]:
    """One sentence per (budget, other strategy): does interp's plan beat it, from the paired interval."""
    out = []
    for _, row in table[table["budget"].notna() & (table["strategy"] != "interp")].iterrows():
        if not isinstance(row.get("diff"), float) or math.isnan(row["diff"]):
            continue
        if row["diff_low"] > 0:
            word = "interp's plan **beats**"
        elif row["diff_high"] < 0:
            word = "interp's plan **loses to**"
        else:
            word = "interp's plan is **not distinguishable from**"
        out.append(f"- Budget {row['budget']:g}: {word} {row['strategy']} on mean error ({row['strategy']} minus "
                   f"interp {row['diff']:+.4f} nats, 95% CI [{row['diff_low']:+.4f}, {row['diff_high']:+.4f}]; "
                   f"on D_large {row['large_diff']:+.4f} "
                   f"[{row['large_diff_low']:+.4f}, {row['large_diff_high']:+.4f}]).")
    return out


def agreement(scores: Any) -> None:
    """Where the sensitivity sits, by role and half of the layers, against the localization's gate/down-late finding."""
    table = scores.table(n_boot=1000)
    half = (max(scores.layers) + 1) // 2
    total, params = table["score"].sum(), table["weights"].sum()
    lines = ["| role | score share, lower half | score share, upper half | parameter share, upper half |",
             "|---|---:|---:|---:|"]
    for role in scores.grid().columns:
        rows = table[table["role"] == role]
        lower, upper = rows[rows["layer"] < half], rows[rows["layer"] >= half]
        lines.append(f"| {role} | {100 * lower['score'].sum() / total:.1f}% "
                     f"| {100 * upper['score'].sum() / total:.1f}% | {100 * upper['weights'].sum() / params:.1f}% |")
    late = table[(table["layer"] >= half) & table["role"].isin(["gate", "down"])]
    lines += ["", f"Gate and down in the upper half hold {100 * late['score'].sum() / total:.1f}% of the summed "
                  f"sensitivity and {100 * late['weights'].sum() / params:.1f}% of the parameters; "
                  f"{int((table['score'] < 0).sum())} of {len(table)} weights have a negative score (quantizing them "
                  f"alone lowered the calibration NLL). Sensitivity pass: {scores.settings.get('seconds', 0):.0f} s "
                  f"for {len(table)} weights on {scores.settings.get('n')} x {scores.settings.get('seq_len')} tokens "
                  f"({scores.settings.get('model_forwards', 0):.0f} model-forward equivalents)."]
    lines += ["", reliability(scores, table)]
    replace_block("agreement", "\n".join(lines))


def reliability(scores: Any, table: pd.DataFrame) -> str:
    """How repeatable the per-weight scores are: split-half (odd against even examples), Spearman-Brown corrected."""
    import numpy as np

    odd, even = scores.per_example[:, 1::2].mean(1), scores.per_example[:, ::2].mean(1)
    r = float(np.corrcoef(odd, even)[0, 1])
    with_zero = int(((table["low"] <= 0) & (table["high"] >= 0)).sum()) if "low" in table else -1
    return (f"Reliability: the scores on odd and on even calibration examples correlate at r = {r:.2f} over the "
            f"{len(table)} weights (split-half; Spearman-Brown {2 * r / (1 + r):.2f} for the full set), and "
            f"{with_zero} of {len(table)} weights have a 95% bootstrap interval that contains 0.")


if __name__ == "__main__":
    raise SystemExit(main())
