"""Train a small llama-style model with and without SAOBP, and compare them as they train.

The experiment behind the SAOBP paper (Findings of EMNLP 2025, arXiv 2509.07324): train two
models that differ only in their attention, one standard (eager) and one whose attention
pattern is refined by SAOBP (see :mod:`interp.attention.trainable`), with the same seed, the
same initial weights, the same data in the same order and the same optimiser. Every
``log_every`` steps both are scored on held-out text and on a fixed held-out batch:

* held-out loss (mean next-token cross-entropy over a fixed set of held-out sequences);
* per layer: mean attention entropy (raw and normalised), GTD and sink share of the
  pattern the model actually uses (the refined one for SAOBP), averaged over examples,
  heads and valid queries;
* the learned beta of every SAOBP head;
* stability: gradient norm (before clipping), and loss spikes (a training loss above
  ``spike_factor`` times the median of the previous ``spike_window`` losses).

Data: the bundled Wikipedia lead summaries (``wiki_documents`` in ``interp/documents.py``), split into
train and held-out by a hash of the document id. The tokenizer is a byte-level BPE trained
here on the training split only (fast, needs no download, and matched to the data); it is
saved as ``tokenizer.json``. Documents are joined with an end-of-text token and cut into
rows of ``seq_len`` tokens, each starting with that token as BOS.

Outputs in ``out_dir``: ``config.json``, ``tokenizer.json``, ``log.csv`` and ``log.json``
(one row per model per logged step), ``checkpoint/`` (models and optimiser states as
safetensors, plus ``state.json`` with the step, loss history and RNG state). Rerunning with
``resume=True`` continues from the checkpoint and gives the same log as an uninterrupted
run. Nothing is pickled.

Run it:
    python -m interp.attention.train --out runs/saobp --quick
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from einops import rearrange
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

from interp.attention.metrics import METRICS, masked_mean, valid_query_mask
from interp.attention.trainable import SAOBPConfig, build_llama, capture_prior_patterns, saobp_betas
from interp.data import wiki_documents
from interp.errors import InterpError
from interp.io import claim_folder, remove_owned, write_file, write_text

MODEL_NAMES = ("baseline", "saobp")
EOT = "<|endoftext|>"
TIME_COLUMNS = ("wall_s", "step_s")
RUN_KIND = "train-saobp"  # the kind in a run folder's interp marker (interp.io.MARKER); the command's name
RUN_FILES = ("checkpoint", "log.csv", "log.json", "tokenizer.json")  # what a fresh run replaces

__all__ = ["MODEL_NAMES", "TrainConfig", "load_log", "main", "run"]


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of one baseline-versus-SAOBP experiment (saved as ``config.json``).

    Use :meth:`full` or :meth:`quick` and override fields with ``dataclasses.replace``.
    """

    steps: int = 900
    batch_size: int = 16
    seq_len: int = 128
    vocab_size: int = 4096
    n_layers: int = 4
    d_model: int = 192
    n_heads: int = 6
    n_kv_heads: int = 6
    d_mlp: int = 512
    lr: float = 2e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    heldout_every: int = 20  # one document in heldout_every goes to the held-out split
    max_train_docs: int | None = None
    n_heldout_rows: int = 128
    n_metric_rows: int = 8
    log_every: int = 25
    checkpoint_every: int = 50
    spike_factor: float = 1.5
    spike_window: int = 50
    saobp: dict[str, Any] = field(
        default_factory=lambda: {"layers": None, "mode": "first_order", "beta": 1.0, "learnable": True}
    )
    # "bfloat16": forward passes under CPU/CUDA autocast (weights, optimiser state and the loss's
    # reduction stay float32): about 2x faster on CPUs with bf16 matmuls, and a different run
    dtype: str = "float32"

    @classmethod
    def full(cls) -> TrainConfig:
        """The documented experiment: 4 layers, d_model 192, 6 heads, 900 steps of 16 x 128 tokens."""
        return cls()

    @classmethod
    def quick(cls) -> TrainConfig:
        """A tiny model and a few steps, for tests and smoke runs (both models < 2 min on 2 cores)."""
        return cls(
            steps=40, batch_size=8, seq_len=64, vocab_size=512, n_layers=2, d_model=64, n_heads=4,
            n_kv_heads=2, d_mlp=128, warmup_steps=4, max_train_docs=1500, n_heldout_rows=16,
            n_metric_rows=4, log_every=10, checkpoint_every=10,
        )  # fmt: skip

    @classmethod
    def seeds(cls) -> TrainConfig:
        """The multi-seed experiment: narrower than :meth:`full` and on longer rows, so it is cheap enough
        to repeat over seeds (a few minutes per seed on one core) and gives the baseline room to form an
        attention sink (rows of 256 tokens, each starting with the BOS-like separator). Whether it does is
        measured, not assumed: see the SAOBP training claims in :mod:`interp.report.reproduction`.
        """
        return cls(
            steps=300, batch_size=8, seq_len=256, vocab_size=1024, n_layers=4, d_model=64, n_heads=4,
            n_kv_heads=4, d_mlp=192, warmup_steps=20, n_heldout_rows=32, n_metric_rows=8, log_every=25,
            checkpoint_every=100,
        )  # fmt: skip

    def model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``LlamaConfig``."""
        # A field-by-field table, as checkpoint_state() below is: the same shape, other fields (deliberate).
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.d_model,
            "intermediate_size": self.d_mlp,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "max_position_embeddings": self.seq_len,
            "tie_word_embeddings": True,
            "attention_dropout": 0.0,
        }

    def saobp_config(self) -> SAOBPConfig:
        return SAOBPConfig(**self.saobp)


# ---------------------------------------------------------------- data and tokenizer


def _is_heldout(doc_id: str, every: int) -> bool:
    digest = hashlib.sha256(f"saobp-heldout:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % every == 0


def _documents(config: TrainConfig) -> tuple[list[str], list[str]]:
    """(train texts, held-out texts) in the fixed order of ``wiki_documents``."""

    train: list[str] = []
    heldout: list[str] = []
    for doc in wiki_documents():
        (heldout if _is_heldout(doc.id, config.heldout_every) else train).append(doc.text)
    if config.max_train_docs is not None:
        train = train[: config.max_train_docs]
        heldout = heldout[: max(1, config.max_train_docs // config.heldout_every)]
    return train, heldout


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer trained on ``texts``, with ``<|endoftext|>`` as id 0."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _rows(tokenizer: Tokenizer, texts: Sequence[str], seq_len: int) -> torch.Tensor:
    """Join documents with EOT and cut the stream into ``[n, seq_len]`` rows that start with EOT."""
    eot = tokenizer.token_to_id(EOT)
    if eot is None:
        raise InterpError(f"The tokenizer has no {EOT} token; build it with train_tokenizer().")
    stream: list[int] = []
    for encoding in tokenizer.encode_batch(list(texts)):
        stream.extend(encoding.ids)
        stream.append(eot)
    body = seq_len - 1
    n_rows = len(stream) // body
    if n_rows == 0:
        raise InterpError(f"Only {len(stream)} tokens of text, fewer than one row of {seq_len}; use more documents.")
    # host: token rows from the tokenizer's ids, built once before any batch is drawn
    tokens = rearrange(torch.tensor(stream[: n_rows * body], dtype=torch.long), "(n t) -> n t", n=n_rows)
    eot_column = torch.full((n_rows, 1), eot, dtype=torch.long)  # host: the first column of those rows
    return torch.cat([eot_column, tokens], dim=1)


# ---------------------------------------------------------------- optimisation


def _lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def _optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    # Matrices decay; norms, embeddings' tied copies aside, and the raw betas do not:
    # decaying raw beta would pull it to 0, i.e. beta to softplus(0), not to 0.
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    flat = {}
    for index, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            # host: bound for a safetensors file; a tensor keeps its device, a Python step count becomes a scalar
            flat[f"{index}.{name}"] = torch.as_tensor(value).contiguous()
    return flat


def _load_optimizer(optimizer: torch.optim.Optimizer, flat: dict[str, torch.Tensor]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    saved = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def _autocast(config: TrainConfig) -> Any:
    """The forward's precision: autocast to bfloat16 when the config asks for it, else a no-op."""
    if config.dtype not in ("float32", "bfloat16"):
        raise InterpError(f"TrainConfig.dtype must be 'float32' or 'bfloat16'; got {config.dtype!r}.")
    return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16,
                          enabled=config.dtype == "bfloat16")


