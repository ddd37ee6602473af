"""Recoveries on both scales (interp.report.scales) and the disclosed order of events behind the NLL scale."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from interp.report import reproduction as rp
from interp.report import scales
from interp.report.scales import RECOVERY_ROWS, perplexity_reading
from interp.stats import Estimate

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "reproduction"
PAGE = ROOT / "docs" / "reproduction.md"


def _registered(name: str) -> dict[str, rp.Measurement]:
    data = json.loads((DATA / name / "mc_error.json").read_text())
    return {k: rp.measurement_from_dict(data["claims"][k]["registered"]) for k in RECOVERY_ROWS}


@pytest.mark.parametrize("name", ["smollm2-confirmatory-2", "gemma3-confirmatory-1"])
def test_the_perplexity_reading_agrees_with_the_reason_the_registered_rule_gives(name):
    """The registered rule writes its level part's perplexity reading into its reason; the reading here, level part
    first, says the same (and adds the ordering or the paired control, as the rule does on NLL)."""
    for key, m in _registered(name).items():
        reading = perplexity_reading(key, m)
        if key == "patch_up":
            assert reading is None
            continue
        shown = re.search(r"on the perplexity scale \(shown, not judged\): ([^;]+)", rp.judge(key, m).reason)
        assert shown is not None and reading is not None, key
        assert scales._level(key, m.estimates["recovery_ppl"]).verdict == shown.group(1), key
        assert reading.reason.startswith(scales._level(key, m.estimates["recovery_ppl"]).reason), key


def test_smollm2_attention_is_weaker_on_nll_and_contradicted_on_perplexity():
    """The issue's case: registration 2's attention patching recovers less than half of the NLL gap and more than
    half of the perplexity gap, so the scale decides the row."""
    m = _registered("smollm2-confirmatory-2")["patch_attn_out"]
    assert m.estimates["recovery"].high < rp.LITTLE <= m.estimates["recovery_ppl"].low
    assert rp.judge("patch_attn_out", m).verdict == rp.WEAKER
    reading = perplexity_reading("patch_attn_out", m)
    assert reading is not None and reading.verdict == rp.CONTRADICTED


def test_the_reading_follows_the_rule_part_by_part():
    """Level and ordering both shown: the level's verdict; the ordering contradicted: contradicted; two instances:
    instance-limited, with what the examples alone say."""
    ppl = Estimate(0.95, 0.94, 0.96)  # above the paper's perplexity-scale level for down (0.9348)
    good = rp.Measurement({"recovery": Estimate(0.9, 0.89, 0.91), "recovery_ppl": ppl, "margin": Estimate(.5, .4, .6)})
    assert perplexity_reading("patch_down", good).verdict == rp.AS_STRONG
    bad = rp.Measurement({**good.estimates, "margin": Estimate(-0.5, -0.6, -0.4)})
    assert perplexity_reading("patch_down", bad).verdict == rp.CONTRADICTED
    few = rp.Measurement({**good.estimates, "instances": Estimate(2, 2, 2)})
    limited = perplexity_reading("patch_down", few)
    assert limited.verdict == rp.INSTANCE_LIMITED and f"rule reads '{rp.AS_STRONG}'" in limited.reason
    assert perplexity_reading("patch_down", rp.Measurement({"recovery": ppl, "margin": ppl})) is None


def _history() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True,
                             text=True, timeout=60, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout: the commits the page dates cannot be read"
    return "a shallow clone: the commits the page dates are not here" if out == "true" else None


@pytest.mark.skipif(_history() is not None, reason=_history() or "")
def test_the_pages_order_of_events_is_the_historys():
    """The page dates four commits (registration 1, its data, the one-scale rules, registration 2); each exists
    with that date, touches what the page says, and they come in that order."""
    text = PAGE.read_text()
    events = re.findall(r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2}), `([0-9a-f]{7})`", text)
    assert [h for _, h in events] == ["48b81cb", "9a88177", "554fbd0", "ef6f0c9"]
    times = []
    for date, commit in events:
        stamp = subprocess.run(["git", "-C", str(ROOT), "show", "-s", "--format=%ad", "--date=format-local:%Y-%m-%d "
                                "%H:%M", commit], capture_output=True, text=True, timeout=60, check=True,
                               env={**os.environ, "TZ": "UTC"}).stdout.strip()
        assert stamp == date, (commit, stamp)
        times.append(stamp)
    assert times == sorted(times)
    touched = {c: subprocess.run(["git", "-C", str(ROOT), "show", "--format=", "--name-only", c], capture_output=True,
                                 text=True, timeout=60, check=True).stdout.split() for _, c in events}
    assert "docs/preregistration/smollm2-confirmatory-1.json" in touched["48b81cb"]
    assert any(p.startswith("docs/data/reproduction/smollm2-confirmatory-1/") for p in touched["9a88177"])
    assert "interp/report/reproduction.py" in touched["554fbd0"]
    assert "docs/preregistration/smollm2-confirmatory-2.json" in touched["ef6f0c9"]
