"""TokenSelect's head soft vote over one layer's heads (Eq. 7) for long candidate lists (a prefill chunk's mean query
over every earlier token): vote[n] = sum over heads of softmax_h(scores[h])[n], in two passes over the scores, and
the sparse prefill's whole selection built on it.

- `soft_vote(scores)`: `_block_stats` gives each program a block of candidates and writes every head's maximum and
  sum of exponentials there; `_normaliser` folds the blocks into each head's log-sum-exp (one program per head);
  `_vote` sums exp(score - lse) over the heads. Torch's softmax over a row of 1M candidates runs one block per head
  (0.43 ms of a 1M-token selection on an H100); these run over the whole device. Same result as the reference's
  `per_set(softmax(scores))` with one vote set.
- `prefill_context(q, ...)`: the chunk's attended slots. `_scores_stats` reads the candidates' keys in place through
  the page table (the paged dot product, `key_dots`) and writes the scores and their block statistics in the same
  pass (no second read of the scores for the statistics); after the vote and torch's top-k, `_context` sorts the k
  picked slots in one program and writes them between the initial slots and the recent ones, which bound them
  below and above (the whole list ascending, no sort of it). Same result as `reference.prefill_context`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from semkv.kernels.triton_paged_dot import key_dots


@triton.jit(do_not_specialize=["n"])
def _block_stats(S, TOP, TOTAL, n, stride_h, HEADS: tl.constexpr, HEADS_P: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    j = b * BLOCK + tl.arange(0, BLOCK)
    h = tl.arange(0, HEADS_P)
    x = tl.load(S + h[:, None] * stride_h + j[None, :], mask=(h < HEADS)[:, None] & (j < n)[None, :],
                other=float("-inf"))
    top = tl.max(x, 1)  # [HEADS_P]
    safe = tl.where(top == float("-inf"), 0.0, top)
    tl.store(TOP + b * HEADS_P + h, top)
    tl.store(TOTAL + b * HEADS_P + h, tl.sum(tl.exp(x - safe[:, None]), 1))


@triton.jit(do_not_specialize=["n"])
def _vote(S, LSE, OUT, n, stride_h, HEADS: tl.constexpr, HEADS_P: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.arange(0, HEADS_P)
    x = tl.load(S + h[:, None] * stride_h + j[None, :], mask=(h < HEADS)[:, None] & (j < n)[None, :],
                other=float("-inf"))
    lse = tl.load(LSE + h)  # +inf for the padding heads: they add nothing
    tl.store(OUT + j, tl.sum(tl.exp(x - lse[:, None]), 0), mask=j < n)


@triton.jit
def _normaliser(TOP, TOTAL, LSE, blocks, HEADS: tl.constexpr, HEADS_P: tl.constexpr, BLOCK: tl.constexpr):
    """One head's log-sum-exp over every block's (max, sum of exponentials); +inf for the padding heads, which then
    add nothing to the vote."""
    h = tl.program_id(0)
    if h >= HEADS:
        tl.store(LSE + h, float("inf"))
        return
    top = tl.full([BLOCK], float("-inf"), tl.float32)  # each lane's running maximum and sum, merged at the end
    total = tl.zeros([BLOCK], tl.float32)
    for b0 in range(0, blocks, BLOCK):
        b = b0 + tl.arange(0, BLOCK)
        x = tl.load(TOP + b * HEADS_P + h, mask=b < blocks, other=float("-inf"))
        y = tl.load(TOTAL + b * HEADS_P + h, mask=b < blocks, other=0.0)
        new_top = tl.maximum(top, x)
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        total = total * tl.exp(top - safe) + y * tl.exp(x - safe)
        top = new_top
    best = tl.max(top, 0)
    safe = tl.where(best == float("-inf"), 0.0, best)
    tl.store(LSE + h, safe + tl.log(tl.sum(total * tl.exp(top - safe), 0)))


def _votes(scores: torch.Tensor, top: torch.Tensor, total: torch.Tensor, block: int) -> torch.Tensor:
    """The vote [1, n] from scores [heads, n] and their block statistics top/total [blocks, heads_p]."""
    heads, n = scores.shape
    heads_p = top.shape[1]
    lse = torch.empty(heads_p, dtype=torch.float32, device=scores.device)
    _normaliser[(heads_p,)](top, total, lse, top.shape[0], HEADS=heads, HEADS_P=heads_p, BLOCK=1024, num_warps=4)
    out = torch.empty(1, n, dtype=torch.float32, device=scores.device)
    _vote[(triton.cdiv(n, block),)](scores, lse, out, n, scores.stride(0), HEADS=heads, HEADS_P=heads_p, BLOCK=block,
                                    num_warps=8)
    return out


def soft_vote(scores: torch.Tensor, block: int = 256) -> torch.Tensor:
    """scores [heads, n] float32 (-inf where not a candidate) -> the vote of every candidate [1, n]."""
    heads, n = scores.shape
    heads_p = triton.next_power_of_2(heads)
    blocks = triton.cdiv(n, block)
    top = torch.empty(blocks, heads_p, dtype=torch.float32, device=scores.device)
    total = torch.empty_like(top)
    _block_stats[(blocks,)](scores, top, total, n, scores.stride(0), HEADS=heads, HEADS_P=heads_p, BLOCK=block,
                            num_warps=8)
    return _votes(scores, top, total, block)


@triton.jit(do_not_specialize=["lo", "n"])
def _scores_stats(Q, K, TABLE, S, TOP, TOTAL, lo, n, PAGE_SIZE: tl.constexpr, KV_HEADS: tl.constexpr,
                  GROUP: tl.constexpr, DIM: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_D: tl.constexpr,
                  HEADS_P: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """One KV group's scores against candidates [lo + block * BLOCK_N, ...) (slots read through the page table) and,
    per head, their maximum and sum of exponentials (`_block_stats`'s layout)."""
    kv_head = tl.program_id(0)
    block = tl.program_id(1)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    in_group = g < GROUP
    q = tl.load(Q + heads[:, None] * DIM + d[None, :], mask=in_group[:, None] & (d[None, :] < DIM), other=0.0)
    t = block * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = t < n
    scores = key_dots(q, K, TABLE, lo + t, valid, kv_head, d, PAGE_SIZE, KV_HEADS, DIM, IEEE)  # [GROUP_P, BLOCK_N]
    tl.store(S + heads[:, None] * n + t[None, :], scores, mask=in_group[:, None] & valid[None, :])
    x = tl.where(valid[None, :], scores, float("-inf"))
    top = tl.max(x, 1)  # [GROUP_P]; every block holds a candidate
    tl.store(TOP + block * HEADS_P + heads, top, mask=in_group)
    tl.store(TOTAL + block * HEADS_P + heads, tl.sum(tl.exp(x - top[:, None]), 1), mask=in_group)


@triton.jit(do_not_specialize=["lo", "k", "sink", "hi", "start"])
def _context(PICKED, OUT, lo, k, sink, hi, start, K_P: tl.constexpr, BLOCK: tl.constexpr):
    """OUT [sink + k + start - hi]: slots [0, sink), the k picked candidates (offsets from lo, in any order) sorted,
    then slots [hi, start)."""
    i = tl.arange(0, K_P)
    picked = tl.load(PICKED + i, mask=i < k, other=2147483647).to(tl.int32)  # the padding sorts last
    tl.store(OUT + sink + i, tl.sort(picked).to(tl.int64) + lo, mask=i < k)
    for a in range(0, sink, BLOCK):
        r = a + tl.arange(0, BLOCK)
        tl.store(OUT + r, r.to(tl.int64), mask=r < sink)
    for a in range(0, start - hi, BLOCK):
        r = a + tl.arange(0, BLOCK)
        tl.store(OUT + sink + k + r, (hi + r).to(tl.int64), mask=r < start - hi)


def prefill_context(q: torch.Tensor, k_pool: torch.Tensor, table: torch.Tensor, sink: int, hi: int, start: int,
                    k: int, block_n: int = 128) -> torch.Tensor:
    """See `reference.prefill_context` (the soft vote over all heads, one GPU): q [heads, D], the candidates
    [sink, hi) -> [1, sink + k + start - hi] ascending int64."""
    heads, dim = q.shape
    _, page_size, kv_heads, _ = k_pool.shape
    n = hi - sink
    heads_p = triton.next_power_of_2(heads)
    blocks = triton.cdiv(n, block_n)
    scores = torch.empty(heads, n, dtype=torch.float32, device=q.device)
    top = torch.empty(blocks, heads_p, dtype=torch.float32, device=q.device)
    total = torch.empty_like(top)
    group = heads // kv_heads
    _scores_stats[(kv_heads, blocks)](
        q.to(k_pool.dtype).contiguous(), k_pool, table, scores, top, total, sink, n, PAGE_SIZE=page_size,
        KV_HEADS=kv_heads, GROUP=group, DIM=dim, GROUP_P=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)), HEADS_P=heads_p, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32)
    picked = _votes(scores, top, total, 256).topk(k, dim=-1, sorted=False).indices  # [1, k], offsets from sink
    out = torch.empty(1, sink + k + start - hi, dtype=torch.int64, device=q.device)
    _context[(1,)](picked, out, sink, k, sink, hi, start, K_P=triton.next_power_of_2(k), BLOCK=1024)
    return out
