"""The GPU acceptance run (issue 44): correctness on CUDA against the CPU, and throughput on a 1B-shaped model.

One script, four steps, meant to end within 8 minutes on one H200:

1. **The device suite on CUDA**: ``pytest --device cuda -m device_suite tests/test_device_suite.py
   tests/test_quant_device.py``: every public API function and every CLI command on the GPU in bfloat16 and
   float32 and with a device map offloading a block to the CPU, each against the CPU float32 result within a
   tolerance derived from the dtype (see that module's docstring), and the quantizers computing on the weight's
   device. Per-test results come from a JUnit XML file.
2. **The five quantizers on a real-shaped model, CUDA against CPU**: a random-weight model of SmolLM2-135M's
   widths (hidden 576, 9 heads, 3 KV heads, MLP 1536; ``--quant-layers`` blocks) quantized by ``interp.quantize``
   with every registered method (rtn, nf, hqq when the ``hqq`` package imports, else reported missing, gptq,
   awq; the calibrated ones on random calibration rows) once on the GPU and once on the CPU. The tolerance is
   derived, not chosen: running the same arithmetic on another device changes each intermediate by about one
   rounding, so the CPU run is repeated on a copy whose every weight moved by one float32 unit roundoff
   (``w * (1 + 2^-24 s)``, ``s`` a random sign), and the GPU's distance from the CPU result must lie within 4x that
   self-distance, plus one quantization level of the coarsest group (the change a single weight on a rounding
   boundary makes). Distances are relative Frobenius norms over all block weights.
3. **The CLI's placement options on the GPU**: every command that takes ``--device-map`` run with
   ``--device-map auto`` and a ``--max-memory`` that leaves at least one block to the CPU (checked on the loaded
   model first), against its CPU float32 run; ``interp score`` and ``interp probe`` under ``torchrun`` with one
   rank per GPU (``--device cuda``), against one process on the CPU. ``--device cuda`` with ``--dtype bfloat16``
   for every command is step 1's.
4. **Throughput in bfloat16** on a Llama-shaped model of about 1B parameters (hidden 2048, 16 layers, 32 heads,
   8 KV heads, head_dim 64, MLP 8192, the SmolLM2 tokenizer's vocabulary, tied embeddings, weights normal with
   std 0.05), as ratios to a bare Hugging Face forward of the same 16 x 512 batch in the same run (medians of
   ``--repeats``, round-robin): ``interp.nll`` (target <= 1.05x), ``interp.probe`` of ``resid_post`` norms at
   every layer (<= 1.10x), ``interp.eap`` over every head and MLP into the logits (<= 3.4x), a 64-run patching
   sweep (16 layers x 4 components) against ``patch_naive`` (>= 3x faster), and GPTQ-4 of the whole model timed,
   with the evidence of where it ran: process CPU time against wall time, and a profile of the widest weight's
   quantization alone (the down projection) giving its device kernel time against its wall time and the reads of
   device values it makes. Tokens/s and achieved TFLOP/s (forward FLOPs:
   2 x matmul parameters + 2 x layers x positions x d_model for the causal attention, per token) are recorded
   with ``torch.cuda.get_device_name()``. A ratio that misses its target gets a profile of the slow call (the
   top operators by device time) in the results.

Writes ``--json`` (default ``benchmarks/results/gpu_check.json``, schema of ``benchjson.py``) and a markdown
table (``--markdown``, default ``benchmarks/results/gpu_check.md``, also printed). Exit status 1 when a
correctness check fails (the suite, a quantizer, a command); the throughput ratios are measurements and do not
change it.

Usage: ``python benchmarks/gpu_check.py`` on a machine with CUDA (without one it says so and exits 0);
``python benchmarks/gpu_check.py --dry-run`` runs every step on the CPU with tiny sizes, to check the script.
``--tokenizer DIR`` gives the SmolLM2 tokenizer folder (``--save-tokenizer DIR`` writes it from the bundled model
on a machine that has it); without it the vocabulary size is SmolLM2's 49152 and a byte tokenizer names tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import benchjson

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_VOCAB = 49152
U32 = 2.0**-24


@dataclass(frozen=True)
class Sizes:
    """Everything the steps size: the real run's, or the dry run's tiny ones."""

    quant_hidden: int = 576
    quant_heads: int = 9
    quant_kv_heads: int = 3
    quant_mlp: int = 1536
    quant_layers: int = 4
    quant_vocab: int = SMOLLM2_VOCAB
    quant_group: int = 64
    calibration_rows: int = 16
    calibration_len: int = 256
    hidden: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    mlp: int = 8192
    batch: int = 16
    seq_len: int = 512
    patch_components: tuple[str, ...] = ("resid_mid", "resid_post", "attn_out", "down")
    gptq_group: int = 128
    gptq_rows: int = 16


TINY = Sizes(quant_hidden=64, quant_heads=4, quant_kv_heads=2, quant_mlp=128, quant_layers=2, quant_vocab=259,
             quant_group=32, calibration_rows=4, calibration_len=32, hidden=64, layers=2, heads=4, kv_heads=2,
             head_dim=16, mlp=128, batch=2, seq_len=32, gptq_group=32, gptq_rows=4)
TARGETS = {"nll": ("<=", 1.05), "probe": ("<=", 1.10), "eap": ("<=", 3.4), "patching": (">=", 3.0)}


# -- shared pieces -------------------------------------------------------------------------------------------------


def synchronize(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: Any) -> Callable[[], Any]:
    """``fn`` followed by a device synchronisation, so a wall clock around it counts the device's work."""
    def run() -> Any:
        out = fn()
        synchronize(device)
        return out

    return run


