"""Does cross-method agreement rise with sequence length, as the noise argument predicts?

A per-example error averages ``T - 1`` token errors, so its measurement noise shrinks as T
grows, and the split-half reliability should follow the Spearman-Brown prophecy: if the
reliability at T-1 targets is ``rel``, at ``k`` times as many it is ``k rel / (1 + (k - 1) rel)``.
If the low agreement at T = 128 is mostly noise, agreement rises with T toward its
disattenuated value; if the methods truly disagree, it does not.

**One pass gives every length.** The models are causal: the NLL of target ``t`` does not depend
on later tokens, so the per-token errors of a row cut to ``T`` are the first ``T - 1`` of the
same row at the longest length. :func:`measure` scores once, at the longest length, and
:func:`table_from_tokens` reads every shorter length as a prefix: the same rows and the same
text at every length, by construction.

**Packed rows.** No bundled Wikipedia summary reaches 512 tokens (with SmolLM2's tokenizer the
eval split has 69 documents of at least 256 tokens, 4 of 384 and none of 512), so the rows are
whole documents joined end to end (:func:`interp.data.load_packed_examples`), as the paper's
512-token sequences are cut from running text.

The run keeps every per-token NLL (``token_nll.safetensors``, float32 as scored), and
``--analyse-only`` recomputes the table from that file alone.

Run: ``python -m interp.quant.length --out runs/agreement_by_length`` (settings below).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from interp import stats
from interp.errors import InterpError, exit_status
from interp.quant import protocol as pr

DEFAULT_SPECS = ("rtn:bits=3,group=64", "nf:bits=3,group=64", "hqq:bits=3,group=64", "gptq:bits=3,group=64",
                 "awq:bits=3,group=64")
REFERENCE = "reference"
RAW = "token_nll.safetensors"
TABLE = "agreement_by_length.csv"


def table_from_tokens(token_nll: Mapping[str, np.ndarray], lengths: Sequence[int], n_boot: int = 1000,
                      seed: int = 0) -> pd.DataFrame:
    """One row per length T: the paper-rule agreement, the reliabilities and the disattenuated agreement.

    Args:
        token_nll: ``"reference"`` and each spec -> ``[N, T_max - 1]`` per-token NLL on the same rows.
        lengths: row lengths T (BOS included); each reads the first ``T - 1`` targets.

    Every length's bootstrap draws the same resamples of rows (one seed), so ``pearson_change`` (agreement at T
    minus agreement at the shortest length) has a paired interval.
    """
    if REFERENCE not in token_nll:
        raise InterpError("agreement by length needs the reference's per-token NLL beside each method's.")
    ref = np.asarray(token_nll[REFERENCE], dtype=np.float64)
    specs = [s for s in token_nll if s != REFERENCE]
    lengths = sorted(int(t) for t in lengths)
    if not specs or not lengths or lengths[0] < 3 or lengths[-1] - 1 > ref.shape[1]:
        raise InterpError(f"lengths must lie in [3, {ref.shape[1] + 1}] (the scored rows' length) and at least one "
                          f"method must be scored; got lengths {lengths} and methods {specs}.")
    errors = {s: np.asarray(token_nll[s], dtype=np.float64) - ref for s in specs}
    pairs = pr.paper_pairs(specs)
    idx = [(specs.index(a), specs.index(b)) for a, b in pairs]
    boot = stats.bootstrap_indices(ref.shape[0], n_boot, seed)
    rows, first_boot, first_value = [], None, None
    for length in lengths:
        tok = {s: e[:, :length - 1] for s, e in errors.items()}
        means = pd.DataFrame({s: t.mean(axis=1) for s, t in tok.items()})
        agree = pr.pair_agreement(means, pairs, n_boot=n_boot, seed=seed)
        ceiling = pr.noise_ceiling(tok, pairs, n_boot=n_boot, seed=seed)
        data = means.to_numpy()
        value = pr._pair_r(data, idx)
        r_boot = np.array([pr._pair_r(data[b], idx) for b in boot])
        if first_boot is None:
            first_boot, first_value = r_boot, value
        change = pr.estimate(value - first_value, r_boot - first_boot, len(data))
        rel = ceiling.reliability
        rows.append({
            "T": length, "targets": length - 1, "n": len(data), "pairs": len(pairs),
            "pearson": agree["pearson"].value, "pearson_low": agree["pearson"].low,
            "pearson_high": agree["pearson"].high,
            "pearson_change": change.value, "pearson_change_low": change.low, "pearson_change_high": change.high,
            "jaccard": agree["jaccard"].value, "jaccard_low": agree["jaccard"].low,
            "jaccard_high": agree["jaccard"].high, "chance_jaccard": agree["chance"].value,
            "mean_reliability": float(rel["reliability"].mean()),
            "min_reliability": float(rel["reliability"].min()),
            "disattenuated": ceiling.mean_disattenuated.value, "disattenuated_low": ceiling.mean_disattenuated.low,
            "disattenuated_high": ceiling.mean_disattenuated.high,
        })
    table = pd.DataFrame(rows)
    k = table["targets"] / table["targets"].iloc[0]
    rel0 = table["mean_reliability"].iloc[0]
    table["reliability_predicted"] = k * rel0 / (1 + (k - 1) * rel0)
    return table


def windows(token_nll: Mapping[str, np.ndarray], width: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Why length may not raise agreement: the rows cut into consecutive windows of ``width`` targets.

    Returns ``(per_window, across)``: per window, the paper-rule agreement (mean Pearson over the pairs) of the
    window's per-example errors; per method, the mean Pearson between its errors in two different windows of
    the same rows. If the windows of a row hold different documents and that correlation is near 0, a longer
    row averages near-independent window errors, signal and noise alike, and its agreement stays at the
    windows' level instead of rising.
    """
    ref = np.asarray(token_nll[REFERENCE], dtype=np.float64)
    specs = [s for s in token_nll if s != REFERENCE]
    bounds = [(a, a + width) for a in range(0, ref.shape[1] - width + 1, width)]
    if len(bounds) < 2:
        raise InterpError(f"windows of {width} targets need rows of at least {2 * width} targets; these have "
                          f"{ref.shape[1]}.")
    idx = [(specs.index(a), specs.index(b)) for a, b in pr.paper_pairs(specs)]
    means = {s: np.stack([(np.asarray(token_nll[s], dtype=np.float64)[:, a:b] - ref[:, a:b]).mean(axis=1)
                          for a, b in bounds], axis=1) for s in specs}  # spec -> [N, windows]
    per_window = pd.DataFrame([{"first_target": a, "last_target": b - 1,
                                "pearson": pr._pair_r(np.stack([means[s][:, w] for s in specs], axis=1), idx)}
                               for w, (a, b) in enumerate(bounds)])
    upper = np.triu_indices(len(bounds), 1)
    across = pd.DataFrame([{"spec": s, "windows": len(bounds),
                            "pearson_between_windows": float(np.corrcoef(means[s], rowvar=False)[upper].mean())}
                           for s in specs])
    return per_window, across


