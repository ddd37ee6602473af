"""Pre-registered run: interp's bit plan against llama.cpp's own mixes at equal file size (issue 34).

Follows ``docs/preregistration/llama-cpp-plans-2.json`` (read here, never edited):

1. ``llama-quantize`` makes the F32 reference from the bundled GGUF, the mixes (Q4_K_M, Q3_K_M,
   Q4_K_S) and one ``--pure`` file per candidate type (the weights each option would store).
2. For each calibration seed, :func:`interp.quant.fisher.fisher_sensitivity` scores every block
   linear weight at every candidate type with llama.cpp's own dequantized weights, and
   :func:`interp.quant.prescribe.choose_options` picks the types with the least summed score
   whose bytes fit in each mix's block-weight bytes. ``llama-quantize MIX --tensor-type-file``
   writes the plan's GGUF; its file must be at most the mix's file (bytes from the files).
3. Every GGUF is scored on the 256 held-out examples by llama.cpp's own kernels (its Python
   bindings, logits of every position): per-example mean KL(reference || quant) and NLL.
4. interp's GGUF loader scores the first 16 held-out examples of some files for comparison.
5. ``analyse`` judges the registered verdicts and writes ``docs/data/prescribe/llama-cpp/``.

Every phase writes its result as it finishes, so a killed run resumes where it stopped.

A registration with an ``imatrix`` entry (``llama-cpp-plans-4``) takes another path
(:func:`main_imatrix`): ``interp imatrix``'s matrix of the calibration split, and every file,
mixes and registration 3's unchanged plans, made by ``llama-quantize --imatrix`` with it.

    LLAMA_CPP_BIN=/path/to/build/bin PYTHONPATH=/path/with/llama_cpp \
        python benchmarks/llama_cpp_plans.py --registration llama-cpp-plans-3

``LLAMA_CPP_BIN`` holds ``llama-quantize`` and ``libllama.so`` (built with ``-DGGML_NATIVE=OFF``;
see docs/prescribe.md); the ``llama_cpp`` Python package must import (``LLAMA_CPP_LIB_PATH`` is
set to ``LLAMA_CPP_BIN``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import interp  # noqa: E402
from interp.data import load_examples  # noqa: E402
from interp.io import sanitize, write_json  # noqa: E402
from interp.quant.fisher import fisher_sensitivity  # noqa: E402
from interp.quant.llama_cpp import TENSOR_ROLES, gguf_block_weights, tensor_bytes, write_tensor_types  # noqa: E402
from interp.quant.llama_cpp_run import block_bytes, block_types, fit_to_size, rounding_of  # noqa: E402
from interp.quant.llama_cpp_run import quantize as run_quantize  # noqa: E402
from interp.quant.prescribe import choose_options  # noqa: E402
from interp.quant.shapes import WeightShape  # noqa: E402
from interp.report.confirm import fresh_examples  # noqa: E402
from interp.runtime.scoring import model_logits  # noqa: E402
from interp.stats import crossed_bootstrap  # noqa: E402

PREREG = ROOT / "docs" / "preregistration"
DATA = ROOT / "docs" / "data" / "prescribe" / "llama-cpp"
MIXES = ("Q4_K_M", "Q3_K_M", "Q4_K_S")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def registration(name: str) -> tuple[dict[str, Any], str]:
    raw = (PREREG / f"{name}.json").read_bytes()
    return json.loads(raw), hashlib.sha256(raw).hexdigest()


def quantize(binary: Path, src: Path, dst: Path, mix: str, *extra: str, imatrix: Path | None = None) -> None:
    """``llama-quantize`` through interp (the file whole or absent; ``imatrix`` as
    :func:`interp.quant.llama_cpp_run.quantize` takes it), skipped when ``dst`` exists."""
    if not dst.exists():
        run_quantize(binary, src, dst, mix, *extra, imatrix=imatrix)


def mixes(reg: dict[str, Any]) -> tuple[str, ...]:
    """The llama.cpp mixes a registration makes and scores (registrations 2-5: Q4_K_M, Q3_K_M, Q4_K_S)."""
    return tuple(reg.get("mixes", MIXES))


def phase_files(run: Path, binary: Path, reg: dict[str, Any]) -> dict[str, Path]:
    gguf_dir = run / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    from interp.models import _bundled_gguf

    ref = gguf_dir / "ref-f32.gguf"
    quantize(binary, _bundled_gguf(reg["model"]), ref, "F32", "--allow-requantize")
    files = {"reference": ref}
    for mix in mixes(reg):
        files[mix] = gguf_dir / f"{mix}.gguf"
        quantize(binary, ref, files[mix], mix)
    for ggml_type in reg["candidate_types"]:
        files[f"pure-{ggml_type}"] = gguf_dir / f"pure-{ggml_type}.gguf"
        quantize(binary, ref, files[f"pure-{ggml_type}"], ggml_type.upper(), "--pure")
    return files


def phase_sensitivity(run: Path, files: dict[str, Path], reg: dict[str, Any], model: Any, chunks: int = 8
                      ) -> dict[int, Any]:
    from safetensors.numpy import load_file, save_file

    cal = reg["calibration"]
    pure: dict[str, Any] = {}
    out = {}
    for seed in cal["seeds"]:
        path = run / f"sensitivity-{seed}.safetensors"
        if not path.exists():
            rows = load_examples(cal["data"], model.tokenizer, n=cal["n"], seq_len=cal["seq_len"], seed=seed,
                                 split=cal["split"])

            if not pure:
                pure.update({t: gguf_block_weights(files[f"pure-{t}"]) for t in reg["candidate_types"]})
            options = rounding_of(pure)  # each type where llama.cpp stores it as asked (its block divides the width)
            log(f"Fisher sensitivity, calibration seed {seed}")
            result = fisher_sensitivity(model, rows, options, chunks=chunks, batch_size=8, seed=seed, progress=False)
            meta = {"layers": result.layers, "roles": result.roles, "options": result.options,
                    "settings": result.settings, "ids": rows.ids}
            save_file({"per_chunk": result.per_chunk, "tokens": result.tokens}, str(path.with_suffix(".tmp")))
            write_json(path.with_suffix(".json"), sanitize(meta))
            path.with_suffix(".tmp").replace(path)
            log(f"  {result.settings['seconds']:.0f} s")
        arrays = load_file(str(path))
        out[seed] = {**json.loads(path.with_suffix(".json").read_text()), **arrays}
    return out


def option_table(sens: dict[str, Any], shapes: dict[tuple[int, str], tuple[int, int]], candidates: list[str],
                 scores: np.ndarray) -> tuple[list[tuple[int, str]], list[list[str]], list[Any], list[list[int]]]:
    """Per weight: its key, its candidate types, their ``scores`` rows (``scores[w, o]``, a number or an array)
    and their bytes."""
    keys, allowed, losses, costs = [], [], [], []
    for w, (layer, role, opts) in enumerate(zip(sens["layers"], sens["roles"], sens["options"], strict=True)):
        keep = [o for o, t in enumerate(opts) if t in candidates]
        keys.append((layer, role))
        allowed.append([opts[o] for o in keep])
        losses.append(scores[w, keep])
        costs.append([tensor_bytes(opts[o], *shapes[layer, role]) for o in keep])
    return keys, allowed, losses, costs


def plan_types(sens: dict[str, Any], shapes: dict[tuple[int, str], tuple[int, int]], capacity: int,
               candidates: list[str]) -> dict[tuple[int, str], str]:
    """The registered allocation: the least summed sensitivity whose block-weight bytes fit ``capacity``."""
    scores = sens["per_chunk"].sum(axis=2) / sens["tokens"].sum()
    keys, allowed, losses, costs = option_table(sens, shapes, candidates, scores)
    chosen = choose_options([[float(x) for x in row] for row in losses], costs, capacity,
                            unit=max(1, capacity // 50000))
    return {key: allowed[w][o] for w, (key, o) in enumerate(zip(keys, chosen, strict=True))}


def predicted(sens: dict[str, Any], types: dict[tuple[int, str], str]) -> float:
    scores = sens["per_chunk"].sum(axis=2) / sens["tokens"].sum()
    total = 0.0
    for w, (layer, role, opts) in enumerate(zip(sens["layers"], sens["roles"], sens["options"], strict=True)):
        t = types[layer, role]
        total += float(scores[w, opts.index(t)]) if t in opts else float("nan")
    return total


def write_plan(run: Path, binary: Path, files: dict[str, Path], name: str, size: str,
               shapes: dict[tuple[int, str], tuple[int, int]],
               choose: Callable[[int], dict[tuple[int, str], str]]) -> Path:
    """``llama-quantize SIZE --tensor-type-file`` of the types ``choose(capacity)`` gives for the mix's block-weight
    bytes. When alignment padding makes the file larger than the mix's, the excess comes off the capacity and the
    plan is chosen again (the registered equal-size rule)."""
    path = run / "gguf" / f"{name}.gguf"
    if path.exists():  # an earlier (killed) run's
        return path

    def write(types: dict[tuple[int, str], str]) -> Path:
        type_file = run / f"{name}.txt"
        order = sorted(types)
        write_tensor_types(type_file, [WeightShape(layer, role, *shapes[layer, role]) for layer, role in order],
                           {f"{layer}.{role}": types[layer, role] for layer, role in order})
        return run_quantize(binary, files["reference"], path, size, "--tensor-type-file", str(type_file))

    fit_to_size(choose, write, block_bytes(files[size]), files[size].stat().st_size,
                lambda slack: log(f"{name} was {slack} bytes over; again with less"))
    return path


def reference_shapes(files: dict[str, Path]) -> dict[tuple[int, str], tuple[int, int]]:
    return {key: value.shape for key, (_, value) in gguf_block_weights(files["reference"]).items()}


def phase_plans(run: Path, binary: Path, files: dict[str, Path], reg: dict[str, Any], sens: dict[int, Any]
                ) -> dict[str, Path]:
    shapes = reference_shapes(files)
    plans = {}
    for size in reg["sizes"]:
        for seed, s in sens.items():
            name = f"plan-{size}-{seed}"
            plans[name] = write_plan(run, binary, files, name, size, shapes, lambda capacity, s=s:
                                     plan_types(s, shapes, capacity, reg["candidate_types"]))
            log(f"{name}: {plans[name].stat().st_size} bytes (mix {files[size].stat().st_size})")
    return plans


def score_llama_cpp(run: Path, files: dict[str, Path], rows: torch.Tensor, names: list[str], binary: Path) -> None:
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(binary))
    from llama_cpp import Llama

    todo = [n for n in names if not (run / "scores" / f"{n}.parquet").exists()]
    if not todo:
        return
    (run / "scores").mkdir(exist_ok=True)
    threads = int(os.environ.get("LLAMA_THREADS", "2"))

    def load(path: Path) -> Any:
        return Llama(model_path=str(path), n_ctx=rows.shape[1], n_batch=rows.shape[1], n_threads=threads,
                     n_threads_batch=threads, logits_all=True, verbose=False)

    ref = load(files["reference"])
    models = {n: load(files[n]) for n in todo}
    out: dict[str, list[tuple[float, float]]] = {n: [] for n in todo}
    ref_nll = []
    start = time.perf_counter()
    def logprobs(llm: Any, row: list[int]) -> np.ndarray:
        llm.reset()
        llm.eval(row)
        logits = torch.from_numpy(np.asarray(llm.scores[:len(row) - 1], dtype=np.float64))
        return torch.log_softmax(logits, dim=1).numpy()  # float64; 262k-way rows (Gemma) in a fraction of a second

    for i, row in enumerate(rows.tolist()):
        lp_ref = logprobs(ref, row)
        targets = np.asarray(row[1:])
        ref_nll.append(float(-lp_ref[np.arange(len(targets)), targets].mean()))
        p_ref = np.exp(lp_ref)
        for n, llm in models.items():
            lp = logprobs(llm, row)
            kl = float((p_ref * (lp_ref - lp)).sum(axis=1).mean())
            out[n].append((kl, float(-lp[np.arange(len(targets)), targets].mean())))
        if i % 32 == 31:
            log(f"  llama.cpp scoring: {i + 1} examples, {time.perf_counter() - start:.0f} s")
    for n in todo:
        frame = pd.DataFrame(out[n], columns=["kl", "nll"])
        frame["ref_nll"] = ref_nll
        frame["bytes"] = files[n].stat().st_size
        frame.to_parquet(run / "scores" / f"{n}.parquet")


def score_interp(run: Path, files: dict[str, Path], rows: torch.Tensor, names: list[str]) -> None:
    path = run / "scores" / "interp-loader.parquet"
    if path.exists():
        return
    records = []
    parts = [rows[i:i + 4] for i in range(0, len(rows), 4)]  # float64 log-probabilities of 4 x 127 x 262k: 1 GiB
    ref = interp.load_model(str(files["reference"]))
    with torch.no_grad():
        logits_ref = [model_logits(ref, part)[:, :-1] for part in parts]
    del ref
    for n in names:
        model = interp.load_model(str(files[n]))
        i = 0
        for part, logit_ref in zip(parts, logits_ref, strict=True):
            with torch.no_grad():
                lp_ref = torch.log_softmax(logit_ref.double(), -1)
                lp = torch.log_softmax(model_logits(model, part)[:, :-1].double(), -1)
            kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).mean(-1)
            nll = -lp.gather(-1, part[:, 1:, None])[..., 0].mean(-1)
            records += [(n, i + j, float(kl[j]), float(nll[j])) for j in range(len(part))]
            i += len(part)
        del model
    pd.DataFrame(records, columns=["file", "example", "kl", "nll"]).to_parquet(path)


def judge(low: float, high: float) -> str:
    """The registered verdict of a relative reduction's interval."""
    if low >= 0.10:
        return "beats by at least 10% (issue 34's goal)"
    if low > 0:
        return "beats"
    if high < 0:
        return "loses"
    return "not resolved"


