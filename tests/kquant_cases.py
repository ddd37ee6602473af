"""Awkward weights quantized by llama.cpp's own ``llama-quantize``, for tests/test_kquants.py.

:func:`llama_cpp_blocks` writes the tiny llama of :mod:`tiny_gguf` with awkward rows in
``blk.0.attn_q`` (input width 256) and ``blk.0.ffn_down`` (width 512), writes an importance
matrix for every block linear weight (:func:`interp.quant.imatrix.write_imatrix`, as interp
writes one for users), runs ``llama-quantize --pure`` to each K type with and without it (and to Q4_0, Q4_1, Q5_0 and
Q5_1 with it), and reads the stored blocks back with gguf-py.

Run as a script it regenerates the committed fixture (llama.cpp's bytes for the width-256
awkward rows, so the byte-exact test also runs where no build is):

    LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin .venv/bin/python tests/kquant_cases.py

which writes ``tests/fixtures/llama_cpp/kquant_blocks.safetensors`` (pickle-free: the input rows,
the importance llama-quantize passes for them, and per type the stored bytes).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np

KTYPES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
LEGACY = ("q4_0", "q4_1", "q5_0", "q5_1")  # run here with the imatrix only: tests/test_gguf_weights.py has them plain
FIXTURE = Path(__file__).parent / "fixtures" / "llama_cpp" / "kquant_blocks.safetensors"
TENSORS = {"blk.0.attn_q.weight": (256, 256), "blk.0.ffn_down.weight": (256, 512)}  # GGUF rows, ne0
COUNT = 7  # tokens the importance matrix says it summed over (llama-quantize divides by it in float32)


def awkward_rows(width: int, seed: int) -> np.ndarray:
    """Rows a quantizer can get wrong: zeros, an outlier, one sign only, tiny, exact grids, constant, heavy tails."""
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal((16, width)).astype(np.float32) * np.float32(0.05)
    rows = [
        np.zeros(width),                                         # all zero: every scale 0
        np.where(np.arange(width) == 37, 1000.0, normal[0]),     # one huge outlier
        -np.abs(normal[1]),                                      # negative only
        np.abs(normal[2]),                                       # positive only
        normal[3] * 1e-5,                                        # the block scale is an fp16 subnormal or 0
        (rng.integers(-4, 4, width) * 0.25),                     # on a signed grid
        (rng.integers(0, 16, width) * 0.125 - 0.5),              # on an offset grid
        np.where((np.arange(width) // 16) % 2 == 0, 0.0, normal[4]),  # every other 16 zero
        np.full(width, 0.5),                                     # constant
        normal[5] * 1e-17,                                       # below ggml's GROUP_MAX_EPS (1e-15)
        rng.standard_t(2, width) * 0.05,                         # heavy tails
        normal[6] * 100.0,                                       # large
        np.where(np.arange(width) % 32 == 5, -3.0, normal[7]),  # a negative outlier in every 32
    ]
    return np.asarray(rows, dtype=np.float32)


def model_tensors() -> dict[str, np.ndarray]:
    """The two tensors of the tiny llama the test replaces: awkward rows first, then seeded normal rows."""
    out = {}
    for seed, (name, (rows, width)) in enumerate(TENSORS.items()):
        odd = awkward_rows(width, seed)
        normal = np.random.default_rng(100 + seed).standard_normal((rows - len(odd), width)) * width ** -0.5
        out[name] = np.concatenate([odd, normal.astype(np.float32)])
    return out


def importance(width: int, seed: int) -> np.ndarray:
    """Sums of squared inputs per channel: spread over decades, a few zero, one dominant."""
    rng = np.random.default_rng(1000 + seed)
    sums = np.exp(rng.normal(0.0, 2.0, width)) * COUNT
    sums[rng.choice(width, 4, replace=False)] = 0.0
    sums[width // 3] *= 1e4
    return sums


def llama_cpp_blocks(build: Path, folder: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray],
                                                         dict[tuple[str, bool], dict[str, np.ndarray]]]:
    """(tensors, importance per tensor as llama-quantize passes it, (type, with imatrix) -> GGUF name -> blocks).

    The blocks are ``uint8 [rows, bytes per row]`` as llama-quantize stored them.
    """
    import gguf
    from tiny_gguf import LAYERS, write_tiny_gguf

    from interp.quant.imatrix import ImportanceMatrix, write_imatrix
    from interp.quant.kquants import llama_importance

    tensors = model_tensors()
    source = write_tiny_gguf(folder / "awkward-f32.gguf", replace=tensors)
    widths = {"attn_q": 256, "attn_k": 256, "attn_v": 256, "attn_output": 256, "ffn_gate": 256, "ffn_up": 256,
              "ffn_down": 512}
    sums = {f"blk.{layer}.{role}.weight": importance(width, 10 * layer + i)
            for layer in range(LAYERS) for i, (role, width) in enumerate(widths.items())}
    matrix = ImportanceMatrix(sums, {name: COUNT for name in sums}, chunk_size=COUNT, datasets=("kquant_cases",))
    imatrix = write_imatrix(matrix, folder / "imatrix.gguf")
    weights = {name: llama_importance(matrix, name) for name in tensors}
    out = {}
    for ggml_type, with_imatrix in [*((t, i) for t in KTYPES for i in (False, True)), *((t, True) for t in LEGACY)]:
        target = folder / f"{ggml_type}{'-imatrix' if with_imatrix else ''}.gguf"
        flags = ["--pure", *(["--imatrix", str(imatrix)] if with_imatrix else [])]
        done = subprocess.run([str(build / "llama-quantize"), *flags, str(source), str(target),
                               ggml_type.upper(), "1"], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"llama-quantize {ggml_type} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        reader = gguf.GGUFReader(str(target))
        found = {}
        for tensor in reader.tensors:
            if tensor.name in tensors:
                assert tensor.tensor_type.name.lower() == ggml_type, (tensor.name, tensor.tensor_type)
                rows = tensors[tensor.name].shape[0]
                found[tensor.name] = np.array(tensor.data, dtype=np.uint8).reshape(rows, -1)
        out[ggml_type, with_imatrix] = found
    return tensors, weights, out


def write_fixture(build: Path, folder: Path, path: Path = FIXTURE) -> Path:
    """llama-quantize's blocks of the width-256 awkward rows (and one normal row) of every K type, with and without
    the importance matrix, and of the legacy types with it, in one safetensors file."""
    from safetensors.numpy import save_file

    tensors, weights, blocks = llama_cpp_blocks(build, folder)
    name, keep = "blk.0.attn_q.weight", len(awkward_rows(256, 0)) + 1
    arrays = {"rows": tensors[name][:keep], "importance": weights[name]}
    for (ggml_type, with_imatrix), found in blocks.items():
        arrays[f"{ggml_type}{'.imatrix' if with_imatrix else ''}"] = found[name][:keep]
    line = "unknown"
    if (build / "llama-perplexity").exists():  # llama-quantize has no --version; the build's other tools do
        version = subprocess.run([str(build / "llama-perplexity"), "--version"], capture_output=True, text=True,
                                 check=False)
        line = next((x for x in (version.stdout + version.stderr).splitlines() if "version" in x), line)
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(path),
              metadata={"made_by": "tests/kquant_cases.py (llama-quantize --pure TYPE, and with --imatrix)",
                        "llama_cpp": line.strip(), "tensor": name})
    return path


if __name__ == "__main__":
    import sys
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    build = Path(os.environ["LLAMA_CPP_BIN"])
    with tempfile.TemporaryDirectory() as tmp:
        print(write_fixture(build, Path(tmp)))
