"""Write docs/prescribe.md's size-curve section (llama-cpp-curve-1) from the committed results.

The run (``benchmarks/llama_cpp_curve.py``, pre-registered in ``docs/preregistration/llama-cpp-curve-1.json``)
writes ``docs/data/prescribe/llama-cpp/llama-cpp-curve-1/<model>/result.json``; this script only renders it
between ``<!-- curve1:begin -->`` and ``<!-- curve1:end -->``, saying "not run yet" for a model without data,
so no number on the page is typed by hand (``tests/test_llama_cpp_curve.py`` checks the page against the data).

    python docs/build_llama_cpp_curve.py --write [--figure]    # or --check
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "prescribe.md"
DATA = ROOT / "docs" / "data" / "prescribe" / "llama-cpp" / "llama-cpp-curve-1"
MODELS = ("smollm2-135m", "gemma3-270m")
BLOCK = re.compile(r"<!-- curve1:begin -->.*?<!-- curve1:end -->", re.S)
ARMS = {"plan_mean": "plan (mean)", "plan_tail": "plan (worst 10%)"}
KIND_LABELS = {"mix_plain": "llama.cpp mix", "mix_interp_imatrix": "llama.cpp mix + interp imatrix",
               "mix_llama_imatrix": "llama.cpp mix + llama-imatrix", "plan_mean": "interp plan (mean objective)",
               "plan_tail": "interp plan (tail objective)"}


def figure_path(model: str) -> Path:
    return ROOT / "docs" / "img" / f"prescribe_llama_cpp_curve_{model}.png"


def results() -> dict[str, dict[str, Any]]:
    """Each model's committed result (a model not run yet is left out)."""
    return {m: json.loads((DATA / m / "result.json").read_text()) for m in MODELS
            if (DATA / m / "result.json").exists()}


def _ci(d: dict[str, Any], percent: bool = True, digits: int = 1) -> str:
    if percent:
        return f"{100 * d['estimate']:+.{digits}f}% [{100 * d['low']:+.{digits}f}, {100 * d['high']:+.{digits}f}]"
    return f"{d['estimate']:.{digits}f} [{d['low']:.{digits}f}, {d['high']:.{digits}f}]"


def _reading(p: dict[str, Any]) -> str:
    bound = p.get("deciding_bound")
    if not bound:
        return p["reading"]
    se = "n/a" if not math.isfinite(bound["mc_se"]) else f"{bound['mc_se']:.4f}"
    return (f"{p['reading']} ({bound['bound']} {bound['value']:+.4f} vs {bound['threshold']:g}, Monte Carlo SE {se}, "
            f"{bound['distance_se']:.1f} SE)")


def verdict_table(r: dict[str, Any]) -> str:
    lines = ["| size | mix bytes | arm | R vs interp-imatrix mix [95% CI] | R vs llama-imatrix mix [95% CI] | "
             "tails worse | verdict (deciding bound) |", "|---|---:|---|---|---|---|---|"]
    for size, arms in r["primary"].items():
        nbytes = r["sizes"]["sizes"][size]["bytes"]
        for arm, p in arms.items():
            if p["status"] not in ("judged",) and "estimates" not in p:
                lines.append(f"| {size} | {nbytes} | {ARMS[arm]} | | | | {p['status']} |")
                continue
            e = p["estimates"]
            worse = "; ".join(f"{b}: {', '.join(w)}" for b, w in p.get("tails_worse", {}).items() if w) or "none"
            verdict = f"**{_reading(p)}**" if p["status"] == "judged" else p["status"]
            lines.append(f"| {size} | {nbytes} | {ARMS[arm]} | {_ci(e['R_interp'])} | {_ci(e['R_llama'])} | "
                         f"{worse if p['status'] == 'judged' else ''} | {verdict} |")
    return "\n".join(lines)


def tail_table(r: dict[str, Any]) -> str:
    lines = ["| size | arm | baseline | p99 ratio [95% CI] | p99.9 ratio [95% CI] | same-top difference, points "
             "[95% CI] |", "|---|---|---|---|---|---|"]
    for size, arms in r["primary"].items():
        for arm, p in arms.items():
            if "estimates" not in p:
                continue
            e = p["estimates"]
            for b, label in (("interp", "interp imatrix"), ("llama", "llama-imatrix")):
                lines.append(f"| {size} | {ARMS[arm]} | {label} | {_ci(e[f'p99_{b}'], False, 3)} | "
                             f"{_ci(e[f'p999_{b}'], False, 3)} | {_ci(e[f'same_top_{b}'], True, 2)} |")
    return "\n".join(lines)


def secondary_table(r: dict[str, Any]) -> str:
    lines = ["| size | plan vs plain mix: R [95% CI], verdict (mean arm; tail arm) | mean KL: interp-imatrix mix | "
             "llama-imatrix mix | difference [95% CI] | better imatrix for llama.cpp |", "|---|---|---:|---:|---|---|"]
    for size, arms in r["secondary"]["against_plain"].items():
        cells = []
        for arm in ARMS:
            p = arms[arm]
            cells.append(p["status"] if "estimates" not in p else f"{_ci(p['estimates']['R_plain'])}, {p['reading']}")
        c = r["secondary"]["imatrix_choice"][size]
        kinds = {row["kind"]: row for row in r["pareto"] if row["size"] == size}
        lines.append(f"| {size} | {'; '.join(cells)} | {kinds['mix_interp_imatrix']['mean_kl']['estimate']:.5f} | "
                     f"{kinds['mix_llama_imatrix']['mean_kl']['estimate']:.5f} | {_ci(c, False, 5)} | "
                     f"{c['better']} |")
    return "\n".join(lines)