def random_llama(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, mlp: int, vocab: int,
                 device: str, dtype: Any, std: float = 0.05, seed: int = 0) -> Any:
    """A Llama-shaped ``LlamaForCausalLM`` made on ``device``, weights normal(0, std) (norms 1), tied embeddings."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=0,
                         eos_token_id=1, pad_token_id=2)
    config.architectures = ["LlamaForCausalLM"]
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.to(dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, std, generator=generator)
    return model.eval()


def tokenizer_for(args: argparse.Namespace) -> tuple[Any, int]:
    """(tokenizer, vocabulary size) for the real-shaped models."""
    from interp.models import tiny_tokenizer

    if args.dry_run:
        return tiny_tokenizer(), TINY.quant_vocab
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        return tokenizer, len(tokenizer)
    return tiny_tokenizer(), SMOLLM2_VOCAB


def random_rows(n: int, seq_len: int, vocab: int, seed: int) -> Any:
    import torch

    import interp

    tokens = torch.randint(3, vocab, (n, seq_len), generator=torch.Generator().manual_seed(seed))
    tokens[:, 0] = 0  # BOS
    return interp.Examples.from_tokens(tokens)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def suite_module() -> Any:
    """tests/test_device_suite.py, imported: its tiny model folder, CLI commands, comparisons and tolerance."""
    sys.path.insert(0, str(ROOT / "tests"))
    import test_device_suite

    return test_device_suite


# -- step 1: the device suite ------------------------------------------------------------------------------------


def step_suite(device: str, work: Path) -> dict[str, Any]:
    junit = work / "suite.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--device", device, "-m", "device_suite",
           "tests/test_device_suite.py", "tests/test_quant_device.py", f"--junitxml={junit}"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if device == "cpu" else "8")}
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    tests: dict[str, str] = {}
    if junit.is_file():
        for case in ElementTree.parse(junit).getroot().iter("testcase"):
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = child.tag
            tests[f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"] = outcome
    failed = sorted(name for name, outcome in tests.items() if outcome in ("failure", "error"))
    return {"command": " ".join(cmd[2:]), "returncode": done.returncode, "seconds": seconds, "tests": tests,
            "n_tests": len(tests), "failed": failed, "skipped": sorted(n for n, o in tests.items() if o == "skipped"),
            "tail": (done.stdout + done.stderr)[-3000:], "ok": done.returncode == 0 and bool(tests)}


# -- step 2: the five quantizers, device against CPU ---------------------------------------------------------------


def _block_weights(model: Any) -> dict[str, Any]:
    from interp.runtime import hooks

    return {f"{layer}.{role}": slot.read().detach().float().cpu()
            for layer in range(hooks.n_layers(model)) for role, slot in hooks.linear_weights(model, layer).items()}


def _relative_distance(a: dict[str, Any], b: dict[str, Any]) -> float:
    import torch

    num = sum(float(torch.linalg.norm(a[k].double() - b[k].double()) ** 2) for k in b)
    den = sum(float(torch.linalg.norm(b[k].double()) ** 2) for k in b)
    return math.sqrt(num / den)


def _level_floor(weights: dict[str, Any], bits: int, group: int) -> float:
    """One quantization level of the widest group, relative to the weights' Frobenius norm: what a single weight
    that rounds to the other side of a level boundary changes."""
    import torch

    widest = max(float((w.reshape(w.shape[0], -1, group).amax(-1) - w.reshape(w.shape[0], -1, group).amin(-1)).max())
                 for w in weights.values())
    norm = math.sqrt(sum(float(torch.linalg.norm(w.double()) ** 2) for w in weights.values()))
    return widest / (2**bits - 1) / norm


def step_quantizers(device: str, sizes: Sizes, args: argparse.Namespace) -> dict[str, Any]:
    import importlib.util

    import torch

    import interp
    from interp.quant.spec import METHODS

    tokenizer, vocab = tokenizer_for(args)
    vocab = min(vocab, sizes.quant_vocab) if args.dry_run else vocab

    def build(where: str, perturb: bool = False) -> Any:
        hf = random_llama(sizes.quant_hidden, sizes.quant_layers, sizes.quant_heads, sizes.quant_kv_heads,
                          sizes.quant_hidden // sizes.quant_heads, sizes.quant_mlp, vocab, "cpu", torch.float32)
        if perturb:  # every weight one float32 rounding away: w (1 + u s), s a random sign
            generator = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for parameter in hf.parameters():
                    signs = torch.randint(0, 2, parameter.shape, generator=generator) * 2 - 1
                    parameter.mul_(1 + U32 * signs)
        return interp.load_model(hf.to(where), tokenizer=tokenizer, name=f"real-shaped-{where}")

    calibration = random_rows(sizes.calibration_rows, sizes.calibration_len, vocab, seed=2)
    reference_cpu, perturbed_cpu, on_device = build("cpu"), build("cpu", perturb=True), build(device)
    results: dict[str, Any] = {}
    for method in sorted(METHODS, key=lambda m: METHODS[m].report_rank):
        if method == "hqq" and importlib.util.find_spec("hqq") is None:
            results[method] = {"status": "missing", "ok": None,
                               "why": "the hqq package does not import here (no wheel for this platform)"}
            continue
        bits = 4 if 4 in METHODS[method].bits else max(METHODS[method].bits)
        spec = f"{method}:bits={bits},group={sizes.quant_group}"
        cal = calibration if METHODS[method].needs_calibration else None
        timings = {}
        quantized = {}
        for label, model in (("cpu", reference_cpu), ("cpu, perturbed", perturbed_cpu), (device, on_device)):
            synchronize(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            q = interp.quantize(model, spec, calibration=cal, progress=False)
            synchronize(device)
            timings[label] = {"wall_s": time.perf_counter() - start, "process_cpu_s": time.process_time() - cpu_start}
            quantized[label] = _block_weights(q)
            del q
        on_dev = quantized[device]
        assert all(t.device.type == "cpu" for t in on_dev.values())
        distance = _relative_distance(on_dev, quantized["cpu"])
        self_distance = _relative_distance(quantized["cpu, perturbed"], quantized["cpu"])
        floor = _level_floor(_block_weights(reference_cpu), bits, sizes.quant_group)
        tolerance = 4 * self_distance + floor
        results[method] = {"status": "run", "spec": spec, "distance": distance, "cpu_self_distance": self_distance,
                           "one_level": floor, "tolerance": tolerance, "ok": distance <= tolerance,
                           "timings": timings}
    return {"model": asdict(sizes) | {"vocab": vocab}, "methods": results,
            "ok": all(r["ok"] is not False for r in results.values())}


# -- step 3: --device-map auto and torchrun ------------------------------------------------------------------------


def _auto_map_memory(folder: Path, device: str) -> tuple[dict[Any, str], list[int]]:
    """A --max-memory under which ``device_map="auto"`` keeps the embedding on the device but offloads at least one
    block (to the CPU next to a GPU; to disk on a CPU-only machine), and the blocks it offloads (checked on the model
    loaded that way).

    accelerate reserves room for the largest block on the device once anything is offloaded, so the budget is
    found by asking its planner (``infer_auto_device_map``) for the largest budget that offloads something."""
    import torch
    from accelerate import infer_auto_device_map, init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    import interp
    from interp.runtime import placement

    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    empty.tie_weights()
    total = sum(p.numel() * p.element_size() for p in empty.parameters())
    main_device: Any = 0 if torch.device(device).type == "cuda" else "cpu"
    spill = "cpu" if main_device == 0 else "disk"
    chosen = None
    for percent in range(99, 20, -2):
        budget = int(total * percent / 100)
        plan = infer_auto_device_map(empty, max_memory={main_device: budget, spill: 10**13},
                                     no_split_module_classes=empty._no_split_modules)
        if plan.get("model.embed_tokens") == main_device and any(
                v == spill for k, v in plan.items() if k.startswith("model.layers")):
            chosen = budget
            break
    if chosen is None:
        raise RuntimeError(f"no --max-memory budget makes device_map='auto' offload a block of {folder}")
    limits: dict[Any, str] = {main_device: f"{max(1, chosen // 1000)}KB"}  # accelerate reads units, not bare bytes
    if spill == "cpu":
        limits["cpu"] = "64GiB"
    with tempfile.TemporaryDirectory() as offload:  # a copy: the loader rewrites the sizes it is given in place
        mapped = interp.load_model(str(folder), device_map="auto", max_memory=dict(limits), offload_folder=offload)
        offloaded = placement.offloaded_layers(mapped)
    return limits, offloaded


def step_cli(device: str, work: Path, dry_run: bool) -> dict[str, Any]:
    import torch

    suite = suite_module()
    folder = suite._saved_tiny(work / "tiny")
    docs = work / "docs.txt"
    words = [" ".join(f"word{(i * 7 + j) % 23}" for j in range(12)) for i in range(120)]
    docs.write_text("\n\n".join(f"Document {i}: {w}" for i, w in enumerate(words)) + "\n")
    reference = suite.CliReference(work / "cpu-float32", folder, docs)
    limits, offloaded = _auto_map_memory(folder, device)
    memory = ",".join(f"{k}={v}" for k, v in limits.items())
    runs: dict[str, Any] = {}
    for name, command in suite.COMMANDS.items():
        if not command.device_map:
            runs[name] = {"ok": None, "why": "takes no --device-map (its --device run is step 1's)"}
            continue
        out = work / f"auto-{name}"
        argv = [*command.args(folder, docs, out), "--device-map", "auto", "--max-memory", memory,
                "--offload-folder", str(work / f"offload-{name}")]
        try:
            suite.run_cli(argv)
            gaps = suite.check(command.compare(out), command.compare(reference.out(name)), "float32")
            runs[name] = {"ok": True, "largest_gap": max(gaps.values(), default=0.0)}
        except Exception as exc:  # noqa: BLE001 - reported (a mismatch or a crash), the next command still runs
            runs[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    ranks = torch.cuda.device_count() if torch.device(device).type == "cuda" else 2
    distributed = {}
    launcher = work / "launch_interp.py"  # torchrun would read interp's own options (--n ...) as its own
    launcher.write_text("import json, sys\nfrom interp.cli.main import main\n"
                        "sys.exit(main(json.loads(open(sys.argv[1]).read())))\n")
    for name in ("score",) if dry_run else ("score", "probe"):  # the dry run starts one job (seconds of imports)
        command = suite.COMMANDS[name]
        out = work / f"torchrun-{name}"
        where = ["--device", "cuda"] if torch.device(device).type == "cuda" else []
        argv_file = work / f"torchrun-{name}.json"
        argv_file.write_text(json.dumps([*command.args(folder, docs, out), *where]))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), str(launcher), str(argv_file)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        env.pop("WORLD_SIZE", None)
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
        record: dict[str, Any] = {"ranks": ranks, "returncode": done.returncode}
        if done.returncode == 0:
            try:
                gaps = suite.check(command.compare(out), command.compare(reference.out(name)), "float32")
                record.update(ok=True, largest_gap=max(gaps.values(), default=0.0))
            except AssertionError as exc:
                record.update(ok=False, error=str(exc)[:2000])
        else:
            record.update(ok=False, error=(done.stdout + done.stderr)[-2000:])
        distributed[name] = record
    ok = bool(offloaded) and all(r["ok"] is not False for r in runs.values()) and all(
        r["ok"] for r in distributed.values())
    return {"max_memory": limits, "offloaded_blocks": offloaded, "device_map_auto": runs, "torchrun": distributed,
            "ok": ok}


# -- step 4: throughput ------------------------------------------------------------------------------------------


def _profile(fn: Callable[[], Any], device: str, rows: int = 15) -> dict[str, Any]:
    """One call of ``fn`` under torch.profiler: the top operators by device (or CPU) time, and host copies."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    device_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events) \
        if cuda else 0.0
    copies = [e for e in events if "Memcpy DtoH" in e.key or "aten::_local_scalar_dense" in e.key
              or e.key == "aten::item"]
    return {"wall_s": wall, "device_kernel_s": device_us / 1e6, "device_busy_fraction": device_us / 1e6 / wall,
            "host_reads": {e.key: e.count for e in copies},
            "table": events.table(sort_by=sort, row_limit=rows)}


