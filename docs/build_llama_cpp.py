"""Write the llama.cpp comparison tables of docs/prescribe.md from docs/data/prescribe/llama-cpp/result.json.

The run (``benchmarks/llama_cpp_plans.py``, pre-registered in
``docs/preregistration/llama-cpp-plans-2.json``) writes the data; this script only renders it, so
no number on the page is typed by hand (``tests/test_docs.py`` checks the page against the data).

    python docs/build_llama_cpp.py --write [--figure]    # or --check
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
from _generated import refresh  # noqa: E402  (the one place generated files are written)

PAGE = ROOT / "docs" / "prescribe.md"
DATA = ROOT / "docs" / "data" / "prescribe" / "llama-cpp"
REGISTRATIONS = {"plans2": "llama-cpp-plans-2", "plans3": "llama-cpp-plans-3",  # block prefix -> registration
                 "plans4": "llama-cpp-plans-4", "plans5": "llama-cpp-plans-5", "plans7": "llama-cpp-plans-7"}
GEMMA = ("plans7",)  # registrations on Gemma-3-270m: their own figure (another file-size scale)


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _interval(d: dict[str, Any], scale: float = 100, unit: str = "%", digits: int = 1) -> str:
    return (f"{scale * d['estimate']:+.{digits}f}{unit} [{scale * d['low']:+.{digits}f}{unit}, "
            f"{scale * d['high']:+.{digits}f}{unit}]")


def verdict_table(result: dict[str, Any]) -> str:
    lines = ["| size | mix file (bytes) | plan files (bytes, 3 seeds) | mean KL mix | mean KL plans (3 seeds) | "
             "KL reduction [95% CI] | verdict | NLL increase, plan - mix [95% CI] | worst-10% KL reduction [95% CI] |",
             "|---|---:|---|---:|---|---|---|---|---|"]
    for size, v in result["verdicts"].items():
        p = v["primary"]
        plans_kl = ", ".join(f"{x:.5f}" for x in v["mean_kl"]["plans"])
        plans_bytes = ", ".join(str(x) for x in v["bytes"]["plans"])
        lines.append(f"| {size} | {v['bytes']['mix']} | {plans_bytes} | {v['mean_kl']['mix']:.5f} | {plans_kl} | "
                     f"{_interval({'estimate': p['estimate'], 'low': p['low'], 'high': p['high']})} | "
                     f"**{p['verdict']}** | {_interval(v['nll_difference'], 1, '', 4)} | "
                     f"{_interval(v['tail'])} |")
    return "\n".join(lines)


def additivity_table(result: dict[str, Any]) -> str:
    lines = ["| file | bytes | predicted KL (summed sensitivity) | realized mean KL | realized / predicted | "
             "mean NLL increase |", "|---|---:|---:|---:|---:|---:|"]
    for row in sorted(result["additivity"], key=lambda r: r["bytes"]):
        ratio = row["realized_kl"] / row["predicted_kl"] if row["predicted_kl"] else float("nan")
        lines.append(f"| {row['file']} | {row['bytes']} | {row['predicted_kl']:.5f} | {row['realized_kl']:.5f} | "
                     f"{ratio:.2f} | {row['realized_nll_increase']:.5f} |")
    return "\n".join(lines)


def reliability_table(result: dict[str, Any]) -> str:
    r = result["reliability"]
    reg = r["registered_over_weight_type_pairs"]
    lines = ["| what | split-half Spearman [95% CI] |", "|---|---|",
             f"| every (weight, type) pair (registered) | {reg['rho']:.3f} [{reg['low']:.3f}, {reg['high']:.3f}] |"]
    for t, v in r["within_type_not_registered"].items():
        if v.get("exact"):
            lines.append(f"| within {t} (not registered) | every score is 0: {t} stores this reference exactly |")
            continue
        lines.append(f"| within {t}, over weights (not registered) | {v['rho']:.3f} "
                     f"[{v['low']:.3f}, {v['high']:.3f}] |")
    seconds = ", ".join(f"{float(s):.0f}" for s in result["sensitivity_seconds"].values())
    lines.append(f"\nSensitivity pass per calibration seed: {seconds} s.")
    return "\n".join(lines)


def loader_table(result: dict[str, Any]) -> str:
    rows = result.get("loader_agreement") or []
    lines = ["| file | examples | mean KL, llama.cpp | mean KL, interp's loader | largest per-example KL difference | "
             "largest per-example NLL difference |", "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['file']} | {row['examples']} | {row['mean_kl_llama_cpp']:.5f} | "
                     f"{row['mean_kl_interp']:.5f} | {row['max_abs_kl_difference']:.5f} | "
                     f"{row['max_abs_nll_difference']:.5f} |")
    return "\n".join(lines)


def imatrix_table(result: dict[str, Any]) -> str:
    """What the importance matrix does to each file: registration 4's scores against registration 3's."""
    effect = result["imatrix_effect"]
    lines = ["| file | mean KL without imatrix | mean KL with interp's imatrix | KL reduction [95% CI] | instances |",
             "|---|---|---|---|---:|"]
    rows = [(mix, e) for mix, e in effect["mix"].items()] + [(f"plans at {size}", e) for size, e in
                                                              effect["plans"].items()]
    for name, e in rows:
        without = ", ".join(f"{x:.5f}" for x in e["mean_kl_without"])
        with_ = ", ".join(f"{x:.5f}" for x in e["mean_kl_with"])
        lines.append(f"| {name} | {without} | {with_} | {_interval(e)} | {e['instances']} |")
    seconds = result["imatrix"]["seconds"]
    lines.append(f"\nThe importance matrix: {result['imatrix']['tokens']} calibration tokens, {seconds:.0f} s "
                 "(interp imatrix, 2 threads).")
    return "\n".join(lines)


def tail_table(result: dict[str, Any]) -> str:
    """Registration 5: the tail plans against the mix (the registered primary) and against the mean plans."""
    lines = ["| size | worst-10% KL: mix | mean plans (reg. 3) | tail plans | tail plans vs mix, worst-10% KL "
             "reduction [95% CI] | verdict | tail vs mean plans, worst-10% KL [95% CI] | tail vs mean plans, mean KL "
             "(negative: the cost) [95% CI] |", "|---|---:|---|---|---|---|---|---|"]
    for size, v in result["verdicts"].items():
        m, t = result["against_mean_plans"][size], result["tail_verdicts"][size]
        lines.append(f"| {size} | {t['tail_kl_mix']:.5f} | "
                     f"{', '.join(f'{x:.5f}' for x in m['tail_kl_mean_plans'])} | "
                     f"{', '.join(f'{x:.5f}' for x in t['tail_kl_plans'])} | {_interval(v['tail'])} | "
                     f"**{t['verdict']}** | {_interval(m['tail'])} | {_interval(m['mean'])} |")
    lines += ["", "| plan | predicted worst-10% KL (calibration): mean-optimal | chosen | predicted mean KL, chosen | "
              "rounds | types equal to registration 3's plan |", "|---|---:|---:|---:|---:|---|"]
    for name, p in result["predicted"].items():
        lines.append(f"| {name} | {p['tail_mean_optimal']:.5f} | {p['tail_chosen']:.5f} | {p['mean_chosen']:.5f} | "
                     f"{p['rounds']} | {'yes' if p['same_types_as_registration_3'] else 'no'} |")
    return "\n".join(lines)


def grid_table(result: dict[str, Any]) -> str:
    share = result["reference_grid_share"]
    lines = ["| file | block-weight bytes in the type the bundled GGUF gave that tensor |", "|---|---:|"]
    lines += [f"| {name} | {100 * value:.1f}% |" for name, value in share.items()]
    return "\n".join(lines)

DESIGNS = {"plans2": "every legacy type a candidate (the reference's own Q4_1 included)",
           "plans3": "mean objective, no candidate reproduces the reference",
           "plans4": "as 3, every file with an imatrix",
           "plans5": "tail objective (primary: worst 10%)", "plans7": "registration 3's design"}


def goal_table(data: dict[str, dict[str, Any]]) -> str:
    """Every registered plan-against-mix comparison read against issue 34's goal ("beats the `_M` type by >= 10% in
    held-out mean KL, with the interval excluding 0"), in both readings: the point estimate at 10% or more with the
    interval above 0, and the registrations' own stricter label (the interval's lower end at 10% or more)."""
    lines = ["| registration | model | design | size | `_M` type | mean-KL reduction [95% CI] | point >= 10%, interval "
             "above 0 | lower end >= 10% (registered label) |", "|---|---|---|---|---|---|---|---|"]
    for prefix, result in data.items():
        name = REGISTRATIONS[prefix]
        model = json.loads((ROOT / "docs" / "preregistration" / f"{name}.json").read_text())["model"]
        for size, v in result["verdicts"].items():
            p = v["primary"]
            literal = p["estimate"] >= 0.10 and p["low"] > 0
            lines.append(f"| {name} | {model} | {DESIGNS[prefix]} | {size} | {'yes' if size.endswith('_M') else 'no'} "
                         f"| {_interval(p)} | {'yes' if literal else 'no'} | {'yes' if p['low'] >= 0.10 else 'no'} |")
    return "\n".join(lines)


BLOCKS = {"verdicts": verdict_table, "additivity": additivity_table, "reliability": reliability_table,
          "loader": loader_table, "imatrix": imatrix_table, "tail": tail_table, "grid": grid_table}
# the result key each block renders
NEEDS = {"verdicts": "verdicts", "additivity": "additivity", "reliability": "reliability",
         "loader": "loader_agreement", "imatrix": "imatrix_effect", "tail": "against_mean_plans",
         "grid": "reference_grid_share"}


def results() -> dict[str, dict[str, Any]]:
    """Each registration's committed result, by block prefix (a registration without data is left out)."""
    found = {}
    for prefix, name in REGISTRATIONS.items():
        path = DATA / name / "result.json"
        if path.exists():
            found[prefix] = json.loads(path.read_text())
    return found


