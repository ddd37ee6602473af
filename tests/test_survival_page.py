"""docs/survival.md's generated section is what the committed raw data give (issue 48: one command recomputes
every number on the page, and a test does)."""

from __future__ import annotations

import shutil

import pytest

from interp.report.survival import page as survival_page


def _generated(text: str) -> str:
    return text[text.index(survival_page.BEGIN):text.index(survival_page.END)]


def test_the_page_is_generated_from_the_committed_raw_data(tmp_path):
    copy = tmp_path / "survival.md"
    shutil.copy(survival_page.PAGE, copy)
    raw = tmp_path / survival_page.RAW.name  # the page names the raw folder by its last two parts
    if survival_page.RAW.is_dir():
        shutil.copytree(survival_page.RAW, raw)  # the tables the page writes beside the data land in the copy
    survival_page.write(raw, copy)
    assert _generated(copy.read_text()) == _generated(survival_page.PAGE.read_text()), \
        "docs/survival.md is stale: run `python -m interp.report.survival.page`"


def test_a_hand_edited_number_is_caught(tmp_path):
    page = tmp_path / "survival.md"
    page.write_text(f"# S\n\n{survival_page.BEGIN}\n| x | 0.51 [0.40, 0.62] |\n{survival_page.END}\n")
    (tmp_path / "raw-empty").mkdir()  # a raw folder with no model in it: every model 'Not run yet'
    survival_page.write(tmp_path / "raw-empty", page)
    assert "0.51 [0.40, 0.62]" not in page.read_text() and "Not run yet" in page.read_text()


def test_a_page_without_markers_is_refused(tmp_path):
    from interp.errors import DataError

    page = tmp_path / "survival.md"
    page.write_text("# no markers\n")
    (tmp_path / "raw-empty").mkdir()
    with pytest.raises(DataError, match="markers"):
        survival_page.write(tmp_path / "raw-empty", page)
    assert page.read_text() == "# no markers\n"
    with pytest.raises(DataError, match="is not a folder"):  # a mistyped --raw never empties the section
        survival_page.write(tmp_path / "raw-none", page)


def test_every_figure_the_page_links_is_drawn():
    """The page names each figure by the SHA-256 of the data it draws (and the first test checks those names
    against the committed data), so a figure left undrawn after the data changed is a missing file here."""
    import re

    links = re.findall(r"\]\((img/survival/[^)]+\.png)\)", _generated(survival_page.PAGE.read_text()))
    assert links, "the page links no figure"
    missing = [link for link in links if not (survival_page.PAGE.parent / link).is_file()]
    assert not missing, f"run `python -m interp.report.survival.page --figures`: {missing} not drawn"


def test_figure_names_follow_their_data():
    import pandas as pd

    frame = pd.DataFrame({"method": ["rtn"], "edge": ["a->b"], "ratio": [0.5], "verdict": ["broken"]})
    (name, *_), = survival_page.figure_specs("m", {"ioi": {"per_edge": frame}})
    (other, *_), = survival_page.figure_specs("m", {"ioi": {"per_edge": frame.assign(ratio=0.6)}})
    assert name.startswith("m-ioi-") and other.startswith("m-ioi-") and name != other


def test_no_figure_is_left_unlinked():
    """A figure drawn from earlier data is named otherwise than the page's link: the page command names it for
    removal, and none is committed."""
    import re

    folder = survival_page.FIGURES
    linked = set(re.findall(r"\]\(img/survival/([^)]+\.png)\)", _generated(survival_page.PAGE.read_text())))
    drawn = {p.name for p in folder.glob("*.png")} if folder.is_dir() else set()
    assert drawn - linked == set(), "figures the page no longer links: git rm them"


def test_a_bound_that_rounds_to_zero_is_not_negative():
    # a normal interval around a share of 0 (no dead latents) has a lower bound of about -2e-4: shown as 0.00
    assert survival_page._num(-0.0002) == "0.00"
    assert survival_page._num(-0.006) == "-0.01"
    assert survival_page._num(float("nan")) == "n/a"
    row = {"d": 0.0002, "d_low": -0.0001, "d_high": 0.0005}
    assert survival_page._iv(row, "d", scale=100) == "0.02 [-0.01, 0.05]"
