"""Triton helpers that write the two ends of a slot list (the sinks and the recent tail), shared by the slot-list
kernels of SentenceKV and DynSplit-KV."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_sinks(OUT, n_sink, SPAN: tl.constexpr):
    """Slots 0..n_sink-1 at the front of a slot list."""
    span = tl.arange(0, SPAN)
    for start in range(0, n_sink, SPAN):
        tl.store(OUT + start + span, (start + span).to(tl.int64), mask=start + span < n_sink)


@triton.jit
def finish_slots(OUT, LENGTH, written, n, tail, width, SPAN: tl.constexpr):
    """After `written` slots: the last `tail` slots [n - tail, n), the list's length, zeros up to `width`."""
    span = tl.arange(0, SPAN)
    for start in range(0, tail, SPAN):
        at = start + span
        tl.store(OUT + written + at, (n - tail + at).to(tl.int64), mask=at < tail)
    written += tail
    tl.store(LENGTH, written.to(tl.int64))
    for start in range(0, width, SPAN):
        at = start + span
        tl.store(OUT + at, tl.zeros_like(at).to(tl.int64), mask=(at >= written) & (at < width))
