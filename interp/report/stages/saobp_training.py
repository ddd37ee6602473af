"""Stage (b'): SAOBP in training over seeds, read from the committed per-seed logs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from interp.quant.protocol import t_estimate
from interp.report.context import ReportContext, Stage, StageOutput
from interp.report.reproduction import Measurement
from interp.report.stages.common import record_claims
from interp.stats import Estimate


def saobp_log_folder(setting: str) -> Any:
    """The per-seed SAOBP training logs: the setting, or ``docs/data/saobp_seeds`` of this checkout."""

    if setting:
        return Path(setting)
    return Path(__file__).resolve().parents[3] / "docs" / "data" / "saobp_seeds"  # interp/report/stages/ -> root


def saobp_seed_table(folder: Any) -> pd.DataFrame:
    """One row per seed: final held-out loss and deep-half attention statistics of both models."""
    rows = []
    for log_path in sorted(folder.glob("seed*/log.csv")):
        log = pd.read_csv(log_path)
        final = log[log["step"] == log["step"].max()].set_index("model")
        if not {"baseline", "saobp"} <= set(final.index):
            continue
        n_layers = sum(1 for c in log.columns if c.startswith("entropy_l"))
        deep = list(range(n_layers // 2, n_layers))

        def deep_mean(model: str, metric: str, final: pd.DataFrame = final, deep: list[int] = deep) -> float:
            return float(np.mean([final.loc[model, f"{metric}_l{layer}"] for layer in deep]))

        rows.append({
            "seed": log_path.parent.name, "step": int(log["step"].max()), "deep_layers": f"{deep[0]}-{deep[-1]}",
            "loss_baseline": float(final.loc["baseline", "heldout_loss"]),
            "loss_saobp": float(final.loc["saobp", "heldout_loss"]),
            "entropy_baseline": deep_mean("baseline", "entropy"), "entropy_saobp": deep_mean("saobp", "entropy"),
            "norm_entropy_baseline": deep_mean("baseline", "entropy_norm"),
            "sink_baseline": deep_mean("baseline", "sink"), "sink_saobp": deep_mean("saobp", "sink"),
            "gtd_baseline": deep_mean("baseline", "gtd"), "gtd_saobp": deep_mean("saobp", "gtd"),
        })
    columns = ["seed", "step", "deep_layers", "loss_baseline", "loss_saobp", "entropy_baseline", "entropy_saobp",
               "norm_entropy_baseline", "sink_baseline", "sink_saobp", "gtd_baseline", "gtd_saobp"]
    table = pd.DataFrame(rows, columns=columns)  # headers even with no seeds, so the stage's CSV reads back
    table["loss_diff"] = table["loss_saobp"] - table["loss_baseline"]
    table["entropy_diff"] = table["entropy_saobp"] - table["entropy_baseline"]
    table["gtd_diff"] = table["gtd_saobp"] - table["gtd_baseline"]
    return table


def training_measurements(table: pd.DataFrame, folder: Any) -> dict[str, Measurement]:
    """The three training claims' measurements from the per-seed table (:func:`saobp_seed_table`)."""
    n = len(table)
    seeds = Estimate(float(n), float(n), float(n), n)
    if n == 0:
        why = f"no per-seed training logs in {folder}"
        return {key: Measurement(untestable=why)
                for key in ("saobp_training_entropy", "saobp_training_loss", "saobp_training_gtd")}
    ent, loss, gtd = t_estimate(table["entropy_diff"]), t_estimate(table["loss_diff"]), t_estimate(table["gtd_diff"])
    loss_sd = float(table["loss_diff"].std(ddof=1)) if n > 1 else float("nan")
    sink = float(table["sink_baseline"].mean())
    norm_entropy = float(table["norm_entropy_baseline"].mean())
    common = {"seeds": seeds, "baseline_sink": Estimate(sink), "baseline_norm_entropy": Estimate(norm_entropy)}
    return {
        "saobp_training_entropy": Measurement(
            {**common, "entropy_diff": ent},
            f"{ent.text(3)} nats over {n} seeds (layers {table['deep_layers'].iloc[0]}); baseline sink share "
            f"{sink:.2f}, normalised entropy {norm_entropy:.2f}"),
        "saobp_training_loss": Measurement(
            {**common, "loss_diff": loss, "loss_diff_sd": Estimate(loss_sd)},
            f"{loss.text(3)} nats/token over {n} seeds (step {table['step'].iloc[0]}; per-seed sd {loss_sd:.3f})"),
        "saobp_training_gtd": Measurement(
            {**common, "gtd_diff": gtd},
            f"deep-half GTD, SAOBP minus baseline: {gtd.text(3)} over {n} seeds (baseline "
            f"{table['gtd_baseline'].mean():.3f}, SAOBP {table['gtd_saobp'].mean():.3f})"),
    }


def stage_saobp_training(ctx: ReportContext) -> StageOutput:
    ctx.main_only()  # reads the committed training logs
    folder = saobp_log_folder(ctx.settings.saobp_logs)
    table = saobp_seed_table(folder)
    out = StageOutput(tables={"per_seed": table})
    record_claims(out, training_measurements(table, folder))
    if table.empty:
        return out
    out.numbers["per_seed"] = table.to_dict(orient="records")
    out.notes.append(f"Read from the committed logs in {folder.name}/ (python -m interp.attention.train --preset seeds "
                     "--seed S): baseline and SAOBP trained in lockstep from the same initial weights and batches.")
    return out


STAGE = Stage("saobp_training", "(b') SAOBP in training, over seeds",
              "Small llama-style models trained from scratch with and without SAOBP attention, one pair per seed: the "
              "paper's own setting. Final held-out loss and deep-layer attention entropy, per seed.",
              stage_saobp_training, reuse=False)  # reads the committed logs: cheap, and not in the settings key
