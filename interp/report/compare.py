"""Compare finished reports' reproduction tables side by side: ``python -m interp.report.compare DIR... --out DIR``.

The command-line face of :func:`interp.report.reproduction.main`, in a module of its own so
that running it does not re-import a module the package has already loaded.
"""

from __future__ import annotations

from interp.report.reproduction import main

if __name__ == "__main__":
    raise SystemExit(main())
