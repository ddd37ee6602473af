"""Recoveries on both scales: each registered recovery rule read on the perplexity scale, beside its NLL verdict.

A recovery is judged on the NLL scale, ``(ln q - ln p) / (ln q - ln ref)``, against levels converted exactly from
the paper's perplexities; the perplexity scale, ``(q - p) / (q - ref)``, is the paper's own. The two can give
different verdicts for the same patch, because perplexity stretches large losses. The NLL scale was chosen after
registration 1's data had been seen (docs/reproduction.md, "One scale"), so every recovery row is shown on both.

:func:`perplexity_reading` applies a recovery claim's rule, part by part as the registered rule does (the level,
then the ordering or the paired control, then the instance gate), with the perplexity-scale recovery against the
perplexity-scale level. It is shown, never judged.
"""

from __future__ import annotations

from interp.report import reproduction as rp
from interp.stats import MIN_INSTANCES, Estimate

RECOVERY_ROWS = ("restoration", "patch_down", "patch_gate", "patch_up", "patch_attn_out")


def _level(key: str, ppl: Estimate) -> rp.Judgement:
    if key == "restoration":
        return rp.in_band(ppl, 0.0, rp.LITTLE, rp.RESTORATION_LEVEL_PPL,
                          below="restoring the reference layers makes the model worse",
                          above="restoration recovers more than little")
    component = key.removeprefix("patch_")
    if component in ("down", "gate"):
        return rp.present_at_level(ppl, 0.0, rp.PATCH_LEVELS_PPL[component], +1)
    return rp.in_band(ppl, 0.0, rp.LITTLE, rp.PATCH_LEVELS_PPL[component], below="patching it makes the model worse",
                      above="it recovers more than little")


def _other_part(key: str, m: rp.Measurement) -> rp.Judgement | None:
    if key == "restoration":
        control = m.estimates.get("top_minus_random")
        if control is None or not control.has_interval:
            return None
        return rp.signed(control, +1, "the top layers recover more than random ones",
                         "random layers recover more than the top ones")
    return rp._ordering(m, stronger=key in ("patch_down", "patch_gate"))


def perplexity_reading(key: str, m: rp.Measurement) -> rp.Judgement | None:
    """Claim ``key``'s rule with the perplexity-scale recovery (``recovery_ppl``) against the perplexity-scale
    level; None where the row has no perplexity interval or no level (up-patching judges the ordering alone,
    which the scale does not enter)."""
    ppl = m.estimates.get("recovery_ppl")
    if key not in RECOVERY_ROWS or key == "patch_up" or ppl is None or not ppl.has_interval:
        return None
    level = _level(key, ppl)
    other = _other_part(key, m)
    judgement = level if other is None else rp.both(level, other)
    instances = m.estimates.get("instances")
    if instances is not None and instances.value < MIN_INSTANCES and judgement.verdict in rp.CONCLUDING:
        return rp.Judgement(rp.INSTANCE_LIMITED, f"{int(instances.value)} calibrated instance(s); over the examples "
                                                 f"alone the rule reads '{judgement.verdict}' ({judgement.reason})")
    return judgement
