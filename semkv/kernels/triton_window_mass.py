"""The attention mass an observation window gives each key (`reference.window_mass`), without the window's
probability matrix: the scoring of the prefill-eviction methods (SnapKV, PyramidKV, ChunkKV, SentenceKV) and of
CHESS anchor="queries", once a layer at the end of every prompt, a follow-up question's too.

Materialized, the probabilities of a 32-query window over a 32k prompt are [heads, 32, 32k] floats: 59 MB a layer at
Qwen2.5-0.5B's 14 heads, written and read by five torch operations (the scores, the causal mask, the softmax, the
sum): 0.350 ms a layer on an H200 against these kernels' 0.171 (`benchmarks/kernel_check.py --window-only`). Here
two kernels read the keys instead: `_window_lse`, each window query's log-sum-exp over the keys it sees (online
softmax, the keys split between programs; the splits merged in torch), then `_window_mass`, for a block of keys every
window query's probability exp(q . k * scale - lse), summed over the window. GQA by grouping: query head h reads KV
head h // group. What varies with the prompt (its length, the window's, the heads of the layers scored at once,
the splits) is a runtime argument Triton does not specialize on (`do_not_specialize`): one compiled kernel serves
every prompt, so a server compiles none between requests (each variant took 0.2-0.4 s on an H200, paid by the
request that first needed it). Importing this module imports Triton; set TRITON_INTERPRET=1 before importing it to
run the kernels on CPU tensors (slowly) for tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 32  # window queries a tile (tl.dot needs 16 at least)
BLOCK_N = 64  # keys a block
MAX_SPLITS = 16


@triton.jit
def _scores(q_ptr, k_ptr, pos_ptr, qpos_ptr, h, kv, i, j, w, n, scale, heads, DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Head h's scaled scores of window queries i [BLOCK_M] against keys j [BLOCK_N] of KV head kv, -inf where a key
    is in a query's future or either is out of range: [BLOCK_M, BLOCK_N] float32."""
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + (i[:, None] * heads + h) * DIM + d[None, :], mask=(i[:, None] < w) & (d[None, :] < DIM),
                other=0.0)
    k = tl.load(k_ptr + (kv * n + j[:, None]) * DIM + d[None, :], mask=(j[:, None] < n) & (d[None, :] < DIM),
                other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale  # fp32 accumulation
    key_pos = tl.load(pos_ptr + kv * n + j, mask=j < n, other=0)
    query_pos = tl.load(qpos_ptr + i, mask=i < w, other=-1)
    visible = (j[None, :] < n) & (i[:, None] < w) & (key_pos[None, :] <= query_pos[:, None])
    return tl.where(visible, s, float("-inf"))


@triton.jit(do_not_specialize=["w", "n", "per_split", "heads", "splits"])
def _window_lse(q_ptr, k_ptr, pos_ptr, qpos_ptr, m_ptr, l_ptr, w, n, per_split, scale, heads, splits,
                GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Program (head, query tile, split): the running max and sum of exp over its keys, per query."""
    h, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m = tl.full([BLOCK_M], -1e30, tl.float32)  # finite: a query that sees none of these keys keeps l = 0
    total = tl.zeros([BLOCK_M], tl.float32)
    for start in range(split * per_split, tl.minimum((split + 1) * per_split, n), BLOCK_N):
        s = _scores(q_ptr, k_ptr, pos_ptr, qpos_ptr, h, h // GROUP, i, start + tl.arange(0, BLOCK_N), w, n, scale,
                    heads, DIM, BLOCK_D)
        m_new = tl.maximum(m, tl.max(s, 1))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m = m_new
    out = (h * w + i) * splits + split
    tl.store(m_ptr + out, m, mask=i < w)
    tl.store(l_ptr + out, total, mask=i < w)


@triton.jit(do_not_specialize=["w", "n", "heads"])
def _window_mass(q_ptr, k_ptr, pos_ptr, qpos_ptr, lse_ptr, out_ptr, w, n, scale, heads, GROUP: tl.constexpr,
                 DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (head, key block): every window query's probability of each key, summed over the window."""
    h, block = tl.program_id(0), tl.program_id(1)
    j = block * BLOCK_N + tl.arange(0, BLOCK_N)
    mass = tl.zeros([BLOCK_N], tl.float32)
    for first in range(0, w, BLOCK_M):
        i = first + tl.arange(0, BLOCK_M)
        s = _scores(q_ptr, k_ptr, pos_ptr, qpos_ptr, h, h // GROUP, i, j, w, n, scale, heads, DIM, BLOCK_D)
        lse = tl.load(lse_ptr + h * w + i, mask=i < w, other=0.0)
        mass += tl.sum(tl.exp(s - lse[:, None]), 0)  # exp(-inf) = 0 where not visible
    tl.store(out_ptr + h * n + j, mass, mask=j < n)


def window_mass(q_window: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, query_positions: torch.Tensor,
                scale: float) -> torch.Tensor:
    """See `reference.window_mass`: q_window [w, heads, D], keys [kv_heads, n, D], positions [kv_heads, n],
    query_positions [w] -> float32 [heads, n]."""
    w, heads, dim = q_window.shape
    kv_heads, n, _ = keys.shape
    q, k = q_window.contiguous(), keys.contiguous()
    pos, qpos = positions.contiguous(), query_positions.to(positions.dtype).contiguous()
    tiles = triton.cdiv(w, BLOCK_M)
    splits = max(1, min(triton.cdiv(n, BLOCK_N), MAX_SPLITS))
    per_split = triton.cdiv(triton.cdiv(n, splits), BLOCK_N) * BLOCK_N
    m = torch.empty(heads, w, splits, device=q.device, dtype=torch.float32)
    total = torch.empty_like(m)
    shape = dict(GROUP=heads // kv_heads, DIM=dim,
                 BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    _window_lse[(heads, tiles, splits)](q, k, pos, qpos, m, total, w, n, per_split, scale, heads, splits, **shape)
    lse = torch.logsumexp(m + total.log(), dim=-1).contiguous()  # [heads, w]; an empty split adds exp(-inf) = 0
    out = torch.empty(heads, n, device=q.device, dtype=torch.float32)
    _window_mass[(heads, triton.cdiv(n, BLOCK_N))](q, k, pos, qpos, lse, out, w, n, scale, heads, **shape)
    return out
