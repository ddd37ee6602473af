"""The device checks and a throughput benchmark on CUDA; exits cleanly, with a message, without a GPU.

What it runs, in order:

1. ``tests/test_device_map.py`` (the CPU device-map tests; they hold on any machine) and the
   same comparisons on CUDA: a float32 tiny llama placed whole on ``cuda:0`` and split by a
   ``device_map`` (blocks on ``cuda:0``, one block offloaded to CPU, and across ``cuda:0`` /
   ``cuda:1`` when there are two GPUs) must give the unsplit CUDA model's NLL and score errors
   exactly (same kernels, same values: the split moves weights, not arithmetic).
2. Throughput of ``interp.nll`` on SmolLM2 (batch x tokens per second, and achieved TFLOP/s
   from the model's FLOPs per token) in float32 and bfloat16 on one GPU, and in bfloat16
   with ``device_map="auto"`` over two GPUs when there are two.

Results go to ``--json`` (default ``benchmarks/results/gpu_check.json``, schema of
``benchjson.py``: the throughputs as comparisons against float32 on one GPU) and a markdown
table on stdout. Usage: ``python benchmarks/gpu_check.py [--batch 8 --seq-len 512 --repeats 5]``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchjson

ROOT = Path(__file__).resolve().parents[1]


def device_tests() -> dict[str, Any]:
    """The CPU device-map tests, then the CUDA comparisons (exact)."""
    import torch
    import transformers

    import interp
    from interp.models import tiny_tokenizer
    from interp.quant.store import score

    cpu = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_device_map.py"], cwd=ROOT,
                         capture_output=True, text=True)
    config = transformers.LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=256)
    torch.manual_seed(0)
    weights = transformers.AutoModelForCausalLM.from_config(config).state_dict()

    def fresh() -> Any:
        hf = transformers.AutoModelForCausalLM.from_config(config).eval()
        hf.load_state_dict(weights)
        return hf

    maps = {"blocks on cuda:0, block 1 on CPU": {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu",
                                                 "model.layers.2": 0, "model.norm": 0, "model.rotary_emb": 0,
                                                 "lm_head": 0}}
    if torch.cuda.device_count() >= 2:
        maps["across cuda:0 and cuda:1"] = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1,
                                            "model.layers.2": 1, "model.norm": 1, "model.rotary_emb": 1,
                                            "lm_head": 1}
    whole = interp.load_model(fresh(), tokenizer=tiny_tokenizer(), device="cuda:0")
    tokens = torch.randint(0, 256, (6, 32), generator=torch.Generator().manual_seed(1))
    tokens[:, 0] = 256
    examples = interp.Examples.from_tokens(tokens)
    expected_nll = interp.nll(whole, examples, batch_size=3)
    with tempfile.TemporaryDirectory() as tmp:
        expected_errors = score(whole, ["rtn:bits=3,group=32"], examples, store=f"{tmp}/whole", batch_size=3,
                                progress=False)
        checks = {}
        for label, device_map in maps.items():
            split = interp.load_model(fresh(), tokenizer=tiny_tokenizer(), device_map=device_map)
            errors = score(split, ["rtn:bits=3,group=32"], examples, store=f"{tmp}/{len(checks)}", batch_size=3,
                           progress=False)
            checks[label] = {
                "nll_max_abs_diff": float((interp.nll(split, examples, batch_size=3) - expected_nll).abs().max()),
                "errors_max_abs_diff": float((errors - expected_errors).abs().to_numpy().max()),
            }
    return {"cpu_tests_returncode": cpu.returncode, "cpu_tests_tail": cpu.stdout[-300:], "cuda": checks}


def throughput(label: str, model: Any, examples: Any, repeats: int) -> dict[str, Any]:
    import torch

    import interp

    interp.nll(model, examples, batch_size=len(examples))  # warm-up: kernels, allocator
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        interp.nll(model, examples, batch_size=len(examples))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    tokens = examples.tokens.numel()
    params = sum(p.numel() for p in model.original_model.parameters())
    return {"label": label, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tflops": 2 * params * tokens / seconds / 1e12}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="smollm2-135m")
    benchjson.add_options(parser, "gpu_check")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to run.")
        return 0
    import interp

    tests = device_tests()
    print(f"CPU device-map tests: exit {tests['cpu_tests_returncode']}")
    for label, diffs in tests["cuda"].items():
        print(f"CUDA, {label}: NLL max |diff| {diffs['nll_max_abs_diff']:.3g}, "
              f"score errors max |diff| {diffs['errors_max_abs_diff']:.3g} (exact expected: 0)")
    runs = []
    for dtype in ("float32", "bfloat16"):
        model = interp.load_model(args.model, dtype=dtype, device="cuda:0")
        examples = interp.load_examples("wiki", model.tokenizer, n=args.batch, seq_len=args.seq_len)
        runs.append(throughput(f"{dtype}, cuda:0", model, examples, args.repeats))
        del model
        torch.cuda.empty_cache()
    if torch.cuda.device_count() >= 2:
        model = interp.load_model(args.model, dtype="bfloat16", device_map="auto",
                                  max_memory={0: "2GiB", 1: "2GiB"} if args.model == "smollm2-135m" else None)
        runs.append(throughput("bfloat16, device_map over 2 GPUs", model, examples, args.repeats))
    print(f"\n| run ({torch.cuda.get_device_name(0)}) | tokens/s | TFLOP/s (2 x params x tokens) |\n|---|---|---|")
    for run in runs:
        print(f"| {run['label']} | {run['tokens_per_s']:.0f} | {run['tflops']:.2f} |")
    base = runs[0]
    comparisons = [benchjson.comparison(f"nll {r['label']} vs float32 cuda:0", r["label"], base["label"],
                                        r["seconds"], base["seconds"], repeats=args.repeats) for r in runs[1:]]
    benchjson.write(args.json, "gpu_check", comparisons, args, metrics={"device_tests": tests, "runs": runs})
    failed = tests["cpu_tests_returncode"] != 0 or any(v for d in tests["cuda"].values() for v in d.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
