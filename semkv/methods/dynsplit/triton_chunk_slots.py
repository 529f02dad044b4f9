"""Attended slots from ranked chunks (DynSplit-KV): the sinks, the leading slots each chunk takes (its share of the
capacity left after the chunks ranked before it) and the recent window, written straight to their places in the slot
list. Chunks are contiguous slot ranges in ascending order, so a chunk's taken slots go to consecutive places from
its `place` (`kernels.bucket_take`: the slots the chunks before it take) and blocks of chunks are independent: a
program per row, KV head and block of chunks, each chunk's leading slots one masked [chunks, run] store (1,024
programs at 16 rows and 2,000 chunks a row, where one program per row and KV head walking the blocks with a running
count took 18 us a layer on an H200, results page 2026-11-28-h200x4-vllm-same-call). The first block's program also
writes the sinks, the recent window, the length and the padding. Same result as `reference.chunk_slots`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from semkv.kernels.triton_slot_lists import finish_slots, write_sinks


@triton.jit
def _chunk_slots(LO, COUNT, BEFORE, PLACE, N, N_SINK, CAPACITY, TAIL, OUT, LENGTHS, heads, chunks, width, longest,
                 BLOCK: tl.constexpr, RUN: tl.constexpr, SPAN: tl.constexpr):
    b, h, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    out_row = b * heads + h  # [B, S] flattened
    OUT += out_row.to(tl.int64) * width
    BEFORE += out_row.to(tl.int64) * chunks
    PLACE += out_row.to(tl.int64) * chunks
    LO += b.to(tl.int64) * chunks
    COUNT += b.to(tl.int64) * chunks
    n_sink, capacity = tl.load(N_SINK + b), tl.load(CAPACITY + b)
    c = block * BLOCK + tl.arange(0, BLOCK)
    inside = c < chunks
    count = tl.load(COUNT + c, mask=inside, other=0)
    take = tl.minimum(tl.maximum(capacity - tl.load(BEFORE + c, mask=inside, other=0), 0), count)  # [BLOCK]
    at = n_sink + tl.load(PLACE + c, mask=inside, other=0)  # where each chunk's first taken slot goes
    lo = tl.load(LO + c, mask=inside, other=0).to(tl.int64)
    run = tl.arange(0, RUN)
    for offset in range(0, longest, RUN):
        slot = offset + run
        tl.store(OUT + at[:, None] + slot[None, :], lo[:, None] + slot[None, :], mask=slot[None, :] < take[:, None])
    if block == 0:
        write_sinks(OUT, n_sink, SPAN)
        last = chunks - 1
        taken = tl.load(PLACE + last) + tl.minimum(tl.maximum(capacity - tl.load(BEFORE + last), 0),
                                                   tl.load(COUNT + last))
        finish_slots(OUT, LENGTHS + out_row, n_sink + taken, tl.load(N + b), tl.load(TAIL + b), width, SPAN)


def chunk_slots(lo: torch.Tensor, count: torch.Tensor, before: torch.Tensor, place: torch.Tensor, n: torch.Tensor,
                n_sink: torch.Tensor, capacity: torch.Tensor, tail: torch.Tensor, max_sink: int, width: int,
                longest: int, block: int = 64, run: int = 32, span: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.chunk_slots`'s arguments and result, with place [B, S, chunks] (`kernels.bucket_take`) after before
    (max_sink only bounds the reference's shapes). block: chunks a program; run: slots of a chunk a store."""
    batch, heads, chunks = before.shape
    out = torch.empty(batch, heads, width, dtype=torch.long, device=before.device)
    lengths = torch.empty(batch, heads, dtype=torch.long, device=before.device)
    _chunk_slots[(batch, heads, triton.cdiv(chunks, block))](
        lo.contiguous(), count.contiguous(), before.contiguous(), place.contiguous(), n.contiguous(),
        n_sink.contiguous(), capacity.contiguous(), tail.contiguous(), out, lengths, heads, chunks, width, longest,
        BLOCK=block, RUN=run, SPAN=span)
    return out, lengths
