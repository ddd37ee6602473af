"""Build the API reference with pdoc, and list the cross-references it could not resolve.

``make docs`` runs this: ``python docs/build_api.py --out site``. The pages render the
Google-style docstrings of ``interp``, ``interp.attention``, ``interp.quant`` and the other
public submodules (those named in ``interp.__all__``).

Two things pdoc does not do on its own:

- The packages export their public names lazily (a module ``__getattr__``), which pdoc does
  not follow; they are looked up once here, so each package page lists what
  ``from interp import X`` gives.
- pdoc links a reference (``:func:`probe```, ``:class:`interp.quant.apply.QuantInfo```,
  `` `interp.localize.lens` ``) when it resolves and silently leaves it as code otherwise. Such a
  leftover is a broken cross-reference: :func:`unresolved` finds them in the HTML, and the
  build fails on them (``tests/test_api_reference.py`` runs the same check).

A reference counts as one to resolve when it names a dotted path inside the project
(``interp.…``) or came from a Sphinx role (pdoc writes those as ``name()`` or ``name``
inside ``<code>``; only the ``()`` form can be told apart in the HTML, so a broken
``:class:`` role to a bare name is not caught). References to other libraries
(``torch.…``, ``transformers.…``) are left alone.
"""

from __future__ import annotations

import argparse
import html
import importlib
import re
import sys
import warnings
from pathlib import Path

PACKAGES = ("interp", "interp.attention", "interp.quant")
# Plain inline code; highlighted listings (source, examples) are split into <span>s and never match.
_CODE = re.compile(r"<code>([^<]*)</code>")
_PROJECT_REF = re.compile(r"^interp(\.\w+)+(\(\))?$")
# pdoc's own pattern for Sphinx roles; it writes :func:/:meth: targets as ``name()``.
_ROLE = re.compile(r"(:py)?:(mod|func|data|const|class|meth|attr|exc|obj):`([^`]+)`")
ROOT = Path(__file__).resolve().parents[1]


def materialize_lazy_exports() -> None:
    """Put each lazily exported name of ``PACKAGES`` into its module dict, where pdoc looks."""
    for name in PACKAGES:
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", []):
            if attr not in vars(module):
                setattr(module, attr, getattr(module, attr))


def public_modules() -> list[str]:
    """Every module of the package but ``__main__`` and underscore-prefixed ones."""
    names = []
    for path in sorted((ROOT / "interp").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(part.startswith("_") for part in parts):
            names.append(".".join(parts))
    return names


def role_targets() -> set[str]:
    """Every Sphinx-role target in the package's source, as pdoc writes it (``name()`` for functions)."""
    targets = set()
    for path in (ROOT / "interp").rglob("*.py"):
        for _, kind, name in _ROLE.findall(path.read_text(encoding="utf-8")):
            targets.add(f"{name}()" if kind in ("func", "meth") else name)
    return targets


def build(out: Path) -> list[str]:
    """Render the reference into ``out`` and return the unresolved references found."""
    import pdoc
    import pdoc.render

    materialize_lazy_exports()
    pdoc.render.configure(docformat="google", show_source=True, search=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*public_modules(), output_directory=out)
    # Each package spec also walks its submodules, already listed: those repeats are expected.
    problems = [f"pdoc: {w.message}" for w in caught
                if "pdoc" in str(w.filename) and "has already been added" not in str(w.message)]
    return problems + unresolved(out)


def unresolved(site: Path) -> list[str]:
    """``page: reference`` for every project reference left as plain code in a docstring."""
    found = []
    roles = role_targets()
    for page in sorted(site.rglob("*.html")):
        text = page.read_text(encoding="utf-8")
        for code in _CODE.findall(text):
            ref = html.unescape(code).strip()
            if _PROJECT_REF.match(ref) or ref in roles:
                found.append(f"{page.relative_to(site)}: {ref}")
    return sorted(set(found))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="site", help="output folder (default: site/)")
    args = parser.parse_args(argv)
    problems = build(Path(args.out))
    for line in problems:
        print(f"unresolved reference: {line}", file=sys.stderr)
    print(f"API reference in {args.out}/index.html; {len(problems)} unresolved references.")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
