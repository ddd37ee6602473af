"""Peak memory of ``interp score``, ``quantize``, ``patch``, ``lens`` and ``report`` against the NLL alone.

Each measured command runs in a child process of its own (a fresh interpreter, one torch
thread); its peak resident set size is the kernel's ``ru_maxrss`` for that child, read with
``os.wait4``. The baseline is a child that loads the same model and computes ``interp.nll``
on the same examples: whatever ``score`` or ``quantize`` holds beyond that is their own cost,
reported as a ratio to the size of the model's weights. Two full copies of the weights show
as ~1.0x, one copy plus a block's worth as ~0.0x.

``--code PATH`` runs the children against another checkout of interp (its folder goes first
on ``PYTHONPATH``; the child prints which ``interp`` it imported), e.g. the commit before a
change, made with ``git worktree add /tmp/before COMMIT``. Several ``--code`` options give one
column each, in the same run.

Usage:
    python benchmarks/bench_memory.py                          # this checkout
    python benchmarks/bench_memory.py --code /tmp/before --code .   # before and after, side by side
    python benchmarks/bench_memory.py --quick                  # score only, 4 x 32 tokens
    python benchmarks/bench_memory.py --check-weights          # + GPTQ in place == quantize(), every block
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import benchjson

HERE = Path(__file__).resolve().parent
SCORE_SPECS = "rtn:bits=3,group=64;nf:bits=3,group=64;rtn:bits=4,group=64"
QUANTIZE_SPEC = "gptq:bits=3,group=64"
PATCH_SPEC = "rtn:bits=3,group=64"

NLL_CHILD = """
import json, sys
import interp
model = interp.load_model(sys.argv[1])
examples = interp.load_examples("wiki", model.tokenizer, n=int(sys.argv[2]), seq_len=int(sys.argv[3]), seed=0)
interp.nll(model, examples, batch_size=8)
weights = sum(p.numel() * p.element_size() for p in model.original_model.parameters())
print(json.dumps({"weights_bytes": weights, "interp": interp.__file__}))
"""


def _child(code: Path, argv: list[str]) -> dict[str, Any]:
    """Run ``python argv`` with ``code`` first on the path; its peak RSS (bytes), wall time and last JSON line."""
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "INTERP_QUIET": "1"}
    start = os.times().elapsed
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, *argv], cwd=code, env=env, stdout=out, stderr=err, text=True)
        # reap with wait4 (not Popen.wait): it returns this child's own resource usage, ru_maxrss its peak RSS
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:3]} failed ({proc.returncode}):\n{stderr[-2000:]}")
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    record = json.loads(lines[-1]) if lines else {}
    return {"peak_bytes": usage.ru_maxrss * 1024, "seconds": os.times().elapsed - start, **record}


def _offload_map(n_layers: int) -> str:
    """Every block on disk, the embeddings, final norm and head in memory (SmolLM2's module names)."""
    placed = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    placed.update({f"model.layers.{i}": "disk" for i in range(n_layers)})
    return json.dumps(placed)


def measure(code: Path, model: str, n: int, seq_len: int, runs_wanted: list[str], calibration_n: int,
            n_layers: int) -> dict[str, Any]:
    data = ["--model", model, "--n", str(n), "--seq-len", str(seq_len), "--quiet"]
    quantize = ["-m", "interp", "quantize", *data, "--method", QUANTIZE_SPEC, "--calibration-n", str(calibration_n)]
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        commands = {
            "score": ["-m", "interp", "score", *data, "--batch-size", "8", "--methods", SCORE_SPECS,
                      "--out", f"{tmp}/score"],
            "quantize": [*quantize, "--out", f"{tmp}/quantized"],
            "quantize-offloaded": [*quantize, "--out", f"{tmp}/quantized-offloaded", "--device-map",
                                   _offload_map(n_layers), "--offload-folder", f"{tmp}/offload"],
            # the paper's table on D_large (--top 0.5: half of the examples); scoring the examples first
            # puts the quantized weights in the cache, so what the patching holds beyond them is measured
            "patch": ["-m", "interp", "patch", *data, "--batch-size", "8", "--method", PATCH_SPEC, "--top", "0.5",
                      "--experiments", "table", "--out", f"{tmp}/patch"],
            # early exit of both models on D_large and D_ctrl, and the restoration sweep on D_large
            "lens": ["-m", "interp", "lens", *data, "--batch-size", "8", "--method", PATCH_SPEC, "--top", "0.5",
                     "--out", f"{tmp}/lens"],
            # the quick report's stages that hold a quantized model (its own quick settings: 20 x 32 tokens)
            "report": ["-m", "interp", "report", "--model", model, "--quick", "--no-static", "--quiet", "--stages",
                       "norms,early_exit,restoration,patching", "--out", f"{tmp}/report"],
        }
        runs = {"nll": _child(code, ["-c", NLL_CHILD, model, str(n), str(seq_len)])}
        runs.update({name: _child(code, commands[name]) for name in runs_wanted})
    weights = runs["nll"]["weights_bytes"]
    for run in runs.values():
        run["over_nll_bytes"] = run["peak_bytes"] - runs["nll"]["peak_bytes"]
        run["over_nll_per_weights"] = run["over_nll_bytes"] / weights
    return {"code": str(code), "interp": runs["nll"]["interp"], "weights_bytes": weights, "runs": runs}


def check_weights(model_name: str, spec: str, n: int, seq_len: int) -> dict[str, Any]:
    """Whole-model check: the in-place quantizer's weights equal quantize()'s copy, every block (torch.equal)."""
    import torch

    import interp
    from interp.quant.apply import quantize
    from interp.quant.calibration import load_calibration
    from interp.quant.inplace import quantized_in_place
    from interp.quant.spec import parse_spec
    from interp.runtime import hooks

    model = interp.load_model(model_name)
    calibration = load_calibration("wiki", model.tokenizer, [parse_spec(spec)], n=n, seq_len=seq_len, seed=0)
    copied = quantize(model, spec, calibration=calibration, progress=False)
    unequal = []
    with quantized_in_place(model, spec, calibration, progress=False):
        for layer in range(hooks.n_layers(model)):
            mine, theirs = hooks.linear_weights(model, layer), hooks.linear_weights(copied, layer)
            unequal += [f"{layer}.{role}" for role in mine if not torch.equal(mine[role].read(), theirs[role].read())]
    return {"spec": spec, "calibration": [n, seq_len], "layers": hooks.n_layers(model), "unequal": unequal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", action="append", default=None,
                        help="a checkout of interp to measure (repeatable; default: this one)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--n", type=int, default=None, help="examples (default 8; 4 with --quick)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per example (default 64; 32 with --quick)")
    parser.add_argument("--calibration-n", type=int, default=32, help="calibration examples for the GPTQ run")
    parser.add_argument("--check-weights", action="store_true",
                        help="also check here that GPTQ in place gives quantize()'s weights in every block")
    parser.add_argument("--runs", default=None,
                        help="commands to measure beside nll, comma-separated: score, quantize, quantize-offloaded "
                             "(every block on disk: needs a checkout with --device-map), patch (the patching table "
                             "of interp patch on D_large, 4 of the examples), lens (early exit and restoration, same "
                             "split), report (the quick report's norms, early exit, restoration and patching "
                             "stages); default score,quantize "
                             "(score with --quick)")
    parser.add_argument("--n-layers", type=int, default=30, help="blocks of --model, for the offload map")
    benchjson.add_options(parser, "memory")
    args = parser.parse_args()
    args.n = args.n or (4 if args.quick else 8)
    args.seq_len = args.seq_len or (32 if args.quick else 64)
    codes = [Path(c).resolve() for c in (args.code or [str(HERE.parent)])]
    args.runs = args.runs or ("score" if args.quick else "score,quantize")
    wanted = [r.strip() for r in args.runs.split(",") if r.strip()]
    results = [measure(c, args.model, args.n, args.seq_len, wanted, args.calibration_n, args.n_layers) for c in codes]

    gib = 1024 ** 3
    print(f"## Peak memory ({args.model}, {args.n} x {args.seq_len} tokens; weights "
          f"{results[0]['weights_bytes'] / gib:.3f} GiB)\n")
    print("| code | command | peak RSS (GiB) | over nll (GiB) | over nll / weights | wall (s) |")
    print("|---|---|---|---|---|---|")
    for result in results:
        for name, run in result["runs"].items():
            print(f"| {result['code']} | {name} | {run['peak_bytes'] / gib:.3f} | {run['over_nll_bytes'] / gib:.3f} "
                  f"| {run['over_nll_per_weights']:.2f} | {run['seconds']:.0f} |")
    metrics: dict[str, Any] = {"score_specs": SCORE_SPECS, "quantize_spec": QUANTIZE_SPEC, "patch_spec": PATCH_SPEC,
                               "results": results}
    if args.check_weights:
        metrics["weights_check"] = check_weights(args.model, QUANTIZE_SPEC, args.calibration_n, args.seq_len)
        found = metrics["weights_check"]["unequal"]
        print(f"\nGPTQ in place vs quantize(), all {metrics['weights_check']['layers']} blocks: "
              + ("every weight equal (torch.equal)" if not found else f"{len(found)} differ: {found[:5]}"))
    benchjson.write(args.json, "memory", [], args, metrics=metrics)


if __name__ == "__main__":
    main()
