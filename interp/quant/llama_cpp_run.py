"""Running llama.cpp itself: ``llama-quantize`` writes the files, ``llama-perplexity`` measures them.

interp does not ship llama.cpp. A *build* is a folder holding its ``llama-quantize`` and
``llama-perplexity`` binaries (``make llama-cpp`` builds one from the ``llama-cpp-python``
sdist, without native CPU detection), named by ``--llama-cpp DIR`` or the ``LLAMA_CPP_BIN``
environment variable; a CMake build folder whose ``bin/`` holds them is taken too.

What is here, shared by ``interp prescribe --gguf`` and ``benchmarks/llama_cpp_plans.py``:

- :func:`find_build` checks a named build before any work; :func:`quantize` runs
  ``llama-quantize`` into a file written through interp's writer (whole or absent).
- :func:`pure_rounding`: every block linear weight as llama.cpp stores it in each type
  (``llama-quantize --pure`` files of the reference, dequantized), for the Fisher score.
- :func:`fit_to_size`: a plan re-chosen with less room until its file is at most a size in
  bytes (alignment padding and metadata are only known once the file is written).
- :func:`kl_divergence`: ``llama-perplexity --kl-divergence-base`` on the reference, then
  ``--kl-divergence`` for each file: mean, 99th and 99.9th percentile KL and the share of
  positions with the same top token, as llama.cpp prints them (:func:`parse_kl`).
- :func:`prescribe_commands`: the exact command lines, printed when no build is named.

Example:
    >>> report = ("Mean ln(PPL(Q)/PPL(base))     :   0.036918 ±   0.001201\\nMean    KLD:   0.037806 ±   0.001034\\n"
    ...           "99.9%   KLD:   0.764152\\n99.0%   KLD:   0.300982\\nSame top p: 90.330 ± 0.464 %\\n")
    >>> parse_kl(report)["mean_kl"], parse_kl(report)["same_top"]
    (0.037806, 90.33)
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from interp.errors import SpecError, ToolError

__all__ = ["BUILD_ENV", "block_bytes", "block_types", "check_target_file", "find_build", "fit_to_size", "gguf_shapes",
           "gguf_source", "heldout_text", "kl_divergence", "mix_block_bytes", "mix_file_name", "nearest_mix",
           "parse_kl", "perplexity_commands", "prescribe_commands", "pure_rounding", "quantize", "quantize_command",
           "rest_bytes", "rounding_of", "target_capacity"]

BUILD_ENV = "LLAMA_CPP_BIN"
NEEDED = ("llama-quantize", "llama-perplexity")
HOW_TO_BUILD = "`make llama-cpp` builds one, see docs/prescribe.md"
T = TypeVar("T")


def find_build(path: str | os.PathLike[str] | None = None, need: Sequence[str] = NEEDED) -> Path | None:
    """The folder of llama.cpp's binaries named by ``path`` or ``$LLAMA_CPP_BIN``, checked; ``None`` if none is named.

    Raises:
        ToolError: the named folder does not exist, is not a folder, or lacks one of ``need``
            (as an executable file), in that folder or its ``bin/``.
    """
    named = os.fspath(path) if path is not None else os.environ.get(BUILD_ENV, "")
    if not named:
        return None
    where = "--llama-cpp" if path is not None else BUILD_ENV
    folder = Path(named).expanduser()
    if not folder.exists():
        raise ToolError(f"the llama.cpp build {named} ({where}) does not exist; name the folder that holds "
                        f"{' and '.join(need)} ({HOW_TO_BUILD})")
    if not folder.is_dir():
        raise ToolError(f"the llama.cpp build {named} ({where}) is a file, not a folder; name the folder that holds "
                        f"{' and '.join(need)}")
    if not _executable(folder / need[0]) and _executable(folder / "bin" / need[0]):
        folder = folder / "bin"
    missing = [tool for tool in need if not _executable(folder / tool)]
    if missing:
        raise ToolError(f"the llama.cpp build {named} ({where}) has no {' or '.join(missing)}: name the folder of "
                        f"llama.cpp's binaries (cmake --build BUILD --target {' '.join(need)}; {HOW_TO_BUILD})")
    return folder


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def gguf_source(model: str) -> Path | None:
    """The GGUF file llama.cpp starts from for ``--model``: a bundled model's or a ``.gguf`` path; else ``None``."""
    from interp.models import BUNDLED, _bundled_gguf

    if model in BUNDLED:
        return _bundled_gguf(model)
    return Path(model).expanduser() if model.endswith(".gguf") else None


