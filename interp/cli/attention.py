"""``interp attention`` and ``interp train-saobp``."""

from __future__ import annotations

import argparse
import math
import time

from interp.cli.common import (
    add_checks,
    add_model_data,
    check_out,
    command,
    float_in,
    int_at_least,
    int_list,
    load_model_and_examples,
    parse_ints,
    set_threads,
)


def _modes() -> tuple[str, ...]:
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    from typing import get_args

    from interp.attention.saobp import Mode

    return tuple(get_args(Mode))


def _attention_args(p: argparse.ArgumentParser) -> None:
    add_model_data(p, n=16, seq_len=96)
    p.add_argument("--beta", type=float_in(0, math.inf), default=4.0,
                   help="SAOBP beta (>= 0) for the inference-time comparison; 0 = no comparison")
    p.add_argument("--mode", default="exact", choices=_modes(), help="SAOBP update")
    p.add_argument("--layers", default=None, type=int_list(),
                   help="comma-separated layer indices, negative from the end (default: all)")
    p.add_argument("--map-layers", default="-1", type=int_list(),
                   help="comma-separated layer indices for the attention-map figures")
    p.add_argument("--out", default="reports/attention", help="output folder")
    p.add_argument("--no-static", action="store_true", help="skip PNG/SVG export")
    add_checks(p, check_out)


@command("attention", "attention entropy, GTD, sink share per layer and head, with and without SAOBP",
         _attention_args)
def cmd_attention(args: argparse.Namespace) -> int:
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    from interp.attention.analysis import capture_patterns
    from interp.attention.metrics import METRICS
    from interp.cli.shard import sharded_attention
    from interp.figures.attention import attention_map, metric_by_layer, metric_heatmap
    from interp.figures.style import export_static, save_html
    from interp.io import ensure_writable_dir, write_csv, write_json
    from interp.runtime.batching import device_of
    from interp.runtime.distributed import pin_threads, process_group

    out = ensure_writable_dir(args.out)
    start = time.time()
    pin_threads()
    model, examples = load_model_and_examples(args)
    layers = parse_ints(args.layers) if args.layers else None
    with process_group(device_of(model)):  # torchrun: whole batches per rank, merged on rank 0 (interp.cli.shard)
        result = sharded_attention(args, model, examples, args.beta or None, layers)
    if result is None:  # a rank other than 0: its batches are in --out/parts
        return 0
    write_csv(out / "attention_by_head.csv", result.to_frame(), index=False)
    write_csv(out / "attention_by_layer.csv", result.by_layer(), index=False)
    write_json(out / "attention.json", result.to_dict())
    figs = {f"{m}_by_layer": metric_by_layer(result, m) for m in METRICS}
    figs.update({f"{m}_heatmap_{v}": metric_heatmap(result, m, v) for m in ("entropy", "gtd", "sink_share")
                 for v in result.variants})
    tokens = examples.tokens[0, :32]
    labels = [model.tokenizer.decode([int(t)]) for t in tokens]
    map_layers = parse_ints(args.map_layers)
    for variant, beta in [("reference", None), ("saobp", args.beta or None)]:
        if variant == "saobp" and beta is None:
            continue
        for layer, pattern in capture_patterns(model, tokens, map_layers, saobp_beta=beta, mode=args.mode).items():
            head = int(pattern[:, 1:, 0].mean(1).argmax())  # the most sink-heavy head
            figs[f"map_L{layer}_H{head}_{variant}"] = attention_map(
                pattern[head], labels, f"layer {layer} head {head} ({variant})")
    save_html(figs, out)
    if not args.no_static:
        export_static(figs, out / "static")
    summary = result.by_layer()
    cols = ["variant", "layer", "entropy_mean", "gtd_mean", "sink_share_mean"]
    print(summary[cols].to_string(index=False, float_format="{:.3f}".format))
    if result.delta_nll is not None:
        print(f"\nmean NLL change with SAOBP beta={args.beta}: {float(result.delta_nll.mean()):+.4f} nats")
    print(f"{time.time() - start:.1f} s; tables and figures in {out}/")
    return 0


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/saobp", help="output folder (resumed if it holds a checkpoint)")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (under 2 minutes)")
    p.add_argument("--steps", type=int_at_least(1), default=None,
                   help="number of optimisation steps (default: the chosen configuration's)")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seeds the weights and the data order")
    p.add_argument("--fresh", action="store_true", help="start over instead of resuming")
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help="torch CPU threads (1 is steadier on a shared machine)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="precision of the forward passes (bfloat16: autocast; weights stay float32)")
    add_checks(p, check_out, set_threads)


@command("train-saobp", "train a small llama with and without SAOBP attention and log how they compare",
         _train_args)
def cmd_train_saobp(args: argparse.Namespace) -> int:
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    from interp.attention import train

    log = train.run(args.out, quick=args.quick, steps=args.steps, seed=args.seed, resume=not args.fresh,
                    quiet=args.quiet, dtype=args.dtype)
    last = log[log["step"] == log["step"].max()]
    print(last.filter(regex="^(model|step|heldout_loss)").to_string(index=False))
    print(f"log: {args.out}/log.csv")
    return 0
