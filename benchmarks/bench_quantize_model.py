"""Time whole-model quantization of the default report's nine specs, per layer, against a baseline.

Each variant runs in a fresh process (``--child``) that loads the model and the calibration
examples, then calls ``interp.quant.apply.quantize`` for every spec, one after another, and
reports for each: process CPU time and wall time, the per-layer breakdown the quantized
model's ``quant_info`` records (calibration forwards and each linear role), and a SHA-256 of
every quantized block weight, so that the variants can be checked to give the same model.

Variants:

- ``after``: this checkout.
- ``before``: another checkout of interp (``--before DIR``, e.g. a ``git worktree`` of the
  commit before a change), run with ``PYTHONPATH=DIR``.
- ``rerun``: this checkout with the calibration inputs taken by re-running each block from its
  start for every group of linear layers (the scheme before the paused forward), the default
  baseline when no ``--before`` is given.

Run from the repository root, one torch thread (another job may use the other core)::

    OMP_NUM_THREADS=1 python benchmarks/bench_quantize_model.py [--before /tmp/quant-before] [--rounds 1]
        [--quick] [--json PATH]

``--quick`` uses a random SmolLM2-shaped model with 2 layers (``interp.tiny_model`` with
d_model 576, d_mlp 1536, 9 heads, 3 key/value heads) and 8 calibration rows of 64 tokens,
instead of SmolLM2-135M's 30 layers and the report's 32 rows of 128 tokens. The comparisons
(``ratio_is`` candidate/baseline: after / baseline, lower is faster) go to ``--json``
(default ``benchmarks/results/quantize_model.json``; schema in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

import benchjson  # noqa: E402  # beside this script; interp itself comes from the environment or PYTHONPATH

# the report's default methods (interp/report/context.py, DEFAULT_METHODS)
SPECS = ("rtn:bits=3,group=64", "rtn:bits=4,group=64", "nf:bits=3,group=64", "nf:bits=4,group=64",
         "gptq:bits=3,group=64", "gptq:bits=4,group=64", "awq:bits=3,group=64", "awq:bits=4,group=64",
         "hqq:bits=3,group=64")
ROLES = ("q", "k", "v", "o", "gate", "up", "down")
QUICK_MODEL = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3}


# ---------------------------------------------------------------------------------------
# Child: quantize every spec in this process (runs under either checkout)


def _weights_digest(qmodel: Any) -> str:
    from interp.runtime import hooks

    digest = hashlib.sha256()
    for layer in range(hooks.n_layers(qmodel)):
        for role, slot in sorted(hooks.linear_weights(qmodel, layer).items()):
            digest.update(f"{layer}.{role}".encode())
            digest.update(slot.read().detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _quick_model_folder() -> Path:
    """A random SmolLM2-shaped llama with 2 layers, saved once as a Hugging Face folder (seeded: same weights)."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from interp.models import TINY_VOCAB, tiny_tokenizer

    folder = Path(tempfile.gettempdir()) / "interp-bench-quantize-model"
    if not (folder / "config.json").is_file():
        config = LlamaConfig(vocab_size=TINY_VOCAB, num_hidden_layers=2, max_position_embeddings=256,
                             bos_token_id=256, eos_token_id=257, pad_token_id=258, tie_word_embeddings=True,
                             **QUICK_MODEL)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
    return folder


def child(args: argparse.Namespace) -> None:
    import torch

    import interp
    from interp.quant import apply as qa

    torch.set_num_threads(args.threads)
    if args.rerun:
        from interp.quant import calibration

        original = calibration.LayerFeeder.__init__

        def rerun_init(self: Any, *a: Any, **k: Any) -> None:
            original(self, *a, **k)
            self.pauses = False  # never pause: re-run each block from its start for every group

        calibration.LayerFeeder.__init__ = rerun_init  # type: ignore[method-assign]
    if args.quick:
        model = interp.load_model(_quick_model_folder())
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 256, (args.calibration_n, args.seq_len), generator=g)
        calibration_rows = interp.Examples.from_tokens(tokens)
    else:
        model = interp.load_model(args.model)
        calibration_rows = interp.load_examples("wiki", model.tokenizer, n=args.calibration_n, seq_len=args.seq_len,
                                                seed=0, split="calibration")
    for spec in args.specs.split(";"):
        wall, cpu = time.perf_counter(), time.process_time()
        qmodel = qa.quantize(model, spec, calibration=calibration_rows, progress=False, batch_size=8)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        info = qmodel.quant_info
        print(json.dumps({"spec": spec, "cpu_s": cpu, "wall_s": wall, "layers": len(info.layer_seconds),
                          "calibration_s": info.calibration_seconds, "role_s": info.role_seconds,
                          "digest": _weights_digest(qmodel)}), flush=True)
        del qmodel


# ---------------------------------------------------------------------------------------
# Parent: run the variants, compare, print markdown


