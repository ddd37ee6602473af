"""interp's K-quants (and the legacy types with an importance matrix) are llama-quantize's own bytes.

Three kinds of check:

- **llama.cpp's bytes.** With a build (``LLAMA_CPP_BIN``), tests/kquant_cases.py writes a tiny
  llama whose ``attn_q`` (width 256) and ``ffn_down`` (width 512) start with awkward rows (zeros,
  a huge outlier, one sign only, tiny, constant, below ggml's epsilon, heavy tails, on a grid),
  quantizes it with ``llama-quantize --pure`` to every K type, with and without an importance
  matrix, and every stored block must equal interp's. Without a build, the committed fixture
  (llama-quantize's bytes of those width-256 rows, made by that script) is checked instead.
- **The format's own guarantee.** The last step of every K type rounds each weight to the
  nearest level of its sub-block's stored grid ``d * sc * q - dmin * m``. The grid is read back
  with gguf-py's dequantization (independent of interp's packing): the blocks with every level
  set to 0 and to 1 give each weight's ``base`` and ``step``, and the stored value must be within
  float32 rounding of the nearest of the type's levels.
- **Exactly representable rows.** A row built on a type's grid (sub-block scales and mins that
  are integers times a power of two, the largest of each at the top code, each sub-block using its
  lowest and highest level) is stored exactly: the fit finds its grid to float32 rounding, and the
  fp16 super-block scale and the integer codes snap it back.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from kquant_cases import FIXTURE, KTYPES, LEGACY, awkward_rows, llama_cpp_blocks, write_fixture

from interp.errors import SpecError
from interp.quant import kquants
from interp.quant.llama_cpp import GGML_TYPES, quantize_blocks, stored_weight

BUILD = os.environ.get("LLAMA_CPP_BIN", "")
NO_BUILD = ("needs a llama.cpp build: set LLAMA_CPP_BIN to the folder of llama-quantize (e.g. make llama-cpp); "
            "without one the committed fixture is checked instead")
KEYS = [*KTYPES, *(f"{t}.imatrix" for t in (*KTYPES, *LEGACY))]


def _load_fixture() -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(FIXTURE))


@pytest.mark.parametrize("key", KEYS)
def test_the_committed_blocks_are_llama_quantizes_own(key):
    arrays = _load_fixture()
    ggml_type, _, imatrix = key.partition(".")
    got = quantize_blocks(arrays["rows"], ggml_type, arrays["importance"] if imatrix else None)
    want = arrays[key]
    assert got.shape == want.shape
    differ = np.flatnonzero((got != want).any(axis=1))
    assert differ.size == 0, f"rows {differ.tolist()} differ from llama-quantize's"


def test_the_fixture_holds_the_awkward_rows():
    arrays = _load_fixture()
    rows = arrays["rows"]
    assert rows.shape[1] == 256 and len(rows) > len(awkward_rows(256, 0))
    assert not rows[0].any() and rows[1].max() == 1000 and (rows[2] <= 0).all()
    # with and without the importance matrix llama-quantize stores different bytes: both paths are checked
    assert all((arrays[t] != arrays[f"{t}.imatrix"]).any() for t in KTYPES)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    if not BUILD:
        pytest.skip(NO_BUILD)
    return llama_cpp_blocks(Path(BUILD), tmp_path_factory.mktemp("kquants"))


@pytest.mark.skipif(not BUILD, reason=NO_BUILD)
@pytest.mark.parametrize("ggml_type", [*KTYPES, *LEGACY])
def test_every_block_is_llama_quantizes_own(live, ggml_type):
    tensors, importance, blocks = live
    for with_imatrix in ((False, True) if ggml_type in KTYPES else (True,)):
        for name, rows in tensors.items():
            got = quantize_blocks(rows, ggml_type, importance[name] if with_imatrix else None)
            want = blocks[ggml_type, with_imatrix][name]
            assert got.shape == want.shape
            differ = np.flatnonzero((got != want).any(axis=1))
            assert differ.size == 0, f"{name} (imatrix: {with_imatrix}): rows {differ[:10].tolist()} differ"


@pytest.mark.skipif(not BUILD, reason=NO_BUILD)
def test_the_committed_fixture_is_what_the_build_writes(tmp_path):
    from safetensors.numpy import load_file

    made = load_file(str(write_fixture(Path(BUILD), tmp_path, tmp_path / "fixture.safetensors")))
    committed = _load_fixture()
    assert made.keys() == committed.keys()
    assert all(np.array_equal(made[k], committed[k]) for k in made)


# ---------------------------------------------------------------------------------------
# The format's guarantee: every weight at the nearest level of its sub-block's stored grid

# per type: the byte ranges holding the levels, and the byte that sets every level there to 1 (0 for high bits)
LEVEL_BYTES = {"q2_k": [(16, 80, 0x55)], "q3_k": [(0, 32, 0x00), (32, 96, 0x55)], "q4_k": [(16, 144, 0x11)],
               "q5_k": [(16, 48, 0x00), (48, 176, 0x11)], "q6_k": [(0, 128, 0x11), (128, 192, 0x00)]}
LEVELS = {"q2_k": 4, "q3_k": 8, "q4_k": 16, "q5_k": 32, "q6_k": 64}
ULP = 2.0 ** -24  # float32's relative rounding


def _with_levels(blocks: np.ndarray, ggml_type: str, one: bool) -> np.ndarray:
    """The blocks with every weight's level set to 0 (or 1), scales untouched."""
    out = blocks.reshape(-1, GGML_TYPES[ggml_type][1]).copy()
    for start, stop, byte in LEVEL_BYTES[ggml_type]:
        out[:, start:stop] = byte if one else 0
    return out.reshape(blocks.shape)


