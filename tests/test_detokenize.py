"""Incremental detokenization on the default model's byte-level BPE tokenizer."""

from __future__ import annotations

import pytest

from launch.detokenize import IncrementalDetokenizer

TEXT = "Héllo wörld! 日本語のテキスト 🎉🎉 done.\nNext line"


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model)


@pytest.fixture(scope="module")
def default_model():
    from launch.prepare_model import prepare_default_model

    return prepare_default_model(quiet=True)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(t) for t in ids] + [detok.flush()]


def test_streamed_pieces_add_up_to_the_text_and_never_split_a_character(tokenizer):
    ids = tokenizer.encode(TEXT)
    pieces = stream(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    # Some tokens carry only part of a character: they produce no text until it is whole.
    assert "" in pieces[:-1]


def test_prompt_context_does_not_leak_into_the_answer(tokenizer):
    prompt = tokenizer.encode("Question: what is it?")
    answer = tokenizer.encode(" It is fine.")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    assert "".join(stream(detok, answer)) == " It is fine."


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (["🎉"], "Héllo wörld! 日本語のテキスト "),
        (["line"], "Héllo wörld! 日本語のテキスト 🎉🎉 done.\nNext "),
        (["wörld!", "xyz"], "Héllo "),
        (["not there"], TEXT),
    ],
)
def test_stop_strings_cut_before_the_match_and_never_show_part_of_it(tokenizer, stop, expected):
    detok = IncrementalDetokenizer(tokenizer, stop=stop)
    pieces = stream(detok, tokenizer.encode(TEXT))
    assert "".join(pieces) == expected
    assert detok.stopped == (expected != TEXT)
    for s in stop:  # no piece, nor the text so far, ever held the start of a stop string
        shown = ""
        for piece in pieces:
            shown += piece
            assert s not in shown


def test_with_min_tokens_a_stop_string_counts_only_if_it_ends_in_a_later_token(tokenizer):
    ids = tokenizer.encode("ab ab ab ab")
    texts = [tokenizer.decode(ids[: n + 1]) for n in range(len(ids))]
    first = next(n for n, t in enumerate(texts) if "ab" in t) + 1  # tokens to the first "ab"
    # A stop string whole within the first min_tokens tokens' text does not stop the answer,
    # the next one does: the text is cut before the first "ab" that ends later.
    detok = IncrementalDetokenizer(tokenizer, stop=["ab"], min_tokens=first)
    shown = "".join(stream(detok, ids))
    assert detok.stopped and shown == texts[first - 1] + " "
    plain = IncrementalDetokenizer(tokenizer, stop=["ab"])
    assert "".join(stream(plain, ids)) == "" and plain.stopped
