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
sys.path.insert(0, str(ROOT / "docs"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import llama_cpp_curve_tensors as tensors  # noqa: E402
from _generated import refresh  # noqa: E402  (the one place generated files are written)

PAGE = ROOT / "docs" / "prescribe.md"
DATA = ROOT / "docs" / "data" / "prescribe" / "llama-cpp" / "llama-cpp-curve-1"
MODELS = ("smollm2-135m", "gemma3-270m")
BLOCK = re.compile(r"<!-- curve1:begin -->.*?<!-- curve1:end -->", re.S)
ARMS = {"plan_mean": "plan (mean)", "plan_tail": "plan (worst 10%)"}
KIND_LABELS = {"mix_plain": "llama.cpp mix", "mix_interp_imatrix": "llama.cpp mix + interp imatrix",
               "mix_llama_imatrix": "llama.cpp mix + llama-imatrix", "plan_mean": "interp plan (mean objective)",
               "plan_tail": "interp plan (tail objective)"}


SECOND = ("mix_llama_imatrix", "plan_tail")  # drawn dashed over their pair's solid line


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


def not_met(r: dict[str, Any]) -> list[tuple[str, str]]:
    """(size, arm) of every judged comparison whose registered verdict (the verdict table's) is not the goal."""
    from llama_cpp_curve_analysis import GOAL  # only with results: it imports the statistics

    return [(size, arm) for size, arms in r["primary"].items() for arm, p in arms.items()
            if p["status"] == "judged" and p["verdict"] != GOAL]


def where_the_bits_go(rows: list[dict[str, Any]]) -> str:
    lines = ["| tensors | third of the blocks | weights | llama.cpp mix: bits per weight (types) | "
             "plan: bits per weight, mean of the seeds (types, over the seeds) | mix - plan (bits per weight) | "
             "share of the mix's extra bytes |", "|---|---|---:|---|---|---:|---:|"]
    for x in rows:
        share = "" if x["extra_share"] is None else f"{100 * x['extra_share']:.1f}%"
        role = f"**{x['role']}**" if x["role"] == tensors.TOTAL else x["role"]
        mix_types = f" ({x['mix_types']})" if x["mix_types"] else ""
        plan_types = f" ({x['plan_types']})" if x["plan_types"] else ""
        lines.append(f"| {role} | {x['third']} | {x['weights']} | {x['mix_bits']:.3f}{mix_types} | "
                     f"{x['plan_bits']:.3f}{plan_types} | {x['difference']:+.3f} | {share} |")
    return "\n".join(lines)


def bits_section(r: dict[str, Any], folder: Path) -> list[str]:
    """"Where the bits go" at every judged size and arm whose verdict is not the goal, from the committed
    per-tensor records in ``folder`` (``tensor_types/``); nothing when every verdict is the goal."""
    found = not_met(r)
    if not found:
        return []
    parts = ["Where the bits go, at each size and arm whose verdict is not the goal: llama.cpp's mix (the same "
             "tensor types plain or with either importance matrix) against the plan's files (their mean bytes over "
             "the seeds), by role and third of the blocks, from each file's tensors as stored. Bits per weight = "
             "8 x bytes / weights; the last column is each row's share of the bytes the mix spends beyond the "
             "plan, over the rows where it spends more."]
    for size, arm in found:
        mix = folder / f"mix_plain-{size}.json"
        plans = [folder / f"{arm}-{size}-{seed}.json" for seed in r["seeds"]]
        title = f"**{size}, {ARMS[arm]}** ({r['primary'][size][arm]['verdict']})"
        missing = [p.name for p in (mix, *plans) if not p.exists()]
        if missing:
            parts.append(f"{title}: no tensor-type record ({', '.join(missing)}).")
            continue
        rows = tensors.bits_table(tensors.read_record(mix)["tensors"],
                                  [tensors.read_record(p)["tensors"] for p in plans])
        parts += [f"{title}:", where_the_bits_go(rows)]
    return parts


def headline(r: dict[str, Any]) -> str:
    judged = [s for s, v in r["sizes"]["sizes"].items() if v["judged"]]
    parts = []
    for arm, counts in r["headline"].items():
        found = ", ".join(f"{k}: {v}" for k, v in counts.items() if v) or "nothing judged"
        parts.append(f"{ARMS[arm]}: {found}")
    return (f"Sizes judged: {', '.join(judged)} ({len(judged)} of {len(r['sizes']['sizes'])}). "
            f"Verdict counts, {'; '.join(parts)}.")


def same_files(r: dict[str, Any], folder: Path) -> str:
    """Sizes whose plain mixes llama-quantize makes as one file (the same tensors, types and bytes in the committed
    records): their rows measure the same files, so they are one point of the curve listed at each size."""
    groups: dict[str, list[str]] = {}
    for size in r["sizes"]["sizes"]:
        path = folder / f"mix_plain-{size}.json"
        if path.is_file():
            groups.setdefault(json.dumps(tensors.read_record(path)["tensors"], sort_keys=True), []).append(size)
    same = [sizes for sizes in groups.values() if len(sizes) > 1]
    if not same:
        return ""

    def scored(size: str) -> list[Any]:
        return [[row["kind"], row["bytes"], row["mean_kl"]["estimate"], row["p99"], row["p999"], row["same_top"]]
                for row in r["pareto"] if row["size"] == size]

    parts = []
    for sizes in same:
        alike = all(scored(z) == scored(sizes[0]) for z in sizes[1:])
        parts.append(" and ".join(sizes) + (" (and every file of these sizes, plans included, has the same bytes and "
                                            "held-out scores, so their rows are one measurement counted at each size)"
                                            if alike else " (their plans' files or scores differ)"))
    return (f"One file, several sizes: on this model llama-quantize makes the same plain mix for {'; '.join(parts)}: "
            "every tensor's type and bytes are the same in the committed records.")


def model_section(model: str, r: dict[str, Any] | None, tensor_types: Path | None = None) -> str:
    """One model's part of the section; ``tensor_types``: the folder of its per-tensor records (default: the
    committed ``tensor_types/`` beside its result)."""
    if r is None:
        return f"#### {model}\n\n{progress(model)}"
    figure = figure_path(model).relative_to(ROOT / "docs")
    folder = tensor_types or DATA / model / "tensor_types"
    return "\n\n".join(part for part in [
        f"#### {model}", headline(r), same_files(r, folder),
        f"![{model}: file size against held-out mean KL]({figure})",
        "Primary: R = 1 - mean KL(plan) / mean KL(mix with an importance matrix), the seeds' pairs crossed with the "
        f"{len(r['examples']['heldout_ids'])} held-out examples ({r['n_boot']} resamples).", verdict_table(r),
        "Tails against each importance-matrix mix (a ratio's lower end above 1, or a difference's upper end below 0, "
        "is 'worse'):", tail_table(r), *bits_section(r, folder),
        "Secondary rows:", secondary_table(r), "Every file:", pareto_table(r),
        additivity_table(r)] if part)


def progress(model: str, folder: Path | None = None) -> str:
    """What a model without a result has done: nothing, or the sizes its kept run state has finished (a size is
    finished when its tensor-type records are written, after its last score)."""
    folder = folder or DATA / model
    where = f"`docs/data/prescribe/llama-cpp/llama-cpp-curve-1/{model}/`"
    if not (folder / "run.json").is_file():
        return f"Not run yet: no committed result under {where}."
    sizes = json.loads((folder / "sizes.json").read_text())["sizes"] if (folder / "sizes.json").is_file() else {}
    done = [z for z in sizes if (folder / "tensor_types" / f"mix_plain-{z}.json").is_file()]
    saved = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("partial/*.json"))}
    being = "; ".join(f"{size}: {meta['done']} of {meta['of']} examples" for size, meta in saved.items())
    return (f"In progress: {len(done)} of {len(sizes) or 'its'} sizes scored ({', '.join(done) or 'none yet'}). "
            + (f"Being scored (saved so far): {being}. " if being else "")
            + f"The run's state is kept under {where} and `benchmarks/llama_cpp_curve.py --model {model}` resumes it; "
            "no verdict is read before every size is scored.")