def _run(build: Path, tool: str, args: Sequence[str], log: list[str] | None = None, cwd: Path | None = None) -> str:
    """Run ``tool`` of ``build`` with ``args`` (in ``cwd`` if given); its output (stdout and stderr), or a ToolError
    naming its last line."""
    command = [os.path.abspath(build / tool), *map(str, args)]
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                              check=False, cwd=cwd)
    except OSError as error:
        raise ToolError(f"cannot run {command[0]} ({error})") from None
    if log is not None:
        log.append(f"$ {shlex.join(command)}\n{done.stdout}")
    if done.returncode != 0:
        lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
        last = next((line for line in reversed(lines) if "error" in line.lower() or "failed" in line.lower()),
                    lines[-1] if lines else "no output")
        raise ToolError(f"{tool} failed (exit status {done.returncode}): {last}")
    return done.stdout


def quantize_command(tool: str | os.PathLike[str], source: str | os.PathLike[str], target: str | os.PathLike[str],
                     ggml_type: str, *flags: str, threads: int | None = None) -> list[str]:
    """``llama-quantize [FLAGS] SOURCE TARGET TYPE [THREADS]`` as a list of arguments."""
    return [os.fspath(tool), *flags, os.fspath(source), os.fspath(target), ggml_type,
            *([str(threads)] if threads else [])]


def quantize(build: Path, source: str | os.PathLike[str], target: str | os.PathLike[str], ggml_type: str, *flags: str,
             imatrix: str | os.PathLike[str] | None = None, threads: int | None = None, log: list[str] | None = None
             ) -> Path:
    """``llama-quantize [--imatrix NAME] [FLAGS] SOURCE TARGET TYPE``, the file written through
    :func:`interp.io.write_file`.

    ``imatrix``: the importance matrix, and the only way one reaches llama-quantize (``--imatrix`` in ``flags`` is a
    ValueError). llama-quantize stores the path as given in the file's metadata (``quantize.imatrix.file``), so the
    file's header and its alignment padding depend on that path; the tool runs in the matrix's folder with its bare
    name, and the same matrix makes the same bytes wherever its folder lies. Paths in ``flags``
    (``--tensor-type-file``) are made absolute first."""
    from interp.io import write_file

    if "--imatrix" in flags:
        raise ValueError("pass the importance matrix as quantize(..., imatrix=PATH), not as a flag: llama-quantize "
                         "stores the path as given, so interp runs it in the matrix's folder")
    flags = tuple(os.path.abspath(f) if i and flags[i - 1] == "--tensor-type-file" else f for i, f in enumerate(flags))
    cwd = None
    if imatrix is not None:
        cwd = Path(os.path.abspath(imatrix)).parent
        flags = ("--imatrix", Path(imatrix).name, *flags)

    def produce(tmp: Path) -> None:
        _run(build, "llama-quantize", quantize_command("", os.path.abspath(source), os.path.abspath(tmp), ggml_type,
                                                       *flags, threads=threads)[1:], log, cwd)

    return write_file(target, produce)


