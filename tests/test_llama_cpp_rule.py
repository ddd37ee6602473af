"""llama.cpp's mixes as interp models them: the per-tensor types of Q3_K_M / Q4_K_S / Q4_K_M, the
shape fallback, the bits per weight of each type, and the ``--tensor-type-file`` writer and reader.

The expected values are recomputed here another way: type sizes from the fields of ggml's
block structs, the rule spelled out per layer, and the average by a plain loop over tensors."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest

from interp.errors import SpecError
from interp.quant import llama_cpp as lc
from interp.quant.prescribe import ROLE_ORDER, WeightShape

FIXTURES = Path(__file__).parent / "fixtures" / "llama_cpp"

# bytes per block from the fields of ggml-common.h's block structs (d, dmin, scales, qh, qs; fp16 = 2 bytes)
STRUCT_BYTES = {
    "q4_0": (32, 2 + 32 // 2), "q4_1": (32, 2 + 2 + 32 // 2), "q5_0": (32, 2 + 4 + 32 // 2),
    "q5_1": (32, 2 + 2 + 4 + 32 // 2), "q8_0": (32, 2 + 32),
    "q2_k": (256, 256 // 16 + 256 // 4 + 2 + 2), "q3_k": (256, 256 // 8 + 256 // 4 + 12 + 2),
    "q4_k": (256, 2 + 2 + 12 + 256 // 2), "q5_k": (256, 2 + 2 + 12 + 256 // 8 + 256 // 2),
    "q6_k": (256, 256 // 2 + 256 // 4 + 256 // 16 + 2),
}


def shapes_of(n_layers: int, width: int, hidden: int, kv: int) -> list[WeightShape]:
    dims = {"q": (width, width), "k": (kv, width), "v": (kv, width), "o": (width, width),
            "gate": (hidden, width), "up": (hidden, width), "down": (width, hidden)}
    return [WeightShape(layer, role, *dims[role]) for layer in range(n_layers) for role in ROLE_ORDER]


SMOL = shapes_of(30, 576, 1536, 192)  # SmolLM2-135M: 30 blocks, width 576, MLP 1536, 3 KV heads of 64
TOY = shapes_of(16, 512, 1024, 256)  # every input width divisible by 256


@pytest.mark.parametrize("name", sorted(STRUCT_BYTES))
def test_bits_per_weight_match_the_block_structs(name):
    block, nbytes = STRUCT_BYTES[name]
    assert lc.bits_per_weight(name) == 8 * nbytes / block  # exact: a ratio of small integers, a dyadic fraction


def test_use_more_bits_picks_smollm2s_fourteen_layers():
    picked = [i for i in range(30) if lc.use_more_bits(i, 30)]
    assert picked == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]  # n/8 = 3, 7n/8 = 26, then every third


def test_fallback_replaces_k_quants_on_widths_256_does_not_divide():
    assert [lc.fallback(t, 576) for t in ("q3_k", "q4_k", "q5_k", "q6_k", "q8_0")] == \
        ["q4_0", "q5_0", "q5_1", "q8_0", "q8_0"]
    assert [lc.fallback(t, 1536) for t in ("q3_k", "q4_k", "q6_k")] == ["q3_k", "q4_k", "q6_k"]
    assert lc.fallback("q4_k", 40) == "f16"  # not even a 32-block fits
    assert lc.fallback("q4_0", 576) == "q4_0"


def test_q4_k_m_on_smollm2_only_ffn_down_keeps_k_quants():
    stored = lc.stored_types(SMOL, lc.mix_types(SMOL, "Q4_K_M"))
    for s in SMOL:
        more = s.layer in (0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29)
        if s.role == "down":
            want = "q6_k" if more else "q4_k"
        elif s.role == "v":
            want = "q8_0" if more else "q5_0"
        else:
            want = "q5_0"
        assert stored[s.name] == want, s.name


def test_q4_k_m_on_a_divisible_toy_is_the_rule_itself():
    stored = lc.stored_types(TOY, lc.mix_types(TOY, "Q4_K_M"))
    more = {i for i in range(16) if i < 2 or i >= 14 or (i - 2) % 3 == 2}  # n/8 = 2, 7n/8 = 14
    for s in TOY:
        assert stored[s.name] == ("q6_k" if s.role in ("v", "down") and s.layer in more else "q4_k"), s.name


def test_q3_k_m_and_q4_k_s_on_the_toy():
    q3 = lc.mix_types(TOY, "Q3_K_M")
    assert (q3["0.v"], q3["1.v"], q3["2.v"], q3["0.down"], q3["1.down"]) == ("q5_k", "q5_k", "q4_k", "q5_k", "q4_k")
    assert (q3["5.o"], q3["5.q"], q3["5.gate"], q3["5.up"], q3["5.k"]) == ("q4_k", "q3_k", "q3_k", "q3_k", "q3_k")
    s = lc.mix_types(TOY, "Q4_K_S")
    assert [s[f"{i}.v"] for i in range(5)] == ["q5_k"] * 4 + ["q4_k"]
    assert [s[f"{i}.down"] for i in range(3)] == ["q5_k", "q5_k", "q4_k"]  # 16 // 8 = 2
    with pytest.raises(SpecError, match="unknown llama.cpp mix"):
        lc.mix_types(TOY, "Q4_K_L")


def test_smollm2_q4_k_m_averages_about_five_and_a_half_bits():
    """A plain loop: bytes of each tensor from the block structs, summed, over the parameter count."""
    stored = lc.stored_types(SMOL, lc.mix_types(SMOL, "Q4_K_M"))
    bits, count = Fraction(0), 0
    for s in SMOL:
        block, nbytes = STRUCT_BYTES[stored[s.name]]
        bits += Fraction(8 * nbytes * s.d_out * s.d_in, block)
        count += s.d_out * s.d_in
    # float64 sums of 210 terms of ~1e7 bits, each exact below 2**53: relative error well under 1e-12
    assert lc.types_average_bits(SMOL, stored) == pytest.approx(float(bits / count), rel=1e-12)
    assert 5.4 < bits / count < 5.6  # the "about 5.5", against 4.5 for true Q4_K
    assert lc.embedding_type(576) == "q8_0" and lc.embedding_type(512) == "q6_k"


def test_tensor_type_file_round_trips_and_matches_the_fixture(tmp_path):
    """The fixture is written by hand in llama-quantize's documented format (``name=type`` items
    separated by whitespace; names are regular expressions searched in the tensor name)."""
    shapes = SMOL[:7]
    types = {s.name: "q6_k" if s.role in ("v", "down") else "q4_k" for s in shapes}
    path = lc.write_tensor_types(tmp_path / "types.txt", shapes, types)
    assert path.read_text() == (FIXTURES / "smol_layer0_types.txt").read_text()
    names = [lc.gguf_name(s.layer, s.role) for s in SMOL]
    items = lc.read_tensor_types(path, names)
    assert [t for _, t in items] == ["q5_0", "q5_0", "q8_0", "q5_0", "q5_0", "q5_0", "q6_k"]  # fallback applied


@pytest.mark.parametrize("text, words", [
    ("blk\\.0\\.attn_q\\.weight", "is not PATTERN=TYPE"),
    ("=q4_k", "is not PATTERN=TYPE"),
    ("blk\\.0\\.attn_q\\.weight=", "is not PATTERN=TYPE"),
    ("blk\\.0\\.attn_q\\.weight=q7_k", "unknown llama.cpp tensor type"),
    ("blk\\.30\\.attn_q\\.weight=q4_k", "names no tensor"),
    ("blk\\.0\\.attn_x\\.weight=q4_k", "names no tensor"),
    ("blk(=q4_k", "not a regular expression"),
])
def test_bad_tensor_type_files_get_clear_errors(tmp_path, text, words):
    path = tmp_path / "bad.txt"
    path.write_text(text + "\n")
    with pytest.raises(SpecError, match=words):
        lc.read_tensor_types(path, [lc.gguf_name(s.layer, s.role) for s in SMOL])


def test_patterns_are_lowercased_and_types_case_insensitive(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("BLK\\.0\\.FFN_DOWN\\.weight=Q6_K   blk\\.1\\.attn_v\\.weight=q8_0\n")
    assert lc.read_tensor_types(path, [lc.gguf_name(s.layer, s.role) for s in SMOL]) == \
        [("blk\\.0\\.ffn_down\\.weight", "q6_k"), ("blk\\.1\\.attn_v\\.weight", "q8_0")]
    with pytest.raises(SpecError, match="cannot read"):
        lc.read_tensor_types(tmp_path / "missing.txt")


def _llama_cpp_files() -> dict:
    import json

    return json.loads((FIXTURES / "smol_mix_types.json").read_text())["mixes"]


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q3_K_M", "Q4_K_S"])
def test_the_rule_predicts_every_type_llama_quantize_wrote(mix):
    # the fixture: the tensor types of llama-quantize's own files of SmolLM2 (benchmarks/llama_cpp_plans.py made them)
    written = _llama_cpp_files()[mix]["tensors"]
    predicted = lc.stored_types(SMOL, lc.mix_types(SMOL, mix))
    got = {lc.gguf_name(s.layer, s.role): predicted[s.name] for s in SMOL}
    assert got == {name: t for name, t in written.items() if name in got}
    assert len(got) == sum(name.startswith("blk.") and name.endswith(".weight") and "norm" not in name
                           for name in written)
    assert written["token_embd.weight"] == lc.embedding_type(576)  # tied: the output's type


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q3_K_M", "Q4_K_S"])
def test_tensor_bytes_are_blocks_times_block_bytes(mix):
    files = _llama_cpp_files()[mix]
    dims = {lc.gguf_name(s.layer, s.role): (s.d_out, s.d_in) for s in SMOL}
    for name, nbytes in files["tensor_bytes"].items():
        if name in dims:
            d_out, d_in = dims[name]
            block, block_bytes = STRUCT_BYTES.get(files["tensors"][name], (1, 4))
            assert nbytes == d_out * d_in // block * block_bytes, name


GEMMA = [WeightShape(layer, role, *dims) for layer in range(18) for role, dims in (
    ("q", (1024, 640)), ("k", (256, 640)), ("v", (256, 640)), ("o", (640, 1024)), ("gate", (2048, 640)),
    ("up", (2048, 640)), ("down", (640, 2048)))]  # Gemma-3-270m: 4 heads and 1 KV head of 256, MLP 2048


def _gemma_files() -> dict:
    import json

    return json.loads((FIXTURES / "gemma_mix_types.json").read_text())


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q3_K_M", "Q4_K_S"])
def test_the_rule_predicts_llama_quantizes_gemma_files(mix):
    """A second architecture (width 640: q, k, v, gate and up fall back; o and down keep K-quants), against
    llama-quantize's own files of Gemma-3-270m (benchmarks/llama_cpp_plans.py, registration 6, made them)."""
    written = _gemma_files()["mixes"][mix]
    predicted = lc.stored_types(GEMMA, lc.mix_types(GEMMA, mix))
    assert {lc.gguf_name(s.layer, s.role): predicted[s.name] for s in GEMMA} == \
        {name: t for name, t in written["tensors"].items() if name.startswith("blk.")}
    assert written["tensors"]["token_embd.weight"] == lc.embedding_type(640) == "q8_0"
    for s in GEMMA:  # bytes: blocks times the block struct's bytes
        block, nbytes = STRUCT_BYTES[predicted[s.name]]
        assert written["tensor_bytes"][lc.gguf_name(s.layer, s.role)] == s.d_out * s.d_in // block * nbytes


