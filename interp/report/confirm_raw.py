"""A confirmatory run's raw data: the folder it writes as it goes, one file per finished step, and reads back.

:func:`~interp.report.confirm_run.run` writes it; :func:`~interp.report.confirm.analyse` reads only it, so the
analysis is cheap and its numbers can be recomputed from the committed data. The names are importable from
:mod:`interp.report.confirm` too.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from interp.data import Examples
from interp.errors import InterpError
from interp.io import write_file, write_json
from interp.models import weights_digest
from interp.quant.spec import parse_spec
from interp.runtime.batching import batches
from interp.runtime.scoring import token_nll_fn


def _label(spec: str, instance: int | None) -> str:
    return str(parse_spec(spec)) + ("" if instance is None else f"#{instance}")


def _token_nll(model: Any, examples: Examples, batch_size: int) -> np.ndarray:
    score = token_nll_fn(model)
    rows = []
    with torch.no_grad():
        for start, end in batches(len(examples), batch_size):
            rows.append(score(examples.tokens[start:end]).double().cpu().numpy())
    return np.concatenate(rows)


class _Folder:
    """The run's output folder: one file per finished step, so a killed run resumes where it stopped."""

    def __init__(self, out: Path) -> None:
        self.out = out
        (out / "token_nll").mkdir(parents=True, exist_ok=True)
        (out / "localize").mkdir(parents=True, exist_ok=True)

    def token_path(self, label: str) -> Path:
        return self.out / "token_nll" / (hashlib.sha256(label.encode()).hexdigest()[:16] + ".parquet")

    def save_tokens(self, label: str, values: np.ndarray, ids: list[str]) -> None:
        frame = pd.DataFrame(values.astype(np.float64), index=ids, columns=[f"t{j}" for j in range(values.shape[1])])
        frame.attrs = {}
        write_file(self.token_path(label), lambda tmp: frame.assign(label=label).to_parquet(tmp))

    def tokens(self, label: str) -> np.ndarray:
        frame = pd.read_parquet(self.token_path(label))
        return frame.drop(columns="label").to_numpy(dtype=np.float64)

    def read(self, name: str) -> dict[str, Any]:
        """A finished step's data (the analysis never computes: a missing step is an error)."""
        path = self.out / "localize" / f"{name}.json"
        if not path.exists():
            raise InterpError(f"{path} is missing: the run has not finished that step (run it again to resume).")
        return json.loads(path.read_text())

    def step(self, name: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        path = self.out / "localize" / f"{name}.json"
        if path.exists():
            return json.loads(path.read_text())
        result = compute()
        write_json(path, result)
        return result


def _arrays(values: torch.Tensor) -> list[float]:
    return [float(v) for v in values.double().cpu().reshape(-1)]


def _record_weights(folder: _Folder, stage: str, label: str, model: Any) -> None:
    """Keep a quantized model's weights digest in ``models.json``: under ``scored`` when its per-token NLL is
    written, under ``localized`` when a localization instance loads it.

    A run resumed after its quantized-model cache was lost quantizes again, and on another machine the result
    differs even under the same kernels label (docs/reproduction.md, "One machine's verdict is not the
    verdict"). The digests make that visible in the raw data, and the run says so when it happens; each
    localization step records its own quantized NLL, so the analysis never mixes the two models."""
    path = folder.out / "models.json"
    record = json.loads(path.read_text()) if path.is_file() else {"scored": {}, "localized": {}}
    digest = weights_digest(model)
    record[stage][label] = digest
    write_json(path, record)
    scored = record["scored"].get(label)
    if stage == "localized" and scored is not None and scored != digest:
        print(f"note: {label} is localized on other weights than the ones its per-token NLL was scored with "
              f"(weights digest {digest[:12]}, scored {scored[:12]}): the quantized-model cache of an earlier start "
              "is gone and this machine quantized it again. models.json records both.", file=sys.stderr)
