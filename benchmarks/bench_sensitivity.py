"""Sensitivity estimators on SmolLM2: split-half reliability and cost, the output-error proxy against today's NLL score.

Both estimators run in the same process on calibration-split examples that GPTQ's calibration
(the first 32 calibration examples, seed 0, the report's) never saw:

- **proxy** (:func:`interp.quant.sensitivity.proxy_sensitivity`): ``tr(ΔW H ΔWᵀ)`` per token
  for every block linear weight at every candidate width (RTN, group 32), ``H = XᵀX`` from
  one forward per batch, in interleaved chunks of examples;
- **nll** (:func:`interp.quant.sensitivity.sensitivity`, today's): the NLL increase with one
  weight at a time quantized, at the lowest width only (its cost is a forward from the
  weight's block per weight, so it runs on fewer tokens here: say so in the table).

Reliability is the split-half Spearman (even against odd examples; for the proxy, even
against odd chunks, which hold the even and odd examples), with a 95% bootstrap interval
that redraws each half's units. Results: ``docs/data/sensitivity/bench_sensitivity.json``
and the table between the ``sensitivity`` markers of ``docs/benchmarks.md``.

Run: ``nice -n 15 env OMP_NUM_THREADS=1 python benchmarks/bench_sensitivity.py``.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import interp
from interp.io import write_json
from interp.quant.sensitivity import Sensitivity, proxy_sensitivity, sensitivity, split_half

ROOT = Path(__file__).resolve().parents[1]
COMMITTED_NLL = ROOT / "docs" / "data" / "prescribe" / "sensitivity"  # today's pass: 8 x 64 tokens, GPTQ 3-bit
OUT = ROOT / "docs" / "data" / "sensitivity" / "bench_sensitivity.json"
DOC = ROOT / "docs" / "benchmarks.md"
GPTQ_CALIBRATION = 32  # the report's GPTQ calibration: the first 32 calibration-split examples, seed 0


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--widths", default="3,4,5,6,8")
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--proxy-n", type=int, default=32, help="proxy examples (128 tokens each)")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--nll-n", type=int, default=2, help="examples of today's one-at-a-time NLL estimator (its cost)")
    p.add_argument("--nll-seq-len", type=int, default=16)
    p.add_argument("--n-boot", type=int, default=1000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--table-only", action="store_true", help="rewrite the docs table from --out, measure nothing")
    return p.parse_args()


def main() -> int:
    args = parse()
    if args.table_only:
        write_table(json.loads(args.out.read_text()))
        return 0
    torch.set_num_threads(args.threads)
    widths = tuple(int(w) for w in args.widths.split(","))
    model = interp.load_model(args.model)
    rows = interp.load_examples("wiki", model.tokenizer, n=GPTQ_CALIBRATION + args.proxy_n, seq_len=128, seed=0,
                                split="calibration")
    gptq_rows = rows.subset(list(range(GPTQ_CALIBRATION)))
    fresh = rows.subset(list(range(GPTQ_CALIBRATION, len(rows))))
    assert not set(map(str, gptq_rows.ids)) & set(map(str, fresh.ids)), "calibration rows must be disjoint"

    tick = time.perf_counter()
    proxy = proxy_sensitivity(model, fresh, widths, group=args.group, chunks=args.chunks, progress=False)
    proxy_seconds = time.perf_counter() - tick
    per_item = proxy.per_chunk.reshape(-1, args.chunks)  # [weights * widths, chunks]
    result: dict[str, Any] = {"model": args.model, "proxy": {
        "spec": proxy.spec, "widths": list(widths), "examples": len(fresh), "seq_len": fresh.seq_len,
        "tokens": int(proxy.tokens.sum()), "chunks": args.chunks, "seconds": proxy_seconds,
        "model_forwards": len(fresh) / 8, "split_half_all": split_half(per_item, np.tile(proxy.tokens, 1),
                                                                       args.n_boot),
        "split_half_by_width": {str(w): split_half(proxy.per_chunk[:, i], proxy.tokens, args.n_boot)
                                for i, w in enumerate(widths)},
        "split_half_gains": {f"{a}->{b}": split_half(proxy.per_chunk[:, i] - proxy.per_chunk[:, i + 1],
                                                     proxy.tokens, args.n_boot)
                             for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True))}}}
    print(f"proxy: {proxy_seconds:.0f} s, all {result['proxy']['split_half_all']}", flush=True)

    nll_rows = fresh.subset(list(range(args.nll_n)))
    nll_rows = interp.Examples.from_tokens(nll_rows.tokens[:, :args.nll_seq_len], ids=nll_rows.ids)
    tick = time.perf_counter()
    nll = sensitivity(model, f"rtn:bits={widths[0]},group={args.group}", nll_rows, progress=False, cache=False)
    nll_seconds = time.perf_counter() - tick
    committed = Sensitivity.load(COMMITTED_NLL)
    by_name = dict(zip(proxy.names, proxy.scores()[:, 0], strict=True))
    agreement = interp.stats.spearman([by_name[n] for n in committed.names], committed.scores, n_boot=args.n_boot)
    result["nll"] = {"spec": nll.spec, "examples": args.nll_n, "seq_len": args.nll_seq_len,
                     "tokens": args.nll_n * args.nll_seq_len, "seconds": nll_seconds,
                     "model_forwards": nll.settings["model_forwards"] * args.nll_n / 8,
                     "split_half": split_half(nll.per_example, None, args.n_boot)}
    result["nll_committed"] = {"spec": committed.spec, "examples": committed.per_example.shape[1],
                               "seq_len": committed.settings["seq_len"],
                               "tokens": committed.per_example.shape[1] * committed.settings["seq_len"],
                               "seconds": committed.settings["seconds"],
                               "model_forwards": committed.settings["model_forwards"],
                               "split_half": split_half(committed.per_example, None, args.n_boot)}
    result["proxy_vs_nll"] = {"rho": agreement.r, "low": agreement.low, "high": agreement.high,
                              "width": widths[0], "against": "the committed NLL pass (GPTQ 3-bit, 8 x 64 tokens)"}
    print(f"nll: {nll_seconds:.0f} s, {result['nll']['split_half']}; proxy vs nll {result['proxy_vs_nll']}",
          flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, result)
    write_table(result)
    return 0


def _ci(d: dict[str, float]) -> str:
    return f"{d['rho']:.3f} [{d['low']:.3f}, {d['high']:.3f}]"


def write_table(result: dict[str, Any]) -> None:
    """The table between the sensitivity markers of docs/benchmarks.md, from the result."""
    p, n = result["proxy"], result["nll"]
    lines = ["| estimator | scores | tokens | split-half Spearman [95% CI] | seconds | token-forwards |",
             "|---|---|---:|---|---:|---:|",
             f"| proxy tr(ΔW H ΔWᵀ), all widths | {len(p['widths'])} widths x 210 weights | {p['tokens']} | "
             f"{_ci(p['split_half_all'])} | {p['seconds']:.0f} | {p['tokens']} |"]
    for width, d in p["split_half_by_width"].items():
        lines.append(f"| proxy, {width}-bit only | 210 weights | {p['tokens']} | {_ci(d)} | | |")
    for step, d in p["split_half_gains"].items():
        lines.append(f"| proxy, gain {step} bits | 210 weights | {p['tokens']} | {_ci(d)} | | |")
    c = result["nll_committed"]
    lines.append(f"| NLL one at a time (today's), GPTQ 3-bit, committed pass | 210 weights | {c['tokens']} | "
                 f"{_ci(c['split_half'])} | {c['seconds']:.0f} | {c['model_forwards'] * c['tokens']:.0f} |")
    lines.append(f"| NLL one at a time, RTN {p['widths'][0]}-bit, this run (reduced; 1 example per half) | "
                 f"210 weights | {n['tokens']} | {_ci(n['split_half'])} | {n['seconds']:.0f} | "
                 f"{n['model_forwards'] * 8 / n['examples'] * n['tokens']:.0f} |")
    a = result["proxy_vs_nll"]
    lines.append("")
    lines.append("Token-forwards: model forwards (a forward from a weight's block counts as its share of the "
                 "model) times the tokens each covers. Seconds: wall time, one thread at nice 15 on the shared "
                 "2-core machine (load average about 11 during this run), so they overstate the CPU cost; the two "
                 "estimators ran in the same process, one after the other.")
    lines.append("")
    lines.append(f"Proxy ({a['width']}-bit RTN) against {a['against']}, over the 210 weights: Spearman "
                 f"{a['rho']:.3f} [{a['low']:.3f}, {a['high']:.3f}].")
    text = DOC.read_text()
    block = "<!-- sensitivity:begin (benchmarks/bench_sensitivity.py) -->\n" + "\n".join(lines) + \
        "\n<!-- sensitivity:end -->"
    pattern = re.compile(r"<!-- sensitivity:begin.*?<!-- sensitivity:end -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)


if __name__ == "__main__":
    raise SystemExit(main())