def heldout_loss(model: nn.Module, rows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy over all predicted tokens of ``rows``."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        logits = model(batch).logits[:, :-1].float()
        total += nn.functional.cross_entropy(
            rearrange(logits, "b t v -> (b t) v"), rearrange(batch[:, 1:], "b t -> (b t)"), reduction="sum"
        ).item()
        count += batch[:, 1:].numel()
    model.train(was_training)
    return total / count


def _layer_means(prefix: str, layer: int, pattern: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    pattern = pattern.float()
    return {f"{prefix}{metric.log_name}_l{layer}": masked_mean(metric.compute(pattern), valid).item()
            for metric in METRICS.values()}


@torch.no_grad()
def attention_metrics(model: nn.Module, rows: torch.Tensor) -> dict[str, float]:
    """Per-layer mean entropy, normalised entropy, GTD and sink share of the patterns used.

    For SAOBP layers the pattern used is the refined one; the unrefined prior ``A`` is also
    scored, under ``prior_``-prefixed names. Means run over rows, heads and valid queries
    (:func:`valid_query_mask`, so position 0, which sees only itself, is left out).
    """
    was_training = model.training
    model.eval()
    with capture_prior_patterns(model) as priors:
        patterns = model(rows, output_attentions=True).attentions  # per layer [batch, head, q, k]
    model.train(was_training)
    valid = valid_query_mask(rows.shape[1], device=rows.device)
    out: dict[str, float] = {}
    for layer, pattern in enumerate(patterns):
        out.update(_layer_means("", layer, pattern, valid))
    for layer, captured in sorted(priors.items()):
        out.update(_layer_means("prior_", layer, captured[0], valid))
    return out


def _beta_columns(model: nn.Module) -> dict[str, float]:
    return {
        f"beta_l{layer}_h{head}": float(value)
        for layer, betas in sorted(saobp_betas(model).items())
        for head, value in enumerate(betas.tolist())
    }


# ---------------------------------------------------------------- the run


@dataclass
class _Runner:
    """Mutable training state of one model: what a checkpoint must restore."""

    name: str
    model: nn.Module
    optimizer: torch.optim.AdamW
    losses: list[float] = field(default_factory=list)  # training losses since the start
    n_spikes: int = 0
    window_spike: bool = False
    window_grad_max: float = 0.0
    window_losses: list[float] = field(default_factory=list)
    last_grad_norm: float = float("nan")

    def step(self, batch: torch.Tensor, lr: float, config: TrainConfig) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with _autocast(config):
            loss = self.model(batch, labels=batch).loss
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip))
        self.optimizer.step()
        value = float(loss.detach())
        recent = self.losses[-config.spike_window :]
        if len(recent) >= 10 and value > config.spike_factor * statistics.median(recent):
            self.n_spikes += 1
            self.window_spike = True
        self.losses.append(value)
        self.window_losses.append(value)
        self.window_grad_max = max(self.window_grad_max, grad_norm)
        self.last_grad_norm = grad_norm

    def log_row(self, step: int, rows: dict[str, torch.Tensor], config: TrainConfig) -> dict[str, Any]:
        row: dict[str, Any] = {
            "step": step,
            "model": self.name,
            "train_loss": statistics.fmean(self.window_losses) if self.window_losses else float("nan"),
            "heldout_loss": heldout_loss(self.model, rows["heldout"], config.batch_size),
            "grad_norm": self.last_grad_norm,
            "grad_norm_max": self.window_grad_max if self.window_losses else float("nan"),
            "spike": self.window_spike,
            "n_spikes": self.n_spikes,
            "lr": _lr_at(max(0, step - 1), config),
        }
        row.update(attention_metrics(self.model, rows["metric"]))
        row.update(_beta_columns(self.model))
        self.window_spike, self.window_grad_max, self.window_losses = False, 0.0, []
        return row

    def checkpoint_state(self) -> dict[str, Any]:
        # A field-by-field table, as TrainConfig.model_kwargs() is (deliberate: see there).
        return {
            "losses": self.losses,
            "n_spikes": self.n_spikes,
            "window_spike": self.window_spike,
            "window_grad_max": self.window_grad_max,
            "window_losses": self.window_losses,
            "last_grad_norm": self.last_grad_norm,
        }

    def restore_state(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def _build_runners(config: TrainConfig, seed: int) -> list[_Runner]:
    runners = []
    for name in MODEL_NAMES:
        settings = config.saobp_config() if name == "saobp" else None
        model = build_llama(config.model_kwargs(), settings, seed=seed)
        runners.append(_Runner(name, model, _optimizer(model, config)))
    return runners


def _batch_order(n_rows: int, step: int, config: TrainConfig, seed: int) -> torch.Tensor:
    """Row indices for ``step``: a seeded permutation per epoch, the same for both models."""
    per_epoch = n_rows // config.batch_size
    if per_epoch == 0:
        raise InterpError(f"{n_rows} training rows is fewer than one batch of {config.batch_size}.")
    epoch, position = divmod(step, per_epoch)
    # host: row indices from a seeded CPU generator, the same order on every device
    order = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return order[position * config.batch_size : (position + 1) * config.batch_size]


def _atomic_json(path: Path, payload: Any) -> None:
    write_text(path, json.dumps(payload, indent=1, allow_nan=True))


def _atomic_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    copies = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    write_file(path, lambda tmp: save_file(copies, str(tmp)))


def _save_checkpoint(folder: Path, step: int, runners: list[_Runner], wall_s: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for runner in runners:
        _atomic_safetensors(folder / f"{runner.name}_model.safetensors", runner.model.state_dict())
        _atomic_safetensors(folder / f"{runner.name}_optimizer.safetensors", _optimizer_tensors(runner.optimizer))
    state = {
        "step": step,
        "wall_s": wall_s,
        "torch_rng": torch.get_rng_state().tolist(),
        "runners": {runner.name: runner.checkpoint_state() for runner in runners},
    }
    _atomic_json(folder / "state.json", state)  # written last: it marks the checkpoint complete


def _load_checkpoint(folder: Path, runners: list[_Runner]) -> tuple[int, float]:
    state = json.loads((folder / "state.json").read_text())
    for runner in runners:
        weights = load_file(str(folder / f"{runner.name}_model.safetensors"))
        # Tied embeddings appear under both names in the state dict; strict loading checks both.
        runner.model.load_state_dict(weights, strict=True)
        _load_optimizer(runner.optimizer, load_file(str(folder / f"{runner.name}_optimizer.safetensors")))
        runner.restore_state(state["runners"][runner.name])
    torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))  # host: the CPU generator's state
    return int(state["step"]), float(state["wall_s"])


