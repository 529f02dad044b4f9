"""Each chunk's best token for the current query in one kernel (DynSplit-KV's score="tokens"): the dot products of a
KV group's queries with the keys of a block of slots, read in place through the page table (`key_dots`, TokenSelect's
paged dot product), reduced over the group (mean or max), folded into each chunk the block's slots fall in and
written with one atomic max a chunk. One program per KV head, block of slots and row. Replaces the torch reference
(`reference.chunk_best`), which writes every dot product of every query head ([B, heads, width] float32) and reads it
back three times."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from semkv.kernels.triton_paged_dot import fold_max, key_dots


@triton.jit
def _chunk_best(Q, K, TABLES, CHUNK_OF, LO, HI, OUT, width, max_pages, chunks, PAGE_SIZE: tl.constexpr,
                KV_HEADS: tl.constexpr, GROUP: tl.constexpr, DIM: tl.constexpr, GROUP_P: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MEAN: tl.constexpr, IEEE: tl.constexpr):
    kv_head, block, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    g, d = tl.arange(0, GROUP_P), tl.arange(0, BLOCK_D)
    t = block * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = (t >= tl.load(LO + b)) & (t < tl.load(HI + b)) & (t < width)
    heads = kv_head * GROUP + g
    q = tl.load(Q + (b * KV_HEADS * GROUP + heads[:, None]) * DIM + d[None, :],
                mask=(g[:, None] < GROUP) & (d[None, :] < DIM), other=0.0)
    dots = key_dots(q, K, TABLES + b * max_pages, t, valid, kv_head, d, PAGE_SIZE, KV_HEADS, DIM,
                    IEEE)  # [GROUP_P, BLOCK_N]
    if MEAN:
        best = tl.sum(dots, 0) / GROUP  # the padding rows are 0
    else:
        best = tl.max(tl.where(g[:, None] < GROUP, dots, float("-inf")), 0)
    # chunks are runs of slots: a block's slots fall in a few of them, each folded and written with one atomic
    chunk = tl.load(CHUNK_OF + b * width + t, mask=valid, other=-1)
    fold_max(OUT + (b * KV_HEADS + kv_head) * chunks, chunk, best, valid, chunks)


def chunk_best(q: torch.Tensor, k_pool: torch.Tensor, tables: torch.Tensor, chunk_of: torch.Tensor, lo: torch.Tensor,
               hi: torch.Tensor, chunks: int, group_reduce: str, block_n: int = 64) -> torch.Tensor:
    """Same arguments and result as `reference.chunk_best`."""
    batch, n_heads, dim = q.shape
    _, page_size, kv_heads, _ = k_pool.shape
    width = chunk_of.shape[1]
    out = torch.full((batch, kv_heads, chunks), float("-inf"), dtype=torch.float32, device=q.device)
    group = n_heads // kv_heads
    _chunk_best[(kv_heads, triton.cdiv(width, block_n), batch)](
        q.to(k_pool.dtype).contiguous(), k_pool, tables.contiguous(), chunk_of.contiguous(), lo.contiguous(),
        hi.contiguous(), out, width, tables.shape[1], chunks, PAGE_SIZE=page_size, KV_HEADS=kv_heads, GROUP=group,
        DIM=dim, GROUP_P=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_N=block_n, MEAN=group_reduce == "mean", IEEE=q.dtype == torch.float32)
    return out
