"""The survival study's page: every table and verdict recomputed from the committed raw data by one command.

    python -m interp.report.survival.page                 # docs/data/survival/survival-1 -> docs/survival.md
    pytest tests/test_survival_page.py                    # recompute it and compare with the committed page

The generated part of ``docs/survival.md`` sits between ``<!-- survival:begin -->`` and ``<!-- survival:end -->``;
beside it, per model, ``tables/*.csv`` (every statistic with its interval). The page links one heatmap per family
(heads, each task's edges; ``docs/img/survival/``, named by the SHA-256 of the data they draw), drawn with
``--figures`` (Chromium).

    python -m interp.report.survival.page --figures       # also draw the figures the page links
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from interp.errors import DataError, exit_status
from interp.report.survival.analyse import circuit_analysis, induction_analysis
from interp.report.survival.registration import MODELS, REPO, registration, sha256
from interp.report.survival.roster import roster

RAW = REPO / "docs" / "data" / "survival" / "survival-1"
PAGE = REPO / "docs" / "survival.md"
FIGURES = REPO / "docs" / "img" / "survival"  # the page links them as img/survival/<name>.png
BEGIN, END = "<!-- survival:begin -->", "<!-- survival:end -->"
TASKS = ("ioi", "capitals")


def _num(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    text = f"{v:.{digits}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text  # a bound that rounds to 0 is "0.00"


def _iv(row: Any, key: str, digits: int = 2, scale: float = 1.0) -> str:
    low, value, high = (row[k] * scale if row[k] is not None else None for k in (f"{key}_low", key, f"{key}_high"))
    return f"{_num(value, digits)} [{_num(low, digits)}, {_num(high, digits)}]"


def _table(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "_(none)_\n"
    head = "| " + " | ".join(map(str, frame.columns)) + " |\n|" + "---|" * len(frame.columns) + "\n"
    return head + "".join("| " + " | ".join(str(v) for v in row) + " |\n" for row in frame.itertuples(index=False))


def analyse_model(folder: Path, model: str, seeds: Any = None) -> dict[str, Any]:
    reg = registration()
    out: dict[str, Any] = {}
    if (folder / "induction" / "reference.safetensors").is_file():
        out["induction"] = induction_analysis(folder, model, reg, seeds)
    for task in TASKS:
        found = circuit_analysis(folder, model, task, reg, seeds)
        if found is not None:
            out[task] = found
    if (folder / "features").is_dir():
        from interp.report.survival.features import feature_analysis

        out["features"] = feature_analysis(folder, model, reg, seeds)
    out["tie"] = {"tie": _tie(folder, model, out, reg, seeds), "where": _where(folder, model, out, reg, seeds)}
    return out


def _head_mask(folder: Path, induction: dict[str, Any]) -> Any:
    """``[layers, heads]`` True at the judged induction heads."""
    import numpy as np

    from interp.report.survival.analyse import _load

    mask = np.zeros(_load(folder / "induction" / "reference.safetensors")["pm"].shape[1:], dtype=bool)
    for unit in induction["judged_heads"]:
        layer, head = map(int, unit.split("."))
        mask[layer, head] = True
    return mask


def _where(folder: Path, model: str, results: dict[str, Any], reg: dict[str, Any], seeds: Any) -> pd.DataFrame:
    """The tie's secondary statistic E per quantized model: induction heads in the upper half of the layers, and
    each task's judged edges whose sender is an MLP there (survival-1 localization_tie.secondary)."""
    import numpy as np

    from interp.report.survival.tie import concentration_analysis

    low, high = reg["models"][model]["upper_half_layers"]

    def upper(layer: int) -> bool:
        return low <= layer <= high

    rows = []
    ind = results.get("induction")
    if ind is not None and ind["bar_met"]:
        mask = _head_mask(folder, ind)
        region = np.array([upper(layer) for layer, _ in zip(*np.nonzero(mask), strict=True)])
        rows += concentration_analysis(folder, model, "induction", mask.reshape(-1), region, reg, seeds)
    for task in TASKS:
        if task in results:
            edges = results[task]["edges"]
            judged = edges["judged"].to_numpy()
            region = np.array([s.startswith("mlp ") and upper(int(s.split()[1])) for s in edges["sender"][judged]])
            rows += concentration_analysis(folder, model, f"circuits/{task}", judged, region, reg, seeds)
    return pd.DataFrame(rows)


