"""Fitting a generated prompt to a length in the model's own tokens.

A generator is a function size -> Sample whose prompt grows with `size` (noise lines, words, documents, records);
`fit_sample` finds the largest size whose prompt (`prompt_text`, no chat template, no special tokens) is at most
`length` tokens, and checks that it is no more than `TOLERANCE` short. A linear estimate from two probes brackets the
size, then a binary search runs down to single units (RULER steps by 25 lines or 500 words, too coarse for 2%).
"""
from __future__ import annotations

from typing import Any, Callable

from semkv.errors import SemkvError
from semkv.eval.task import Sample, prompt_text

TOLERANCE = 0.02


def n_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def largest_fitting(count: Callable[[int], int], length: int, low: int, guess: int) -> int:
    """Largest size >= low with count(size) <= length, given count(low) <= length and count about linear in size."""
    probe = max(guess, low + 1)
    slope = max((count(probe) - count(low)) / (probe - low), 1e-6)
    estimate = low + int((length - count(low)) / slope)
    step = max(1, estimate // 100)
    lo, hi = max(low, estimate - step), estimate + step
    while count(lo) > length:  # widen down until lo fits (count(low) fits, so this ends)
        hi, lo, step = lo, max(low, lo - step), step * 2
    hi = max(hi, lo + 1)
    while count(hi) <= length:  # widen up until hi does not fit
        lo, hi, step = hi, hi + step, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) <= length:
            lo = mid
        else:
            hi = mid
    return lo


def fit_sample(tokenizer: Any, length: int, build: Callable[[int], Sample], guess: int = 16, low: int = 1) -> Sample:
    """The sample of the largest size whose prompt is at most `length` tokens (and at least 98% of it)."""
    built: dict[int, tuple[int, Sample]] = {}

    def count(size: int) -> int:
        if size not in built:
            sample = build(size)
            built[size] = (n_tokens(tokenizer, prompt_text(sample)), sample)
        return built[size][0]

    if count(low) > length:
        raise SemkvError(f"length={length} is too short for this task: its smallest prompt has {count(low)} tokens")
    tokens, sample = built[largest_fitting(count, length, low, guess)]
    if tokens < (1 - TOLERANCE) * length:
        raise SemkvError(f"could not fit the prompt to length={length}: the closest has {tokens} tokens")
    return sample
