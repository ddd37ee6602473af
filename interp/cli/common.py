"""What every command shares: the command registry, argument types, the checks that run before any
model loads, and the shared model/data options.

Every argument type parses one value or raises ``ArgumentTypeError`` (argparse exits 2); every check
raises :class:`~interp.errors.InterpError` with one line saying what to fix."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import math
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from interp.errors import InterpError, ModelLoadError, ResourceError

DTYPES = ("float32", "bfloat16", "float16")


Check = Callable[[argparse.Namespace], None]


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help_text: str, configure: Callable[[argparse.ArgumentParser], None]):
    def register(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = (help_text, configure, fn)
        return fn

    return register


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except for flags and options whose default is 'not given'."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action) or ""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``choices``, or ``"."``: ends a sentence either way."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else "."


def unknown_name(what: str, name: str, choices: Sequence[str]) -> str:
    """``unknown component 'x'; did you mean 'y'? Valid components: a, b.``"""
    return f"unknown {what} {name!r}{did_you_mean(name, choices)} Valid {what}s: {', '.join(choices)}."


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number (at least {low}), got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def float_in(low: float, high: float, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in ``[low, high]`` (``(low, high]`` with ``low_open``; ``high`` may be inf)."""
    if math.isinf(high):
        interval = f"{'>' if low_open else '>='} {low:g} (finite)"
    else:
        interval = f"in {'(' if low_open else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number {interval}, got {text!r}") from None
        if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
            raise argparse.ArgumentTypeError(f"must be a number {interval}, got {text!r}")
        return value

    return parse


def split_names(text: str, what: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    if not text.strip() or not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}s without empty entries, got {text!r}")
    return names


def name_list(what: str, valid: Callable[[], Sequence[str]]) -> Callable[[str], str]:
    """An argparse type: comma-separated names, each one of ``valid()``; returns the cleaned text."""

    def parse(text: str) -> str:
        names = split_names(text, what)
        choices = list(valid())
        for name in names:
            if name not in choices:
                raise argparse.ArgumentTypeError(unknown_name(what, name, choices))
        return ",".join(names)

    return parse


def int_list(low: int | None = None, keywords: Sequence[str] = ()) -> Callable[[str], str]:
    """An argparse type: one of ``keywords``, or comma-separated whole numbers (each >= ``low``)."""

    def parse(text: str) -> str:
        if text.strip() in keywords:
            return text.strip()
        items = split_names(text, "whole number")
        for item in items:
            try:
                value = int(item)
            except ValueError:
                hint = did_you_mean(item, keywords) if keywords else "."
                words = f"{', '.join(keywords)} or " if keywords else ""
                raise argparse.ArgumentTypeError(
                    f"expected {words}comma-separated whole numbers like 0,5,-1; {item!r} is not one{hint}") from None
            if low is not None and value < low:
                raise argparse.ArgumentTypeError(f"each number must be at least {low}, got {value}")
        return ",".join(items)

    return parse


def parse_ints(text: str) -> list[int]:
    """The numbers of a value already checked by :func:`int_list`."""
    return [int(x) for x in text.split(",")]


def device_type(text: str) -> str:
    """An argparse type: ``cpu``, or an accelerator that this machine has."""
    text = text.strip()
    if text == "cpu":
        return text
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r} asked for, but CUDA is not available here (torch.cuda.is_available() is False); "
                "use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise argparse.ArgumentTypeError(f"{text!r} asked for, but MPS is not available here; use --device cpu")
    else:
        raise argparse.ArgumentTypeError(f"unsupported device {text!r}; use cpu, cuda, cuda:N or mps")
    return text


def check_model_source(name: str) -> None:
    """The model is a bundled name, an existing .gguf file or a Hugging Face folder."""
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    from interp import models

    if name in models.BUNDLED:
        return
    path = Path(name).expanduser()
    if name.endswith(".gguf") or path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist. Give --model an existing .gguf file.")
        return
    if path.is_dir():
        return
    raise ModelLoadError(
        f"Unknown model {name!r}{did_you_mean(name, models.BUNDLED)} Use one of {sorted(models.BUNDLED)}, "
        "a Hugging Face model folder, or a path to a .gguf file."
    )


def check_cache_dir() -> None:
    """The model cache (``$INTERP_CACHE`` or ``~/.cache/interp``) is a writable folder."""
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    from interp.io import ensure_writable_dir
    from interp.models import cache_dir

    root = cache_dir()
    try:
        ensure_writable_dir(root)
    except ResourceError:
        why = "it is a file" if root.is_file() else "it cannot be created or written"
        where = "INTERP_CACHE" if os.environ.get("INTERP_CACHE") else "the default model cache"
        raise ResourceError(
            f"{where} {root} is not a usable folder ({why}). Point INTERP_CACHE at a writable folder "
            "(e.g. export INTERP_CACHE=$HOME/.cache/interp)."
        ) from None


