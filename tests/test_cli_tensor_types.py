"""``interp tensor-types``: what llama-quantize stores for a tensor-type file, checked against llama-quantize's own
output for the same file (tests/fixtures/llama_cpp/smol_overlap_types.*) on the bundled SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "llama_cpp"


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    from interp.cli.main import main

    out = tmp_path_factory.mktemp("tt") / "out"
    assert main(["tensor-types", str(FIXTURES / "smol_overlap_types.txt"), "--out", str(out)]) == 0
    return pd.read_csv(out / "tensor_types.csv", keep_default_na=False)


def test_every_type_and_byte_count_is_llama_quantizes(table):
    written = json.loads((FIXTURES / "smol_overlap_types.json").read_text())
    assert dict(zip(table.tensor, table.type, strict=True)) == {n: written["tensors"][n] for n in table.tensor}
    assert dict(zip(table.tensor, table.bytes, strict=True)) == {n: written["tensor_bytes"][n] for n in table.tensor}
    assert len(table) == 210


def test_the_mix_columns_are_llama_quantizes_q4_k_m(table):
    mix = json.loads((FIXTURES / "smol_mix_types.json").read_text())["mixes"]["Q4_K_M"]
    assert dict(zip(table.tensor, table.mix_type, strict=True)) == {n: mix["tensors"][n] for n in table.tensor}
    assert dict(zip(table.tensor, table.mix_bytes, strict=True)) == {n: mix["tensor_bytes"][n] for n in table.tensor}


def test_patterns_say_which_item_won(table):
    row = table.set_index("tensor")
    assert row.loc["blk.4.ffn_down.weight", "pattern"] == "ffn_down"  # the first item, not blk\.4\.ffn_down=q3_k
    assert row.loc["blk.1.attn_q.weight", "pattern"] == r"blk\.1\."
    assert row.loc["blk.4.attn_v.weight", "pattern"] == ""  # left to the rule, which counts only what it typed


def test_a_pattern_naming_no_tensor_is_refused_in_interps_words(tmp_path, capsys):
    from interp.cli.main import main

    path = tmp_path / "types.txt"
    path.write_text("blk\\.30\\.ffn_down\\.weight=q6_k\n")  # SmolLM2 has blocks 0..29
    assert main(["tensor-types", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "names no tensor of this model" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "tensor_types.csv").exists()
