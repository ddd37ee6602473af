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

Run: ``python benchmarks/bench_probe_scoring.py [--repeats 5] [--threads 2] [--quick] [--json PATH]``

``--quick``: batch 4 x 64 tokens, median of 3, process CPU time (``--clock cpu``: a descheduled
thread on a loaded machine does not count), the measurements timed round-robin (``--interleave``:
load that changes during the run falls on all of them alike), no memory check (explicit options
still win).

Every ratio printed is also written as a comparison (with its direction, ``ratio_is``) to
``--json`` (default ``benchmarks/results/probe_scoring.json``; schema in docs/benchmarks.md),
and the matmul peak, FLOP/s share and memory growth under ``metrics``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import benchjson
import torch

import interp
from interp.probes import REDUCERS, probe
from interp.runtime import hooks as hk

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]  # set by main() from --clock
COMPONENTS = ["resid_mid", "resid_post", "h", "gate", "pattern"]
REDUCERS_USED = ["norm", "mean", "kurtosis", "entropy", "gtd"]


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = clock()
        fn()
        samples.append(clock() - start)
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


def main() -> None:  # noqa: C901 - one straight script: measure, print, record
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=None, help="default 5 (3 with --quick)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=None, help="examples per batch (default 8; 4 with --quick)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per example (default 128; 64 with --quick)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default=None,
                        help="wall time (default) or process CPU time (default with --quick)")
    parser.add_argument("--memory-seq-len", type=int, default=32)
    parser.add_argument("--memory-child", type=int, default=None)
    parser.add_argument("--memory-only", action="store_true", help="run only the N=64 vs N=1024 memory check")
    benchjson.add_interleave_option(parser)
    benchjson.add_options(parser, "probe_scoring")
    args = parser.parse_args()
    for name, full, quick in (("repeats", 5, 3), ("batch", 8, 4), ("seq_len", 128, 64), ("clock", "wall", "cpu"),
                              ("interleave", False, True)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args.memory_child, args.memory_seq_len)
        return
    if args.memory_only:
        memory_check(args)
        return

    model = interp.load_model("smollm2-135m")
    ex = interp.load_examples("wiki", model.tokenizer, n=args.batch, seq_len=args.seq_len, seed=0)
    tokens = ex.tokens
    sdpa, eager = plain_hf("sdpa"), plain_hf("eager")
    no_grad = torch.no_grad()

    def hf_nll():
        logits = sdpa(input_ids=tokens).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(),
                                                 reduction="none").view(args.batch, -1).mean(1)

    variants = {
        "plain HF forward (sdpa)": no_grad(lambda: sdpa(input_ids=tokens)),
        "plain HF forward (eager)": no_grad(lambda: eager(input_ids=tokens)),
        "plain HF NLL (sdpa)": no_grad(hf_nll),
        "plain HF body, no unembed (sdpa)": no_grad(lambda: sdpa.model(input_ids=tokens)),
        "interp.nll": lambda: interp.nll(model, ex, batch_size=args.batch),
        "interp.nll as before (bridge forward, full logits, logsumexp)": lambda: nll_before(model, tokens),
        "interp.probe (report statistics)": lambda: probe(model, ex, COMPONENTS, REDUCERS_USED,
                                                          batch_size=args.batch, progress=False),
        "interp.probe on the bridge's hook points (native=False)": lambda: probe(
            model, ex, COMPONENTS, REDUCERS_USED, batch_size=args.batch, progress=False, native=False),
        "run_with_cache + same reductions": lambda: run_with_cache_and_reduce(model, tokens),
    }
    if args.interleave:  # one call of each per round, so load changing during the run falls on all alike
        rows, _ = benchjson.round_robin(variants, args.repeats, clock)
    else:  # one measurement after another, each with its own warm-up
        rows = {name: timed(fn, args.repeats) for name, fn in variants.items()}

    base = rows["plain HF forward (sdpa)"]
    n_tokens = tokens.numel()
    params = sum(p.numel() for n, p in sdpa.named_parameters() if "embed_tokens" not in n)
    vocab, d_model = sdpa.lm_head.weight.shape
    cfg = sdpa.config
    attn_flops = 2 * 2 * cfg.num_hidden_layers * tokens.shape[0] * tokens.shape[1] ** 2 * cfg.hidden_size
    flops = 2 * n_tokens * (params + 0) + attn_flops  # params include the tied lm_head once
    peak = matmul_peak()
    print(f"machine: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{'cpu time, ' if args.clock == 'cpu' else ''}{'interleaved, ' if args.interleave else ''}matmul peak "
          f"{peak / 1e9:.1f} GFLOP/s (2048^3 fp32)")
    print(f"\n| measurement ({args.batch} x {args.seq_len} tokens) | median s | ratio to plain HF forward (sdpa) |"
          "\n|---|---|---|")
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

    metrics = {"tokens_per_batch": n_tokens, "matmul_peak_flops": peak, "scoring_flops_per_batch": flops,
               "scoring_share_of_matmul_peak": achieved / peak,
               "memory": None if args.quick else memory_check(args)}
    benchjson.write(args.json, "probe_scoring", comparisons(rows, args), args, metrics)


def comparisons(rows: dict[str, float], args: argparse.Namespace) -> list[dict]:
    """Every ratio printed above, as ``benchjson`` comparisons in the direction printed."""
    base_name = "plain HF forward (sdpa)"
    common = {"repeats": args.repeats, "threads": torch.get_num_threads(), "clock": args.clock}
    out = [benchjson.comparison(f"{name} vs {base_name}", name, base_name, seconds, rows[base_name],
                                ratio_is="candidate/baseline", **common)
           for name, seconds in rows.items() if name != base_name]
    for candidate, baseline, ratio_is in (
        ("interp.nll", "plain HF NLL (sdpa)", "baseline/candidate"),
        ("interp.probe (report statistics)", "run_with_cache + same reductions", "baseline/candidate"),
        ("interp.probe (report statistics)", "plain HF body, no unembed (sdpa)", "candidate/baseline"),
        ("interp.nll", "interp.nll as before (bridge forward, full logits, logsumexp)", "baseline/candidate"),
    ):
        out.append(benchjson.comparison(f"{candidate} vs {baseline}", candidate, baseline, rows[candidate],
                                        rows[baseline], ratio_is=ratio_is, **common))
    return out


def memory_check(args: argparse.Namespace) -> dict:
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
    return {"seq_len": args.memory_seq_len, "runs": mem, "growth_1024_vs_64": growth}


if __name__ == "__main__":
    main()