def block_types(path: str | os.PathLike[str]) -> dict[str, tuple[str, int]]:
    """GGUF name -> (lowercase ggml type, bytes) of every block linear weight, from the header (nothing dequantized)."""
    import gguf

    return {t.name: (t.tensor_type.name.lower(), int(t.n_bytes)) for t in gguf.GGUFReader(str(path)).tensors
            if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.data.shape) == 2}


def block_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of a GGUF file's block linear weights (:func:`block_types`)."""
    return sum(nbytes for _, nbytes in block_types(path).values())


def pure_rounding(build: Path, reference: Path, types: Sequence[str], folder: Path, threads: int | None = None,
                  log: list[str] | None = None) -> Callable[[int, str, Any], dict[str, Any]]:
    """llama.cpp's own rounding of every block linear weight in each of ``types``.

    One ``llama-quantize --pure`` file of ``reference`` per type is written in ``folder``, read
    back dequantized (:func:`~interp.quant.llama_cpp.gguf_block_weights`) and removed. The
    returned function maps ``(layer, role, W)`` to ``{type: weight}`` for the types llama.cpp
    stores that weight in as asked (a type whose block does not divide the input width falls
    back, and is left out): the ``rounded`` argument of
    :func:`~interp.quant.llama_plan.score_llama_options`.
    """
    from interp.io import remove_temp
    from interp.quant.llama_cpp import gguf_block_weights

    weights = {}
    for ggml_type in dict.fromkeys(types):
        path = quantize(build, reference, folder / f"pure-{ggml_type}.gguf", ggml_type.upper(), "--pure",
                        threads=threads, log=log)
        weights[ggml_type] = gguf_block_weights(path)
        remove_temp(path)
    return rounding_of(weights)


def rounding_of(weights: dict[str, dict[tuple[int, str], tuple[str, Any]]]
                ) -> Callable[[int, str, Any], dict[str, Any]]:
    """``(layer, role, W) -> {type: weight}`` from each type's ``--pure`` file read by
    :func:`~interp.quant.llama_cpp.gguf_block_weights`, keeping a type only where llama.cpp stored it as asked."""
    import torch

    def rounded(layer: int, role: str, W: Any) -> dict[str, Any]:
        # host: llama.cpp's stored blocks are read as numpy arrays; each moves to the weight's device once
        return {t: torch.from_numpy(found[layer, role][1]).to(W.device) for t, found in weights.items()
                if found[layer, role][0] == t}

    return rounded


def fit_to_size(choose: Callable[[int], T], write: Callable[[T], Path], capacity: int, limit: int,
                note: Callable[[int], None] | None = None) -> tuple[T, Path, int]:
    """``write(choose(capacity))``, chosen again with less room while the written file is over ``limit`` bytes.

    Each time the file is ``x`` bytes over, ``x`` more comes off the capacity (the registered
    equal-size rule: alignment padding and metadata are only known once the file is written).
    Returns the choice, the file and the capacity taken off; ``note(slack)`` hears of each retry.
    """
    slack = 0
    while True:
        chosen = choose(capacity - slack)
        path = write(chosen)
        size = Path(path).stat().st_size
        if size <= limit:
            return chosen, path, slack
        slack += size - limit
        if note is not None:
            note(slack)


KL_FIELDS = {"mean_kl": r"Mean\s+KLD:\s+(-?[\d.]+)", "mean_kl_se": r"Mean\s+KLD:\s+-?[\d.]+\s+±\s+([\d.]+)",
             "kl_p99": r"99\.0%\s+KLD:\s+(-?[\d.]+)", "kl_p999": r"99\.9%\s+KLD:\s+(-?[\d.]+)",
             "same_top": r"Same top p:\s+([\d.]+)", "ln_ppl_ratio": r"Mean ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s+(-?[\d.]+)"}


