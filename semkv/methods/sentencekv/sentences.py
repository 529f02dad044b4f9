"""Sentence buckets from token ids, for SentenceKV: where sentences end, over-long sentences split, equal chunks.

A token ends a sentence when its text (with any closing quotes or brackets that follow it, and the whitespace after
them) ends with `.`, `!`, `?` or `…` (so also `...`) and a space or newline separates it from the next token (so
"3.14" and "file.txt" do not end sentences; "e.g. the" still does), or with a CJK `。！？` (no space needed); a run
of whitespace holding a blank line ends one too, and so does the token before a special token (`<|im_end|>`) and
the last token of the text. Which token ids are terminal, whitespace, closers... is found once per tokenizer by
scanning its vocabulary (`semkv.methods.sentencekv.vocab`), so the rule is a few vectorised lookups per prompt.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import torch

from semkv.methods.sentencekv.vocab import lookup, vocab_mask

CLOSERS = "\"'”’»)\\]}*"
_TERMINAL = re.compile(r"[.!?…][" + CLOSERS + r"]*\s*$")
_CJK_TERMINAL = re.compile(r"[。！？][」』" + CLOSERS + r"]*\s*$")
_CLOSERS_ONLY = re.compile(r"[" + CLOSERS + r"]+\s*")


def is_terminal(text: str) -> bool:
    return bool(_TERMINAL.search(text))


def is_cjk_terminal(text: str) -> bool:
    return bool(_CJK_TERMINAL.search(text))


def is_whitespace(text: str) -> bool:
    return text != "" and text.isspace()


def is_closers(text: str) -> bool:
    return bool(_CLOSERS_ONLY.fullmatch(text))


def starts_with_space(text: str) -> bool:
    return text[:1].isspace()


def ends_with_space(text: str) -> bool:
    return text[-1:].isspace()


def ends_with_newline(text: str) -> bool:
    return "\n" in text[len(text.rstrip()):]


def ends_with_blank_line(text: str) -> bool:
    return text[len(text.rstrip()):].count("\n") >= 2


PREDICATES = (is_terminal, is_cjk_terminal, is_whitespace, is_closers, starts_with_space, ends_with_space,
              ends_with_newline, ends_with_blank_line)


# bits of `SentenceRule.flags`: one per predicate of a token's text, and special tokens
(WHITESPACE, CLOSER, ENDS_SPACE, STARTS_SPACE, TERMINAL, CJK_TERMINAL, NEWLINE, BLANK_LINE,
 SPECIAL) = (1 << b for b in range(9))
_FLAG_MASKS = (("is_whitespace", WHITESPACE), ("is_closers", CLOSER), ("ends_with_space", ENDS_SPACE),
               ("starts_with_space", STARTS_SPACE), ("is_terminal", TERMINAL), ("is_cjk_terminal", CJK_TERMINAL),
               ("ends_with_newline", NEWLINE), ("ends_with_blank_line", BLANK_LINE))


@dataclass(frozen=True)
class SentenceRule:
    """Bool masks over one tokenizer's vocabulary, one per predicate, plus its special tokens; `flags` holds the
    same per token id as bits, for the token-by-token `SentenceScan`."""

    masks: dict[str, torch.Tensor]
    special: torch.Tensor
    flags: tuple[int, ...]

    @classmethod
    @functools.lru_cache(maxsize=4)  # one rule per tokenizer, made once (a scan of the vocabulary)
    def for_tokenizer(cls, tokenizer) -> "SentenceRule":
        masks = {p.__name__: vocab_mask(tokenizer, p) for p in PREDICATES}
        special = torch.zeros_like(masks["is_terminal"])
        special[[i for i in tokenizer.all_special_ids if i < special.shape[0]]] = True
        flags = sum(masks[name].long() * bit for name, bit in _FLAG_MASKS) + special.long() * SPECIAL
        return cls(masks, special, tuple(flags.tolist()))

    def scan(self) -> "SentenceScan":
        """The rule over a text that grows a token at a time (a bucket of generated text), from its first token."""
        return SentenceScan(self.flags)

    def ends(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] -> bool [n]: token i ends a sentence (the last token always does)."""
        ids = ids.cpu()
        f = {name: lookup(mask, ids) for name, mask in self.masks.items()}
        special = lookup(self.special, ids)
        n = ids.shape[0]
        idx = torch.arange(n)
        # whitespace, and closers right after a word, continue the sentence their last content token ended (or not)
        after_space = torch.cat([torch.tensor([True]), f["ends_with_space"][:-1]])
        cont = f["is_whitespace"] | (f["is_closers"] & ~after_space)
        content = torch.where(cont, -1, idx).cummax(0).values  # [n] last content token at or before i
        has = content >= 0
        at = content.clamp(min=0)
        terminal = f["is_terminal"][at] & has
        cjk = f["is_cjk_terminal"][at] & has
        newlines = f["ends_with_newline"].long() + f["ends_with_blank_line"].long()  # trailing newlines, capped at 2
        run = newlines.cumsum(0)
        run = run - torch.where(has, run[at] - newlines[at], 0)  # newlines since the last content token's end
        shifted = lambda x, last: torch.cat([x[1:], torch.tensor([last])])  # noqa: E731  value of token i + 1
        separated = f["ends_with_space"] | shifted(f["starts_with_space"], True)
        ends = ~shifted(cont, False) & ((terminal & separated) | cjk | (run >= 2))
        ends |= shifted(special, True)
        if n:
            ends[-1] = True
        return ends