def pareto_table(r: dict[str, Any]) -> str:
    lines = ["| size | file | bytes (per seed) | mean KL [95% CI] | p99 KL | p99.9 KL | same top token |",
             "|---|---|---|---|---|---|---|"]
    for row in r["pareto"]:
        def many(values: list[float], fmt: str) -> str:
            return ", ".join(format(v, fmt) for v in values)
        lines.append(f"| {row['size']} | {KIND_LABELS[row['kind']]} | {many(row['bytes'], 'd')} | "
                     f"{_ci(row['mean_kl'], False, 5)} | {many(row['p99'], '.4f')} | {many(row['p999'], '.4f')} | "
                     f"{many([100 * x for x in row['same_top']], '.2f')}% |")
    return "\n".join(lines)


def additivity_table(r: dict[str, Any]) -> str:
    rows = r["secondary"]["additivity"]
    inside = sum(1 for x in rows if x["within_10_percent"])
    lines = [f"Realized over predicted mean KL, per plan file ({inside} of {len(rows)} within issue 47's 0.9-1.1):",
             "", "| file | predicted (summed sensitivity) | realized | realized / predicted |", "|---|---:|---:|---:|"]
    lines += [f"| {x['file']} | {x['predicted_kl']:.5f} | {x['realized_kl']:.5f} | {x['ratio']:.2f} |" for x in rows]
    return "\n".join(lines)


def headline(r: dict[str, Any]) -> str:
    judged = [s for s, v in r["sizes"]["sizes"].items() if v["judged"]]
    parts = []
    for arm, counts in r["headline"].items():
        found = ", ".join(f"{k}: {v}" for k, v in counts.items() if v) or "nothing judged"
        parts.append(f"{ARMS[arm]}: {found}")
    return (f"Sizes judged: {', '.join(judged)} ({len(judged)} of {len(r['sizes']['sizes'])}). "
            f"Verdict counts, {'; '.join(parts)}.")


def model_section(model: str, r: dict[str, Any] | None) -> str:
    if r is None:
        return (f"#### {model}\n\nNot run yet: no committed result under "
                f"`docs/data/prescribe/llama-cpp/llama-cpp-curve-1/{model}/`.")
    figure = figure_path(model).relative_to(ROOT / "docs")
    return "\n\n".join([
        f"#### {model}", headline(r), f"![{model}: file size against held-out mean KL]({figure})",
        "Primary: R = 1 - mean KL(plan) / mean KL(mix with an importance matrix), the seeds' pairs crossed with the "
        f"{len(r['examples']['heldout_ids'])} held-out examples ({r['n_boot']} resamples).", verdict_table(r),
        "Tails against each importance-matrix mix (a ratio's lower end above 1, or a difference's upper end below 0, "
        "is 'worse'):", tail_table(r), "Secondary rows:", secondary_table(r), "Every file:", pareto_table(r),
        additivity_table(r)])


def section(data: dict[str, dict[str, Any]]) -> str:
    return "\n\n".join(model_section(m, data.get(m)) for m in MODELS)


def render(page: str, data: dict[str, dict[str, Any]] | None = None) -> str:
    data = results() if data is None else data
    text = f"<!-- curve1:begin -->\n{section(data)}\n<!-- curve1:end -->"
    return BLOCK.sub(lambda _: text, page)


def pareto(r: dict[str, Any], model: str) -> Any:
    """Bytes of the whole file against held-out mean KL: every kind's files (seed means, with their interval),
    each kind's points joined in size order."""
    import plotly.graph_objects as go

    from interp.figures.style import styled

    fig = go.Figure()
    for kind, label in KIND_LABELS.items():
        rows = sorted((row for row in r["pareto"] if row["kind"] == kind), key=lambda row: sum(row["bytes"]))
        if not rows:
            continue
        kl = [row["mean_kl"] for row in rows]
        fig.add_trace(go.Scatter(
            x=[sum(row["bytes"]) / len(row["bytes"]) / 1e6 for row in rows], y=[k["estimate"] for k in kl],
            mode="lines+markers", name=label, text=[row["size"] for row in rows],
            error_y=dict(type="data", symmetric=False, array=[k["high"] - k["estimate"] for k in kl],
                         arrayminus=[k["estimate"] - k["low"] for k in kl])))
    fig = styled(fig, f"{model} through llama.cpp: file size against held-out mean KL (llama-cpp-curve-1)",
                 "GGUF file size (MB)", "mean KL from the reference (nats per token)")
    fig.update_yaxes(type="log")
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.16, xanchor="left", x=0), height=640,
                      margin=dict(b=170))
    return fig


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    page = PAGE.read_text()
    new = render(page)
    if "--write" in argv:
        PAGE.write_text(new)
        if "--figure" in argv:
            from interp.figures import export_static

            figures = {figure_path(m).stem: pareto(r, m) for m, r in results().items()}
            export_static(figures, ROOT / "docs" / "img", formats=("png",))
        return 0
    if new != page:
        print("docs/prescribe.md's curve section differs from the data: run python docs/build_llama_cpp_curve.py "
              "--write")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
