"""Circuits one dot away (interp.dla, interp.eap, interp.path_patch, interp.circuit): prompts and answers as
plain strings give the numbers of the deep functions on token rows and ids, and bad inputs are refused
in interp's words before any forward.

Exactness: the flat functions tokenize and then call the deep ones, so on the same rows and ids they run
the same operations in the same order: their results are compared with ``torch.equal``. The known case
is direct logit attribution on a float64 tiny llama against the plain Hugging Face forward.
"""

from __future__ import annotations

import importlib

import pandas as pd
import pytest
import torch
from test_circuits import float64_norms  # noqa: F401  (a fixture: RMSNorms that stay in float64)

import interp
from interp.errors import ComponentError, DataError, InterpError
from interp.figures.localize import answer_label, circuit_figures, patching_positions, token_labels
from interp.localize.circuit import one_token, receiver, sender
from interp.localize.dla import logit_attribution
from interp.localize.eap import edge_attribution
from interp.localize.patching import LogitDiffMetric
from interp.localize.paths import Sender, path_patch

pytestmark = pytest.mark.usefixtures("one_thread")

CLEAN = ["When Mary and John went, John gave it to", "Then Tom and Ann ate, Ann passed it to"]
CORRUPT = ["When Mary and John went, Anna gave it to", "Then Tom and Ann ate, Bob passed it to"]
ANSWERS, WRONGS = ["M", "T"], ["J", "A"]


def ids(model, texts):
    return torch.tensor([model.tokenizer.encode(t, add_special_tokens=False)[0] for t in texts])


@pytest.mark.parametrize("name", ["dla", "eap", "path_patch", "circuit"])
def test_flat_name_is_the_function_at_its_deep_path(name):
    assert getattr(interp, name) is getattr(importlib.import_module("interp.localize.circuit"), name)
    assert name in interp.__all__


def test_dla_from_strings_is_logit_attribution_and_adds_up_to_the_hf_logit_difference(model64, float64_norms):  # noqa: F811
    flat = interp.dla(model64, CLEAN, ANSWERS, WRONGS)
    rows = interp.examples_from_texts(CLEAN, model64.tokenizer)
    deep = logit_attribution(model64, rows, ids(model64, ANSWERS), versus=ids(model64, WRONGS))
    for part in ("heads", "attn_bias", "mlp", "embed", "final_bias", "logit"):
        assert torch.equal(getattr(flat, part), getattr(deep, part)), part
    assert flat.settings["answer_text"] == ANSWERS and flat.settings["wrong_text"] == WRONGS
    # the known case: each prompt alone through the plain Hugging Face model, its last token's logit difference.
    # Both sides are float64 forwards of the same weights (float64 attention and norms), so they differ only in
    # how float64 sums associate: ~1e-15 relative on O(1) logits; 1e-10 is far above that.
    for i, text in enumerate(CLEAN):
        tokens = interp.examples_from_texts([text], model64.tokenizer).tokens
        with torch.no_grad():
            logits = model64.original_model(input_ids=tokens).logits[0, -1]
        a, w = ids(model64, [ANSWERS[i], WRONGS[i]])
        assert abs(float(logits[a] - logits[w]) - float(flat.logit[i])) < 1e-10
        assert abs(float(flat.total()[i]) - float(logits[a] - logits[w])) < 1e-10
    assert flat.logit.abs().min() > 1e-6  # not vacuous: the logit differences are far from 0


def test_string_answers_are_their_token_ids(model64):
    by_text = interp.dla(model64, CLEAN[0], "M", "J")
    by_id = interp.dla(model64, CLEAN[0], int(ids(model64, ["M"])[0]), ids(model64, ["J"]))
    assert torch.equal(by_text.heads, by_id.heads) and torch.equal(by_text.logit, by_id.logit)
    one_for_all = interp.eap(model64, CLEAN, CORRUPT, "M", "J", senders=["head 0.1", "mlp 0"])
    per_prompt = interp.eap(model64, CLEAN, CORRUPT, ["M", "M"], ids(model64, ["J", "J"]),
                            senders=[Sender("head", 0, 1), Sender("mlp", 0)])
    assert torch.equal(one_for_all.scores, per_prompt.scores)