DIAGNOSTIC = ROOT / "docs" / "data" / "prescribe" / "llama-cpp" / "diagnostics" / "smollm2-q3kl.json"


def imatrix_means(sizes: tuple[str, ...], folder: Path | None = None) -> dict[str, float]:
    """Held-out mean KL of SmolLM2's llama-imatrix mix per size, averaged over the curve's seeds (committed scores);
    a size not scored yet is left out."""
    import pandas as pd

    scores = (folder or DATA / "smollm2-135m") / "scores"
    out = {}
    for size in sizes:
        files = sorted(scores.glob(f"mix_llama_imatrix-{size}-*.parquet"))
        if files:
            out[size] = sum(float(pd.read_parquet(f)["kl"].mean()) for f in files) / len(files)
    return out


def diagnostic_section(path: Path = DIAGNOSTIC) -> str:
    """Why SmolLM2's plain Q3_K_L scores worse than its plain Q3_K_M: ``benchmarks/llama_cpp_mix_roles.py``'s
    committed result rendered (nothing when it has not been run)."""
    if not path.is_file():
        return ""
    r = json.loads(path.read_text())
    files, err = r["files"], r["weight_relative_error"]

    def diff(label: str) -> str:
        d = files[label]["against_Q3_K_M"]
        return (f"{d['difference']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}], worse on "
                f"{100 * d['share_of_examples_worse']:.0f}% of examples")

    rows = ["| file | bytes | mean KL | minus plain Q3_K_M (95% interval) |", "|---|---:|---:|---|"]
    for label, f in files.items():
        rows.append(f"| {label} | {f['bytes']:,} | {f['mean_kl']:.4f} | "
                    f"{'—' if f['against_Q3_K_M'] is None else diff(label)} |")
    single = sum(f["against_Q3_K_M"]["difference"] for label, f in files.items() if "+" in label)
    whole = files["Q3_K_L"]["against_Q3_K_M"]["difference"]
    imatrix = "; ".join(f"{size} {kl:.4f}" for size, kl in imatrix_means(("Q3_K_M", "Q3_K_L")).items())
    imatrix = f"llama-imatrix mixes, mean KL over the curve's seeds, {imatrix}" if imatrix else "n/a"
    werr = "; ".join(f"`{role}` " + ", ".join(f"{t.upper()} {100 * v:.2f}%" for t, v in types.items())
                     for role, types in err.items())
    return "\n\n".join([
        "#### A diagnostic, not registered: why SmolLM2's plain Q3_K_L scores worse than its plain Q3_K_M",
        "On SmolLM2 plain Q3_K_L stores every tensor at as many bits as plain Q3_K_M or more (`attn_v` and "
        "`attn_output` Q5_1 for Q5_0, `ffn_down` Q5_K for Q4_K; the other roles fall back to the same legacy types "
        "because 576 is not a multiple of 256), yet its held-out mean KL is higher. "
        "`benchmarks/llama_cpp_mix_roles.py` gives plain Q3_K_M one of Q3_K_L's types at a time "
        f"(`--tensor-type`) and scores each file on the curve's {r['examples']} held-out examples through llama.cpp, "
        "paired with plain Q3_K_M (bootstrap over examples):",
        "\n".join(rows),
        "Relative weight error ||Q(W) - W|| / ||W|| over every block weight of the role, without an importance "
        f"matrix, as llama-quantize rounds: {werr}. The reference is the bundled GGUF's Q4_1 weights in F32, so "
        "every block of 32 weights holds at most 16 evenly spaced values; on such weights llama-quantize's Q5_1 "
        "stores `attn_v` and `attn_output` less exactly than Q5_0, and its Q5_K stores `ffn_down` less exactly than "
        "Q4_K (whose 32-weight sub-blocks with a scale and an offset can nearly hold a Q4_1 block). Held-out KL "
        "follows that for `attn_v` (most of the loss) and `attn_output`, not measurably for `ffn_down`; the three "
        f"single-role changes add up to {single:+.4f} of Q3_K_L's {whole:+.4f}, the rest coming from the roles "
        f"together. With an importance matrix the order is as expected: {imatrix}. This is a property of requantizing "
        "a 4-bit reference, not a finding about Q3_K_L on original weights.",
    ])


def section(data: dict[str, dict[str, Any]]) -> str:
    parts = [model_section(m, data.get(m)) for m in MODELS]
    return "\n\n".join(parts + [d for d in [diagnostic_section()] if d])


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
            line=dict(dash="dash" if kind in SECOND else "solid"),  # a pair that overlaps stays visible
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

    def figures() -> None:
        from interp.figures import export_static

        if "--figure" in argv:
            made = {figure_path(m).stem: pareto(r, m) for m, r in results().items()}
            export_static(made, ROOT / "docs" / "img", formats=("png",))

    return refresh({PAGE: render(PAGE.read_text())}, "python docs/build_llama_cpp_curve.py --write", "--write" in argv,
                   figures)


if __name__ == "__main__":
    raise SystemExit(main())
