"""Write the tables of docs/reproduction.md from the committed data, so that no number in them is typed by hand.

    python docs/build_reproduction.py --write     # rewrite docs/reproduction.md's blocks and side_by_side.csv
    python docs/build_reproduction.py --check     # exit 1 when the page and the data differ (tests/test_docs.py)

Every column is re-judged by today's rules (``interp.report.reproduction``) from the measurements its
run stored (``results.json`` of a report; ``reproduction.csv`` of the confirmatory analysis). Two
statistics of the exploratory runs predate today's definitions and are converted here, not re-measured:

- ``reversal_h_mse`` stored the count of upper layers whose interval *reaches* 0.6; the count wholly
  below is the rest (an interval that does not reach 0.6 lies wholly below it);
- ``agreement_disattenuated`` stored the classical split-half correction, which shared reference noise
  inflates (issue 21); it carries no verdict, and the cell says what was measured.

The generated blocks sit between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` markers.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from interp.report import reproduction as rp  # noqa: E402  (the checkout's own package)
from interp.report.stages.saobp_training import (  # noqa: E402
    saobp_log_folder,
    saobp_seed_table,
    training_measurements,
)

RENAMED = {  # claims whose wording changed since a report printed them: today's text -> the old text
    "Per-example errors agree across methods once token noise is removed (this project's noise ceiling)":
        "Per-example errors agree across methods once measurement noise is removed (this project's noise ceiling)",
}

DATA = ROOT / "docs" / "data" / "reproduction"
PAGE = ROOT / "docs" / "reproduction.md"
EXPLORATORY = DATA / "smollm2-wiki-2026-12-01"  # the newest complete SmolLM2 report (AVX-512 kernels)
EARLIER = DATA / "smollm2-wiki"  # the earlier complete SmolLM2 report (kernels not recorded)
GEMMA = DATA / "gemma3-wiki"
CONFIRMATORY = DATA / "smollm2-confirmatory-1"


def _legacy(key: str, m: rp.Measurement) -> rp.Measurement:
    """A stored measurement in today's form (see the module docstring)."""
    est = m.estimates
    if key == "reversal_h_mse" and "layers_reaching" in est and "layers_below" not in est:
        below = est["upper_layers"].value - est["layers_reaching"].value
        return rp.Measurement({**est, "layers_below": rp.Estimate(below, below, below)},
                              m.text.replace("reach it", "reach it, the rest lie wholly below"), m.untestable)
    if key == "agreement_disattenuated" and "ceiling" not in est and m.untestable is None:
        return rp.Measurement(est, m.text, "correction not valid here: this run used the classical split-half "
                                           "correction, which shared reference noise inflates (its interval reaches "
                                           "above 1 or its pairs do); the disjoint-token correction needs per-token "
                                           "data that this run did not commit")
    return m


def report_measurements(folder: Path) -> dict[str, rp.Measurement]:
    """A report's stored measurements in today's form; the SAOBP training rows are measured again from the
    committed per-seed logs (model-independent, and the GTD row is new)."""
    results = json.loads((folder / "results.json").read_text())
    out: dict[str, rp.Measurement] = {}
    for numbers in results["numbers"].values():
        for key, raw in (numbers.get("claims") or {}).items():
            out[key] = _legacy(key, rp.measurement_from_dict(raw))
    logs = saobp_log_folder("")
    out.update(training_measurements(saobp_seed_table(logs), logs))
    return out


def report_table(folder: Path) -> pd.DataFrame:
    return rp.reproduction_frame(report_measurements(folder))


def report_kernels(folder: Path) -> str:
    versions = json.loads((folder / "results.json").read_text()).get("versions", {})
    return versions.get("cpu kernels", "not recorded")


def earlier_verdicts(folder: Path) -> dict[str, str]:
    """The verdicts a report printed under the rules of its day (holds / partly / does not hold ...)."""
    rows = json.loads((folder / "results.json").read_text())["reproduction"]
    return {row["claim"]: row["verdict"] for row in rows}


def columns() -> dict[str, pd.DataFrame]:
    tables = {"SmolLM2 exploratory (n=128)": report_table(EXPLORATORY)}
    if (CONFIRMATORY / "reproduction.csv").exists():
        tables["SmolLM2 confirmatory (held-out)"] = pd.read_csv(CONFIRMATORY / "reproduction.csv")
    tables["Gemma-3-270m (n=128)"] = report_table(GEMMA)
    return tables