def run_variant(name: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--threads", str(args.threads),
               "--model", args.model, "--calibration-n", str(args.calibration_n), "--seq-len", str(args.seq_len),
               "--specs", ";".join(args.spec_list)] + (["--quick"] if args.quick else [])
    if name == "before":
        env["PYTHONPATH"] = str(Path(args.before).resolve())
    if name == "rerun":
        command.append("--rerun")
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd="/" if name == "before" else REPO)
    if done.returncode != 0:
        raise SystemExit(f"variant {name} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {row["spec"]: row for row in rows}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def profile_table(rows: dict[str, dict[str, Any]], label: str) -> list[str]:
    """Seconds per layer by part, in CPU seconds: quant_info's wall-clock parts scaled by the spec's CPU/wall."""
    lines = [f"\nPer layer, {label} (CPU seconds per layer; calibration = the block forwards that produce the "
             "layers' inputs, the rest is quantize_weight per role):\n",
             "| spec | total | calibration | " + " | ".join(ROLES) + " |",
             "|---|---:|---:|" + "---:|" * len(ROLES)]
    for spec, row in rows.items():
        layers = max(1, row["layers"])
        scale = row["cpu_s"] / row["wall_s"] / layers
        parts = [row["calibration_s"] * scale] + [row["role_s"].get(role, 0.0) * scale for role in ROLES]
        lines.append(f"| `{spec}` | {row['cpu_s'] / layers:.3f} | " + " | ".join(f"{p:.3f}" for p in parts) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--calibration-n", type=int, default=None, help="calibration rows (default 32; quick 8)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 128; quick 64)")
    parser.add_argument("--specs", default=";".join(SPECS), help="';'-separated specs (default: the report's nine)")
    parser.add_argument("--before", default=None, help="a checkout of interp to time as the baseline 'before'")
    parser.add_argument("--baselines", default=None,
                        help="comma-separated from before, rerun (default: before when --before is given, else rerun)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each variant, alternating their order")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rerun", action="store_true", help=argparse.SUPPRESS)
    benchjson.add_options(parser, "quantize_model")
    args = parser.parse_args()
    args.calibration_n = args.calibration_n or (8 if args.quick else 32)
    args.seq_len = args.seq_len or (64 if args.quick else 128)
    if args.child:
        child(args)
        return
    args.spec_list = args.specs.split(";")
    baselines = (args.baselines or ("before" if args.before else "rerun")).split(",")
    if "before" in baselines and not args.before:
        raise SystemExit("--baselines before needs --before DIR")
    variants = ["after", *baselines]
    runs: dict[str, list[dict[str, dict[str, Any]]]] = {name: [] for name in variants}
    for round_index in range(args.rounds):
        shift = round_index % len(variants)
        for name in variants[shift:] + variants[:shift]:
            runs[name].append(run_variant(name, args))
    model = "random SmolLM2-shaped, 2 layers" if args.quick else args.model
    print(f"{model}; calibration {args.calibration_n} x {args.seq_len} tokens, batch 8; {args.threads} thread(s); "
          f"{args.rounds} round(s), median; CPU = process time of each spec's quantize(), wall = elapsed\n")
    comparisons = []
    metrics: dict[str, Any] = {"digests_equal": {}}
    for baseline in baselines:
        print(f"| spec | after CPU s | {baseline} CPU s | after/{baseline} | after wall s | {baseline} wall s | "
              "same weights |")
        print("|---|---:|---:|---:|---:|---:|---|")
        totals = {"after": [0.0, 0.0], baseline: [0.0, 0.0]}
        for spec in args.spec_list:
            cpu = {v: _median([r[spec]["cpu_s"] for r in runs[v]]) for v in ("after", baseline)}
            wall = {v: _median([r[spec]["wall_s"] for r in runs[v]]) for v in ("after", baseline)}
            same = all(r[spec]["digest"] == runs["after"][0][spec]["digest"] for r in runs[baseline] + runs["after"])
            metrics["digests_equal"][f"{spec} vs {baseline}"] = same
            for v in totals:
                totals[v][0] += cpu[v]
                totals[v][1] += wall[v]
            print(f"| `{spec}` | {cpu['after']:.1f} | {cpu[baseline]:.1f} | {cpu['after'] / cpu[baseline]:.2f} | "
                  f"{wall['after']:.1f} | {wall[baseline]:.1f} | {'yes' if same else 'NO'} |")
            comparisons.append(benchjson.comparison(f"{spec} after vs {baseline}", "after", baseline, cpu["after"],
                                                    cpu[baseline], repeats=args.rounds, ratio_is="candidate/baseline",
                                                    clock="cpu", threads=args.threads))
        (a_cpu, a_wall), (b_cpu, b_wall) = totals["after"], totals[baseline]
        print(f"| **all {len(args.spec_list)}** | {a_cpu:.1f} | {b_cpu:.1f} | **{a_cpu / b_cpu:.2f}** | {a_wall:.1f} | "
              f"{b_wall:.1f} | |\n")
        comparisons.append(benchjson.comparison(f"all specs after vs {baseline}", "after", baseline, a_cpu, b_cpu,
                                                repeats=args.rounds, ratio_is="candidate/baseline", clock="cpu",
                                                threads=args.threads, wall_after_s=a_wall, wall_baseline_s=b_wall))
    for name in variants:
        print("\n".join(profile_table(runs[name][0], name)))
    metrics["runs"] = runs
    benchjson.write(args.json, "quantize_model", comparisons, args, metrics)


if __name__ == "__main__":
    main()
