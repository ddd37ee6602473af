"""The Fisher-weighted score against the output-error proxy: cost and split-half reliability, in one run.

Both run in this process on the same calibration-split examples of SmolLM2 (64 x 128 tokens,
seed 31, 8 interleaved chunks), one after the other:

- **proxy** (``interp.quant.sensitivity.proxy_sensitivity``): ``tr(ΔW H ΔWᵀ)`` at 4, 5 and 8
  bits (RTN, group 32);
- **fisher** (:func:`interp.quant.fisher.fisher_sensitivity`): ``1/2 g² (ΔW x)²`` per token on
  llama.cpp's exact legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: five options per weight).

The ratio of their seconds is the cost claim; the split-half Spearman (even against odd chunks)
within one option, over the 210 weights, is the reliability. Results:
``docs/data/sensitivity/bench_fisher.json`` and the ``fisher`` table of ``docs/benchmarks.md``.

Run: ``OMP_NUM_THREADS=2 python benchmarks/bench_fisher.py``.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import interp  # noqa: E402
from interp.io import sanitize, write_json  # noqa: E402
from interp.quant.fisher import fisher_sensitivity  # noqa: E402
from interp.quant.llama_cpp import LEGACY_TYPES, stored_weight  # noqa: E402
from interp.quant.sensitivity import proxy_sensitivity, split_half  # noqa: E402

OUT = ROOT / "docs" / "data" / "sensitivity" / "bench_fisher.json"
DOC = ROOT / "docs" / "benchmarks.md"


def table(result: dict) -> str:
    p, f = result["proxy"], result["fisher"]
    lines = ["| estimator | options per weight | seconds | split-half Spearman within one option [95% CI] |",
             "|---|---|---:|---|"]
    for name, r in (("output-error proxy (RTN stand-ins)", p), ("Fisher-weighted (llama.cpp legacy types)", f)):
        halves = "; ".join(f"{k}: {v['rho']:.3f} [{v['low']:.3f}, {v['high']:.3f}]" for k, v in r["split_half"].items())
        lines.append(f"| {name} | {r['options']} | {r['seconds']:.0f} | {halves} |")
    lines.append(f"\nFisher / proxy seconds: **{f['seconds'] / p['seconds']:.2f}x** (same run, same "
                 f"{result['tokens']} tokens, {result['threads']} threads).")
    return "\n".join(lines)


def main() -> int:
    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "2")))
    model = interp.load_model("smollm2-135m")
    rows = interp.load_examples("wiki", model.tokenizer, n=64, seq_len=128, seed=31, split="calibration")
    tick = time.perf_counter()
    proxy = proxy_sensitivity(model, rows, (4, 5, 8), group=32, chunks=8, batch_size=8, progress=False)
    proxy_seconds = time.perf_counter() - tick

    def options(layer: int, role: str, W: torch.Tensor) -> dict[str, torch.Tensor]:
        return {t: stored_weight(W, t) for t in LEGACY_TYPES}

    tick = time.perf_counter()
    fisher = fisher_sensitivity(model, rows, options, chunks=8, batch_size=8, seed=31, progress=False)
    fisher_seconds = time.perf_counter() - tick
    result = {
        "tokens": int(rows.tokens.numel()), "threads": torch.get_num_threads(),
        "proxy": {"seconds": proxy_seconds, "options": "RTN 4, 5, 8 bits",
                  "split_half": {f"{b} bits": split_half(proxy.per_chunk[:, i], proxy.tokens, seed=0)
                                 for i, b in enumerate(proxy.widths)}},
        "fisher": {"seconds": fisher_seconds, "options": ", ".join(LEGACY_TYPES),
                   "split_half": {t: split_half(fisher.per_chunk[:, i], fisher.tokens, seed=0)
                                  for i, t in enumerate(LEGACY_TYPES) if np.any(fisher.per_chunk[:, i])}},
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    write_json(OUT, sanitize(result))
    text = DOC.read_text()
    block = f"<!-- fisher:begin (benchmarks/bench_fisher.py) -->\n{table(result)}\n<!-- fisher:end -->"
    DOC.write_text(re.sub(r"<!-- fisher:begin.*?<!-- fisher:end -->", lambda _: block, text, flags=re.S))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