def _tie(folder: Path, model: str, results: dict[str, Any], reg: dict[str, Any], seeds: Any) -> pd.DataFrame:
    """The localization tie per registered method and family (induction heads; each task's judged edges)."""

    from interp.report.survival.tie import tie_analysis

    rows = []
    ind = results.get("induction")
    if ind is not None and ind["bar_met"]:
        rows += tie_analysis(folder, model, "induction", _head_mask(folder, ind).reshape(-1), reg, seeds)
    for task in TASKS:
        if task in results:
            rows += tie_analysis(folder, model, f"circuits/{task}", results[task]["edges"]["judged"].to_numpy(), reg,
                                 seeds)
    feats = results.get("features")
    if feats is not None and not feats["quality"].empty:
        from interp.report.survival.tie import feature_tie_analysis

        for layer in feats["quality"]["layer"]:
            rows += feature_tie_analysis(folder, model, int(layer), reg, seeds)
    return pd.DataFrame(rows)


def _where_section(folder: Path, model: str, results: dict[str, Any]) -> str:
    """The tie's secondary statistics: E per quantized model and family, and the latents' layer shares."""
    from interp.report.survival.tie import layer_shares

    low, high = registration()["models"][model]["upper_half_layers"]
    text = ""
    where = results.get("tie", {}).get("where")
    if where is not None and not where.empty:
        frame = pd.DataFrame({
            "quantized model": where["method"], "units": where["family"].str.replace("circuits/", "edges: "),
            "instances used": [f"{u} of {i}" for u, i in zip(where["instances_used"], where["instances"],
                                                              strict=True)],
            "judged (in region)": [f"{j} ({r})" for j, r in zip(where["judged_units"], where["in_region"],
                                                                strict=True)],
            "broken units": where["broken_units"], "E (95% CI)": [_iv(r, "E") for _, r in where.iterrows()],
            "resamples with a broken unit": [_num(v) for v in where["defined"]], "verdict": where["verdict"]})
        text += (f"\n**Where the broken units sit** (the tie's secondary statistic E: the share of broken units in the "
                 f"region over the share of judged units there; region: layers {low}-{high}, and for edges a sender "
                 "that is an MLP there; broken: a point ratio < 0.5, recomputed per resample; an instance with no "
                 "broken unit on all rows is left out, and a resample with none has no E; fewer than 3 broken "
                 "units get no verdict, as for T; E > 1 with its interval: "
                 "\"concentrate there\", < 1: \"avoid it\"):\n\n" + _table(frame))
    feats = results.get("features")
    if feats is not None and not feats["quality"].empty:
        shares = pd.DataFrame(layer_shares(folder, model, [int(v) for v in feats["quality"]["layer"]]))
        if not shares.empty:
            frame = pd.DataFrame({"quantized model": shares["method"], "instances": shares["instances"],
                                  "layer": shares["layer"],
                                  "share of judged latents": [_num(v) for v in shares["share_of_judged"]],
                                  "share of non-surviving latents": [_num(v)
                                                                     for v in shares["share_of_not_surviving"]]})
            text += ("\nThe latents' layer shares (descriptive only, as registered: a later layer inherits every "
                     "earlier layer's error; summed over a method's instances, all held-out rows):\n\n"
                     + _table(frame))
    return text


def _coverage(folder: Path, model: str, family: str) -> str:
    from interp.report.survival.registration import file_name

    rows = []
    for e in roster(model):
        done = sum((folder / family / f"{file_name(u)}.safetensors").is_file() for u in e.ids())
        rows.append(f"{e.label} {done}/{len(e.instances)}")
    return "; ".join(rows)


def _stages_kept(entry: dict[str, Any]) -> str:
    if entry.get("stages") is None:
        return "stages not recorded"
    return ", ".join(entry["stages"]) or "no stage kept"


def _remade(folder: Path) -> str:
    """The instances measured on more than one set of weights (``models.json``'s ``earlier``), with the stages
    measured on each: a fitted quantizer made again on another CPU gives other weights from the same seed."""
    path = folder / "models.json"
    if not path.is_file():
        return ""
    items = []
    for unit, entry in sorted(json.loads(path.read_text()).items()):
        if not entry.get("earlier"):
            continue
        parts = [f"{_stages_kept(e)} on weights `{str(e.get('weights_sha256'))[:12]}` "
                 f"({str(e.get('cpu', '?')).split(';')[0]})"
                 + (f" (since measured again on the later weights: {', '.join(e['superseded'])})"
                    if e.get("superseded") else "")
                 for e in [*entry["earlier"], entry]]
        items.append(f"- `{unit}`: " + "; ".join(parts))
    if not items:
        return ""
    return ("\n**Instances made more than once.** GPTQ and AWQ fit their weights in floating point, so the same seed "
            "and calibration rows give other weights on another CPU. Where an instance's cache was gone and this "
            "machine made it again, each stage reads the weights it was measured on (SHA-256 of the weights, and the "
            "CPU), and the instance still counts once:\n\n" + "\n".join(items) + "\n")