def measure(model: Any, examples: Any, specs: Sequence[str], calibration: Any, store: str | Path,
            batch_size: int = 8, progress: bool | None = None) -> dict[str, np.ndarray]:
    """Per-token NLL (float32, as scored) of the reference and each spec on ``examples``; resumable."""
    from interp.models import cache_dir
    from interp.quant.store import ScoreStore, score

    errors = score(model, list(specs), examples, store=store, calibration=calibration, batch_size=batch_size,
                   progress=progress, cache_dir=cache_dir() / "quantized")
    ids = list(examples.ids)
    with ScoreStore(store) as st:
        return {name: st.token_nll(name, ids=ids).to_numpy(dtype=np.float32)
                for name in [REFERENCE, *errors.columns]}


def save_tokens(path: Path, token_nll: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
    """The per-token NLL as safetensors, one tensor per spec, and the run's settings (row ids included) as
    metadata."""
    import torch
    from safetensors.torch import save_file

    from interp.io import write_file

    # host: numpy arrays bound for a safetensors file
    tensors = {name: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for name, v in token_nll.items()}
    write_file(path, lambda tmp: save_file(tensors, str(tmp), metadata={"run": json.dumps(dict(meta))}))


def load_tokens(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """What :func:`save_tokens` wrote: spec -> per-token NLL, in the saved order, and the run's settings."""
    from safetensors import safe_open

    from interp.io import read_safetensors

    tensors = read_safetensors(path, "per-token NLL of the agreement-by-length run")
    with safe_open(str(path), "pt") as fh:
        meta = json.loads(fh.metadata()["run"])
    return {name: tensors[name].numpy() for name in meta["order"]}, meta


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Cross-method agreement of per-example errors against sequence "
                                                 "length, on the same rows (each length a prefix of the longest).")
    parser.add_argument("--out", required=True, help="folder for the score store, the per-token NLL and the table")
    parser.add_argument("--model", default="smollm2-135m", help="bundled model name or folder")
    parser.add_argument("--lengths", default="128,256,512", help="comma-separated row lengths (BOS included)")
    parser.add_argument("--n", type=int, default=256, help="rows")
    parser.add_argument("--rows", choices=["packed", "documents"], default="packed",
                        help="packed: whole documents joined end to end; documents: one document per row")
    parser.add_argument("--specs", nargs="+", default=list(DEFAULT_SPECS), help="method specs")
    parser.add_argument("--calibration-n", type=int, default=32, help="calibration rows for gptq and awq")
    parser.add_argument("--calibration-seed", type=int, default=21, help="calibration sample seed")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per forward")
    parser.add_argument("--seed", type=int, default=0, help="row sample and bootstrap seed")
    parser.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples")
    parser.add_argument("--analyse-only", action="store_true",
                        help=f"recompute the table from --out/{RAW} (at the lengths recorded there)")
    args = parser.parse_args(argv)
    out = Path(args.out)

    def body() -> None:
        try:
            lengths = sorted({int(x) for x in args.lengths.split(",")})
        except ValueError:
            raise InterpError(f"--lengths takes comma-separated whole numbers, e.g. 128,256,512; "
                              f"got {args.lengths!r}.") from None
        if args.analyse_only:
            if not (out / RAW).is_file():
                raise InterpError(f"{out} holds no {RAW}: run without --analyse-only first.")
            token_nll, meta = load_tokens(out / RAW)
        else:
            token_nll, meta = _run(args, lengths, out)
        table = table_from_tokens(token_nll, meta["lengths"] if args.analyse_only else lengths, n_boot=args.n_boot,
                                  seed=meta["seed"])
        from interp.io import write_file

        write_file(out / TABLE, lambda tmp: table.to_csv(tmp, index=False))
        print(table[["T", "n", "pearson", "pearson_low", "pearson_high", "pearson_change", "mean_reliability",
                     "reliability_predicted", "disattenuated"]].to_string(index=False))

    return exit_status(body)


def _run(args: argparse.Namespace, lengths: list[int], out: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    import torch

    import interp
    from interp.data import load_packed_examples
    from interp.io import ensure_writable_dir
    from interp.quant.spec import parse_spec
    from interp.runtime.batching import kernels

    specs = [str(parse_spec(s)) for s in args.specs]  # a bad spec is refused before the model loads
    if lengths[0] < 3:
        raise InterpError(f"--lengths must be at least 3 (BOS and two targets); got {lengths[0]}.")
    for name in ("n", "calibration_n", "batch_size"):
        if getattr(args, name) < 1:
            raise InterpError(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}.")
    ensure_writable_dir(out)
    model = interp.load_model(args.model)
    loader = load_packed_examples if args.rows == "packed" else interp.load_examples
    examples = loader("wiki", model.tokenizer, n=args.n, seq_len=lengths[-1], seed=args.seed, split="eval")
    calibration = interp.load_examples("wiki", model.tokenizer, n=args.calibration_n, seq_len=128,
                                       seed=args.calibration_seed, split="calibration")
    token_nll = measure(model, examples, specs, calibration, out / "store", batch_size=args.batch_size,
                        progress=True)
    meta = {"order": list(token_nll), "ids": list(examples.ids), "settings": examples.settings,
            "model": args.model, "calibration": calibration.settings, "seed": args.seed, "lengths": lengths,
            "kernels": kernels("cpu"), "threads": torch.get_num_threads()}
    save_tokens(out / RAW, token_nll, meta)
    return token_nll, meta


if __name__ == "__main__":
    raise SystemExit(main())
