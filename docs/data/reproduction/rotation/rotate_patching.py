"""Rotated selection for the patching step of a confirmatory registration: post hoc, exploratory.

The registration selects D_large on calibrated instance 0 and patches on instances 1-5. Here every instance j
selects in turn (the top 10% of its own recorded per-example error, as ``selection_rotation`` on
docs/reproduction.md), and the patching step runs on the next instance, (j + 1) mod 6, so no set is measured
on the instance that picked it. The measured models are quantized again from their calibration samples on the
machine that runs this (the run's own models are not kept), so each is another draw of its instance; each
patching result records its own quantized and reference NLL, as the run's steps do.

    python docs/data/reproduction/rotation/rotate_patching.py \
        docs/preregistration/smollm2-confirmatory-2.json docs/data/reproduction/smollm2-confirmatory-2/raw \
        --out docs/data/reproduction/rotation/smollm2-confirmatory-2

writes ``selector<j>.json`` (the selected ids and every per-example array, resumable: a finished selector is
skipped) and ``summary.csv`` (per selector and component: recovery on the NLL scale with a 95% bootstrap
interval over the selected examples). Not a verdict: the registration fixed instance 0 as the selector.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

COMPONENTS = ("down", "gate", "up", "attn_out")


def selected_sets(p, raw: Path) -> tuple[list[str], list[list[str]]]:
    from interp.data import Examples
    from interp.report import confirm
    from interp.stats import top_count

    ids = json.loads((raw / "examples.json").read_text())["ids"]
    errors = confirm._errors(confirm._Folder(raw), p, Examples.from_tokens(
        torch.zeros(len(ids), 2, dtype=torch.long), ids=ids))
    k = top_count(len(ids), p.top)
    sets = []
    for j in range(len(p.calibration_seeds)):
        e = errors[confirm._label(p.patched_spec, j)].to_numpy(dtype=float)
        sets.append([ids[i] for i in np.argsort(-e, kind="stable")[:k]])
    return ids, sets


def summarise(out: Path, registered: set[str], n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    from interp.report import confirm

    rows = []
    for path in sorted(out.glob("selector*.json")):
        data = json.loads(path.read_text())
        n = len(data["ids"])
        boot = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
        for comp in COMPONENTS:
            point = float(confirm._recovery(data, np.arange(n)[None, :], comp)[0])
            low, high = np.percentile(confirm._recovery(data, boot, comp), [2.5, 97.5])
            rows.append({"selector": data["selector"], "measured on": data["measured"], "examples": n,
                         "overlap with registered D_large": round(len(registered & set(data["ids"]))
                                                                  / len(registered | set(data["ids"])), 4),
                         "component": comp, "recovery_nll": point, "low": float(low), "high": float(high)})
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("registration")
    parser.add_argument("raw")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import interp
    from interp.io import write_json
    from interp.localize.patching import patching_table
    from interp.quant.apply import quantize_cached
    from interp.report import confirm
    from interp.runtime.batching import cpu_identity, kernels

    p = confirm.Preregistration.load(args.registration)
    raw, out = Path(args.raw), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ids, sets = selected_sets(p, raw)
    model = interp.load_model(p.model)
    examples = confirm.heldout_examples(model.tokenizer, p)
    if list(examples.ids) != ids:
        raise SystemExit(f"{raw} holds other examples than {args.registration} draws")
    position = {e: i for i, e in enumerate(ids)}
    n_inst = len(p.calibration_seeds)
    for j in range(n_inst):
        path = out / f"selector{j}.json"
        if path.exists():
            continue
        m = (j + 1) % n_inst
        cal = interp.load_examples(p.data, model.tokenizer, n=p.calibration_n, seq_len=p.seq_len,
                                   seed=p.calibration_seeds[m], split="calibration")
        quantized = quantize_cached(model, p.patched_spec, cal, progress=False, batch_size=p.batch_size)
        subset = examples.subset([position[e] for e in sets[j]])
        result = patching_table(model, quantized, subset, batch_size=p.batch_size, progress=False)
        write_json(path, {"selector": j, "measured": m, "ids": sets[j], "kernels": kernels("cpu"),
                          "cpu": cpu_identity(), "threads": torch.get_num_threads(),
                          "target": confirm._arrays(result.target), "source": confirm._arrays(result.source),
                          "patched": {pt.component: confirm._arrays(result.values[i])
                                      for i, pt in enumerate(result.patches)}})
        print(f"selector {j} measured on instance {m}: done", flush=True)
    registered = set(json.loads((raw / "split.json").read_text())["large"])
    summarise(out, registered).to_csv(out / "summary.csv", index=False)


if __name__ == "__main__":
    main()
