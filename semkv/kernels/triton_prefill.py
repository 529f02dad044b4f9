"""Triton prefill attention over the paged cache: a chunk of queries attends to a context (every earlier slot, or an
index list for sparse prefill) plus itself causally, reading K/V through the page table (FlashAttention-style online
softmax in base 2, no gathered copy). Same contract as `reference.prefill_attention`.

- The context and the chunk's own keys are two loops: the context and the chunk's key blocks below a query block's
  diagonal need no mask; only the diagonal blocks are masked.
- Query blocks are launched longest first (the causal part grows with the block index).
- When the chunk's query blocks are too few to fill the device (a short chunk over a long context, the TokenSelect
  paper's Figure-7 shape), the context is split over programs (`splits`) that each keep their own softmax
  statistics; the partial outputs are merged by their log-sum-exps.
- The log-sum-exp of each query's logits comes out as well, for methods that score the prompt from it (H2O).
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from semkv.kernels.triton_decode import _combine, device_limits

LOG2E = 1.4426950408889634

# (BLOCK_M, BLOCK_N, num_warps, num_stages) for head_dim <= 128 on Hopper (the best at a 512-query chunk over 1M
# keys and within 1% of the best at 8k chunks on an H100: benchmarks/prefill_sweep.py), and a smaller tile for wider
# heads and other GPUs' shared memory
TILE = (128, 64, 4, 3)
TILE_SPARSE = (64, 64, 4, 3)  # an index list (TokenSelect's 2688 slots): the tile before TILE, twice as fast there
TILE_WIDE = (64, 64, 4, 2)


@triton.jit
def _block(q, K, V, Table, slot, valid, kvh, stride_kr, stride_kh, d, m, l, acc, visible, scale_log2,
           PAGE: tl.constexpr, MASKED: tl.constexpr):
    """One block of keys at logical slots `slot` [BLOCK_N] folded into the running max m, sum l and output acc."""
    page = tl.load(Table + slot // PAGE, mask=valid, other=0)
    row = page.to(tl.int64) * PAGE + slot % PAGE
    k = tl.load(K + row[:, None] * stride_kr + kvh * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale_log2  # [BLOCK_M, BLOCK_N], log2 units
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    v = tl.load(V + row[:, None] * stride_kr + kvh * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l, acc


@triton.jit
def _chunk_attention(
    Q, K, V, Table, Context, O, LSE,
    stride_qm, stride_qh, stride_kr, stride_kh, stride_cs, stride_os, stride_om, stride_oh, stride_ls, stride_lm,
    start, chunk, n_ctx, split_len, scale_log2, mb, h, part,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, PER_HEAD: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """Query block mb of a chunk (rows [start, start + chunk) of its sequence, Q / O / LSE at its first row), head h,
    part `part` of the context [0, n_ctx): the online softmax over that part, and over the chunk itself (causal) in
    the launch's last part; writes the part's output and, with WRITE_LSE, its log-sum-exp."""
    kvh = h // GROUP
    sel = kvh if PER_HEAD else 0
    rows_q = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # query index inside the chunk
    d = tl.arange(0, D)
    q_mask = rows_q < chunk
    q = tl.load(Q + rows_q[:, None] * stride_qm + h * stride_qh + d[None, :], mask=q_mask[:, None], other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # the context: this program's part of [0, n_ctx)
    lo = part * split_len
    hi = tl.minimum(n_ctx, lo + split_len)
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        valid = j < hi
        if HAS_CONTEXT:
            slot = tl.load(Context + sel * stride_cs + j, mask=valid, other=0)
        else:
            slot = j
        m, l, acc = _block(q, K, V, Table, slot, valid, kvh, stride_kr, stride_kh, d, m, l, acc, valid[None, :],
                           scale_log2, PAGE, True)
    # the chunk itself, causal, in the last part: blocks below the diagonal whole, then the diagonal masked
    if part == tl.num_programs(2) - 1:
        diagonal = mb * BLOCK_M
        for n0 in range(0, diagonal, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            valid = j < diagonal  # all true: the blocks below the diagonal
            m, l, acc = _block(q, K, V, Table, start + j, valid, kvh, stride_kr, stride_kh, d, m, l, acc,
                               valid[None, :], scale_log2, PAGE, False)
        for n0 in range(diagonal, tl.minimum(chunk, diagonal + BLOCK_M), BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            valid = j < chunk
            visible = valid[None, :] & (j[None, :] <= rows_q[:, None])
            m, l, acc = _block(q, K, V, Table, start + j, valid, kvh, stride_kr, stride_kh, d, m, l, acc, visible,
                               scale_log2, PAGE, True)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(O + part * stride_os + rows_q[:, None] * stride_om + h * stride_oh + d[None, :],
             out.to(O.dtype.element_ty), mask=q_mask[:, None])
    if WRITE_LSE:  # log2 units; -inf where a part saw no key
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(LSE + part * stride_ls + rows_q * stride_lm + h, lse, mask=q_mask)


@triton.jit(do_not_specialize=["start", "chunk", "n_ctx", "split_len", "stride_cs", "stride_os", "stride_ls"])
def _prefill(
    Q, K, V, Table, Context, O, LSE,
    stride_qm, stride_qh, stride_kr, stride_kh, stride_cs, stride_os, stride_om, stride_oh, stride_ls, stride_lm,
    start, chunk, n_ctx, split_len, scale_log2,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, PER_HEAD: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """Program (query block, head, part) of one chunk; the longest causal part first."""
    _chunk_attention(Q, K, V, Table, Context, O, LSE, stride_qm, stride_qh, stride_kr, stride_kh, stride_cs,
                     stride_os, stride_om, stride_oh, stride_ls, stride_lm, start, chunk, n_ctx, split_len,
                     scale_log2, tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1), tl.program_id(2),
                     GROUP, D, BLOCK_M, BLOCK_N, PAGE, HAS_CONTEXT, PER_HEAD, WRITE_LSE)


@triton.jit(do_not_specialize=["blocks", "split_len", "stride_os", "stride_ls"])
def _packed_prefill(
    Q, K, V, Tables, CuQ, UsedK, O, LSE,
    stride_qm, stride_qh, stride_kr, stride_kh, stride_tp, stride_os, stride_om, stride_oh, stride_ls, stride_lm,
    blocks, split_len, scale_log2,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """Program (chunk p and query block, head, part) of several sequences' chunks one after another: chunk p's rows
    [CuQ[p], CuQ[p + 1]) of Q / O, the last of its sequence's UsedK[p] slots, read through Tables[p]; `blocks` query
    blocks a chunk at most (a shorter chunk's extra programs end at once)."""
    p = tl.program_id(0) // blocks
    mb = blocks - 1 - tl.program_id(0) % blocks  # the longest causal part first
    first = tl.load(CuQ + p)
    chunk = tl.load(CuQ + p + 1) - first
    if mb * BLOCK_M < chunk:
        start = tl.load(UsedK + p) - chunk
        _chunk_attention(Q + first.to(tl.int64) * stride_qm, K, V, Tables + p.to(tl.int64) * stride_tp, Tables,
                         O + first.to(tl.int64) * stride_om, LSE + first.to(tl.int64) * stride_lm,
                         stride_qm, stride_qh, stride_kr, stride_kh, 0, stride_os, stride_om, stride_oh, stride_ls,
                         stride_lm, start, chunk, start, split_len, scale_log2, mb, tl.program_id(1),
                         tl.program_id(2), GROUP, D, BLOCK_M, BLOCK_N, PAGE, False, False, WRITE_LSE)


@functools.cache
def major_version(index: int | None) -> int:
    """The compute capability's major number of CUDA device `index` (read once: torch's query, about 20 us, ran at
    every call, 192 of them a packed step of 8 prompt chunks)."""
    return torch.cuda.get_device_capability(index)[0]


def tile_for(dim: int, device: torch.device, sparse: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): the tuned tiles on Hopper-class shared memory, else a small one."""
    if dim <= 128 and device.type == "cuda" and major_version(device.index) >= 9:
        return TILE_SPARSE if sparse else TILE
    return TILE_WIDE


def num_splits(programs: int, n_ctx: int, sms: int, block_n: int) -> int:
    """Parts the context is split into when the query blocks leave SMs idle: as many as keep the programs within two
    per SM (one wave: a partial second wave costs more than it gains), each part at least 64 key blocks long (a
    short context, such as a sparse prefill's, gains less than merging the parts costs)."""
    if programs >= sms:
        return 1
    return max(1, min(2 * sms // programs, n_ctx // (64 * block_n)))


def prefill_attention(q, k_pool, v_pool, table, start, context, scale, lse=False, tile=None, splits=None):
    """q [C, heads, D]; table [max_pages]; context [S, n] logical slots or None (all slots < start). Returns
    out [C, heads, D], and with lse=True also the natural-log log-sum-exp of each query's logits [C, heads] float32.
    tile / splits: override `tile_for` / `num_splits` (tests and benchmarks)."""
    chunk, n_heads, dim = q.shape
    _, page, kv_heads, _ = k_pool.shape
    kf, vf = k_pool.view(-1, kv_heads, dim), v_pool.view(-1, kv_heads, dim)
    block_m, block_n, warps, stages = tile or tile_for(dim, q.device, context is not None)
    n_ctx = start if context is None else context.shape[1]
    m_blocks = triton.cdiv(chunk, block_m)
    if splits is None:
        sms = device_limits(q.device.index)[0] if q.device.type == "cuda" else 1
        splits = num_splits(m_blocks * n_heads, n_ctx, sms, block_n)
    split_len = triton.cdiv(triton.cdiv(max(n_ctx, 1), splits), block_n) * block_n
    splits = max(1, triton.cdiv(n_ctx, split_len))
    out, lse_out = _parts(q, splits, lse)
    ctx_arg = context if context is not None else table
    _prefill[(m_blocks, n_heads, splits)](
        q, kf, vf, table, ctx_arg, out, lse_out,
        q.stride(0), q.stride(1), kf.stride(0), kf.stride(1), ctx_arg.stride(0) if context is not None else 0,
        out.stride(0) if splits > 1 else 0, out.stride(-3), out.stride(-2),
        lse_out.stride(0) if splits > 1 else 0, lse_out.stride(-2),
        start, chunk, n_ctx, split_len, scale * LOG2E,
        GROUP=n_heads // kv_heads, D=dim, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page,
        HAS_CONTEXT=context is not None, PER_HEAD=context is not None and context.shape[0] > 1,
        WRITE_LSE=lse or splits > 1, num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        return _merged(out, lse_out, q.dtype, lse)
    return (out, lse_out * math.log(2)) if lse else out


def _parts(q: torch.Tensor, splits: int, lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and log-sum-exp buffers of a launch over q [rows, heads, D] in `splits` parts: the output in q's
    dtype (and the lse, or a stand-in) for one part; float32 [splits, rows, heads, D] and [splits, rows, heads] for
    several, merged by `_merged`."""
    rows, n_heads, dim = q.shape
    if splits == 1:
        out = torch.empty_like(q)
        return out, torch.empty(rows, n_heads, device=q.device, dtype=torch.float32) if lse else out
    return (torch.empty(splits, rows, n_heads, dim, device=q.device, dtype=torch.float32),
            torch.empty(splits, rows, n_heads, device=q.device, dtype=torch.float32))


def _merged(out: torch.Tensor, lse_out: torch.Tensor, dtype: torch.dtype, lse: bool):
    """Parts [splits, rows, heads, D] -> [rows, heads, D] (and the merged natural log-sum-exp [rows, heads] with
    lse=True) in one kernel (torch's softmax, logsumexp and weighted sum were six launches a layer: a short chunk's
    host time)."""
    splits, rows, n_heads, dim = out.shape
    merged = torch.empty(rows, n_heads, dim, device=out.device, dtype=dtype)
    merged_lse = torch.empty(rows, n_heads, device=out.device, dtype=torch.float32) if lse else merged
    _combine[(rows, n_heads)](out, lse_out, merged, merged_lse, out.stride(1), out.stride(2), out.stride(0),
                              lse_out.stride(1), lse_out.stride(2), lse_out.stride(0), merged.stride(0),
                              merged.stride(1), splits, SPLITS_PAD=triton.next_power_of_2(splits), D=dim, LOG2=True,
                              WRITE_LSE=lse)
    return (merged, merged_lse) if lse else merged


def packed_prefill_attention(q, k_pool, v_pool, tables, cu_q, used_k, longest_q, longest_k, scale, tile=None,
                             splits=None):
    """`fa3.packed_attention`'s contract in one launch: q [T, heads, D] holds the chunks of several sequences
    one after another (chunk i: rows [cu_q[i], cu_q[i + 1]), cu_q [P + 1] int32), each over its own pages (tables
    [P, >= pages], int32 or int64) up to used_k[i] slots, its chunk the last of them (lower-right causal); longest_q /
    longest_k: the longest chunk and context. Returns out [T, heads, D]. One launch a layer instead of one a chunk:
    eight follow-up questions of a step were 192 launches and merges of `prefill_attention`.
    tile / splits: override `tile_for` / `num_splits` (tests)."""
    _, n_heads, dim = q.shape
    _, page, kv_heads, _ = k_pool.shape
    kf, vf = k_pool.view(-1, kv_heads, dim), v_pool.view(-1, kv_heads, dim)
    block_m, block_n, warps, stages = tile or tile_for(dim, q.device, False)
    blocks = triton.cdiv(longest_q, block_m)  # query blocks of the longest chunk
    programs = tables.shape[0] * blocks
    if splits is None:
        sms = device_limits(q.device.index)[0] if q.device.type == "cuda" else 1
        splits = num_splits(programs * n_heads, longest_k, sms, block_n)
    split_len = triton.cdiv(triton.cdiv(max(longest_k, 1), splits), block_n) * block_n
    splits = max(1, triton.cdiv(longest_k, split_len))
    out, lse_out = _parts(q, splits, False)
    _packed_prefill[(programs, n_heads, splits)](
        q, kf, vf, tables, cu_q, used_k, out, lse_out,
        q.stride(0), q.stride(1), kf.stride(0), kf.stride(1), tables.stride(0),
        out.stride(0) if splits > 1 else 0, out.stride(-3), out.stride(-2),
        lse_out.stride(0) if splits > 1 else 0, lse_out.stride(-2),
        blocks, split_len, scale * LOG2E,
        GROUP=n_heads // kv_heads, D=dim, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page, WRITE_LSE=splits > 1,
        num_warps=warps, num_stages=stages,
    )
    return _merged(out, lse_out, q.dtype, False) if splits > 1 else out