def parse_kl(output: str) -> dict[str, float]:
    """llama-perplexity's KL statistics (``same_top`` in percent); ToolError when any is missing (a cut report)."""
    found = {}
    for key, pattern in KL_FIELDS.items():
        match = re.search(pattern, output)
        if match:
            found[key] = float(match.group(1))
    if len(found) < len(KL_FIELDS):
        tail = " / ".join(line.strip() for line in output.strip().splitlines()[-3:])
        missing = ", ".join(k for k in KL_FIELDS if k not in found)
        raise ToolError(f"llama-perplexity printed no KL statistics ({missing} missing); its output ends: "
                        f"{tail or 'nothing'}")
    chunks = re.search(r"computing over (\d+) chunks", output)
    if chunks:
        found["chunks"] = int(chunks.group(1))
    return found


def perplexity_commands(tool: str | os.PathLike[str], reference: str | os.PathLike[str], text: str | os.PathLike[str],
                        base: str | os.PathLike[str], files: Sequence[str | os.PathLike[str]], ctx: int, chunks: int,
                        threads: int | None = None) -> list[list[str]]:
    """The reference's run that saves its log-probabilities in ``base``, then one KL run per file."""
    common = ["-c", str(ctx), *(["-t", str(threads)] if threads else [])]
    first = [os.fspath(tool), "-m", os.fspath(reference), "-f", os.fspath(text), "--chunks", str(chunks), *common,
             "--kl-divergence-base", os.fspath(base)]
    return [first, *([os.fspath(tool), "-m", os.fspath(f), *common, "--kl-divergence-base", os.fspath(base),
                      "--kl-divergence"] for f in files)]


def kl_divergence(build: Path, reference: Path, files: dict[str, Path], text: Path, folder: Path, ctx: int = 256,
                  chunks: int = 32, threads: int | None = None, log: list[str] | None = None
                  ) -> dict[str, dict[str, float]]:
    """Each file's KL against ``reference`` on ``text`` (``chunks`` contexts of ``ctx`` tokens; llama.cpp scores
    the second half of each), as :func:`parse_kl` reads llama-perplexity's report. The reference's
    log-probabilities go to a file in ``folder``, removed at the end."""
    from interp.io import remove_temp

    base = folder / "kl-base.bin"
    runs = perplexity_commands(build / "llama-perplexity", reference, text, base, list(files.values()), ctx, chunks,
                               threads)
    try:
        _run(build, "llama-perplexity", runs[0][1:], log)
        if not base.is_file():
            raise ToolError(f"llama-perplexity wrote no log-probabilities to {base}")
        return {name: _kl_run(build, run[1:], log) for name, run in zip(files, runs[1:], strict=True)}
    finally:
        if base.exists():
            remove_temp(base)


def _kl_run(build: Path, args: Sequence[str], log: list[str] | None, tries: int = 8) -> dict[str, float]:
    """One ``--kl-divergence`` run, read by :func:`parse_kl`; run again when its report is missing.

    llama.cpp prints through a logging thread that it never stops (its logger is leaked on purpose,
    llama.cpp issue 22142), so the last lines of a run can be lost when the process exits before
    that thread has written them. On 2 busy cores a tiny model's run (under a second) lost part of its
    report about half the time; SmolLM2's (a minute) did not.
    The statistics are computed before they are printed, so a rerun gives the same numbers."""
    for attempt in range(tries):
        output = _run(build, "llama-perplexity", args, log)
        try:
            return parse_kl(output)
        except ToolError:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")  # the loop returns or raises


def heldout_text(source: str | os.PathLike[str], tokenizer: Any, tokens: int) -> tuple[str, list[str]]:
    """Documents of ``source``'s eval split (never calibration text), in order, until they hold ``tokens``
    tokens (counted by ``tokenizer``), joined by blank lines; and their ids.

    Raises:
        DataError: the eval split holds fewer tokens.
    """
    from interp.data import read_documents, split_of
    from interp.errors import DataError

    parts, ids, count = [], [], 0
    for doc in read_documents(os.fspath(source)):
        if split_of(doc.id) != "eval":
            continue
        parts.append(doc.text)
        ids.append(doc.id)
        count += len(tokenizer(doc.text)["input_ids"]) + 1
        if count >= tokens:
            return "\n\n".join(parts), ids
    raise DataError(f"the eval split of {source} holds about {count} tokens; llama-perplexity needs {tokens} here "
                    "(fewer --kl-chunks or a smaller --kl-ctx)")


