"""The survival study's resumable run: every raw number the registered statistics read, for one model.

    python -m interp.report.survival.run --model smollm2-135m --out docs/data/survival/survival-1/smollm2-135m \\
        --stages induction,circuits --llama-cpp .venv/llama.cpp/build/bin

Layout of ``--out`` (each file written whole through interp's writer; a file that exists is done, so a killed run
resumes at the first missing file):

- ``meta.json``: the registration's name and SHA-256, and every (re)start with its commit, CPU, kernels, threads;
- ``units.json``: the token set, the prompt sets (candidate indices, filter values, readings);
- ``sequences.safetensors``: the selection and measurement sequences;
- ``induction/<id>.safetensors``: ``pm``, ``cp`` ``[sequences, layers, heads]`` (the reference also on the
  selection sequences);
- ``circuits/<task>-reference.parquet``: the reference circuit's top edges (``interp.localize.circuit.circuit``);
- ``circuits/<task>/<id>.safetensors``: ``effects [edges, pairs]`` and ``clean [pairs]`` on the measurement pairs;
- ``models.json``: each quantized instance's weights digest, where it was made and the stages measured on it
  (an instance made again with other weights keeps the earlier record under ``earlier``; a stage measured again
  on the weights in hand, ``--remeasure``, moves from an earlier record's ``stages`` to its ``superseded``).

``<id>`` is ``reference``, a label (``rtn:bits=3,group=64``) or ``label@instance`` (``gptq:bits=3,group=64@seed61``),
made file-safe by :func:`~interp.report.survival.registration.file_name`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from interp.errors import DataError, InterpError, exit_status
from interp.io import write_json, write_parquet, write_safetensors
from interp.report.survival import circuits as cc
from interp.report.survival import units
from interp.report.survival.induction import induction_scores
from interp.report.survival.registration import check_model, file_name, registration, sha256
from interp.report.survival.roster import make, roster

STAGES = ("induction", "circuits", "features")
TASKS = ("ioi", "capitals")
VARIANTS = {"named": ("gate", "down"), "control": ("up", "q", "k", "v", "o")}  # the registration's two variants


def tie_labels() -> list[str]:
    """The roster labels whose instances the localization tie restores (``"gptq:... (all 5 instances)"`` -> label)."""
    return [m.split(" (")[0] for m in registration()["localization_tie"]["methods"]]


class Folder:
    """The run's output folder: paths, and steps that run only when their file is missing."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)

    def path(self, *parts: str) -> Path:
        return self.out.joinpath(*parts)

    def tensors(self, path: Path, make_them: Callable[[], dict[str, Any]], again: bool = False
                ) -> dict[str, torch.Tensor]:
        """Load ``path`` if it exists (unless ``again``), else make the tensors, write them whole, and return them."""
        from safetensors.torch import load_file

        if path.is_file() and not again:
            return load_file(str(path))
        # host: numpy results written to a file
        made = {k: torch.as_tensor(np.ascontiguousarray(v)) for k, v in make_them().items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_safetensors(path, made)
        return made


@contextlib.contextmanager
def _folder_lock(folder: Folder) -> Any:
    """Hold an exclusive lock on the run folder while a shared record is read, changed and written: two runs of
    one model on disjoint rows (``--only``) may share a folder, and neither may lose the other's entry. The lock
    is on the folder itself, so no lock file joins the committed data."""
    fd = os.open(folder.out, os.O_RDONLY)  # Folder made it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _start_record(folder: Folder, model: str) -> None:
    from interp.report.confirm_run import _commit
    from interp.runtime.batching import cpu_identity, kernels

    path = folder.path("meta.json")
    reg = registration()
    with _folder_lock(folder):
        meta = json.loads(path.read_text()) if path.is_file() else {"registration": reg["name"], "model": model,
                                                                     "registration_sha256": sha256(), "starts": []}
        if meta.get("registration_sha256") != sha256() or meta.get("model") != model:
            raise InterpError(f"{folder.out} holds a run of another registration or model "
                              f"({meta.get('registration')}, {meta.get('model')}); give this run its own --out folder")
        done = sorted(str(p.relative_to(folder.out)) for p in folder.out.rglob("*.safetensors"))
        meta["starts"].append({"commit": _commit(), "cpu": cpu_identity(), "kernels": kernels("cpu"),
                               "threads": torch.get_num_threads(),
                               "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "files_done": len(done)})
        write_json(path, meta)


def _token_set(folder: Folder, model: str, reference: Any) -> list[int]:
    path = folder.path("token_set.json")
    if path.is_file():
        return list(json.loads(path.read_text())["ids"])
    from interp.documents import wiki_documents
    from interp.quant.llama_cpp_run import gguf_source

    spec = registration()["induction"]["sequences"]
    size = int(re.search(r"the ([\d,]+) token ids", spec["token_set"]).group(1).replace(",", ""))  # type: ignore[union-attr]
    tok = reference.tokenizer
    counts = units.token_counts(tok, [d.text for d in wiki_documents()])
    ids = units.token_set(counts, tok.all_special_ids, units.gguf_token_types(gguf_source(model)), size)
    write_json(path, {"ids": ids, "size": size, "distinct_in_text": len(counts)})
    return ids


def _sequences(folder: Folder, reference: Any, ids: list[int]) -> dict[str, torch.Tensor]:
    from interp.data import bos_token_id

    spec = registration()["induction"]["sequences"]
    bos = bos_token_id(reference.tokenizer)
    return folder.tensors(folder.path("sequences.safetensors"), lambda: {
        part: units.repeated_sequences(ids, bos, spec["R"], spec[part]["n"], spec[part]["seed"])
        for part in ("selection", "measurement")})


def _pairs(folder: Folder, reference: Any, task: str) -> tuple[units.Pairs, dict[str, Any]]:
    """The task's candidates and the reference's sets (``selection``, ``measurement`` indices, ``reading``)."""
    spec = registration()["circuits"]["tasks"][task]
    tok = reference.tokenizer
    pairs = units.ioi_candidates(tok, spec) if task == "ioi" else units.capital_candidates(tok, spec)
    path = folder.path("circuits", f"{task}-sets.json")
    if path.is_file():
        return pairs, json.loads(path.read_text())
    kept, seen = cc.passing(reference, pairs, both_ways=task == "capitals", needed=64 + 128)
    selection, measurement, reading = units.reference_sets(kept)
    sets = {"candidates": len(pairs), "passing": kept, "filter_values": seen, "selection": selection,
            "measurement": measurement, "reading": reading}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, sets)
    return pairs, sets


def _reference_circuit(folder: Folder, reference: Any, task: str, pairs: units.Pairs, sets: dict[str, Any]
                       ) -> pd.DataFrame:
    path = folder.path("circuits", f"{task}-reference.parquet")
    if path.is_file():
        return pd.read_parquet(path)
    from interp.localize.circuit import circuit

    rc = registration()["circuits"]["reference_circuit"]["pipeline"]
    top_k, movers = int(re.search(r"top_k=(\d+)", rc).group(1)), int(re.search(r"movers=(\d+)", rc).group(1))  # type: ignore[union-attr]
    sel = pairs.take(sets["selection"])
    # host: token ids; circuit() moves them with each batch
    res = circuit(reference, sel.clean, sel.corrupt, torch.as_tensor(sel.answers), torch.as_tensor(sel.wrongs),
                  top_k=top_k, movers=movers, ig_steps=1, batch_size=8)
    effects, _ = cc.edge_effects(reference, sel.clean, sel.corrupt, sel.answers, sel.wrongs, res.confirmed)
    table = res.confirmed.copy()
    table["selection_effect"] = effects.mean(axis=1)
    table["movers"] = ", ".join(res.movers)
    write_parquet(path, table)
    write_safetensors(folder.path("circuits", f"{task}-selection-reference.safetensors"),
                      {"effects": torch.as_tensor(effects)})  # host: numpy results written to a file
    return table


def measure(folder: Folder, model: Any, unit_id: str, stages: Sequence[str], context: dict[str, Any],
            again: Sequence[str] = ()) -> None:
    """Every stage's raw numbers for one model (the reference or a quantized instance), skipping what exists, except
    the stages named in ``again``, which are measured again and replace their files."""
    name = file_name(unit_id)
    if "induction" in stages:
        seqs, ids = context["sequences"], context["token_set"]

        def scores() -> dict[str, Any]:
            pm, cp = induction_scores(model, seqs["measurement"], ids)
            out = {"pm": pm, "cp": cp}
            if unit_id == "reference":
                out["pm_selection"], out["cp_selection"] = induction_scores(model, seqs["selection"], ids)
            return out

        folder.tensors(folder.path("induction", f"{name}.safetensors"), scores, again="induction" in again)
    if "features" in stages and unit_id != "reference":
        from interp.report.survival.features import latent_survival

        latent_survival(context["reference"], model, context["saes"], context["held_out"], folder.out, unit_id,
                        context, again="features" in again)
    if "circuits" in stages:
        for task in TASKS:
            pairs, sets, edges = context["circuits"][task]
            if edges is None:
                continue
            m = pairs.take(sets["measurement"])

            def effects(m: Any = m, edges: Any = edges) -> dict[str, Any]:
                return dict(zip(("effects", "clean"),
                                cc.edge_effects(model, m.clean, m.corrupt, m.answers, m.wrongs, edges), strict=True))

            folder.tensors(folder.path("circuits", task, f"{name}.safetensors"), effects, again="circuits" in again)


def _done(folder: Folder, unit_id: str, stages: Sequence[str], context: dict[str, Any]) -> bool:
    name = file_name(unit_id)
    files = [folder.path("induction", f"{name}.safetensors")] if "induction" in stages else []
    if "circuits" in stages:
        files += [folder.path("circuits", t, f"{name}.safetensors") for t in TASKS if context["circuits"][t][2]
                  is not None]
    if "features" in stages:
        files += [folder.path("features", f"{name}-L{layer}.safetensors") for layer in context["saes"]]
    return all(f.is_file() for f in files)


def _record(folder: Folder, unit_id: str, model: Any, stages: Sequence[str], replaced: bool = False) -> None:
    """Keep the weights digest of the instance measured as ``unit_id``, with the stages measured on it.

    A quantizer that fits its weights (GPTQ, AWQ) gives other weights on another CPU from the same seed and rows,
    so an instance made again after its cache was lost, or on another machine, is another set of weights. Its
    earlier record is kept under ``earlier`` (nothing is lost) and the run says so: the raw data show which stage
    was measured on which weights. ``replaced``: the files of ``stages`` were measured again on these weights, so an
    earlier record's ``stages`` no longer have their files (moved to its ``superseded``)."""
    from interp.models import weights_digest
    from interp.runtime.batching import cpu_identity

    entry: dict[str, Any] = {"weights_sha256": weights_digest(model), "cpu": cpu_identity(),
                             "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "stages": sorted(stages)}
    path = folder.path("models.json")
    with _folder_lock(folder):
        record = json.loads(path.read_text()) if path.is_file() else {}
        prior = record.get(unit_id)
        if prior is not None and prior.get("weights_sha256") == entry["weights_sha256"]:
            entry = {**prior, "stages": sorted(set(prior.get("stages", [])) | set(stages))}
        elif prior is not None:
            earlier = prior.pop("earlier", [])
            entry["earlier"] = [*earlier, prior]
            print(f"note: {unit_id} was made again and its weights differ from the ones measured before "
                  f"(digest {entry['weights_sha256'][:12]}, before {str(prior.get('weights_sha256'))[:12]} on "
                  f"{prior.get('cpu')}): models.json keeps both, with the stages measured on each.",
                  file=sys.stderr, flush=True)
        for old in entry.get("earlier", []) if replaced else []:
            moved = set(stages) if old.get("stages") is None else set(old["stages"]) & set(stages)
            if moved:
                if old.get("stages") is not None:
                    old["stages"] = sorted(set(old["stages"]) - moved)
                old["superseded"] = sorted(set(old.get("superseded", [])) | moved)
        record[unit_id] = entry
        write_json(path, record)


def _stale(folder: Folder, unit_id: str, model: Any, stages: Sequence[str]) -> list[str]:
    """The ones of ``stages`` of ``unit_id`` that models.json does not show measured on ``model``'s weights (the one
    place that decides whether an instance's scores belong to the weights in hand): the tie's restored variants are
    derived from the weights in hand and compared with the instance's own scores, so both must come from the same
    weights. An entry made once and never made again predates per-stage records: its stages are its weights'."""
    from interp.models import weights_digest

    path = folder.path("models.json")
    entry = json.loads(path.read_text()).get(unit_id) if path.is_file() else None
    if entry is None or entry.get("weights_sha256") != weights_digest(model):
        return list(stages)
    if not entry.get("earlier"):
        return []
    return [s for s in stages if s not in entry.get("stages", [])]


def _measured_on(folder: Folder, unit_id: str, model: Any, stages: Sequence[str]) -> bool:
    """Whether every one of ``stages`` of ``unit_id`` was measured on ``model``'s weights (:func:`_stale`)."""
    return not _stale(folder, unit_id, model, stages)


def _variants(folder: Folder, reference: Any, quantized: Any, unit_id: str, stages: Sequence[str],
              context: dict[str, Any], again: Sequence[str] = ()) -> None:
    """The localization tie's two variants of one instance: the reference's gate and down weights restored in every
    layer ('named'), or its up, q, k, v and o ('control'), each measured like any model (id ``unit#variant``)."""
    from interp.localize.restoration import restore_layers
    from interp.runtime import hooks as hk

    layers = list(range(hk.n_layers(reference)))
    for name, roles in VARIANTS.items():
        variant_id = f"{unit_id}#{name}"
        if not again and _done(folder, variant_id, stages, context):
            continue
        restored = restore_layers(quantized, reference, layers, roles=list(roles))
        measure(folder, restored, variant_id, stages, context, again=again)
        del restored
        gc.collect()


def _wanted(entry: Any, unit_id: str, only: Sequence[str] | None) -> bool:
    """Whether ``--only`` names the instance ``unit_id`` of the roster row ``entry``: by the row's label or by id."""
    return only is None or entry.label in only or unit_id in only


def _named(entry: Any, only: Sequence[str] | None) -> bool:
    """Whether ``--only`` names the roster row ``entry``, by its label or by one of its instances' ids."""
    return any(_wanted(entry, u, only) for u in entry.ids())


def _measure_instance(folder: Folder, reference: Any, quantized: Any, unit_id: str, stages: Sequence[str],
                      context: dict[str, Any], variants: bool, remeasure: bool) -> None:
    """One quantized instance: its missing stages, with ``remeasure`` its stages measured on other weights, and with
    ``variants`` the tie's restored variants, only beside scores of the same weights."""
    missing = [s for s in stages if not _done(folder, unit_id, [s], context)]
    if missing:  # recorded first: a killed run resumes on the same (cached) weights at the first missing file
        _record(folder, unit_id, quantized, missing)
        measure(folder, quantized, unit_id, missing, context)
    stale = _stale(folder, unit_id, quantized, [s for s in stages if s not in missing]) if remeasure else []
    if stale:  # recorded after: a run killed half-way measures them again
        print(f"note: {unit_id}: measuring {', '.join(stale)} again on the weights in hand "
              f"({', '.join(stale)} {'was' if len(stale) == 1 else 'were'} measured on other weights)",
              file=sys.stderr, flush=True)
        measure(folder, quantized, unit_id, stale, context, again=stale)
        _record(folder, unit_id, quantized, stale, replaced=True)
    if variants:
        if _measured_on(folder, unit_id, quantized, stages):
            _variants(folder, reference, quantized, unit_id, stages, context, again=stale)
        else:
            print(f"note: {unit_id}'s restored variants are not measured: its {', '.join(stages)} scores were "
                  "measured on other weights (made on another CPU, models.json 'earlier'), and the tie "
                  "compares an instance with its own variants only", file=sys.stderr, flush=True)


def run(model_name: str, out: str | Path, stages: Sequence[str] = STAGES, only: Sequence[str] | None = None,
        build: Path | None = None, progress: bool | None = None, variants: bool = False, remeasure: bool = False
        ) -> Path:
    """Compute (or resume) the raw data of ``stages`` for ``model_name``, reference first, then every quantized
    instance of the registration (headline first), or only the rows and instances ``only`` names (a label, or one
    instance's id such as ``plan Q3_K_M@33``, so that two runs can share a row's instances); with ``variants``, also the
    localization tie's restored variants of the registered methods' instances. With ``remeasure``, a stage of a named
    instance that models.json shows measured on other weights (a fitted quantizer made again) is measured again on
    the weights in hand, its variants' too, so that the tie can compare the instance with its own variants."""
    from interp.models import cache_dir, load_model

    check_model(model_name)
    folder = Folder(Path(out))
    _start_record(folder, model_name)
    reference = load_model(model_name)
    context: dict[str, Any] = {"circuits": {}}
    if "induction" in stages:
        context["token_set"] = _token_set(folder, model_name, reference)
        context["sequences"] = _sequences(folder, reference, context["token_set"])
    if "circuits" in stages:
        for task in TASKS:
            pairs, sets = _pairs(folder, reference, task)
            edges = _reference_circuit(folder, reference, task, pairs, sets) if sets["reading"] != "not measured" \
                else None
            context["circuits"][task] = (pairs, sets, edges)
    if "features" in stages:
        if model_name != "smollm2-135m":
            raise DataError("the registration measures features on smollm2-135m only")
        from interp.report.survival.features import feature_rows, prepare_saes

        context["reference"] = reference
        context["saes"] = prepare_saes(reference, folder.out, cache_dir() / "survival-sae", registration(),
                                       progress=progress)
        context["held_out"] = feature_rows(reference.tokenizer, registration())["held_out"]
    measure(folder, reference, "reference", stages, context)
    entries = [e for e in roster(model_name) if _named(e, only)]
    if only is not None:  # the order the user named: the rows wanted first are measured first
        entries.sort(key=lambda e: min(list(only).index(n) for n in (e.label, *e.ids()) if n in only))
    for entry in entries:
        for instance, unit_id in zip(entry.instances, entry.ids(), strict=True):
            if not _wanted(entry, unit_id, only):
                continue
            wanted = [unit_id] + ([f"{unit_id}#{v}" for v in VARIANTS] if variants and entry.label in tie_labels()
                                  else [])
            if not remeasure and all(_done(folder, w, stages, context) for w in wanted):
                continue
            started = time.time()
            # the llama.cpp files are large and made again from the registered plans: they live in the cache
            quantized = make(reference, model_name, entry, instance, cache_dir() / "survival-gguf" / model_name, build,
                             progress=progress)
            _measure_instance(folder, reference, quantized, unit_id, stages, context,
                              variants and entry.label in tie_labels(), remeasure)
            print(f"{unit_id}: {time.time() - started:.0f} s", file=sys.stderr, flush=True)
            del quantized
            gc.collect()
    return folder.out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m interp.report.survival.run", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, choices=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--only", default=None,
                        help="labels of the roster, or instance ids (LABEL@INSTANCE), separated by ; (default: all)")
    parser.add_argument("--llama-cpp", default=None, help="llama.cpp's binaries (default $LLAMA_CPP_BIN)")
    parser.add_argument("--variants", action="store_true", help="also the localization tie's restored variants")
    parser.add_argument("--remeasure", action="store_true",
                        help="measure again, on the weights in hand, the stages of the --only instances that were "
                             "measured on other weights (models.json 'earlier'); their variants too")
    args = parser.parse_args(argv)
    from interp.quant.llama_cpp_run import find_build

    stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    def body() -> None:
        if unknown:
            raise DataError(f"unknown stage(s) {', '.join(unknown)}; the stages are {', '.join(STAGES)}")
        labels = {e.label for e in roster(args.model)}
        names = labels | {u for e in roster(args.model) for u in e.ids()}
        only = [s.strip() for s in args.only.split(";")] if args.only else None
        if args.remeasure and not only:
            raise DataError("--remeasure replaces committed scores: name the instances with --only")
        if only and set(only) - names:
            raise DataError(f"--only names {', '.join(sorted(set(only) - names))}, not in the roster: "
                            f"{'; '.join(sorted(labels))} (or one instance, LABEL@INSTANCE)")
        build = find_build(args.llama_cpp, need=("llama-quantize",))
        by_llama = [e.label for e in roster(args.model) if e.kind in ("mix", "plan") and _named(e, only)]
        if by_llama and build is None:  # refused here, not after the rows before them have been measured
            raise DataError(f"{'; '.join(by_llama)} {'is' if len(by_llama) == 1 else 'are'} made by llama-quantize: "
                            "name a llama.cpp build (--llama-cpp DIR or LLAMA_CPP_BIN; `make llama-cpp` builds one), "
                            "or leave them out with --only")
        run(args.model, args.out, stages, only, build, variants=args.variants, remeasure=args.remeasure)

    return exit_status(body)

if __name__ == "__main__":
    raise SystemExit(main())