def compare(mix: pd.DataFrame, plans: list[pd.DataFrame], n_boot: int) -> dict[str, Any]:
    """The registered comparison of the seeds' plans with one mix, on the shared held-out examples."""

    def crossed(column: str, tail: bool = False) -> Any:
        def statistic(plan: pd.DataFrame, rows: np.ndarray) -> np.ndarray:
            a, b = plan[column].to_numpy()[rows], mix[column].to_numpy()[rows]
            if column == "nll":  # the NLL increases over the reference, plan minus mix
                return (a - plan["ref_nll"].to_numpy()[rows]).mean(-1) - (b - mix["ref_nll"].to_numpy()[rows]).mean(-1)
            if tail:  # each file's own worst 10%
                k = max(1, int(round(0.1 * rows.shape[-1])))
                a, b = np.sort(a, -1)[..., -k:], np.sort(b, -1)[..., -k:]
            return 1 - a.mean(-1) / b.mean(-1)

        return crossed_bootstrap(plans, statistic, len(mix), n_boot=n_boot, seed=0)

    primary = crossed("kl")
    est = primary.estimate
    nll, tail = crossed("nll").estimate, crossed("kl", tail=True).estimate
    return {
        "primary": {"statistic": "relative reduction of mean KL, plan vs mix", "estimate": est.value, "low": est.low,
                    "high": est.high, "per_seed": list(primary.per_instance), "between_seed_sd": primary.between_sd,
                    "verdict": judge(est.low, est.high)},
        "mean_kl": {"mix": float(mix.kl.mean()), "plans": [float(p.kl.mean()) for p in plans]},
        "bytes": {"mix": int(mix.bytes.iloc[0]), "plans": [int(p.bytes.iloc[0]) for p in plans]},
        "nll_difference": {"estimate": nll.value, "low": nll.low, "high": nll.high,
                           "meaning": "plan minus mix, mean NLL increase over the reference (nats)"},
        "tail": {"estimate": tail.value, "low": tail.low, "high": tail.high,
                 "meaning": "relative reduction of the mean KL over each file's worst 10%"},
    }


