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
measured after the two models were loaded. The naive loop is :func:`interp.patching.patch_naive`:
the source's activations cached once, then one full forward with full logits per patch,
as transformer-lens' ``patching.py`` does. Attribution patching runs on the ``sweep``
data and is compared with the exact sweep by Spearman rank correlation.

Run from the repository root::

    python benchmarks/bench_patching.py [--n 8] [--seq-len 64] [--threads 1] [--write docs/benchmarks_patching.md]

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

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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
    from interp import patching

    torch.set_num_threads(args.threads)
    reference, quantized = _models()
    baseline = _peak_mib()
    cpu, wall = time.process_time(), time.perf_counter()
    if scenario == "positions":
        clean, corrupt, answers, wrongs = _prompts(reference)
        jobs = patching.position_patches("resid_pre", range(30), range(clean.shape[1]))
        metric = patching.LogitDiffMetric(answers, wrongs)
        target, source = interp.Examples.from_tokens(corrupt), interp.Examples.from_tokens(clean)
        run = patching.patch if method == "engine" else patching.patch_naive
        result = run(reference, reference, target, jobs, source_examples=source, metric=metric, batch_size=8)
        values = result.values
    else:
        examples = interp.load_examples("wiki", reference.tokenizer, n=args.n, seq_len=args.seq_len, seed=0)
        layers = range(15, 30) if scenario == "upper" else range(30)
        jobs = patching.single_layer_patches(COMPONENTS, layers)
        if method == "attribution":
            result = patching.attribution(quantized, reference, examples, COMPONENTS, list(layers), batch_size=args.n)
            values = result.estimates
        else:
            run = patching.patch if method == "engine" else patching.patch_naive
            result = run(quantized, reference, examples, jobs, batch_size=args.n)
            values = result.values - result.target
    record = {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall,
              "peak_mib": _peak_mib(), "models_mib": baseline, "n_patches": int(values.shape[0])}
    save_file({"values": values.contiguous()}, str(out / f"{scenario}-{method}.safetensors"))
    (out / f"{scenario}-{method}.json").write_text(json.dumps(record))


def _run_child(scenario: str, method: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", scenario, method, "--out", str(out), "--n", str(args.n),
           "--seq-len", str(args.seq_len), "--threads", str(args.threads)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    record = json.loads((out / f"{scenario}-{method}.json").read_text())
    record["values"] = load_file(str(out / f"{scenario}-{method}.safetensors"))["values"]
    print(f"  {scenario:9s} {method:11s} {record['wall_s']:8.1f} s wall {record['cpu_s']:8.1f} s cpu", flush=True)
    return record


def _describe(scenario: str, args: argparse.Namespace) -> str:
    if scenario == "positions":
        return "clean/corrupt, resid_pre x 30 layers x 14 positions, 2 prompts"
    layers = "15-29" if scenario == "upper" else "0-29"
    return f"5 components x layers {layers}, {args.n} ex x {args.seq_len} tok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--write", default=None, help="also write the markdown report to this file")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args, Path(args.out))
        return
    rows, attribution_line = [], ""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for scenario in args.scenarios.split(","):
            engine = _run_child(scenario, "engine", args, out)
            naive = _run_child(scenario, "naive", args, out)
            diff = float((engine["values"] - naive["values"]).abs().max())
            rows.append((scenario, engine, naive, diff))
            if scenario == "sweep":
                attr = _run_child(scenario, "attribution", args, out)
                attribution_line = _attribution_line(attr, engine)
    report = _report(rows, attribution_line, args)
    print(report)
    if args.write:
        Path(args.write).write_text(report)


def _attribution_line(attr: dict, exact: dict) -> str:
    from scipy.stats import spearmanr

    estimate = attr["values"].mean(dim=1).numpy()
    effect = exact["values"].mean(dim=1).numpy()
    rho = spearmanr(estimate, effect).statistic
    per_component = []
    for i, component in enumerate(COMPONENTS):
        rows = slice(30 * i, 30 * (i + 1))
        per_component.append(f"{component} {spearmanr(estimate[rows], effect[rows]).statistic:.2f}")
    return (f"Attribution patching (one forward + backward per batch) on the `sweep` data: "
            f"{attr['wall_s']:.1f} s wall ({attr['cpu_s']:.1f} s cpu), {exact['wall_s'] / attr['wall_s']:.0f}x faster "
            f"than the exact engine; Spearman rank correlation of the 150 estimated effects (change in mean NLL) "
            f"with the exact ones: **{rho:.2f}** (within component, across layers: {', '.join(per_component)}).")


def _report(rows: list, attribution_line: str, args: argparse.Namespace) -> str:
    lines = [
        "# Benchmark: patching engine vs the one-forward-per-patch loop",
        "",
        f"Output of `python benchmarks/bench_patching.py --n {args.n} --seq-len {args.seq_len} "
        f"--threads {args.threads}` on the project's 2-core CPU VM (timings move 5-10% run to run). torch "
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
    lines += ["", attribution_line, ""] if attribution_line else [""]
    lines += [
        "Where the time goes (see docs/patching.md, \"Speed\"): the engine caches the source's activations and",
        "the target's block inputs once per batch and starts each patched run at its patched layer, so a",
        "single-layer sweep over all L layers runs (L + 1) / 2 blocks per patch on average instead of L; patches",
        "with the same start layer are stacked into one forward, and patches starting higher join it at their",
        "layer. Unpatched layers run bridge-free (interp.hooks.native_model, bit-identical), and the NLL is read",
        "by vocabulary slices with a running log-sum-exp instead of full logits. The unembedding (49,152 x 576,",
        "about 8 blocks' worth of multiply-adds for SmolLM2) still runs once per patch: with equal per-block and",
        "unembedding costs the full 30-layer sweep is bounded by (30 + 8) / (15.5 + 8) = 1.6x and the",
        "upper-half sweep by (30 + 8) / (8 + 8) = 2.4x; the cheaper head and blocks lift both a little above",
        "that. Short prompts gain most from stacking, where per-call overhead, not arithmetic, dominates.",
        "Differences are float rounding only.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