def prescribe_commands(build: Path | None, source: Path, out: Path, gguf: Path, mix: str, imatrix: bool, ctx: int,
                       chunks: int, threads: int | None = None) -> list[list[str]]:
    """The commands ``interp prescribe --gguf`` runs (or prints without a build), in order: ``cd OUT`` (they run
    there, as :func:`quantize` runs llama-quantize in the importance matrix's folder, so that the matrix's bare name
    is what the files store), the F32 reference, the plan's file, the mix's file, the reference's log-probabilities,
    and the two KL runs; every other path absolute.

    The reference, the mix's file and the log-probabilities are ``out/reference-f32.gguf``,
    ``out/MIX.gguf`` and ``out/kl-base.bin`` (a build run keeps only the mix's file)."""
    quant = Path(os.path.abspath(build / "llama-quantize")) if build else "llama-quantize"
    ppl = Path(os.path.abspath(build / "llama-perplexity")) if build else "llama-perplexity"
    source, out, gguf = (Path(os.path.abspath(p)) for p in (source, out, gguf))  # the commands run in out
    reference = out / "reference-f32.gguf"
    with_imatrix = ("--imatrix", "imatrix.gguf") if imatrix else ()  # as quantize() passes it: see there
    mix_file = out / mix_file_name(mix, imatrix)
    return [["cd", str(out)],
            quantize_command(quant, source, reference, "F32", "--allow-requantize", threads=threads),
            quantize_command(quant, reference, gguf, mix, *with_imatrix, "--tensor-type-file",
                             str(out / "tensor_types.txt"), threads=threads),
            quantize_command(quant, reference, mix_file, mix, *with_imatrix, threads=threads),
            *perplexity_commands(ppl, reference, out / "heldout.txt", out / "kl-base.bin", [gguf, mix_file], ctx,
                                 chunks, threads)]


def mix_file_name(mix: str, imatrix: bool) -> str:
    """``Q4_K_M-imatrix.gguf`` or ``Q4_K_M.gguf``: llama.cpp's own mix beside the plan."""
    return f"{mix}{'-imatrix' if imatrix else ''}.gguf"


def check_target_file(gguf: str | os.PathLike[str], source: Path | None) -> Path:
    """``--gguf``: a ``.gguf`` file name that is not a folder and not the model's own file (SpecError otherwise)."""
    path = Path(gguf).expanduser()
    if path.suffix != ".gguf":
        raise SpecError(f"--gguf {gguf}: give a file name ending in .gguf")
    if path.is_dir():
        raise SpecError(f"--gguf {gguf} is a folder; give a file name ending in .gguf")
    if source is not None and path.exists() and path.resolve() == source.resolve():
        raise SpecError(f"--gguf {gguf} is the model's own file; choose another name")
    return path


def gguf_shapes(path: str | os.PathLike[str]) -> list[Any]:
    """The block linear weights of a GGUF file as :class:`~interp.quant.shapes.WeightShape` (from its header alone,
    in interp's order: by layer, then q, k, v, o, gate, up, down)."""
    import gguf

    from interp.quant.llama_cpp import TENSOR_ROLES
    from interp.quant.prescribe import ROLE_ORDER
    from interp.quant.shapes import WeightShape

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as error:
        raise SpecError(f"cannot read {path} as a GGUF file ({error})") from None
    shapes = []
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in TENSOR_ROLES:
            d_in, d_out = int(tensor.shape[0]), int(tensor.shape[1])  # GGUF shapes are [ne0 = d_in, ne1 = d_out]
            shapes.append(WeightShape(int(parts[1]), TENSOR_ROLES[parts[2]], d_out, d_in))
    return sorted(shapes, key=lambda s: (s.layer, ROLE_ORDER.index(s.role)))


