"""Draw the package's layers and the imports between them as a Mermaid graph, from the code.

    python docs/build_architecture.py            # print the graph
    python docs/build_architecture.py --write    # refresh it inside docs/architecture.md

The graph groups modules by layer (the base modules together), reads every import with
grimp (function-local imports included, as import-linter does), and draws one arrow per
pair of groups that import each other, labelled with the number of module-level imports.
``tests/test_architecture.py`` fails when docs/architecture.md holds a stale graph.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

import grimp

DOC = Path(__file__).resolve().parent / "architecture.md"
BEGIN, END = "<!-- layers:begin (docs/build_architecture.py) -->", "<!-- layers:end -->"
# Top to bottom: the order of the layers contract in setup.cfg.
GROUPS = ["cli", "report", "figures", "attention", "quant", "localize", "probes", "runtime", "base"]
BASE = {"errors", "typing", "io", "stats", "data", "models", "architecture", "validate", "display"}
WHAT = {
    "cli": "interp COMMAND: parse, validate, dispatch",
    "report": "stages in order, claims judged, HTML",
    "figures": "results to plotly figures",
    "attention": "entropy, GTD, SAOBP, training",
    "quant": "quantizers, scoring store, error analyses",
    "localize": "early exit, restoration, patching",
    "probes": "streaming reducers over hooks",
    "runtime": "hook points, batching, readout, decoder, scoring",
    "base": "examples, models, stats, io, errors",
}


def group_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the root package's face
    head = parts[1]
    if head in BASE:
        return "base"
    return head if head in GROUPS else None


def edges() -> Counter[tuple[str, str]]:
    graph = grimp.build_graph("interp", include_external_packages=False)
    counts: Counter[tuple[str, str]] = Counter()
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            a, b = group_of(importer), group_of(imported)
            if a and b and a != b:
                counts[(a, b)] += 1
    return counts


def mermaid() -> str:
    lines = ["```mermaid", "flowchart TB"]
    for name in GROUPS:
        lines.append(f'    {name}["<b>{name}</b><br/>{WHAT[name]}"]')
    for (a, b), n in sorted(edges().items(), key=lambda item: (GROUPS.index(item[0][0]), GROUPS.index(item[0][1]))):
        up = GROUPS.index(b) < GROUPS.index(a)
        lines.append(f"    {a} {'-. ' if up else '-- '}{n} {'.->' if up else '-->'} {b}")
    lines.append("```")
    return "\n".join(lines)


def block() -> str:
    return f"{BEGIN}\n{mermaid()}\n{END}"


def current_block(text: str) -> str | None:
    match = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), text, re.S)
    return match.group(0) if match else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="refresh the graph inside docs/architecture.md")
    args = parser.parse_args()
    if not args.write:
        print(block())
        return
    text = DOC.read_text()
    old = current_block(text)
    DOC.write_text(text.replace(old, block()) if old else text + "\n" + block() + "\n")
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