def check_writable_file(path: str, option: str) -> None:
    """``path`` (symlinks resolved) is a new file name in a folder that can be written (created if needed).

    An existing file is refused: interp cannot tell whether it wrote it, and it never replaces what it
    did not write."""
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    from interp.io import check_output_folder, ensure_writable_dir, resolve

    target = resolve(path)
    if target.is_dir():
        raise ResourceError(f"{option} {path} is a folder; give a file name such as page.png.")
    if target.exists():
        raise ResourceError(f"{option} {path} already exists, and interp never replaces a file it did not write. "
                            "Give a new file name (or move the old file away yourself).")
    if not target.parent.exists():
        check_output_folder(target.parent)  # a folder to create: never the root, home or an ancestor of this one
    try:
        ensure_writable_dir(target.parent)
    except ResourceError:
        raise ResourceError(f"Cannot write {option} {path}: its folder {target.parent} is not writable.") from None


def check_loads_model(args: argparse.Namespace) -> None:
    """Model source and model cache (only needed when the model comes from a file to convert)."""
    check_model_source(args.model)
    if args.model.endswith(".gguf") or args.model in _bundled():
        check_cache_dir()


def check_data(args: argparse.Namespace) -> None:
    """``--data`` can be read and holds text (the rows' length is checked once a tokenizer exists)."""
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    from interp.data import read_documents

    read_documents(args.data)


def out_kind(args: argparse.Namespace) -> str:
    """The kind of output a command writes into ``--out`` (recorded in the folder's interp marker)."""
    if args.command == "quantize":  # what save_quantized or export_compressed_tensors installs there
        from interp.quant.apply import QUANTIZED_KIND
        from interp.quant.export import EXPORT_KIND

        return EXPORT_KIND if getattr(args, "format", None) == "compressed-tensors" else QUANTIZED_KIND
    return str(args.command)


def check_out(args: argparse.Namespace) -> None:
    """``--out`` becomes an interp output folder of this command's kind, through the one output writer
    (:func:`interp.output_folders.claim_folder`): a new or empty folder, or an earlier output of the same kind. A
    non-empty folder interp did not write, the working folder, its ancestors, home and the root are refused."""
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    from interp.io import claim_folder

    claim_folder(args.out, out_kind(args))


def writing_out(args: argparse.Namespace) -> contextlib.AbstractContextManager[Any]:
    """While a command runs, the ``--out`` folder :func:`check_out` claimed holds ``INCOMPLETE``
    (:func:`interp.output_folders.writing`): a kill or a failure at any point leaves it saying so. Under torchrun
    only rank 0, which writes the outputs, marks it (another rank finishing first must not unmark it)."""
    from interp.runtime.torchrun import world  # no torch: read before anything heavy

    if check_out not in getattr(args, "checks", ()) or world()[0] != 0:
        return contextlib.nullcontext()
    from interp.io import writing  # imported on use, like every check here

    return writing(args.out)


def set_threads(args: argparse.Namespace) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def _bundled() -> Sequence[str]:
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    from interp.models import BUNDLED

    return tuple(BUNDLED)


# the commands that split their work over the ranks of a torchrun job (interp.cli.shard, docs/scaling.md)
SHARDED_COMMANDS = ("score", "probe", "attention", "lens", "patch", "report")


def refuse_unsharded(name: str) -> None:
    """Under torchrun (``WORLD_SIZE > 1``) a command that does not split its work stops before it loads anything:
    every rank would repeat the whole run and write the same files."""
    from interp.runtime.torchrun import world  # an empty or half-set torchrun environment is a clear error here

    size = world()[2]
    if size > 1 and name not in SHARDED_COMMANDS:
        raise InterpError(f"interp {name} does not split its work over processes; started here with WORLD_SIZE={size}, "
                          "every rank would repeat the whole run and write the same files. Run it without torchrun. "
                          f"These commands shard whole batches over the ranks: interp "
                          f"{', interp '.join(SHARDED_COMMANDS)} (docs/scaling.md).")


def add_checks(p: argparse.ArgumentParser, *checks: Check) -> None:
    """Run ``checks`` (in order, after those added before) before the command."""
    p.set_defaults(checks=(*(p.get_default("checks") or ()), *checks))


