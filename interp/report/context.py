"""What a report run shares: the settings that determine its numbers, the lazily loaded model,
examples and calibration rows, and the Stage/StageOutput types every section uses."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import torch

from interp import models  # models.load_model looked up at call time, so a patched loader is seen
from interp.data import load_examples, read_documents
from interp.digests import cache_key, file_digest, files_digest, texts_digest
from interp.errors import ModelLoadError
from interp.quant.reference import describe_reference
from interp.quant.spec import MethodSpec, parse_spec, report_specs

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja")


def model_digests(source: str) -> dict[str, str]:
    """The SHA-256 of a model's weights and of its tokenizer, from the content of its files, without loading it.

    A GGUF file (a bundled model's too) holds both; a Hugging Face folder's tokenizer files are the tokenizer
    and all its other files (config, safetensors, index) the weights."""
    path = Path(source).expanduser()
    if source not in models.BUNDLED and not os.path.exists(path):
        return {"weights": f"missing {source}", "tokenizer": f"missing {source}"}  # the load says what is wrong
    try:
        if source in models.BUNDLED or path.suffix == ".gguf":
            gguf = models._bundled_gguf(source) if source in models.BUNDLED else path
            digest = file_digest(gguf)
            return {"weights": digest, "tokenizer": digest}
        files = [p for p in sorted(path.iterdir()) if p.is_file()]
    except OSError as exc:
        raise ModelLoadError(f"Cannot read the model {source} ({exc.strerror or exc}). Give a bundled name, a "
                             "Hugging Face model folder or a .gguf file.") from None
    tokenizer = [p for p in files if p.name in TOKENIZER_FILES]
    return {"weights": files_digest(p for p in files if p not in tokenizer), "tokenizer": files_digest(tokenizer)}


def report_inputs(settings: "ReportSettings") -> dict[str, str]:
    """What a report's numbers are computed from, each as a digest of its content: the weights and the
    tokenizer (:func:`model_digests`), the documents of ``--data`` (their ids and texts), and the settings."""
    docs = read_documents(settings.data)
    return {**model_digests(settings.model), "data": texts_digest(t for d in docs for t in (d.id, d.text)),
            "settings": settings.key()}


# The method lists come from the quantizer registry (each record's report_bits / quick_bits).
DEFAULT_METHODS = report_specs()
QUICK_METHODS = report_specs(quick=True)  # calibration-free: fast


def _patched(specs: tuple[str, ...], calibrated: bool) -> str:
    """The spec patching and restoration use: the first 3-bit spec (a calibrated one when asked),
    like the paper's AWQ-3 and NF-3 runs."""
    for spec in specs:
        parsed = parse_spec(spec)
        if parsed.bits == 3 and (parsed.needs_calibration or not calibrated):
            return spec
    return specs[0]


@dataclass(frozen=True)
class ReportSettings:
    """Everything that determines the report's numbers (hashed to decide what can be reused)."""

    model: str = "smollm2-135m"
    data: str = "wiki"
    n: int | None = 128
    seq_len: int = 128
    seed: int = 0
    methods: tuple[str, ...] = DEFAULT_METHODS
    calibration_n: int = 32
    batch_size: int = 8
    saobp_beta: float = 4.0
    attention_n: int = 16
    patch_method: str = _patched(DEFAULT_METHODS, calibrated=True)
    device: str = "cpu"
    dtype: str = "float32"
    saobp_logs: str = ""  # per-seed SAOBP training logs (default: docs/data/saobp_seeds of this checkout)

    @classmethod
    def quick(cls, **overrides: Any) -> "ReportSettings":
        base = dict(n=20, seq_len=32, methods=QUICK_METHODS, calibration_n=8, attention_n=4,
                    patch_method=_patched(QUICK_METHODS, calibrated=False))
        return cls(**{**base, **overrides})

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    @cached_property
    def specs(self) -> tuple[MethodSpec, ...]:
        """:attr:`methods` parsed, once (the settings are the report's edge): what the stages pass on."""
        return tuple(parse_spec(method) for method in self.methods)

    @cached_property
    def patch_spec(self) -> MethodSpec:
        """:attr:`patch_method` parsed, once."""
        return parse_spec(self.patch_method)


@dataclass
class StageOutput:
    """What one stage produces."""

    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    figures: dict[str, go.Figure] = field(default_factory=dict)
    numbers: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    provenance: dict[str, Any] = field(default_factory=dict)  # where and from what it was computed (run.py)


@dataclass(frozen=True)
class Stage:
    name: str
    title: str
    intro: str
    run: Callable[["ReportContext"], StageOutput]
    reuse: bool = True  # False: recomputed every run (cheap stages that read files outside the settings)


class MainRankOnly(Exception):
    """Raised on ranks other than 0 where the rest of a stage is rank 0's alone (:meth:`ReportContext.main_only`)."""


class ReportContext:
    """Lazily loaded shared state: the model, examples, scores and quantized copies.

    Under ``torchrun`` every rank runs every stage, in order, through its batched steps
    (:attr:`shards`, every rank gets the gathered result); from :meth:`main_only` on, the stage's
    remaining work (bootstrap intervals, figures, the steps that are not split into batches) is
    rank 0's, and the other ranks go on to the next stage.
    """

    def __init__(self, settings: ReportSettings, out: Path, progress: bool | None) -> None:
        from interp.runtime.distributed import world

        self.settings = settings
        self.out = out
        self.rank, _, self.world_size = world()
        self.progress = progress if self.rank == 0 else False
        self.cache: dict[str, Any] = {}
        self._main_only = False

    @cached_property
    def shards(self) -> Any:
        """The stages' batched steps (:class:`interp.report.shards.Sharding`), their parts reused under ``key``."""
        from interp.report.shards import Sharding

        return Sharding(self.out / "parts", {"report": self.key}, self.settings.batch_size, progress=self.progress,
                        everywhere=True)

    @cached_property
    def inputs(self) -> dict[str, str]:
        """Digests of everything the report's numbers are computed from, read from the files' content (not
        their paths): the weights, the tokenizer, the data and the settings (:func:`report_inputs`)."""
        return report_inputs(self.settings)

    @cached_property
    def key(self) -> str:
        """The key a finished stage or batch is reused under (:func:`interp.digests.cache_key`: the
        ``inputs`` and the code fingerprint)."""
        return cache_key(**self.inputs)

    def begin_stage(self) -> None:
        """A stage starts: every rank takes part in it until :meth:`main_only`."""
        self._main_only = False

    def main_only(self) -> None:
        """The rest of this stage is rank 0's: the other ranks leave it (:class:`MainRankOnly`).

        Every step that all ranks must take together (the batched steps, the scoring) comes before
        this in a stage; one after it is refused, in one process too, so a stage that breaks the
        rule fails in the tests instead of leaving rank 0 waiting for ranks that have moved on.
        """
        self._main_only = True
        if self.rank != 0:
            raise MainRankOnly

    def collective(self, what: str) -> None:
        """Before a step every rank takes: it must come before :meth:`main_only` in the stage."""
        if self._main_only:
            from interp.errors import InterpError

            raise InterpError(f"report stage bug: {what} runs on every rank, so it must come before the stage's "
                              "main_only() call.")

    @cached_property
    def model(self) -> Any:
        from interp.runtime.distributed import local_device

        s = self.settings
        device = local_device(s.device) if s.device == "cuda" and self.world_size > 1 else s.device
        return models.load_model(s.model, dtype=getattr(torch, s.dtype), device=device)

    @cached_property
    def stash(self) -> Any:
        """The reference's block weights on disk while a quantized variant is swapped into it
        (:class:`interp.runtime.swap.WeightStash`, one per run under ``out``; :meth:`close` deletes it)."""
        from interp.runtime.swap import WeightStash

        return WeightStash(self.model, self.out)

    def close(self) -> None:
        """Delete the stash, if one was made."""
        if "stash" in self.__dict__:
            self.stash.close()

    def batched(self, what: str) -> Any:
        """:attr:`shards`, the stage's batched steps (:class:`interp.report.shards.Sharding`), for ``what``."""
        self.collective(what)
        return self.shards

    @cached_property
    def examples(self) -> Any:

        s = self.settings
        return load_examples(s.data, self.model.tokenizer, n=s.n, seq_len=s.seq_len, seed=s.seed, split="eval")

    @cached_property
    def calibration(self) -> Any:

        s = self.settings
        return load_examples(s.data, self.model.tokenizer, n=s.calibration_n, seq_len=s.seq_len, seed=s.seed,
                             split="calibration")

    @cached_property
    def reference_description(self) -> str:
        """What the "full-precision" reference is, read from its GGUF file (e.g. Q4_1 dequantized to fp32)."""

        return describe_reference(self.settings.model)

    def token_labels(self, row: int, length: int) -> list[str]:
        tokens = self.examples.tokens[row, :length]
        return [self.model.tokenizer.decode([int(t)]) for t in tokens]
