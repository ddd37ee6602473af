"""Monte Carlo error of the interval ends that decide a registered verdict.

A bootstrap interval's ends are random twice over: once through the data, and once through the resamples
drawn. The second part, the Monte Carlo error, shrinks with the number of resamples but never vanishes, and a
verdict reads an interval end against a threshold (the null, the paper's level, the edge of a band). When the
end lies close to its threshold, the bootstrap seed can decide the verdict.

This module re-analyses a registration's committed raw data (``raw/``) with K fresh bootstrap seeds, everything
else as registered (the same rules, statistics and ``n_boot``; :func:`interp.report.confirm.analyse` itself), and
for every claim finds its **deciding bound**: among the interval ends whose move across a threshold of the
claim's rule would change the verdict, the one nearest its threshold in units of its Monte Carlo standard error
(the standard deviation of that end over the K seeds).

**The rule for registrations from now on** (:func:`boundary_reading`): a verdict whose deciding bound lies within
:data:`BOUNDARY_Z` Monte Carlo standard errors of its threshold reads "on the boundary", with both readings: the
verdict as computed, and the verdict with that bound on the other side of its threshold. The existing
registrations' fingerprint does not include it, so their verdicts stay as registered; for them the reproduction
page shows the bound and its Monte Carlo error beside the registered verdict.

    python -m interp.report.mc_error docs/preregistration/smollm2-confirmatory-2.json \\
        --raw docs/data/reproduction/smollm2-confirmatory-2/raw --seeds 20 \\
        --out docs/data/reproduction/smollm2-confirmatory-2/mc_error.json
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from interp.errors import InterpError, exit_status
from interp.io import write_json
from interp.report import confirm
from interp.report import reproduction as rp
from interp.stats import Estimate

BOUNDARY_Z = 2.0  # within this many Monte Carlo standard errors of its threshold, a deciding bound is on the boundary
SIDES = ("low", "high")


def thresholds(key: str, m: rp.Measurement) -> dict[str, tuple[float, ...]]:
    """The thresholds each interval of claim ``key`` is read against by its rule (``interp.report.reproduction``):
    the null, the paper's level and the edges of a band. The perplexity-scale recoveries are shown, not judged, and
    the noise-corrected agreement is a diagnostic, so neither has one."""
    patch = {c: rp.PATCH_LEVELS[c] for c in ("down", "gate", "attn_out")}
    if key == "agreement":
        return {"pearson": (0.0, rp.AGREEMENT_LEVEL)}
    if key == "jaccard_top10":
        chance = m.estimates.get("chance")
        return {"jaccard": (chance.value, rp.JACCARD_LEVEL)} if chance is not None else {}
    if key == "norm_error":
        return {"r_3bit": (0.0, rp.NORM_LEVEL)}
    if key in ("kurtosis", "gate_input"):
        return {"diff": (0.0,)}
    if key == "outlier_gamma":
        return {"percentile": (0.5, rp.OUTLIER_LEVEL)}
    if key in ("early_exit_tuned", "early_exit_logit"):  # the band's upper edge as the rule writes it
        return {rp._share_key(f): (0.0, rp.EARLY_EXIT_SHARE + 1e-9, rp.EARLY_EXIT_LEVEL) for f in rp.SPLIT_FRACTIONS}
    if key == "restoration":
        return {"recovery": (0.0, rp.LITTLE, rp.RESTORATION_LEVEL), "top_minus_random": (0.0,)}
    if key in ("patch_down", "patch_gate"):
        return {"recovery": (0.0, patch[key[6:]]), "margin": (0.0,)}
    if key == "patch_attn_out":
        return {"recovery": (0.0, rp.LITTLE, patch["attn_out"]), "margin": (0.0,)}
    if key == "patch_up":
        return {"margin": (0.0,)}
    return {}


def measurements(p: confirm.Preregistration, raw: str | Path) -> dict[str, rp.Measurement]:
    """Every claim's measurement from :func:`interp.report.confirm.analyse` on ``raw`` under registration ``p``.

    ``analyse`` returns its table, not its measurements, and its code may not change (its source is in the
    registrations' fingerprint), so the measurements are read where it hands them to ``reproduction_frame``."""
    captured: dict[str, rp.Measurement] = {}
    original = rp.reproduction_frame

    def capture(measurements: Mapping[str, rp.Measurement], keys: list[str] | None = None) -> pd.DataFrame:
        captured.update(measurements)
        return original(measurements, keys)

    rp.reproduction_frame = capture
    try:
        confirm.analyse(p, raw)
    finally:
        rp.reproduction_frame = original
    return captured


def fresh_seeds(registered: int, count: int) -> list[int]:
    """``count`` bootstrap seeds drawn from the registered seed (reproducible, none equal to it)."""
    state = np.random.SeedSequence(registered).generate_state(count + 1, dtype=np.uint32)
    return [int(s) for s in state if int(s) != registered][:count]


def _bounds(m: rp.Measurement, key: str) -> dict[str, list[float]]:
    return {name: [m.estimates[name].low, m.estimates[name].high] for name in thresholds(key, m)
            if name in m.estimates and m.estimates[name].has_interval}


def compute(prereg: str | Path, raw: str | Path, count: int) -> dict[str, Any]:
    """The registered analysis and ``count`` re-analyses with fresh seeds, as committed JSON (:func:`summarise`
    reads it)."""
    if count < 2:
        raise InterpError(f"--seeds {count}: a Monte Carlo standard error needs at least 2 seeds.")
    p = confirm.Preregistration.load(prereg)
    start = time.process_time()
    registered = measurements(p, raw)
    seconds = time.process_time() - start
    seeds = fresh_seeds(p.seed, count)
    runs = [measurements(dataclasses.replace(p, seed=s), raw) for s in seeds]
    claims = {}
    for key, m in registered.items():
        bounds = _bounds(m, key)
        if not bounds:
            continue
        claims[key] = {"registered": rp.measurement_to_dict(m), "verdict": rp.judge(key, m).verdict,
                       "runs": {name: {side: [getattr(r[key].estimates[name], side) for r in runs] for side in SIDES}
                                for name in bounds},
                       "run_verdicts": [rp.judge(key, r[key]).verdict for r in runs]}
    return {"registration": p.name, "preregistration_sha256": p.sha256, "criteria": p.criteria, "n_boot": p.n_boot,
            "registered_seed": p.seed, "seeds": seeds, "cpu_seconds_per_analysis": round(seconds, 1),
            "claims": claims}


@dataclasses.dataclass(frozen=True)
class DecidingBound:
    """The interval end that decides a claim's verdict, with its Monte Carlo error.

    Attributes:
        key: the claim.
        verdict: the registered verdict.
        statistic, side: which estimate and which end (``low``/``high``).
        threshold: the threshold that end is read against.
        bound: its registered value.
        mc_se: its standard deviation over the fresh seeds.
        seeds: how many fresh seeds.
        other: the verdict with the bound on the other side of the threshold.
        flipped: how many fresh seeds give a verdict other than the registered one.
    """

    key: str
    verdict: str
    statistic: str
    side: str
    threshold: float
    bound: float
    mc_se: float
    seeds: int
    other: str
    flipped: int

    @property
    def z(self) -> float:
        """The distance of the bound from its threshold in Monte Carlo standard errors."""
        gap = abs(self.bound - self.threshold)
        return gap / self.mc_se if self.mc_se > 0 else math.inf

    def reading(self, z: float = BOUNDARY_Z) -> str:
        """The verdict under the rule for future registrations (:func:`boundary_reading`)."""
        return boundary_reading(self.verdict, self.other, self.z, z)


def boundary_reading(verdict: str, other: str, distance_in_se: float, z: float = BOUNDARY_Z) -> str:
    """The rule for registrations from now on: a verdict whose deciding bound lies within ``z`` Monte Carlo
    standard errors of its threshold reads "on the boundary", with both readings.

    Example:
        >>> boundary_reading("not shown", "weaker than the paper", 0.4)
        'on the boundary: not shown / weaker than the paper'
        >>> boundary_reading("not shown", "weaker than the paper", 3.1)
        'not shown'
    """
    return f"on the boundary: {verdict} / {other}" if distance_in_se < z else verdict


def _moved(m: rp.Measurement, name: str, side: str, threshold: float) -> rp.Measurement:
    """``m`` with one interval end mirrored to the other side of ``threshold`` (the interval kept ordered)."""
    est = m.estimates[name]
    low, high = est.low, est.high
    mirrored = 2 * threshold - getattr(est, side)
    low, high = (mirrored, high) if side == "low" else (low, mirrored)
    estimates = {**m.estimates, name: Estimate(est.value, min(low, high), max(low, high), est.n)}
    return rp.Measurement(estimates, m.text, m.untestable)


def deciding_bound(key: str, record: dict[str, Any]) -> DecidingBound | None:
    """The deciding bound of one claim from its committed record (None when no single end decides: e.g. a
    contradicted part of a two-part claim that no other end's move can change)."""
    m = rp.measurement_from_dict(record["registered"])
    verdict = record["verdict"]
    candidates = []
    for name, limits in thresholds(key, m).items():
        if name not in record["runs"]:
            continue
        for side in SIDES:
            draws = np.asarray(record["runs"][name][side], dtype=np.float64)
            se = float(draws.std(ddof=1))
            for threshold in limits:
                other = rp.judge(key, _moved(m, name, side, threshold)).verdict
                if other == verdict:
                    continue
                flipped = sum(v != verdict for v in record["run_verdicts"])
                candidates.append(DecidingBound(key, verdict, name, side, threshold, getattr(m.estimates[name], side),
                                                se, draws.size, other, flipped))
    return min(candidates, key=lambda c: (c.z, abs(c.bound - c.threshold)), default=None)


def summarise(data: dict[str, Any]) -> dict[str, DecidingBound | None]:
    """Every claim's deciding bound from a committed ``mc_error.json``, in the claims' declaration order (None where
    no single end decides)."""
    return {key: deciding_bound(key, data["claims"][key]) for key in rp.CLAIMS if key in data["claims"]}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m interp.report.mc_error PREREG --raw RAW_DIR --seeds K --out FILE.json``."""
    parser = argparse.ArgumentParser(description="Monte Carlo error of a registration's deciding interval ends.")
    parser.add_argument("prereg", help="the pre-registration JSON file (docs/preregistration/)")
    parser.add_argument("--raw", required=True, help="the registration's committed raw data (its raw/ folder)")
    parser.add_argument("--seeds", type=int, default=20, help="fresh bootstrap seeds (K)")
    parser.add_argument("--out", required=True, help="the JSON file to write")
    args = parser.parse_args(list(argv) if argv is not None else None)
    def body() -> None:
        data = compute(args.prereg, args.raw, args.seeds)
        write_json(Path(args.out), data)
        for key, d in summarise(data).items():
            if d is None:
                print(f"{key}: {data['claims'][key]['verdict']}; no single interval end decides it")
                continue
            print(f"{d.key}: {d.verdict}; {d.statistic} {d.side} {d.bound:.4f} vs {d.threshold:g}, MC SE "
                  f"{d.mc_se:.4f} ({d.z:.1f} SE), {d.flipped}/{d.seeds} seeds differ -> {d.reading()}")

    return exit_status(body)


if __name__ == "__main__":
    from interp.report.mc_error import main as _imported_main  # the imported module's functions (see confirm.py)

    raise SystemExit(_imported_main())