def _rows(width: int = 512) -> np.ndarray:
    rng = np.random.default_rng(7)
    normal = rng.standard_normal((24, width)).astype(np.float32) * np.float32(0.02)
    return np.concatenate([awkward_rows(width, 3), normal, normal * np.float32(50), np.abs(normal[:4])])


@pytest.mark.parametrize("ggml_type", KTYPES)
@pytest.mark.parametrize("with_importance", [False, True])
def test_every_weight_is_at_the_nearest_level_of_its_stored_grid(ggml_type, with_importance):
    rows = _rows()
    importance = np.random.default_rng(8).gamma(0.5, 1.0, rows.shape[1]).astype(np.float32) if with_importance \
        else None
    blocks = kquants.quantize(rows, ggml_type, importance)
    stored = kquants.dequantize(blocks, ggml_type).reshape(rows.shape).astype(np.float64)
    base = kquants.dequantize(_with_levels(blocks, ggml_type, False), ggml_type).reshape(rows.shape)
    step = kquants.dequantize(_with_levels(blocks, ggml_type, True), ggml_type).reshape(rows.shape) - base
    x = rows.astype(np.float64)
    levels = base.astype(np.float64)[..., None] + step.astype(np.float64)[..., None] * np.arange(LEVELS[ggml_type])
    nearest = np.abs(x[..., None] - levels).min(axis=-1)
    # the C code divides (x + m) by the stored step and rounds in float32, gguf-py multiplies back in float32: a
    # few roundings of the largest magnitude involved, 2**-24 each; 64 of them is a wide margin
    slack = 64 * ULP * (np.abs(x) + np.abs(base) + LEVELS[ggml_type] * np.abs(step))
    assert (np.abs(x - stored) <= nearest + slack).all()
    assert (step != 0).mean() > 0.9  # the check is not vacuous: nearly every sub-block has a grid
    assert not stored[0].any()  # the zero row


# ---------------------------------------------------------------------------------------
# Rows on a type's grid are stored exactly


def _on_grid(ggml_type: str, rows: int, width: int, seed: int) -> np.ndarray:
    """Rows each of whose sub-blocks is ``D_j * q - M_j`` with the type's codes (see the module docstring)."""
    rng = np.random.default_rng(seed)
    # (weights per sub-block, lowest level, highest level, top scale code, scale unit, top min code, min unit)
    spec = {"q2_k": (16, 0, 3, 15, 2.0 ** -8, 15, 2.0 ** -8), "q3_k": (16, -4, 3, 32, 2.0 ** -8, 0, 0.0),
            "q4_k": (32, 0, 15, 63, 2.0 ** -12, 63, 2.0 ** -10), "q5_k": (32, 0, 31, 63, 2.0 ** -12, 63, 2.0 ** -10),
            "q6_k": (16, -32, 31, 128, 2.0 ** -12, 0, 0.0), "q4_0": (32, -8, 7, 1000, 2.0 ** -14, 0, 0.0),
            "q5_0": (32, -16, 15, 1000, 2.0 ** -14, 0, 0.0), "q4_1": (32, 0, 15, 1000, 2.0 ** -14, 1000, 2.0 ** -12),
            "q5_1": (32, 0, 31, 1000, 2.0 ** -14, 1000, 2.0 ** -12)}[ggml_type]
    n, lo, hi, top, unit, top_min, min_unit = spec
    per_block = 256 // n
    subs = rows * width // n
    q = rng.integers(lo, hi + 1, (subs, n))
    q[:, 0], q[:, 1] = lo, hi  # every sub-block spans its levels: lo is its largest magnitude for the signed types
    q = rng.permuted(q, axis=1)
    scale = rng.integers(1, top + 1, subs)
    offset = rng.integers(0, top_min + 1, subs) if top_min else np.zeros(subs, dtype=np.int64)
    if ggml_type.endswith("_k"):  # the first sub-block of each super-block has the top codes
        scale[::per_block] = top
        offset[::per_block] = top_min
    values = scale[:, None] * unit * q - offset[:, None] * min_unit
    return values.reshape(rows, width).astype(np.float32)


