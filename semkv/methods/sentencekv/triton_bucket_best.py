"""Each bucket's best retained token for the query in one kernel (SentenceKV's score="tokens"): the dot products of a KV
group's query (the mean of its query heads, taken here: three small kernels a layer less) with the keys of a block of
retained tokens, read in place through the page table (`key_dots`, TokenSelect's paged dot product), folded into each
bucket the block's tokens fall in and written with one atomic max a bucket (`fold_max`). One program per KV head,
block of retained tokens and row. Replaces the torch steps of
`reference.bucket_best` (every dot product of the row's slots written as float32, gathered at the retained ones, masked,
then a scatter max: five kernels a layer, the scatter alone 63 us a layer at 16 x 31k on an H200, results page
2026-11-28-h200x2-servers)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from semkv.kernels.triton_paged_dot import fold_max, key_dots


@triton.jit
def _bucket_best(Q, K, TABLES, BUCKET, ROWS, N_SINK, RETAINED, OUT, max_pages, map_heads, tokens, buckets,
                 PAGE_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                 DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    kv_head, block, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    g, d = tl.arange(0, 16), tl.arange(0, BLOCK_D)  # tl.dot takes at least 16 rows: the query is row 0
    t = block * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = (t < tl.load(RETAINED + b)) & (t < tokens)
    slot = tl.load(N_SINK + b) + t
    valid &= slot < max_pages * PAGE_SIZE
    head = tl.arange(0, GROUP_P)
    group = tl.load(Q + ((b * KV_HEADS + kv_head) * GROUP + head[:, None]) * DIM + d[None, :],
                    mask=(head[:, None] < GROUP) & (d[None, :] < DIM), other=0.0).to(tl.float32)  # [GROUP_P, BLOCK_D]
    mean = (tl.sum(group, 0) / GROUP).to(K.dtype.element_ty)  # the group's query, in the keys' dtype
    q = tl.where(g[:, None] == 0, mean[None, :], tl.zeros([16, BLOCK_D], K.dtype.element_ty))
    dots = tl.sum(key_dots(q, K, TABLES + b * max_pages, slot, valid, kv_head, d, PAGE_SIZE, KV_HEADS, DIM, IEEE),
                  0)  # [BLOCK_N]: the other rows are 0
    row = tl.load(ROWS + b).to(tl.int64)
    bucket = tl.load(BUCKET + (row * map_heads + kv_head % map_heads) * tokens + t, mask=valid, other=-1)
    fold_max(OUT + (b * KV_HEADS + kv_head) * buckets, bucket, dots, valid, buckets)


def bucket_best(q: torch.Tensor, k_pool: torch.Tensor, tables: torch.Tensor, bucket: torch.Tensor,
                rows: torch.Tensor, n_sink: torch.Tensor, retained: torch.Tensor, buckets: int,
                block_n: int = 64, num_warps: int = 2) -> torch.Tensor:
    """Same arguments and result as `reference.bucket_best`. Two warps a program of 64 tokens: on an H200 at the 0.5B
    model's shape and 335 rows, 0.16 ms against 0.22 with four for whole retained sentences, 0.47 against 0.75 for
    buckets of 2-3 tokens (the atomics' worst case); alike at 16 rows
    (`benchmarks/results/2026-11-29-h200-sentencekv-batch.md`)."""
    batch, heads, dim = q.shape
    page_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    tokens = bucket.shape[-1]
    out = torch.full((batch, kv_heads, buckets), float("-inf"), dtype=torch.float32, device=q.device)
    _bucket_best[(kv_heads, triton.cdiv(tokens, block_n), batch)](
        q.contiguous(), k_pool, tables.contiguous(), bucket.contiguous(), rows.contiguous(), n_sink.contiguous(),
        retained.contiguous(), out, tables.shape[1], bucket.shape[1], tokens, buckets, PAGE_SIZE=page_size,
        KV_HEADS=kv_heads, GROUP=heads // kv_heads, GROUP_P=triton.next_power_of_2(heads // kv_heads), DIM=dim,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=block_n, IEEE=k_pool.dtype == torch.float32,
        num_warps=num_warps)
    return out
