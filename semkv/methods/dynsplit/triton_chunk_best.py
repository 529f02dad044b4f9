"""Each chunk's best token for the current query in one kernel (DynSplit-KV's score="tokens"): the dot products of a
KV group's queries with the keys of a block of slots (exact keys, or the key channels of score_keys="channels"), read
in place through the page table, reduced over the group (mean: one dot product with the group's mean query; max:
every head's, `key_dots`, TokenSelect's paged dot product), and each run of slots of one chunk folded and written with
one atomic max (`fold_runs`). With a mask of kept pages (score_keys="pages") only their slots are read. One program
per KV head, block of slots and row. Replaces the torch reference
(`reference.chunk_best`), which writes every dot product of every query head ([B, heads, width] float32) and reads it
back three times."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from semkv.kernels.triton_paged_dot import fold_runs, key_dots, paged_keys


@triton.jit
def _chunk_best(Q, K, TABLES, CHUNK_OF, LO, HI, KEPT, OUT, width, max_pages, chunks, kept_pages,
                PAGE_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, DIM: tl.constexpr,
                GROUP_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MEAN: tl.constexpr,
                IEEE: tl.constexpr, HAS_KEPT: tl.constexpr):
    kv_head, block, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    g, d = tl.arange(0, GROUP_P), tl.arange(0, BLOCK_D)
    t = block * BLOCK_N + tl.arange(0, BLOCK_N)
    lo, hi = tl.load(LO + b), tl.minimum(tl.load(HI + b), width)
    valid = (t >= lo) & (t < hi)
    if HAS_KEPT:  # only the slots of kept pages
        valid &= tl.load(KEPT + b * kept_pages + t // PAGE_SIZE, mask=valid, other=0) != 0
    heads = kv_head * GROUP + g
    q = tl.load(Q + (b * KV_HEADS * GROUP + heads[:, None]) * DIM + d[None, :],
                mask=(g[:, None] < GROUP) & (d[None, :] < DIM), other=0.0)
    table = TABLES + b * max_pages
    if MEAN:  # the mean over the group of q . k is the group's mean query . k
        query = tl.sum(q.to(tl.float32), 0) / GROUP  # [BLOCK_D]
        keys = paged_keys(K, table, t, valid, kv_head, d, PAGE_SIZE, KV_HEADS, DIM)  # [BLOCK_N, BLOCK_D]
        best = tl.sum(keys.to(tl.float32) * query[None, :], 1)
    else:
        dots = key_dots(q, K, table, t, valid, kv_head, d, PAGE_SIZE, KV_HEADS, DIM, IEEE)  # [GROUP_P, BLOCK_N]
        best = tl.max(tl.where(g[:, None] < GROUP, dots, float("-inf")), 0)
    # chunks are runs of slots: a block's slots fall in a few of them, each folded and written with one atomic
    row = CHUNK_OF + b * width
    chunk = tl.load(row + t, mask=valid, other=-1)
    before_ok, after_ok = valid & (t > lo), valid & (t + 1 < hi)
    if HAS_KEPT:  # a neighbour on a page not kept ends the run (`fold_runs` reads only valid entries' values)
        before_ok &= tl.load(KEPT + b * kept_pages + (t - 1) // PAGE_SIZE, mask=before_ok, other=0) != 0
        after_ok &= tl.load(KEPT + b * kept_pages + (t + 1) // PAGE_SIZE, mask=after_ok, other=0) != 0
    before = tl.load(row + t - 1, mask=before_ok, other=-1)
    after = tl.load(row + t + 1, mask=after_ok, other=-1)
    fold_runs(OUT + (b * KV_HEADS + kv_head) * chunks, chunk, best, valid, before, after, BLOCK_N)


def chunk_best(q: torch.Tensor, k_pool: torch.Tensor, tables: torch.Tensor, chunk_of: torch.Tensor, lo: torch.Tensor,
               hi: torch.Tensor, chunks: int, group_reduce: str, kept: torch.Tensor | None = None,
               block_n: int = 128, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """Same arguments and result as `reference.chunk_best` (k_pool may hold key channels: q then holds the same
    channels; kept, if given, uint8 [B, pages]). Blocks of 128 slots, four warps, three stages: on an H200 at the 0.5B
    model's shape, 335 rows of 31,744 slots, 0.90 ms a layer with exact keys (1.22 with 64; 1.55 before `fold_runs`),
    0.32 with 8 or 16 key channels (`benchmarks/results/2026-11-29-h200-key-channels.md`)."""
    batch, n_heads, dim = q.shape
    _, page_size, kv_heads, _ = k_pool.shape
    width = chunk_of.shape[1]
    out = torch.full((batch, kv_heads, chunks), float("-inf"), dtype=torch.float32, device=q.device)
    group = n_heads // kv_heads
    _chunk_best[(kv_heads, triton.cdiv(width, block_n), batch)](
        q.to(k_pool.dtype).contiguous(), k_pool, tables.contiguous(), chunk_of.contiguous(), lo.contiguous(),
        hi.contiguous(), out if kept is None else kept.contiguous(), out, width, tables.shape[1], chunks,
        0 if kept is None else kept.shape[1], PAGE_SIZE=page_size, KV_HEADS=kv_heads, GROUP=group, DIM=dim,
        GROUP_P=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=block_n,
        MEAN=group_reduce == "mean", IEEE=q.dtype == torch.float32, HAS_KEPT=kept is not None, num_warps=num_warps,
        num_stages=num_stages)
    return out
