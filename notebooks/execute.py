"""Re-execute the notebooks in place, with their quick settings, so the stored outputs are current.

The repository stores every notebook executed, outputs included, so a code host shows the tables
and figures. Refresh them after changing a notebook or the code it calls:

    make notebooks                                   # all of them
    .venv/bin/python notebooks/execute.py 02 05      # those whose name starts with 02 or 05

Settings (``QUICK_ENV``, also used by ``tests/test_notebooks.py``):

* ``INTERP_NB_N=4``: the notebooks' quick size (each reads it for its number of examples);
* ``OMP_NUM_THREADS=1``: one torch thread, as in the test suite (an existing value is kept);
* ``ATEN_CPU_CAPABILITY=avx2``, ``MKL_CBWR=AVX2``, ``ONEDNN_MAX_CPU_ISA=AVX2``: torch's own kernels,
  MKL's and oneDNN's pinned to AVX2, so a stored notebook is what any x86-64 CPU with AVX2 computes.
  Without them float32 sums add in an order set by the CPU's vector width, and GPTQ's error
  feedback turns that into other weights (28% of SmolLM2's GPTQ-3 weights differ between the
  AVX2 and AVX-512 kernels of one machine), so notebook 04's GPTQ numbers moved in the second
  digit between an AVX2 and an AVX-512 machine. Quantized models are cached per kernel set
  (``interp.quant.apply.cache_key``), so a model made under other kernels is never reused;
* ``PLOTLY_RENDERER=plotly_mimetype+png``: each figure is stored twice in one output, as the
  plotly JSON (interactive in Jupyter, ~10-30 kB) and as a 700x500 PNG at scale 1 (what GitHub
  shows, which cannot run the JSON). Nothing embeds plotly.js (4.6 MB), which the ``notebook``
  renderers would put into every file. The PNG goes through kaleido and a headless Chromium
  (``BROWSER_PATH``, default ``/usr/bin/chromium``; ``make chromium`` installs it). Without a
  Chromium the script refuses, since the stored notebooks would lose their images.

Before writing, two things are trimmed (``tidy``): each PNG is re-encoded with a 256-colour palette
(a quarter of the size, no visible change on these line and heat-map figures), and progress-bar
widgets are dropped (their state is not stored, so a reader would see a bar frozen at 0%). Cell
timing metadata is not recorded, so a refresh changes only what the cells print and draw.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RENDERER = "plotly_mimetype+png"
# One set of CPU kernels on every x86-64 machine with AVX2 (see the module docstring)
KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
QUICK_ENV = {"INTERP_NB_N": "4", "PLOTLY_RENDERER": RENDERER, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
             **KERNELS}
TIMEOUT_S = 1500


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


def kernel_env(renderer: str = RENDERER, **overrides: str) -> dict[str, str]:
    """The environment the kernel runs in: this process's, plus the quick settings, plus ``overrides``."""
    env = dict(os.environ, **QUICK_ENV)
    env.update(overrides, PLOTLY_RENDERER=renderer)
    env.setdefault("OMP_NUM_THREADS", "1")
    if "png" in renderer:
        browser = browser_path()
        if browser is None:
            raise SystemExit("PNG figures need a Chromium: run `make chromium` or set BROWSER_PATH.")
        env["BROWSER_PATH"] = browser
    return env


def execute(path: Path, renderer: str = RENDERER, timeout: int = TIMEOUT_S, **overrides: str):
    """Execute the notebook at ``path`` top to bottom and return it with its outputs (not written).

    ``overrides`` replace environment variables of the quick settings (``INTERP_NB_N="32"``).
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=kernel_env(renderer, **overrides))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prefixes", nargs="*", help="only notebooks whose file name starts with one of these")
    args = parser.parse_args(argv)
    import nbformat

    paths = notebooks(args.prefixes)
    if not paths:
        parser.error(f"no notebook matches {args.prefixes}")
    for path in paths:
        start = time.time()
        nb = execute(path)
        errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if o.output_type == "error"]
        if errors:
            print(f"{path.name}: {errors[0].ename}: {errors[0].evalue}; not written", file=sys.stderr)
            return 1
        nbformat.write(tidy(nb), path)
        print(f"{path.name}: {time.time() - start:.0f} s, {path.stat().st_size / 1024:.0f} kB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
