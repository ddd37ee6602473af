"""Regenerate the cross-check tables in docs/quantization_methods.md from docs/data/crosscheck.

Reads ``crosscheck.csv`` (crosscheck.py), ``crosscheck_gptq.csv`` (gptq_library.py),
``crosscheck_awq.csv`` (awq_library.py), ``kernels.json``
(real_kernels.py), ``export_nll.json`` (export_nll.py) where present, and, for the yardstick, the committed
self-agreement data: the AVX2 vs AVX-512 runs (``docs/data/reproduction/sensitivity``, per-example NLL,
recomputed here on all 128 examples and on the first N, the cross-check's examples) and the
across-calibration-sample self-agreement of the confirmatory report (``summary.json``). Each table is
written between ``<!-- crosscheck-NAME:begin -->`` and ``<!-- crosscheck-NAME:end -->``.

    .venv/bin/python benchmarks/crosscheck/table.py [--check]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "data" / "crosscheck"
PAGE = ROOT / "docs" / "quantization_methods.md"
SENSITIVITY = ROOT / "docs" / "data" / "reproduction" / "sensitivity"
SUMMARY = ROOT / "docs" / "data" / "reproduction" / "smollm2-confirmatory-1" / "summary.json"

sys.path.insert(0, str(Path(__file__).parent))
from crosscheck import top_jaccard  # noqa: E402


def fmt(value: float, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def share(value: float) -> str:
    return f"{100 * value:.4f}%" if value < 1 else "100%"


def library_rows() -> str:
    frames = [pd.read_csv(DATA / "crosscheck.csv")]
    for name in ("crosscheck_gptq.csv", "crosscheck_awq.csv"):
        if (DATA / name).exists():
            frames.append(pd.read_csv(DATA / name))
    lines = ["| ours | library | bits | same grid level | relative weight difference | Pearson (errors) "
             "| top-10% Jaccard | mean error ours | mean error theirs | n |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for frame in frames:
        for row in frame.itertuples():
            pearson = getattr(row, "pearson", float("nan"))
            jaccard = getattr(row, "top10_jaccard", float("nan"))
            lines.append(f"| `{row.ours}` | {row.library} | {row.bits} | {share(row.same_level_share)} "
                         f"| {fmt(row.relative_weight_difference, 4)} | {fmt(pearson, 4)} | {fmt(jaccard, 2)} "
                         f"| {fmt(getattr(row, 'mean_error_ours', float('nan')))} "
                         f"| {fmt(getattr(row, 'mean_error_theirs', float('nan')))} | {row.n} |")
    return "\n".join(lines)


def self_agreement(n_first: int) -> str:
    a = json.loads((SENSITIVITY / "smollm2_avx2.json").read_text())
    b = json.loads((SENSITIVITY / "smollm2_avx512.json").read_text())
    lines = ["| what changed | spec | n | Pearson (errors) | top-10% Jaccard |", "|---|---|---|---|---|"]
    for spec in (k for k in a if ":" in k):
        for n in (len(a["reference"]), n_first):
            e_a = torch.tensor(a[spec][:n]) - torch.tensor(a["reference"][:n])
            e_b = torch.tensor(b[spec][:n]) - torch.tensor(b["reference"][:n])
            lines.append(f"| our code, {a['cpu_capability']} -> {b['cpu_capability']} kernels | `{spec}` | {n} "
                         f"| {fmt(float(torch.corrcoef(torch.stack([e_a, e_b]))[0, 1]), 2)} "
                         f"| {fmt(top_jaccard(e_a, e_b), 2)} |")
    summary = json.loads(SUMMARY.read_text())["self_agreement"]
    for spec, entry in summary.items():
        p, j = entry["pearson"], entry["jaccard"]
        lines.append(f"| our code, 3 calibration samples (confirmatory report) | `{spec}` | {p['n']} "
                     f"| {fmt(p['value'], 2)} [{fmt(p['low'], 2)}, {fmt(p['high'], 2)}] "
                     f"| {fmt(j['value'], 2)} [{fmt(j['low'], 2)}, {fmt(j['high'], 2)}] |")
    return "\n".join(lines)


def kernels() -> str | None:
    if not (DATA / "kernels.json").exists():
        return None
    k = json.loads((DATA / "kernels.json").read_text())
    return "\n".join([
        "| real kernel | fake quant | n | weights max abs diff, as loaded | in the kernel (relative) "
        "| Pearson (errors) | top-10% Jaccard | mean error fake | mean error real | mean real - fake "
        "| max abs NLL diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| bitsandbytes Linear4bit, NF4, blocksize 64, fp32 compute_dtype; repacked for the AVX512-BF16 CPU "
        f"kernel: {'yes' if k['cpu_repacked'] == [True] else k['cpu_repacked']}, absmax "
        f"{', '.join(d.removeprefix('torch.') for d in k['kernel_absmax_dtype'])} "
        f"| `{k['fake']}` | {k['n']} | {k['weights_max_abs_diff_as_loaded']:.1e} "
        f"| {k['weights_max_abs_diff_in_kernel']:.1e} ({k['weights_relative_difference_in_kernel']:.1e}) "
        f"| {fmt(k['pearson'], 4)} | {fmt(k['top10_jaccard'], 2)} | {fmt(k['mean_error_fake'], 4)} "
        f"| {fmt(k['mean_error_real'], 4)} | {k['mean_difference_real_minus_fake']:.1e} "
        f"| {k['max_abs_nll_difference']:.1e} |"])


def export_nll() -> str | None:
    if not (DATA / "export_nll.json").exists():
        return None
    rows = json.loads((DATA / "export_nll.json").read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    lines = ["| spec | n | max abs NLL diff, export vs fake quant (plain transformers) | max abs diff, export vs "
             "interp.nll | tolerance | mean NLL export | mean NLL interp | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['spec']}` | {r['n']} | {r['max_abs_export_minus_fake_plain']:.1e} "
                     f"| {r['max_abs_export_minus_interp']:.1e} | {r.get('tolerance', float('nan')):.1e} "
                     f"| {fmt(r['mean_nll_export'], 4)} | {fmt(r['mean_nll_interp'], 4)} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def render(page: str) -> str:
    n_first = int(pd.read_csv(DATA / "crosscheck.csv")["n"].iloc[0])
    tables = {"libraries": library_rows(), "self": self_agreement(n_first), "kernels": kernels(),
              "export": export_nll()}
    for name, table in tables.items():
        if table is None:
            continue
        pattern = re.compile(rf"(<!-- crosscheck-{name}:begin -->\n).*?(<!-- crosscheck-{name}:end -->)", re.S)
        if not pattern.search(page):
            raise SystemExit(f"{PAGE} has no crosscheck-{name} markers")
        page = pattern.sub(lambda m, t=table: m.group(1) + t + "\n" + m.group(2), page)
    return page


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="fail if the page is not what the data give")
    args = parser.parse_args()
    page = PAGE.read_text()
    new = render(page)
    if args.check:
        if new != page:
            raise SystemExit(f"{PAGE} is stale: run benchmarks/crosscheck/table.py")
        return
    PAGE.write_text(new)


if __name__ == "__main__":
    main()
