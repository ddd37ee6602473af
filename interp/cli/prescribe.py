"""``interp prescribe``: a mixed-precision plan (a bit width per block linear weight) under a bit budget.

It measures each weight's sensitivity on calibration examples (the NLL increase when it alone
is quantized at the low width; cached), allocates the high width greedily by sensitivity per
extra bit, and writes ``plan.json`` (the width of every weight, the achieved average bits per
weight, the settings, and the spec that quantizes with the plan: ``interp quantize --method
@OUT/plan.json``) and ``sensitivity.csv``. See :mod:`interp.quant.prescribe` for the bit
accounting and the allocation.

The method, the two widths and the budget are checked before the model loads: the widths
must be ones the method supports and the budget must lie strictly between the all-low and
all-high averages (scales and zero-points counted).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from interp.cli.common import (
    add_checks,
    add_model_data,
    check_loads_model,
    check_out,
    command,
    float_in,
    int_at_least,
    set_threads,
)
from interp.errors import InterpError, SpecError
from interp.quant.spec import METHODS


def _bits(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bits must be whole numbers like 3,4; got {text!r}") from None
    if len(values) < 2:
        raise argparse.ArgumentTypeError(f"bits must be two widths or more, like 3,4 (or 3,4,5,6,8 with --format "
                                         f"llama.cpp); got {text!r}")
    return values


def _method(text: str) -> str:
    from interp.cli.common import unknown_name

    if text not in METHODS:
        raise argparse.ArgumentTypeError(unknown_name("method", text, list(METHODS)))
    return text


def _types(text: str) -> tuple[str, ...]:
    """Comma-separated llama.cpp type names (q4_k, Q6_K...), lowercased."""
    from interp.cli.common import split_names
    from interp.quant.llama_cpp import check_type

    try:
        return tuple(dict.fromkeys(check_type(name) for name in split_names(text, "llama.cpp type")))
    except InterpError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _size(text: str) -> int | str:
    """A whole number of bytes, or the name of a llama.cpp mix (its file's size)."""
    from interp.quant.llama_cpp import MIXES

    if text.strip().upper() in MIXES:
        return text.strip().upper()
    try:
        value = int(text.strip().replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size in bytes or one of {', '.join(MIXES)}; got {text!r}") \
            from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a size in bytes must be positive; got {text!r}")
    return value


# the options that only mean something for a llama.cpp plan
LLAMA_OPTIONS = {"target_bpw": "--target-bpw", "target_size": "--target-size", "types": "--types",
                 "exclude_types": "--exclude-types", "gguf": "--gguf", "llama_cpp": "--llama-cpp", "mix": "--mix"}


def check_request(args: argparse.Namespace) -> None:
    """Supported widths or types, and a budget or size they allow, before any model loads (SpecError otherwise).

    For a llama.cpp plan also: a named llama.cpp build holds its tools (ToolError otherwise), ``--gguf`` needs
    a GGUF model and a .gguf file name, and with a GGUF model the budget is checked on its real shapes (read
    from the file's header): a size below the smallest file the candidate types make is refused here."""
    from interp.quant.prescribe import check_llama_budget, validate_request

    given = [flag for key, flag in LLAMA_OPTIONS.items() if getattr(args, key) is not None]
    if args.format is None:
        args.format = "llama.cpp" if given else "interp"
    if args.format == "interp":
        if given:
            raise SpecError(f"{', '.join(given)} make a llama.cpp plan; drop --format interp")
        if args.budget is None:
            raise SpecError("give --budget, the average bits per weight (e.g. 4.0 for gptq 3,4)")
        args.bits = args.bits or (3, 4)
        validate_request(args.method, args.bits, args.budget, args.group)
        return
    targets = [flag for flag, value in (("--budget", args.budget), ("--target-bpw", args.target_bpw),
                                        ("--target-size", args.target_size)) if value is not None]
    if len(targets) != 1:
        raise SpecError(f"give one of --target-bpw (bits per weight over the block linear weights) or --target-size "
                        f"(bytes of the whole GGUF file, or a mix like Q4_K_M); got {', '.join(targets) or 'none'}")
    if args.types and args.bits:
        raise SpecError("give the candidates as --bits (widths) or --types (llama.cpp types), not both")
    if not args.types:
        args.bits = args.bits or (3, 4, 5, 6, 8)
    if isinstance(args.target_size, str) and args.mix not in (None, args.target_size):
        raise SpecError(f"--target-size {args.target_size} is that mix's file; --mix {args.mix} would type the rest of "
                        "the file differently. Leave --mix out")
    from interp.quant import llama_cpp_run as run

    args.build = run.find_build(args.llama_cpp)
    args.source = run.gguf_source(args.model) if args.gguf or args.build or args.target_size else None
    if args.gguf is not None:
        if args.source is None:
            raise SpecError(f"--gguf needs the model as a GGUF file (a bundled model or a .gguf path); {args.model} is "
                            "not one (llama.cpp's convert_hf_to_gguf.py converts a Hugging Face folder)")
        run.check_target_file(args.gguf, args.source)
    if args.target_size is not None and args.source is None:
        raise SpecError(f"--target-size counts the bytes of a GGUF file: the model must be one (a bundled model or a "
                        f".gguf path); {args.model} is not. Give --target-bpw")
    shapes = run.gguf_shapes(args.source) if args.source is not None and args.source.is_file() else None
    budget = args.budget if args.budget is not None else args.target_bpw
    if budget is not None:
        check_llama_budget(shapes, args.bits, budget, args.score, args.types, args.exclude_types or ())
    elif shapes is not None:
        run.target_capacity(shapes, args.source, args.target_size, args.bits, args.score, args.types,
                            args.exclude_types or ())


def _args(p: argparse.ArgumentParser) -> None:
    from interp.quant.llama_cpp import MIXES

    add_model_data(p, n=32, seq_len=128)
    p.add_argument("--method", default="gptq", type=_method, help=f"quantizer, one of {', '.join(METHODS)}")
    p.add_argument("--bits", default=None, type=_bits,
                   help="the two bit widths, low,high (default 3,4); with --format llama.cpp the candidate widths "
                        "(default 3,4,5,6,8), each becoming its llama.cpp types (4: Q4_K, and with --score fisher "
                        "Q4_0 and Q4_1 too; 6: Q6_K; 8: Q8_0), before the shape fallback")
    p.add_argument("--format", default=None, choices=("interp", "llama.cpp"),
                   help="interp: plan.json for interp quantize; llama.cpp: tensor_types.txt for llama-quantize "
                        "--tensor-type-file, the budget in llama.cpp bits per weight over the block linear weights "
                        "(the default when any llama.cpp option is given)")
    p.add_argument("--score", default="proxy", choices=("proxy", "fisher"),
                   help="with --format llama.cpp: proxy, the output-error proxy tr(dW H dW^T) (RTN stand-ins); "
                        "fisher, the Fisher-weighted output error in KL nats of every type rounded as llama-quantize "
                        "rounds it (interp's byte-identical rounding, or the build's own --pure files when one is "
                        "named; with --gguf, with the importance matrix the file is made with)")
    p.add_argument("--budget", default=None, type=float_in(0, 64, low_open=True),
                   help="average bits per weight, group scales and zero-points counted (gptq group 64: 3.5 to "
                        "4.5 for 3,4); with --format llama.cpp the same as --target-bpw")
    p.add_argument("--target-bpw", default=None, type=float_in(0, 64, low_open=True),
                   help="llama.cpp plan: bits per weight over the block linear weights (SmolLM2's Q4_K_M: 5.5344)")
    p.add_argument("--target-size", default=None, type=_size,
                   help=f"llama.cpp plan: the whole GGUF file's bytes, or a mix ({', '.join(MIXES)}) meaning its "
                        "file's bytes; with a build the file is checked and the plan re-chosen until it fits")
    p.add_argument("--types", default=None, type=_types,
                   help="llama.cpp plan: the candidate types instead of --bits, e.g. q3_k,q4_0,q4_k,q5_0,q5_1,q5_k,"
                        "q6_k,q8_0; a type a weight's input width cannot take becomes llama.cpp's fallback (Q4_K -> "
                        "Q5_0, Q6_K -> Q8_0...)")
    p.add_argument("--exclude-types", default=None, type=_types,
                   help="llama.cpp plan: types no weight may get (after the fallback), e.g. q4_1")
    p.add_argument("--mix", default=None, choices=MIXES,
                   help="llama.cpp plan: the mix llama-quantize is given (it types the tensors the plan does not "
                        "name) and the plan is compared with; default: the one nearest the target")
    p.add_argument("--gguf", default=None,
                   help="llama.cpp plan: write the quantized model here (with a build), or print the commands that do")
    p.add_argument("--llama-cpp", default=None,
                   help="a llama.cpp build: the folder holding llama-quantize and llama-perplexity (default "
                        "$LLAMA_CPP_BIN; `make llama-cpp` builds one)")
    p.add_argument("--no-imatrix", action="store_true",
                   help="with --gguf: quantize the plan and the mix without interp's importance matrix")
    p.add_argument("--kl-chunks", type=int_at_least(1), default=32,
                   help="with --gguf: held-out contexts llama-perplexity scores (eval split of --data)")
    p.add_argument("--kl-ctx", type=int_at_least(16), default=256, help="with --gguf: tokens per held-out context")
    p.add_argument("--group", type=int_at_least(1), default=64, help="group size")
    p.add_argument("--sensitivity-n", type=int_at_least(1), default=8,
                   help="calibration examples the sensitivity is measured on (the first of the --n)")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads (and llama.cpp's)")
    p.add_argument("--out", default="reports/prescribe", help="output folder")
    add_checks(p, check_request, check_out)


@command("prescribe", "a mixed-precision plan: a bit width per block weight under an average-bit budget", _args)
def cmd_prescribe(args: argparse.Namespace) -> int:
    from pathlib import Path

    from interp.cli.common import load_model_and_examples
    from interp.quant.prescribe import prescribe

    set_threads(args)
    start = time.time()
    model, calibration = load_model_and_examples(args, split="calibration")
    if args.format == "llama.cpp":
        return _llama_cpp(args, model, calibration, start)
    plan = prescribe(model, args.method, args.bits, args.budget, calibration=calibration, group=args.group,
                     sensitivity_n=args.sensitivity_n, batch_size=args.batch_size, progress=not args.quiet and None)
    path = plan.save(args.out)
    from interp.quant.sensitivity import sensitivity

    rows = calibration.subset(list(range(min(args.sensitivity_n, len(calibration)))))
    scores = sensitivity(model, f"{args.method}:bits={min(args.bits)},group={args.group}", rows,
                         calibration=calibration, progress=False)  # cached by prescribe: a read
    from interp.io import write_csv

    write_csv(Path(args.out) / "sensitivity.csv", scores.table(n_boot=1000, seed=args.seed), index=False)
    high = sum(1 for bits in plan.widths.values() if bits == max(args.bits))
    print(f"{high} of {len(plan.widths)} weights at {max(args.bits)} bits: {plan.achieved:.4f} bits per weight "
          f"(budget {plan.budget:g}; ends {plan.ends[0]:.4f} and {plan.ends[1]:.4f}), {time.time() - start:.0f} s. "
          f"Saved {path}")
    return 0


def _llama_cpp(args: argparse.Namespace, model: Any, calibration: Any, start: float) -> int:
    """A llama.cpp plan: tensor_types.txt, and with --gguf the imatrix, the quantized file and its held-out KL beside
    llama.cpp's own mix (with a build), or the commands that make and measure them (without)."""
    import os
    import shlex
    from pathlib import Path

    from interp.io import PrivateFolder, write_json, write_text
    from interp.quant import llama_cpp_run as run
    from interp.quant.prescribe import candidate_options, choose_llama_types, model_shapes, score_llama_options

    shapes = model_shapes(model)
    build, source, out = args.build, args.source, Path(args.out)
    gguf = Path(args.gguf).expanduser() if args.gguf else None
    threads = args.threads or os.cpu_count()
    exclude = args.exclude_types or ()
    budget, capacity, mix = _llama_target(args, shapes)
    imatrix = gguf is not None and not args.no_imatrix
    with_matrix = out / "imatrix.gguf" if imatrix else None
    progress = not args.quiet and None
    log: list[str] = []
    saved: list[Path] = []
    kl: dict[str, dict[str, float]] = {}
    slack, mix_path = 0, None
    reference: Path | None = None
    with PrivateFolder(out) as scratch:
        if build is not None and source is not None and (gguf is not None or args.score == "fisher"):
            reference = run.quantize(build, source, scratch / "reference-f32.gguf", "F32", "--allow-requantize",
                                     threads=threads, log=log)
        matrix = None
        if imatrix:  # first: the Fisher score rounds every candidate with it, as llama-quantize --imatrix will
            from interp.quant.imatrix import importance_matrix, write_imatrix

            matrix = importance_matrix(model, calibration, batch_size=args.batch_size, progress=progress,
                                       datasets=(str(args.data),))
            write_imatrix(matrix, out / "imatrix.gguf")
            saved.append(out / "imatrix.gguf")
        rounded = None
        if reference is not None and args.score == "fisher" and matrix is None:  # --pure files: no imatrix
            needed = {t for opts in candidate_options(shapes, args.bits, "fisher", args.types, exclude) for t in opts}
            rounded = run.pure_rounding(build, reference, sorted(needed), scratch, threads, log)
        scores = score_llama_options(model, calibration, args.bits, chunks=min(8, len(calibration)),
                                     batch_size=args.batch_size, progress=progress, score=args.score, seed=args.seed,
                                     types=args.types, exclude=exclude, rounded=rounded, imatrix=matrix)
        del rounded  # every candidate's weights: as large as the model several times over
        made = (gguf, reference) if gguf is not None and reference is not None else None  # a build run's files
        if made is not None:  # the mix first: with --target-size its file sets the room the plan has
            mix_path = run.quantize(build, made[1], out / run.mix_file_name(mix, imatrix), mix, imatrix=with_matrix,
                                    threads=threads, log=log)
            saved.append(out / mix_path.name)

        def write(plan: Any) -> Path:
            path = plan.save(out, shapes)
            if made is None:
                return path
            return run.quantize(build, made[1], made[0], mix, "--tensor-type-file", str(path), imatrix=with_matrix,
                                threads=threads, log=log)

        if budget is not None:
            plan = choose_llama_types(scores, budget=budget)
            write(plan)
        elif mix_path is not None:  # measured from the mix's file: its size, less what is not a block linear weight
            size, rest = mix_path.stat().st_size, mix_path.stat().st_size - run.block_bytes(mix_path)
            limit = size if isinstance(args.target_size, str) else args.target_size
            plan, _, slack = run.fit_to_size(lambda room: choose_llama_types(scores, capacity_bytes=room), write,
                                             limit - rest, limit)
        else:
            plan = choose_llama_types(scores, capacity_bytes=capacity)
            write(plan)
        saved[:0] = [out / "tensor_types.txt", out / "llama_plan.json"]
        if gguf is not None:
            text, ids = run.heldout_text(args.data, model.tokenizer, args.kl_ctx * (args.kl_chunks + 1) * 5 // 4)
            write_text(out / "heldout.txt", text)
            saved.append(out / "heldout.txt")
        if made is not None and mix_path is not None:
            kl = run.kl_divergence(build, made[1], {"plan": made[0], mix: mix_path}, out / "heldout.txt", scratch,
                                   args.kl_ctx, args.kl_chunks, threads, log)
    if log:
        write_text(out / "llama-cpp.log", "\n".join(log))
        saved.append(out / "llama-cpp.log")
    head = (f"{plan.achieved:.4f} bits per weight over the block linear weights (target {plan.budget:.4f}; ends "
            f"{plan.ends[0]:.4f} and {plan.ends[1]:.4f}; llama.cpp's {mix} here: {plan.baselines[mix]:.4f}), "
            f"{args.score} score ({_rounding(args)}), {time.time() - start:.0f} s.")
    if gguf is None:
        path = out / "tensor_types.txt"
        print(f"{head} Saved {path}: llama-quantize --tensor-type-file {path} SOURCE.gguf OUT.gguf {mix}")
        return 0
    commands = run.prescribe_commands(build, source, out, gguf, mix, imatrix, args.kl_ctx, args.kl_chunks,
                                      threads if made else None)  # a build run's own threads: the same sums
    if made is None or mix_path is None:
        print(f"{head} Saved {', '.join(map(str, saved))}.\nNo llama.cpp build named (--llama-cpp DIR or "
              f"LLAMA_CPP_BIN). These commands write {gguf} and llama.cpp's own {mix} beside it, then measure both "
              "against the F32 reference on the held-out text:")
        print("\n".join("  " + shlex.join(c) for c in commands))
        return 0
    record = {"files": {"plan": {"path": str(gguf), "bytes": gguf.stat().st_size, **kl["plan"]},
                        mix: {"path": str(mix_path), "bytes": mix_path.stat().st_size, **kl[mix]}},
              "mix": mix, "imatrix": imatrix, "reduction_mean_kl": 1 - kl["plan"]["mean_kl"] / kl[mix]["mean_kl"],
              "slack_bytes": slack, "kl_ctx": args.kl_ctx, "kl_chunks": args.kl_chunks, "heldout_documents": ids,
              "build": str(build), "commands": [shlex.join(c) for c in commands],
              "commands_folder": os.path.abspath(out)}
    write_json(out / "llama_cpp_kl.json", record)
    saved.insert(1, out / "llama_cpp_kl.json")
    _print_kl(head, record, gguf, out, saved)
    return 0


def _llama_target(args: argparse.Namespace, shapes: Any) -> tuple[float | None, int, str]:
    """The budget in bits per weight (or None), the room in bytes for --target-size, and the mix to compare with."""
    from interp.quant import llama_cpp_run as run
    from interp.quant.prescribe import check_llama_budget

    budget = args.budget if args.budget is not None else args.target_bpw
    if budget is not None:  # checked again on the loaded shapes: a Hugging Face folder's first check
        check_llama_budget(shapes, args.bits, budget, args.score, args.types, args.exclude_types or ())
        return budget, 0, args.mix or run.nearest_mix(shapes, budget)
    capacity, mix = run.target_capacity(shapes, args.source, args.target_size, args.bits, args.score, args.types,
                                        args.exclude_types or ())
    return None, capacity, args.mix or mix


def _rounding(args: argparse.Namespace) -> str:
    """How the score rounded the candidates."""
    if args.score != "fisher":
        return "RTN stand-ins"
    if args.gguf is not None and not args.no_imatrix:
        return "every type as llama-quantize --imatrix stores it, by interp's byte-identical rounding"
    if args.build is not None and args.source is not None:  # a Hugging Face folder has no GGUF file to round
        return "every type as llama-quantize stores it"
    return "every type as llama-quantize stores it, by interp's byte-identical rounding"


def _print_kl(head: str, record: dict[str, Any], gguf: Any, out: Any, saved: list[Any]) -> None:
    """The plan's KL beside the mix's, as llama-perplexity measured them."""
    mix, files = record["mix"], record["files"]
    label = f"{mix} (llama.cpp{', imatrix' if record['imatrix'] else ''})"
    rows = [(f"plan ({gguf.name})", files["plan"]), (label, files[mix])]
    width = max(len(shown) for shown, _ in rows)
    nan = float("nan")
    lines = [f"{'file':<{width}}  {'bytes':>11}  {'mean KL':>8}  {'99% KL':>8}  {'99.9% KL':>8}  same top"]
    lines += [f"{shown:<{width}}  {k['bytes']:>11}  {k['mean_kl']:>8.5f}  {k.get('kl_p99', nan):>8.4f}  "
              f"{k.get('kl_p999', nan):>8.4f}  {k.get('same_top', nan):>7.2f}%" for shown, k in rows]
    chunks = files["plan"].get("chunks", record["kl_chunks"])
    print(f"{head}\nllama.cpp's KL against the F32 reference, {chunks} held-out contexts of {record['kl_ctx']} tokens "
          f"({out / 'heldout.txt'}):")
    print("\n".join("  " + line for line in lines))
    print(f"The plan's mean KL is {-100 * record['reduction_mean_kl']:+.1f}% against {mix}'s, its file "
          f"{files['plan']['bytes'] - files[mix]['bytes']:+d} bytes. Saved {gguf}, {', '.join(map(str, saved))}")


def _imatrix_args(p: argparse.ArgumentParser) -> None:
    add_model_data(p, n=128, seq_len=128)
    p.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads")
    p.add_argument("--out", default="reports/imatrix", help="output folder (imatrix.gguf, imatrix.csv)")
    add_checks(p, check_out)


@command("imatrix", "llama.cpp's importance matrix (imatrix.gguf for llama-quantize --imatrix) from calibration "
         "examples", _imatrix_args)
def cmd_imatrix(args: argparse.Namespace) -> int:
    from pathlib import Path

    from interp.cli.common import load_model_and_examples
    from interp.quant.imatrix import importance_matrix, write_imatrix

    set_threads(args)
    start = time.time()
    model, calibration = load_model_and_examples(args, split="calibration")
    matrix = importance_matrix(model, calibration, batch_size=args.batch_size, progress=not args.quiet and None,
                               datasets=(str(args.data),))
    out = Path(args.out)
    path = write_imatrix(matrix, out / "imatrix.gguf")
    from interp.io import write_file

    table = matrix.table()
    write_file(out / "imatrix.csv", lambda tmp: table.to_csv(tmp, index=False))
    top = table.sort_values("max_over_mean", ascending=False).iloc[0]
    print(f"{len(table)} weights, {matrix.tokens} tokens ({matrix.chunk_count} chunks of {matrix.chunk_size}), "
          f"{time.time() - start:.0f} s; most uneven input: {top.tensor} (largest channel {top.max_over_mean:.0f}x "
          f"the mean). Saved {path}: llama-quantize --imatrix {path} ...")
    return 0


def _tensor_type_file(args: argparse.Namespace) -> None:
    """The tensor-type file reads as llama-quantize reads it (names are checked once the model is known)."""
    from interp.quant.llama_cpp import read_tensor_types

    read_tensor_types(args.file)


def _tensor_types_args(p: argparse.ArgumentParser) -> None:
    from interp.quant.llama_cpp import MIXES

    p.add_argument("file", help="a llama-quantize --tensor-type-file: whitespace-separated PATTERN=TYPE items")
    p.add_argument("--model", default="smollm2-135m",
                   help="bundled model (smollm2-135m, gemma3-270m), a Hugging Face folder, or a .gguf file")
    p.add_argument("--mix", default="Q4_K_M", choices=MIXES, help="the llama-quantize type the file goes with")
    p.add_argument("--out", default="reports/tensor-types", help="output folder (tensor_types.csv)")
    add_checks(p, _tensor_type_file, check_loads_model, check_out)


@command("tensor-types", "what llama-quantize MIX --tensor-type-file FILE stores for each block weight of a model, "
         "the shape fallback applied, and its bytes against the mix alone", _tensor_types_args)
def cmd_tensor_types(args: argparse.Namespace) -> int:
    from pathlib import Path

    import interp
    from interp.io import write_file
    from interp.quant import llama_cpp as lc
    from interp.quant.prescribe import model_shapes

    model = interp.load_model(args.model)
    shapes = model_shapes(model)
    names = [lc.gguf_name(s.layer, s.role) for s in shapes]
    items = lc.read_tensor_types(args.file, [*names, "token_embd.weight", "output.weight"])
    resolved = lc.resolve_tensor_types(shapes, items, args.mix)
    alone = lc.stored_types(shapes, lc.mix_types(shapes, args.mix))
    import pandas as pd

    def nbytes(ggml_type: str, d_out: int, d_in: int) -> int:
        block, size = lc.GGML_TYPES[ggml_type]
        return d_out * (d_in // block) * size

    rows = [{"tensor": name, "d_out": s.d_out, "d_in": s.d_in, "pattern": resolved[s.name][1],
             "type": resolved[s.name][0], "bits_per_weight": lc.bits_per_weight(resolved[s.name][0]),
             "bytes": nbytes(resolved[s.name][0], s.d_out, s.d_in), "mix_type": alone[s.name],
             "mix_bytes": nbytes(alone[s.name], s.d_out, s.d_in)} for name, s in zip(names, shapes, strict=True)]
    table = pd.DataFrame(rows)
    out = Path(args.out)
    path = out / "tensor_types.csv"
    write_file(path, lambda tmp: table.to_csv(tmp, index=False))
    named = int((table.pattern != "").sum())
    weights = sum(s.size for s in shapes)
    total, mix_total = int(table.bytes.sum()), int(table.mix_bytes.sum())
    print(f"{named} of {len(table)} block weights named by {args.file}, {len(table) - named} left to {args.mix}'s "
          f"rule. Block weights: {total} bytes, {8 * total / weights:.4f} bits per weight; {args.mix} alone: "
          f"{mix_total} bytes, {8 * mix_total / weights:.4f} ({total - mix_total:+d} bytes). Saved {path}")
    return 0
