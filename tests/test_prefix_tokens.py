"""Tokenizing a text from a recent one's tokens (`semkv.prefix_tokens`): always the tokenizer's own result."""
from __future__ import annotations

import random

import numpy as np
import pytest

from semkv.errors import SemkvError
from semkv.prefix_tokens import MIN_SHARED, PrefixTokens
from semkv.text import TextModel


@pytest.fixture(scope="module")
def text_model(embedded_folder):
    return TextModel.load(embedded_folder)


def plain(tokenizer, text, special):
    return tokenizer(text, add_special_tokens=special)["input_ids"]


# what may sit where two texts part: whitespace runs, newlines, multi-byte and combining characters, digits, an
# apostrophe that the pre-tokenizer joins to the next letters, a word cut in two
EDITS = ["   ", "\n\n  \n", "héllo 😀 世界 e\u0301", " 12345 67", "'s", "x", "", "\t", "  ­-- «»"]


@pytest.mark.parametrize("special", [False, True])
def test_edited_texts_tokenize_as_the_tokenizer_does(text_model, essay_text, special):
    """Texts that share a long start with a recent one, parted at random places by random edits (also inside a word
    and beside multi-byte characters), get the tokenizer's ids; most reuse the recent tokens."""
    tokenizer, rng = text_model.tokenizer, random.Random(0)
    cache = PrefixTokens(tokenizer)
    base = essay_text[:30_000] + "é 😀 x" * 3 + essay_text[30_000:40_000]
    assert cache(base, special)[0] == plain(tokenizer, base, special)
    for _ in range(40):
        cut = rng.randrange(MIN_SHARED + 600, len(base))
        text = base[:cut] + rng.choice(EDITS) + rng.choice(EDITS) + base[cut + rng.randrange(0, 40):][:2000]
        ids, ends = cache(text, special)
        assert ids == plain(tokenizer, text, special), cut
        offsets = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)["offset_mapping"]
        assert ends.tolist() == [e for _, e in offsets]
    assert cache.reused >= 30


def test_follow_up_questions_reuse_the_document_and_find_the_question(text_model, essay_text):
    """A conversation about one document, question after question in the chat template: the ids and the question's
    first token are what a fresh tokenization gives, from the first question's tokens after the first."""
    tokenizer = text_model.tokenizer
    document = essay_text[:20_000]
    questions = ["What does the author think of startups?", "Who founded the company?", "  and then?\n"]
    for question in questions:
        ids, start = text_model.encode(document, question)
        text = text_model.prompt_text(document, question)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        assert ids == enc["input_ids"]
        where = text.rfind(question)
        assert start == next(i for i, (_, end) in enumerate(enc["offset_mapping"]) if end > where)
        chat = text_model.encode_chat([{"role": "user", "content": f"{document}\n\n{question}"}])
        assert chat == enc["input_ids"]
    assert text_model._prefix_tokens.reused >= 2 * len(questions) - 1


def test_short_and_unrelated_texts_are_tokenized_whole(text_model, essay_text):
    tokenizer = text_model.tokenizer
    cache = PrefixTokens(tokenizer)
    short = essay_text[: MIN_SHARED - 1]
    for text in (short, short + "?", essay_text[:9000], essay_text[100:9100]):
        assert cache(text, False)[0] == plain(tokenizer, text, False)
    assert cache.reused == 0
    assert isinstance(cache(essay_text[:9000], False)[1], np.ndarray)


class NoOffsets:
    """The embedded tokenizer as a backend that gives no character offsets (a slow tokenizer) would."""

    def __init__(self, tokenizer):
        self.inner = tokenizer

    def __call__(self, text, return_offsets_mapping=False, **kwargs):
        if return_offsets_mapping:
            raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
        return self.inner(text, **kwargs)


def test_a_tokenizer_without_offsets_is_called_as_before(text_model, essay_text):
    """Prompts are tokenized whole, and a prompt with a question, which needs offsets, gets one clear error."""
    tokenizer = text_model.tokenizer
    cache = PrefixTokens(NoOffsets(tokenizer))
    for text in (essay_text[:9000], essay_text[:9000] + " more"):
        ids, ends = cache(text, True)
        assert ids == plain(tokenizer, text, True) and ends is None
    assert cache.reused == 0
    model = TextModel(NoOffsets(tokenizer), text_model.config)
    assert model.encode(essay_text[:500], chat=False)[0] == plain(tokenizer, essay_text[:500], True)
    with pytest.raises(SemkvError, match="offsets"):
        model.encode(essay_text[:500], "Why?", chat=False)