def step_throughput(device: str, sizes: Sizes, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import interp
    from interp.localize.patching import Patch
    from interp.localize.patching.engine import patch_naive

    dtype = torch.bfloat16
    tokenizer, vocab = tokenizer_for(args)
    hf = random_llama(sizes.hidden, sizes.layers, sizes.heads, sizes.kv_heads, sizes.head_dim, sizes.mlp, vocab,
                      device, dtype)
    config = {k: getattr(hf.config, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                                  "head_dim", "tie_word_embeddings")}
    params = sum(p.numel() for p in hf.parameters())
    model = interp.load_model(hf, tokenizer=tokenizer, name="llama-1b-shaped")
    examples = random_rows(sizes.batch, sizes.seq_len, vocab, seed=3)
    tokens = examples.tokens.to(device)
    corrupt_tokens = examples.tokens.clone()
    corrupt_tokens[:, -4:] = torch.randint(3, vocab, (sizes.batch, 4), generator=torch.Generator().manual_seed(4))
    corrupt = interp.Examples.from_tokens(corrupt_tokens)
    answer, wrong = 5, 6
    n_tokens = sizes.batch * sizes.seq_len
    # tied embeddings: the one matrix costs nothing as a lookup and 2 x vocab x hidden as the unembedding, so
    # every parameter is a matmul parameter once; causal attention adds 2 x seq_len x heads x head_dim per layer
    flops_per_token = 2 * params + 2 * sizes.layers * sizes.seq_len * sizes.heads * sizes.head_dim

    def bare() -> Any:
        with torch.inference_mode():
            return hf(input_ids=tokens, use_cache=False).logits

    calls: dict[str, Callable[[], Any]] = {
        "bare HF forward": bare,
        "nll": lambda: interp.nll(model, examples, batch_size=sizes.batch),
        "probe": lambda: interp.probe(model, examples, ["resid_post"], ["norm"], batch_size=sizes.batch,
                                      progress=False),
        "eap": lambda: interp.eap(model, examples, corrupt, answer, wrong, batch_size=sizes.batch),
    }
    medians, _ = benchjson.round_robin({k: timed(v, device) for k, v in calls.items()}, args.repeats)
    base = medians["bare HF forward"]
    rows: dict[str, Any] = {}
    for name, seconds in medians.items():
        rows[name] = {"seconds": seconds, "ratio": seconds / base, "tokens_per_s": n_tokens / seconds,
                      "tflops": flops_per_token * n_tokens / seconds / 1e12 if name != "eap" else None}
    # the patching sweep: the reference's components patched into an RTN-4 copy, 64 runs (16 layers x 4 components)
    target = interp.quantize(model, f"rtn:bits=4,group={sizes.gptq_group}", progress=False)
    patches = [Patch(component, (layer,)) for layer in range(sizes.layers) for component in sizes.patch_components]
    sweep = {"patch": lambda: interp.patch(target, model, examples, patches, batch_size=sizes.batch, progress=False),
             "patch_naive": lambda: patch_naive(target, model, examples, patches, batch_size=sizes.batch)}
    sweep_medians, sweep_results = benchjson.round_robin({k: timed(v, device) for k, v in sweep.items()},
                                                         max(1, args.repeats // 3))
    agree = float((sweep_results["patch"].values - sweep_results["patch_naive"].values).abs().max())
    rows["patching"] = {"seconds": sweep_medians["patch"], "naive_seconds": sweep_medians["patch_naive"],
                        "ratio": sweep_medians["patch_naive"] / sweep_medians["patch"], "runs": len(patches),
                        "max_abs_diff_vs_naive": agree}
    # GPTQ-4 of the whole model, and where it ran
    calibration = random_rows(sizes.gptq_rows, sizes.seq_len, vocab, seed=5)
    spec = f"gptq:bits=4,group={sizes.gptq_group}"
    synchronize(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    quantized = interp.quantize(model, spec, calibration=calibration, progress=False)
    synchronize(device)
    gptq = {"spec": spec, "wall_s": time.perf_counter() - start, "process_cpu_s": time.process_time() - cpu_start,
            "calibration_tokens": sizes.gptq_rows * sizes.seq_len}
    gptq["weights_on"] = str(next(quantized.original_model.parameters()).device)
    del quantized
    # where the work ran, on the widest weight alone (the down projection, d_in = MLP width): a profile of one
    # quantize_weight call, its device kernel time against its wall time and the reads it makes of device values
    from interp.quant import quantize_weight

    generator = torch.Generator(device=device).manual_seed(6)
    weight = (torch.randn(sizes.hidden, sizes.mlp, generator=generator, device=device) * 0.05).to(dtype)
    inputs = torch.randn(sizes.gptq_rows * sizes.seq_len, sizes.mlp, generator=generator, device=device).to(dtype)
    quantize_weight(weight, spec, inputs)  # warm-up
    gptq["down_projection_profile"] = _profile(lambda: quantize_weight(weight, spec, inputs), device)
    gptq["down_projection_shape"] = [sizes.hidden, sizes.mlp]
    verdicts = {}
    for name, (sense, target_ratio) in TARGETS.items():
        ratio = rows[name]["ratio"]
        met = ratio <= target_ratio if sense == "<=" else ratio >= target_ratio
        verdicts[name] = {"ratio": ratio, "target": f"{sense} {target_ratio}", "met": met}
        if not met and not args.no_profile:
            call = sweep["patch"] if name == "patching" else calls[name]
            rows[name]["profile"] = _profile(call, device)
    return {"device_name": torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu",
            "config": config, "parameters": params, "batch": [sizes.batch, sizes.seq_len], "dtype": "bfloat16",
            "flops_per_token": flops_per_token, "rows": rows, "verdicts": verdicts, "gptq": gptq}


# -- the run -----------------------------------------------------------------------------------------------------


def markdown(results: dict[str, Any]) -> str:
    dry = ", DRY RUN on the CPU" if results["dry_run"] else ""
    lines = [f"# GPU acceptance run ({results['device_name']}, {results['date']}{dry})",
             "", "| step | check | result | target | verdict |", "|---|---|---|---|---|"]

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("pass" if ok else "**FAIL**")

    suite = results["steps"].get("suite")
    if suite:
        counts = {o: sum(1 for v in suite["tests"].values() if v == o) for o in ("passed", "failure", "error",
                                                                                   "skipped")}
        lines.append(f"| 1 | device suite ({suite['n_tests']} tests) | {counts} in {suite['seconds']:.0f} s | all pass "
                     f"| {verdict(suite['ok'])} |")
    quant = results["steps"].get("quantizers")
    if quant:
        for method, r in quant["methods"].items():
            if r["status"] == "missing":
                lines.append(f"| 2 | {method} | missing: {r['why']} | - | n/a |")
                continue
            times = ", ".join(f"{k} {v['wall_s']:.1f} s" for k, v in r["timings"].items())
            lines.append(f"| 2 | {r['spec']}: device vs CPU distance | {r['distance']:.3g} (CPU self "
                         f"{r['cpu_self_distance']:.3g}; {times}) | <= {r['tolerance']:.3g} | {verdict(r['ok'])} |")
    cli = results["steps"].get("cli")
    if cli:
        lines.append(f"| 3 | --device-map auto, --max-memory {cli['max_memory']} | blocks offloaded: "
                     f"{cli['offloaded_blocks']} | >= 1 block | {verdict(bool(cli['offloaded_blocks']))} |")
        for name, r in cli["device_map_auto"].items():
            got = r.get("why") or r.get("error") or f"largest gap {r['largest_gap']:.2g}"
            lines.append(f"| 3 | interp {name} --device-map auto | {str(got)[:120]} | float32 tol | "
                         f"{verdict(r['ok'])} |")
        for name, r in cli["torchrun"].items():
            got = r.get("error", f"largest gap {r.get('largest_gap', 0):.2g}")
            lines.append(f"| 3 | torchrun {r['ranks']} rank(s): interp {name} | {str(got)[:120]} | float32 tol | "
                         f"{verdict(r['ok'])} |")
    through = results["steps"].get("throughput")
    if through:
        for name, r in through["rows"].items():
            target = through["verdicts"].get(name, {})
            tflops = f", {r['tflops']:.1f} TFLOP/s" if r.get("tflops") else ""
            speed = f", {r['tokens_per_s']:.0f} tok/s" if r.get("tokens_per_s") else ""
            shown = (f"{r['ratio']:.2f}x faster than patch_naive ({r['seconds']:.2f} s vs {r['naive_seconds']:.2f} s)"
                     if name == "patching" else f"{r['ratio']:.3f}x ({r['seconds'] * 1e3:.1f} ms{speed}{tflops})")
            met = target.get("met")
            lines.append(f"| 4 | {name} | {shown} | {target.get('target', '-')} | "
                         f"{'n/a' if met is None else ('met' if met else '**missed**')} |")
        g = through["gptq"]
        prof = g["down_projection_profile"]
        lines.append(f"| 4 | {g['spec']}, whole model | {g['wall_s']:.1f} s wall, {g['process_cpu_s']:.1f} s process "
                     f"CPU; one {g['down_projection_shape']} weight: device kernels {prof['device_kernel_s']:.2f} s of "
                     f"{prof['wall_s']:.2f} s, host reads {sum(prof['host_reads'].values())} | on the device | - |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="every step on the CPU with tiny sizes (checks the script; no GPU needed)")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --dry-run)")
    parser.add_argument("--steps", default="suite,quantizers,cli,throughput",
                        help="comma-separated subset of: suite, quantizers, cli, throughput")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per variant (default 7; 2 dry)")
    parser.add_argument("--quant-layers", type=int, default=None, help="blocks of the real-shaped quantizer model")
    parser.add_argument("--tokenizer", default=None, help="the SmolLM2 tokenizer folder (vocabulary and tokens)")
    parser.add_argument("--save-tokenizer", default=None, metavar="DIR",
                        help="write the bundled SmolLM2 tokenizer to DIR (on a machine that has it) and exit")
    parser.add_argument("--no-profile", action="store_true", help="no profile of a ratio that misses its target")
    parser.add_argument("--markdown", default=str(benchjson.DEFAULT_DIR / "gpu_check.md"))
    benchjson.add_options(parser, "gpu_check")
    args = parser.parse_args()
    import torch

    if args.save_tokenizer:
        import interp

        interp.load_model("smollm2-135m").tokenizer.save_pretrained(args.save_tokenizer)
        print(f"gpu_check: SmolLM2 tokenizer written to {args.save_tokenizer}")
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to run. "
              "Use --dry-run to run every step on the CPU with tiny sizes.")
        return 0
    device = args.device or ("cpu" if args.dry_run else "cuda")
    sizes = TINY if args.dry_run else Sizes()
    if args.quant_layers:
        sizes = Sizes(**{**asdict(sizes), "quant_layers": args.quant_layers})
    args.repeats = args.repeats or (2 if args.dry_run else 7)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 comparisons in IEEE float32 (the derivations assume it)
    torch.backends.cudnn.allow_tf32 = False
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    results: dict[str, Any] = {"dry_run": args.dry_run, "device": device, "date": benchjson.now(),
                               "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                               "torch": torch.__version__, "steps": {}, "step_seconds": {}}
    runners = {"suite": lambda work: step_suite(device, work),
               "quantizers": lambda work: step_quantizers(device, sizes, args),
               "cli": lambda work: step_cli(device, work, args.dry_run),
               "throughput": lambda work: step_throughput(device, sizes, args)}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for step in steps:
            start = time.perf_counter()
            print(f"gpu_check: step {step} ...", flush=True)
            try:
                results["steps"][step] = runners[step](Path(tmp) / step)
            except Exception as exc:  # noqa: BLE001 - one failed step is reported; the others still run
                import traceback

                results["steps"][step] = {"ok": False, "error": traceback.format_exc()[-4000:]}
                print(f"gpu_check: step {step} raised {type(exc).__name__}: {exc}", flush=True)
            results["step_seconds"][step] = time.perf_counter() - start
            print(f"gpu_check: step {step} done in {results['step_seconds'][step]:.0f} s", flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    table = markdown(results) if all("error" not in r for r in results["steps"].values()) else json.dumps(
        {k: v.get("error", "ok") for k, v in results["steps"].items()}, indent=1)
    print(table)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(table)
    comparisons = []
    through = results["steps"].get("throughput", {})
    for name, row in through.get("rows", {}).items():
        if name == "bare HF forward":
            continue
        if name == "patching":
            comparisons.append(benchjson.comparison("patching sweep vs patch_naive", "patch", "patch_naive",
                                                    row["seconds"], row["naive_seconds"], repeats=args.repeats))
        else:
            comparisons.append(benchjson.comparison(f"{name} vs bare HF forward", name, "bare HF forward",
                                                    row["seconds"], through["rows"]["bare HF forward"]["seconds"],
                                                    repeats=args.repeats, ratio_is="candidate/baseline"))
    benchjson.write(args.json, "gpu_check", comparisons, args, metrics=results)
    failed = [step for step, r in results["steps"].items() if r.get("ok") is False]
    print(f"gpu_check: {'all correctness checks passed' if not failed else 'FAILED: ' + ', '.join(failed)} "
          f"({sum(results['step_seconds'].values()):.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
