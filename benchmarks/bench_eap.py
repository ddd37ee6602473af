"""Edge attribution patching (EAP, EAP-IG) against exact path patching on the same edges.

On the bundled SmolLM2-135M (30 layers, 9 query heads and 3 key/value heads: grouped-query
attention), with IOI prompts built from the tokenizer's single-token names
(:func:`interp.localize.tasks.ioi_task`, the paper's ABC corruption) and the logit
difference between the indirect object and the subject at the last token:

- senders: every head and the MLP of ``--sender-layers``;
- receivers: the final residual (``logits``: the direct path) and the query, key and value
  inputs of the heads of ``--receiver-layer``;
- exact: :func:`interp.localize.paths.path_patch`, one call per receiver (senders stacked);
- estimates: :func:`interp.localize.eap.edge_attribution` with ``ig_steps=1`` (EAP) and
  ``--ig-steps`` (EAP-IG), one call per receiver kind.

Reported: the Spearman rank correlation between each estimate and the exact effect over all
edges (mean over prompts), and the wall-time ratio exact / estimate, all in one process.

Run from the repository root::

    OMP_NUM_THREADS=1 python benchmarks/bench_eap.py [--n 8] [--quick] [--json PATH] [--write FILE]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import benchjson
import torch
from scipy.stats import spearmanr

import interp
from interp.localize.eap import edge_attribution
from interp.localize.patching import LogitDiffMetric
from interp.localize.paths import Sender, path_patch
from interp.localize.tasks import ioi_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=None, help="prompts (default 8; 4 with --quick)")
    parser.add_argument("--sender-layers", default=None, help="default 14,18,22 (20,22 with --quick)")
    parser.add_argument("--receiver-layer", type=int, default=None, help="default 26 (24 with --quick)")
    parser.add_argument("--ig-steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--write", default=None, help="also write the markdown report to this file")
    benchjson.add_options(parser, "eap")
    args = parser.parse_args()
    for name, full, quick in (("n", 8, 4), ("sender_layers", "14,18,22", "20,22"), ("receiver_layer", 26, 24)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    torch.set_num_threads(args.threads)
    model = interp.load_model("smollm2-135m")
    task = ioi_task(model.tokenizer, n=args.n, seed=0)
    metric = LogitDiffMetric(task.answers, task.wrongs)
    n_heads, n_kv = int(model.cfg.n_heads), int(model.info.n_kv_heads or model.cfg.n_heads)
    layers = [int(x) for x in args.sender_layers.split(",")]
    senders = [Sender("head", layer, h) for layer in layers for h in range(n_heads)]
    senders += [Sender("mlp", layer) for layer in layers]
    r = args.receiver_layer
    head_receivers = ([(r, h, "q") for h in range(n_heads)] + [(r, h, "k") for h in range(n_kv)]
                      + [(r, h, "v") for h in range(n_kv)])
    common = {"source_examples": task.corrupt, "metric": metric}

    start = time.perf_counter()
    exact_cols = [path_patch(model, task.clean, senders, "logits", **common).effect()]
    for receiver in head_receivers:
        exact_cols.append(path_patch(model, task.clean, senders, [receiver], **common).effect())
    exact_s = time.perf_counter() - start
    exact = torch.stack(exact_cols, dim=1)  # [senders, receivers]

    estimates, times = {}, {}
    for label, steps in (("EAP", 1), (f"EAP-IG ({args.ig_steps} steps)", args.ig_steps)):
        start = time.perf_counter()
        direct = edge_attribution(model, task.clean, senders, "logits", ig_steps=steps, **common)
        heads = edge_attribution(model, task.clean, senders, head_receivers, ig_steps=steps, **common)
        times[label] = time.perf_counter() - start
        estimates[label] = torch.cat([direct.edge_scores(), heads.edge_scores()], dim=1)

    n_edges = exact.numel()
    rows, comparisons, metrics = [], [], {"edges": n_edges, "exact_s": exact_s}
    for label, est in estimates.items():
        rho = float(spearmanr(est.flatten().numpy(), exact.flatten().numpy()).statistic)
        direct_rho = float(spearmanr(est[:, 0].numpy(), exact[:, 0].numpy()).statistic)
        rows.append((label, rho, direct_rho, times[label], exact_s / times[label]))
        metrics[f"{label} spearman"] = rho
        comparisons.append(benchjson.comparison(f"{label} vs exact path patching (wall)", label, "path_patch",
                                                times[label], exact_s, repeats=1, threads=args.threads,
                                                spearman=rho, edges=n_edges))
    report = _report(rows, args, len(senders), len(head_receivers) + 1, exact_s, float(exact.abs().max()))
    print(report)
    if args.write:
        Path(args.write).write_text(report)
    benchjson.write(args.json, "eap", comparisons, args, metrics)


def _report(rows: list, args: argparse.Namespace, n_senders: int, n_receivers: int, exact_s: float,
            largest: float) -> str:
    lines = [f"SmolLM2-135M, {args.n} IOI prompts (ABC corruption), logit difference; {n_senders} senders (every head "
             f"and the MLP of layers {args.sender_layers}) x {n_receivers} receivers (logits, and q/k/v of layer "
             f"{args.receiver_layer}'s 9 query / 3 key-value heads) = {n_senders * n_receivers} edges; "
             f"{args.threads} thread(s). Exact path patching: {exact_s:.1f} s; largest exact edge effect "
             f"{largest:.3f}.", "",
             "| estimate | Spearman vs exact (all edges) | Spearman (direct edges) | time (s) | exact / estimate |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {label} | {rho:.2f} | {direct:.2f} | {t:.1f} | {ratio:.1f}x |"
              for label, rho, direct, t, ratio in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
