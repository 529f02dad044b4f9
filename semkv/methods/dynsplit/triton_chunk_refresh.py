"""The min / max keys of the two chunks DynSplit-KV refreshes each step (the one the new token joined and the next),
read in place from the paged cache in one kernel: one program per row, chunk and KV head loads the row's last `span`
keys of that head, reduces the chunk's members and writes its summary rows. Replaces the gather, masks, reductions
and scatters of `reference.chunk_refresh` (a dozen small launches per layer); min and max are exact, so the result
is the reference's bit for bit."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _chunk_refresh(K, TABLES, FIRST, SPLIT, N, TARGETS, KMIN, KMAX, span, stride_tb, stride_gb, stride_gc,
                   PAGE_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, SPAN: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    b, chunk, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(N + b)
    split = tl.load(SPLIT + b)
    lo = tl.where(chunk == 0, tl.load(FIRST + b), split)
    hi = tl.where(chunk == 0, split, n)
    position = n - span + tl.arange(0, SPAN)
    member = (tl.arange(0, SPAN) < span) & (position >= lo) & (position < hi) & (position >= 0)
    page = tl.load(TABLES + b.to(tl.int64) * stride_tb + position // PAGE_SIZE, mask=member, other=0)
    row = page.to(tl.int64) * PAGE_SIZE + position % PAGE_SIZE  # [SPAN] physical rows of the pool
    d = tl.arange(0, BLOCK_D)
    inside = member[:, None] & (d[None, :] < DIM)
    keys = tl.load(K + (row[:, None] * KV_HEADS + h) * DIM + d[None, :], mask=inside, other=0.0).to(tl.float32)
    held = tl.sum(member.to(tl.int32), 0) > 0
    kmin = tl.where(held, tl.min(tl.where(inside, keys, float("inf")), 0), 0.0)
    kmax = tl.where(held, tl.max(tl.where(inside, keys, float("-inf")), 0), 0.0)
    target = tl.load(TARGETS + b.to(tl.int64) * stride_gb + chunk * stride_gc).to(tl.int64)
    out = (target * KV_HEADS + h) * DIM + d
    tl.store(KMIN + out, kmin.to(KMIN.dtype.element_ty), mask=d < DIM)
    tl.store(KMAX + out, kmax.to(KMAX.dtype.element_ty), mask=d < DIM)


def chunk_refresh(k_flat: torch.Tensor, tables: torch.Tensor, page_size: int, first: torch.Tensor,
                  split: torch.Tensor, n: torch.Tensor, targets: torch.Tensor, span: int, kmin: torch.Tensor,
                  kmax: torch.Tensor) -> None:
    """Same arguments and effect as `reference.chunk_refresh`."""
    batch = n.shape[0]
    kv_heads, dim = k_flat.shape[1], k_flat.shape[2]
    assert k_flat.is_contiguous() and kmin.is_contiguous() and kmax.is_contiguous()
    tables = tables if tables.stride(-1) == 1 else tables.contiguous()
    _chunk_refresh[(batch, 2, kv_heads)](
        k_flat, tables, first.contiguous(), split.contiguous(), n.contiguous(), targets, kmin, kmax, span,
        tables.stride(0), targets.stride(0), targets.stride(1), PAGE_SIZE=page_size, KV_HEADS=kv_heads, DIM=dim,
        SPAN=triton.next_power_of_2(span), BLOCK_D=triton.next_power_of_2(dim))
