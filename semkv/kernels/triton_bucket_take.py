"""What a capacity takes of ranked buckets, in one kernel (`reference.bucket_take`; SentenceKV's sentences,
DynSplit-KV's chunks): instead of sorting every bucket of a row by score, it finds the score at which the capacity
ends (a search over the 32 bits of the scores' order-preserving integer keys, a few bits a step, each step one
reduction of the tokens held at or above every candidate value of those bits) and gives the exact rank prefix only to
the buckets tied at that score; the buckets above it are taken whole, those below not at all. Where each bucket's
taken tokens go among all the taken ones (`place`) comes from the same scan as the tied buckets' prefix, so the
slot-list kernels place every token without a running count. Replaced a sort, two cumulative sums, a gather and a
scatter (about 55 us a layer at 16 rows and 1,400 sentences on an H200, results page 2026-11-28-h200x2-servers).

A row's buckets are too few to share among programs (one program per row and KV head: 32 at 16 rows), so the time
is one program's chain of block-wide reductions and its instructions. What Triton 3.9 compiles for sm_90a (ptxas -v
and the SASS at BLOCK=2048, 8 warps; instructions a warp / barriers): two bits a step in 64-bit integers, the design
measured at 30 us a layer (results page 2026-11-28-h200x4-vllm-same-call), 6,384 / 101, its candidates' sums moved
between layouts through shared memory; two bits a step in 32-bit integers with every candidate's sum kept in each
thread ([2^BITS, 1] shapes beside the [1, BLOCK] buckets; a warp sums a candidate with one REDUX), 3,296 / 33; four
bits a step, 8 steps instead of 16, 5,728 / 65: a reduction of 16 candidates crosses the warps in four rounds of two
barriers instead of one, and each bucket is compared 16 times for four bits instead of 8. Hence two bits (`bits`:
benchmarks/kernel_check.py times four as well); 115 registers and no spills (189 at BLOCK=4096, DynSplit-KV's
chunks at 32k)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _bucket_take(SCORES, COUNT, ROWS, CAPACITY, BEFORE, FIRST, PLACE, n, heads, count_b, count_h, BLOCK: tl.constexpr,
                 BITS: tl.constexpr, HAS_ROWS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * heads + h
    b, h = row // heads, row % heads
    if HAS_ROWS:  # the counts of state row ROWS[b]
        count_row = tl.load(ROWS + b).to(tl.int64)
    else:
        count_row = b
    i = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]: the layout of the [2^BITS, BLOCK] comparisons, none converted
    inside = i < n
    score = tl.load(SCORES + row * n + i, mask=inside, other=0.0) + 0.0  # -0.0 + 0.0 is +0.0: ties as in a sort
    count = tl.load(COUNT + count_row * count_b + h * count_h + i, mask=inside, other=0).to(tl.int32)
    bits = score.to(tl.uint32, bitcast=True)
    key = tl.where(bits < 0x80000000, bits | 0x80000000, ~bits)  # order-preserving, unsigned
    cap = tl.load(CAPACITY + b).to(tl.int32)
    # the largest key at or above which the buckets hold >= cap tokens (0 when they all hold fewer: all taken), BITS
    # bits a step: one reduction gives the tokens held at or above the threshold with each value of the next bits
    # appended, and the last value whose buckets still hold >= cap (the sums never grow with it) is kept. `above`
    # follows the tokens held at or above the next value of the bits found so far: at the end, above the threshold.
    # The [2^BITS, 1] / [1, 1] shapes keep every candidate's sum in each thread: choosing among them is no exchange
    threshold = tl.full([1, 1], 0, tl.uint32)
    above = tl.full([1, 1], 0, tl.int32)
    digit = tl.arange(0, 1 << BITS)[:, None]  # [2^BITS, 1]
    for step in tl.static_range(32 // BITS):  # unrolled: each shift a constant
        candidate = threshold | (digit.to(tl.uint32) << (32 - BITS - BITS * step))  # [2^BITS, 1]
        held = tl.sum(tl.where(key >= candidate, count, 0), 1, keep_dims=True)  # [2^BITS, 1]
        kept = tl.sum(((held >= cap) & (digit > 0)).to(tl.int32), 0, keep_dims=True)  # [1, 1]
        above = tl.where(kept < (1 << BITS) - 1, tl.sum(tl.where(digit == kept + 1, held, 0), 0, keep_dims=True),
                         above)
        threshold = threshold | (kept.to(tl.uint32) << (32 - BITS - BITS * step))
    over = tl.where(key > threshold, count, 0)
    tied = tl.where(key == threshold, count, 0)
    over_before, tied_before, first = tl.associative_scan((over, tied, count), 1, _add3)  # one scan for the three
    over_before, tied_before, first = over_before - over, tied_before - tied, first - count  # exclusive
    prefix = above + tied_before  # the exact rank prefix of a tied bucket (ties by bucket id)
    before = tl.where(key > threshold, 0, cap)
    before = tl.where((key == threshold) & (prefix < cap), tl.where(prefix + count <= cap, 0, prefix), before)
    before = tl.where(count == 0, cap, before)
    # the buckets before this one in id order take all their tokens above the threshold, and the tied ones fill in
    # id order what the capacity leaves after `above`
    place = over_before + tl.minimum(tied_before, tl.maximum(cap - above, 0))
    tl.store(BEFORE + row * n + i, before, mask=inside)
    tl.store(FIRST + row * n + i, first, mask=inside)
    tl.store(PLACE + row * n + i, place, mask=inside)


def bucket_take(scores: torch.Tensor, count: torch.Tensor, capacity: torch.Tensor, rows: torch.Tensor | None = None,
                bits: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same arguments and result as `reference.bucket_take` (count may be expanded: strides of 0 are read as such;
    with rows, count [R, S, buckets] is read at rows [B] in place). bits: of the threshold found a step (a divisor
    of 32; see the module docstring)."""
    if 32 % bits:
        raise ValueError(f"bits={bits} must divide 32 (1, 2, 4, 8, 16)")
    batch, heads, n = scores.shape
    before = torch.empty(batch, heads, n, dtype=torch.int32, device=scores.device)
    first, place = torch.empty_like(before), torch.empty_like(before)
    if count.stride(-1) != 1:
        count = count.contiguous()
    block = max(16, triton.next_power_of_2(n))
    _bucket_take[(batch * heads,)](scores.float().contiguous(), count, before if rows is None else rows.contiguous(),
                                   capacity.contiguous(), before, first, place, n, heads, count.stride(0),
                                   count.stride(1), BLOCK=block, BITS=bits, HAS_ROWS=rows is not None,
                                   num_warps=8 if block <= 4096 else 16)
    return before, first, place
