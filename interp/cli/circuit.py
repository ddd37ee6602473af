"""``interp circuit``: direct logit attribution, edge attribution and path patching on your own prompt pair.

One prompt pair on the command line (``--clean``, ``--corrupt``, ``--answer``, ``--wrong``) or many in a
JSONL file (``--pairs``: one object a line with those four fields) goes through
:func:`interp.localize.circuit.circuit`: DLA on the clean prompts, EAP of every head and MLP into the
logits and into the top DLA heads' queries, keys and values, and path patching of EAP's top edges.

Written into ``--out``: ``circuit.html`` (one page, plotly inlined: opens offline, travels alone),
``tables/*.csv``, ``figures/*.html`` (beside one ``plotly.min.js``; ``*.png`` too when ``BROWSER_PATH``
names a Chromium) and ``settings.json``.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from interp.cli.common import (
    DTYPES,
    add_checks,
    check_loads_model,
    check_out,
    command,
    device_type,
    int_at_least,
)
from interp.errors import DataError

FIELDS = ("clean", "corrupt", "answer", "wrong")
PAIRS_MAX_BYTES = 16 << 20  # a prompt-pair file is text typed by hand or generated: far below this


def _circuit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clean", default=None, help="the clean prompt, e.g. 'The Eiffel Tower is in the city of'")
    p.add_argument("--corrupt", default=None,
                   help="the corrupted prompt, as many tokens as --clean, e.g. 'The Colosseum is in the city of'")
    p.add_argument("--answer", default=None,
                   help="the clean prompt's answer: one token, usually with its leading space (' Paris')")
    p.add_argument("--wrong", default=None, help="the answer it is compared with (one token, e.g. ' Rome')")
    p.add_argument("--pairs", default=None,
                   help="instead of the four above: a .jsonl file, one {\"clean\", \"corrupt\", \"answer\", \"wrong\"} "
                        "object a line")
    p.add_argument("--model", default="smollm2-135m",
                   help="bundled model (smollm2-135m, gemma3-270m), a Hugging Face folder, or a .gguf file")
    p.add_argument("--top", type=int_at_least(1), default=8, help="EAP's top edges that path patching measures")
    p.add_argument("--movers", type=int_at_least(0), default=3,
                   help="heads (largest direct contribution) whose queries, keys and values are EAP receivers")
    p.add_argument("--ig-steps", type=int_at_least(1), default=1, help="EAP-IG steps (1: plain EAP)")
    p.add_argument("--batch-size", type=int_at_least(1), default=8, help="prompt pairs per forward pass")
    p.add_argument("--device", type=device_type, default="cpu", help="cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="model parameter dtype")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads")
    p.add_argument("--out", default="reports/circuit", help="output folder")
    add_checks(p, check_pairs, check_loads_model, check_out)


def check_pairs(args: argparse.Namespace) -> None:
    """Either ``--pairs FILE`` or all four of ``--clean``, ``--corrupt``, ``--answer``, ``--wrong``, each a
    non-empty string; the file is read and each line checked. Sets ``args.pair_rows``."""
    given = [name for name in FIELDS if getattr(args, name) is not None]
    if args.pairs is not None:
        if given:
            raise DataError(f"Give either --pairs FILE or --clean/--corrupt/--answer/--wrong, not both "
                            f"(--{' --'.join(given)} given with --pairs).")
        args.pair_rows = read_pairs(args.pairs)
        return
    missing = [name for name in FIELDS if name not in given]
    if missing:
        raise DataError(f"Missing --{', --'.join(missing)}: give a prompt pair as --clean \"...\" --corrupt \"...\" "
                        "--answer \" Paris\" --wrong \" Rome\", or a JSONL file of pairs with --pairs.")
    row = {name: getattr(args, name) for name in FIELDS}
    args.pair_rows = [_checked_row(row, "the command line", lambda name: f"--{name}")]


def _checked_row(row: dict[str, Any], where: str, option: Any) -> dict[str, Any]:
    for name in FIELDS:
        value = row.get(name)
        if name in ("answer", "wrong") and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            continue  # a token id
        if not isinstance(value, str):
            raise DataError(f"{where}: {option(name)} must be a string, got {json.dumps(value)}.")
        empty = not value if name in ("answer", "wrong") else not value.strip()
        if empty:
            raise DataError(f"{where}: {option(name)} is empty; give "
                            + ("one token such as ' Paris'." if name in ("answer", "wrong") else "a prompt."))
    return {name: row[name] for name in FIELDS}


def read_pairs(path: str) -> list[dict[str, Any]]:
    """The prompt pairs of a JSONL file: one JSON object a line with string fields ``clean``, ``corrupt``,
    ``answer`` and ``wrong`` (the answers may be token ids); blank lines are skipped.

    Example:
        >>> import tempfile, pathlib
        >>> f = pathlib.Path(tempfile.mkdtemp()) / "pairs.jsonl"
        >>> _ = f.write_text('{"clean": "A is in", "corrupt": "B is in", "answer": " Paris", "wrong": " Rome"}\\n')
        >>> read_pairs(str(f))[0]["answer"]
        ' Paris'
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"--pairs {path}: no such file. Give a .jsonl file, one {{\"clean\", \"corrupt\", \"answer\", "
                        "\"wrong\"} object a line.")
    if file.stat().st_size > PAIRS_MAX_BYTES:
        raise DataError(f"--pairs {path} is {file.stat().st_size >> 20} MiB; a file of prompt pairs is expected to "
                        f"be under {PAIRS_MAX_BYTES >> 20} MiB.")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (UnicodeDecodeError, OSError) as exc:
        raise DataError(f"--pairs {path} cannot be read as UTF-8 text ({type(exc).__name__}).") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--pairs {path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where} is not JSON ({exc.msg}); write one object a line, e.g. {{\"clean\": \"...\", "
                            "\"corrupt\": \"...\", \"answer\": \" Paris\", \"wrong\": \" Rome\"}.") from None
        if not isinstance(row, dict):
            raise DataError(f"{where} is a JSON {type(row).__name__}, not an object with fields "
                            f"{', '.join(FIELDS)}.")
        missing = [name for name in FIELDS if name not in row]
        if missing:
            raise DataError(f"{where} lacks {', '.join(missing)} (it has {', '.join(map(str, row)) or 'no fields'}); "
                            f"each line needs {', '.join(FIELDS)}.")
        rows.append(_checked_row(row, where, lambda name: f"field {name!r}"))
    if not rows:
        raise DataError(f"--pairs {path} holds no prompt pairs (it is empty).")
    return rows


@command("circuit", "direct logit attribution, edge attribution (EAP) and path patching of the top edges on your "
         "own prompt pair", _circuit_args)
def cmd_circuit(args: argparse.Namespace) -> int:
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    import torch

    import interp
    from interp.figures.localize import circuit_figures
    from interp.io import ensure_writable_dir
    from interp.localize.circuit import circuit
    from interp.runtime.distributed import pin_threads

    out = ensure_writable_dir(args.out)
    start = time.time()
    pin_threads(args.threads)
    model = interp.load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    rows = args.pair_rows
    result = circuit(model, [r["clean"] for r in rows], [r["corrupt"] for r in rows], [r["answer"] for r in rows],
                     [r["wrong"] for r in rows], top_k=args.top, movers=args.movers, ig_steps=args.ig_steps,
                     batch_size=args.batch_size)
    figures = circuit_figures(result)
    seconds = time.time() - start
    written = _write_outputs(out, args, result, figures, seconds)
    _show(result)
    print(f"\n{len(rows)} prompt pair(s), {seconds:.0f} s. Wrote {len(written)} files to {out}/; open "
          f"{out / 'circuit.html'}")
    return 0


def _write_outputs(out: Path, args: argparse.Namespace, result: Any, figures: dict[str, Any],
                   seconds: float) -> list[Path]:
    """Tables, figures, the one-page HTML and the settings, each written atomically through :mod:`interp.io`."""
    import pandas as pd
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    from interp.figures import export_static
    from interp.io import atomic_write_bytes, ensure_writable_dir, write_json

    tables_dir, figures_dir = ensure_writable_dir(out / "tables"), ensure_writable_dir(out / "figures")
    written = []
    tables = {"pairs": pd.DataFrame(args.pair_rows), **result.tables()}
    for name, table in tables.items():
        written.append(tables_dir / f"{name}.csv")
        atomic_write_bytes(written[-1], table.to_csv(index=False).encode())
    plotly_js = get_plotlyjs()
    atomic_write_bytes(figures_dir / "plotly.min.js", plotly_js.encode())
    for name, fig in figures.items():  # plotly.js beside the pages: offline, not copied into each file
        written.append(figures_dir / f"{name}.html")
        atomic_write_bytes(written[-1], pio.to_html(fig, include_plotlyjs="directory", full_html=True).encode())
    browser = os.environ.get("BROWSER_PATH", "")
    if browser and Path(browser).exists():
        written.extend(export_static(figures, figures_dir, formats=("png",)))
    written.append(out / "circuit.html")
    atomic_write_bytes(written[-1], circuit_page(result, figures, plotly_js, args.model, seconds).encode("utf-8"))
    written.append(out / "settings.json")
    write_json(written[-1], {"command": "circuit", "model": args.model, "dtype": args.dtype, "top": args.top,
                             "movers": args.movers, "ig_steps": args.ig_steps, "batch_size": args.batch_size,
                             "pairs": args.pair_rows, "movers_found": result.movers,
                             "logit_diff": result.settings["logit_diff"], "seconds": seconds})
    return written


def _show(result: Any) -> None:
    import pandas as pd

    table = result.confirmed[["rank", "edge", "eap", "path_patching", "agree"]]
    with pd.option_context("display.width", 200, "display.max_columns", 10, "display.float_format", "{:.3f}".format):
        print(f"\nMean logit difference {result.settings['logit_diff']:.3f}; top heads by direct effect: "
              f"{', '.join(result.movers) or 'none asked'}\n\nEAP's top edges against exact path patching\n{table}")


# ---------------------------------------------------------------------------------------
# The one-page HTML


PAGE_CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1100px;
margin:2em auto;padding:0 1em;color:#222;line-height:1.45}h1{font-size:1.6em}h2{margin-top:1.6em;
border-bottom:1px solid #ddd}table{border-collapse:collapse;font-size:90%}td,th{padding:2px 8px;
border-bottom:1px solid #eee;text-align:left}.note{color:#555}code{background:#f4f4f4;padding:0 3px}"""

SECTIONS = (
    ("dla_heads", "Direct logit attribution",
     "Each head's direct contribution to the logit difference at the last token (final norm's scale frozen): "
     "blue pushes towards the answer, red towards the wrong answer. The top heads become receivers below."),
    ("edges", "Edge attribution patching (EAP)",
     "First-order estimate of every edge sender -> receiver: the change of the logit difference when the "
     "sender is taken from the corrupted prompt along that edge only. Receivers: the logits (direct path) and "
     "the queries, keys and values of the top heads."),
    ("confirmed", "Path patching: the top edges measured exactly",
     "Each pair of bars is one edge: EAP's estimate beside the exact path-patching effect. Where they agree in "
     "sign and size, the estimate is trustworthy for that edge."),
    ("attention", "Where the top heads look",
     "Attention from the last token of the first clean prompt, per top head; positions are labelled by "
     "their tokens (a repeated token carries its position, as in John·3)."),
)


def circuit_page(result: Any, figures: dict[str, Any], plotly_js: str, model: str, seconds: float) -> str:
    """One self-contained HTML page: the prompt pairs, each figure with how to read it, the confirmed
    edges; plotly.js is inlined, so the page fetches nothing and opens offline."""
    import plotly.io as pio

    from interp.display import summary_html

    esc = html.escape
    pairs = [f"<tr><td>{esc(c)}</td><td>{esc(k)}</td><td><code>{esc(repr(a))}</code></td>"
             f"<td><code>{esc(repr(w))}</code></td></tr>"
             for c, k, a, w in zip(result.settings["clean"], result.settings["corrupt"], result.answer_text,
                                   result.wrong_text, strict=True)][:20]
    parts = [f"<h1>Circuit of {esc(model)} on {len(result.answer_text)} prompt pair(s)</h1>",
             f"<p class='note'>Mean logit difference {result.settings['logit_diff']:.3f} "
             f"(answer minus wrong, clean prompts); computed in {seconds:.0f} s.</p>",
             "<table><tr><th>clean</th><th>corrupt</th><th>answer</th><th>wrong</th></tr>", *pairs, "</table>"]
    for key, title, note in SECTIONS:
        if key not in figures:
            continue
        div = pio.to_html(figures[key], include_plotlyjs=False, full_html=False, div_id=f"fig-{key}",
                          config={"displaylogo": False})
        parts += [f"<h2>{esc(title)}</h2>", f"<p class='note'>{esc(note)}</p>", div]
        if key == "confirmed":
            parts.append(summary_html("Confirmed edges (tables/confirmed.csv)", result.confirmed,
                                      max_rows=len(result.confirmed)))
    parts.append("<p class='note'>Tables: <code>tables/*.csv</code>; figures: <code>figures/</code>; made by "
                 "<code>interp circuit</code> (docs/circuits.md).</p>")
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>interp circuit</title>"
            f"<style>{PAGE_CSS}</style><script>{_inline(plotly_js)}</script></head><body>"
            + "\n".join(parts) + "</body></html>\n")


def _inline(js: str) -> str:
    """``js`` to inline in a ``<script>`` element, refused if it would end the element early (as the
    report inlines it; not imported from there: the report package loads scipy, seconds for one check)."""
    if re.search(r"</script|<!--", js, flags=re.IGNORECASE):
        raise ValueError("this plotly.js cannot be inlined: it contains '</script' or '<!--'")
    return js