def render(page: str, data: dict[str, dict[str, Any]] | None = None) -> str:
    data = results() if data is None else data
    page = re.sub(r"<!-- goal:begin -->.*?<!-- goal:end -->",
                  lambda _: f"<!-- goal:begin -->\n{goal_table(data)}\n<!-- goal:end -->", page, flags=re.S)
    for prefix, result in data.items():
        for kind, build in BLOCKS.items():
            if NEEDS[kind] not in result:
                continue
            name = f"{prefix}_{kind}"
            block = f"<!-- {name}:begin -->\n{build(result)}\n<!-- {name}:end -->"
            page = re.sub(rf"<!-- {name}:begin -->.*?<!-- {name}:end -->", lambda _, text=block: text, page,
                          flags=re.S)
    return page


def pareto(data: dict[str, dict[str, Any]], title: str = "SmolLM2-135M through llama.cpp") -> Any:
    """File size against held-out mean KL: llama.cpp's mixes as points, interp's plans (seed means) as curves."""
    import plotly.graph_objects as go

    from interp.figures.style import styled

    fig = go.Figure()
    mixes = {row["file"]: row for result in data.values() for row in result.get("additivity", [])
             if not row["file"].startswith("plan-")}
    fig.add_trace(go.Scatter(x=[r["bytes"] / 1e6 for r in mixes.values()], y=[r["realized_kl"] for r in mixes.values()],
                             mode="markers+text", text=list(mixes), textposition="top left", name="llama.cpp mixes",
                             marker=dict(size=11, symbol="diamond")))
    with_imatrix = [row for result in data.values() for row in result.get("files", [])
                    if not row["file"].startswith("plan-")]
    if with_imatrix:
        fig.add_trace(go.Scatter(x=[r["bytes"] / 1e6 for r in with_imatrix], y=[r["mean_kl"] for r in with_imatrix],
                                 mode="markers+text", text=[f"{r['file']} + imatrix" for r in with_imatrix],
                                 textposition="bottom right", name="llama.cpp mixes with interp's imatrix",
                                 marker=dict(size=11, symbol="diamond-open")))
    labels = {"plans2": "interp plan, every legacy type (registration 2)",
              "plans3": "interp plan, Q4_1 excluded (registration 3)",
              "plans4": "registration 3's plans with interp's imatrix (registration 4)",
              "plans5": "interp plan minimizing the worst 10% (registration 5)",
              "plans7": "interp plan (registration 7: registration 3's design)"}
    for prefix, result in data.items():
        points = sorted((sum(v["bytes"]["plans"]) / len(v["bytes"]["plans"]) / 1e6,
                         sum(v["mean_kl"]["plans"]) / len(v["mean_kl"]["plans"])) for v in result["verdicts"].values())
        fig.add_trace(go.Scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="lines+markers",
                                 name=labels[prefix]))
    fig = styled(fig, f"{title}: file size against held-out KL (256 examples)",
                 "GGUF file size (MB)", "mean KL from the reference (nats per token)")
    sizes = [r["bytes"] / 1e6 for r in mixes.values()]
    fig.update_xaxes(range=[min(sizes) - 2, max(sizes) + 3])
    # the legend below the axes: above them it ran into the title once there were five series
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.16, xanchor="left", x=0), height=640,
                      margin=dict(b=170))
    fig.update_yaxes(type="log", tickvals=[0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0])
    return fig


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def figures() -> None:
        from interp.figures import export_static

        if "--figure" not in argv:
            return
        data = results()
        made = {"prescribe_llama_cpp_pareto": pareto({k: v for k, v in data.items() if k not in GEMMA})}
        if any(k in data for k in GEMMA):
            made["prescribe_llama_cpp_pareto_gemma"] = pareto({k: v for k, v in data.items() if k in GEMMA},
                                                              "Gemma-3-270m through llama.cpp")
        export_static(made, ROOT / "docs" / "img", formats=("png",))

    return refresh({PAGE: render(PAGE.read_text())}, "python docs/build_llama_cpp.py --write", "--write" in argv,
                   figures)


if __name__ == "__main__":
    raise SystemExit(main())