def model_section(folder: Path, model: str, results: dict[str, Any]) -> str:
    lines = [f"### {model}\n"]
    reference = registration()["models"][model]["reference"].split(":")[0]
    lines.append(f"Reference: {reference}. Raw data: `docs/data/survival/{folder.parent.name}/{folder.name}`.\n")
    ind = results.get("induction")
    if ind is None:
        lines.append("Induction heads: not measured yet.\n")
    else:
        lines.append(f"**Induction heads** (quantized models measured, instances done/registered: "
                     f"{_coverage(folder, model, 'induction')}).\n")
        heads = ind["reference_heads"]
        if not heads.empty:
            shown = heads.assign(pm=heads["pm"].map(_num), cp=[f"{_num(r.cp, 3)} [{_num(r.cp_low, 3)}, "
                                                                f"{_num(r.cp_high, 3)}]" for r in heads.itertuples()])
            lines.append("Heads with prefix matching >= 0.40 on the 128 selection sequences (copying in logits, "
                         "95% interval):\n\n" + _table(shown[["head", "pm", "cp", "induction head"]]))
        if not ind["bar_met"]:
            lines.append("Fewer than 2 heads meet the registered rule: the 4 heads with the largest PM are shown "
                         "'below the registered bar', without verdicts.\n")
        summary = ind["summary"]
        if not summary.empty:
            frame = pd.DataFrame({"quantized model": summary["method"], "instances": summary["instances"],
                                  "heads kept (share, 95% CI)": [_iv(r, "share") .replace("share", "")
                                                                 for _, r in summary.rename(
                                                                     columns={"share_kept": "share"}).iterrows()],
                                  "keeps": summary["keeps its role"], "loses": summary["loses its role"],
                                  "not resolved": summary["not resolved"]})
            lines.append("\nPer quantized model (verdicts from the crossed intervals of r_PM and r_CP; counts include "
                         "'on the boundary' readings under their computed verdict):\n\n" + _table(frame))
        surv = ind["survival"]
        if not surv.empty:
            grid = surv.pivot(index="method", columns="head", values="verdict").reindex(
                list(dict.fromkeys(surv["method"])))[list(dict.fromkeys(surv["head"]))]  # layer order, not text order
            lines.append("\nPer head (r_PM, r_CP intervals in the CSV beside the raw data):\n\n"
                         + _table(grid.reset_index().rename(columns={"method": "quantized model"})))
        contrast = ind["rtn_vs_gptq"]
        if not contrast.empty:
            frame = pd.DataFrame({"bits": contrast["bits"], "GPTQ instances": contrast["gptq_instances"],
                                  "D = mean r_PM(GPTQ) - r_PM(RTN)": [_iv(r, "D") for _, r in contrast.iterrows()],
                                  "verdict": contrast["verdict"]})
            lines.append("\nRTN against GPTQ (the GPT-2 replication's claim; 3 bits is the headline):\n\n"
                         + _table(frame))
    for task in TASKS:
        res = results.get(task)
        if res is None:
            lines.append(f"\n**Circuit, {task}**: not measured yet.\n")
            continue
        edges = res["edges"]
        lines.append(f"\n**Circuit, {task}** ({res['pairs']} measurement pairs, sets {res['sets_reading']}; "
                     f"{int(edges['judged'].sum())} of {len(edges)} edges judged):\n")
        per = res["per_method"]
        if not per.empty:
            frame = pd.DataFrame({"quantized model": per["method"], "instances": per["instances"],
                                  "kept": [_iv(r, "share_kept") for _, r in per.iterrows()],
                                  "weakened": [_iv(r, "share_weakened") for _, r in per.iterrows()],
                                  "broken": [_iv(r, "share_broken") for _, r in per.iterrows()],
                                  "reading": per["reading"],
                                  "logit difference lost": [_iv(r, "ld_lost") for _, r in per.iterrows()]})
            lines.append("\n" + _table(frame))
    feats = results.get("features")
    if feats is None or feats["quality"].empty:
        lines.append("\n**Features**: " + ("not in the registration for this model.\n" if model != "smollm2-135m"
                                             else "SAEs not trained yet.\n"))
    else:
        q = feats["quality"]
        frame = pd.DataFrame({"layer": q["layer"], "FVU": [_iv(r, "fvu") for _, r in q.iterrows()],
                              "CE loss recovered": [_iv(r, "ce_recovered") for _, r in q.iterrows()],
                              "dead latents (%)": [_iv(r, "dead_share", scale=100) for _, r in q.iterrows()],
                              "L0": q["l0"].map(lambda v: _num(v, 1)), "meets the bar": q["meets the bar"]})
        lines.append("\n**Features: the SAEs' quality** on the held-out rows (bar: FVU <= 0.20, CE loss recovered "
                     ">= 0.80, dead latents <= 10%, each read from its interval):\n\n" + _table(frame))
        s = feats["survival"]
        if not s.empty:
            from interp.report.survival.feature_counts import DEFINITIONS

            s = s[s["definition"] == DEFINITIONS[0][0]]
            frame = pd.DataFrame({"quantized model": s["method"], "layer": s["layer"], "instances": s["instances"],
                                  "judged latents": s["judged_latents"],
                                  "surviving (95% CI)": [_iv(r, "rate") for _, r in s.iterrows()],
                                  "SAE meets the bar": s["sae_meets_bar"]})
            lines.append("\nLatents surviving per layer (correlation >= 0.9 and firing rate within 2x, survival-1's "
                         "definition; committed in survival-2's form):\n\n" + _table(frame))
        p = feats.get("pooled")
        if p is not None and not p.empty:
            anchors = [c for c in p.columns if c.startswith("vs ") and not c.endswith(("bound", "distance_se"))]
            frame = pd.DataFrame({"quantized model": p["method"], "definition": p["definition"],
                                  "layers": p["layers"].map(lambda v: ", ".join(str(x) for x in v)),
                                  "surviving, pooled (95% CI)": [_iv(r, "rate") for _, r in p.iterrows()],
                                  **{c: p[c] for c in anchors}})
            lines.append("\nPooled over the layers whose SAE meets the bar, beside Duan's rates (62.4%: Pythia-70M, "
                         "6-bit RTN; 51.3%: Gemma-2-2B). His definition, SAEs and references are not known here, so "
                         "this compares rates, it does not replicate them. His models are quantized from full "
                         "precision; SmolLM2's reference here is already Q4_1, so 6-bit RTN re-grids a 4-bit grid and "
                         "is close to lossless by construction:\n\n" + _table(frame))
    tie = results.get("tie", {}).get("tie")
    if tie is not None and not tie.empty:
        frame = pd.DataFrame({"method": tie["method"], "units": tie["family"], "instances": tie["instances_used"],
                              "broken units": tie["broken_units"], "T (named - control)": [
                                  _iv(r, "T") for _, r in tie.iterrows()], "verdict": tie["verdict"]})
        lines.append("\n**Localization tie** (share of broken units repaired by restoring gate and down, minus by "
                     "restoring up, q, k, v, o):\n\n" + _table(frame))
    else:
        lines.append("\n**Localization tie**: no restored variants measured yet.\n")
    lines.append(_where_section(folder, model, results))
    return "\n".join(lines) + "\n" + _remade(folder)


