"""H2O's heavy-hitter scores on the GPU.

- `accumulate_attention` (decode): one pass that normalises each row's attention logits over its resident slots, sums
  them over each KV head's query group and adds them to the per-slot scores stored beside the paged cache, restarting
  at zero the slot that holds the current token. Replaces a float64 softmax and about a dozen small gather /
  element-wise kernels per layer; reads and writes only the `counts[b]` resident slots of each row, so the result does
  not depend on how wide the logits are padded. Torch reference: `reference.accumulate_attention`.
- `prompt_attention_sums` (prefill): the attention every key receives from a chunk of prompt queries, in one pass
  that reads the keys through the page table and never holds the [heads, C, L] probabilities: each query's
  log-sum-exp comes from the prefill attention kernel (`kernels.prefill_attention(lse=True)`), and
  `_prompt_column_sums` gives each program a block of keys of one KV head, recomputes the logits of every query of the
  group that sees them and sums `exp(logit - lse)` into a [queries, keys] tile, reduced over the queries once at the
  end; only the query blocks on the causal diagonal and the chunk's last one compute a mask. Torch reference:
  `reference.prompt_attention_sums`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _accumulate_attention(LOGITS, COUNTS, PAGES, POSITIONS, POS, SCORES, stride_lb, stride_lh, stride_pb,
                          GROUP: tl.constexpr, GROUP_P: tl.constexpr, KV_HEADS: tl.constexpr,
                          PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    first = tl.program_id(2) * CHUNK  # this program updates slots [first, first + CHUNK)
    count = tl.load(COUNTS + b)
    if first >= count:
        return
    g = tl.arange(0, GROUP_P)
    in_group = g < GROUP
    rows = LOGITS + b * stride_lb + (kv_head * GROUP + g)[:, None] * stride_lh  # [GROUP_P, 1]
    # pass 1 (every program of the row, over all its resident slots: they sit in L2): each query head's running max
    # and sum of exponentials
    top = tl.full([GROUP_P], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P], tl.float32)
    for start in range(0, count, BLOCK):
        n = start + tl.arange(0, BLOCK)
        x = tl.load(rows + n[None, :], mask=in_group[:, None] & (n < count)[None, :], other=float("-inf"))
        x = tl.where(in_group[:, None], x, 0.0)  # padding heads stay finite; they are dropped below
        new_top = tl.maximum(top, tl.max(x, 1))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top[:, None]), 1)
        top = new_top
    # pass 2: probabilities summed over the group, added to the stored scores
    now = tl.load(POSITIONS + b)
    for start in range(first, tl.minimum(count, first + CHUNK), BLOCK):
        n = start + tl.arange(0, BLOCK)
        resident = n < count
        x = tl.load(rows + n[None, :], mask=in_group[:, None] & resident[None, :], other=float("-inf"))
        probs = tl.where(in_group[:, None], tl.exp(x - top[:, None]) / total[:, None], 0.0)
        added = tl.sum(probs, 0)  # [BLOCK]
        page = tl.load(PAGES + b * stride_pb + n // PAGE_SIZE, mask=resident, other=0).to(tl.int64)
        cell = (page * PAGE_SIZE + n % PAGE_SIZE) * KV_HEADS + kv_head
        stored_at = tl.load(POS + cell, mask=resident, other=-1)
        old = tl.load(SCORES + cell, mask=resident, other=0.0)
        tl.store(SCORES + cell, tl.where(stored_at == now, 0.0, old) + added, mask=resident)


def accumulate_attention(logits: torch.Tensor, counts: torch.Tensor, pages: torch.Tensor, positions: torch.Tensor,
                         pos_pool: torch.Tensor, scores: torch.Tensor, block: int = 128, chunk: int = 256) -> None:
    """See `reference.accumulate_attention` (same arguments; scores updated in place). Each row's slots are updated
    in chunks of `chunk` by programs of their own (a multiple of `block`)."""
    batch, heads, width = logits.shape
    _, page_size, kv_heads = scores.shape
    group = heads // kv_heads
    logits = logits.contiguous()
    pages = pages.contiguous()
    _accumulate_attention[(batch, kv_heads, triton.cdiv(width, chunk))](
        logits, counts.contiguous(), pages, positions.contiguous(), pos_pool, scores,
        logits.stride(0), logits.stride(1), pages.stride(0),
        GROUP=group, GROUP_P=max(2, triton.next_power_of_2(group)), KV_HEADS=kv_heads, PAGE_SIZE=page_size,
        BLOCK=block, CHUNK=chunk,
    )


@triton.jit
def _paged_keys(K, TABLE, j, valid, kv_head, d, stride_kr, stride_kh, PAGE: tl.constexpr):
    """Keys of logical slots j [BLOCK] (0 where not valid) of one KV head, through the page table: [BLOCK, D]."""
    page = tl.load(TABLE + j // PAGE, mask=valid, other=0).to(tl.int64)
    return tl.load(K + (page * PAGE + j % PAGE)[:, None] * stride_kr + kv_head * stride_kh + d[None, :],
                   mask=valid[:, None], other=0.0)


@triton.jit
def _column_block(Q, LSE, k, j, valid, acc, m0, head, start, chunk, scale_log2, stride_qm, stride_qh, stride_lm,
                  d, MASKED: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] plus the probabilities queries [m0, m0 + BLOCK_M) of `head` give the keys j (by the
    query's log-sum-exp); MASKED: the block holds queries past the chunk or keys after a query (else every query
    sees every key: no mask to compute)."""
    rows = m0 + tl.arange(0, BLOCK_M)
    in_chunk = rows < chunk
    q = tl.load(Q + rows[:, None] * stride_qm + head * stride_qh + d[None, :], mask=in_chunk[:, None], other=0.0)
    lse = tl.load(LSE + rows * stride_lm + head, mask=in_chunk, other=0.0) * 1.4426950408889634
    s = tl.dot(q, tl.trans(k)) * scale_log2 - lse[:, None]  # [BLOCK_M, BLOCK_N], log2 units
    if MASKED:
        seen = in_chunk[:, None] & valid[None, :] & (j[None, :] <= start + rows[:, None])
        return acc + tl.where(seen, tl.exp2(s), 0.0)
    return acc + tl.exp2(s)


