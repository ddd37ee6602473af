"""Re-execute the notebooks in place, so the stored outputs are current and mean something.

The repository stores every notebook executed, outputs included, so a code host shows the tables
and figures. Refresh them after changing a notebook or the code it calls:

    make notebooks                                   # all of them
    .venv/bin/python notebooks/execute.py 02 05      # those whose name starts with 02 or 05

Each notebook is executed twice:

* **Full size, stored in the notebook.** The notebook's own settings (its ``INTERP_NB_N`` default,
  at least 32 examples), so a reader sees results with meaningful intervals. The first markdown cell
  gets a "Stored outputs" line that says the settings (:func:`settings_line`).
* **Quick size, stored as a record** (``notebooks/quick/<name>.json``): ``INTERP_NB_N=4``, its outputs
  in the normalised form of ``notebooks/rule.py``. ``tests/test_notebooks.py`` executes each notebook
  at this size and compares with the record, which catches a library change that alters what the
  notebook computes, without executing at full size in CI.

The notebook's metadata holds a **fingerprint** (:func:`fingerprint`): a SHA-256 of its code cells,
its settings and its quick record. A fast test recomputes it, so a notebook whose code changed, or
whose record was refreshed without re-executing the full outputs, fails.

Settings common to both runs (``KERNELS`` and ``BASE_ENV``):

* ``OMP_NUM_THREADS=1``: one torch thread, as in the test suite (an existing value is kept);
* ``ATEN_CPU_CAPABILITY=avx2``, ``MKL_CBWR=AVX2``, ``ONEDNN_MAX_CPU_ISA=AVX2``: torch's own kernels,
  MKL's and oneDNN's pinned to AVX2, so a stored notebook is what any x86-64 CPU with AVX2 computes.
  Without them float32 sums add in an order set by the CPU's vector width, and GPTQ's error
  feedback turns that into other weights (28% of SmolLM2's GPTQ-3 weights differ between the
  AVX2 and AVX-512 kernels of one machine). Quantized models are cached per kernel set
  (``interp.quant.apply.cache_key``), so a model made under other kernels is never reused;
* ``PLOTLY_RENDERER=plotly_mimetype+png`` (full size only): each figure is stored twice in one output,
  as the plotly JSON (interactive in Jupyter) and as a 700x500 PNG (what GitHub shows). Nothing embeds
  plotly.js (4.6 MB). The PNG goes through kaleido and a headless Chromium (``BROWSER_PATH``, default
  ``/usr/bin/chromium``; ``make chromium`` installs it). The quick record needs no Chromium.

Before writing, two things are trimmed (``tidy``): each PNG is re-encoded with a 256-colour palette,
and progress-bar widgets are dropped. Cell timing metadata is not recorded.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECORDS = HERE / "quick"
RENDERER = "plotly_mimetype+png"
QUICK_RENDERER = "plotly_mimetype"  # the record compares figures by structure: no PNG needed
# One set of CPU kernels on every x86-64 machine with AVX2 (see the module docstring)
KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
BASE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **KERNELS}
QUICK_N = "4"
QUICK_ENV = {"INTERP_NB_N": QUICK_N, "PLOTLY_RENDERER": QUICK_RENDERER, **BASE_ENV}
TIMEOUT_S = 1500
SETTINGS_MARK = "**Stored outputs:**"
_DEFAULT_N = re.compile(r"INTERP_NB_N\"\s*,\s*(\d+)")


def _rule():
    spec = importlib.util.spec_from_file_location("notebooks_rule", HERE / "rule.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def code_sources(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def default_n(nb) -> int | None:
    """The notebook's own number of examples (its ``INTERP_NB_N`` default), or None when it has none."""
    for source in code_sources(nb):
        match = _DEFAULT_N.search(source)
        if match:
            return int(match.group(1))
    return None


def settings_line(nb) -> str:
    """What the stored outputs were computed with, said in the notebook's first cell."""
    n = default_n(nb)
    size = f"N = {n} examples (the notebook's default; `INTERP_NB_N` overrides it)" if n else \
        "the settings in the code below"
    return (f"{SETTINGS_MARK} executed top to bottom by `notebooks/execute.py` with {size}, one torch thread "
            "and AVX2 kernels pinned (`ATEN_CPU_CAPABILITY=avx2`), so any x86-64 CPU computes the same. The test "
            f"suite re-executes it at N = {QUICK_N} and compares with `notebooks/quick/`.")


def record_path(path: Path) -> Path:
    return RECORDS / f"{path.stem}.json"