# the legacy types without an importance matrix are gguf-py's quantizers (tests/test_gguf_weights.py)
@pytest.mark.parametrize(("ggml_type", "with_importance"), [*((t, i) for t in KTYPES for i in (False, True)),
                                                            *((t, True) for t in LEGACY)])
def test_a_row_on_the_types_grid_is_stored_exactly(ggml_type, with_importance):
    rows = _on_grid(ggml_type, 6, 512, seed=len(ggml_type) + 11 * with_importance)
    importance = np.random.default_rng(9).uniform(0.5, 2.0, 512).astype(np.float32) if with_importance else None
    back = stored_weight(torch.from_numpy(rows), ggml_type, importance)
    assert back.dtype == torch.float32 and back.shape == rows.shape
    assert np.array_equal(back.numpy(), rows)


# ---------------------------------------------------------------------------------------
# Refusals and the importance llama-quantize passes


def test_refusals_name_the_problem():
    rows = np.ones((2, 256), np.float32)
    with pytest.raises(SpecError, match="not a K-quant type"):
        kquants.quantize(rows, "q7_k")
    with pytest.raises(SpecError, match="do not split"):
        kquants.quantize(np.ones((2, 200), np.float32), "q4_k")
    with pytest.raises(SpecError, match="NaN or infinite"):
        kquants.quantize(np.where(np.eye(2, 256) > 0, np.nan, rows), "q6_k")
    with pytest.raises(SpecError, match="256 input channels"):
        kquants.quantize(rows, "q3_k", np.ones(128, np.float32))
    with pytest.raises(SpecError, match="importance holds NaN"):
        kquants.quantize(rows, "q3_k", np.full(256, np.inf, np.float32))
    with pytest.raises(SpecError, match="no importance-weighted rounding"):
        kquants.quantize_legacy(rows, "q8_0", np.ones(256, np.float32))
    with pytest.raises(SpecError, match="no entry for blk.9.attn_q.weight"):
        kquants.llama_importance(type("M", (), {"sums": {"blk.0.attn_q.weight": np.ones(4)}, "counts": {}})(),
                                 "blk.9.attn_q.weight")


def test_the_importance_is_the_files_float32_sums_over_the_count(tmp_path):
    """llama-quantize divides the file's float32 sums by the float32 token count; write and read back through the
    file and the same float32 values come out."""
    from interp.quant.imatrix import ImportanceMatrix, read_imatrix, write_imatrix

    sums = np.random.default_rng(2).gamma(0.3, 10.0, 256) * 3  # float64: the file rounds them to float32
    matrix = ImportanceMatrix({"blk.0.attn_q.weight": sums}, {"blk.0.attn_q.weight": 3}, chunk_size=3,
                              datasets=("test",))
    back = read_imatrix(write_imatrix(matrix, tmp_path / "imatrix.gguf"))
    mine = kquants.llama_importance(back, "blk.0.attn_q.weight")
    assert mine.dtype == np.float32
    assert np.array_equal(mine, sums.astype(np.float32) / np.float32(3))
    assert np.array_equal(mine, kquants.llama_importance(matrix, "blk.0.attn_q.weight"))


def test_a_576_by_1536_matrix_takes_seconds():
    import time

    rows = np.random.default_rng(0).standard_normal((576, 1536)).astype(np.float32)
    importance = np.random.default_rng(1).random(1536).astype(np.float32)
    start = time.perf_counter()
    for ggml_type in KTYPES:
        kquants.quantize(rows, ggml_type, importance)
    assert time.perf_counter() - start < 60  # about 2.5 s on one core here; the bound leaves room for a slow CI


@pytest.mark.skipif(not BUILD, reason=NO_BUILD)
def test_without_a_build_the_fisher_plan_is_the_one_scored_on_llama_cpps_own_weights(tmp_path, monkeypatch, capsys):
    """The Fisher score on interp's rounding and on llama-quantize's ``--pure`` files sees the same stored weights,
    so the plans (and their summed scores, to the last bit) are the same, K-quants included."""
    import json

    from tiny_gguf import write_tiny_gguf

    from interp.cli.main import main

    model = write_tiny_gguf(tmp_path / "tiny.gguf")

    def plan(out: Path, *extra: str) -> tuple[str, float]:
        assert main(["prescribe", "--model", str(model), "--score", "fisher", "--types",
                     "q2_k,q3_k,q4_0,q4_1,q4_k,q5_0,q5_1,q5_k,q6_k,q8_0", "--target-size", "Q4_K_M", "--n", "8",
                     "--seq-len", "32", "--quiet", "--out", str(out), *extra]) == 0
        return (out / "tensor_types.txt").read_text(), json.loads((out / "llama_plan.json").read_text())[
            "estimated_loss"]

    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    mine = plan(tmp_path / "interp")
    assert "interp's byte-identical rounding" in capsys.readouterr().out
    theirs = plan(tmp_path / "llama", "--llama-cpp", BUILD)
    assert "interp's" not in capsys.readouterr().out  # this one read llama-quantize's --pure files
    assert mine == theirs
    assert any(t in mine[0] for t in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k"))
