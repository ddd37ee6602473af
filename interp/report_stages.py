"""The stages of ``interp report`` and its reproduction table.

Each stage is a function ``ReportContext -> StageOutput`` that calls the public API and the
figure builders; nothing here computes an analysis itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from interp import figures
from interp.report import ReportContext, ReportSettings, Stage, StageOutput

# ---------------------------------------------------------------------------------------
# (a) probes


def stage_probes(ctx: ReportContext) -> StageOutput:
    from interp.probes import probe

    components = ["resid_mid", "resid_post", "h", "gate"]
    result = probe(ctx.model, ctx.examples, components, ["norm", "kurtosis"], batch_size=ctx.settings.batch_size,
                   progress=ctx.progress)
    summary = result.summary().reset_index()
    out = StageOutput(tables={"by_layer": summary})
    out.figures["norms"] = figures.probe_norms(result, components, "norm")
    kurt = figures.probe_norms(result, ["resid_mid", "h"], "kurtosis")
    kurt.update_layout(title="kurtosis over features by layer (band = 10-90% of examples; Gaussian = 3)")
    out.figures["kurtosis"] = kurt
    last = summary.iloc[-1]
    out.numbers = {
        "layers": int(len(summary)),
        "resid_mid_norm_by_layer": summary["resid_mid/norm"].round(4).tolist(),
        "h_norm_by_layer": summary["h/norm"].round(4).tolist(),
        "gate_norm_by_layer": summary["gate/norm"].round(4).tolist(),
        "last_layer_resid_mid_norm": float(last["resid_mid/norm"]),
        "last_layer_h_norm": float(last["h/norm"]),
    }
    out.notes.append(
        "Residual norms grow with depth while the MLP input h = RMSNorm(r) * gamma stays small: the norm "
        "removes the residual's scale, so ||h|| reflects how r's energy spreads over dimensions."
    )
    return out


# ---------------------------------------------------------------------------------------
# (b) attention


def stage_attention(ctx: ReportContext) -> StageOutput:
    from interp.attention.analysis import analyze, capture_patterns

    s = ctx.settings
    subset = ctx.examples.subset(range(min(s.attention_n, len(ctx.examples))))
    result = analyze(ctx.model, subset, saobp_beta=s.saobp_beta, batch_size=s.batch_size, progress=ctx.progress)
    by_layer = result.by_layer()
    out = StageOutput(tables={"by_layer": by_layer.round(5)})
    for metric in ("entropy", "gtd", "sink_share"):
        out.figures[f"{metric}_by_layer"] = result.figure(metric)
    out.figures["entropy_heatmap_reference"] = result.heatmap("entropy", "reference")
    out.figures["entropy_heatmap_saobp"] = result.heatmap("entropy", "saobp")
    n_layers = ctx.model.info.n_layers
    deep = list(range(n_layers - max(1, n_layers // 3), n_layers))
    length = min(24, s.seq_len)
    labels = ctx.token_labels(0, length)
    tokens = subset.tokens[0, :length]
    ref_maps = capture_patterns(ctx.model, tokens, [n_layers - 1])
    sao_maps = capture_patterns(ctx.model, tokens, [n_layers - 1], saobp_beta=s.saobp_beta)
    pattern = ref_maps[n_layers - 1]
    head = int(pattern[:, 1:, 0].mean(1).argmax())
    out.figures["map_last_layer_reference"] = figures.attention_map(
        pattern[head], labels, f"layer {n_layers - 1}, head {head} (most sink-heavy), reference")
    out.figures["map_last_layer_saobp"] = figures.attention_map(
        sao_maps[n_layers - 1][head], labels, f"layer {n_layers - 1}, head {head}, SAOBP beta={s.saobp_beta}")

    def deep_mean(metric: str, variant: str) -> float:
        rows = by_layer[(by_layer["variant"] == variant) & by_layer["layer"].isin(deep)]
        return float(rows[f"{metric}_mean"].mean())

    out.numbers = {
        "deep_layers": deep,
        "deep_entropy_reference": deep_mean("entropy", "reference"),
        "deep_entropy_saobp": deep_mean("entropy", "saobp"),
        "deep_gtd_reference": deep_mean("gtd", "reference"),
        "deep_gtd_saobp": deep_mean("gtd", "saobp"),
        "deep_sink_reference": deep_mean("sink_share", "reference"),
        "deep_sink_saobp": deep_mean("sink_share", "saobp"),
        "delta_nll_saobp": float(result.delta_nll.mean()) if result.delta_nll is not None else None,
        "saobp_beta": s.saobp_beta,
        "n_examples": len(subset),
    }
    from interp.report_quant_stages import _claims
    from interp.reproduction import Measurement

    n = out.numbers
    nll_text = "n/a" if n["delta_nll_saobp"] is None else f"{n['delta_nll_saobp']:+.3f}"
    _claims(out, {"saobp_inference": Measurement(text=(
        f"layers {deep[0]}-{deep[-1]}: entropy {n['deep_entropy_reference']:.2f} -> {n['deep_entropy_saobp']:.2f} "
        f"nats, GTD {n['deep_gtd_reference']:.2f} -> {n['deep_gtd_saobp']:.2f}, sink share "
        f"{n['deep_sink_reference']:.2f} -> {n['deep_sink_saobp']:.2f}; NLL cost {nll_text} nats (beta "
        f"{s.saobp_beta}, {len(subset)} examples)"))})
    out.notes.append(
        f"Inference-time SAOBP (exact, beta={s.saobp_beta}) on every layer of the pretrained model, measured on "
        f"{len(subset)} examples. GTD and SAOBP follow this project's derivation from the SAOBP paper's "
        "description (docs/attention.md)."
    )
    return out


# ---------------------------------------------------------------------------------------
# (b') SAOBP training over seeds (reads the committed per-seed logs)


def saobp_log_folder(setting: str) -> Any:
    """The per-seed SAOBP training logs: the setting, or ``docs/data/saobp_seeds`` of this checkout."""
    from pathlib import Path

    if setting:
        return Path(setting)
    return Path(__file__).resolve().parents[1] / "docs" / "data" / "saobp_seeds"


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
        })
    columns = ["seed", "step", "deep_layers", "loss_baseline", "loss_saobp", "entropy_baseline", "entropy_saobp",
               "norm_entropy_baseline", "sink_baseline", "sink_saobp"]
    table = pd.DataFrame(rows, columns=columns)  # headers even with no seeds, so the stage's CSV reads back
    table["loss_diff"] = table["loss_saobp"] - table["loss_baseline"]
    table["entropy_diff"] = table["entropy_saobp"] - table["entropy_baseline"]
    return table


def stage_saobp_training(ctx: ReportContext) -> StageOutput:
    from interp.quant.protocol import t_estimate
    from interp.report_quant_stages import _claims
    from interp.reproduction import Measurement
    from interp.stats import Estimate

    folder = saobp_log_folder(ctx.settings.saobp_logs)
    table = saobp_seed_table(folder)
    out = StageOutput(tables={"per_seed": table})
    n = len(table)
    seeds = Estimate(float(n), float(n), float(n), n)
    if n == 0:
        why = f"no per-seed training logs in {folder}"
        _claims(out, {"saobp_training_entropy": Measurement(untestable=why),
                      "saobp_training_loss": Measurement(untestable=why)})
        return out
    ent, loss = t_estimate(table["entropy_diff"]), t_estimate(table["loss_diff"])
    sink = float(table["sink_baseline"].mean())
    norm_entropy = float(table["norm_entropy_baseline"].mean())
    common = {"seeds": seeds, "baseline_sink": Estimate(sink), "baseline_norm_entropy": Estimate(norm_entropy)}
    _claims(out, {
        "saobp_training_entropy": Measurement(
            {**common, "entropy_diff": ent},
            f"{ent.text(3)} nats over {n} seeds (layers {table['deep_layers'].iloc[0]}); baseline sink share "
            f"{sink:.2f}, normalised entropy {norm_entropy:.2f}"),
        "saobp_training_loss": Measurement(
            {**common, "loss_diff": loss}, f"{loss.text(3)} nats/token over {n} seeds (step {table['step'].iloc[0]})"),
    })
    out.numbers["per_seed"] = table.to_dict(orient="records")
    out.notes.append(f"Read from the committed logs in {folder.name}/ (python -m interp.attention.train --preset seeds "
                     "--seed S): baseline and SAOBP trained in lockstep from the same initial weights and batches.")
    return out


STAGES: list[Stage] = [
    Stage("probes", "(a) Residual, h and gate norms per layer",
          "Per-layer statistics captured by streaming probes: mean L2 norm of the residual after attention "
          "(resid_mid) and after the block (resid_post), of the MLP input h, and of the gate activation.",
          stage_probes),
    Stage("attention", "(b) Attention entropy, GTD and sink share, with and without SAOBP",
          "Attention entropy (nats), Global Token Dependency (total variation between direct and two-hop "
          "attention) and the mass on the first token, per layer and head, for the pretrained model and with "
          "one step of SAOBP belief propagation applied at inference.",
          stage_attention),
    Stage("saobp_training", "(b') SAOBP in training, over seeds",
          "Small llama-style models trained from scratch with and without SAOBP attention, one pair per seed: the "
          "paper's own setting. Final held-out loss and deep-layer attention entropy, per seed.",
          stage_saobp_training, reuse=False),  # reads the committed logs: cheap, and not in the settings key
]


def _all_stages() -> list[Stage]:
    from interp.report_lens_stages import LENS_STAGES
    from interp.report_quant_stages import QUANT_STAGES

    return STAGES + list(QUANT_STAGES) + list(LENS_STAGES)


# ---------------------------------------------------------------------------------------
# Reproduction table


def reproduction_table(outputs: dict[str, StageOutput], settings: ReportSettings) -> pd.DataFrame:
    """The pre-registered claims (:mod:`interp.reproduction`) judged on what the stages measured."""
    from interp.reproduction import CLAIMS, measurement_from_dict, reproduction_frame

    measurements = {}
    for output in outputs.values():
        for key, value in (output.numbers.get("claims") or {}).items():
            measurements[key] = measurement_from_dict(value)
    return reproduction_frame(measurements, list(CLAIMS))
