"""Write the llama.cpp comparison tables of docs/prescribe.md from docs/data/prescribe/llama-cpp/result.json.

The run (``benchmarks/llama_cpp_plans.py``, pre-registered in
``docs/preregistration/llama-cpp-plans-2.json``) writes the data; this script only renders it, so
no number on the page is typed by hand (``tests/test_docs.py`` checks the page against the data).

    python docs/build_llama_cpp.py --write    # or --check
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "prescribe.md"
RESULT = ROOT / "docs" / "data" / "prescribe" / "llama-cpp" / "result.json"


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


BLOCKS = {"llamacpp_verdicts": verdict_table, "llamacpp_additivity": additivity_table,
          "llamacpp_reliability": reliability_table, "llamacpp_loader": loader_table}


def render(page: str, result: dict[str, Any] | None = None) -> str:
    result = result if result is not None else json.loads(RESULT.read_text())
    for name, build in BLOCKS.items():
        block = f"<!-- {name}:begin -->\n{build(result)}\n<!-- {name}:end -->"
        page = re.sub(rf"<!-- {name}:begin -->.*?<!-- {name}:end -->", lambda _, text=block: text, page, flags=re.S)
    return page


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    page = PAGE.read_text()
    new = render(page)
    if "--write" in argv:
        PAGE.write_text(new)
        return 0
    if new != page:
        print("docs/prescribe.md's llama.cpp tables differ from the data: run python docs/build_llama_cpp.py --write")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