def _write_log(out_dir: Path, records: list[dict[str, Any]]) -> pd.DataFrame:
    frame = pd.DataFrame.from_records(records)
    write_file(out_dir / "log.csv", lambda tmp: frame.to_csv(tmp, index=False))
    _atomic_json(out_dir / "log.json", records)
    return frame


def load_log(out_dir: str | Path) -> pd.DataFrame:
    """The training log of a run folder, one row per model per logged step."""
    path = Path(out_dir) / "log.csv"
    if not path.exists():
        raise InterpError(f"No training log at {path}; run interp.attention.train.run({str(out_dir)!r}) first.")
    return pd.read_csv(path)


def _prepare_out_dir(out_dir: Path, config: TrainConfig, seed: int, resume: bool) -> bool:
    """Create or check ``out_dir``; return whether a checkpoint should be resumed."""
    claim_folder(out_dir, RUN_KIND, adopt=_is_earlier_run)  # a folder interp did not make is refused
    settings = {"seed": seed, "config": asdict(config)}
    stored = out_dir / "config.json"
    has_checkpoint = (out_dir / "checkpoint" / "state.json").exists()
    if resume and has_checkpoint and stored.exists():
        previous = json.loads(stored.read_text())
        if previous != json.loads(json.dumps(settings)):
            raise InterpError(
                f"{out_dir} holds a run with other settings ({stored}); resume it with the same settings, "
                "pick another out_dir, or pass resume=False to start over."
            )
        return True
    remove_owned(out_dir, RUN_FILES, RUN_KIND)  # only these names, written by an earlier run; nothing else
    _atomic_json(stored, settings)
    return False