def analyse(run: Path, reg: dict[str, Any], sha: str, sens: dict[int, Any], files: dict[str, Path]) -> dict[str, Any]:
    scores = {p.stem: pd.read_parquet(p) for p in (run / "scores").glob("*.parquet") if p.stem != "interp-loader"}
    verdicts = {size: compare(scores[size], [scores[f"plan-{size}-{seed}"] for seed in sens], reg["n_boot"])
                for size in reg["sizes"]}
    # additivity: predicted (summed sensitivity, seed-averaged) against realized mean KL, every scored file
    additivity = []
    for name, frame in scores.items():
        types = {(int(k.split(".")[1]), TENSOR_ROLES[k.split(".")[2]]): t
                 for k, (t, _) in block_types(files[name]).items()}
        guesses = [predicted(s, types) for s in sens.values()]
        additivity.append({"file": name, "bytes": int(frame.bytes.iloc[0]), "realized_kl": float(frame.kl.mean()),
                           "predicted_kl": float(np.nanmean(guesses)), "realized_nll_increase":
                           float((frame.nll - frame.ref_nll).mean())})
    return {"registration": reg["name"], "registration_sha256": sha, "verdicts": verdicts, "additivity": additivity,
            "reliability": reliability(next(iter(sens.values())), reg),
            "loader_agreement": loader_agreement(run, scores),
            "sensitivity_seconds": {str(k): v["settings"]["seconds"] for k, v in sens.items()},
            "environment": environment()}


