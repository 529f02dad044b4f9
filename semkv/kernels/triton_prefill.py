"""Triton prefill attention over the paged cache: a chunk of queries attends to a context (every earlier slot, or an
index list for sparse prefill) plus itself causally, reading K/V through the page table (FlashAttention-style online
softmax, no gathered copy). Same contract as `reference.prefill_attention`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _prefill(
    Q, K, V, Table, Context, O,
    stride_qm, stride_qh, stride_kr, stride_kh, stride_cs, stride_om, stride_oh,
    start, chunk, n_ctx, scale,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, PER_HEAD: tl.constexpr,
):
    mb = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    sel = kvh if PER_HEAD else 0
    rows_q = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # query index inside the chunk
    d = tl.arange(0, D)
    q_mask = rows_q < chunk
    q = tl.load(Q + rows_q[:, None] * stride_qm + h * stride_qh + d[None, :], mask=q_mask[:, None], other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # virtual key index j: [0, n_ctx) context, then [n_ctx, n_ctx + chunk) the chunk itself (causal)
    end = n_ctx + tl.minimum(chunk, (mb + 1) * BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        in_ctx = j < n_ctx
        if HAS_CONTEXT:
            ctx_slot = tl.load(Context + sel * stride_cs + j, mask=in_ctx, other=0)
        else:
            ctx_slot = j
        slot = tl.where(in_ctx, ctx_slot, start + j - n_ctx)
        valid = j < end
        page = tl.load(Table + slot // PAGE, mask=valid, other=0)
        row = page.to(tl.int64) * PAGE + slot % PAGE
        k = tl.load(K + row[:, None] * stride_kr + kvh * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [BLOCK_M, BLOCK_N]
        visible = valid[None, :] & (in_ctx[None, :] | ((j - n_ctx)[None, :] <= rows_q[:, None]))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + row[:, None] * stride_kr + kvh * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(O + rows_q[:, None] * stride_om + h * stride_oh + d[None, :], out.to(O.dtype.element_ty),
             mask=q_mask[:, None])


def prefill_attention(q, k_pool, v_pool, table, start, context, scale, block_m=64, block_n=64):
    """q [C, heads, D]; table [max_pages]; context [S, n] logical slots or None (all slots < start)."""
    chunk, n_heads, dim = q.shape
    _, page, kv_heads, _ = k_pool.shape
    kf, vf = k_pool.view(-1, kv_heads, dim), v_pool.view(-1, kv_heads, dim)
    out = torch.empty_like(q)
    n_ctx = start if context is None else context.shape[1]
    ctx_arg = context if context is not None else table
    _prefill[(triton.cdiv(chunk, block_m), n_heads)](
        q, kf, vf, table, ctx_arg, out,
        q.stride(0), q.stride(1), kf.stride(0), kf.stride(1), ctx_arg.stride(0) if context is not None else 0,
        out.stride(0), out.stride(1),
        start, chunk, n_ctx, scale,
        GROUP=n_heads // kv_heads, D=dim, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page,
        HAS_CONTEXT=context is not None, PER_HEAD=context is not None and context.shape[0] > 1,
    )
    return out
