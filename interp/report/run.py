"""``interp report``: one offline HTML report reproducing both papers' analyses.

The report runs in stages. Each stage computes tables, figures and numbers, and writes them
to ``OUT/stages/<stage>/`` (CSV, plotly JSON, ``numbers.json``) followed by a ``done.json``
marker holding the key of its inputs (``ReportContext.key``: the weights, tokenizer, data,
code and settings, by content), where it was computed and the elapsed time. A rerun with the same
inputs loads finished stages from disk instead of recomputing them, so a killed report resumes
where it stopped; per-example scoring inside a stage resumes from its SQLite store. Changing any
input, even at the same path, starts the stages and the scores over.

Outputs:

- ``index.html`` with every figure, interactive; ``plotly.min.js`` sits beside it, so the
  page works offline with no CDN;
- with ``single_file``, ``report.html``: the same page with plotly.js inlined, one file that
  works when moved or mailed on its own;
- ``figures/*.png`` and ``figures/*.svg`` for papers (kaleido + headless Chromium);
- ``tables/*.csv``;
- ``results.json`` with every number, the settings, package versions and stage times, and where it ran
  (``provenance``: the commit, torch's threads and CPU kernels) and whether it was a smoke run (``smoke``).

A smoke run (``--quick``, or the quick sizes) concludes nothing: its page says so in a banner, and every
claim shows its measurement with "too few examples for a verdict" instead of a verdict.

The page is rendered from the Jinja2 templates in ``interp/templates`` with autoescaping on: all
text that comes from data (document titles, tokens, user file names) is HTML-escaped; only
plotly's own figure markup and plotly.js are inserted as trusted markup.
"""

from __future__ import annotations

import contextlib
import json
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs
from tqdm.auto import tqdm

from interp import validate
from interp.errors import InterpError
from interp.figures import export_static
from interp.io import atomic_write_bytes, claim_folder, remove_owned, write_csv, write_json, writing
from interp.report.context import MainRankOnly, ReportContext, ReportSettings, Stage, StageOutput
from interp.report.html import _versions, csv_data_uri, provenance, render_html
from interp.report.stages import STAGES
from interp.report.stages.reproduction_table import reproduction_table
from interp.runtime.batching import show_progress
from interp.runtime.distributed import local_device, process_group, world

REPORT_KIND = "report"  # the kind in a report folder's interp marker (interp.io.MARKER); the command's name
INPUTS = "inputs.json"  # the digests of what the folder's scores were computed from (ReportContext.inputs)

# ---------------------------------------------------------------------------------------
# Stage persistence


def _figure_from_json(text: str) -> go.Figure:
    return pio.from_json(text)


def save_stage(folder: Path, output: StageOutput, key: str) -> None:
    """Write a finished stage; ``done.json``, written last, holds the key it may be reused under
    (``ReportContext.key``) and where it was computed (``output.provenance``)."""
    for name, table in output.tables.items():
        atomic_write_bytes(folder / f"{name}.csv", table.to_csv(index=False).encode())
    for name, fig in output.figures.items():
        atomic_write_bytes(folder / f"{name}.plotly.json", fig.to_json().encode())
    write_json(folder / "numbers.json", {"numbers": output.numbers, "notes": output.notes,
                                         "tables": list(output.tables), "figures": list(output.figures)})
    write_json(folder / "done.json", {"key": key, "seconds": output.seconds, "provenance": output.provenance})


def load_stage(folder: Path, key: str) -> StageOutput | None:
    """A stage an earlier run finished, when it was computed under ``key`` (the same weights, data, tokenizer,
    code and settings); ``None`` otherwise."""
    done = folder / "done.json"
    if not done.is_file():
        return None
    try:
        marker = json.loads(done.read_text())
        if marker.get("key") != key:
            return None
        meta = json.loads((folder / "numbers.json").read_text())
        tables = {name: pd.read_csv(folder / f"{name}.csv") for name in meta["tables"]}
        figures = {name: _figure_from_json((folder / f"{name}.plotly.json").read_text()) for name in meta["figures"]}
    except (OSError, json.JSONDecodeError, ValueError, KeyError):
        return None  # a damaged stage is simply recomputed
    earlier = marker.get("provenance") if isinstance(marker.get("provenance"), dict) else {}
    return StageOutput(tables=tables, figures=figures, numbers=meta["numbers"], notes=meta["notes"],
                       seconds=float(marker.get("seconds", 0.0)), provenance={**earlier, "reused": True})


