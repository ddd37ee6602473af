"""Compare finished reports' reproduction tables side by side: ``python -m interp.report.compare DIR... --out DIR``.

The comparisons a reader makes with the claims of :mod:`interp.report.reproduction`: one run's measurement
against the paper in a sentence (:func:`comparison`), several reports' tables row by row (:func:`side_by_side`),
as a plain pipe table (:func:`markdown_table`). Its own module, so that running the command does not re-import a
module the package has already loaded; the names are still importable from :mod:`interp.report.reproduction`.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from interp.report.reproduction import CLAIMS, judge
from interp.report.verdicts import NOT_TESTABLE, VERDICTS, Measurement


def comparison(key: str, measurement: Measurement | None) -> str:
    """One sentence comparing this run's ``measurement`` with the paper, by claim ``key``'s pre-registered rule.

    The same :func:`~interp.report.reproduction.judge` the report's reproduction table applies, so a notebook
    and the report say the same thing about the same numbers (the verdict, and why).

    Example:
        >>> from interp.stats import Estimate
        >>> m = Measurement({"pearson": Estimate(0.9, 0.85, 0.94, 48)}, "0.90 [0.85, 0.94] over 3 pairs")
        >>> print(comparison("agreement", m))  # doctest: +ELLIPSIS
        Quantization errors (arXiv 2506.12044) found that ...; here 0.90 [0.85, 0.94] over 3 pairs: as strong as ...
    """
    c = CLAIMS[key]
    j = judge(key, measurement)
    measured = measurement.text if measurement is not None and measurement.text else "nothing measured"
    return f"{c.paper} found that {c.claim[:1].lower()}{c.claim[1:]} ({c.paper_value}); here {measured}: " \
           f"{j.verdict} ({j.reason})."



def side_by_side(tables: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """Several columns' reproduction tables, row by row: claim, the paper's value, then each column's
    measurement and verdict, and a summary across columns.

    A claim measured independently of the model (the SAOBP training logs) is counted once: its
    measurement and verdict appear in the first column, and the other columns point there.
    """
    names = list(tables)
    first = next(iter(tables.values()))
    out = first[["paper", "claim", "paper value"]].copy()
    independent = {c.claim for c in CLAIMS.values() if c.model_independent}
    once = f"counted once (model-independent: see {names[0]})"
    for i, (name, table) in enumerate(tables.items()):
        indexed = table.set_index("claim")

        def cell(claim_text: str, column: str, missing: str, i: int = i, indexed: pd.DataFrame = indexed) -> str:
            if i > 0 and claim_text in independent:
                return once
            return str(indexed.loc[claim_text, column]) if claim_text in indexed.index else missing

        out[f"{name}: measured"] = [cell(c, "measured here", "not run") for c in out["claim"]]
        out[f"{name}: verdict"] = [cell(c, "verdict", NOT_TESTABLE) for c in out["claim"]]

    def across(row: pd.Series) -> str:
        if row["claim"] in independent:
            return f"{row[f'{names[0]}: verdict']} (once, model-independent)"
        verdicts = [row[f"{n}: verdict"] for n in names]
        phrases = []
        for verdict in VERDICTS:
            which = [n for n, v in zip(names, verdicts, strict=True) if v == verdict]
            if which:
                who = ("both" if len(names) == 2 else "all") if len(which) == len(names) else ", ".join(which)
                phrases.append(f"{verdict} on {who}")
        return "; ".join(phrases)

    out["across columns"] = out.apply(across, axis=1)
    return out


def markdown_table(table: pd.DataFrame) -> str:
    """A plain pipe table (pipes inside cells escaped)."""
    def cell(v: object) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(c) for c in table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m interp.report.compare REPORT_DIR [REPORT_DIR ...] --out FOLDER``: the side-by-side table
    of several finished reports (their ``tables/reproduction.csv``), as CSV and markdown."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description="Compare the reproduction tables of finished reports.")
    parser.add_argument("reports", nargs="+", help="report folders (each holds results.json)")
    parser.add_argument("--out", required=True, help="folder for reproduction.csv and reproduction.md")
    args = parser.parse_args(argv)
    tables = {}
    for folder in map(Path, args.reports):
        results = json.loads((folder / "results.json").read_text())
        tables[str(results["settings"]["model"])] = pd.DataFrame(results["reproduction"])
    table = side_by_side(tables)
    from interp.io import write_csv, write_text

    out = Path(args.out)
    write_csv(out / "reproduction.csv", table, index=False)
    write_text(out / "reproduction.md", markdown_table(table.drop(columns=["paper"])))
    print(table[["claim"] + [c for c in table.columns if c.endswith("verdict")] + ["across columns"]].to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
