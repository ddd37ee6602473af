"""``interp probe``: per-layer statistics of a model's activations, saved as safetensors, JSON and parquet."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from interp.cli.common import (
    add_checks,
    add_model_data,
    check_out,
    command,
    load_model_and_examples,
    name_list,
)


def _components() -> Sequence[str]:
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    from interp.runtime.hooks import COMPONENTS

    return COMPONENTS


def _reducers() -> Sequence[str]:
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    from interp.probes import REDUCERS

    return tuple(REDUCERS)


def _check_probe_pairs(args: argparse.Namespace) -> None:
    """Every component has a reducer that applies to it (``_pairs`` with no layers touches no model)."""
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    from interp.probes import _pairs

    _pairs(None, args.components.split(","), args.reducers.split(","), [])


def _probe_args(p: argparse.ArgumentParser) -> None:
    add_model_data(p)
    p.add_argument("--components", default="resid_mid,resid_post,h,gate",
                   type=name_list("component", _components),
                   help=f"comma-separated components, from: {', '.join(_components())}")
    p.add_argument("--reducers", default="norm,mean,kurtosis", type=name_list("reducer", _reducers),
                   help=f"comma-separated reducers, from: {', '.join(_reducers())} (entropy, gtd, sink_share, "
                        "effective_span and entropy_norm apply to 'pattern' only)")
    p.add_argument("--out", default="reports/probe", help="output folder")
    add_checks(p, _check_probe_pairs, check_out)


@command("probe", "capture per-layer statistics (norms, gate stats, attention entropy) and save them", _probe_args)
def cmd_probe(args: argparse.Namespace) -> int:
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    import pandas as pd

    from interp.cli.shard import sharded_probe
    from interp.io import ensure_writable_dir, write_csv
    from interp.runtime.batching import device_of
    from interp.runtime.distributed import pin_threads, process_group

    out = ensure_writable_dir(args.out)
    start = time.time()
    pin_threads(getattr(args, "threads", None))
    model, examples = load_model_and_examples(args)
    with process_group(device_of(model)):
        result = sharded_probe(args, model, examples, components=args.components.split(","),
                               reducers=args.reducers.split(","))
    if result is None:  # a rank other than 0 under torchrun: its batches are in --out/parts
        return 0
    result.save(out)
    summary = result.summary()
    write_csv(out / "summary.csv", summary)
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.float_format", "{:.3f}".format):
        print(summary)
    print(f"\n{len(examples)} examples x {examples.seq_len} tokens, {model.info.n_layers} layers, "
          f"{time.time() - start:.1f} s. Saved to {out}/ (summary.csv, probe.parquet, stats.safetensors)")
    return 0