def test_eap_and_path_patch_from_strings_are_the_deep_functions(model64):
    rows = interp.examples_from_texts(CLEAN, model64.tokenizer)
    source = interp.examples_from_texts(CORRUPT, model64.tokenizer)
    metric = LogitDiffMetric(ids(model64, ANSWERS), ids(model64, WRONGS))
    senders = [Sender("head", 0, h) for h in range(4)] + [Sender("head", 1, h) for h in range(4)]
    senders += [Sender("mlp", 0), Sender("mlp", 1)]
    flat = interp.eap(model64, CLEAN, CORRUPT, ANSWERS, WRONGS, receivers=["q 1.2", "k 1.0"])
    deep = edge_attribution(model64, rows, senders, [(1, 2, "q"), (1, 0, "k")], source_examples=source,
                            metric=metric)
    assert flat.senders == senders and torch.equal(flat.scores, deep.scores)
    assert flat.scores.abs().max() > 0
    flat_pp = interp.path_patch(model64, CLEAN, CORRUPT, ANSWERS, WRONGS, ["head 0.1", "mlp 0"], "v 1.1")
    deep_pp = path_patch(model64, rows, [Sender("head", 0, 1), Sender("mlp", 0)], [(1, 1, "v")],
                         source_examples=source, metric=metric)
    assert torch.equal(flat_pp.values, deep_pp.values) and torch.equal(flat_pp.target, deep_pp.target)
    assert flat_pp.settings["answer_text"] == ANSWERS


def test_circuit_runs_the_three_tools_on_their_own_numbers(model64):
    res = interp.circuit(model64, CLEAN, CORRUPT, ANSWERS, WRONGS, top_k=4, movers=1)
    dla = interp.dla(model64, CLEAN, ANSWERS, WRONGS)
    assert torch.equal(res.dla.heads, dla.heads)
    best = int(dla.head_means().flatten().argmax())
    assert res.movers == [f"head {best // 4}.{best % 4}"]
    assert len(res.confirmed) == 4 and res.confirmed["rank"].tolist() == [1, 2, 3, 4]
    assert (res.edges["score"].abs().diff().dropna() <= 0).all()  # largest |score| first
    direct = interp.eap(model64, CLEAN, CORRUPT, ANSWERS, WRONGS).table().set_index("edge")["score"]
    for row in res.edges[res.edges["receiver"] == "logits"].itertuples():
        assert row.score == direct[row.edge]
    for row in res.confirmed.itertuples():
        target = "logits" if row.receiver == "logits" else row.receiver
        exact = interp.path_patch(model64, CLEAN, CORRUPT, ANSWERS, WRONGS, [row.sender], target).effect()
        assert row.path_patching == float(exact[0])
    weights = res.attention["weight"].to_numpy()
    assert len(weights) == len(res.tokens) and abs(weights.sum() - 1) < 1e-12  # a softmax row (float64)
    assert res.tokens == [model64.tokenizer.decode([t]) for t in interp.examples_from_texts(
        CLEAN[:1], model64.tokenizer).tokens[0].tolist()]
    assert set(res.tables()) == {"dla_heads", "dla_layers", "edges", "confirmed", "attention"}


# ---------------------------------------------------------------------------------------
# Refused inputs


class Splitter:
    """A stand-in tokenizer: each word of letters one token, with its leading space; anything else one per byte."""

    vocab = {" Paris": 0, "Paris": 1, " Rome": 2}

    def encode(self, text, add_special_tokens=False):
        if text in self.vocab:
            return [self.vocab[text]]
        return [10 + b for b in text.encode()]

    def decode(self, token_ids):
        back = {v: k for k, v in self.vocab.items()}
        return "".join(back.get(i, chr(i - 10)) for i in token_ids)


def test_a_multi_token_answer_says_how_it_tokenizes_and_what_to_pass():
    assert one_token(Splitter(), " Paris") == 0
    with pytest.raises(DataError, match=r"answer 'Paris!' is 6 tokens .*\('P', 'a', 'r', 'i', 's', '!'\).*token id"):
        one_token(Splitter(), "Paris!")
    with pytest.raises(DataError, match=r"With its leading space, ' Rome' is one token"):
        one_token(Splitter(), "Rome")
    with pytest.raises(DataError, match="empty string"):
        one_token(Splitter(), "")


