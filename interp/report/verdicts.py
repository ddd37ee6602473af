"""The verdicts a pre-registered claim can get, what each asserts, and what a rule reads (:class:`Measurement`).

The claims and their rules are in :mod:`interp.report.reproduction`; this module is the vocabulary they
share with the report's pages and tables.

**The verdicts.** No verdict reads a point estimate when an interval exists, and a wider interval
can never earn a stronger verdict:

- ``as strong as the paper``: the whole interval lies at or beyond the paper's level (for a
  claim of direction only: the whole interval lies on the claimed side of the null);
- ``consistent with the paper``: the interval excludes the null and contains the paper's level;
- ``weaker than the paper``: the effect is present (the null is excluded) but the whole interval
  falls short of the paper's level;
- ``not shown``: the null (or an edge of the claimed band) lies inside the interval; the reason
  says so, and says "underpowered" with the sample size that would be needed where that is known;
- ``contradicted``: the whole interval lies on the other side (the reason says what happened, e.g.
  "the patch makes the model worse");
- ``not testable here``, with the reason; ``by construction``.

Each verdict asserts a set of conclusions (:data:`CONCLUSIONS`): "as strong" asserts that the
effect is present and at the paper's level, "weaker" that it is present and below that level,
"consistent" only that it is present, "contradicted" that it lies on the other side, and "not
shown" nothing. Widening an interval around the same point can only remove conclusions; the
property test in ``tests/test_reproduction.py`` checks this for every rule.


"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from interp.stats import Estimate

Verdict = Literal["diagnostic (no verdict)",
                  "as strong as the paper", "present; level not resolved", "weaker than the paper", "not shown",
                  "contradicted", "not testable here", "by construction", "too few examples for a verdict",
                  "instance-limited"]
AS_STRONG: Verdict = "as strong as the paper"
CONSISTENT: Verdict = "present; level not resolved"  # was "consistent with the paper" (registration 1)
WEAKER: Verdict = "weaker than the paper"
NOT_SHOWN: Verdict = "not shown"
CONTRADICTED: Verdict = "contradicted"
NOT_TESTABLE: Verdict = "not testable here"
BY_CONSTRUCTION: Verdict = "by construction"
TOO_FEW: Verdict = "too few examples for a verdict"  # the measurement is shown; its interval decides nothing
DIAGNOSTIC: Verdict = "diagnostic (no verdict)"  # shown beside a claim; the paper makes no such claim
INSTANCE_LIMITED: Verdict = "instance-limited"  # fewer than 3 calibrated instances: the instance component is unknown
VERDICTS: tuple[Verdict, ...] = (AS_STRONG, CONSISTENT, WEAKER, NOT_SHOWN, CONTRADICTED, NOT_TESTABLE,
                                 BY_CONSTRUCTION, TOO_FEW, INSTANCE_LIMITED, DIAGNOSTIC)
# What each verdict asserts. A wider interval must never add to this set (the monotonicity property).
CONCLUSIONS: dict[str, frozenset[str]] = {
    AS_STRONG: frozenset({"present", "at the paper's level"}),
    CONSISTENT: frozenset({"present"}),
    WEAKER: frozenset({"present", "below the paper's level"}),
    NOT_SHOWN: frozenset(),
    CONTRADICTED: frozenset({"the other side"}),
    NOT_TESTABLE: frozenset(),
    BY_CONSTRUCTION: frozenset(),
    TOO_FEW: frozenset(),
    INSTANCE_LIMITED: frozenset(),
    DIAGNOSTIC: frozenset(),
}

# The verdicts that conclude something about the paper's level or direction (instance-limited withholds them)
CONCLUDING = frozenset({AS_STRONG, CONSISTENT, WEAKER, NOT_SHOWN, CONTRADICTED})


@dataclass(frozen=True)
class Measurement:
    """What a stage measured for one claim.

    Attributes:
        estimates: the named statistics the claim's rule reads.
        text: the "measured here" cell, in words.
        untestable: why the claim cannot be tested here (then the rule is not applied).
    """

    estimates: dict[str, Estimate] = field(default_factory=dict)
    text: str = ""
    untestable: str | None = None


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    reason: str


Rule = Callable[[Measurement], Judgement]


@dataclass(frozen=True)
class Claim:
    """One pre-registered finding."""

    key: str
    paper: str
    claim: str
    paper_value: str
    statistic: str
    criterion: str
    rule: Rule
    model_independent: bool = False  # measured once for every model (the SAOBP training logs)
    min_n: int = 0  # the fewest examples its intervals may resample (0: not counted in examples)


def measurement_to_dict(m: Measurement) -> dict[str, object]:
    """JSON-ready form of a measurement (stages store it in ``numbers.json``)."""
    return {"estimates": {k: [e.value, e.low, e.high, e.n] for k, e in m.estimates.items()}, "text": m.text,
            "untestable": m.untestable}


def measurement_from_dict(d: Mapping[str, object]) -> Measurement:
    raw = d.get("estimates") or {}
    assert isinstance(raw, dict)

    def num(v: object) -> float:
        return math.nan if v is None else float(v)  # type: ignore[arg-type]

    estimates = {k: Estimate(num(v[0]), num(v[1]), num(v[2]), None if v[3] is None else int(v[3]))
                 for k, v in raw.items()}
    untestable = d.get("untestable")
    return Measurement(estimates, str(d.get("text", "")), None if untestable is None else str(untestable))