@triton.jit
def _prompt_column_sums(Q, K, TABLE, LSE, OUT, stride_qm, stride_qh, stride_kr, stride_kh, stride_lm, start, chunk,
                        scale_log2, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    n_keys = start + chunk
    j = block * BLOCK_N + tl.arange(0, BLOCK_N)  # this program's keys
    valid = j < n_keys
    d = tl.arange(0, D)
    k = _paged_keys(K, TABLE, j, valid, kv_head, d, stride_kr, stride_kh, PAGE)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # summed over the query axis once, at the end
    # query blocks [first, full) hold queries that see only part of these keys (the diagonal); from `full` on every
    # query of a block sees all of them, unmasked up to the last whole block of the chunk
    first = tl.maximum(block * BLOCK_N - start, 0) // BLOCK_M * BLOCK_M
    full = tl.cdiv(tl.maximum(block * BLOCK_N + BLOCK_N - 1 - start, 0), BLOCK_M) * BLOCK_M
    whole = chunk // BLOCK_M * BLOCK_M
    for g in range(GROUP):
        head = kv_head * GROUP + g
        for m0 in range(first, tl.minimum(full, chunk), BLOCK_M):
            acc = _column_block(Q, LSE, k, j, valid, acc, m0, head, start, chunk, scale_log2, stride_qm, stride_qh,
                                stride_lm, d, True, BLOCK_M)
        for m0 in range(full, whole, BLOCK_M):
            acc = _column_block(Q, LSE, k, j, valid, acc, m0, head, start, chunk, scale_log2, stride_qm, stride_qh,
                                stride_lm, d, False, BLOCK_M)
        for m0 in range(tl.maximum(full, whole), chunk, BLOCK_M):  # the chunk's last, partial block
            acc = _column_block(Q, LSE, k, j, valid, acc, m0, head, start, chunk, scale_log2, stride_qm, stride_qh,
                                stride_lm, d, True, BLOCK_M)
    tl.store(OUT + kv_head * n_keys + j, tl.sum(acc, 0), mask=valid)


def prompt_attention_sums(q: torch.Tensor, k_pool: torch.Tensor, table: torch.Tensor, start: int, scale: float,
                          lse: torch.Tensor, block_m: int = 64, block_n: int = 128, num_warps: int = 4,
                          num_stages: int = 3) -> torch.Tensor:
    """See `reference.prompt_attention_sums` (same arguments): float32 [kv_heads, start + C]. The default tile is
    the fastest of 15 on an H100 at two of three prefill shapes of the Llama-3.1-8B shape (438-476 TFLOP/s of q . k
    products, 337-341 with 8 warps; benchmarks/results/2026-11-27-h100-prefill-floor.md)."""
    chunk, n_heads, dim = q.shape
    _, page, kv_heads, _ = k_pool.shape
    k_flat = k_pool.view(-1, kv_heads, dim)
    lse = lse.contiguous()
    out = torch.empty(kv_heads, start + chunk, dtype=torch.float32, device=q.device)
    _prompt_column_sums[(triton.cdiv(start + chunk, block_n), kv_heads)](
        q, k_flat, table, lse, out, q.stride(0), q.stride(1), k_flat.stride(0), k_flat.stride(1), lse.stride(0),
        start, chunk, scale * 1.4426950408889634,
        GROUP=n_heads // kv_heads, D=dim, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page, num_warps=num_warps,
        num_stages=num_stages)
    return out
