"""Time the patching engine against the textbook one-forward-per-patch loop.

Scenarios, all on the bundled SmolLM2-135M (30 layers) with a 3-bit RTN copy as the target:

- ``sweep``: the full per-layer sweep, 5 components (attn_out, gate, up, down,
  gate_input) x 30 layers = 150 patches, on 8 examples x 64 tokens (NLL metric);
- ``upper``: the same sweep over the upper half only (15 layers, 75 patches), the paper's
  setting;
- ``positions``: clean/corrupt patching of ``resid_pre`` at every (layer, position) of two
  14-token prompts (420 patches, logit-difference metric).

Each (scenario, method) runs in its own subprocess, so the peak resident memory
(``ru_maxrss``) of one does not hide the other's; "above models" subtracts the peak
measured after the two models were loaded. The naive loop is :func:`interp.localize.patching.patch_naive`:
the source's activations cached once, then one full forward with full logits per patch,
as transformer-lens' ``patching.py`` does. Attribution patching runs on the ``sweep``
data and is compared with the exact sweep by Spearman rank correlation.

The second baseline is transformer-lens' own serial loop: the source's activations from
``run_with_cache`` once per batch, then one ``run_with_hooks`` (full logits) per patch with a
hook that returns the source's activation, as transformer-lens' ``patching.py`` and its
tutorials do; the same metric is read from the logits (``--skip-tl`` leaves it out).

``--head-study`` also times the engine's head on its own (the exact NLL of 8 stacked patches'
final residuals, 4,032 rows x 49,152 logits, from the bundled model's real residuals): the
vocabulary-sliced log-sum-exp the engine uses, its matrix multiplications alone, and the
variants tried to cut it (the target logit from its own dot product instead of a gather per
slice; row blocks that keep each logits tile in cache; different slice widths; fused
cross-entropy over full-vocabulary row chunks, as the naive loop reads its logits).

Run from the repository root::

    python benchmarks/bench_patching.py [--n 8] [--seq-len 64] [--threads 1] [--write docs/benchmarks_patching.md]
        [--quick] [--json PATH] [--skip-tl] [--head-study]

``--quick`` is ``--n 2 --seq-len 16 --scenarios upper --components attn_out,down`` (explicit
options still win). Each table
row is also written as two comparisons, engine vs naive by wall and by CPU time (``ratio_is``
baseline/candidate: the "ratio" columns), and attribution vs the exact engine, to ``--json``
(default ``benchmarks/results/patching.json``; schema in docs/benchmarks.md).

One torch thread by default: on the shared 2-core machine two threads contend with other
processes and timings scatter; process CPU time is reported beside wall time for the same
reason.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import benchjson  # noqa: E402

COMPONENTS = ("attn_out", "gate", "up", "down", "gate_input")
SCENARIOS = ("sweep", "upper", "positions")
SPEC = "rtn:bits=3,group=64"


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _models() -> tuple[object, object]:
    import interp
    from interp.quant.apply import quantize

    reference = interp.load_model("smollm2-135m")
    return reference, quantize(reference, SPEC, progress=False)


def _prompts(model: object) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """Two 14-token prompts whose clean/corrupt versions differ in one name (IOI style)."""
    tok = model.tokenizer  # type: ignore[attr-defined]
    pairs = [("When Mary and John went to the store, John gave a drink to", " Mary", " John"),
             ("When Tom and Anna went to the park, Anna gave a ball to", " Tom", " Anna")]
    rows_clean, rows_corrupt, answers, wrongs = [], [], [], []
    for text, right, wrong in pairs:
        rows_clean.append(tok(text, add_special_tokens=False)["input_ids"])
        rows_corrupt.append(tok(text.replace(right.strip(), "Paul"), add_special_tokens=False)["input_ids"])
        answers.append(tok(right, add_special_tokens=False)["input_ids"][0])
        wrongs.append(tok(wrong, add_special_tokens=False)["input_ids"][0])
    return torch.tensor(rows_clean), torch.tensor(rows_corrupt), answers, wrongs


def child(scenario: str, method: str, args: argparse.Namespace, out: Path) -> None:
    import interp
    from interp.localize import patching

    torch.set_num_threads(args.threads)
    reference, quantized = _models()
    baseline = _peak_mib()
    cpu, wall = time.process_time(), time.perf_counter()
    if scenario == "positions":
        clean, corrupt, answers, wrongs = _prompts(reference)
        jobs = patching.position_patches("resid_pre", range(30), range(clean.shape[1]))
        metric = patching.LogitDiffMetric(answers, wrongs)
        target, source = interp.Examples.from_tokens(corrupt), interp.Examples.from_tokens(clean)
        if method == "tl":
            values = _tl_loop(reference, reference, target, jobs, source, metric, batch_size=8)
        else:
            run = patching.patch if method == "engine" else patching.patch_naive
            values = run(reference, reference, target, jobs, source_examples=source, metric=metric,
                         batch_size=8).values
    else:
        examples = interp.load_examples("wiki", reference.tokenizer, n=args.n, seq_len=args.seq_len, seed=0)
        layers = _layers(scenario, args)
        components = args.components.split(",")
        jobs = patching.single_layer_patches(components, layers)
        if method == "attribution":
            result = patching.attribution(quantized, reference, examples, components, list(layers), batch_size=args.n)
            values = result.estimates
        elif method == "tl":
            metric = patching.NLLMetric()
            values = _tl_loop(quantized, reference, examples, jobs, examples, metric, batch_size=args.n)
        else:
            run = patching.patch if method == "engine" else patching.patch_naive
            result = run(quantized, reference, examples, jobs, batch_size=args.n)
            values = result.values - result.target
    record = {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall,
              "peak_mib": _peak_mib(), "models_mib": baseline, "n_patches": int(values.shape[0])}
    save_file({"values": values.contiguous()}, str(out / f"{scenario}-{method}.safetensors"))
    (out / f"{scenario}-{method}.json").write_text(json.dumps(record))


def _layers(scenario: str, args: argparse.Namespace) -> list[int]:
    """The sweep's layers: ``--layers`` when given (e.g. ``0,8,16,24``), else 15-29 (``upper``) or 0-29."""
    if args.layers:
        return [int(x) for x in args.layers.split(",")]
    return list(range(15, 30) if scenario == "upper" else range(30))


