"""Where llama.cpp's mix spends bits that interp's plan does not (llama-cpp-curve-1, issue 47), measured from files.

Issue 47's "done when" asks, wherever the >=30% rule fails at a size, which tensors llama.cpp's mix spends bits
on that the plan does not. Both are GGUF files, so this reads what they hold:

- :func:`gguf_tensors`: every tensor of a file (name, ggml type, weights, bytes as stored), from its header.
- :func:`tensor_record`: that list and the file's size, the JSON ``benchmarks/llama_cpp_curve.py --write``
  commits under ``tensor_types/<file stem>.json`` (so the page is generated from committed data).
- :func:`bits_table`: a mix and a size's plans (one per calibration seed) grouped by role (token_embd, output,
  the seven block weights, norms/other) and, for the block weights, by third of the blocks. Per row: bits per
  weight (``8 * bytes / weights``) in the mix and in the plans (mean bytes over the seeds), the difference, and
  the row's share of the bytes the mix spends beyond the plans, over the rows where it spends more.

``docs/build_llama_cpp_curve.py`` renders the table for every judged size and arm whose verdict is not the goal;
``tests/test_llama_cpp_curve.py`` checks the bytes against a hand count and the file's size.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from interp.errors import DataError, SpecError

BLOCK_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
ROLES = ("token_embd", "output", *BLOCK_ROLES)
OTHER = "norms/other"
THIRDS = ("first", "middle", "last")
ALL = "all"
TOTAL = "total"


def gguf_tensors(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every tensor of a GGUF file in the file's order: ``name``, ``type`` (lowercase ggml type), ``weights``
    (number of elements) and ``bytes`` (as stored, without the alignment padding), from the header alone."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path), "r")
    except (OSError, ValueError) as error:
        raise SpecError(f"cannot read {path} as a GGUF file ({error})") from None
    return [{"name": t.name, "type": t.tensor_type.name.lower(), "weights": int(t.n_elements), "bytes": int(t.n_bytes)}
            for t in reader.tensors]


def tensor_record(path: str | os.PathLike[str], stands_for: Sequence[str] = ()) -> dict[str, Any]:
    """What ``tensor_types/<stem>.json`` holds for one file: its name, size and :func:`gguf_tensors`; ``stands_for``
    names other files with exactly these tensors (a mix kind's seeds)."""
    path = Path(path)
    return {"file": path.stem, "file_bytes": path.stat().st_size, "stands_for": list(stands_for),
            "tensors": gguf_tensors(path)}


def read_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def role_of(name: str) -> tuple[str, int | None]:
    """A tensor's row role and, for a block weight, its block: ``blk.3.ffn_down.weight`` -> ``("ffn_down", 3)``,
    ``token_embd.weight`` -> ``("token_embd", None)``; norms, biases and anything else -> ``("norms/other", None)``."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in BLOCK_ROLES:
        return parts[2], int(parts[1])
    if name in ("token_embd.weight", "output.weight"):
        return name.split(".")[0], None
    return OTHER, None


def n_blocks(tensors: Sequence[dict[str, Any]]) -> int:
    """One more than the largest block index of any ``blk.N.*`` tensor (0 without blocks)."""
    found = [int(t["name"].split(".")[1]) for t in tensors
             if t["name"].startswith("blk.") and t["name"].split(".")[1].isdigit()]
    return max(found) + 1 if found else 0


def third(layer: int, blocks: int) -> str:
    """``first``, ``middle`` or ``last``: block ``layer`` of ``blocks`` lies in third ``floor(3 layer / blocks)``
    (30 blocks: 0-9, 10-19, 20-29)."""
    return THIRDS[3 * layer // blocks]


def row_of(name: str, blocks: int) -> tuple[str, str]:
    role, layer = role_of(name)
    return role, ALL if layer is None else third(layer, blocks)


def row_order() -> list[tuple[str, str]]:
    return [("token_embd", ALL), ("output", ALL), *((r, t) for r in BLOCK_ROLES for t in THIRDS), (OTHER, ALL)]


def grouped(tensors: Sequence[dict[str, Any]], blocks: int) -> dict[tuple[str, str], dict[str, Any]]:
    """Weights, bytes and the count of each type per row."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for t in tensors:
        row = out.setdefault(row_of(t["name"], blocks), {"weights": 0, "bytes": 0, "types": Counter()})
        row["weights"] += t["weights"]
        row["bytes"] += t["bytes"]
        row["types"][t["type"]] += 1
    return out


def _types(counts: Counter) -> str:
    """``q4_0 x8, q5_k x2``: a row's types, most frequent first."""
    return ", ".join(f"{name} x{n}" for name, n in sorted(counts.items(), key=lambda x: (-x[1], x[0])))


def bits_table(mix: Sequence[dict[str, Any]], plans: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The mix against the plans (each a :func:`gguf_tensors` list; the plans are one size's seeds) by role and
    third of the blocks, in :func:`row_order`, rows that neither file holds left out, then a ``total`` row.

    Per row: ``weights``, ``mix_bytes``, ``plan_bytes`` (mean over the plans), ``mix_bits`` and ``plan_bits``
    (``8 * bytes / weights``), ``difference`` (mix - plan, bits per weight), ``extra_share``: the row's share of
    the bytes the mix spends beyond the plans, summed over the rows where the mix spends more (``None`` where it
    does not, and everywhere when it spends more nowhere), and ``mix_types``/``plan_types`` (types with their
    counts; the plans' summed over the seeds)."""
    if not plans:
        raise DataError("bits_table needs at least one plan file")
    shape = {t["name"]: t["weights"] for t in mix}
    for i, plan in enumerate(plans):
        if {t["name"]: t["weights"] for t in plan} != shape:
            raise DataError(f"plan {i} holds other tensors than the mix (names or numbers of weights differ); "
                            "a table needs files of one model")
    blocks = n_blocks(mix)
    ours, theirs = grouped(mix, blocks), [grouped(p, blocks) for p in plans]
    rows = []
    for key in row_order():
        if key not in ours:
            continue
        weights, mix_bytes = ours[key]["weights"], ours[key]["bytes"]
        plan_bytes = sum(g[key]["bytes"] for g in theirs) / len(theirs)
        rows.append({"role": key[0], "third": key[1], "weights": weights, "mix_bytes": mix_bytes,
                     "plan_bytes": plan_bytes, "mix_types": _types(ours[key]["types"]),
                     "plan_types": _types(sum((g[key]["types"] for g in theirs), Counter()))})
    weights, mix_total = sum(r["weights"] for r in rows), sum(r["mix_bytes"] for r in rows)
    plan_total = sum(r["plan_bytes"] for r in rows)
    extra = sum(max(r["mix_bytes"] - r["plan_bytes"], 0.0) for r in rows)
    for r in rows:
        more = r["mix_bytes"] - r["plan_bytes"]
        r["extra_share"] = more / extra if more > 0 else None
    rows.append({"role": TOTAL, "third": ALL, "weights": weights, "mix_bytes": mix_total, "plan_bytes": plan_total,
                 "mix_types": "", "plan_types": "", "extra_share": 1.0 if extra > 0 else None})
    for r in rows:
        r["mix_bits"] = 8 * r["mix_bytes"] / r["weights"] if r["weights"] else 0.0
        r["plan_bits"] = 8 * r["plan_bytes"] / r["weights"] if r["weights"] else 0.0
        r["difference"] = r["mix_bits"] - r["plan_bits"]
    return rows
