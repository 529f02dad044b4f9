"""Attended slots from ranked chunks in one kernel (DynSplit-KV): the sinks, the leading slots each chunk takes (its
share of the capacity left after the chunks ranked before it) and the recent window, written straight to their
places in the slot list. Chunks are contiguous slot ranges in ascending order, so the kernel walks chunks, not slots:
a block of chunks at a time, an exclusive prefix sum placing each chunk's slots, then each chunk's leading slots as
one masked [chunks, longest] store. One program per row and KV head. Same result as `reference.chunk_slots`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from semkv.kernels.triton_slot_lists import finish_slots, write_sinks


@triton.jit
def _chunk_slots(LO, COUNT, BEFORE, N, N_SINK, CAPACITY, TAIL, OUT, LENGTHS, heads, chunks, width, longest,
                 BLOCK: tl.constexpr, RUN: tl.constexpr, SPAN: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    out_row = b * heads + h  # [B, S] flattened
    OUT += out_row.to(tl.int64) * width
    BEFORE += out_row.to(tl.int64) * chunks
    LO += b.to(tl.int64) * chunks
    COUNT += b.to(tl.int64) * chunks
    n, n_sink, tail, capacity = tl.load(N + b), tl.load(N_SINK + b), tl.load(TAIL + b), tl.load(CAPACITY + b)
    write_sinks(OUT, n_sink, SPAN)
    written = n_sink.to(tl.int32)
    block, run = tl.arange(0, BLOCK), tl.arange(0, RUN)
    for first in range(0, chunks, BLOCK):
        c = first + block
        inside = c < chunks
        count = tl.load(COUNT + c, mask=inside, other=0).to(tl.int32)
        take = tl.minimum(tl.maximum(capacity - tl.load(BEFORE + c, mask=inside, other=0), 0), count).to(tl.int32)
        lo = tl.load(LO + c, mask=inside, other=0).to(tl.int64)
        taken = tl.sum(take, 0)
        if taken > 0:  # most blocks of a long context take nothing
            place = written + tl.cumsum(take, 0) - take  # where each chunk's first taken slot goes
            for offset in range(0, longest, RUN):
                at = offset + run
                keep = at[None, :] < take[:, None]  # [BLOCK, RUN]
                tl.store(OUT + place[:, None] + at[None, :], lo[:, None] + at[None, :], mask=keep)
        written += taken
    finish_slots(OUT, LENGTHS + out_row, written, n, tail, width, SPAN)


def chunk_slots(lo: torch.Tensor, count: torch.Tensor, before: torch.Tensor, n: torch.Tensor, n_sink: torch.Tensor,
                capacity: torch.Tensor, tail: torch.Tensor, max_sink: int, width: int, longest: int,
                block: int = 128, run: int = 32, span: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments and result as `reference.chunk_slots` (max_sink only bounds the reference's shapes)."""
    batch, heads, chunks = before.shape
    out = torch.empty(batch, heads, width, dtype=torch.long, device=before.device)
    lengths = torch.empty(batch, heads, dtype=torch.long, device=before.device)
    _chunk_slots[(batch, heads)](lo.contiguous(), count.contiguous(), before.contiguous(), n.contiguous(),
                                 n_sink.contiguous(), capacity.contiguous(), tail.contiguous(), out, lengths, heads,
                                 chunks, width, longest, BLOCK=block, RUN=run, SPAN=span)
    return out, lengths
