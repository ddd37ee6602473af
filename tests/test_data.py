"""Examples: bundled and user text, fixed length, seeded, disjoint splits, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

import interp
from interp.data import load_examples, split_of, wiki_documents
from interp.errors import DataError
from interp.models import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_wiki_has_the_bundled_documents():
    docs = wiki_documents()
    assert len(docs) > 10_000 and all(d.text.strip() for d in docs)
    assert len({d.id for d in docs}) == len(docs)


def test_rows_are_bos_plus_document_prefix(tok):
    ex = load_examples("wiki", tok, n=5, seq_len=40, seed=1)
    assert ex.tokens.shape == (5, 40) and ex.tokens.dtype == torch.long
    for row, text in zip(ex.tokens, ex.texts, strict=True):
        assert int(row[0]) == tok.bos_token_id
        expected = tok(text, add_special_tokens=False)["input_ids"][:39]
        assert row[1:].tolist() == expected


def test_seeded_and_deterministic(tok):
    a = load_examples("wiki", tok, n=20, seq_len=32, seed=7)
    b = load_examples("wiki", tok, n=20, seq_len=32, seed=7)
    c = load_examples("wiki", tok, n=20, seq_len=32, seed=8)
    assert a.ids == b.ids and torch.equal(a.tokens, b.tokens)
    assert a.ids != c.ids


def test_calibration_and_eval_are_disjoint(tok):
    ev = load_examples("wiki", tok, n=200, seq_len=32, split="eval")
    cal = load_examples("wiki", tok, n=100, seq_len=32, split="calibration")
    assert not set(ev.ids) & set(cal.ids)
    assert all(split_of(i) == "calibration" for i in cal.ids)


def test_too_many_examples_names_the_available_count(tok):
    with pytest.raises(DataError, match=r"only \d+ documents have at least"):
        load_examples("wiki", tok, n=10**6, seq_len=64)


def test_text_and_jsonl_and_dataset_sources(tok, tmp_path):
    docs = [("alpha beta gamma delta epsilon " * 4).strip(), ("one two three four five six " * 4).strip(), "short"]
    txt = tmp_path / "docs.txt"
    txt.write_text("\n\n".join(docs))
    ex = load_examples(txt, tok, n=2, seq_len=30, split="all")
    assert len(ex) == 2 and set(ex.texts) == set(docs[:2])
    jl = tmp_path / "docs.jsonl"
    jl.write_text("\n".join(json.dumps({"id": f"d{i}", "text": t}) for i, t in enumerate(docs)))
    ex2 = load_examples(jl, tok, n=2, seq_len=30, split="all")
    assert set(ex2.ids) == {"d0", "d1"}
    import datasets

    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "ds"))
    ex3 = load_examples(tmp_path / "ds", tok, n=2, seq_len=30, split="all")
    assert set(ex3.texts) == set(docs[:2])


def test_source_errors(tok, tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_examples(tmp_path / "missing.txt", tok, n=1, seq_len=8)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n \t\n")
    with pytest.raises(DataError, match="contains no text"):
        load_examples(empty, tok, n=1, seq_len=8)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(DataError, match="not valid UTF-8"):
        load_examples(bad, tok, n=1, seq_len=8)
    nofield = tmp_path / "x.jsonl"
    nofield.write_text('{"body": "hello"}\n')
    with pytest.raises(DataError, match="no 'text' field"):
        load_examples(nofield, tok, n=1, seq_len=8)


def test_examples_subset_keeps_alignment(tok):
    ex = load_examples("wiki", tok, n=6, seq_len=16)
    sub = ex.subset([4, 1])
    assert sub.ids == [ex.ids[4], ex.ids[1]] and torch.equal(sub.tokens, ex.tokens[[4, 1]])


def test_wiki_examples_with_real_tokenizer_count(smol):
    """Eligible-document counts match the environment facts (2,722 summaries of >= 128 tokens)."""
    ex = interp.load_examples("wiki", smol.tokenizer, n=None, seq_len=129, split="all")
    assert 2600 <= len(ex) <= 2800


test_wiki_examples_with_real_tokenizer_count = pytest.mark.integration(test_wiki_examples_with_real_tokenizer_count)


# --- packed rows -------------------------------------------------------------------------------


def test_packed_rows_rebuild_from_their_documents(tok):
    """Each packed row is BOS, then its documents' tokens each followed by the separator, cut at T; rebuilt here
    from the row's own document ids, independently of the packer's loop."""
    from interp.data import load_packed_examples, read_documents, separator_token_id

    ex = load_packed_examples("wiki", tok, n=12, seq_len=200, seed=3)
    texts = {d.id: d.text for d in read_documents("wiki")}
    sep = separator_token_id(tok)
    used: list[str] = []
    for row, row_id in zip(ex.tokens.tolist(), ex.ids, strict=True):
        members = row_id.split("+")
        stream = [tok.bos_token_id]
        for doc in members:
            stream += tok(texts[doc], add_special_tokens=False)["input_ids"] + [sep]
        assert row == stream[:200]
        # whole documents until the row is full: without its last member the row would not be full
        assert len(stream) - len(tok(texts[members[-1]], add_special_tokens=False)["input_ids"]) - 1 < 200
        used += members
    assert len(used) == len(set(used))  # no document in two rows
    assert all(split_of(d) == "eval" for d in used)


def test_packed_rows_are_seeded(tok):
    from interp.data import load_packed_examples

    a = load_packed_examples("wiki", tok, n=6, seq_len=4096, seed=5)
    b = load_packed_examples("wiki", tok, n=6, seq_len=4096, seed=5)
    assert a.ids == b.ids and torch.equal(a.tokens, b.tokens)
    assert load_packed_examples("wiki", tok, n=6, seq_len=4096, seed=6).ids != a.ids
    # a document shorter than T joins the next one, so rows reach lengths no single document has
    assert any("+" in i for i in a.ids)


def test_packed_rows_refuse_more_than_the_documents_fill(tok, tmp_path):
    from interp.data import load_packed_examples

    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(f"Document {i} says little." for i in range(10)))
    with pytest.raises(DataError, match=r"fill only \d+"):
        load_packed_examples(path, tok, n=50, seq_len=64, split="all")
    with pytest.raises(DataError, match="n must be a positive"):
        load_packed_examples(path, tok, n=0, seq_len=64, split="all")
