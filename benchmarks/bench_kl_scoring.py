"""The curve's per-file KL scoring (``llama_cpp_curve.score_group``) against the formula it replaced, in one run.

``score_group`` turns each file's logits into KL(reference || file), NLL and the top token for every held-out
position. Since 2026-12-06 it uses KL = sum p_ref lp_ref - p_ref . z + logsumexp(z) * sum p_ref, with the
reference's two sums taken once per example; before, it materialised each file's float64 log-softmax and summed
p_ref (lp_ref - lp). Both are float64 throughout.

Here llama.cpp is replaced by a stand-in that hands back fixed float32 logits (drawn once per file), so the time
is the scoring arithmetic alone, at SmolLM2's vocabulary (49,152) and Gemma-3's (262,144), 127 positions per
example, 13 files (as the curve scores per size), 2 examples:

- **candidate:** ``score_group`` itself (including its parquet and safetensors writes);
- **baseline:** the previous formula over the same stand-in logits.

Timed round-robin by process CPU time (median of ``--repeats``); the largest difference between the two KL arrays
is reported beside the ratio. Results: ``docs/data/benchmarks/kl_scoring.json`` and ``docs/benchmarks.md``.

Run: ``OMP_NUM_THREADS=1 python benchmarks/bench_kl_scoring.py``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import benchjson  # noqa: E402
import llama_cpp_curve as bench  # noqa: E402

OUT = ROOT / "docs" / "data" / "benchmarks" / "kl_scoring.json"
POSITIONS, FILES, EXAMPLES = 127, 13, 2  # 13 files: what the curve scores per size and seed set


def stand_in(logits: dict[str, np.ndarray]) -> types.ModuleType:
    """A ``llama_cpp`` module whose Llama returns ``logits[file stem]`` for every row (no model is run)."""

    class Llama:
        def __init__(self, model_path: str, **_: object) -> None:
            self.scores = logits[Path(model_path).stem]

        def reset(self) -> None:
            pass

        def eval(self, row: list[int]) -> None:
            pass

        def close(self) -> None:
            pass

    module = types.ModuleType("llama_cpp")
    module.Llama = Llama  # type: ignore[attr-defined]
    return module


def previous_formula(logits: dict[str, np.ndarray], names: list[str], rows: torch.Tensor) -> dict[str, np.ndarray]:
    """KL per example and position as score_group computed it before 2026-12-06 (float64 log-softmax per file)."""
    out = {m: np.empty((rows.shape[0], rows.shape[1] - 1)) for m in names}
    for i in range(rows.shape[0]):
        def lp_of(name: str) -> np.ndarray:
            raw = np.asarray(logits[name][:rows.shape[1] - 1], dtype=np.float32)
            return torch.log_softmax(torch.from_numpy(raw.astype(np.float64)), dim=1).numpy()

        lp_ref = lp_of("ref-f32")
        p_ref = np.exp(lp_ref)
        for m in names:
            out[m][i] = (p_ref * (lp_ref - lp_of(m))).sum(axis=1)
    return out


def measure(vocab: int, repeats: int) -> dict[str, Any]:
    from safetensors.numpy import load_file

    rng = np.random.default_rng(vocab)
    names = [f"file{k}" for k in range(FILES)]
    ref = (rng.standard_normal((POSITIONS + 1, vocab)) * 3).astype(np.float32)
    logits = {"ref-f32": ref} | {m: (ref + 0.1 * rng.standard_normal(ref.shape)).astype(np.float32) for m in names}
    rows = torch.from_numpy(rng.integers(0, vocab, size=(EXAMPLES, POSITIONS + 1)))
    sys.modules["llama_cpp"] = stand_in(logits)
    folder = Path(tempfile.mkdtemp(prefix="bench-kl-"))
    (folder / "gguf").mkdir()
    for k, name in enumerate(["ref-f32", *names]):
        (folder / "gguf" / f"{name}.gguf").write_bytes(bytes([k]) * 64)
    s = types.SimpleNamespace(run=folder, keep=None, gguf=lambda n: folder / "gguf" / f"{n}.gguf")

    def candidate() -> dict[str, np.ndarray]:
        bench.score_group(s, names, rows, "bench", save_every=10 ** 9)  # type: ignore[arg-type]
        return {m: load_file(str(folder / "scores" / f"{m}.safetensors"))["kl"] for m in names}

    medians, results = benchjson.round_robin(
        {"score_group": candidate, "previous": lambda: previous_formula(logits, names, rows)},
        repeats=repeats, clock=time.process_time)
    # score_group stores per-position KL as float32 (its safetensors), so the difference is read at float32 scale
    diff = max(float(np.max(np.abs(results["score_group"][m] - results["previous"][m]))) for m in names)
    return benchjson.comparison(
        f"kl scoring, vocab {vocab}", "score_group (log-sum-exp identity)", "materialised float64 log-softmax",
        medians["score_group"], medians["previous"], repeats=repeats, clock="cpu", threads=torch.get_num_threads(),
        vocab=vocab, positions=POSITIONS, files=FILES, examples=EXAMPLES, max_abs_kl_difference=diff)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=str(OUT))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(v, args.repeats) for v in (49152, 262144)]
    print("| vocabulary | score_group s | previous s | speedup | max abs KL difference |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['extra']['vocab']:,} | {r['candidate_s']:.2f} | {r['baseline_s']:.2f} | {r['speedup']:.2f}x | "
              f"{r['extra']['max_abs_kl_difference']:.1e} |")
    benchjson.write(args.json, "kl_scoring", rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