def _tl_loop(target: Any, source: Any, examples: Any, jobs: list, source_examples: Any, metric: Any,
             batch_size: int) -> torch.Tensor:
    """transformer-lens' serial loop: ``run_with_cache`` for the source once per batch, then one
    ``run_with_hooks`` with full logits per patch (single-layer jobs). Returns ``values - target``
    for the NLL metric and ``values`` for the logit difference, as the engine's rows are compared."""
    from interp.runtime import hooks as hk

    n = len(examples.tokens)
    values = torch.empty(len(jobs), n, dtype=torch.float64)
    target_values = torch.empty(n, dtype=torch.float64)
    names = [hk.hook_point(target, job.component, job.layers[0]) for job in jobs]

    def replace(src: torch.Tensor, positions: tuple[int, ...] | None) -> Any:
        def hook(x: torch.Tensor, hook: Any) -> torch.Tensor:
            if positions is None:
                return src
            x[:, list(positions)] = src[:, list(positions)]
            return x
        return hook

    with torch.no_grad():
        for start in range(0, n, batch_size):
            tokens, index = examples.tokens[start : start + batch_size], torch.arange(start, min(start + batch_size, n))
            _, cache = source.run_with_cache(source_examples.tokens[start : start + batch_size],
                                             names_filter=lambda name: name in set(names))
            target_values[start : start + batch_size] = metric.from_logits(target(tokens), tokens, index)
            for j, (job, name) in enumerate(zip(jobs, names, strict=True)):
                logits = target.run_with_hooks(tokens, fwd_hooks=[(name, replace(cache[name], job.positions))])
                values[j, start : start + batch_size] = metric.from_logits(logits, tokens, index)
    return values if metric.name == "logit_diff" else values - target_values


