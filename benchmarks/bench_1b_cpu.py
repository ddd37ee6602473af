"""Peak memory and wall time of ``interp score``, ``probe``, ``patch``, ``lens`` and ``circuit`` on a
Llama-shaped ~1B-parameter model in bfloat16, on the CPU.

The model (random weights; the shape is what costs memory and time):

- hidden 2048, 16 layers, 32 heads, 8 KV heads, head_dim 64, intermediate 8192, RMSNorm eps 1e-5,
  rope theta 500000, the bundled SmolLM2 tokenizer's vocabulary (49,152), **untied** input and
  output embeddings (as Llama-3-8B and -70B, the shapes projected to);
- every linear and embedding weight drawn from N(0, 0.05^2) (seed 0), the norms' weights 1;
- built in a child process directly in bfloat16 (no float32 copy) and saved once as a Hugging Face
  folder (safetensors + the tokenizer) under ``--cache-dir`` (default ``$INTERP_CACHE/bench-1b`` or
  ``/tmp/interp-bench-1b``), reused by later runs with the same shape.

Each command then runs as its own child process (``python -m interp CMD --model FOLDER --dtype
bfloat16 ...``) on ``--n`` examples of ``--seq-len`` tokens; its peak resident set size is the
kernel's ``ru_maxrss`` for that child (read with ``os.wait4``), its wall time the child's lifetime
(interpreter start, imports and model load included). Two reference children run the same way:
``import`` (import interp, torch, transformers and transformer-lens: the interpreter's floor) and
``load`` (``interp.load_model(FOLDER, dtype="bfloat16")`` and nothing else). The table gives each
peak over the size of the weights in bytes (goal: at most 1.2x, one copy of the weights), and the
peak above the ``load`` child's.

``--layers 16,8`` measures two depths (the second is the same model with fewer layers); the
per-layer cost is the difference over the layer difference, for time and memory, and the
projection to Llama-3-8B and Llama-3-70B shapes scales it by their per-layer weight count (see
``project``).

Usage (from the repository root)::

    python benchmarks/bench_1b_cpu.py [--layers 16,8] [--n 4] [--seq-len 64] [--threads 2]
        [--commands score,probe,patch,lens,circuit] [--json PATH] [--write PATH.md]
    python benchmarks/bench_1b_cpu.py --quick     # a 2-layer, hidden-256 model: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchjson

ROOT = Path(__file__).resolve().parents[1]
SPEC = "rtn:bits=3,group=64"
STD = 0.05
# the bundled tokenizer's clean/corrupt pair: both prompts 9 tokens, answers one token each
CIRCUIT = ["--clean", "The Eiffel Tower is in the city of", "--corrupt", "The Colosseum is in the city of",
           "--answer", " Paris", "--wrong", " Rome"]
# Llama-3 shapes for the projection (from their published config.json files)
TARGETS = {
    "Llama-3-8B": {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "head_dim": 128,
                   "intermediate": 14336, "vocab": 128256},
    "Llama-3-70B": {"hidden": 8192, "layers": 80, "heads": 64, "kv_heads": 8, "head_dim": 128,
                    "intermediate": 28672, "vocab": 128256},
}

BUILD_CHILD = r"""
import json, sys
from pathlib import Path
import torch, transformers
import interp

shape, folder = json.loads(sys.argv[1]), Path(sys.argv[2])
tokenizer = interp.load_model("smollm2-135m").tokenizer
config = transformers.LlamaConfig(
    vocab_size=len(tokenizer), hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
    num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
    num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], max_position_embeddings=2048,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config)
model = model.to_empty(device="cpu").to(torch.bfloat16)  # empty storage in bfloat16: never a float32 copy
generator = torch.Generator().manual_seed(0)
with torch.no_grad():
    for name, parameter in model.named_parameters():
        if parameter.ndim == 1:  # RMSNorm weights
            parameter.fill_(1.0)
        else:  # drawn in float32 row blocks, so the float32 transient stays small
            for start in range(0, parameter.shape[0], 1024):
                rows = parameter[start : start + 1024]
                rows.copy_(torch.randn(rows.shape, generator=generator) * shape["std"])
