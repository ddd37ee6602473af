"""Every quantized model of the survival registration, in the order the run measures them, and how each is made.

A :class:`Entry` is one quantized model of one reference: a method spec (free, calibrated or anchor) with one
instance per calibration seed, one of llama.cpp's mixes, or a registered plan with one instance per plan file.
The headline rows come first, so a run stopped early has the rows the verdicts need.

Example:
    >>> from interp.report.survival.roster import roster
    >>> [e.label for e in roster("gemma3-270m")][:3]
    ['rtn:bits=3,group=64', 'nf:bits=3,group=64', 'hqq:bits=3,group=64']
"""

from __future__ import annotations

import gc
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from interp.errors import InterpError, ToolError
from interp.report.survival.registration import REPO, check_model, registration

__all__ = ["Entry", "make", "roster"]


@dataclass(frozen=True)
class Entry:
    """One quantized model: ``label`` as the page names it, ``kind``, and its instances (seeds or plan files)."""

    label: str
    kind: str  # "free" | "calibrated" | "anchor" | "mix" | "plan"
    spec: str  # the method spec, or the llama.cpp mix the file is made with
    instances: tuple[str, ...]  # "seed61"..., "31".. (plan seeds), or ("only",)
    headline: bool

    def ids(self) -> list[str]:
        """One raw-data id per instance: ``label`` alone for a single instance, ``label@instance`` otherwise."""
        return [self.label if i == "only" else f"{self.label}@{i}" for i in self.instances]


def roster(model: str, path: Any = None) -> list[Entry]:
    """The registered quantized models of ``model``, headline first (then secondary, then the anchor)."""
    check_model(model)
    reg = registration(path)
    q = reg["quantized_models"]
    headline = set(reg["quantized_models"]["headline"][model])
    seeds = tuple(f"seed{s}" for s in q["calibration"]["seeds"])
    entries = [Entry(s, "free", s, ("only",), s in headline) for s in q["free_specs"]]
    entries += [Entry(s, "calibrated", s, seeds, s in headline) for s in q["calibrated_specs"]]
    entries += [Entry(s, "anchor", s, ("only",), False) for s in q["anchor_specs"]]
    entries += [Entry(f"llama.cpp {m}", "mix", m, ("only",), f"llama.cpp {m}" in headline)
                for m in q["llama_cpp"]["mixes"]]
    plans = q["plans"][model]
    for mix in q["llama_cpp"]["mixes"]:
        files = plans.get(mix)
        if isinstance(files, str) and "{" in files:
            names = files[files.index("{") + 1:files.index("}")].split(",")
            entries.append(Entry(f"plan {mix}", "plan", mix, tuple(names), f"plan {mix}" in headline))
    return sorted(entries, key=lambda e: (not e.headline, e.kind == "anchor"))


def plan_file(model: str, mix: str, instance: str, path: Any = None) -> Path:
    """The registered plan file of ``mix`` and seed ``instance``, checked against its registered SHA-256."""
    plans = registration(path)["quantized_models"]["plans"][model]
    pattern = plans[mix]
    file = REPO / (pattern[:pattern.index("{")] + instance + pattern[pattern.index("}") + 1:])
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    wanted = plans["sha256"][f"plan-{mix}-{instance}"]
    if digest != wanted:
        raise InterpError(f"{file} has SHA-256 {digest[:12]}..., the registration says {wanted[:12]}...: the plan "
                          "changed after registration")
    return file


def make(reference: Any, model: str, entry: Entry, instance: str, work: Path, build: Path | None,
         path: Any = None, progress: bool | None = None) -> Any:
    """The quantized model of ``entry``'s ``instance``: quantized through the disk cache, or a llama.cpp file made
    by ``llama-quantize`` (``build``) and loaded as every GGUF is."""
    from interp.data import load_examples
    from interp.models import cache_dir, load_model
    from interp.quant.apply import quantize_cached

    reg = registration(path)
    if entry.kind in ("free", "anchor", "calibrated"):
        calibration = None
        if entry.kind == "calibrated":
            cal = reg["quantized_models"]["calibration"]
            calibration = load_examples(cal["data"], reference.tokenizer, n=cal["n"], seq_len=cal["seq_len"],
                                        seed=int(instance.removeprefix("seed")), split=cal["split"])
        return quantize_cached(reference, entry.spec, calibration, cache_dir=cache_dir() / "quantized",
                               progress=progress, batch_size=8)
    if build is None:
        raise ToolError(f"{entry.label} is made by llama-quantize: name a llama.cpp build (--llama-cpp DIR or "
                        "LLAMA_CPP_BIN; `make llama-cpp` builds one)")
    from interp.quant import llama_cpp_run as run

    work.mkdir(parents=True, exist_ok=True)
    source = run.gguf_source(model)
    if source is None:
        raise ToolError(f"{model} has no GGUF file for llama-quantize to start from")
    f32 = work / "reference-f32.gguf"
    if not f32.is_file():
        run.quantize(build, source, f32, "F32", "--allow-requantize")
    flags: list[str] = []
    name = f"{entry.spec}.gguf"
    if entry.kind == "plan":
        flags = ["--tensor-type-file", str(plan_file(model, entry.spec, instance, path))]
        name = f"plan-{entry.spec}-{instance}.gguf"
    target = work / name
    if not target.is_file():
        run.quantize(build, f32, target, entry.spec, *flags)
    gc.collect()
    return load_model(str(target))
