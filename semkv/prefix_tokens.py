"""Tokenizing a text that starts like a recent one (a follow-up question on a long document) from near where the two
part, not from its start: a 32k-token prompt takes about 65 ms to tokenize on one CPU core, which a served follow-up
whose document is in the prefix cache would otherwise wait for before its first token.

Tokens never cross the boundaries of the tokenizer's pre-tokenization (words, spaces, punctuation) or its special
tokens, and those boundaries depend only on the few characters around them. So where two texts share their first L
characters, the shared text's tokens up to a token boundary some way before L are the new text's too, and the rest
is the tokenization of the new text from a boundary further back. That the boundary is one is checked, not assumed:
the new text is tokenized from a token start `MARGIN` characters before the reused part ends, and its tokens must
repeat the recent text's up to there; otherwise (and for texts that share less than `MIN_SHARED` characters with
every recent one) the text is tokenized whole. The result is the tokenizer's own (tests compare them on edited
texts, multi-byte characters and whitespace runs at the cut).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

MIN_SHARED = 4096  # characters a text must share with a recent one to reuse its tokens
MARGIN = 256  # characters re-tokenized before the reused part ends, to check the boundary
RECENT = 8  # texts kept (each about 10 bytes a character: its text, and two int32 offsets a token)


class PrefixTokens:
    """`tokenizer(text)` ids (with its special tokens when `special`), reusing the tokens of the most alike of the
    last `RECENT` texts of at least `MIN_SHARED` characters. Thread-safe (the server tokenizes in worker threads)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._recent: OrderedDict[tuple[str, bool], tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()
        self.reused = 0  # texts tokenized from a recent one's tokens (statistics for tests and benchmarks)
        self.offsets = True  # False once the tokenizer refused to give character offsets

    def __call__(self, text: str, special: bool) -> tuple[list[int], np.ndarray | None]:
        """Token ids of `text` and the end offset of each token's characters ([ids] int32; None from a tokenizer
        that gives no offsets, which is then only called)."""
        if not self.offsets:
            return self.tokenizer(text, add_special_tokens=special)["input_ids"], None
        try:
            ids, starts, ends = self._tokens(text, special)
        except NotImplementedError:  # a tokenizer without offsets (a slow one): tokenize whole, as before
            self.offsets = False
            return self(text, special)
        if len(text) >= MIN_SHARED:
            with self._lock:
                self._recent[(text, special)] = ids, starts, ends
                self._recent.move_to_end((text, special))
                while len(self._recent) > RECENT:
                    self._recent.popitem(last=False)
        return ids.tolist(), ends

    def _tokens(self, text: str, special: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if len(text) < MIN_SHARED:
            return self._tokenize(text, special)
        with self._lock:
            recent = list(self._recent.items())
        best, shared = None, MIN_SHARED - 1
        head = text[:MIN_SHARED]
        for (old, old_special), value in recent:
            if old_special == special and old.startswith(head):
                n = shared_length(old, text)
                if n > shared:
                    best, shared = value, n
        if best is not None:
            reused = self._reuse(text, special, *best, shared)
            if reused is not None:
                self.reused += 1
                return reused
        return self._tokenize(text, special)

    def _tokenize(self, text: str, special: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        enc = self.tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int32).reshape(-1, 2)
        return np.asarray(enc["input_ids"], dtype=np.int32), offsets[:, 0], offsets[:, 1]

    def _reuse(self, text: str, special: bool, ids: np.ndarray, starts: np.ndarray, ends: np.ndarray,
               shared: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The recent text's tokens up to a token start `MARGIN` characters before `shared`, then `text` tokenized
        from a token start `MARGIN` before that, whose tokens must repeat the recent ones in between; None when no
        such starts exist or the tokens differ."""
        keep = boundary(starts, ends, shared - MARGIN)  # token index: the recent tokens [0, keep) are kept
        restart = boundary(starts, ends, int(starts[keep]) - MARGIN) if keep else 0
        if not restart or restart >= keep:
            return None
        origin = int(starts[restart])
        tail_ids, tail_starts, tail_ends = self._tokenize(text[origin:], False)
        repeat = keep - restart
        if (len(tail_ids) <= repeat or not np.array_equal(tail_ids[:repeat], ids[restart:keep])
                or int(tail_starts[repeat]) + origin != int(starts[keep])):
            return None
        return (np.concatenate([ids[:restart], tail_ids]), np.concatenate([starts[:restart], tail_starts + origin]),
                np.concatenate([ends[:restart], tail_ends + origin]))


def boundary(starts: np.ndarray, ends: np.ndarray, at: int) -> int:
    """The last token index j with starts[j] <= at where every earlier token ends by starts[j] (not inside a
    character that several byte tokens share), or 0."""
    j = int(np.searchsorted(starts, at, side="right")) - 1
    while j > 0 and (ends[j - 1] > starts[j] or starts[j] == starts[j - 1]):
        j -= 1
    return max(j, 0)


def shared_length(a: str, b: str) -> int:
    """Length of the common start of two strings (slice comparisons, halving: memcmp speed)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
