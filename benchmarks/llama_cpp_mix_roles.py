"""Diagnostic (not registered): why llama.cpp's plain Q3_K_L scores worse than its plain Q3_K_M on SmolLM2.

In llama-cpp-curve-1 the plain Q3_K_L file (97.5 MB) has a higher held-out mean KL than the plain Q3_K_M file
(93.5 MB), although on SmolLM2 it stores every tensor at as many bits or more: ``attn_v`` and ``attn_output`` as
Q5_1 where Q3_K_M has Q5_0 (two ``attn_v`` already Q5_1), and every ``ffn_down`` as Q5_K where Q3_K_M has Q4_K
(one already Q5_K). The other roles are the same types (SmolLM2's width 576 is not a multiple of 256, so they fall
back to legacy types).

This script measures where the difference comes from, on the curve's own held-out examples and reference:

1. **Weights.** Per role and type, the relative Frobenius error ``||Q(W) - W|| / ||W||`` of every block
   weight of that role (all 30 layers), rounded as ``llama-quantize`` rounds them without an importance matrix
   (``interp.quant.llama_cpp.quantize_blocks``, byte-identical to llama.cpp's).
2. **Held-out KL.** Plain Q3_K_M with one role at a time given Q3_K_L's type (``--tensor-type``), scored with
   llama.cpp's kernels beside plain Q3_K_M and Q3_K_L on the registration's 256 held-out examples; the paired
   difference in mean KL against Q3_K_M, with a 95% bootstrap interval over examples.

The reference is the curve's: the bundled SmolLM2 GGUF (block weights Q4_1) requantized to F32, so every reference
block weight lies on a 16-level grid per 32 weights. The results go to
``docs/data/prescribe/llama-cpp/diagnostics/smollm2-q3kl.json``; the run's GGUF files stay under ``--run``.

Usage (a llama.cpp build from ``make llama-cpp``, about 15 minutes on one core)::

    LLAMA_CPP_BIN=.venv/llama.cpp/build/bin LLAMA_CPP_LIB_PATH=.venv/llama.cpp/build/bin \\
        python benchmarks/llama_cpp_mix_roles.py
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import llama_cpp_curve as run_curve  # noqa: E402
import llama_cpp_plans as plans  # noqa: E402

OUT = ROOT / "docs" / "data" / "prescribe" / "llama-cpp" / "diagnostics" / "smollm2-q3kl.json"
# Q3_K_L's type for each role it stores at more bits than Q3_K_M on SmolLM2 (read from the curve's tensor_types/)
UPGRADES = {"attn_v": "q5_1", "attn_output": "q5_1", "ffn_down": "q5_k"}
WEIGHT_TYPES = {"attn_v": ("q5_0", "q5_1"), "attn_output": ("q5_0", "q5_1"), "ffn_down": ("q4_k", "q5_k", "q6_k")}
N_BOOT = 2000


def weight_errors(source: Path) -> dict[str, dict[str, float]]:
    """Per role and type: ||Q(W) - W|| / ||W|| over all of the role's block weights, no importance matrix."""
    import gguf

    from interp.quant.llama_cpp import quantize_blocks

    reader = gguf.GGUFReader(str(source))
    err: dict[str, dict[str, list[float]]] = {r: {t: [0.0, 0.0] for t in ts} for r, ts in WEIGHT_TYPES.items()}
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.\d+\.(\w+)\.weight", t.name)
        if not m or m.group(1) not in WEIGHT_TYPES:
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(-1, w.shape[-1])
        for ty in WEIGHT_TYPES[m.group(1)]:
            blocks = quantize_blocks(w, ty)
            back = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[ty.upper()]).reshape(w.shape)
            acc = err[m.group(1)][ty]
            acc[0] += float(np.sum((back.astype(np.float64) - w) ** 2))
            acc[1] += float(np.sum(w.astype(np.float64) ** 2))
    return {r: {t: (a / b) ** 0.5 for t, (a, b) in ts.items()} for r, ts in err.items()}


def paired(kl: dict[str, np.ndarray], name: str, base: str, seed: int = 0) -> dict[str, float]:
    """Mean KL of ``name`` minus ``base`` over the same examples, with a 95% percentile bootstrap interval."""
    from interp.quant.protocol import paired_mean_difference

    est = paired_mean_difference(kl[name], kl[base], n_boot=N_BOOT, seed=seed)
    return {"difference": est.value, "low": est.low, "high": est.high,
            "share_of_examples_worse": float((kl[name] > kl[base]).mean())}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", default=str(ROOT / "runs" / "llama-cpp-mix-roles"), help="working folder")
    parser.add_argument("--examples", type=int, default=None, help="score only the first N held-out examples")
    parser.add_argument("--out", default=str(OUT), help="where the result JSON goes")
    args = parser.parse_args(argv)
    binary = Path(os.environ.get("LLAMA_CPP_BIN", ""))
    if not (binary / "llama-quantize").is_file():
        raise SystemExit("set LLAMA_CPP_BIN to the folder holding llama-quantize and libllama.so")
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(binary))
    os.environ.setdefault("LLAMA_THREADS", "1")
    import interp
    from interp.io import write_json

    s = run_curve.setup("smollm2-135m", Path(args.run), binary, dry=False)
    s = dataclasses.replace(s, keep=None)  # nothing of this run goes into the curve's committed folder
    (s.run / "gguf").mkdir(parents=True, exist_ok=True)
    plans.quantize(binary, s.source, s.gguf("ref-f32"), "F32", "--allow-requantize")
    files: dict[str, list[str]] = {"Q3_K_M": [], "Q3_K_L": []} | {f"Q3_K_M+{r}={t}": ["--tensor-type", f"{r}={t}"]
                                                            for r, t in UPGRADES.items()}
    names = {label: re.sub(r"[^A-Za-z0-9_-]", "-", label) for label in files}
    for label, extra in files.items():
        mix = "Q3_K_L" if label == "Q3_K_L" else "Q3_K_M"
        plans.quantize(binary, s.gguf("ref-f32"), s.gguf(names[label]), mix, *extra)
    model = interp.load_model("smollm2-135m")
    rows, _ = run_curve.examples(s, model.tokenizer)
    del model
    tokens = rows.tokens if args.examples is None else rows.tokens[:args.examples]
    # always scored (about 15 minutes): a kill resumes at the last save, which score_group reuses only for the same
    # rows, file bytes and code; finished scores are not reused, so a changed --examples is never read from old ones
    run_curve.score_group(s, list(names.values()), tokens, "mix-roles")
    import pandas as pd

    kl = {label: pd.read_parquet(s.run / "scores" / f"{n}.parquet")["kl"].to_numpy() for label, n in names.items()}
    result = {
        "what": __doc__.split("\n")[0],
        "registered": False,
        "reference": "the bundled SmolLM2 GGUF (block weights Q4_1) requantized to F32, as in llama-cpp-curve-1",
        "examples": int(tokens.shape[0]),
        "heldout": "llama-cpp-curve-1's held-out examples (examples.json)",
        "files": {label: {"bytes": s.gguf(n).stat().st_size, "mean_kl": float(kl[label].mean()),
                          "against_Q3_K_M": None if label == "Q3_K_M" else paired(kl, label, "Q3_K_M")}
                  for label, n in names.items()},
        "weight_relative_error": weight_errors(s.source),
    }
    write_json(Path(args.out), result)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