def _is_earlier_run(folder: Path) -> bool:
    """A run folder written before output folders carried interp's marker: its ``config.json`` is a run's
    settings, and it holds nothing but a run's files."""
    try:
        stored = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    names = {"config.json", *RUN_FILES}
    return isinstance(stored, dict) and {"seed", "config"} <= set(stored) and all(
        p.name in names for p in folder.iterdir())


def _data(out_dir: Path, config: TrainConfig) -> dict[str, torch.Tensor]:
    train_texts, heldout_texts = _documents(config)
    path = out_dir / "tokenizer.json"
    if path.exists():
        tokenizer = Tokenizer.from_file(str(path))
    else:
        tokenizer = train_tokenizer(train_texts, config.vocab_size)
        write_text(path, tokenizer.to_str(pretty=True))
    heldout = _rows(tokenizer, heldout_texts, config.seq_len)
    if len(heldout) < config.n_metric_rows:
        raise InterpError(f"Only {len(heldout)} held-out rows; lower n_metric_rows or use more documents.")
    return {
        "train": _rows(tokenizer, train_texts, config.seq_len),
        "heldout": heldout[: config.n_heldout_rows],
        "metric": heldout[: config.n_metric_rows],
    }


def _progress(total: int, initial: int, quiet: bool) -> Any:
    if quiet or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="saobp vs baseline", unit="step")


