"""Fitting a generated prompt to a length in the model's own tokens.

A generator is a function size -> Sample whose prompt grows with `size` (noise lines, words, documents, records);
`fit_sample` finds the largest size whose prompt (`prompt_text`: no chat template, no special tokens) is at most
`length` tokens, or, when that is more than `TOLERANCE` short (coarse units at short lengths), the smallest size
above it if that is within the tolerance. A linear estimate from two probes (or the previous sample's size) brackets
the size, then a binary search runs down to single units (RULER steps by 25 lines or 500 words, too coarse for 2%).
"""
from __future__ import annotations

from typing import Any, Callable

from semkv.errors import SemkvError
from semkv.eval.task import Sample, prompt_text

TOLERANCE = 0.02


def n_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def largest_fitting(count: Callable[[int], int], length: int, low: int, guess: int, start: int | None = None) -> int:
    """Largest size >= low with count(size) <= length, given count(low) <= length and count about linear in size;
    `start` (a size known to be close) replaces the linear estimate."""
    if start is None:
        probe = max(guess, low + 1)
        slope = max((count(probe) - count(low)) / (probe - low), 1e-6)
        start = low + int((length - count(low)) / slope)
        step = max(1, start // 100)
    else:
        step = 1
    lo, hi = max(low, start), max(low, start) + step
    while count(lo) > length:  # widen down until lo fits (count(low) fits, so this ends)
        hi, lo, step = lo, max(low, lo - step), step * 2
    while count(hi) <= length:  # widen up until hi does not fit
        lo, hi, step = hi, hi + step, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) <= length:
            lo = mid
        else:
            hi = mid
    return lo


def fit_sample(tokenizer: Any, length: int, build: Callable[[int], Sample], guess: int = 16, low: int = 1,
               start: int | None = None) -> tuple[Sample, int]:
    """The sample whose prompt is closest to `length` tokens within 2% (at most `length` when possible), and its
    size; `start` is a size to search from (the previous sample's)."""
    built: dict[int, tuple[int, Sample]] = {}

    def count(size: int) -> int:
        if size not in built:
            sample = build(size)
            built[size] = (n_tokens(tokenizer, prompt_text(sample)), sample)
        return built[size][0]

    if count(low) > length:
        raise SemkvError(f"length={length} is too short for this task: its smallest prompt has {count(low)} tokens")
    size = largest_fitting(count, length, low, guess, start)
    if count(size) < (1 - TOLERANCE) * length and count(size + 1) <= (1 + TOLERANCE) * length:
        size += 1
    tokens, sample = built[size]
    if abs(tokens - length) > TOLERANCE * length:
        raise SemkvError(f"could not fit the prompt to length={length} within 2%: the closest has {tokens} tokens")
    return sample, size
