"""Probe and scoring speed against peers, in one process, as ratios (medians of repeats).

Baselines, all on the bundled SmolLM2-135M, batch 8 x 128 tokens:

- plain HF: a separately loaded ``LlamaForCausalLM`` (transformers' default SDPA attention),
  no hooks, the same NLL computed with ``cross_entropy``;
- ``run_with_cache``: transformer-lens caching the same hook points, then the same reductions;
- interp: ``interp.probe`` of the report's statistics (resid_mid/post norms, h norm, gate
  norm/mean/kurtosis, attention entropy and GTD, all layers) and ``interp.nll``.

Also: the machine's fp32 matmul peak (one large ``torch.mm``), the scoring run's achieved
FLOP/s as a fraction of it, and peak RSS of probing N=64 against N=1024 examples (each in a
fresh subprocess).

Run: ``python benchmarks/bench_probe_scoring.py [--repeats 5] [--threads 2]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

import interp
from interp import hooks as hk
from interp.probes import REDUCERS, probe

COMPONENTS = ["resid_mid", "resid_post", "h", "gate", "pattern"]
REDUCERS_USED = ["norm", "mean", "kurtosis", "entropy", "gtd"]


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def plain_hf(attn: str):
    from transformers import AutoModelForCausalLM

    from interp import models

    folder = next((models.cache_dir() / "models").glob("SmolLM2-135M-Instruct.Q4_1-*"))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn).eval()


def run_with_cache_and_reduce(model, tokens):
    names = set()
    for layer in range(model.cfg.n_layers):
        for component in ("resid_mid", "resid_post", "h", "gate_pre", "pattern"):
            names.add(hk.hook_point(model, component, layer))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
        out = []
        for layer in range(model.cfg.n_layers):
            for component in ("resid_mid", "resid_post", "h"):
                out.append(REDUCERS["norm"](cache[hk.hook_point(model, component, layer)]))
            gate = hk.activation_fn(model, layer)(cache[hk.hook_point(model, "gate_pre", layer)])
            out += [REDUCERS[r](gate) for r in ("norm", "mean", "kurtosis")]
            pattern = cache[hk.hook_point(model, "pattern", layer)]
            out += [REDUCERS[r](pattern) for r in ("entropy", "gtd")]
    return out


def nll_before(model, tokens, chunk: int = 32):
    """What ``interp.nll`` did before this round of work: the hooked bridge forward, the full
    ``[B, T, vocab]`` logits, then ``torch.logsumexp`` + gather per 32 positions."""
    with torch.no_grad():
        logits = model.original_model(input_ids=tokens).logits[:, :-1]
        targets = tokens[:, 1:]
        out = []
        for start in range(0, targets.shape[1], chunk):
            block = logits[:, start:start + chunk]
            picked = block.gather(-1, targets[:, start:start + chunk, None])[..., 0]
            out.append(torch.logsumexp(block, -1) - picked)
        return torch.cat(out, 1).double().mean(1)


def memory_child(n: int, seq_len: int) -> None:
    import resource

    model = interp.load_model("smollm2-135m")
    ex = interp.load_examples("wiki", model.tokenizer, n=n, seq_len=seq_len, split="all")
    import gc

    gc.collect()
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _reset_peak_rss()  # the model load's peak would otherwise hide the probe's
    before = _rss_kib("VmRSS")
    probe(model, ex, COMPONENTS, REDUCERS_USED, batch_size=8, progress=False)
    print(json.dumps({"n": n, "rss_before_mib": before / 1024, "rss_peak_mib": _rss_kib("VmHWM") / 1024,
                      "load_peak_mib": load_peak / 1024}))


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS (Linux)
        f.write("5")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def matmul_peak(size: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    seconds = timed(lambda: torch.mm(a, b), repeats)
    return 2 * size**3 / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory-seq-len", type=int, default=32)
    parser.add_argument("--memory-child", type=int, default=None)
    parser.add_argument("--memory-only", action="store_true", help="run only the N=64 vs N=1024 memory check")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args.memory_child, args.memory_seq_len)
        return
    if args.memory_only:
        memory_check(args)
        return

    model = interp.load_model("smollm2-135m")
    ex = interp.load_examples("wiki", model.tokenizer, n=8, seq_len=128, seed=0)
    tokens = ex.tokens
    sdpa, eager = plain_hf("sdpa"), plain_hf("eager")
    rows = {}
    with torch.no_grad():
        rows["plain HF forward (sdpa)"] = timed(lambda: sdpa(input_ids=tokens), args.repeats)
        rows["plain HF forward (eager)"] = timed(lambda: eager(input_ids=tokens), args.repeats)

        def hf_nll():
            logits = sdpa(input_ids=tokens).logits
            return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(),
                                                     reduction="none").view(8, -1).mean(1)

        rows["plain HF NLL (sdpa)"] = timed(hf_nll, args.repeats)
        rows["plain HF body, no unembed (sdpa)"] = timed(lambda: sdpa.model(input_ids=tokens), args.repeats)
    rows["interp.nll"] = timed(lambda: interp.nll(model, ex, batch_size=8), args.repeats)
    rows["interp.nll as before (bridge forward, full logits, logsumexp)"] = timed(
        lambda: nll_before(model, tokens), args.repeats)
    rows["interp.probe (report statistics)"] = timed(
        lambda: probe(model, ex, COMPONENTS, REDUCERS_USED, batch_size=8, progress=False), args.repeats)
    rows["interp.probe on the bridge's hook points (native=False)"] = timed(
        lambda: probe(model, ex, COMPONENTS, REDUCERS_USED, batch_size=8, progress=False, native=False),
        args.repeats)
    rows["run_with_cache + same reductions"] = timed(lambda: run_with_cache_and_reduce(model, tokens), args.repeats)

    base = rows["plain HF forward (sdpa)"]
    n_tokens = tokens.numel()
    params = sum(p.numel() for n, p in sdpa.named_parameters() if "embed_tokens" not in n)
    vocab, d_model = sdpa.lm_head.weight.shape
    cfg = sdpa.config
    attn_flops = 2 * 2 * cfg.num_hidden_layers * tokens.shape[0] * tokens.shape[1] ** 2 * cfg.hidden_size
    flops = 2 * n_tokens * (params + 0) + attn_flops  # params include the tied lm_head once
    peak = matmul_peak()
    print(f"machine: torch {torch.__version__}, {torch.get_num_threads()} threads, matmul peak "
          f"{peak / 1e9:.1f} GFLOP/s (2048^3 fp32)")
    print("\n| measurement (8 x 128 tokens) | median s | ratio to plain HF forward (sdpa) |\n|---|---|---|")
    for name, seconds in rows.items():
        print(f"| {name} | {seconds:.3f} | {seconds / base:.2f} |")
    nll_ratio = rows["plain HF NLL (sdpa)"] / rows["interp.nll"]
    print(f"\ninterp.nll throughput vs plain HF NLL: {nll_ratio:.2f}x "
          f"({n_tokens / rows['interp.nll']:.0f} vs {n_tokens / rows['plain HF NLL (sdpa)']:.0f} tokens/s)")
    probe_vs_cache = rows["run_with_cache + same reductions"] / rows["interp.probe (report statistics)"]
    print(f"interp.probe vs run_with_cache+reductions: {probe_vs_cache:.2f}x faster")
    print(f"interp.probe / plain HF forward: {rows['interp.probe (report statistics)'] / base:.2f}x "
          f"(target <= 1.15x); / plain HF body without the unembed: "
          f"{rows['interp.probe (report statistics)'] / rows['plain HF body, no unembed (sdpa)']:.2f}x")
    before = rows["interp.nll as before (bridge forward, full logits, logsumexp)"]
    print(f"interp.nll before -> after: {before:.3f} s -> {rows['interp.nll']:.3f} s "
          f"({n_tokens / before:.0f} -> {n_tokens / rows['interp.nll']:.0f} tokens/s)")
    achieved = flops / rows["interp.nll"]
    print(f"scoring: {flops / 1e9:.1f} GFLOP per batch, {achieved / 1e9:.1f} GFLOP/s achieved = "
          f"{achieved / peak:.0%} of the matmul peak")

    memory_check(args)


def memory_check(args: argparse.Namespace) -> None:
    mem = []
    for n in (64, 1024):
        out = subprocess.run([sys.executable, __file__, "--memory-child", str(n), "--threads", str(args.threads),
                              "--memory-seq-len", str(args.memory_seq_len)], capture_output=True, text=True,
                             check=True)
        mem.append(json.loads(out.stdout.strip().splitlines()[-1]))
    growth = mem[1]["rss_peak_mib"] / mem[0]["rss_peak_mib"] - 1
    rise = [m["rss_peak_mib"] - m["rss_before_mib"] for m in mem]
    print(f"\npeak RSS while probing (high-water mark reset after loading) N=64: {mem[0]['rss_peak_mib']:.0f} MiB "
          f"(+{rise[0]:.0f} over the loaded model); N=1024: {mem[1]['rss_peak_mib']:.0f} MiB (+{rise[1]:.0f}); "
          f"T={args.memory_seq_len}; growth {growth:+.1%} (target < 10%)")


if __name__ == "__main__":
    main()
