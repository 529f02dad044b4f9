"""Accumulated attention (H2O's heavy-hitter scores): one pass that normalises each row's attention logits over its
resident slots, sums them over each KV head's query group and adds them to the per-slot scores stored beside the
paged cache, restarting at zero the slot that holds the current token. Replaces a float64 softmax and about a dozen
small gather / element-wise kernels per layer; reads and writes only the `counts[b]` resident slots of each row, so
the result does not depend on how wide the logits are padded. Torch reference: `reference.accumulate_attention`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _accumulate_attention(LOGITS, COUNTS, PAGES, POSITIONS, POS, SCORES, stride_lb, stride_lh, stride_pb,
                          GROUP: tl.constexpr, GROUP_P: tl.constexpr, KV_HEADS: tl.constexpr,
                          PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    first = tl.program_id(2) * CHUNK  # this program updates slots [first, first + CHUNK)
    count = tl.load(COUNTS + b)
    if first >= count:
        return
    g = tl.arange(0, GROUP_P)
    in_group = g < GROUP
    rows = LOGITS + b * stride_lb + (kv_head * GROUP + g)[:, None] * stride_lh  # [GROUP_P, 1]
    # pass 1 (every program of the row, over all its resident slots: they sit in L2): each query head's running max
    # and sum of exponentials
    top = tl.full([GROUP_P], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P], tl.float32)
    for start in range(0, count, BLOCK):
        n = start + tl.arange(0, BLOCK)
        x = tl.load(rows + n[None, :], mask=in_group[:, None] & (n < count)[None, :], other=float("-inf"))
        x = tl.where(in_group[:, None], x, 0.0)  # padding heads stay finite; they are dropped below
        new_top = tl.maximum(top, tl.max(x, 1))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top[:, None]), 1)
        top = new_top
    # pass 2: probabilities summed over the group, added to the stored scores
    now = tl.load(POSITIONS + b)
    for start in range(first, tl.minimum(count, first + CHUNK), BLOCK):
        n = start + tl.arange(0, BLOCK)
        resident = n < count
        x = tl.load(rows + n[None, :], mask=in_group[:, None] & resident[None, :], other=float("-inf"))
        probs = tl.where(in_group[:, None], tl.exp(x - top[:, None]) / total[:, None], 0.0)
        added = tl.sum(probs, 0)  # [BLOCK]
        page = tl.load(PAGES + b * stride_pb + n // PAGE_SIZE, mask=resident, other=0).to(tl.int64)
        cell = (page * PAGE_SIZE + n % PAGE_SIZE) * KV_HEADS + kv_head
        stored_at = tl.load(POS + cell, mask=resident, other=-1)
        old = tl.load(SCORES + cell, mask=resident, other=0.0)
        tl.store(SCORES + cell, tl.where(stored_at == now, 0.0, old) + added, mask=resident)


def accumulate_attention(logits: torch.Tensor, counts: torch.Tensor, pages: torch.Tensor, positions: torch.Tensor,
                         pos_pool: torch.Tensor, scores: torch.Tensor, block: int = 128, chunk: int = 256) -> None:
    """See `reference.accumulate_attention` (same arguments; scores updated in place). Each row's slots are updated
    in chunks of `chunk` by programs of their own (a multiple of `block`)."""
    batch, heads, width = logits.shape
    _, page_size, kv_heads = scores.shape
    group = heads // kv_heads
    logits = logits.contiguous()
    pages = pages.contiguous()
    _accumulate_attention[(batch, kv_heads, triton.cdiv(width, chunk))](
        logits, counts.contiguous(), pages, positions.contiguous(), pos_pool, scores,
        logits.stride(0), logits.stride(1), pages.stride(0),
        GROUP=group, GROUP_P=max(2, triton.next_power_of_2(group)), KV_HEADS=kv_heads, PAGE_SIZE=page_size,
        BLOCK=block, CHUNK=chunk,
    )