def reliability(first: dict[str, Any], reg: dict[str, Any]) -> dict[str, Any]:
    """Split-half Spearman of the first seed's sensitivity: the registered one, and within each type."""
    from interp.quant.sensitivity import split_half

    flat = first["per_chunk"].reshape(-1, first["per_chunk"].shape[-1])
    flat = flat[np.isfinite(flat).all(axis=1)]
    out: dict[str, Any] = {"registered_over_weight_type_pairs": split_half(flat, first["tokens"], n_boot=1000, seed=0)}
    per_type = {}
    for t in reg["candidate_types"]:  # not registered: within one type, over weights only
        rows_t = [first["per_chunk"][w, o] for w, opts in enumerate(first["options"]) for o, x in enumerate(opts)
                  if x == t]
        if len(rows_t) >= 10 and not np.any(rows_t):
            per_type[t] = {"exact": True}  # every score 0: the type stores the reference as it is
        elif len(rows_t) >= 10:
            per_type[t] = split_half(np.asarray(rows_t), first["tokens"], n_boot=1000, seed=0)
    out["within_type_not_registered"] = per_type
    return out


def loader_agreement(run: Path, scores: dict[str, pd.DataFrame]) -> list[dict[str, Any]] | None:
    loader = run / "scores" / "interp-loader.parquet"
    if not loader.exists():
        return None
    frame = pd.read_parquet(loader)
    agreement = []
    for name, group in frame.groupby("file"):
        lc = scores[str(name)].iloc[:len(group)]
        agreement.append({"file": name, "examples": len(group),
                          "max_abs_kl_difference": float(np.abs(group.kl.to_numpy() - lc.kl.to_numpy()).max()),
                          "mean_kl_llama_cpp": float(lc.kl.mean()), "mean_kl_interp": float(group.kl.mean()),
                          "max_abs_nll_difference": float(np.abs(group.nll.to_numpy() - lc.nll.to_numpy()).max())})
    return agreement