def figure_specs(model: str, results: dict[str, Any]) -> list[tuple[str, pd.DataFrame, str, str, str]]:
    """``(file name, frame, unit, value, title)`` of each heatmap the page shows for ``model``. The name carries
    the SHA-256 of the frame it draws (as the page's CSV writes it), so a figure drawn from other data has another
    name, and a page whose figures were not redrawn links files that do not exist (the page test checks)."""
    specs = []
    wanted = [("induction", "survival", "head", "r_pm", "induction heads' prefix matching")] + [
        (task, "per_edge", "edge", "ratio", f"{task} circuit edges") for task in TASKS]
    for family, table, unit, value, what in wanted:
        frame = results.get(family, {}).get(table)
        if not isinstance(frame, pd.DataFrame) or frame.empty:
            continue
        digest = hashlib.sha256(frame.round(6).to_csv(index=False).encode()).hexdigest()[:12]
        specs.append((f"{model}-{family}-{digest}.png", frame, unit, value,
                      f"{model}: {what}, quantized / reference"))
    rates = results.get("features", {}).get("survival")
    if isinstance(rates, pd.DataFrame) and not rates.empty:  # the headline definition's rates per layer
        frame = rates[rates["definition"] == rates["definition"].iloc[0]].reset_index(drop=True)
        digest = hashlib.sha256(frame.round(6).to_csv(index=False).encode()).hexdigest()[:12]
        specs.append((f"{model}-features-{digest}.png", frame, "layer", "rate",
                      f"{model}: SAE latents surviving ({frame['definition'].iloc[0]})"))
    return specs