def add_model_data(p: argparse.ArgumentParser, n: int = 64, seq_len: int = 128) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="bundled model (smollm2-135m, gemma3-270m), a Hugging Face folder, or a .gguf file")
    p.add_argument("--data", default="wiki",
                   help="'wiki' (bundled), a .txt file (documents separated by blank lines), a .jsonl file "
                        "or a .csv file with a 'text' field, or a saved datasets folder")
    p.add_argument("--n", type=int_at_least(1), default=n, help="number of examples")
    p.add_argument("--seq-len", type=int_at_least(2), default=seq_len, help="tokens per example, BOS included")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed for which documents are chosen")
    p.add_argument("--batch-size", type=int_at_least(1), default=8, help="examples per forward pass")
    p.add_argument("--device", type=device_type, default="cpu", help="cpu, cuda, cuda:N or mps")
    p.add_argument("--device-map", type=device_map_type, default=None,
                   help="spread the model over devices with accelerate instead of --device: auto, balanced, "
                        "balanced_low_0, sequential, or a JSON object (or .json file) from module name to "
                        "device, 'cpu' or 'disk' (see docs/scaling.md)")
    p.add_argument("--max-memory", type=max_memory_type, default=None,
                   help="with --device-map: the most weight memory per device, e.g. '0=70GiB,1=70GiB,cpu=200GiB'")
    p.add_argument("--offload-folder", default=None, help="with --device-map: where blocks mapped to 'disk' are kept")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="model parameter dtype")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_checks(p, check_loads_model, check_data, check_placement)


def device_map_type(text: str) -> str | dict[str, Any]:
    """An argparse type: a device-map strategy name, or a JSON object (inline or in a .json file)."""
    import json

    text = text.strip()
    if text in ("auto", "balanced", "balanced_low_0", "sequential"):
        return text
    source = Path(text).read_text() if text.endswith(".json") and Path(text).is_file() else text
    try:
        parsed = json.loads(source)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither auto, balanced, balanced_low_0, sequential nor a JSON object (or .json file) "
            "such as '{\"model.layers.0\": 0, \"model.layers.1\": \"disk\"}'") from None
    if not isinstance(parsed, dict) or not parsed or not all(
            isinstance(v, int) or (isinstance(v, str) and v) for v in parsed.values()):
        raise argparse.ArgumentTypeError("a device map is a non-empty JSON object from module name to a GPU "
                                         "number, a device name, 'cpu' or 'disk'")
    return parsed


def max_memory_type(text: str) -> dict[Any, str]:
    """An argparse type: ``DEVICE=SIZE`` pairs separated by commas (``0=70GiB,cpu=200GiB``)."""
    limits: dict[Any, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        device, sep, size = part.partition("=")
        if not sep or not size.strip() or not device.strip():
            raise argparse.ArgumentTypeError(f"{part!r}: write DEVICE=SIZE, e.g. 0=70GiB or cpu=200GiB")
        key = device.strip()
        limits[int(key) if key.isdigit() else key] = size.strip()
    if not limits:
        raise argparse.ArgumentTypeError("--max-memory needs at least one DEVICE=SIZE pair, e.g. 0=70GiB")
    return limits


def check_placement(args: argparse.Namespace) -> None:
    """``--device-map`` replaces ``--device``; its limits and offload folder make sense only with it."""
    device_map = getattr(args, "device_map", None)
    if device_map is None:
        if getattr(args, "max_memory", None) is not None or getattr(args, "offload_folder", None) is not None:
            raise ModelLoadError("--max-memory and --offload-folder go with --device-map.")
        return
    if args.device != "cpu":
        raise ModelLoadError("Give either --device or --device-map: a device map names the devices itself.")
    if isinstance(device_map, dict) and "disk" in device_map.values() and args.offload_folder is None:
        raise ModelLoadError("The device map sends modules to 'disk': add --offload-folder FOLDER.")


def load_model_from_args(args: argparse.Namespace) -> Any:
    """The model of ``--model``, on ``--device`` or spread by ``--device-map``, in ``--dtype``."""
    # imported on use: torch and the analyses take seconds to load; --help must not wait
    import torch

    import interp

    device_map = getattr(args, "device_map", None)
    if device_map is None:
        device = args.device
        from interp.runtime.torchrun import world

        _, local_rank, size = world()
        if device == "cuda" and size > 1:  # torchrun: one GPU per rank
            device = f"cuda:{local_rank}"
        return interp.load_model(args.model, dtype=getattr(torch, args.dtype), device=device)
    return interp.load_model(args.model, dtype=getattr(torch, args.dtype), device_map=device_map,
                             max_memory=args.max_memory, offload_folder=args.offload_folder)


def load_model_and_examples(args: argparse.Namespace, split: str = "eval") -> tuple[Any, Any]:
    # imported on use: the analyses take seconds to load; --help must not wait
    import interp

    model = load_model_from_args(args)
    examples = interp.load_examples(args.data, model.tokenizer, n=args.n, seq_len=args.seq_len,
                                    seed=args.seed, split=split)
    return model, examples


def default_out(name: str) -> str:
    return str(Path("reports") / name)
