"""Does cross-method agreement rise with sequence length, as the noise argument predicts?

A per-example error averages ``T - 1`` token errors, so its measurement noise shrinks as T
grows, and the split-half reliability should follow the Spearman-Brown prophecy: if the
reliability at T-1 targets is ``rel``, at ``k`` times as many it is ``k rel / (1 + (k - 1) rel)``.
If the low agreement at T = 128 is mostly noise, agreement rises with T toward its
disattenuated value; if the methods truly disagree, it does not.

:func:`agreement_by_length` scores the same documents, truncated to each length, with the
same methods (one resumable store per length), and reports per length the paper-rule
agreement, the mean split-half reliability and the disattenuated agreement.

Run: ``python -m interp.quant.length --out runs/agreement_by_length`` (settings below).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from interp.models import Model
from interp.quant import protocol as pr

DEFAULT_SPECS = ("rtn:bits=3,group=64", "nf:bits=3,group=64", "hqq:bits=3,group=64")


def truncate(examples: Any, seq_len: int) -> Any:
    """The same rows cut to their first ``seq_len`` tokens (BOS kept)."""
    return dataclasses.replace(examples, tokens=examples.tokens[:, :seq_len].contiguous(),
                               settings={**examples.settings, "seq_len": seq_len, "truncated_from": examples.seq_len})


def agreement_by_length(model: Model, examples: Any, specs: Sequence[str], lengths: Sequence[int], out: str | Path,
                        batch_size: int = 8, n_boot: int = 1000, seed: int = 0,
                        progress: bool | None = None) -> pd.DataFrame:
    """One row per length: paper-rule agreement, reliability and disattenuated agreement on the same rows."""
    from interp.quant.store import ScoreStore, score

    rows = []
    out = Path(out)
    for length in sorted(lengths):
        ex = truncate(examples, length)
        store_dir = out / f"T{length}"
        errors = score(model, list(specs), ex, store=store_dir, batch_size=batch_size, progress=progress,
                       cache_dir=store_dir.parent / "quantized")
        names = list(errors.columns)
        pairs = pr.paper_pairs(names)
        agree = pr.pair_agreement(errors, pairs, n_boot=n_boot, seed=seed)
        with ScoreStore(store_dir) as st:
            ref = st.token_nll("reference", ids=list(errors.index)).to_numpy(dtype=np.float64)
            token_errors = {s: st.token_nll(s, ids=list(errors.index)).to_numpy(dtype=np.float64) - ref
                            for s in names}
        ceiling = pr.noise_ceiling(token_errors, pairs, n_boot=n_boot, seed=seed)
        rel = ceiling.reliability
        rows.append({
            "T": length, "n": len(errors), "pairs": len(pairs),
            "pearson": agree["pearson"].value, "pearson_low": agree["pearson"].low,
            "pearson_high": agree["pearson"].high,
            "jaccard": agree["jaccard"].value, "chance_jaccard": agree["chance"].value,
            "mean_reliability": float(rel["reliability"].mean()),
            "disattenuated": ceiling.mean_disattenuated.value, "disattenuated_low": ceiling.mean_disattenuated.low,
            "disattenuated_high": ceiling.mean_disattenuated.high,
        })
    table = pd.DataFrame(rows)
    first = table.iloc[0]
    k = (table["T"] - 1) / (first["T"] - 1)
    table["reliability_predicted"] = k * first["mean_reliability"] / (1 + (k - 1) * first["mean_reliability"])
    return table


def main(argv: Sequence[str] | None = None) -> int:
    import interp

    parser = argparse.ArgumentParser(description="Cross-method agreement of per-example errors against sequence "
                                                 "length, on the same documents.")
    parser.add_argument("--out", required=True, help="folder for the per-length score stores and the table")
    parser.add_argument("--model", default="smollm2-135m", help="bundled model name or folder")
    parser.add_argument("--lengths", default="128,192", help="comma-separated sequence lengths (BOS included)")
    parser.add_argument("--n", type=int, default=None, help="documents (default: every eval document long enough)")
    parser.add_argument("--specs", nargs="+", default=list(DEFAULT_SPECS), help="method specs")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per forward")
    parser.add_argument("--seed", type=int, default=0, help="document sample and bootstrap seed")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    model = interp.load_model(args.model)
    examples = interp.load_examples("wiki", model.tokenizer, n=args.n, seq_len=max(lengths), seed=args.seed,
                                    split="eval")
    table = agreement_by_length(model, examples, args.specs, lengths, args.out,
                                batch_size=args.batch_size, seed=args.seed)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    table.to_csv(Path(args.out) / "agreement_by_length.csv", index=False)
    print(table.to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