def stage_provenance(inputs: dict[str, str]) -> dict[str, Any]:
    """Where a stage is computed: the commit, torch's threads and kernels (``provenance``), the machine,
    when, and the digests of what it is computed from."""
    return {**provenance(), "machine": platform.node(), "platform": platform.platform(),
            "computed": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "inputs": dict(inputs), "reused": False}


DERIVED = ("scores.sqlite", "scores.sqlite-wal", "scores.sqlite-shm", "scores.sqlite-journal", "token_nll")
"""What a report keeps besides its stages, computed from its inputs: the per-example scores."""


def _start_afresh_if_inputs_changed(folder: Path, inputs: dict[str, str]) -> None:
    """The scores an earlier run kept are reused only if it had the same inputs (``inputs.json``); otherwise
    they go, and the stages, keyed by ``ReportContext.key``, are computed again."""
    try:
        earlier = json.loads((folder / INPUTS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        earlier = None
    if earlier != inputs:
        remove_owned(folder, DERIVED, REPORT_KIND)
        write_json(folder / INPUTS, inputs)


# ---------------------------------------------------------------------------------------
# Rendering


# ---------------------------------------------------------------------------------------
# Driver


def smoke_reason(settings: ReportSettings) -> str:
    """Why a run at ``settings`` concludes nothing, in one sentence for the page."""
    return (f"It ran {settings.n} examples of {settings.seq_len} tokens to check that every stage works; its "
            "intervals rest on too few examples (D_large holds a handful) to judge any finding.")


def is_smoke(settings: ReportSettings) -> bool:
    """Whether ``settings`` are the quick ones (the sizes of its quick constructor): a smoke run."""
    quick = ReportSettings.quick()
    sizes = ("n", "seq_len", "calibration_n", "attention_n", "methods")
    return all(getattr(settings, f) == getattr(quick, f) for f in sizes)


def run_report(out: str | Path, settings: ReportSettings | None = None, stages: list[str] | None = None,
               progress: bool | None = None, static: bool = True, single_file: bool = False,
               smoke: bool | None = None) -> dict[str, Any]:
    """Run (or resume) the report into ``out`` and return the ``results.json`` content.

    Args:
        out: output folder.
        settings: :class:`~interp.report.context.ReportSettings` (its ``quick`` constructor for a fast smoke run).
        stages: names of the stages to run (default: all).
        progress: progress bars (default: when stderr is a terminal).
        static: also export PNG and SVG copies of every figure.
        single_file: also write ``report.html``, one page with plotly.js inlined that works when moved
            on its own (about 5 MB).
        smoke: a smoke run, which gives no verdict (default: when ``settings`` have the quick sizes).
    """
    settings = settings or ReportSettings()
    if stages is not None:  # before any folder is made: a misspelt stage must not give an empty report
        stages = validate.names(stages, "stages", valid=[s.name for s in STAGES], error=InterpError)
    folder = claim_folder(out, REPORT_KIND)  # new, empty or an earlier report; anything else is refused
    with contextlib.ExitStack() as marked:
        if world()[0] == 0:  # rank 0 writes the files: the folder says INCOMPLETE until results.json is in
            marked.enter_context(writing(folder))
        return _report(folder, settings, stages, progress, static, single_file, smoke)


def _report(folder: Path, settings: ReportSettings, stages: list[str] | None, progress: bool | None, static: bool,
            single_file: bool, smoke: bool | None) -> dict[str, Any]:
    chosen = [s for s in STAGES if stages is None or s.name in stages]
    device = local_device(settings.device) if settings.device == "cuda" else settings.device
    with process_group(device) as dist:  # torchrun: every rank runs the batched steps (_run_stages)
        context = ReportContext(settings, folder, progress)
        if context.rank == 0:
            _start_afresh_if_inputs_changed(folder, context.inputs)
        if dist is not None:  # the others wait until rank 0 has cleared what another run's inputs left
            dist.broadcast_object_list([None], src=0)
        try:
            outputs, total = _run_stages(context, chosen, dist)
        finally:
            context.close()
    if context.rank != 0:  # torchrun: rank 0 writes every file
        return {}
    smoke = is_smoke(settings) if smoke is None else smoke
    why_smoke = smoke_reason(settings) if smoke else ""
    reproduction = reproduction_table(outputs, settings, why_smoke)
    versions = _versions()
    reference = context.reference_description
    run = {**provenance(), "stages": {name: o.provenance for name, o in outputs.items()}}
    _write_outputs(folder, settings, chosen, outputs, reproduction, versions, total, static, reference,
                   single_file, run, why_smoke)
    results = {
        "settings": asdict(settings), "versions": versions, "reference": reference, "provenance": run,
        "smoke": smoke,
        "stage_seconds": {name: o.seconds for name, o in outputs.items()},
        "numbers": {name: o.numbers for name, o in outputs.items()},
        "reproduction": reproduction.to_dict(orient="records"),
    }
    write_json(folder / "results.json", results)
    return results


def _run_stages(context: ReportContext, chosen: list[Stage], dist: Any) -> tuple[dict[str, StageOutput], float]:
    """Each chosen stage, loaded from its folder when a previous run finished it, else run and saved.

    Under torchrun (``dist`` a process group) every rank runs each stage up to its ``main_only()``
    call (its batched steps and the scoring, which all ranks share), rank 0 alone the rest; rank 0
    decides which stages are already done and tells the others, so all ranks run the same stages.
    """
    key = context.key  # the weights, data, tokenizer, code and settings, by content
    outputs: dict[str, StageOutput] = {}
    began = time.time()
    bar = tqdm(chosen, desc="report", unit="stage", disable=not show_progress(context.progress))
    for stage in bar:
        bar.set_postfix_str(stage.name)
        stage_dir = context.out / "stages" / stage.name
        cached = load_stage(stage_dir, key) if stage.reuse and context.rank == 0 else None
        if dist is not None:
            done = [cached is not None]
            dist.broadcast_object_list(done, src=0)
            if done[0] and context.rank != 0:
                continue
        if cached is not None:
            outputs[stage.name] = cached
            continue
        tick = time.time()
        context.begin_stage()
        try:
            output = stage.run(context)
        except MainRankOnly:  # a rank other than 0: the rest of this stage is rank 0's
            continue
        output.seconds = time.time() - tick
        output.provenance = stage_provenance(context.inputs)
        save_stage(stage_dir, output, key)
        outputs[stage.name] = output
    return outputs, time.time() - began


def _write_outputs(folder: Path, settings: ReportSettings, stages: list[Stage], outputs: dict[str, StageOutput],
                   reproduction: pd.DataFrame, versions: dict[str, str], total: float, static: bool,
                   reference: str = "", single_file: bool = False, run: dict[str, Any] | None = None,
                   smoke: str = "") -> None:
    """Write ``index.html`` + ``plotly.min.js``, the CSV tables, the static figures and, with
    ``single_file``, ``report.html`` (plotly.js inlined, no links to files beside it)."""


    plotly_js = get_plotlyjs()
    atomic_write_bytes(folder / "plotly.min.js", plotly_js.encode())

    def png_link(stem: str) -> str | None:  # the PNG this run exports, or one a previous run left
        return f"figures/{stem}.png" if static or (folder / "figures" / f"{stem}.png").is_file() else None

    args = (settings, stages, outputs, reproduction, versions, total, reference)
    page = {"run": run, "smoke": smoke}
    atomic_write_bytes(folder / "index.html", render_html(*args, static_pngs=png_link, **page).encode("utf-8"))
    if single_file:  # it travels alone: its tables' CSVs go inside it
        atomic_write_bytes(folder / "report.html", render_html(
            *args, plotly_js=plotly_js, csv_links=lambda stem, table: csv_data_uri(table), **page).encode("utf-8"))
    tables_dir = folder / "tables"
    write_csv(tables_dir / "reproduction.csv", reproduction, index=False)
    for name, output in outputs.items():
        for table_name, table in output.tables.items():
            write_csv(tables_dir / f"{name}__{table_name}.csv", table, index=False)
    if static:
        figures = {f"{name}__{fig_name}": fig for name, o in outputs.items() for fig_name, fig in o.figures.items()}
        export_static(figures, folder / "figures")


