"""Pre-registered run llama-cpp-curve-1 (issue 47): the K-quant size curve against llama.cpp at its best.

Follows ``docs/preregistration/llama-cpp-curve-1.json`` (read here, never edited), for one model:

1. ``llama-quantize`` makes the F32 reference and every size's plain mix; the sizes judged are fixed from
   the files' bytes before any score (``sizes.json``; Gemma: the mixes smaller than the bundled file).
2. Fresh held-out examples: the documents any earlier registration held out (the ``ids`` and
   ``heldout_ids`` committed under ``docs/data/prescribe/llama-cpp/`` and ``docs/data/reproduction/``) are
   removed, then ``interp.data.load_examples`` draws; no calibration document may be among them.
3. Per calibration seed (41-43, 64 examples): interp's importance matrix and ``llama-imatrix``'s (the
   examples decoded as text, ``-c 128``); each size's mix with each of them; ``--pure --imatrix`` files of
   every candidate type, dequantized, for the one-sample Fisher sensitivity (one chunk per example).
4. Per seed and size, two plans (``plan_mean``: ``choose_options``; ``plan_tail``: ``choose_options_tail``,
   share 0.1), each ``llama-quantize --imatrix INTERP_s --tensor-type-file``, re-chosen with less room until
   the file is at most every baseline of its seed (``fit_to_size``); else "no plan fits".
5. Every file scored by llama.cpp's kernels (its Python bindings, one example per context): per example
   its mean KL, NLL and top-token agreement (parquet), per position its KL (float32) and agreement (uint8)
   in a safetensors file, the sufficient data of the tail metrics.
6. The registered analysis (``benchmarks/llama_cpp_curve_analysis.py``) writes ``result.json``; with
   ``--write`` it and the scores, plans, records and every file's tensor types (``tensor_types/``) go to
   ``docs/data/prescribe/llama-cpp/llama-cpp-curve-1/<model>/`` (``docs/build_llama_cpp_curve.py`` renders the page;
   ``--dry-run`` writes them to its own folder's ``written/``).

Every phase writes its result as it finishes, so a killed run resumes where it stopped; ``run.json``
records each (re)start with the commit, the registration's SHA-256, the CPU and its flags and torch's kernels.
The working folder is not kept between machines, so after every phase and every scored size its small files
(:data:`KEPT`: records, importance matrices, sensitivities, plans' tensor-type files, scores, tensor-type
records; not the GGUF files) are copied to the kept folder (``--keep``, by default the committed
``docs/data/.../<model>/``), and a run on a new machine restores them first: committing that folder saves the work
done so far, and only the GGUF files of the sizes not yet scored are made again (a plan's with its recorded bytes).
Scoring uses ``LLAMA_THREADS`` threads (default 1: the logits do not depend on it, see :func:`run_model`).

``--sizes A,B`` scores only those sizes, so two processes can score one model's sizes on two cores in the same run
folder (each size's partial scores are its own files; the analysis waits for a run that scores every size): e.g.
one process without ``--sizes`` (it goes through the sizes in order and skips those already scored) and one with
``--sizes Q6_K,Q5_K_M`` from the other end. Two processes must never score the same size at once.

    LLAMA_CPP_BIN=/path/to/build/bin PYTHONPATH=/folder/holding/llama_cpp \\
        python benchmarks/llama_cpp_curve.py --model smollm2-135m [--write]
    python benchmarks/llama_cpp_curve.py --dry-run       # every phase on a tiny GGUF, in a temporary folder

The ``llama_cpp`` package is llama-cpp-python's pure-Python ``llama_cpp/`` folder (its sdist) over the build's
``libllama.so`` (``LLAMA_CPP_LIB_PATH`` is set to ``LLAMA_CPP_BIN``); it needs ``diskcache`` and ``jinja2``.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import llama_cpp_curve_analysis as curve  # noqa: E402
import llama_cpp_curve_tensors as tensors  # noqa: E402
import llama_cpp_plans as plans  # noqa: E402

import interp  # noqa: E402
from interp.data import load_examples  # noqa: E402
from interp.io import sanitize, write_file, write_json, write_text  # noqa: E402
from interp.quant.llama_cpp import write_tensor_types  # noqa: E402
from interp.quant.llama_cpp_run import block_bytes, rounding_of  # noqa: E402
from interp.quant.llama_cpp_run import quantize as run_quantize  # noqa: E402

NAME = "llama-cpp-curve-1"
OUT = plans.DATA / NAME
EARLIER = (plans.DATA, ROOT / "docs" / "data" / "reproduction")  # where earlier registrations' example ids are
log = plans.log


@dataclass
class Setup:
    """One model's run: the registration (``reg``, possibly the dry run's smaller copy), its SHA-256, the model,
    the GGUF llama.cpp starts from, the sizes, the build, the working folder and what the analysis repeats."""

    reg: dict[str, Any]
    sha: str
    model: str
    source: Path
    sizes: list[str]
    binary: Path
    run: Path
    reference_limit: int | None = None  # bytes: only sizes whose plain mix is smaller are judged
    mc_seeds: tuple[int, ...] = tuple(range(1, 21))
    keep: Path | None = None  # the committed copy of the run's small files (:func:`keep_state`)
    score_sizes: list[str] | None = None  # --sizes: only these are scored, and nothing is analysed

    @property
    def seeds(self) -> list[int]:
        return list(self.reg["calibration"]["seeds"])

    def gguf(self, name: str) -> Path:
        return self.run / "gguf" / f"{name}.gguf"


def _read(path: Path) -> Any:
    return json.loads(path.read_text())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cpu() -> dict[str, str]:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    found = {key: re.search(rf"^{key}\s*:\s*(.*)$", info, re.M) for key in ("model name", "flags")}
    return {key: m.group(1) if m else "unknown" for key, m in found.items()}


def record_start(s: Setup) -> dict[str, Any]:
    """Append this (re)start to ``run.json``; a run folder of another registration text is refused."""
    path = s.run / "run.json"
    record = _read(path) if path.exists() else {"registration": NAME, "registration_sha256": s.sha, "model": s.model,
                                                "starts": []}
    if record["registration_sha256"] != s.sha or record["model"] != s.model:
        raise SystemExit(f"{s.run} holds a run of another registration text or model; use another --run")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    record["starts"].append({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": commit, "argv": sys.argv[1:],
                             "cpu": cpu(), "torch_kernels": torch.backends.cpu.get_cpu_capability(),
                             "torch_threads": torch.get_num_threads(),
                             "llama_threads": int(os.environ["LLAMA_THREADS"])})
    write_json(path, record)
    return record


# ---------------------------------------------------------------------------------------
# The kept state: what a later session (on another machine) needs to go on where this one stopped


# Every file of the run folder a resumed run cannot remake cheaply or identically: the records, both tools'
# importance matrices, the sensitivities, the plans' tensor-type files, the scores and each scored size's
# tensor-type records. The GGUF files (about 12 GB on SmolLM2) are not kept: llama-quantize remakes them from
# the F32 reference, these importance matrices and these tensor-type files, and a remade plan must have its
# recorded bytes (:func:`remake_plan`).
# llama-quantize stores the --imatrix path as given in the file's metadata, and its length moves the file's size
# through the alignment padding (32 bytes on the dry run's tiny model): every file made with an importance matrix
# is made through interp.quant.llama_cpp_run.quantize(imatrix=...), which runs the tool in the matrix's folder with
# its bare name, so a plan made again elsewhere has its recorded bytes.
KEPT = ("run.json", "sizes.json", "examples.json", "plans.json", "imatrix-*.gguf", "imatrix-*.json",
        "sensitivity-*.json", "sensitivity-*.safetensors", "plan_*.txt", "scores/*", "tensor_types/*", "partial/*")
# Kept files that grow as the run goes (its list of starts; a size's scores so far): the run folder's copy is the
# newer one, so the two copies may differ without being two runs.
GROWING = ("run.json", "partial/*")


def _growing(name: Path) -> bool:
    return any(name.match(pattern) for pattern in GROWING)


def kept_files(folder: Path) -> list[Path]:
    """The files of ``folder`` that :data:`KEPT` names, relative to it, sorted."""
    return sorted({p.relative_to(folder) for pattern in KEPT for p in folder.glob(pattern) if p.is_file()})


def _same_file(a: Path, b: Path) -> bool:
    return a.stat().st_size == b.stat().st_size and _sha256(a) == _sha256(b)


def restore_state(s: Setup) -> int:
    """Copy into the run folder every kept file (``s.keep``) it lacks; the number copied.

    The kept folder must hold a run of this registration text and model, and a file in both places must be the
    same bytes (the growing files of :data:`GROWING` excepted: the run folder's copy is newer), or the two runs
    differ and nothing is copied: results are only ever combined with what was computed from identical inputs."""
    if s.keep is None or not (s.keep / "run.json").is_file():
        return 0
    kept = _read(s.keep / "run.json")
    if kept.get("registration_sha256") != s.sha or kept.get("model") != s.model:
        raise SystemExit(f"{s.keep} keeps a run of another registration text or model; it cannot be resumed here")
    names = kept_files(s.keep)
    differ = [str(n) for n in names if not _growing(n) and (s.run / n).is_file()
              and not _same_file(s.run / n, s.keep / n)]
    if differ:
        raise SystemExit(f"{s.run} and the kept run {s.keep} differ in {', '.join(differ[:5])}"
                         f"{' ...' if len(differ) > 5 else ''}: they are two runs; resume one (--run, --keep)")
    copied = 0
    for name in names:
        target = s.run / name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            write_file(target, lambda tmp, src=s.keep / name: shutil.copyfile(src, tmp))
            copied += 1
    if copied:
        log(f"restored {copied} files from {s.keep}")
    return copied


def keep_state(s: Setup) -> None:
    """Copy the run folder's kept files (:data:`KEPT`) that are new or changed to ``s.keep``, each whole or not at
    all: called after every phase and every scored size, so committing ``s.keep`` saves the work done so far."""
    if s.keep is not None:
        copy_kept(s.run, s.keep)
        for name in kept_files(s.keep):  # a finished size's partial scores are gone from the run: drop the copy
            if name.parts[0] == "partial" and not (s.run / name).exists():
                (s.keep / name).unlink()


def copy_kept(source: Path, target: Path) -> None:
    """Copy ``source``'s kept files (:data:`KEPT`) that ``target`` lacks or holds with other bytes, each whole or
    not at all; a file already there with the same bytes is left as it is."""
    for name in kept_files(source):
        dst = target / name
        if not dst.is_file() or not _same_file(source / name, dst):
            dst.parent.mkdir(parents=True, exist_ok=True)
            write_file(dst, lambda tmp, src=source / name: shutil.copyfile(src, tmp))


# ---------------------------------------------------------------------------------------
# Phase 1: the reference and the plain mixes; the sizes judged


def registered_limit(reg: dict[str, Any], model: str, source: Path) -> int | None:
    """Gemma's judged sizes: the registered byte count of the bundled reference file, checked against the file."""
    text = reg["models"][model].get("judged_sizes")
    if text is None:
        return None
    limit = int(re.search(r"\(([\d,]+) B\)", text).group(1).replace(",", ""))  # type: ignore[union-attr]
    if source.stat().st_size != limit:
        raise SystemExit(f"{source} has {source.stat().st_size} bytes; the registration names {limit}")
    return limit


def size_done(s: Setup, size: str) -> bool:
    """Whether ``size`` is finished: all its plans recorded, all its files scored and their tensor types recorded
    (then a resumed run makes none of its GGUF files again)."""
    path = s.run / "plans.json"
    if not path.exists():
        return False
    record = _read(path)
    if any(curve.stem(arm, size, seed) not in record for arm in curve.ARMS for seed in s.seeds):
        return False
    scored = all((s.run / "scores" / f"{n}.{ext}").is_file() for n in file_names(s, size, record)
                 for ext in ("parquet", "safetensors"))
    return scored and all((s.run / "tensor_types" / f"{n}.json").is_file() for n in record_names(s, size, record))


def phase_mixes(s: Setup) -> dict[str, Any]:
    (s.run / "gguf").mkdir(parents=True, exist_ok=True)
    plans.quantize(s.binary, s.source, s.gguf("ref-f32"), "F32", "--allow-requantize")
    path = s.run / "sizes.json"
    for size in s.sizes if not path.exists() else [z for z in s.sizes if not size_done(s, z)]:
        plans.quantize(s.binary, s.gguf("ref-f32"), s.gguf(curve.stem(curve.PLAIN, size)), size)
    if not path.exists():  # fixed once, from the files, before any score
        sizes = {}
        for size in s.sizes:
            f = s.gguf(curve.stem(curve.PLAIN, size))
            nbytes = f.stat().st_size
            sizes[size] = {"bytes": nbytes, "block_bytes": block_bytes(f),
                           "judged": s.reference_limit is None or nbytes < s.reference_limit}
        write_json(path, {"reference_limit": s.reference_limit, "sizes": sizes})
    return _read(path)


# ---------------------------------------------------------------------------------------
# Phase 2: the examples


def earlier_ids(exclude: Path | None = None) -> set[str]:
    """Every example id committed by earlier registrations: the ``ids`` and ``heldout_ids`` lists of the JSON
    files under ``docs/data/prescribe/llama-cpp/`` and ``docs/data/reproduction/`` (not this registration's own
    folder ``exclude``). Calibration ids are among them; they are never eval documents, so removing them
    changes nothing."""
    found: set[str] = set()
    for root in EARLIER:
        for path in sorted(root.rglob("*.json")):
            if exclude is not None and exclude in path.parents:
                continue
            data = json.loads(path.read_text())
            if isinstance(data, dict):
                for key in ("ids", "heldout_ids"):
                    if isinstance(data.get(key), list):
                        found.update(str(x) for x in data[key])
    return found


def examples(s: Setup, tokenizer: Any) -> tuple[Any, dict[int, Any]]:
    """The held-out examples and each seed's calibration examples, checked against ``examples.json``."""
    held, cal = s.reg["heldout"], s.reg["calibration"]
    used = earlier_ids(OUT)
    pool = load_examples(held["data"], tokenizer, n=None, seq_len=held["seq_len"], seed=held["seed"],
                         split=held["split"])
    keep = [i for i, doc in enumerate(pool.ids) if doc not in used]
    if len(keep) < held["n"]:
        raise SystemExit(f"only {len(keep)} fresh held-out documents remain; the registration asks for {held['n']}")
    rows = pool.subset(keep[:held["n"]])  # the pool is in the seed's order
    calibration = {seed: load_examples(cal["data"], tokenizer, n=cal["n"], seq_len=cal["seq_len"], seed=seed,
                                       split=cal["split"]) for seed in s.seeds}
    overlap = set(rows.ids) & {i for c in calibration.values() for i in c.ids}
    if overlap:
        raise SystemExit(f"{len(overlap)} held-out documents are also calibration documents")
    record = {"heldout_ids": rows.ids,
              "heldout_tokens_sha256": hashlib.sha256(rows.tokens.numpy().tobytes()).hexdigest(),
              "excluded_documents": len(used),
              "excluded_ids_sha256": hashlib.sha256("\n".join(sorted(used)).encode()).hexdigest(),
              "calibration_ids": {str(seed): c.ids for seed, c in calibration.items()}}
    path = s.run / "examples.json"
    if path.exists() and _read(path) != record:
        raise SystemExit(f"the examples drawn now differ from {path}'s: the data or the tokenizer changed")
    write_json(path, record)
    return rows, calibration


# ---------------------------------------------------------------------------------------
# Phase 3: importance matrices, the imatrix mixes and the sensitivities


def llama_imatrix(binary: Path, model: Path, text: Path, target: Path, ctx: int) -> None:
    """``llama-imatrix -m MODEL -f TEXT -c CTX -o TARGET`` (default settings otherwise), written whole or not at all."""
    def produce(tmp: Path) -> None:
        done = subprocess.run([str(binary / "llama-imatrix"), "-m", str(model), "-f", str(text), "-c", str(ctx),
                               "-o", str(tmp)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace", check=False)
        if done.returncode != 0:
            raise SystemExit(f"llama-imatrix failed ({done.returncode}): {done.stdout.strip().splitlines()[-1:]}")

    write_file(target, produce)


def phase_imatrices(s: Setup, model: Any, calibration: dict[int, Any]) -> None:
    from interp.quant.imatrix import importance_matrix, write_imatrix

    for seed, rows in calibration.items():
        mine, theirs = s.run / f"imatrix-interp-{seed}.gguf", s.run / f"imatrix-llama-{seed}.gguf"
        if not mine.exists():
            start = time.perf_counter()
            write_imatrix(importance_matrix(model, rows, progress=False,
                                            datasets=(f"wiki calibration split, seed {seed}",)), mine)
            write_json(s.run / f"imatrix-interp-{seed}.json", {"seconds": time.perf_counter() - start})
            log(f"interp imatrix, seed {seed}")
        if not theirs.exists():
            text = s.run / f"calibration-{seed}.txt"
            write_text(text, "\n\n".join(model.tokenizer.decode(row[1:]) for row in rows.tokens.tolist()))
            start = time.perf_counter()
            llama_imatrix(s.binary, s.gguf("ref-f32"), text, theirs, s.reg["calibration"]["seq_len"])
            write_json(s.run / f"imatrix-llama-{seed}.json", {"seconds": time.perf_counter() - start})
            log(f"llama-imatrix, seed {seed}")


def phase_imatrix_mixes(s: Setup) -> None:
    for seed in s.seeds:
        for short, kind in curve.BASELINES.items():
            for size in [z for z in s.sizes if not size_done(s, z)]:
                plans.quantize(s.binary, s.gguf("ref-f32"), s.gguf(curve.stem(kind, size, seed)), size,
                               imatrix=s.run / f"imatrix-{short}-{seed}.gguf")


def phase_sensitivity(s: Setup, model: Any, calibration: dict[int, Any]) -> dict[int, dict[str, Any]]:
    """Per seed: the one-sample Fisher sensitivity of every candidate type, each rounded as llama-quantize
    ``--pure --imatrix INTERP_s`` rounds it (those files are removed once read)."""
    from safetensors.numpy import load_file, save_file

    from interp.quant.fisher import fisher_sensitivity
    from interp.quant.llama_cpp import gguf_block_weights

    types = s.reg["plans"]["candidate_types"]
    out = {}
    for seed, rows in calibration.items():
        path = s.run / f"sensitivity-{seed}.safetensors"
        if not path.exists():
            pure = {}
            for t in types:
                f = s.gguf(f"pure-{t}-{seed}")
                plans.quantize(s.binary, s.gguf("ref-f32"), f, t.upper(), "--pure",
                               imatrix=s.run / f"imatrix-interp-{seed}.gguf")
                pure[t] = gguf_block_weights(f)
            log(f"Fisher sensitivity, calibration seed {seed}")
            result = fisher_sensitivity(model, rows, rounding_of(pure), chunks=len(rows), batch_size=8,
                                        seed=seed, progress=False)
            write_json(path.with_suffix(".json"), sanitize({"layers": result.layers, "roles": result.roles,
                                                            "options": result.options, "settings": result.settings,
                                                            "ids": rows.ids}))
            write_file(path, lambda tmp, r=result: save_file({"per_chunk": r.per_chunk, "tokens": r.tokens}, str(tmp)))
            for t in types:
                s.gguf(f"pure-{t}-{seed}").unlink()
            log(f"  {result.settings['seconds']:.0f} s")
        out[seed] = {**_read(path.with_suffix(".json")), **load_file(str(path))}
    return out


# ---------------------------------------------------------------------------------------
# Phase 4: the plans


def make_plan(s: Setup, arm: str, size: str, seed: int, sen: dict[str, Any],
              shapes: dict[tuple[int, str], tuple[int, int]], capacity: int, limit: int) -> dict[str, Any]:
    """One registered plan: its types chosen for ``capacity`` block bytes (``plan_mean``: least summed
    sensitivity; ``plan_tail``: least predicted worst-10% KL), written by ``llama-quantize SIZE --imatrix INTERP_s
    --tensor-type-file`` and chosen again with less room until the file is at most ``limit`` bytes."""
    from interp.errors import SpecError
    from interp.quant.llama_cpp_run import fit_to_size
    from interp.quant.prescribe import choose_options_tail
    from interp.quant.shapes import WeightShape

    name = curve.stem(arm, size, seed)
    candidates = s.reg["plans"]["candidate_types"]
    keys, allowed, losses, costs = plans.option_table(sen, shapes, candidates, sen["per_chunk"] / sen["tokens"])
    history: list[float] = []

    def choose(room: int) -> dict[tuple[int, str], str]:
        if arm == "plan_mean":
            return plans.plan_types(sen, shapes, room, candidates)
        chosen, found = choose_options_tail(losses, costs, room, share=0.1, unit=max(1, room // 50000))
        history[:] = found
        return {key: allowed[w][o] for w, (key, o) in enumerate(zip(keys, chosen, strict=True))}

    def write(types: dict[tuple[int, str], str]) -> Path:
        type_file = s.run / f"{name}.txt"
        order = sorted(types)
        write_tensor_types(type_file, [WeightShape(layer, role, *shapes[layer, role]) for layer, role in order],
                           {f"{layer}.{role}": types[layer, role] for layer, role in order})
        return run_quantize(s.binary, s.gguf("ref-f32"), s.gguf(name), size, "--tensor-type-file", str(type_file),
                            imatrix=s.run / f"imatrix-interp-{seed}.gguf")

    try:
        types, made, slack = fit_to_size(choose, write, capacity, limit, lambda x: log(f"{name}: {x} bytes less"))
    except SpecError as error:
        return {"fits": False, "reason": str(error), "limit": limit, "capacity": capacity}
    return {"fits": True, "bytes": made.stat().st_size, "limit": limit, "capacity": capacity, "slack": slack,
            "predicted_kl": plans.predicted(sen, types), **({"tail_history": history} if history else {})}


def phase_plans(s: Setup, sens: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Every size, seed and arm's plan, each recorded in ``plans.json`` as it is made (a rerun skips it)."""
    from interp.quant.llama_cpp_run import gguf_shapes

    path = s.run / "plans.json"
    record: dict[str, Any] = _read(path) if path.exists() else {}
    shapes = {(w.layer, w.role): (w.d_out, w.d_in) for w in gguf_shapes(s.gguf("ref-f32"))}
    for size in s.sizes:
        for seed in s.seeds:
            for arm in curve.ARMS:
                name = curve.stem(arm, size, seed)
                if name not in record:
                    capacity = block_bytes(s.gguf(curve.stem(curve.PLAIN, size)))
                    baselines = [curve.stem(curve.PLAIN, size),
                                 *(curve.stem(k, size, seed) for k in curve.BASELINES.values())]
                    limit = min(s.gguf(b).stat().st_size for b in baselines)  # the plan must fit under each
                    record[name] = make_plan(s, arm, size, seed, sens[seed], shapes, capacity, limit)
                    write_json(path, sanitize(record))
                    keep_state(s)
                    log(f"{name}: {record[name].get('bytes', 'no plan fits')} bytes (limit {limit})")
    return record


def remake_plan(s: Setup, arm: str, size: str, seed: int, record: dict[str, Any]) -> None:
    """A recorded plan's GGUF file made again (a resumed run on another machine) from its kept tensor-type file and
    the kept importance matrix, as :func:`make_plan` made it; refused unless it has the recorded bytes."""
    name = curve.stem(arm, size, seed)
    if s.gguf(name).exists() or not record[name]["fits"]:
        return
    made = run_quantize(s.binary, s.gguf("ref-f32"), s.gguf(name), size, "--tensor-type-file",
                        str(s.run / f"{name}.txt"), imatrix=s.run / f"imatrix-interp-{seed}.gguf")
    if made.stat().st_size != record[name]["bytes"]:
        found = made.stat().st_size
        made.unlink()
        raise SystemExit(f"{name}.gguf made again has {found} bytes, not the recorded {record[name]['bytes']}: this "
                         "llama.cpp build quantizes differently from the run's; resume with the same build")
    log(f"{name}: made again from its tensor-type file ({record[name]['bytes']} bytes)")


# ---------------------------------------------------------------------------------------
# Phase 5: scores


SAVE_EVERY = 32  # examples between saves of a size's scores so far (about 17 min of SmolLM2 at one thread)


def partial_key(s: Setup, names: list[str], rows: torch.Tensor) -> str:
    """What a size's saved partial scores were computed from: the held-out rows, the bytes of the reference and of
    every scored file (in order), and this scoring code. A partial is reused only under the same key."""
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(rows.numpy().astype(np.int64)).tobytes())
    for name in ["ref-f32", *names]:
        digest.update(f"{name}:{_sha256(s.gguf(name))};".encode())
    digest.update(SCORING_SOURCE.encode())  # the text read at import, not the file as it is now
    return digest.hexdigest()


def _load_partial(folder: Path, size: str, key: str, names: list[str], n: int, width: int
                  ) -> tuple[int, dict[str, np.ndarray]] | None:
    """The scores saved so far for ``size`` when they were computed from the same inputs (``key``), else None."""
    from safetensors.numpy import load_file

    meta_path, data_path = folder / f"{size}.json", folder / f"{size}.safetensors"
    if not (meta_path.is_file() and data_path.is_file()):
        return None
    meta = _read(meta_path)
    if meta.get("key") != key or meta.get("names") != names:
        log(f"{size}: the saved partial scores were computed from other inputs; scoring from the first example")
        return None
    arrays = load_file(str(data_path))
    done = int(meta["done"])
    if not 0 < done <= n or any(a.shape[0] != done for a in arrays.values()) or arrays["ref_nll"].shape != (done,) \
            or any(arrays[f"kl/{m}"].shape != (done, width) for m in names):
        log(f"{size}: the saved partial scores do not have the expected shapes; scoring from the first example")
        return None
    return done, arrays


def score_group(s: Setup, names: list[str], rows: torch.Tensor, size: str = "group",
                save_every: int = SAVE_EVERY) -> None:
    """Score ``names`` (files of one size) on every held-out example through llama.cpp's bindings, the
    reference evaluated once per example for the group; per file a parquet and a safetensors file.

    Every ``save_every`` examples the scores so far are saved (``partial/SIZE.safetensors`` and ``.json``, kept with
    the run's state), so a killed run resumes at the last save; they are reused only when :func:`partial_key`
    matches. A non-finite KL or NLL is refused before anything is written, and the partial is dropped once the
    size's files are written."""
    from llama_cpp import Llama
    from safetensors.numpy import save_file

    threads = int(os.environ.get("LLAMA_THREADS", "1"))

    def load(path: Path) -> Any:
        return Llama(model_path=str(path), n_ctx=rows.shape[1], n_batch=rows.shape[1], n_threads=threads,
                     n_threads_batch=threads, logits_all=True, verbose=False)

    def logits(llm: Any, row: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Float64 logits of every position but the last, their log-sum-exp and the top token."""
        llm.reset()
        llm.eval(row)
        raw = np.asarray(llm.scores[:len(row) - 1], dtype=np.float32)
        z = raw.astype(np.float64)
        return z, torch.logsumexp(torch.from_numpy(z), dim=1).numpy(), raw.argmax(axis=1)

    n, width = rows.shape[0], rows.shape[1] - 1
    kl = {m: np.empty((n, width)) for m in names}
    same = {m: np.empty((n, width), dtype=bool) for m in names}
    nll = {m: np.empty(n) for m in names}
    ref_nll = np.empty(n)
    folder = s.run / "partial"
    key = partial_key(s, names, rows)
    saved = _load_partial(folder, size, key, names, n, width)
    first = 0
    if saved is not None:
        first, arrays = saved
        ref_nll[:first] = arrays["ref_nll"]
        for m in names:
            kl[m][:first], same[m][:first] = arrays[f"kl/{m}"], arrays[f"same/{m}"].astype(bool)
            nll[m][:first] = arrays[f"nll/{m}"]
        log(f"{size}: resuming at example {first} of {n} from the saved scores")

    def save(done: int) -> None:
        folder.mkdir(exist_ok=True)
        arrays = {"ref_nll": ref_nll[:done].copy()}
        for m in names:
            arrays.update({f"kl/{m}": kl[m][:done].copy(), f"same/{m}": same[m][:done].astype(np.uint8),
                           f"nll/{m}": nll[m][:done].copy()})
        # data first, then the record naming it: a kill between them leaves an old record, which the shape check
        # or the key refuses, never a record of data that is not there
        write_file(folder / f"{size}.safetensors", lambda tmp: save_file(arrays, str(tmp)))
        write_json(folder / f"{size}.json", {"key": key, "names": names, "done": done, "of": n})
        keep_state(s)

    ref, models = load(s.gguf("ref-f32")), {m: load(s.gguf(m)) for m in names}
    start = time.perf_counter()
    for i in range(first, n):
        row = rows[i].tolist()
        z_ref, lse_ref, top_ref = logits(ref, row)
        at = (np.arange(width), np.asarray(row[1:]))
        lp_ref = z_ref - lse_ref[:, None]
        ref_nll[i] = -lp_ref[at].mean()
        p_ref = np.exp(lp_ref)
        # KL(ref || m) per position = sum_v p_ref (lp_ref - z + lse) = sum p_ref lp_ref - p_ref . z + lse * sum p_ref:
        # the same float64 sum as materialising m's log-softmax (to 1e-12, tests/test_llama_cpp_curve.py), one pass
        # over the vocabulary fewer per file; 1.01-1.05x in benchmarks/bench_kl_scoring.py, the log-sum-exp dominates
        h_ref, mass = np.einsum("ij,ij->i", p_ref, lp_ref), p_ref.sum(axis=1)
        for m, llm in models.items():
            z, lse, top = logits(llm, row)
            kl[m][i] = h_ref - np.einsum("ij,ij->i", p_ref, z) + lse * mass
            same[m][i] = top == top_ref
            nll[m][i] = lse.mean() - z[at].mean()
        if (i + 1) % save_every == 0 and i + 1 < n:
            save(i + 1)
            log(f"  {i + 1} examples, {time.perf_counter() - start:.0f} s (saved)")
    for llm in (ref, *models.values()):
        llm.close()
    bad = [m for m in names if not (np.isfinite(kl[m]).all() and np.isfinite(nll[m]).all())]
    if bad or not np.isfinite(ref_nll).all():
        raise SystemExit(f"{size}: non-finite KL or NLL for {', '.join(bad) or 'the reference'}; nothing written")
    (s.run / "scores").mkdir(exist_ok=True)
    for m in names:
        frame = pd.DataFrame({"kl": kl[m].mean(axis=1), "nll": nll[m], "ref_nll": ref_nll,
                              "same_top": same[m].mean(axis=1), "bytes": s.gguf(m).stat().st_size})
        write_file(s.run / "scores" / f"{m}.safetensors", lambda tmp, m=m: save_file(
            {"kl": kl[m].astype(np.float32), "same_top": same[m].astype(np.uint8)}, str(tmp)))
        write_file(s.run / "scores" / f"{m}.parquet", lambda tmp, frame=frame: frame.to_parquet(tmp))
    for ext in ("json", "safetensors"):
        (folder / f"{size}.{ext}").unlink(missing_ok=True)



# The scoring code's text, read once when this module is imported. inspect.getsource reads the file again at each
# call, at the line numbers the running code came from: a run that computed a key after the file had been edited
# keyed its scores with other lines (Gemma's first 64 Q3_K_M examples were rescored for that), and a key must name
# the code that computed the scores.
SCORING_SOURCE = inspect.getsource(score_group)

def file_names(s: Setup, size: str, record: dict[str, Any]) -> list[str]:
    names = [curve.stem(curve.PLAIN, size)] + [curve.stem(k, size, seed) for seed in s.seeds
                                               for k in curve.BASELINES.values()]
    return names + [curve.stem(arm, size, seed) for arm in curve.ARMS for seed in s.seeds
                    if record[curve.stem(arm, size, seed)]["fits"]]


def record_names(s: Setup, size: str, record: dict[str, Any]) -> list[str]:
    """The tensor-type records of ``size``: one per mix kind (:func:`write_size_records`), one per plan that fits."""
    plans_made = [curve.stem(arm, size, seed) for arm in curve.ARMS for seed in s.seeds]
    return [f"{kind}-{size}" for kind in (curve.PLAIN, *curve.BASELINES.values())] + [
        name for name in plans_made if record[name]["fits"]]


def phase_scores(s: Setup, rows: Any, record: dict[str, Any]) -> None:
    """Size by size: its plans' GGUF files made again where a resumed run lacks them, its unscored files scored,
    its tensor types recorded (``tensor_types/``), and the state kept; only ``s.score_sizes`` when named."""
    for size in s.sizes if s.score_sizes is None else s.score_sizes:
        if size_done(s, size):
            continue
        for arm in curve.ARMS:
            for seed in s.seeds:
                remake_plan(s, arm, size, seed, record)
        todo = [n for n in file_names(s, size, record) if not (s.run / "scores" / f"{n}.parquet").exists()]
        if todo:
            log(f"{size}: scoring {len(todo)} files on {len(rows)} held-out examples")
            score_group(s, todo, rows.tokens, size)
        write_size_records(s, size, s.run / "tensor_types", record)
        keep_state(s)


# ---------------------------------------------------------------------------------------
# Phase 6: the analysis and the committed data


def load_scores(folder: Path, names: list[str]) -> dict[str, curve.FileScores]:
    from safetensors.numpy import load_file

    out = {}
    for name in names:
        frame = pd.read_parquet(folder / f"{name}.parquet")
        arrays = load_file(str(folder / f"{name}.safetensors"))
        out[name] = curve.FileScores(frame["kl"].to_numpy(), arrays["kl"].astype(np.float64),
                                     arrays["same_top"].astype(bool), int(frame["bytes"].iloc[0]))
    return out


def design_of(reg: dict[str, Any], sizes: dict[str, Any], record: dict[str, Any], n_boot: int | None = None,
              mc_seeds: tuple[int, ...] = tuple(range(1, 21))) -> curve.Design:
    seeds = reg["calibration"]["seeds"]
    no_plan = {size: [arm for arm in curve.ARMS if not all(record[curve.stem(arm, size, s)]["fits"] for s in seeds)]
               for size in sizes["sizes"]}
    return curve.Design(list(sizes["sizes"]), {k: v["judged"] for k, v in sizes["sizes"].items()}, seeds,
                        n_boot or reg["n_boot"], mc_seeds, no_plan)


def analyse(s: Setup, scores_folder: Path | None = None) -> dict[str, Any]:
    sizes, record = _read(s.run / "sizes.json"), _read(s.run / "plans.json")
    design = design_of(s.reg, sizes, record, s.reg["n_boot"], s.mc_seeds)
    names = [n for size in s.sizes for n in file_names(s, size, record)]
    scores = load_scores(scores_folder or s.run / "scores", names)
    predicted = {n: r["predicted_kl"] for n, r in record.items() if r["fits"] and n in scores}
    start = time.perf_counter()
    result = curve.analyse_model(scores, design, predicted)
    digests = {p.name: _sha256(p) for p in sorted([*s.run.glob("imatrix-*.gguf"), *s.run.glob("sensitivity-*")])}
    return {"registration": NAME, "registration_sha256": s.sha, "model": s.model, "sizes": sizes,
            "seeds": s.seeds, "n_boot": design.n_boot, "mc_seeds": list(design.mc_seeds), **result, "plans": record,
            "digests": digests, "imatrix_seconds": {p.stem: _read(p)["seconds"] for p in s.run.glob("imatrix-*.json")},
            "analysis_seconds": time.perf_counter() - start, "examples": _read(s.run / "examples.json"),
            "run": _read(s.run / "run.json"), "environment": plans.environment()}


def write_size_records(s: Setup, size: str, folder: Path, record: dict[str, Any]) -> list[Path]:
    """Per-tensor types and bytes (:func:`llama_cpp_curve_tensors.tensor_record`) of every mix kind and size and of
    every plan file that fits, as ``folder/<stem>.json``: the page's "where the bits go" tables are made from these,
    never from ``runs/``.

    One record per mix kind and size (``mix_plain-Q4_K_M.json``, ``mix_interp_imatrix-Q4_K_M.json``, ...): the
    plain mix and every seed's importance-matrix mixes of a size hold the same tensors, types and bytes
    (llama-quantize's mix rule for the K-quant mixes does not read the importance matrix). Verified on SmolLM2's
    run (all 9 sizes, each size's 6 importance-matrix files equal to its plain mix, 2026-12-05) and on the dry run;
    a file that differs is refused here rather than recorded under another's name."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    plain = curve.stem(curve.PLAIN, size)
    held = tensors.gguf_tensors(s.gguf(plain))
    for kind in (curve.PLAIN, *curve.BASELINES.values()):
        names = [plain] if kind == curve.PLAIN else [curve.stem(kind, size, seed) for seed in s.seeds]
        for name in names:
            if tensors.gguf_tensors(s.gguf(name)) != held:
                raise SystemExit(f"{name}.gguf holds other tensor types or bytes than {plain}.gguf; the "
                                 "tensor-type records assume a size's mixes share them")
        written.append(folder / f"{kind}-{size}.json")
        write_json(written[-1], tensors.tensor_record(s.gguf(names[0]), names))
    for arm in curve.ARMS:
        for seed in s.seeds:
            name = curve.stem(arm, size, seed)
            if record[name]["fits"]:
                written.append(folder / f"{name}.json")
                write_json(written[-1], tensors.tensor_record(s.gguf(name)))
    return written


def publish(s: Setup, result: dict[str, Any], out: Path) -> None:
    """Copy the run's kept files (:data:`KEPT`: the scores, plans, records, importance matrices, sensitivities and
    every file's tensor types, ``tensor_types/``) and the result to ``out`` (docs/data/...)."""
    copy_kept(s.run, out)
    write_json(out / "result.json", sanitize(result))


def run_model(s: Setup, write: bool) -> dict[str, Any]:
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(s.binary))  # before anything imports llama_cpp
    # One scoring thread unless told: llama.cpp's logits are the same bits with 1 or 2 threads (SmolLM2's
    # reference, Q4_K_M and Q2_K files; tests/test_llama_cpp_curve.py on the tiny model), and on 2 shared cores
    # its 2 threads spin at each barrier while the other waits for a core: 1-9 s an example where 1 thread
    # took 0.5 s (SmolLM2, load 4.5, 2026-12-05).
    os.environ.setdefault("LLAMA_THREADS", "1")
    s.run.mkdir(parents=True, exist_ok=True)
    restore_state(s)
    record_start(s)
    sizes = phase_mixes(s)
    keep_state(s)
    log(f"sizes judged: {[k for k, v in sizes['sizes'].items() if v['judged']]}")
    model = interp.load_model(str(s.source) if s.model == "dry-run" else s.model)
    rows, calibration = examples(s, model.tokenizer)
    phase_imatrices(s, model, calibration)
    keep_state(s)
    phase_imatrix_mixes(s)
    sens = phase_sensitivity(s, model, calibration)
    keep_state(s)
    del model
    record = phase_plans(s, sens)
    phase_scores(s, rows, record)
    if s.score_sizes is not None:
        log(f"scored {', '.join(s.score_sizes)}; the analysis waits for a run over every size")
        return {"scored": s.score_sizes}
    result = analyse(s)
    write_json(s.run / "result.json", sanitize(result))
    if write:
        publish(s, result, OUT / s.model)
    elif s.model == "dry-run":  # the --write path too, into the dry run's own folder
        publish(s, result, s.run / "written")
    log(json.dumps({arm: {k: v for k, v in counts.items() if v} for arm, counts in result["headline"].items()}))
    return result


def dry_registration(reg: dict[str, Any]) -> dict[str, Any]:
    """The registration scaled down for ``--dry-run``: a tiny model, 2 sizes, 8 held-out and 8 calibration
    examples per seed, 2 seeds, 200 resamples (every rule as registered)."""
    dry = copy.deepcopy(reg)
    dry["models"] = {"dry-run": {"reference": "tests/tiny_gguf.py's tiny random llama", "sizes": ["Q2_K", "Q4_K_M"]}}
    dry["heldout"].update(n=8)
    dry["calibration"].update(n=8, seeds=[41, 42])
    dry["n_boot"] = 200
    return dry


def setup(model: str, run: Path | None, binary: Path, dry: bool, keep: Path | None = None) -> Setup:
    reg, sha = plans.registration(NAME)
    if dry:
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_gguf import write_tiny_gguf

        run = run or Path(tempfile.mkdtemp(prefix="llama-cpp-curve-dry-"))
        run.mkdir(parents=True, exist_ok=True)
        source = run / "tiny.gguf"
        if not source.exists():
            write_tiny_gguf(source)
        reg = dry_registration(reg)
        return Setup(reg, sha, "dry-run", source, reg["models"]["dry-run"]["sizes"], binary, run, None, (1, 2, 3),
                     keep)
    from interp.models import _bundled_gguf

    if model not in reg["models"]:
        raise SystemExit(f"--model {model}: the registration names {', '.join(reg['models'])}")
    source = _bundled_gguf(model)
    return Setup(reg, sha, model, source, list(reg["models"][model]["sizes"]), binary,
                 run or ROOT / "runs" / NAME / model, registered_limit(reg, model, source), keep=keep or OUT / model)


def chosen_sizes(text: str, sizes: list[str], write: bool) -> list[str]:
    """``--sizes``: the sizes named, each one of the model's, in the order given; refused before any work."""
    if write:
        raise SystemExit("--sizes scores part of the curve and analyses nothing, so there is nothing to --write; "
                         "run without --sizes once every size is scored")
    named = [z.strip() for z in text.split(",") if z.strip()]
    unknown = [z for z in named if z not in sizes]
    if not named or unknown or len(set(named)) != len(named):
        raise SystemExit(f"--sizes {text!r}: name each size once, from {', '.join(sizes)}")
    return named


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a model of the registration")
    parser.add_argument("--run", default=None, help="working folder (default runs/llama-cpp-curve-1/MODEL; "
                        "--dry-run: a new temporary folder)")
    parser.add_argument("--write", action="store_true", help="copy the results to docs/data (not with --dry-run)")
    parser.add_argument("--dry-run", action="store_true", help="every phase on a tiny GGUF in minutes")
    parser.add_argument("--sizes", default=None, help="score only these sizes (comma-separated, e.g. Q6_K,Q5_K_M) "
                        "and analyse nothing: a second process on another core, in the same run folder")
    parser.add_argument("--keep", default=None, help="where the run's small files are kept as it goes and restored "
                        "from on a resume (default docs/data/prescribe/llama-cpp/llama-cpp-curve-1/MODEL; --dry-run: "
                        "none unless named)")
    args = parser.parse_args(argv)
    binary = Path(os.environ.get("LLAMA_CPP_BIN", ""))
    if not all((binary / tool).is_file() for tool in ("llama-quantize", "llama-imatrix")):
        raise SystemExit("set LLAMA_CPP_BIN to the folder holding llama-quantize, llama-imatrix and libllama.so")
    if args.dry_run and args.write:
        raise SystemExit("--dry-run writes to its own folder only")
    s = setup(args.model, Path(args.run) if args.run else None, binary, args.dry_run,
              Path(args.keep) if args.keep else None)
    if args.sizes is not None:
        s.score_sizes = chosen_sizes(args.sizes, s.sizes, args.write)
    start = time.perf_counter()
    result = run_model(s, args.write)
    log(f"{s.model}: done in {time.perf_counter() - start:.0f} s ({s.run})")
    return result


if __name__ == "__main__":
    main()