def run(
    out_dir: str | Path,
    quick: bool = False,
    steps: int | None = None,
    seed: int = 0,
    resume: bool = True,
    config: TrainConfig | None = None,
    stop_after: int | None = None,
    quiet: bool = False,
    dtype: str | None = None,
) -> pd.DataFrame:
    """Train the baseline and the SAOBP model side by side and log how they compare.

    Args:
        out_dir: folder for the tokenizer, log, checkpoints and settings: new, empty or an earlier run's
            (a folder holding other files is refused; see :func:`interp.output_folders.claim_folder`).
        quick: use :meth:`TrainConfig.quick` (seconds) instead of :meth:`TrainConfig.full`.
        steps: override the number of optimisation steps.
        seed: seeds the weights (shared by both models) and the data order.
        resume: continue from ``out_dir/checkpoint`` if present (settings must match);
            False starts over and deletes any previous log and checkpoint there.
        config: explicit settings (overrides ``quick``).
        stop_after: stop after this many steps in total (checkpointing first), as if the
            run were killed; rerun to continue. Mainly for tests.
        quiet: no progress bar.
        dtype: ``"bfloat16"`` runs the forward passes under autocast (see :class:`TrainConfig`).

    Returns:
        The log as a DataFrame: one row per model and logged step (also in ``log.csv``).
    """
    config = config or (TrainConfig.quick() if quick else TrainConfig.full())
    if steps is not None:
        config = replace(config, steps=steps)
    if dtype is not None:
        config = replace(config, dtype=dtype)
    _autocast(config)  # validates the dtype before anything is written
    out = Path(out_dir)
    resuming = _prepare_out_dir(out, config, seed, resume)
    rows = _data(out, config)
    runners = _build_runners(config, seed)
    start, wall_before = 0, 0.0
    records: list[dict[str, Any]] = []
    if resuming:
        start, wall_before = _load_checkpoint(out / "checkpoint", runners)
        records = [r for r in json.loads((out / "log.json").read_text()) if r["step"] <= start]
    last = config.steps if stop_after is None else min(config.steps, stop_after)
    began = time.perf_counter()
    bar = _progress(config.steps, start, quiet)

    def wall() -> float:
        return wall_before + time.perf_counter() - began

    if start == 0 and not records:
        records += [runner.log_row(0, rows, config) | {"wall_s": wall(), "step_s": 0.0} for runner in runners]
        _write_log(out, records)
    for step in range(start, last):
        batch = rows["train"][_batch_order(len(rows["train"]), step, config, seed)]
        lr = _lr_at(step, config)
        step_times = {}
        for runner in runners:
            tick = time.perf_counter()
            runner.step(batch, lr, config)
            step_times[runner.name] = time.perf_counter() - tick
        done = step + 1
        if bar is not None:
            bar.update(1)
        if done % config.log_every == 0 or done == config.steps:
            for runner in runners:
                row = runner.log_row(done, rows, config)
                records.append(row | {"wall_s": wall(), "step_s": step_times[runner.name]})
            _write_log(out, records)
        if done % config.checkpoint_every == 0 or done == last:
            _save_checkpoint(out / "checkpoint", done, runners, wall())
    if bar is not None:
        bar.close()
    return pd.DataFrame.from_records(records)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m interp.attention.train --out DIR [--quick] [--steps N]``."""
    parser = argparse.ArgumentParser(description="Train a small llama with and without SAOBP attention.")
    parser.add_argument("--out", required=True, help="output folder (resumed if it holds a checkpoint)")
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps (under 2 minutes)")
    parser.add_argument("--preset", choices=["full", "quick", "seeds"], default=None,
                        help="settings preset (default: full, or quick with --quick); 'seeds' is the multi-seed "
                             "experiment of docs/saobp.md")
    parser.add_argument("--steps", type=int, default=None, help="number of optimisation steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fresh", action="store_true", help="start over instead of resuming")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (1 is steadier on a shared machine)"
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    preset = args.preset or ("quick" if args.quick else "full")
    config = {"full": TrainConfig.full, "quick": TrainConfig.quick, "seeds": TrainConfig.seeds}[preset]()
    frame = run(args.out, steps=args.steps, seed=args.seed, resume=not args.fresh, quiet=args.quiet, config=config)
    final = frame[frame["step"] == frame["step"].max()]
    print(final[["step", "model", "heldout_loss", "n_spikes", "wall_s"]].to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