def grid_share(files: dict[str, Path], names: list[str], reg: dict[str, Any]) -> dict[str, float]:
    """Per file: the fraction of its block-weight bytes stored in the type the bundled GGUF gives that tensor."""
    from interp.models import _bundled_gguf

    bundled = block_types(_bundled_gguf(reg["model"]))
    share = {}
    for name in names:
        mine = block_types(files[name])
        share[name] = sum(b for k, (t, b) in mine.items() if bundled[k][0] == t) / sum(b for _, b in mine.values())
    return share


def environment() -> dict[str, Any]:
    import llama_cpp

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return {"commit": commit, "llama_cpp_python": llama_cpp.__version__, "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "llama_threads": int(os.environ.get("LLAMA_THREADS", "2")), "machine": platform.machine()}


SHARED = ("gguf/ref-f32.gguf", "gguf/Q*.gguf", "gguf/pure-*.gguf", "sensitivity-*",
          *(f"scores/{m}.parquet" for m in MIXES))  # what does not depend on the candidate types


def share(source: Path, run: Path, patterns: tuple[str, ...] = SHARED) -> None:
    """Hard-link ``patterns`` (default: what does not depend on the candidate types) from an earlier run."""
    names = [p.relative_to(source) for pattern in patterns for p in source.glob(pattern)]
    for name in names:
        target = run / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            os.link(source / name, target)


def heldout_rows(model: Any, reg: dict[str, Any]) -> Any:
    """The registration's held-out examples (``interp.report.confirm.fresh_examples``)."""
    held = reg["heldout"]
    return fresh_examples(model.tokenizer, held["data"], held["n"], held["seq_len"], held["seed"],
                          held["exclude_seq_lens"], held["exclude_prefix"], held["exclude_preregistrations"])


def calibration_rows(model: Any, reg: dict[str, Any]) -> Any:
    """Every calibration seed's examples in one set (the registered importance matrix's tokens)."""
    cal = reg["calibration"]
    parts = [load_examples(cal["data"], model.tokenizer, n=cal["n"], seq_len=cal["seq_len"], seed=seed,
                           split=cal["split"]) for seed in cal["seeds"]]
    return interp.Examples.from_tokens(torch.cat([p.tokens for p in parts]), ids=[i for p in parts for i in p.ids])


def paired(withs: list[pd.DataFrame], withouts: list[pd.DataFrame], n_boot: int, tail: bool = False
           ) -> dict[str, Any]:
    """1 - mean KL(with) / mean KL(without), each instance paired with its own file, examples shared (with
    ``tail``: each file's mean over its own worst 10%)."""
    pairs = list(zip(withs, withouts, strict=True))

    def statistic(pair: tuple[pd.DataFrame, pd.DataFrame], rows: np.ndarray) -> np.ndarray:
        a, b = pair[0]["kl"].to_numpy()[rows], pair[1]["kl"].to_numpy()[rows]
        if tail:
            k = max(1, int(round(0.1 * rows.shape[-1])))
            a, b = np.sort(a, -1)[..., -k:], np.sort(b, -1)[..., -k:]
        return 1 - a.mean(-1) / b.mean(-1)

    result = crossed_bootstrap(pairs, statistic, len(withs[0]), n_boot=n_boot, seed=0)
    est = result.estimate
    return {"estimate": est.value, "low": est.low, "high": est.high, "per_instance": list(result.per_instance),
            "instances": len(pairs), "mean_kl_with": [float(a.kl.mean()) for a in withs],
            "mean_kl_without": [float(b.kl.mean()) for b in withouts]}


def tail_kl(frame: pd.DataFrame) -> float:
    """A file's mean KL over its own worst 10% of the held-out examples."""
    values = np.sort(frame.kl.to_numpy())
    return float(values[-max(1, int(round(0.1 * values.size))):].mean())


def main_tail(reg: dict[str, Any], sha: str, run: Path, binary: Path, shared: Path | None, write: bool) -> None:
    """Registration 5: plans minimizing the predicted worst-10% KL of the calibration examples."""
    from interp.quant.prescribe import choose_options_tail, tail_loss

    if shared is not None:  # the reference, pure-type and mix files and the mixes' scores (not the sensitivities)
        share(shared, run, tuple(p for p in SHARED if not p.startswith("sensitivity")))
    files = phase_files(run, binary, reg)
    model = interp.load_model(reg["model"])
    rows = heldout_rows(model, reg)
    sens = phase_sensitivity(run, files, reg, model, chunks=reg["calibration"]["n"])  # one example per chunk
    if set(rows.ids) & {i for s in sens.values() for i in s["ids"]}:
        raise SystemExit("held-out documents are also calibration documents")
    del model
    shapes = reference_shapes(files)
    source = DATA / reg["companion_of"]
    predicted_tail: dict[str, Any] = {}
    for size in reg["sizes"]:
        for seed, s in sens.items():
            name = f"plan-{size}-{seed}"
            # per weight and option, each example's mean per token: [options, examples]
            keys, allowed, losses, costs = option_table(s, shapes, reg["candidate_types"], s["per_chunk"] / s["tokens"])
            found: dict[str, Any] = {}

            def choose(capacity: int, keys: Any = keys, allowed: Any = allowed, losses: Any = losses,
                       costs: Any = costs, found: dict[str, Any] = found) -> dict[tuple[int, str], str]:
                found["choice"], found["history"] = choose_options_tail(losses, costs, capacity, share=0.1, rounds=50,
                                                                        unit=max(1, capacity // 50000))
                return {key: allowed[w][o] for w, (key, o) in enumerate(zip(keys, found["choice"], strict=True))}

            files[name] = write_plan(run, binary, files, name, size, shapes, choose)
            if not found:  # the file exists from an earlier (killed) run: recompute its choice for the record
                choose(block_bytes(files[size]))
            history = found["history"]
            totals = np.sum([losses[w][o] for w, o in enumerate(found["choice"])], axis=0)
            predicted_tail[name] = {"tail_mean_optimal": history[0], "tail_chosen": min(history),
                                    "mean_chosen": float(totals.mean()), "rounds": len(history) - 1,
                                    "tail_check": tail_loss(totals, 0.1), "same_types_as_registration_3":
                                    (source / f"{name}.txt").read_text() == (run / f"{name}.txt").read_text()}
            log(f"{name}: {files[name].stat().st_size} bytes (mix {files[size].stat().st_size}); predicted tail "
                f"{history[0]:.4f} -> {min(history):.4f}")
    plans = [n for n in files if n.startswith("plan-")]
    log(f"llama.cpp scoring of {len(plans)} files on {len(rows)} held-out examples")
    score_llama_cpp(run, files, rows.tokens, plans, binary)
    scores = {p.stem: pd.read_parquet(p) for p in (run / "scores").glob("*.parquet")}
    mean_plans = {p.stem: pd.read_parquet(p) for p in source.glob("plan-*.parquet")}
    seeds = reg["calibration"]["seeds"]
    verdicts, tail_verdicts, against_mean = {}, {}, {}
    for size in reg["sizes"]:
        tails = [scores[f"plan-{size}-{seed}"] for seed in seeds]
        means = [mean_plans[f"plan-{size}-{seed}"] for seed in seeds]
        verdicts[size] = compare(scores[size], tails, reg["n_boot"])
        tail = verdicts[size]["tail"]  # the registered primary here: the worst-10% reduction
        tail_verdicts[size] = {"verdict": judge(tail["low"], tail["high"]), "tail_kl_mix": tail_kl(scores[size]),
                               "tail_kl_plans": [tail_kl(t) for t in tails]}
        against_mean[size] = {"tail": paired(tails, means, reg["n_boot"], tail=True),
                              "mean": paired(tails, means, reg["n_boot"]),
                              "tail_kl_mean_plans": [tail_kl(m) for m in means]}
    result = {"registration": reg["name"], "registration_sha256": sha, "verdicts": verdicts,
              "tail_verdicts": tail_verdicts, "against_mean_plans": against_mean, "predicted": predicted_tail,
              "heldout_ids": rows.ids,
              "sensitivity_seconds": {str(k): v["settings"]["seconds"] for k, v in sens.items()},
              "environment": environment()}
    write_json(run / "result.json", sanitize(result))
    if write:
        out = DATA / reg["name"]
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "result.json", sanitize(result))
        for p in [*(run / "scores").glob("*.parquet"), *run.glob("plan-*.txt"), *run.glob("sensitivity-*")]:
            (out / p.name).write_bytes(p.read_bytes())
    log(json.dumps(sanitize({"tail": tail_verdicts, "against_mean_plans": against_mean}), indent=1))


def main_imatrix(reg: dict[str, Any], sha: str, run: Path, binary: Path, shared: Path | None, write: bool) -> None:
    """Registration 4: the same imatrix (interp's, from the calibration split) for the mixes and the plans."""
    from interp.models import _bundled_gguf
    from interp.quant.imatrix import importance_matrix, write_imatrix

    gguf_dir = run / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    ref = gguf_dir / "ref-f32.gguf"
    if shared is not None:
        share(shared, run, ("gguf/ref-f32.gguf",))
    quantize(binary, _bundled_gguf(reg["model"]), ref, "F32", "--allow-requantize")
    model = interp.load_model(reg["model"])
    rows = heldout_rows(model, reg)
    cal = calibration_rows(model, reg)
    overlap = set(rows.ids) & set(cal.ids)
    if overlap:
        raise SystemExit(f"{len(overlap)} held-out documents are also calibration documents")
    imatrix = run / "imatrix.gguf"
    if not imatrix.exists():
        start = time.perf_counter()
        matrix = importance_matrix(model, cal, progress=False, datasets=("wiki calibration split, seeds "
                                   + ",".join(str(s) for s in reg["calibration"]["seeds"]),))
        write_imatrix(matrix, imatrix)
        write_json(run / "imatrix.json", {"seconds": time.perf_counter() - start, "tokens": matrix.tokens})
        log(f"importance matrix of {matrix.tokens} tokens")
    del model
    files = {"reference": ref}
    for mix in mixes(reg):
        files[mix] = gguf_dir / f"{mix}.gguf"
        quantize(binary, ref, files[mix], mix, imatrix=imatrix)
    source = DATA / reg["companion_of"]
    seeds = reg["calibration"]["seeds"]
    for size in reg["sizes"]:
        for seed in seeds:
            name = f"plan-{size}-{seed}"
            files[name] = gguf_dir / f"{name}.gguf"
            quantize(binary, ref, files[name], size, "--tensor-type-file", str(source / f"{name}.txt"),
                     imatrix=imatrix)
            log(f"{name}: {files[name].stat().st_size} bytes (mix {files[size].stat().st_size})")
    scored = [*mixes(reg), *(n for n in files if n.startswith("plan-"))]
    log(f"llama.cpp scoring of {len(scored)} files on {len(rows)} held-out examples")
    score_llama_cpp(run, files, rows.tokens, scored, binary)
    scores = {p.stem: pd.read_parquet(p) for p in (run / "scores").glob("*.parquet")}
    before = {p.stem: pd.read_parquet(p) for p in source.glob("*.parquet") if p.stem != "interp-loader"}
    verdicts = {size: compare(scores[size], [scores[f"plan-{size}-{seed}"] for seed in seeds], reg["n_boot"])
                for size in reg["sizes"]}
    equal_size = {size: all(b <= v["bytes"]["mix"] for b in v["bytes"]["plans"]) for size, v in verdicts.items()}
    effect = {"mix": {m: paired([scores[m]], [before[m]], reg["n_boot"]) for m in MIXES},
              "plans": {size: paired([scores[f"plan-{size}-{s}"] for s in seeds],
                                     [before[f"plan-{size}-{s}"] for s in seeds], reg["n_boot"])
                        for size in reg["sizes"]}}
    files_table = [{"file": n, "bytes": int(f.bytes.iloc[0]), "mean_kl": float(f.kl.mean()),
                    "mean_nll_increase": float((f.nll - f.ref_nll).mean())} for n, f in sorted(scores.items())]
    result = {"registration": reg["name"], "registration_sha256": sha, "verdicts": verdicts,
              "equal_size": equal_size, "imatrix_effect": effect, "files": files_table, "heldout_ids": rows.ids,
              "imatrix": json.loads((run / "imatrix.json").read_text()), "environment": environment()}
    write_json(run / "result.json", sanitize(result))
    if write:
        out = DATA / reg["name"]
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "result.json", sanitize(result))
        for p in [*(run / "scores").glob("*.parquet"), imatrix]:
            (out / p.name).write_bytes(p.read_bytes())
    log(json.dumps(sanitize(verdicts), indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--registration", default="llama-cpp-plans-3", help="a file of docs/preregistration")
    parser.add_argument("--run", default=None, help="working folder (GGUF files, scores); default runs/REGISTRATION")
    parser.add_argument("--shared", default=None, help="an earlier run of the same design whose reference, mix and "
                        "pure-type files, sensitivities and mix scores are reused (hard links)")
    parser.add_argument("--no-write", action="store_true", help="do not copy the results to docs/data")
    args = parser.parse_args()
    binary = Path(os.environ.get("LLAMA_CPP_BIN", ""))
    if not (binary / "llama-quantize").is_file():
        raise SystemExit("set LLAMA_CPP_BIN to the folder holding llama-quantize and libllama.so")
    reg, sha = registration(args.registration)
    if "models" in reg:  # llama-cpp-curve-1 on: a size curve per model, this module's functions driven per model
        raise SystemExit(f"{args.registration} is run one model at a time by benchmarks/llama_cpp_curve.py "
                         f"--model {' or '.join(reg['models'])}")
    run = Path(args.run or f"runs/{args.registration}")
    run.mkdir(parents=True, exist_ok=True)
    if "imatrix" in reg:
        main_imatrix(reg, sha, run, binary, Path(args.shared) if args.shared else None, not args.no_write)
        return
    if "choose_options_tail" in reg["allocation"]:
        main_tail(reg, sha, run, binary, Path(args.shared) if args.shared else None, not args.no_write)
        return
    if args.shared:
        share(Path(args.shared), run)
    files = phase_files(run, binary, reg)
    model = interp.load_model(reg["model"])
    rows = heldout_rows(model, reg)
    sens = phase_sensitivity(run, files, reg, model)
    overlap = set(rows.ids) & {i for s in sens.values() for i in s["ids"]}
    if overlap:
        raise SystemExit(f"{len(overlap)} held-out documents are also calibration documents")
    del model
    files.update(phase_plans(run, binary, files, reg, sens))
    scored = [*mixes(reg), *(n for n in files if n.startswith("plan-"))]
    log(f"llama.cpp scoring of {len(scored)} files on {len(rows)} held-out examples")
    score_llama_cpp(run, files, rows.tokens, scored, binary)
    log("interp loader on the first 16 examples")
    first = reg["sizes"][0]
    score_interp(run, files, rows.tokens[:16], [first, f"plan-{first}-{reg['calibration']['seeds'][0]}"])
    result = analyse(run, reg, sha, sens, files)
    if "mixes" in reg:  # registration 6 on: the share of each file's block bytes kept in the reference's own type
        result["reference_grid_share"] = grid_share(files, scored, reg)
    result["heldout_ids"] = rows.ids
    write_json(run / "result.json", sanitize(result))
    if not args.no_write:
        out = DATA / reg["name"]
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "result.json", sanitize(result))
        for p in [*(run / "scores").glob("*.parquet"), *run.glob("plan-*.txt"), *run.glob("sensitivity-*")]:
            (out / p.name).write_bytes(p.read_bytes())
    log(json.dumps(sanitize(result["verdicts"]), indent=1))


if __name__ == "__main__":
    main()
