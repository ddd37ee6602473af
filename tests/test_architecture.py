"""The package's import structure: no cycles, and the layer contracts in setup.cfg hold.

The contracts themselves run as ``lint-imports`` in ``make test``; this test is the
independent check the issue asks for: grimp's graph of every import (function-local ones
included) has no strongly connected component larger than one module.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_known_cycle():
    graph = grimp.ImportGraph()
    for name in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(name)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.z")
    graph.add_import(importer="a.z", imported="a.x")
    graph.add_import(importer="a", imported="a.x")
    assert _cycles(graph) == [["a.x", "a.y", "a.z"]]


def test_the_package_has_no_import_cycle():
    graph = grimp.build_graph("interp", include_external_packages=False)
    assert len(graph.modules) > 40  # the whole package was read
    assert _cycles(graph) == []


def test_make_test_runs_the_layer_contracts():
    contracts = configparser.ConfigParser()
    contracts.read(ROOT / "setup.cfg")
    names = [s for s in contracts.sections() if s.startswith("importlinter:contract:")]
    assert {"importlinter:contract:layers", "importlinter:contract:analyses-do-not-draw",
            "importlinter:contract:nothing-imports-cli"} <= set(names)
    layers = contracts["importlinter:contract:layers"]["layers"].split()
    assert layers.index("interp.cli") < layers.index("interp.report") < layers.index("interp.figures")
    assert "lint-imports" in (ROOT / "Makefile").read_text()


def test_architecture_page_shows_todays_graph():
    """docs/architecture.md's layer graph is the one the code draws today (regenerate with
    `python docs/build_architecture.py --write`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_architecture", ROOT / "docs" / "build_architecture.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    page = (ROOT / "docs" / "architecture.md").read_text()

    def arrows(block: str) -> set[str]:
        """The arrows between layers, without their import counts (those move with every edit)."""
        return {re.sub(r"-(-|\.) \d+ (-->|\.->)", r"\2", line.strip()) for line in block.splitlines()
                if "-->" in line or ".->" in line}

    assert arrows(builder.current_block(page)) == arrows(builder.block()), \
        "stale graph: run python docs/build_architecture.py --write"
    # the generated graph shows exactly one upward arrow: probes -> attention
    assert builder.block().count(".->") == 1 and "probes -. 1 .-> attention" in builder.block()