def _figure_links(specs: list[tuple[str, pd.DataFrame, str, str, str]]) -> str:
    if not specs:
        return ""
    return "\n**Figures** (heads and edges: each cell the registered verdict, colour the point ratio quantized / " \
        "reference; latents: each cell the share surviving with its interval):\n\n" + \
        "\n".join(f"![{title}](img/survival/{name})" for name, _, _, _, title in specs) + "\n"


def draw_figures(specs: list[tuple[str, pd.DataFrame, str, str, str]], folder: Path = FIGURES) -> list[Path]:
    """Draw the PNGs the page links (needs a Chromium, as every static figure of interp's)."""
    from interp.figures.style import export_static
    from interp.figures.survival import rate_heatmap, unit_heatmap

    missing = {name[:-4]: rate_heatmap(frame, title) if value == "rate" else unit_heatmap(frame, unit, value, title)
               for name, frame, unit, value, title in specs if not (folder / name).is_file()}
    drawn = export_static(missing, folder, formats=("png",)) if missing else []
    current = {name for name, *_ in specs}
    stale = sorted(old.name for name in current for old in folder.glob("*.png") if old.name not in current
                   and re.fullmatch(re.escape(name.rsplit("-", 1)[0]) + r"-[0-9a-f]{12}\.png", old.name))
    if stale:  # drawn from earlier data; the page no longer links them (deleting is left to git, not to the page)
        print(f"no longer linked by the page (git rm them): {', '.join(stale)}", file=sys.stderr)
    return drawn


def write(root: Path = RAW, page: Path = PAGE, seeds: Any = None, figures: bool = False) -> str:
    """Recompute every table from ``root`` and put the generated section into ``page``; returns the section. With
    ``figures``, also draw the figures it links that are not drawn yet (:func:`draw_figures`)."""
    from interp.io import write_csv, write_text

    if not root.is_dir():
        raise DataError(f"{root} is not a folder: --raw takes the survival study's raw data, one folder per model "
                        f"(as {RAW.relative_to(RAW.parents[3])})")
    sections = [f"Registration `survival-1.json`, SHA-256 `{sha256()[:16]}...`. Generated by "
                "`python -m interp.report.survival.page` from the raw data below; `tests/test_survival_page.py` "
                "recomputes it.\n"]
    for model in MODELS:
        folder = root / model
        if not folder.is_dir():
            sections.append(f"### {model}\n\nNot run yet.\n")
            continue
        results = analyse_model(folder, model, seeds)
        for family, res in results.items():
            for name, frame in res.items():
                if isinstance(frame, pd.DataFrame) and not frame.empty:
                    (folder / "tables").mkdir(exist_ok=True)
                    write_csv(folder / "tables" / f"{family}-{name}.csv", frame.round(6), index=False)
        specs = figure_specs(model, results)
        if figures:
            draw_figures(specs)
        sections.append(model_section(folder, model, results) + _figure_links(specs))
    body = "\n".join(sections)
    text = page.read_text() if page.is_file() else f"# Survival\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        raise DataError(f"{page} has no {BEGIN} ... {END} markers for the generated section")
    new = text[:text.index(BEGIN) + len(BEGIN)] + "\n" + body + text[text.index(END):]
    write_text(page, new)
    return body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m interp.report.survival.page", description=__doc__.split("\n")[0])
    parser.add_argument("--raw", default=str(RAW))
    parser.add_argument("--page", default=str(PAGE))
    parser.add_argument("--figures", action="store_true",
                        help=f"also draw the PNGs the page links into {FIGURES.relative_to(REPO)} (needs Chromium)")
    args = parser.parse_args(argv)
    return exit_status(lambda: write(Path(args.raw), Path(args.page), figures=args.figures))


if __name__ == "__main__":
    raise SystemExit(main())
