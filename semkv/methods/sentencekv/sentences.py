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


def _ids(mask: torch.Tensor) -> frozenset[int]:
    return frozenset(mask.nonzero().flatten().tolist())


@dataclass(frozen=True)
class SentenceRule:
    """Bool masks over one tokenizer's vocabulary, one per predicate, plus its special tokens."""

    masks: dict[str, torch.Tensor]
    special: torch.Tensor
    terminal_ids: frozenset[int]  # terminal or CJK terminal
    newline_ids: frozenset[int]  # ends with a newline
    blank_ids: frozenset[int]  # ends with a blank line
    special_ids: frozenset[int]

    @classmethod
    @functools.lru_cache(maxsize=4)  # one rule per tokenizer, made once (a scan of the vocabulary)
    def for_tokenizer(cls, tokenizer) -> "SentenceRule":
        masks = {p.__name__: vocab_mask(tokenizer, p) for p in PREDICATES}
        special = torch.zeros_like(masks["is_terminal"])
        special[[i for i in tokenizer.all_special_ids if i < special.shape[0]]] = True
        return cls(masks, special, _ids(masks["is_terminal"] | masks["is_cjk_terminal"]),
                   _ids(masks["ends_with_newline"]), _ids(masks["ends_with_blank_line"]), _ids(special))

    def may_end_before_last(self, ids: list[int]) -> bool:
        """False when `ends(ids)[-2]` is surely False, from set lookups alone (for one decode step, where `ends` on a
        few tokens costs a hundred small tensor operations): a sentence ends only after a terminal or a CJK terminal,
        after two newlines, or right before a special token."""
        before = ids[:-1]
        return (ids[-1] in self.special_ids or not self.terminal_ids.isdisjoint(before)
                or not self.blank_ids.isdisjoint(before) or sum(i in self.newline_ids for i in before) >= 2)

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
