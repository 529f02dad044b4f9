"""Long-text perplexity, PG-19 style: a `length`-token prefix of a book is prefilled, then the next `continuation`
tokens are fed one decode step at a time with the method active (`LLM.compare(..., continuation=...)`), so the
method's selection decides every scored token. A sample's score is its perplexity; a set's is exp(total NLL / total
scored tokens), lower is better.
"""
from __future__ import annotations

import math
import random
from typing import Any

from semkv.errors import SemkvError
from semkv.eval.task import Sample


class PerplexityTask:
    """Perplexity over `books` (name -> plain text, headers stripped); each sample is a window at a seeded random
    offset of one book, books taken in a seeded order."""

    name = "perplexity"
    chat = False

    def __init__(self, books: dict[str, str], continuation: int = 64):
        if not books:
            raise SemkvError("perplexity needs at least one book")
        if isinstance(continuation, bool) or not isinstance(continuation, int) or continuation < 1:
            raise SemkvError(f"continuation={continuation!r} must be a positive number of tokens")
        self.books, self.continuation = books, continuation
        self.max_new_tokens = continuation
        self._ids: dict[str, list[int]] = {}

    def _tokens(self, tokenizer: Any, book: str) -> list[int]:
        if book not in self._ids:
            self._ids[book] = tokenizer(self.books[book], add_special_tokens=False)["input_ids"]
        return self._ids[book]

    def samples(self, tokenizer: Any, length: int, n: int, seed: int) -> list[Sample]:
        rng = random.Random(f"perplexity-{length}-{seed}")
        order = sorted(self.books)
        rng.shuffle(order)
        out = []
        for i in range(n):
            book = order[i % len(order)]
            ids = self._tokens(tokenizer, book)
            room = len(ids) - length - self.continuation
            if room < 0:
                raise SemkvError(f"book {book!r} has {len(ids)} tokens, fewer than the {length} + "
                                 f"{self.continuation} a perplexity sample needs; use shorter --lengths")
            start = rng.randint(0, room)
            prefix, continuation = ids[start : start + length], ids[start + length : start + length + self.continuation]
            out.append(Sample(self.name, f"{book}-{length}-{i}", tokenizer.decode(prefix), "",
                              [tokenizer.decode(continuation)], length,
                              meta={"book": book, "offset": start, "prefix_ids": prefix,
                                    "continuation_ids": continuation}))
        return out

    @staticmethod
    def score_logprobs(logprobs: list[float]) -> dict[str, float]:
        nll = -sum(logprobs)
        return {"score": math.exp(nll / len(logprobs)), "nll": nll, "tokens": len(logprobs)}