def rest_bytes(path: str | os.PathLike[str]) -> int:
    """About how many bytes of a llama-quantize file of ``path`` are not block linear weights: the source's header,
    its other tensors as stored (norms stay F32), and the token embedding and output at the type every ``_M`` and
    ``_S`` mix gives them (:func:`~interp.quant.llama_cpp.embedding_type`), each padded to the file's alignment.
    An estimate to within the metadata llama-quantize adds (a few hundred bytes); a build measures it."""
    import gguf

    from interp.quant.llama_cpp import TENSOR_ROLES, embedding_type, tensor_bytes

    reader = gguf.GGUFReader(str(path))
    align = 32
    field = reader.fields.get("general.alignment")
    if field is not None:
        align = int(field.parts[-1][0])
    total = int(reader.data_offset)
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in TENSOR_ROLES:
            continue
        if tensor.name in ("token_embd.weight", "output.weight") and len(tensor.shape) == 2:
            d_in, d_out = int(tensor.shape[0]), int(tensor.shape[1])
            nbytes = tensor_bytes(embedding_type(d_in), d_out, d_in)
        else:
            nbytes = int(tensor.n_bytes)
        total += -(-nbytes // align) * align
    return total


def mix_block_bytes(shapes: Sequence[Any], mix: str) -> int:
    """Bytes of the block linear weights in llama.cpp's ``mix`` (its rule and the shape fallback)."""
    from interp.quant.llama_cpp import mix_types, stored_types, tensor_bytes

    stored = stored_types(shapes, mix_types(shapes, mix))
    return sum(tensor_bytes(stored[s.name], s.d_out, s.d_in) for s in shapes)


def nearest_mix(shapes: Sequence[Any], bits: float) -> str:
    """The llama.cpp mix whose block linear weights' bits per weight lie nearest ``bits``."""
    from interp.quant.llama_cpp import MIXES

    total = sum(s.size for s in shapes)
    return min(MIXES, key=lambda mix: abs(8 * mix_block_bytes(shapes, mix) / total - bits))


def target_capacity(shapes: Sequence[Any], source: Path, target: int | str, widths: Sequence[int] | None,
                    score: str = "proxy", types: Sequence[str] | None = None, exclude: Sequence[str] = ()
                    ) -> tuple[int, str]:
    """``--target-size``: the bytes the block linear weights may take, and the mix to compare with.

    A mix name: that mix's block bytes (:func:`mix_block_bytes`). A size in bytes: the size less
    :func:`rest_bytes`, compared with the nearest mix. A build then measures both from the files.

    Raises:
        SpecError: the size is below the smallest file the candidate types make.
    """
    from interp.quant.llama_cpp import tensor_bytes
    from interp.quant.prescribe import candidate_options

    options = candidate_options(shapes, widths, score, types, exclude)
    cheapest = sum(min(tensor_bytes(t, s.d_out, s.d_in) for t in opts) for s, opts in zip(shapes, options,
                                                                                          strict=True))
    total = sum(s.size for s in shapes)
    if isinstance(target, str):
        capacity, mix = mix_block_bytes(shapes, target), target
        rest = 0
    else:
        rest = rest_bytes(source)
        capacity = target - rest
        mix = nearest_mix(shapes, 8 * max(capacity, 0) / total)
    if capacity < cheapest:
        raise SpecError(f"--target-size {target}{' bytes' if isinstance(target, int) else ''} is below the smallest "
                        f"file these types make: about {cheapest + rest} bytes ({cheapest} for the block linear "
                        f"weights at their cheapest types, {8 * cheapest / total:.4f} bits per weight, and about "
                        f"{rest} for the rest)")
    return capacity, mix