def fingerprint(nb, record_text: str) -> str:
    """SHA-256 of the code cells, the full-size settings and the quick record the stored outputs belong to."""
    payload = json.dumps({"code": code_sources(nb), "settings": settings_line(nb), "base_env": BASE_ENV,
                          "record": hashlib.sha256(record_text.encode()).hexdigest()}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def record_text(nb_quick) -> str:
    """The quick execution's normalised outputs, as stored in ``notebooks/quick/``."""
    return json.dumps(_rule().normalise(nb_quick, png=False), indent=0, ensure_ascii=False) + "\n"


def notebooks(prefixes: list[str] | None = None) -> list[Path]:
    """The notebooks in this folder, all or those whose name starts with one of ``prefixes``."""
    paths = sorted(HERE.glob("*.ipynb"))
    if prefixes:
        paths = [p for p in paths if any(p.name.startswith(x) for x in prefixes)]
    return paths


def browser_path() -> str | None:
    """The Chromium kaleido will use, or None when there is none."""
    path = os.environ.get("BROWSER_PATH") or "/usr/bin/chromium"
    return path if Path(path).exists() else None


def kernel_env(renderer: str = RENDERER, quick: bool = True, **overrides: str | None) -> dict[str, str]:
    """The environment the kernel runs in: this process's, plus the quick (or full-size) settings, plus
    ``overrides`` (a value of None removes the variable: ``ATEN_CPU_CAPABILITY=None`` runs the CPU's
    own kernels)."""
    env = dict(os.environ, **(QUICK_ENV if quick else BASE_ENV))
    if not quick:
        env.pop("INTERP_NB_N", None)
    env.update({k: v for k, v in overrides.items() if v is not None}, PLOTLY_RENDERER=renderer)
    for name in [k for k, v in overrides.items() if v is None]:
        env.pop(name, None)
    env.setdefault("OMP_NUM_THREADS", "1")
    if "png" in renderer:
        browser = browser_path()
        if browser is None:
            raise SystemExit("PNG figures need a Chromium: run `make chromium` or set BROWSER_PATH.")
        env["BROWSER_PATH"] = browser
    return env


def execute(path: Path, renderer: str = QUICK_RENDERER, timeout: int = TIMEOUT_S, quick: bool = True,
            **overrides: str | None):
    """Execute the notebook at ``path`` top to bottom and return it with its outputs (not written).

    ``quick`` runs at ``INTERP_NB_N=4``; otherwise at the notebook's own defaults. ``overrides`` replace
    environment variables (``INTERP_NB_N="32"``).
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=kernel_env(renderer, quick, **overrides))
    return nb


def with_settings_line(nb):
    """``nb`` with the first markdown cell's "Stored outputs" line set to :func:`settings_line`."""
    first = next(c for c in nb.cells if c.cell_type == "markdown")
    kept = [line for line in first.source.split("\n") if not line.startswith(SETTINGS_MARK)]
    while kept and not kept[-1].strip():
        kept.pop()
    first.source = "\n".join(kept) + "\n\n" + settings_line(nb)
    return nb


WIDGET = "application/vnd.jupyter.widget-view+json"


def small_png(b64: str) -> str:
    """The base64 PNG re-encoded with a 256-colour palette (over white, where it was transparent)."""
    import base64
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGBA")
    flat = Image.new("RGBA", image.size, "white")
    flat.alpha_composite(image)
    out = io.BytesIO()
    flat.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(out, "PNG", optimize=True)
    return base64.b64encode(out.getvalue()).decode("ascii")


def tidy(nb):
    """Palette PNGs, no progress-bar widgets (see the module docstring). Changes ``nb`` in place."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.outputs = [o for o in cell.get("outputs", []) if WIDGET not in o.get("data", {})]
        for output in cell.outputs:
            if "image/png" in output.get("data", {}):
                output.data["image/png"] = small_png(output.data["image/png"])
    return nb


def _errors(nb) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]


def refresh(path: Path) -> str:
    """Execute ``path`` at quick and at full size; write its record and the notebook (full outputs)."""
    import nbformat

    quick = execute(path)
    full = execute(path, renderer=RENDERER, quick=False)
    for run, nb in (("quick", quick), ("full-size", full)):
        if _errors(nb):
            error = _errors(nb)[0]
            return f"{path.name}: {run} run: {error.ename}: {error.evalue}; not written"
    text = record_text(quick)
    RECORDS.mkdir(exist_ok=True)
    record_path(path).write_text(text)
    full = with_settings_line(tidy(full))
    full.metadata["interp"] = {"fingerprint": fingerprint(full, text), "examples": default_n(full)}
    nbformat.write(full, path)
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prefixes", nargs="*", help="only notebooks whose file name starts with one of these")
    args = parser.parse_args(argv)
    paths = notebooks(args.prefixes)
    if not paths:
        parser.error(f"no notebook matches {args.prefixes}")
    for path in paths:
        start = time.time()
        problem = refresh(path)
        if problem:
            print(problem, file=sys.stderr)
            return 1
        print(f"{path.name}: {time.time() - start:.0f} s, {path.stat().st_size / 1024:.0f} kB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
