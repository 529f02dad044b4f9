"""Paged dot-product kernel (TokenSelect's Algorithm 2): scores of every query head against keys read in place from
the paged cache by an index list, without gathering them into a contiguous copy first.

Same signature and result as `reference.paged_dot`. One program handles one sequence, one KV head and a block of
slots: it loads the queries of that KV group once ([group, D], GQA by grouping: query head h reads KV head
h // group), maps each logical slot to its physical row through the page table, loads the keys of the block and
computes the group's scores with one `tl.dot`. `key_dots` is that step for other kernels; `fold_runs` folds scores
into the groups they belong to (a bucket, a chunk). Importing this module imports Triton; set TRITON_INTERPRET=1 before
importing it to run the kernel on CPU tensors (slowly) for tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _run_max(v1, f1, v2, f2):
    """A segmented max (associative): f is 1 where a run starts."""
    return tl.where(f2 != 0, v2, tl.maximum(v1, v2)), f1 | f2


@triton.jit
def fold_runs(out_ptr, ids, values, valid, prev_ids, next_ids, BLOCK: tl.constexpr):
    """Each run of equal ids' largest value among a block's entries, written to out_ptr[id] with one atomic max a
    run, all in one masked vector atomic: ids [BLOCK] where `valid`, values [BLOCK], prev_ids / next_ids the ids of
    the entries before and after each (anything but its id where that entry is not valid). Runs come from one
    segmented scan, so any order of ids is right and the cost does not grow with the ids a block holds (a loop over
    them, one reduction and atomic each, made DynSplit-KV's chunk_best as slow with an eighth of the key bytes:
    1.28 against 1.55 ms a layer at 335 rows on an H200)."""
    lane = tl.arange(0, BLOCK)
    starts = ((lane == 0) | (prev_ids != ids) | ~valid).to(tl.int32)
    best, _ = tl.associative_scan((tl.where(valid, values, float("-inf")), starts), 0, _run_max)
    ends = valid & ((lane == BLOCK - 1) | (next_ids != ids))
    tl.atomic_max(out_ptr + tl.where(ends, ids, 0), best, mask=ends)


@triton.jit
def paged_keys(k_ptr, table_ptr, slot, valid, kv_head, d, PAGE_SIZE: tl.constexpr, KV_HEADS: tl.constexpr,
               DIM: tl.constexpr):
    """The keys of KV head `kv_head` at logical slots `slot` [BLOCK_N] (where `valid`, else 0), read in place through
    the page table at `table_ptr`: [BLOCK_N, BLOCK_D] (`d` is tl.arange(0, BLOCK_D))."""
    page = tl.load(table_ptr + slot // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    row = page * PAGE_SIZE + slot % PAGE_SIZE
    return tl.load(k_ptr + (row[:, None] * KV_HEADS + kv_head) * DIM + d[None, :],
                   mask=valid[:, None] & (d[None, :] < DIM), other=0.0)


@triton.jit
def key_dots(q, k_ptr, table_ptr, slot, valid, kv_head, d, PAGE_SIZE: tl.constexpr, KV_HEADS: tl.constexpr,
             DIM: tl.constexpr, IEEE: tl.constexpr):
    """q [GROUP_P, BLOCK_D] (one KV group's queries) against the keys of KV head `kv_head` at logical slots
    `slot` [BLOCK_N] (where `valid`), read in place through the page table at `table_ptr`: float32
    [GROUP_P, BLOCK_N], 0 where not valid. `d` is tl.arange(0, BLOCK_D). Shared with `triton_token_select`."""
    keys = paged_keys(k_ptr, table_ptr, slot, valid, kv_head, d, PAGE_SIZE, KV_HEADS, DIM)  # [BLOCK_N, BLOCK_D]
    if IEEE:
        scores = tl.dot(q, tl.trans(keys), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(keys))  # fp32 accumulation
    return scores


@triton.jit
def sketch_dots(q, k_ptr, scale_ptr, table_ptr, slot, valid, kv_head, d, PAGE_SIZE: tl.constexpr,
                KV_HEADS: tl.constexpr, DIM: tl.constexpr, IEEE: tl.constexpr):
    """`key_dots` from an int8 key sketch (`methods/state/key_sketch.py`): the keys at `k_ptr` are int8 and each
    slot and KV head has a float32 scale at `scale_ptr` [pages * PAGE_SIZE, KV_HEADS]: float32 [GROUP_P, BLOCK_N],
    (q . int8 key) * scale, 0 where not valid. Reads D + 4 bytes a key instead of 2D."""
    page = tl.load(table_ptr + slot // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    row = page * PAGE_SIZE + slot % PAGE_SIZE
    keys = tl.load(k_ptr + (row[:, None] * KV_HEADS + kv_head) * DIM + d[None, :],
                   mask=valid[:, None] & (d[None, :] < DIM), other=0)  # [BLOCK_N, BLOCK_D] int8
    scale = tl.load(scale_ptr + row * KV_HEADS + kv_head, mask=valid, other=0.0)  # [BLOCK_N]
    if IEEE:
        scores = tl.dot(q, tl.trans(keys.to(q.dtype)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(keys.to(q.dtype)))  # int8 values are exact in (b)float16; fp32 accumulation
    return scores * scale[None, :]


@triton.jit
def _paged_dot_kernel(q_ptr, k_ptr, table_ptr, slots_ptr, out_ptr, n, MAX_PAGES,
                      PAGE_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, DIM: tl.constexpr,
                      GROUP_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    kv_head = tl.program_id(0)
    block = tl.program_id(1)
    row_b = tl.program_id(2).to(tl.int64)  # the sequence: its queries, page table and scores
    q_ptr += row_b * KV_HEADS * GROUP * DIM
    table_ptr += row_b * MAX_PAGES
    out_ptr += row_b * KV_HEADS * GROUP * n
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, BLOCK_D)
    t = block * BLOCK_N + tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g  # the query heads of this KV group
    q = tl.load(q_ptr + heads[:, None] * DIM + d[None, :], mask=(g[:, None] < GROUP) & (d[None, :] < DIM), other=0.0)
    slot = tl.load(slots_ptr + t, mask=t < n, other=0)
    scores = key_dots(q, k_ptr, table_ptr, slot, t < n, kv_head, d, PAGE_SIZE, KV_HEADS, DIM,
                      IEEE)  # [GROUP_P, BLOCK_N]
    tl.store(out_ptr + heads[:, None] * n + t[None, :], scores, mask=(g[:, None] < GROUP) & (t[None, :] < n))


def paged_dot(q: torch.Tensor, k_pool: torch.Tensor, table: torch.Tensor, slots: torch.Tensor,
              block_n: int = 64) -> torch.Tensor:
    """q [heads, D] with table [max_pages], or q [B, heads, D] with tables [B, max_pages]; k_pool [pages, page_size,
    kv_heads, D] (contiguous); slots [n]. Returns float32 scores [heads, n] (or [B, heads, n])."""
    if q.dim() == 2:
        return paged_dot(q[None], k_pool, table[None], slots, block_n)[0]
    batch, n_heads, dim = q.shape
    _, page_size, kv_heads, _ = k_pool.shape
    n = slots.shape[0]
    out = torch.empty(batch, n_heads, n, dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    group = n_heads // kv_heads
    grid = (kv_heads, triton.cdiv(n, block_n), batch)
    _paged_dot_kernel[grid](
        q.to(k_pool.dtype).contiguous(), k_pool.contiguous(), table.contiguous(), slots.contiguous(), out, n,
        table.shape[1], PAGE_SIZE=page_size, KV_HEADS=kv_heads, GROUP=group, DIM=dim,
        GROUP_P=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
    )
    return out