def test_bad_prompts_and_answers_are_refused_in_interps_words(model64):
    with pytest.raises(DataError, match=r"' ', 'P', 'a'.*one token"):
        interp.dla(model64, CLEAN, " Paris")
    with pytest.raises(DataError, match=r"prompts\[1\] is empty"):
        interp.dla(model64, ["a prompt", "  "], "M")
    with pytest.raises(DataError, match="prompts is empty"):
        interp.dla(model64, [], "M")
    with pytest.raises(DataError, match="3 answers for 2 prompt"):
        interp.dla(model64, CLEAN, ["M", "J", "T"])
    with pytest.raises(DataError, match="2 clean and 1 corrupt prompts"):
        interp.eap(model64, CLEAN, CORRUPT[:1], "M", "J")
    with pytest.raises(DataError, match="clean prompt 0 is 18 tokens but its corrupted prompt 19"):
        interp.path_patch(model64, "When Mary went to", "When Maryx went to", "M", "J", "mlp 0")
    # the argument checker refuses a bool by the annotation, before the circuit code reads it
    with pytest.raises(InterpError, match=r"answer must be a string or an integer .*got True \(bool\)"):
        interp.dla(model64, CLEAN, True)
    with pytest.raises(DataError, match="vocabulary has ids"):
        interp.dla(model64, CLEAN, 10**6)
    with pytest.raises(DataError, match="integer token ids"):
        interp.dla(model64, CLEAN, torch.tensor([1.0, 2.0]))
    with pytest.raises(ComponentError, match="'head LAYER.HEAD'"):
        interp.path_patch(model64, CLEAN, CORRUPT, "M", "J", ["head nine"])
    with pytest.raises(ComponentError, match="'q LAYER.HEAD'"):
        interp.eap(model64, CLEAN, CORRUPT, "M", "J", receivers=["x 1.0"])
    with pytest.raises(InterpError, match="top_k must be at least 1"):
        interp.circuit(model64, CLEAN, CORRUPT, "M", "J", top_k=0)


def test_sender_and_receiver_names_read_back_what_eap_tables_write():
    assert sender(Sender("head", 3, 2).label) == Sender("head", 3, 2) and sender("mlp 7") == Sender("mlp", 7)
    assert receiver("k 9.0") == (9, 0, "k") and receiver((1, 2, "q")) == (1, 2, "q")


# ---------------------------------------------------------------------------------------
# Token-labelled figures


def test_positions_are_labelled_by_their_tokens_and_repeats_stay_apart():
    assert token_labels(["<s>", " John", " and", " John", "\n"]) == ["<s>", "John·1", "and", "John·3", "↵"]
    assert len(set(token_labels(["a", "a", " a", "a "]))) == 4


def test_circuit_figures_name_answers_and_tokens(model64):
    res = interp.circuit(model64, CLEAN[0], CORRUPT[0], "M", "J", top_k=2, movers=2)
    figures = circuit_figures(res)
    assert set(figures) == {"dla_heads", "edges", "confirmed", "attention"}
    assert "logit('M') − logit('J')" in figures["dla_heads"].layout.title.text
    assert "logit('M') − logit('J')" in figures["confirmed"].layout.yaxis.title.text
    attention = figures["attention"].data[0]
    assert list(attention.x) == token_labels(res.tokens) and list(attention.y) == res.movers
    assert answer_label({"answer_text": ["M", "T"], "wrong_text": ["J", "J"]}) == "logit(answer) − logit('J')"


def test_patching_heatmap_labels_positions_by_token(model64):
    from interp.localize import patching

    rows = interp.examples_from_texts(["abca"], model64.tokenizer)
    source = interp.examples_from_texts(["abda"], model64.tokenizer)
    jobs = [patching.Patch("resid_pre", (layer,), positions=(p,)) for layer in range(2) for p in range(5)]
    res = patching.patch(model64, model64, rows, jobs, source_examples=source, progress=False)
    tokens = [model64.tokenizer.decode([t]) for t in rows.tokens[0].tolist()]
    fig = patching_positions(res, tokens)
    assert list(fig.data[0].x) == token_labels(tokens) and "a·1" in fig.data[0].x and "a·4" in fig.data[0].x
    assert isinstance(res.table(), pd.DataFrame)
