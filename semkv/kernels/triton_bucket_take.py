"""What a capacity takes of ranked buckets, in one kernel (`reference.bucket_take`; SentenceKV's sentences,
DynSplit-KV's chunks): instead of sorting every bucket of a row by score, it finds the score at which the capacity
ends (a search over the 32 bits of the scores' order-preserving integer keys, two bits a step, each step one
reduction of the counts of the buckets at or above three candidates) and gives the exact rank prefix only to the buckets tied at that score; the
buckets above it are taken whole, those below not at all. One program per row and KV head holds the row's scores and
counts in registers. Replaces a sort, two cumulative sums, a gather and a scatter (about 55 us a layer at 16 rows and
1,400 sentences on an H200, results page 2026-11-28-h200x2-servers)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bucket_take(SCORES, COUNT, CAPACITY, BEFORE, FIRST, n, heads, count_b, count_h, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * heads + h
    b, h = row // heads, row % heads
    i = tl.arange(0, BLOCK)
    inside = i < n
    score = tl.load(SCORES + row * n + i, mask=inside, other=0.0) + 0.0  # -0.0 + 0.0 is +0.0: ties as in a sort
    count = tl.load(COUNT + b * count_b + h * count_h + i, mask=inside, other=0).to(tl.int64)
    bits = score.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(bits >= 0, bits + tl.full([], 2**31, tl.int64), -1 - bits)  # order-preserving, in [0, 2^32)
    cap = tl.load(CAPACITY + b).to(tl.int64)
    # the largest key at or above which the buckets hold >= cap tokens (0 when they all hold fewer: all taken), two
    # bits a step: one reduction gives the tokens held at or above the threshold with each value of the next two bits
    # appended, and the last value whose buckets still hold >= cap (the sums never grow with it) is kept
    threshold = tl.full([], 0, tl.int64)
    digit = tl.arange(0, 4).to(tl.int64)
    for step in tl.static_range(16):  # unrolled: each shift a constant
        candidate = threshold | (digit << (30 - 2 * step))  # [4]
        held = tl.sum(tl.where(key[None, :] >= candidate[:, None], count[None, :], 0), 1)  # [4]
        kept = tl.sum(((held >= cap) & (digit > 0)).to(tl.int64), 0)
        threshold = threshold | (kept << (30 - 2 * step))
    above = tl.sum(tl.where(key > threshold, count, 0), 0)
    tied = tl.where(key == threshold, count, 0)
    prefix = above + tl.cumsum(tied, 0) - tied  # the exact rank prefix of a tied bucket (ties by bucket id)
    before = tl.where(key > threshold, 0, cap)
    before = tl.where((key == threshold) & (prefix < cap), tl.where(prefix + count <= cap, 0, prefix), before)
    before = tl.where(count == 0, cap, before)
    tl.store(BEFORE + row * n + i, before.to(tl.int32), mask=inside)
    tl.store(FIRST + row * n + i, (tl.cumsum(count, 0) - count).to(tl.int32), mask=inside)


def bucket_take(scores: torch.Tensor, count: torch.Tensor,
                capacity: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments and result as `reference.bucket_take` (count may be expanded: strides of 0 are read as such)."""
    batch, heads, n = scores.shape
    before = torch.empty(batch, heads, n, dtype=torch.int32, device=scores.device)
    first = torch.empty_like(before)
    if count.stride(-1) != 1:
        count = count.contiguous()
    _bucket_take[(batch * heads,)](scores.float().contiguous(), count, capacity.contiguous(), before, first, n,
                                   heads, count.stride(0), count.stride(1),
                                   BLOCK=max(16, triton.next_power_of_2(n)), num_warps=8)
    return before, first
