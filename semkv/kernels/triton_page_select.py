"""Quest's page selection kernels: the upper bound of each KV page's best attention logit from the min / max
summaries of its keys (`page_bound`), and the slots of the chosen pages (`page_slots`). Same signatures and results
as the functions of the same names in `reference`.

`page_bound`: one program handles one sequence, one KV head and a block of its pages. It loads the block's physical
page ids and the min and max summaries [block, D] of that head (in the cache's dtype), and for each query head of
the group adds q+ . kmax + q- . kmin over D in float32 (element-wise products and a row sum; the matrix unit, tried,
was no faster: the kernel waits on its scattered loads; nor were two KV heads a program, one run of 256 bytes a
page at Qwen2.5-0.5B's 64 dims), then takes the mean or the max over the group. Given the K pool, the program that
holds a row's last page also folds the key just stored into that page's min / max (about ten small kernels a layer
otherwise); that page's bound is +inf whatever its summary. The row's last page gets +inf and pages past it -inf, so
a top-k over the result always keeps the current token's page. The reference gathers both summaries into new
tensors first, which writes and reads them twice more.

`page_candidates` (TokenSelect's and DynSplit-KV's score_keys="pages"): one program per row keeps the `count` pages
with the highest bound (the maximum over KV heads) among those holding a slot of [lo, hi), by a bitwise search for
the count-th largest bound, and writes them ascending with their physical ids.

`page_slots`: one program per sequence and KV head keeps the best `keep` of the top-k pages (all the row's pages
when its budget covers it), sorts them and writes their slots and the attended length; it replaces a dozen small
element-wise kernels per layer (each ~1.5 us inside a CUDA graph).

Integers that change with the batch (width, strides) are not specialised, so nothing recompiles as a sequence grows
by a page. Importing this module imports Triton; set TRITON_INTERPRET=1 before importing it to run the kernels on
CPU tensors (slowly) for tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def ordered_key(x):
    """float32 -> int64 in [0, 2**32) with the same order (sign bit flipped for positives, all bits for negatives)."""
    bits = x.to(tl.int32, bitcast=True)
    flipped = bits ^ ((bits >> 31) | -2147483648)
    return flipped.to(tl.uint32, bitcast=True).to(tl.int64)


@triton.jit(do_not_specialize=["W", "stride_qb", "stride_tb", "stride_ob"])
def _page_bound_kernel(q_ptr, kmin_ptr, kmax_ptr, tables_ptr, n_ptr, k_pool_ptr, out_ptr, W, stride_qb, stride_qh,
                       stride_tb, stride_ob, PAGE_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                       DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr, MEAN: tl.constexpr,
                       FOLD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    j = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    n = tl.load(n_ptr + b)
    n_pages = (n + PAGE_SIZE - 1) // PAGE_SIZE
    live = j < n_pages
    ids = tl.load(tables_ptr + b * stride_tb + j, mask=live, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    rows = ids[:, None] * (KV_HEADS * DIM) + h * DIM + d[None, :]  # [BLOCK_W, BLOCK_D]
    mask = live[:, None] & (d < DIM)[None, :]
    kmax = tl.load(kmax_ptr + rows, mask=mask, other=0.0).to(tl.float32)
    kmin = tl.load(kmin_ptr + rows, mask=mask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_W], tl.float32)
    for g in tl.static_range(GROUP):
        qg = tl.load(q_ptr + b * stride_qb + (h * GROUP + g) * stride_qh + d, mask=d < DIM, other=0.0).to(tl.float32)
        bound = tl.sum(kmax * tl.maximum(qg, 0.0)[None, :] + kmin * tl.minimum(qg, 0.0)[None, :], 1)  # [BLOCK_W]
        if MEAN:
            acc += bound
        elif g == 0:
            acc = bound
        else:
            acc = tl.maximum(acc, bound)
    if MEAN:
        acc = acc / GROUP
    last = n_pages - 1
    if FOLD:  # the program holding the row's last page folds the new key into it (its own bound is +inf anyway)
        if (last >= tl.program_id(2) * BLOCK_W) & (last < (tl.program_id(2) + 1) * BLOCK_W):
            slot = n - 1
            page = tl.load(tables_ptr + b * stride_tb + last).to(tl.int64)
            key = tl.load(k_pool_ptr + ((page * PAGE_SIZE + slot % PAGE_SIZE) * KV_HEADS + h) * DIM + d,
                          mask=d < DIM, other=0.0).to(tl.float32)
            summary = page * (KV_HEADS * DIM) + h * DIM + d
            fresh = slot % PAGE_SIZE == 0
            low = tl.load(kmin_ptr + summary, mask=d < DIM, other=0.0).to(tl.float32)
            high = tl.load(kmax_ptr + summary, mask=d < DIM, other=0.0).to(tl.float32)
            low = tl.where(fresh, key, tl.minimum(low, key))
            high = tl.where(fresh, key, tl.maximum(high, key))
            tl.store(kmin_ptr + summary, low.to(kmin_ptr.dtype.element_ty), mask=d < DIM)
            tl.store(kmax_ptr + summary, high.to(kmax_ptr.dtype.element_ty), mask=d < DIM)
    acc = tl.where(j == last, float("inf"), acc)
    acc = tl.where(live, acc, float("-inf"))
    tl.store(out_ptr + b * stride_ob + h * W + j, acc, mask=j < W)


def page_bound(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, tables: torch.Tensor, num_slots: torch.Tensor,
               page_size: int, group_reduce: str, k_pool: torch.Tensor | None = None, block_w: int | None = None,
               num_warps: int = 4) -> torch.Tensor:
    """q [B, heads, D]; kmin / kmax [pool_pages, kv_heads, D] (contiguous, any float dtype, added in float32);
    tables [B, W]; num_slots [B]; k_pool [pool_pages, page_size, kv_heads, D] contiguous, or None: no fold. Returns
    float32 [B, kv_heads, W] (see `reference.page_bound`). block_w: pages a program, by default 4,096 summary
    elements a program: the best of `benchmarks/kernel_check.py --page-bound-sweep` (block_w x num_warps) on an H200
    at both shapes it times, 32 pages of Llama-3.1-8B's 128 dims at 11 rows (1.9x the bytes' floor) and 64 of
    Qwen2.5-0.5B's 64 at 334 (1.9x; 32 pages took 14% longer)."""
    batch, heads, dim = q.shape
    block_w = block_w or max(16, 4096 // triton.next_power_of_2(dim))
    kv_heads, width = kmin.shape[1], tables.shape[1]
    out = torch.empty(batch, kv_heads, width, dtype=torch.float32, device=q.device)
    if width == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    tables = tables if tables.stride(-1) == 1 else tables.contiguous()
    assert kmin.is_contiguous() and kmax.is_contiguous(), "the summaries are updated in place"
    _page_bound_kernel[(batch, kv_heads, triton.cdiv(width, block_w))](
        q, kmin, kmax, tables, num_slots.contiguous(), kmin if k_pool is None else k_pool, out, width, q.stride(0),
        q.stride(1), tables.stride(0), out.stride(0), PAGE_SIZE=page_size, KV_HEADS=kv_heads, GROUP=heads // kv_heads,
        DIM=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_W=block_w, MEAN=group_reduce == "mean",
        FOLD=k_pool is not None, num_warps=num_warps,
    )
    return out


@triton.jit(do_not_specialize=["K", "stride_tb", "stride_sb"])
def _page_slots_kernel(top_ptr, budget_ptr, n_ptr, slots_ptr, lengths_ptr, K, stride_tb, stride_th, stride_sb,
                       stride_sh, KV_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr, K_P: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    n = tl.load(n_ptr + b)
    budget = tl.load(budget_ptr + b)
    n_pages = (n + PAGE_SIZE - 1) // PAGE_SIZE
    keep = tl.where(budget >= n, n_pages, tl.maximum(budget // PAGE_SIZE, 1))
    i = tl.arange(0, K_P)
    top = tl.load(top_ptr + b * stride_tb + h * stride_th + i, mask=i < K, other=0).to(tl.int32)
    pages = tl.sort(tl.where(i < keep, top, 2**30))  # kept pages ascending, then the others
    pages = tl.where(pages == 2**30, 0, pages)  # padding: page 0, past the length
    t = tl.arange(0, PAGE_SIZE)
    slots = pages[:, None].to(tl.int64) * PAGE_SIZE + t[None, :]  # [K_P, PAGE_SIZE]
    tl.store(slots_ptr + b * stride_sb + h * stride_sh + i[:, None] * PAGE_SIZE + t[None, :], slots,
             mask=(i < K)[:, None])
    tl.store(lengths_ptr + b * KV_HEADS + h, keep * PAGE_SIZE - (n_pages * PAGE_SIZE - n))


def page_slots(top: torch.Tensor, budget: torch.Tensor, num_slots: torch.Tensor,
               page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top [B, kv_heads, k] page indices, best first; budget / num_slots [B]. Returns slots
    [B, kv_heads, k * page_size] and lengths [B, kv_heads] (see `reference.page_slots`)."""
    batch, kv_heads, k = top.shape
    slots = torch.empty(batch, kv_heads, k * page_size, dtype=torch.long, device=top.device)
    lengths = torch.empty(batch, kv_heads, dtype=num_slots.dtype, device=top.device)
    _page_slots_kernel[(batch, kv_heads)](
        top, budget.contiguous(), num_slots.contiguous(), slots, lengths, k, top.stride(0), top.stride(1),
        slots.stride(0), slots.stride(1), KV_HEADS=kv_heads, PAGE_SIZE=page_size, K_P=triton.next_power_of_2(k),
    )
    return slots, lengths


@triton.jit(do_not_specialize=["W", "C", "stride_bb", "stride_tb"])
def _page_candidates_kernel(bound_ptr, lo_ptr, hi_ptr, tables_ptr, pages_ptr, ids_ptr, span_ptr, W, C, stride_bb,
                            stride_bh, stride_tb, KV_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr,
                            BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    inside = j < W
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    for h in tl.static_range(KV_HEADS):
        best = tl.maximum(best, tl.load(bound_ptr + b * stride_bb + h * stride_bh + j, mask=inside,
                                        other=float("-inf")))
    lo = tl.load(lo_ptr + b)
    hi = tl.load(hi_ptr + b)
    start = j * PAGE_SIZE
    holds = inside & (start + PAGE_SIZE > lo) & (start < hi)
    # pages holding candidates by their bound (every finite bound's key is above 0), then the others (key 0)
    key = tl.where(holds, ordered_key(best), 0)
    key = tl.where(inside, key, -1)
    threshold = tl.full([], 0, tl.int64)  # the C-th largest key, a bit at a time from the top
    for bit in tl.static_range(31, -1, -1):
        trial = threshold | (1 << bit)
        threshold = tl.where(tl.sum((key >= trial).to(tl.int32), 0) >= C, trial, threshold)
    above = key > threshold
    equal = (key == threshold).to(tl.int32)
    need = C - tl.sum(above.to(tl.int32), 0)
    take = above | ((equal != 0) & (tl.cumsum(equal, 0) <= need))  # ties to the lower pages
    at = tl.cumsum(take.to(tl.int32), 0) - 1
    tl.store(pages_ptr + b * C + at, j.to(tl.int64), mask=take)
    physical = tl.load(tables_ptr + b * stride_tb + j, mask=take, other=0)
    tl.store(ids_ptr + b * C + at, physical.to(tl.int64), mask=take)
    first = tl.sum(tl.where(take, tl.minimum(tl.maximum(lo - start, 0), PAGE_SIZE), 0), 0)
    end = tl.sum(tl.where(take, tl.minimum(tl.maximum(hi - start, 0), PAGE_SIZE), 0), 0)
    tl.store(span_ptr + b * 2, first.to(tl.int64))
    tl.store(span_ptr + b * 2 + 1, end.to(tl.int64))


def page_candidates(bound: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, tables: torch.Tensor, page_size: int,
                    count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same arguments and result as `reference.page_candidates`, one program per row holding its W bounds at once:
    a bitwise search for the count-th largest bound (ties to the lower pages), the pages written ascending."""
    batch, kv_heads, width = bound.shape
    pages = torch.empty(batch, count, dtype=torch.long, device=bound.device)
    ids = torch.empty_like(pages)
    span = torch.empty(batch, 2, dtype=torch.long, device=bound.device)
    block = triton.next_power_of_2(width)
    _page_candidates_kernel[(batch,)](bound, lo.contiguous(), hi.contiguous(), tables, pages, ids, span, width, count,
                                      bound.stride(0), bound.stride(1), tables.stride(0), KV_HEADS=kv_heads,
                                      PAGE_SIZE=page_size, BLOCK=block, num_warps=max(4, min(16, block // 256)))
    return ids, pages, span
