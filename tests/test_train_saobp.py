"""The baseline-versus-SAOBP training experiment, on the quick configuration."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pandas as pd
import plotly.graph_objects as go
import pytest
import torch
from safetensors.torch import load_file

from interp.attention import train
from interp.attention.train import TIME_COLUMNS, TrainConfig, load_log, run
from interp.errors import InterpError
from interp.figures.training import beta_figure, entropy_figure, gtd_figure, loss_figure

# Smaller than TrainConfig.quick() so the resume test (two runs) stays a few seconds.
TINY = replace(
    TrainConfig.quick(), steps=6, log_every=2, checkpoint_every=2, max_train_docs=300, vocab_size=300,
    n_heldout_rows=4, n_metric_rows=2, batch_size=4, seq_len=32,
)  # fmt: skip


def _comparable(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.drop(columns=list(TIME_COLUMNS)).reset_index(drop=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    return out, run(out, config=TINY, quiet=True)


def test_log_has_both_models_and_all_metrics(uninterrupted):
    out, frame = uninterrupted
    assert sorted(frame["model"].unique()) == ["baseline", "saobp"]
    assert sorted(frame["step"].unique()) == [0, 2, 4, 6]
    for layer in range(TINY.n_layers):
        for metric in ("entropy", "entropy_norm", "gtd", "sink", "effective_span"):  # every METRICS entry
            assert frame[f"{metric}_l{layer}"].notna().all()
    saobp_rows = frame[frame["model"] == "saobp"]
    betas = [c for c in frame.columns if c.startswith("beta_l")]
    assert len(betas) == TINY.n_layers * TINY.n_heads
    assert (saobp_rows[betas] > 0).all().all()
    assert frame.loc[frame["model"] == "baseline", betas].isna().all().all()
    assert saobp_rows["prior_entropy_l0"].notna().all()
    assert (frame["heldout_loss"] > 0).all() and frame["n_spikes"].ge(0).all()
    on_disk = load_log(out)
    pd.testing.assert_frame_equal(_comparable(on_disk), _comparable(frame), check_dtype=False)
    assert len(json.loads((out / "log.json").read_text())) == len(frame)
    assert (out / "tokenizer.json").exists()


def test_both_models_start_from_the_same_weights(uninterrupted):
    _, frame = uninterrupted
    start = frame[frame["step"] == 0].set_index("model")
    # Same initial weights: at step 0 only attention (SAOBP with beta = 1) differs, slightly.
    assert abs(start.loc["baseline", "heldout_loss"] - start.loc["saobp", "heldout_loss"]) < 0.05


def test_checkpoints_are_safetensors_and_json(uninterrupted):
    out, _ = uninterrupted
    folder = out / "checkpoint"
    assert json.loads((folder / "state.json").read_text())["step"] == TINY.steps
    weights = load_file(str(folder / "saobp_model.safetensors"))
    assert "model.layers.0.self_attn.saobp_beta_raw" in weights
    assert load_file(str(folder / "baseline_optimizer.safetensors"))
    assert not list(out.rglob("*.pt")) and not list(out.rglob("*.pkl"))


def test_resume_after_interruption_gives_the_same_log(uninterrupted, tmp_path):
    _, expected = uninterrupted
    partial = run(tmp_path, config=TINY, stop_after=3, quiet=True)  # "killed" after step 3
    assert partial["step"].max() == 2
    state = json.loads((tmp_path / "checkpoint" / "state.json").read_text())
    assert state["step"] == 3
    resumed = run(tmp_path, config=TINY, quiet=True)
    pd.testing.assert_frame_equal(_comparable(resumed), _comparable(expected))
    pd.testing.assert_frame_equal(_comparable(load_log(tmp_path)), _comparable(expected), check_dtype=False)


def test_resume_with_other_settings_is_refused(uninterrupted):
    out, _ = uninterrupted
    with pytest.raises(InterpError, match="other settings"):
        run(out, config=replace(TINY, lr=1e-4), quiet=True)


def test_figures_are_built_from_the_log(uninterrupted):
    _, frame = uninterrupted
    for builder in (entropy_figure, gtd_figure, loss_figure, beta_figure):
        figure = builder(frame)
        assert isinstance(figure, go.Figure)
        assert len(figure.data) > 0
    entropy_traces = {trace.name for trace in entropy_figure(frame).data}
    assert entropy_traces == {f"{m} L{layer}" for m in ("baseline", "saobp") for layer in range(TINY.n_layers)}


def test_learning_rate_schedule():
    config = replace(TINY, steps=100, warmup_steps=10, lr=1.0)
    assert train._lr_at(0, config) == pytest.approx(0.1)
    assert train._lr_at(9, config) == pytest.approx(1.0)
    assert train._lr_at(100, config) == pytest.approx(0.1)


def test_rows_start_with_end_of_text():
    tokenizer = train.train_tokenizer(["hello world " * 20, "another document here " * 10], vocab_size=300)
    rows = train._rows(tokenizer, ["hello world " * 20], seq_len=8)
    eot = tokenizer.token_to_id(train.EOT)
    assert eot == 0 and (rows[:, 0] == eot).all() and rows.shape[1] == 8
    assert tokenizer.decode(rows[0, 1:].tolist()).startswith("hello world")


def test_heldout_split_is_disjoint_and_stable():
    config = replace(TINY, max_train_docs=None)
    train_texts, heldout_texts = train._documents(config)
    assert not set(train_texts) & set(heldout_texts)
    assert 0.02 < len(heldout_texts) / (len(train_texts) + len(heldout_texts)) < 0.08
    assert train._documents(config)[1] == heldout_texts


def test_heldout_loss_is_mean_token_cross_entropy():
    from interp.attention.trainable import build_llama

    model = build_llama(replace(TINY).model_kwargs(), None, seed=0)
    rows = torch.randint(0, TINY.vocab_size, (3, TINY.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(rows, labels=rows).loss.item()  # HF: mean over all predicted tokens
    assert train.heldout_loss(model, rows, batch_size=2) == pytest.approx(expected, rel=1e-5)


def test_bfloat16_forwards_train_a_different_but_sane_run(uninterrupted, tmp_path):
    """dtype="bfloat16" autocasts the training forwards only: the logged run differs from the
    float32 one (so the switch really acts), its losses stay finite, held-out evaluation stays
    float32, and the setting is part of the saved config (a resume cannot mix precisions)."""
    _, fp32 = uninterrupted
    frame = run(tmp_path / "bf16", config=TINY, quiet=True, dtype="bfloat16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["config"]["dtype"] == "bfloat16"
    assert frame["heldout_loss"].map(math.isfinite).all()
    last = frame["step"].max()
    a = frame[frame["step"] == last]["heldout_loss"].to_numpy()
    b = fp32[fp32["step"] == last]["heldout_loss"].to_numpy()
    assert (a != b).any()
    with pytest.raises(InterpError, match="dtype"):
        run(tmp_path / "bad", config=TINY, quiet=True, dtype="float16")
    assert not (tmp_path / "bad").exists()  # refused before anything was written