def test_the_bundled_gemma_is_llama_cpps_own_q4_k_m():
    """Why registration 6 does not judge Q4_K_M: the bundled file already has every type that mix asks for."""
    files = _gemma_files()
    assert files["bundled"]["tensors"] == files["mixes"]["Q4_K_M"]["tensors"]


def test_a_partial_overlapping_tensor_type_file_resolves_as_llama_quantize_did():
    """The fixture is llama-quantize's own output for a hand-written file whose patterns overlap (the first match
    wins), are mixed case, ask for K-quants the width forbids, and leave most weights to the Q4_K_M rule. Its
    overrides of blk.1 and blk.3 shift the rule's attn_v bumps (llama.cpp counts only the weights its rule typed),
    which a per-layer reading of the rule gets wrong at blk.4."""
    import json

    written = json.loads((FIXTURES / "smol_overlap_types.json").read_text())["tensors"]
    names = [lc.gguf_name(s.layer, s.role) for s in SMOL]
    items = lc.read_tensor_types(FIXTURES / "smol_overlap_types.txt", names)
    got = lc.resolve_tensor_types(SMOL, items, "Q4_K_M")
    assert {lc.gguf_name(s.layer, s.role): got[s.name][0] for s in SMOL} == {n: written[n] for n in names}
    assert got["4.v"] == ("q8_0", "") and lc.stored_types(SMOL, lc.mix_types(SMOL, "Q4_K_M"))["4.v"] == "q5_0"
    assert got["4.down"] == ("q6_k", "ffn_down")  # the earlier item wins over blk\.4\.ffn_down=q3_k
    untouched = lc.resolve_tensor_types(SMOL, [], "Q4_K_M")  # no items: the mix itself
    assert {k: t for k, (t, _) in untouched.items()} == lc.stored_types(SMOL, lc.mix_types(SMOL, "Q4_K_M"))