def main_table() -> str:
    table = rp.side_by_side(columns())
    return rp.markdown_table(table.drop(columns=["paper"]))


def provenance() -> str:
    """Where each column comes from: folder, examples, kernels."""
    rows = []
    for name, folder in (("SmolLM2 exploratory (n=128)", EXPLORATORY), ("Gemma-3-270m (n=128)", GEMMA)):
        s = json.loads((folder / "results.json").read_text())["settings"]
        rows.append({"column": name, "data": f"`{folder.relative_to(ROOT)}`", "examples": f"{s['n']} x {s['seq_len']}",
                     "methods": len(s["methods"]), "CPU kernels": report_kernels(folder),
                     "selected and measured on": "the same examples and the same quantized model"})
    if (CONFIRMATORY / "summary.json").exists():
        s = json.loads((CONFIRMATORY / "summary.json").read_text())
        rows.insert(1, {"column": "SmolLM2 confirmatory (held-out)", "data": f"`{CONFIRMATORY.relative_to(ROOT)}`",
                        "examples": f"{s['n']} x 128 (held out), D_large {s['d_large']}",
                        "methods": 5, "CPU kernels": s["kernels"],
                        "selected and measured on": f"D_large selected on instance 0, measured on instances 1-"
                                                    f"{s['instances'] - 1}; pre-registration `{s['preregistration']}` "
                                                    f"(SHA-256 {s['preregistration_sha256'][:12]})"})
    return rp.markdown_table(pd.DataFrame(rows))


def changed_verdicts() -> str:
    """Every SmolLM2 and Gemma verdict under the rules of the run's day against today's."""
    rows = []
    for name, folder in (("SmolLM2 exploratory", EXPLORATORY), ("Gemma-3-270m", GEMMA)):
        before = earlier_verdicts(folder)
        for row in report_table(folder).itertuples(index=False):
            old = before.get(RENAMED.get(row.claim, row.claim), "(new row)")
            rows.append({"column": name, "claim": row.claim, "before (old rules)": old,
                         "now": row.verdict, "why": row.why})
    return rp.markdown_table(pd.DataFrame(rows))


def machines() -> str:
    """The two complete SmolLM2 reports from two machines, verdict by verdict, under today's rules."""
    a, b = report_table(EARLIER), report_table(EXPLORATORY)
    ka, kb = report_kernels(EARLIER), report_kernels(EXPLORATORY)
    rows = []
    for ra, rb in zip(a.itertuples(index=False), b.itertuples(index=False), strict=True):
        if ra.verdict != rb.verdict:
            rows.append({"claim": ra.claim, f"earlier run ({ka}): measured": ra._5, "verdict": ra.verdict,
                         f"2026-12-01 run ({kb}): measured": rb._5, "verdict ": rb.verdict})
    if not rows:
        return "Every verdict is the same in both runs.\n"
    return rp.markdown_table(pd.DataFrame(rows))


def confirmatory_controls() -> str:
    if not (CONFIRMATORY / "controls_restoration.csv").exists():
        return "The confirmatory run has not been analysed yet.\n"
    parts = []
    for name, title, digits in (("controls_restoration", "Restoration against its nulls (recovery, NLL scale)", 3),
                                ("controls_early_exit", "Early-exit split share at three split rules", 3),
                                ("controls_h_mse_all_examples", "corr(||h||, MLP-output MSE) per layer over all "
                                 "held-out examples, instance 1", 3),
                                ("patching", "Patching, per component (recovery, NLL and perplexity scales)", 3)):
        if not (CONFIRMATORY / f"{name}.csv").exists():
            continue
        frame = pd.read_csv(CONFIRMATORY / f"{name}.csv")
        if name == "controls_h_mse_all_examples":  # the two halves' MSE columns say nothing here
            frame = frame[["layer", "corr_h_mse", "corr_low", "corr_high"]]
        parts.append(f"**{title}** (`{(CONFIRMATORY / name).relative_to(ROOT)}.csv`)\n\n"
                     + rp.markdown_table(frame.round(digits)))
    summary = json.loads((CONFIRMATORY / "summary.json").read_text())
    rows = [{"method": k, "self-agreement Pearson": _fmt(v["pearson"]), "top-10% Jaccard": _fmt(v["jaccard"])}
            for k, v in summary["self_agreement"].items()]
    parts.append("**Across-instance self-agreement** (the same method, three calibration samples)\n\n"
                 + rp.markdown_table(pd.DataFrame(rows)))
    return "\n".join(parts)