class SentenceScan:
    """`SentenceRule.ends` over a window that grows a token at a time, in constant time a token: `push(t)` says
    whether the token before t ends a sentence, `ends(window + [t])[-2]`, where the window holds the tokens pushed
    since the scan began. It keeps what `ends` looks back to: the last content token (not whitespace, not a closer
    right after a word) and the newlines since it."""

    __slots__ = ("flags", "length", "last", "content", "newlines")

    def __init__(self, flags: tuple[int, ...]):
        self.flags = flags
        self.length = 0  # tokens pushed
        self.last = 0  # flags of the last token pushed
        self.content = None  # flags of the last content token, None before the first
        self.newlines = 0  # trailing newlines (a blank line counts two) from the last content token on

    def push(self, token: int) -> bool:
        f = self.flags[token] if token < len(self.flags) else 0  # ids past the vocabulary match nothing
        last, content = self.last, self.content
        # whitespace, and closers right after a word, continue the sentence their last content token ended (or not);
        # the first token of the window counts as after a space
        cont = bool(f & WHITESPACE) or (bool(f & CLOSER) and self.length > 0 and not last & ENDS_SPACE)
        ended = self.length > 0 and (bool(f & SPECIAL) or not cont and (
            content is not None and (content & TERMINAL and (last & ENDS_SPACE or f & STARTS_SPACE)
                                     or content & CJK_TERMINAL) or self.newlines >= 2))
        newlines = bool(f & NEWLINE) + bool(f & BLANK_LINE)
        if cont:
            self.newlines += newlines
        else:
            self.content, self.newlines = f, newlines
        self.last = f
        self.length += 1
        return bool(ended)


def length_limit(starts: torch.Tensor, n: int, split_std: float, max_sentence: int) -> int:
    """Longest allowed bucket: mean + split_std * std of the sentence lengths (paper A.7), at most max_sentence."""
    lengths = torch.diff(starts, append=torch.tensor([n])).float()
    spread = lengths.std(unbiased=False) if lengths.numel() > 1 else torch.tensor(0.0)
    return max(1, min(max_sentence, math.floor(float(lengths.mean() + split_std * spread))))


def split_long(starts: torch.Tensor, n: int, limit: int) -> torch.Tensor:
    """Split every bucket longer than `limit` into the fewest near-equal pieces of at most `limit` tokens."""
    lengths = torch.diff(starts, append=torch.tensor([n]))
    pieces = -(-lengths // limit)  # [buckets]
    first = starts.repeat_interleave(pieces)
    length = lengths.repeat_interleave(pieces)
    count = pieces.repeat_interleave(pieces)
    k = torch.arange(first.shape[0]) - (pieces.cumsum(0) - pieces).repeat_interleave(pieces)
    return first + k * length // count


def segment(ids: list[int], rule: SentenceRule, split_std: float, max_sentence: int,
            chunks: bool = False) -> tuple[list[int], int]:
    """Bucket start positions of a token sequence, and the longest bucket allowed (for text generated later).

    Sentences longer than mean + split_std * std tokens (and max_sentence) are split, so text without punctuation
    becomes pieces of at most max_sentence tokens. chunks=True: as many equal chunks as there are sentences (the
    paper's ablation, section 6.1); the limit is then the chunk size.
    """
    n = len(ids)
    ends = rule.ends(torch.tensor(ids, dtype=torch.long))
    starts = torch.cat([torch.zeros(1, dtype=torch.long), ends[:-1].nonzero().flatten() + 1])
    limit = length_limit(starts, n, split_std, max_sentence)
    starts = split_long(starts, n, limit)
    if chunks:
        limit = max(1, round(n / starts.shape[0]))
        starts = torch.arange(0, n, limit)
    return starts.tolist(), limit
