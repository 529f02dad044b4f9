"""Each bucket's best retained token for the query in one kernel (SentenceKV's score="tokens"): the dot products of a KV
group's query (the mean of its query heads, taken here: three small kernels a layer less) with the keys of a block of
retained tokens, read in place through the page table (`paged_keys`), each run of tokens of one bucket folded and
written with one atomic max (`fold_runs`). One program per KV head,
block of retained tokens and row. Replaces the torch steps of
`reference.bucket_best` (every dot product of the row's slots written as float32, gathered at the retained ones, masked,
then a scatter max: five kernels a layer, the scatter alone 63 us a layer at 16 x 31k on an H200, results page
2026-11-28-h200x2-servers)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from semkv.kernels.triton_paged_dot import fold_runs, paged_keys


@triton.jit
def _bucket_best(Q, K, TABLES, BUCKET, ROWS, N_SINK, RETAINED, OUT, max_pages, map_heads, tokens, buckets,
                 PAGE_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                 DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    kv_head, block, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    t = block * BLOCK_N + tl.arange(0, BLOCK_N)
    end = tl.minimum(tl.minimum(tl.load(RETAINED + b), tokens), max_pages * PAGE_SIZE - tl.load(N_SINK + b))
    valid = t < end
    slot = tl.load(N_SINK + b) + t
    head = tl.arange(0, GROUP_P)
    group = tl.load(Q + ((b * KV_HEADS + kv_head) * GROUP + head[:, None]) * DIM + d[None, :],
                    mask=(head[:, None] < GROUP) & (d[None, :] < DIM), other=0.0).to(tl.float32)  # [GROUP_P, BLOCK_D]
    query = tl.sum(group, 0) / GROUP  # [BLOCK_D] the group's query
    keys = paged_keys(K, TABLES + b * max_pages, slot, valid, kv_head, d, PAGE_SIZE, KV_HEADS, DIM)
    dots = tl.sum(keys.to(tl.float32) * query[None, :], 1)  # [BLOCK_N]
    bucket_row = BUCKET + (tl.load(ROWS + b).to(tl.int64) * map_heads + kv_head % map_heads) * tokens
    bucket = tl.load(bucket_row + t, mask=valid, other=-1)
    before = tl.load(bucket_row + t - 1, mask=valid & (t > 0), other=-1)
    after = tl.load(bucket_row + t + 1, mask=t + 1 < end, other=-1)
    fold_runs(OUT + (b * KV_HEADS + kv_head) * buckets, bucket, dots, valid, before, after, BLOCK_N)


def bucket_best(q: torch.Tensor, k_pool: torch.Tensor, tables: torch.Tensor, bucket: torch.Tensor,
                rows: torch.Tensor, n_sink: torch.Tensor, retained: torch.Tensor, buckets: int,
                block_n: int = 128, num_warps: int = 4) -> torch.Tensor:
    """Same arguments and result as `reference.bucket_best`. Four warps a program of 128 tokens: on an H200 at the 0.5B
    model's shape, whole retained sentences, 0.027 ms at 16 rows and 0.110 at 335 against 0.044 and 0.112 with two
    warps of 64 (0.161 at 335 before `fold_runs`); buckets of 2-3 tokens, 16 rows, 0.020 against 0.017
    (`benchmarks/results/2026-11-29-h200-key-channels.md`)."""
    batch, heads, dim = q.shape
    page_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    tokens = bucket.shape[-1]
    out = torch.full((batch, kv_heads, buckets), float("-inf"), dtype=torch.float32, device=q.device)
    _bucket_best[(kv_heads, triton.cdiv(tokens, block_n), batch)](
        q.contiguous(), k_pool, tables.contiguous(), bucket.contiguous(), rows.contiguous(), n_sink.contiguous(),
        retained.contiguous(), out, tables.shape[1], bucket.shape[1], tokens, buckets, PAGE_SIZE=page_size,
        KV_HEADS=kv_heads, GROUP=heads // kv_heads, GROUP_P=triton.next_power_of_2(heads // kv_heads), DIM=dim,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=block_n, num_warps=num_warps)
    return out