model.eval()
model.generation_config = transformers.GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                                        eos_token_id=tokenizer.eos_token_id)
model.save_pretrained(folder, safe_serialization=True, max_shard_size="20GB")
tokenizer.save_pretrained(folder)
params = sum(p.numel() for p in model.parameters())
per_layer = sum(p.numel() for p in model.model.layers[0].parameters())
print(json.dumps({"params": params, "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                  "params_per_layer": per_layer, "vocab": len(tokenizer)}))
"""

IMPORT_CHILD = "import interp, torch, transformers, transformer_lens; print('{}')"
LOAD_CHILD = r"""
import json, sys
import interp
model = interp.load_model(sys.argv[1], dtype="bfloat16")
print(json.dumps({"weights_bytes": sum(p.numel() * p.element_size() for p in model.original_model.parameters())}))
"""

# one value read a page (4 KiB of bfloat16): every weight resident, nothing copied
RESIDENT_CHILD = LOAD_CHILD.replace("print(", """with torch.no_grad():
    for p in model.original_model.parameters():
        p.reshape(-1)[::2048].float().sum()
print(""", 1).replace("import interp", "import interp, torch")


def shape_of(args: argparse.Namespace, layers: int) -> dict[str, Any]:
    return {"hidden": args.hidden, "layers": layers, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "intermediate": args.intermediate, "std": STD}


def params_per_layer(shape: dict[str, Any]) -> int:
    """Weights of one Llama block: q, k, v, o, gate, up, down and two RMSNorms."""
    h, q, kv = shape["hidden"], shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    return h * q * 2 + h * kv * 2 + 3 * h * shape["intermediate"] + 2 * h


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "INTERP_QUIET": "1"}


def run_child(argv: list[str], threads: int) -> dict[str, Any]:
    """Run ``python argv``; its peak RSS (bytes, ``ru_maxrss`` from ``os.wait4``), wall seconds and last JSON line."""
    child_env = {**env(), "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=child_env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: ru_maxrss is its peak RSS in KiB
        seconds = time.perf_counter() - start
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if code != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} failed ({code}):\n{stderr[-3000:]}")
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    return {"peak_bytes": usage.ru_maxrss * 1024, "wall_s": seconds,
            "cpu_s": usage.ru_utime + usage.ru_stime, **(json.loads(lines[-1]) if lines else {})}


def build(args: argparse.Namespace, layers: int) -> tuple[Path, dict[str, Any]]:
    """The model's folder, built (in a child) unless a previous run left it complete."""
    shape = shape_of(args, layers)
    tag = "h{hidden}-l{layers}-a{heads}-kv{kv_heads}-d{head_dim}-i{intermediate}-s{std}".format(**shape)
    folder = Path(args.cache_dir) / f"llama-{tag}"
    meta = folder / "bench_1b.json"
    if not meta.is_file():
        print(f"building {folder} ...", flush=True)
        tmp = folder.with_name(folder.name + ".partial")
        record = run_child(["-c", BUILD_CHILD, json.dumps(shape), str(tmp)], args.threads)
        meta_tmp = tmp / "bench_1b.json"
        meta_tmp.write_text(json.dumps({"shape": shape, **{k: record[k] for k in
                                                           ("params", "weights_bytes", "params_per_layer", "vocab")},
                                        "build_s": record["wall_s"], "build_peak_bytes": record["peak_bytes"]}))
        tmp.rename(folder)
    return folder, json.loads(meta.read_text())


def commands(folder: Path, args: argparse.Namespace, out: Path) -> dict[str, list[str]]:
    data = ["--model", str(folder), "--dtype", "bfloat16", "--n", str(args.n), "--seq-len", str(args.seq_len),
            "--batch-size", str(args.n), "--quiet"]
    threads = ["--threads", str(args.threads)]
    return {
        "import": ["-c", IMPORT_CHILD],
        "load": ["-c", LOAD_CHILD, str(folder)],
        "resident": ["-c", RESIDENT_CHILD, str(folder)],
        "score": ["-m", "interp", "score", *data, *threads, "--methods", SPEC, "--out", str(out / "score")],
        "probe": ["-m", "interp", "probe", *data, "--out", str(out / "probe")],
        # the patching table on D_large (half of the examples), upper half of the layers, 5 components
        "patch": ["-m", "interp", "patch", *data, *threads, "--method", SPEC, "--top", "0.5",
                  "--experiments", "table", "--out", str(out / "patch")],
        # early exit of both models on D_large and D_ctrl, and the restoration sweep (k = 0..L) on D_large
        "lens": ["-m", "interp", "lens", *data, *threads, "--method", SPEC, "--top", "0.5", "--out", str(out / "lens")],
        "circuit": ["-m", "interp", "circuit", "--model", str(folder), "--dtype", "bfloat16", *CIRCUIT,
                    *threads, "--out", str(out / "circuit")],
    }


def measure(args: argparse.Namespace, layers: int) -> dict[str, Any]:
    folder, meta = build(args, layers)
    weights = meta["weights_bytes"]
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-1b-", dir=args.cache_dir) as tmp:
        table = commands(folder, args, Path(tmp))
        for name in ["import", "load", "resident", *args.commands.split(",")]:
            run = run_child(table[name], args.threads)
            run["over_weights"] = run["peak_bytes"] / weights
            runs[name] = run
            print(f"  L={layers:<3d} {name:8s} peak {run['peak_bytes'] / 2**30:6.2f} GiB = "
                  f"{run['over_weights']:.3f}x weights, {run['wall_s']:7.1f} s wall, {run['cpu_s']:7.1f} s cpu",
                  flush=True)
    return {"layers": layers, "folder": str(folder), **meta, "runs": runs}


def per_layer(deep: dict[str, Any], shallow: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per command: the cost of one more block (difference over the layer difference) and the rest."""
    dl = deep["layers"] - shallow["layers"]
    out = {}
    for name, run in deep["runs"].items():
        other = shallow["runs"][name]
        mem = (run["peak_bytes"] - other["peak_bytes"]) / dl
        sec = (run["wall_s"] - other["wall_s"]) / dl
        cpu = (run["cpu_s"] - other["cpu_s"]) / dl
        out[name] = {"bytes_per_layer": mem, "s_per_layer": sec, "cpu_s_per_layer": cpu,
                     "cpu_s_fixed": run["cpu_s"] - cpu * deep["layers"],
                     "bytes_fixed": run["peak_bytes"] - mem * deep["layers"],
                     "s_fixed": run["wall_s"] - sec * deep["layers"]}
    return out


def project(measured: dict[str, Any], slopes: dict[str, dict[str, float]], args: argparse.Namespace) -> dict:
    """First-order projection of each command to the Llama-3 shapes, from the measured per-layer costs.

    Memory: the target's weights, plus what the ``resident`` child holds beyond the measured weights
    (interpreter, libraries: kept as measured), plus the command's peak above ``resident`` scaled by
    the block weight ratio. The per-layer fit shows that excess does not grow with depth (its slope
    is one block's weights), so scaling it with the block's size is the cautious side: its parts are
    one block in transit (the weight stash, a quantizer's working copy), which scale so, and tokenized
    text and logits, which scale less.
    Time: the ``import`` child's time as measured, the rest of the fixed part scaled by the
    embedding-and-head weight ratio, one block's seconds by the block weight ratio (the work is
    matrix products over the block's weights at these short sequences). Weights: the shape's
    parameter count x 2 bytes (bfloat16).
    """
    base = shape_of(args, measured["layers"])
    base_layer = params_per_layer(base)
    base_outer = 2 * measured["vocab"] * args.hidden
    floor = measured["runs"]["import"]
    # every weight resident and nothing else: its excess over the weights (interpreter, libraries) is kept as is
    resident = measured["runs"].get("resident", measured["runs"]["load"])["peak_bytes"]
    resident_floor = resident - measured["weights_bytes"]
    result = {}
    for target, shape in TARGETS.items():
        layer_ratio = params_per_layer(shape) / base_layer
        outer = 2 * shape["vocab"] * shape["hidden"]
        params = params_per_layer(shape) * shape["layers"] + outer + shape["hidden"]
        weights = params * 2
        rows = {}
        for name, s in slopes.items():
            if name == "import":
                continue
            peak = resident_floor + weights + (measured["runs"][name]["peak_bytes"] - resident) * layer_ratio
            wall = (floor["wall_s"] + max(s["s_fixed"] - floor["wall_s"], 0.0) * outer / base_outer
                    + s["s_per_layer"] * layer_ratio * shape["layers"])
            cpu = (floor["cpu_s"] + max(s["cpu_s_fixed"] - floor["cpu_s"], 0.0) * outer / base_outer
                   + s["cpu_s_per_layer"] * layer_ratio * shape["layers"])
            rows[name] = {"peak_bytes": peak, "over_weights": peak / weights, "wall_s": wall, "cpu_s": cpu}
        result[target] = {"params": params, "weights_bytes": weights, "layer_ratio": layer_ratio, "commands": rows}
    return result


def report(results: list[dict[str, Any]], slopes: dict | None, projection: dict | None,
           args: argparse.Namespace) -> str:
    gib = 2**30
    lines = [f"Model: Llama-shaped, hidden {args.hidden}, {args.heads} heads ({args.kv_heads} KV) of {args.head_dim}, "
             f"intermediate {args.intermediate}, vocabulary {results[0]['vocab']:,}, untied embeddings, random weights "
             f"N(0, {STD}^2), bfloat16; {args.n} examples x {args.seq_len} tokens (batch {args.n}), "
             f"`{SPEC}` for score/patch/lens, {args.threads} thread(s).", ""]
    for res in results:
        lines += [f"{res['layers']} layers: {res['params'] / 1e9:.3f}B parameters, weights "
                  f"{res['weights_bytes'] / gib:.2f} GiB ({res['weights_bytes']:,} bytes).", "",
                  "| command | peak RSS (GiB) | peak / weights | above `resident` (GiB) | above `resident` / weights "
                  "| wall (s) | cpu (s) |", "|---|---:|---:|---:|---:|---:|---:|"]
        floor = res["runs"].get("resident", res["runs"]["load"])["peak_bytes"]
        for name, run in res["runs"].items():
            flag = "" if name in ("import", "load", "resident") or run["over_weights"] <= 1.2 else " (over 1.2x)"
            lines.append(f"| `{name}` | {run['peak_bytes'] / gib:.2f} | **{run['over_weights']:.3f}x**{flag} | "
                         f"{(run['peak_bytes'] - floor) / gib:+.2f} | "
                         f"{(run['peak_bytes'] - floor) / res['weights_bytes']:+.3f}x"
                         f" | {run['wall_s']:.1f} | {run['cpu_s']:.1f} |")
        lines.append("")
    if slopes:
        deep, shallow = results[0]["layers"], results[1]["layers"]
        lines += [f"Per layer ({deep} vs {shallow} layers; one block has {results[0]['params_per_layer'] / 1e6:.1f}M "
                  f"weights = {results[0]['params_per_layer'] * 2 / 2**20:.0f} MiB in bfloat16):", "",
                  "| command | peak MiB per layer | fixed peak (GiB) | wall s per layer | fixed wall s "
                  "| cpu s per layer | fixed cpu s |", "|---|---:|---:|---:|---:|---:|---:|"]
        for name, s in slopes.items():
            lines.append(f"| `{name}` | {s['bytes_per_layer'] / 2**20:.0f} | {s['bytes_fixed'] / gib:.2f} | "
                         f"{s['s_per_layer']:.2f} | {s['s_fixed']:.1f} | {s['cpu_s_per_layer']:.2f} | "
                         f"{s['cpu_s_fixed']:.1f} |")
        lines.append("")
    if projection:
        lines += ["Projected (first order, from the per-layer costs above; see `project` in the script):", "",
                  "| command | " + " | ".join(f"{t} peak (GiB) | {t} peak / weights | {t} cpu (s)" for t in projection)
                  + " |", "|---|" + "---:|---:|---:|" * len(projection)]
        names = next(iter(projection.values()))["commands"]
        for name in names:
            cells = []
            for proj in projection.values():
                row = proj["commands"][name]
                cells.append(f"{row['peak_bytes'] / gib:.1f} | {row['over_weights']:.3f}x | {row['cpu_s']:.0f}")
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
        lines += ["", "Weights: " + ", ".join(f"{t} {p['params'] / 1e9:.2f}B parameters = "
                                          f"{p['weights_bytes'] / gib:.1f} "
                                          f"GiB, a block {p['layer_ratio']:.2f}x the measured one"
                                          for t, p in projection.items()) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default=None, help="depths to measure, comma-separated (default 16,8; 2,1 quick)")
    parser.add_argument("--hidden", type=int, default=None, help="default 2048 (256 with --quick)")
    parser.add_argument("--heads", type=int, default=None, help="default 32 (4 with --quick)")
    parser.add_argument("--kv-heads", type=int, default=None, help="default 8 (2 with --quick)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=None, help="default 8192 (1024 with --quick)")
    parser.add_argument("--n", type=int, default=4, help="examples (default 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per example (default 64; 16 with --quick)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--commands", default="score,probe,patch,lens,circuit")
    parser.add_argument("--cache-dir", default=None,
                        help="where the model folders are saved "
                             "(default $INTERP_CACHE/bench-1b or /tmp/interp-bench-1b)")
    parser.add_argument("--write", default=None, help="also write the markdown tables to this file")
    parser.add_argument("--report-from", default=None,
                        help="no runs: rebuild the tables, per-layer fit and projection from this JSON result")
    benchjson.add_options(parser, "1b_cpu")
    args = parser.parse_args()
    for name, full, quick in (("layers", "16,8", "2,1"), ("hidden", 2048, 256), ("heads", 32, 4), ("kv_heads", 8, 2),
                              ("intermediate", 8192, 1024), ("seq_len", 64, 16)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.cache_dir is None:
        base = os.environ.get("INTERP_CACHE")
        args.cache_dir = str(Path(base) / "bench-1b") if base else "/tmp/interp-bench-1b"
    Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
    depths = [int(x) for x in args.layers.split(",")]
    if args.report_from:  # the measured runs of an earlier result, with this script's fit and tables
        saved = json.loads(Path(args.report_from).read_text())
        for key in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "n", "seq_len", "threads"):
            setattr(args, key, saved["settings"][key])
        args.layers, args.quick = saved["settings"]["layers"], saved["quick"]
        results = [{**model, "runs": saved["metrics"]["runs"][str(model["layers"])]}
                   for model in saved["metrics"]["models"]]
    else:
        results = [measure(args, layers) for layers in depths]
    slopes = per_layer(results[0], results[1]) if len(results) > 1 else None
    projection = project(results[0], slopes, args) if slopes else None
    text = report(results, slopes, projection, args)
    print(text)
    if args.write:
        Path(args.write).write_text(text)
    # ratio_is candidate/baseline: peak / weights, so a growth shows as a regression in check_regression.py
    comparisons = [benchjson.comparison(f"L={res['layers']} {name}: peak RSS / weights", name, "weights",
                                        run["peak_bytes"] / 2**30, res["weights_bytes"] / 2**30, repeats=1,
                                        ratio_is="candidate/baseline", clock="memory", threads=args.threads,
                                        wall_s=run["wall_s"], cpu_s=run["cpu_s"])
                   for res in results for name, run in res["runs"].items() if name != "import"]
    metrics = {"models": [{k: v for k, v in res.items() if k != "runs"} for res in results],
               "runs": {str(res["layers"]): res["runs"] for res in results},
               "per_layer": slopes, "projection": projection, "targets": TARGETS}
    benchjson.write(args.json, "1b_cpu", comparisons, args, metrics)


if __name__ == "__main__":
    main()