def _run_child(scenario: str, method: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", scenario, method, "--out", str(out), "--n", str(args.n),
           "--components", args.components, *(["--layers", args.layers] if args.layers else []),
           "--seq-len", str(args.seq_len), "--threads", str(args.threads)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    record = json.loads((out / f"{scenario}-{method}.json").read_text())
    record["values"] = load_file(str(out / f"{scenario}-{method}.safetensors"))["values"]
    print(f"  {scenario:9s} {method:11s} {record['wall_s']:8.1f} s wall {record['cpu_s']:8.1f} s cpu", flush=True)
    return record


def _describe(scenario: str, args: argparse.Namespace) -> str:
    if scenario == "positions":
        return "clean/corrupt, resid_pre x 30 layers x 14 positions, 2 prompts"
    layers = args.layers if args.layers else ("15-29" if scenario == "upper" else "0-29")
    components = args.components.split(",")
    what = f"{len(components)} components" if len(components) == len(COMPONENTS) else "+".join(components)
    return f"{what} x layers {layers}, {args.n} ex x {args.seq_len} tok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=None, help="examples (default 8; 2 with --quick)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per example (default 64; 16 with --quick)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--components", default=None,
                        help=f"default {','.join(COMPONENTS)} (attn_out,down with --quick)")
    parser.add_argument("--layers", default=None,
                        help="sweep/upper layers, comma-separated (default 0-29 for sweep, 15-29 for upper)")
    parser.add_argument("--scenarios", default=None, help=f"default {','.join(SCENARIOS)} (upper with --quick)")
    parser.add_argument("--write", default=None, help="also write the markdown report to this file")
    parser.add_argument("--skip-tl", action="store_true", help="leave out transformer-lens' own serial loop")
    parser.add_argument("--head-study", action="store_true",
                        help="also time the engine's head alone and the variants tried to make it cheaper")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    benchjson.add_options(parser, "patching")
    args = parser.parse_args()
    for name, full, quick in (("n", 8, 2), ("seq_len", 64, 16), ("scenarios", ",".join(SCENARIOS), "upper"),
                              ("components", ",".join(COMPONENTS), "attn_out,down")):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.child:
        child(args.child[0], args.child[1], args, Path(args.out))
        return
    rows, tl_rows, attribution_line, comparisons, metrics = [], [], "", [], {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for scenario in args.scenarios.split(","):
            engine = _run_child(scenario, "engine", args, out)
            naive = _run_child(scenario, "naive", args, out)
            diff = float((engine["values"] - naive["values"]).abs().max())
            rows.append((scenario, engine, naive, diff))
            comparisons += _comparisons(scenario, engine, naive, diff, args)
            if not args.skip_tl:
                tl = _run_child(scenario, "tl", args, out)
                tl_diff = float((engine["values"] - tl["values"]).abs().max())
                tl_rows.append((scenario, engine, tl, tl_diff))
                comparisons += _comparisons(scenario, engine, tl, tl_diff, args, "transformer_lens_loop")
            if scenario == "sweep":
                attr = _run_child(scenario, "attribution", args, out)
                attribution_line, metrics["attribution_spearman"] = _attribution_line(
                    attr, engine, args.components.split(","))
                comparisons.append(benchjson.comparison(
                    "sweep: attribution vs engine (wall)", "attribution", "engine", attr["wall_s"], engine["wall_s"],
                    repeats=1, threads=args.threads, cpu_s=[attr["cpu_s"], engine["cpu_s"]]))
    head = ""
    if args.head_study:
        head, metrics["head_study"] = _head_study(args)
    report = _report(rows, tl_rows, attribution_line, head, args)
    print(report)
    if args.write:
        Path(args.write).write_text(report)
    benchjson.write(args.json, "patching", comparisons, args, metrics)


def _comparisons(scenario: str, engine: dict, naive: dict, diff: float, args: argparse.Namespace,
                 baseline: str = "naive") -> list[dict]:
    """The row's two ratios (baseline / engine, by wall and by CPU time) as ``benchjson`` comparisons."""
    extra = {"n_patches": engine["n_patches"], "max_abs_diff": diff, "description": _describe(scenario, args),
             "peak_mib": [engine["peak_mib"], naive["peak_mib"]], "models_mib": [engine["models_mib"],
                                                                               naive["models_mib"]]}
    label = "naive" if baseline == "naive" else "transformer-lens loop"
    return [benchjson.comparison(f"{scenario}: engine vs {label} ({clock})", "engine", baseline,
                                 engine[f"{clock}_s"], naive[f"{clock}_s"], repeats=1, clock=clock,
                                 threads=args.threads, **extra)
            for clock in ("wall", "cpu")]


def _sliced_nll(weight: torch.Tensor, normed: torch.Tensor, targets: torch.Tensor, step: int, block: int,
                gather: bool) -> torch.Tensor:
    """Exact NLL by vocabulary slices with a running log-sum-exp, in row blocks of ``block`` rows; the
    target logit either gathered from each slice (as the engine does) or from its own dot product."""
    import math

    rows, vocab = normed.shape[0], weight.shape[0]
    out = torch.empty(rows)
    picked = torch.zeros(rows) if gather else (normed * weight[targets]).sum(dim=1)
    for r0 in range(0, rows, block):
        x, tg = normed[r0 : r0 + block], targets[r0 : r0 + block]
        peak, total = torch.full((x.shape[0],), -math.inf), torch.zeros(x.shape[0])
        for v0 in range(0, vocab, step):
            z = torch.nn.functional.linear(x, weight[v0 : v0 + step])
            if gather:
                inside = (tg >= v0) & (tg < v0 + z.shape[1])
                picked[r0 : r0 + block][inside] = z[inside, tg[inside] - v0]
            new = torch.maximum(peak, z.amax(dim=1))
            total = total * torch.exp(peak - new) + z.sub_(new[:, None]).exp_().sum(dim=1)
            peak = new
        out[r0 : r0 + block] = peak + total.log()
    return out - picked


def _head_study(args: argparse.Namespace) -> tuple[str, dict]:
    """Time the engine's head on one stacking window (8 patches' final residuals) and the variants tried."""
    import interp
    from interp.runtime.capture import capture
    from interp.runtime.readout import Readout

    torch.set_num_threads(args.threads)
    _, quantized = _models()
    examples = interp.load_examples("wiki", quantized.tokenizer, n=args.n, seq_len=args.seq_len, seed=0)
    readout = Readout(quantized)
    if (readout.bias is not None and bool(readout.bias.any())) or readout.softcap:
        raise SystemExit("the head study assumes a head without bias or soft-capping (SmolLM2's bias is zero)")
    with torch.no_grad():
        _, final = capture(quantized, examples.tokens, [])
        stacked = final.repeat(8, 1, 1)  # one window: 8 patches x the batch, as the engine stacks them
        normed = readout.norm(stacked[:, :-1].reshape(-1, stacked.shape[-1]))
        targets = examples.tokens.repeat(8, 1)[:, 1:].reshape(-1)
    weight, rows = readout.weight.detach(), normed.shape[0]
    step = min(readout.vocab, max(256, readout.max_logits // rows))

    def gemm_only() -> torch.Tensor:
        for v0 in range(0, readout.vocab, step):
            z = torch.nn.functional.linear(normed, weight[v0 : v0 + step])
        return z

    def cross_entropy(chunk: int = 126) -> torch.Tensor:
        return torch.cat([torch.nn.functional.cross_entropy(torch.nn.functional.linear(normed[i : i + chunk], weight),
                                                            targets[i : i + chunk], reduction="none")
                          for i in range(0, rows, chunk)])

    variants = {
        f"engine head: slices of {step} logits x all {rows} rows, target gathered per slice":
            lambda: readout._nll_by_vocab_slices(normed, targets),
        "its matrix multiplications alone": gemm_only,
        "target logit from its own dot product (no gather per slice)":
            lambda: _sliced_nll(weight, normed, targets, step, rows, gather=False),
        "row blocks of 1,008 x slices of 2,048 (a 8 MiB logits tile)":
            lambda: _sliced_nll(weight, normed, targets, 2048, 1008, gather=False),
        "row blocks of 252 x slices of 4,096 (a 4 MiB tile)":
            lambda: _sliced_nll(weight, normed, targets, 4096, 252, gather=False),
        "slices of 1,024 x all rows": lambda: _sliced_nll(weight, normed, targets, 1024, rows, gather=False),
        "fused cross-entropy on full-vocabulary chunks of 126 rows (as full logits are read)": cross_entropy,
    }
    flop = 2.0 * rows * normed.shape[1] * readout.vocab
    results, reference = {}, None
    with torch.no_grad():
        for name, fn in variants.items():
            fn()  # warm-up
            best, value = min((_cpu_timed(fn) for _ in range(3)), key=lambda pair: pair[0])
            if reference is None:
                reference = value
            same_shape = value.shape == reference.shape
            results[name] = {"cpu_s": best, "gflop_per_cpu_s": flop / best / 1e9,
                             "max_abs_diff": float((value - reference).abs().max()) if same_shape else None}
            print(f"  head: {name}: {best:.2f} s cpu", flush=True)
    base = next(iter(results.values()))["cpu_s"]
    lines = ["| head variant | cpu (s) | GFLOP per cpu-second | vs engine head | max abs diff per position (nats) |",
             "|---|---:|---:|---:|---:|"]
    for name, r in results.items():
        diff = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}"
        lines.append(f"| {name} | {r['cpu_s']:.2f} | {r['gflop_per_cpu_s']:.0f} | {base / r['cpu_s']:.2f}x | {diff} |")
    return "\n".join(lines), {"rows": rows, "vocab": readout.vocab, "d_model": int(normed.shape[1]),
                               "variants": results}


def _cpu_timed(fn: Any) -> tuple[float, torch.Tensor]:
    start = time.process_time()
    value = fn()
    return time.process_time() - start, value


def _attribution_line(attr: dict, exact: dict, components: list[str]) -> tuple[str, dict]:
    from scipy.stats import spearmanr

    estimate = attr["values"].mean(dim=1).numpy()
    effect = exact["values"].mean(dim=1).numpy()
    rho = spearmanr(estimate, effect).statistic
    per_component, within = [], {}
    for i, component in enumerate(components):
        rows = slice(30 * i, 30 * (i + 1))
        within[component] = float(spearmanr(estimate[rows], effect[rows]).statistic)
        per_component.append(f"{component} {within[component]:.2f}")
    return (f"Attribution patching (one forward + backward per batch) on the `sweep` data: "
            f"{attr['wall_s']:.1f} s wall ({attr['cpu_s']:.1f} s cpu), {exact['wall_s'] / attr['wall_s']:.0f}x faster "
            f"than the exact engine; Spearman rank correlation of the {len(estimate)} estimated effects "
            f"(change in mean NLL) "
            f"with the exact ones: **{rho:.2f}** (within component, across layers: {', '.join(per_component)})."), \
        {"all": float(rho), "within_component": within}


def _non_default(args: argparse.Namespace) -> str:
    """The ``--scenarios`` / ``--components`` options of this run, when not the defaults."""
    out = ""
    if args.scenarios != ",".join(SCENARIOS):
        out += f" --scenarios {args.scenarios}"
    if args.components != ",".join(COMPONENTS):
        out += f" --components {args.components}"
    return out


def _report(rows: list, tl_rows: list, attribution_line: str, head: str, args: argparse.Namespace) -> str:
    lines = [
        "# Benchmark: patching engine vs the one-forward-per-patch loop",
        "",
        f"Output of `python benchmarks/bench_patching.py --n {args.n} --seq-len {args.seq_len} "
        f"--threads {args.threads}{_non_default(args)}` on the project's 2-core CPU VM "
        f"(timings move 5-10% run to run). torch "
        f"{torch.__version__}, {args.threads} thread(s), {platform.machine()}. Target: SmolLM2-135M with `{SPEC}` "
        "(interp.quant.quantize); source: the reference. Each run is its own process; peak memory is ru_maxrss, "
        "and \"above models\" subtracts the peak after both models were loaded.",
        "",
        "| scenario | patches | engine wall (s) | naive wall (s) | ratio wall | engine cpu (s) | naive cpu (s) "
        "| ratio cpu | max abs diff | engine peak MiB (above models) | naive peak MiB (above models) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for scenario, engine, naive, diff in rows:
        lines.append(
            f"| `{scenario}`: {_describe(scenario, args)} | {engine['n_patches']} | {engine['wall_s']:.1f} | "
            f"{naive['wall_s']:.1f} | **{naive['wall_s'] / engine['wall_s']:.2f}x** | {engine['cpu_s']:.1f} | "
            f"{naive['cpu_s']:.1f} | {naive['cpu_s'] / engine['cpu_s']:.2f}x | {diff:.1e} | "
            f"{engine['peak_mib']:.0f} ({engine['peak_mib'] - engine['models_mib']:.0f}) | "
            f"{naive['peak_mib']:.0f} ({naive['peak_mib'] - naive['models_mib']:.0f}) |")
    if tl_rows:
        lines += [
            "",
            "Against transformer-lens' own serial loop (`run_with_cache` for the source, then one `run_with_hooks`",
            "with full logits per patch), in the same run:",
            "",
            "| scenario | TL loop wall (s) | engine vs TL wall | TL loop cpu (s) | engine vs TL cpu | max abs diff |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for scenario, engine, tl, diff in tl_rows:
            lines.append(f"| `{scenario}` | {tl['wall_s']:.1f} | **{tl['wall_s'] / engine['wall_s']:.2f}x** | "
                         f"{tl['cpu_s']:.1f} | {tl['cpu_s'] / engine['cpu_s']:.2f}x | {diff:.1e} |")
    lines += ["", attribution_line, ""] if attribution_line else [""]
    lines += [
        "Where the time goes (see docs/patching.md, \"Speed\"): the engine caches the source's activations and",
        "the target's block inputs once per batch and starts each patched run at its patched layer, so a",
        "single-layer sweep over all L layers runs (L + 1) / 2 blocks per patch on average instead of L; patches",
        "with the same start layer are stacked into one forward, and patches starting higher join it at their",
        "layer. Unpatched layers run bridge-free (interp.runtime.hooks.native_model, bit-identical), "
        "and the NLL is read",
        "by vocabulary slices with a running log-sum-exp instead of full logits. The unembedding (49,152 x 576,",
        "8.0 blocks' worth of multiply-adds for SmolLM2: 28.3M against 3.54M weights a block) still runs once per",
        "patch: with equal per-block and unembedding costs the full 30-layer sweep is bounded by",
        "(30 + 8) / (15.5 + 8) = 1.6x and the upper-half sweep by (30 + 8) / (8 + 8) = 2.4x; the loop's slower",
        "full-logits head lifts both a little above that. Short prompts gain most from stacking, where per-call",
        "overhead, not arithmetic, dominates. Differences are float rounding only.",
        "",
    ]
    if head:
        lines += [
            "The engine's head alone, on one stacking window (8 patches' final residuals from the 3-bit model, "
            "best of 3, process CPU time; the matrix multiplications do 2 x rows x 576 x 49,152 flop):",
            "",
            head,
            "",
        ]
    return "\n".join(lines)

if __name__ == "__main__":
    main()
