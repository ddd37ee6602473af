"""`interp lens` and `interp patch` end to end on a small model folder: outputs written, and a
rerun into the same --out scores nothing again (the errors live in a resumable store)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from interp.cli.main import main
from interp.models import TINY_VOCAB, tiny_tokenizer
from interp.quant.store import ScoreStore

pytestmark = pytest.mark.usefixtures("one_thread")  # one_thread: conftest.py

SPEC = "rtn:bits=3,group=32"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-lens")
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            bos_token_id=256, eos_token_id=257, pad_token_id=258)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    tiny_tokenizer().save_pretrained(root / "model")
    docs = [f"Document {i}: " + " ".join(f"word{(i * 7 + j) % 23}" for j in range(12)) for i in range(40)]
    (root / "docs.txt").write_text("\n\n".join(docs) + "\n")  # .txt: documents separated by blank lines
    return root


def _args(verb: str, root, out, *extra: str) -> list[str]:
    return [verb, "--model", str(root / "model"), "--data", str(root / "docs.txt"), "--n", "10", "--seq-len", "16",
            "--method", SPEC, "--top", "0.2", "--out", str(out), "--quiet", *extra]


def _logged_batches(out) -> int:
    store = ScoreStore(out / "scores")
    try:
        return len(store.batch_log())
    finally:
        store.close()


def test_lens_writes_its_tables_and_a_rerun_scores_nothing(model_folder, tmp_path, capsys):
    out = tmp_path / "lens"
    assert main(_args("lens", model_folder, out)) == 0
    for name in ("early_exit.csv", "early_exit.html", "restoration.csv", "split.csv", "settings.json"):
        assert (out / name).is_file(), name
    first = (out / "early_exit.csv").read_text()
    scored = _logged_batches(out)
    assert scored > 0
    assert main(_args("lens", model_folder, out)) == 0
    assert _logged_batches(out) == scored  # the errors came from the store
    assert (out / "early_exit.csv").read_text() == first


def test_patch_writes_its_table(model_folder, tmp_path):
    import pandas as pd

    out = tmp_path / "patch"
    assert main(_args("patch", model_folder, out, "--experiments", "table", "--components", "attn_out,down")) == 0
    for name in ("patching_table.csv", "patching_table.html", "split.csv", "settings.json"):
        assert (out / name).is_file(), name
    table = pd.read_csv(out / "patching_table.csv")
    assert len(table) == 2 and table["recovery"].notna().all()  # one row per component