def _fmt(d: dict) -> str:
    value, low, high = d["value"], d["low"], d["high"]
    return f"{value:.2f} [{low:.2f}, {high:.2f}]" if math.isfinite(low) else f"{value:.2f}"


def references() -> str:
    rows = [{"model": name, "reference (read from its GGUF file)": json.loads((folder / "results.json").read_text())
             .get("reference", "not recorded")} for name, folder in (("SmolLM2-135M", EXPLORATORY), ("Gemma-3-270m", GEMMA))]
    return rp.markdown_table(pd.DataFrame(rows))


def levels() -> str:
    rows = [
        ("agreement level", rp.AGREEMENT_LEVEL, "the paper's weakest model (Qwen2.5-7B); its mean over 50 pairs is 0.82"),
        ("Jaccard level", rp.JACCARD_LEVEL, "the paper's mean top-10% Jaccard"),
        ("norm/error level", rp.NORM_LEVEL, "the paper's weakest last-layer correlation"),
        ("corr(||h||, MSE)", rp.H_MSE_LEVEL, "the paper: above this in most upper layers"),
        ("outlier gamma", rp.OUTLIER_LEVEL, "'the smallest gamma': within the smallest tenth of dimensions"),
        ("early-exit share", round(rp.EARLY_EXIT_LEVEL, 4), "the paper's 7 of 40 layers"),
        ("restoration", rp.RESTORATION_LEVEL, "the paper's (8.67 - 8.05) / (8.67 - 5.60) on perplexity"),
        *((f"patching {c}", v, "the paper's Llama3-8B AWQ3 recovery") for c, v in rp.PATCH_LEVELS.items()),
        ("'little' (this project's)", rp.LITTLE, "restoration, up, attention: the band [0, this) is 'little'"),
        ("last quarter (this project's)", rp.EARLY_EXIT_SHARE, "early exit: a split after this share contradicts"),
    ]
    return rp.markdown_table(pd.DataFrame(rows, columns=["level", "value", "where it comes from"]))


def sensitivity() -> str:
    """How much a calibrated 3-bit model moves with the CPU's kernels and with the feeder fix (check.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sensitivity_check", DATA / "sensitivity" / "check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    rows = []
    for what, a, b in (("AVX2 -> AVX-512 kernels", "smollm2_avx2", "smollm2_avx512"),
                       ("calibration-feeder fix", "gemma3_feeder_before", "gemma3_feeder_after")):
        result = check.compare(str(DATA / "sensitivity" / f"{a}.json"), str(DATA / "sensitivity" / f"{b}.json"))
        for key, row in result.items():
            if isinstance(row, dict):
                rows.append({"what changed": what, "model": a.split("_")[0], "examples": result["n"],
                             "spec": key.split(",")[0], "mean error before -> after":
                             f"{row['mean_error_a']:.3f} -> {row['mean_error_b']:.3f}",
                             "Pearson of the per-example errors": f"{row['pearson_a_b']:.2f}",
                             "top-10% Jaccard": f"{row['top10_jaccard_a_b']:.2f}"})
    return rp.markdown_table(pd.DataFrame(rows))


BLOCKS = {"references": references, "levels": levels, "sensitivity": sensitivity, "provenance": provenance, "columns": main_table, "controls": confirmatory_controls,
          "machines": machines, "changed": changed_verdicts}


def render(page: str) -> str:
    for name, build in BLOCKS.items():
        pattern = re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.S)
        if not pattern.search(page):
            raise SystemExit(f"docs/reproduction.md has no '{name}' block")
        page = pattern.sub(lambda m, b=build: m.group(1) + b() + m.group(2), page)
    return page


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    fresh = render(page)
    csv = rp.side_by_side(columns()).to_csv(index=False)
    if args.write:
        PAGE.write_text(fresh)
        (DATA / "side_by_side.csv").write_text(csv)
        return 0
    if fresh != page or (DATA / "side_by_side.csv").read_text() != csv:
        print("docs/reproduction.md differs from the committed data: run python docs/build_reproduction.py --write")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
