"""Reuse counting from per-slot stamps in one kernel (DynSplit-KV's `kv_reused` / `kv_reloaded` without offload):
one program per row and KV head walks the row's attended slots, maps each through the page table to its pool row,
counts it as reused when its stamp says it was attended at the previous step, stamps it with this step and adds
the row's counts to its counters. Replaces the dozen gathers, compares, reductions and scatters of
`reference.slot_stamps`. A row's slots are distinct and rows own their pages, so programs never touch the same
stamp (padding rows aside, which only write the scratch page and counter row 0)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _slot_stamps(STAMPS, TABLES, SLOTS, LENGTHS, CURRENT, STEP, FIRST, REUSE, ROWS, heads, width, stride_tb,
                 PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    out_row = b * heads + h
    SLOTS += out_row.to(tl.int64) * width
    length = tl.load(LENGTHS + out_row)
    current, step, first = tl.load(CURRENT + b), tl.load(STEP + b), tl.load(FIRST + b)
    reused = tl.zeros([], tl.int64)
    counted = tl.zeros([], tl.int64)
    for start in range(0, length, BLOCK):
        at = start + tl.arange(0, BLOCK)
        held = at < length
        slot = tl.load(SLOTS + at, mask=held, other=0)
        page = tl.load(TABLES + b.to(tl.int64) * stride_tb + slot // PAGE_SIZE, mask=held, other=0)
        where = (page * PAGE_SIZE + slot % PAGE_SIZE) * heads + h
        count = held & (slot != current)
        before = tl.load(STAMPS + where, mask=held, other=0)
        reused += tl.sum((count & (before == step - 1) & (first == 0)).to(tl.int64), 0)
        counted += tl.sum(count.to(tl.int64), 0)
        tl.store(STAMPS + where, step.to(tl.int32), mask=held)
    row = tl.load(ROWS + b).to(tl.int64)
    tl.atomic_add(REUSE + row * 2, reused)
    tl.atomic_add(REUSE + row * 2 + 1, counted - reused)


def slot_stamps(stamps: torch.Tensor, tables: torch.Tensor, page_size: int, slots: torch.Tensor, lengths: torch.Tensor,
                current: torch.Tensor, step: torch.Tensor, first: torch.Tensor, reuse: torch.Tensor, rows: torch.Tensor,
                scratch: int, block: int = 512) -> None:
    """Same arguments and effect as `reference.slot_stamps` (scratch only tells the reference where padding goes)."""
    batch, heads, width = slots.shape
    assert stamps.is_contiguous() and reuse.is_contiguous()
    tables = tables if tables.stride(-1) == 1 else tables.contiguous()
    _slot_stamps[(batch, heads)](stamps, tables, slots.contiguous(), lengths.contiguous(), current.contiguous(),
                                 step.contiguous(), first.contiguous(), reuse, rows.contiguous(), heads, width,
                                 tables.stride(0), PAGE_SIZE=page_size, BLOCK=block)
