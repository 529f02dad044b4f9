"""TokenSelect's decode selection with its Selection Cache in four kernels that capture in a CUDA graph and cost
next to nothing for the sequences whose cache hits.

Same arguments and result as `reference.token_select` (selections "soft_vote" and "top_k"):
1. `_cache_check`: one program per sequence compares the layer's query with the cached one (cosine), decides hit or
   refresh, stores the new query and counts hits and lookups.
2. `_vote_scores`: the paged dot product (`triton_paged_dot.key_dots`) over the candidate slots of the rows to refresh,
   one program per (KV head, split, row) looping over every `splits`-th block of slots (a fixed, small grid, so
   rows that hit cost one early exit per program); it writes the per-head logits and, for the soft vote, each
   block's per-head maximum and sum of exponentials.
3. `_vote`: one program per (row, vote set, split) combines the blocks' statistics into each head's softmax
   normaliser and writes the vote of the candidates in its blocks.
4. `_select`: one program per (row, vote set) finds the k-th largest vote exactly by a radix select over the votes'
   bits (eight passes of four bits), writes the k winners in slot order (ties to the lower slot) into the cache,
   then the step's slots (sinks, top-k, recent) of every row, hit or not.
Importing this module imports Triton; set TRITON_INTERPRET=1 before importing it to run on CPU tensors for tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from semkv.kernels.reference import SelectionCacheBuffers
from semkv.kernels.triton_paged_dot import key_dots


@triton.jit
def _cache_check(q_ptr, n_ptr, rows_ptr, cq_ptr, valid_ptr, counts_ptr, refresh_ptr, layer, stride_n, LAYERS, theta,
                 BUDGET: tl.constexpr, QS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + b).to(tl.int64)
    entry = row * LAYERS + layer
    sparse = tl.load(n_ptr + b * stride_n) > BUDGET
    e = tl.arange(0, BLOCK)
    inside = e < QS
    q = tl.load(q_ptr + b * QS + e, mask=inside, other=0.0).to(tl.float32)
    cached = tl.load(cq_ptr + entry * QS + e, mask=inside, other=0.0)
    norms = tl.sqrt(tl.sum(q * q, 0)) * tl.sqrt(tl.sum(cached * cached, 0))
    similar = tl.sum(q * cached, 0) / tl.maximum(norms, 1e-8) >= theta
    hit = sparse & (tl.load(valid_ptr + entry) != 0) & similar
    refresh = sparse.to(tl.int32) - hit.to(tl.int32) > 0  # sparse and missed, kept boolean for the mask below
    tl.store(refresh_ptr + b, refresh.to(tl.int8))
    tl.store(cq_ptr + entry * QS + e, q, mask=inside & (e * 0 + refresh.to(tl.int32) > 0))  # a boolean vector
    tl.store(valid_ptr + entry, sparse.to(tl.int8))
    tl.store(counts_ptr + row * 2, tl.load(counts_ptr + row * 2) + hit.to(tl.int64))
    tl.store(counts_ptr + row * 2 + 1, tl.load(counts_ptr + row * 2 + 1) + sparse.to(tl.int64))


@triton.jit
def _vote_scores(q_ptr, k_ptr, tables_ptr, n_ptr, refresh_ptr, scores_ptr, bmax_ptr, bsum_ptr, W, NB, stride_tb,
                 stride_n, SINK: tl.constexpr, RECENT: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 KV_HEADS: tl.constexpr, GROUP: tl.constexpr, DIM: tl.constexpr, GROUP_P: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, SOFT: tl.constexpr,
                 IEEE: tl.constexpr):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)  # this program scores blocks split, split + SPLITS, ...
    b = tl.program_id(2).to(tl.int64)
    hi = tl.load(n_ptr + b * stride_n) - RECENT  # candidates are [SINK, hi)
    if tl.load(refresh_ptr + b) != 0:
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + g
        head_row = b * KV_HEADS * GROUP + heads
        q = tl.load(q_ptr + head_row[:, None] * DIM + d[None, :], mask=(g[:, None] < GROUP) & (d[None, :] < DIM),
                    other=0.0)
        for block in range(split, tl.cdiv(hi, BLOCK_N), SPLITS):
            t = block * BLOCK_N + tl.arange(0, BLOCK_N)
            candidate = (t >= SINK) & (t < hi)
            s = key_dots(q, k_ptr, tables_ptr + b * stride_tb, t, candidate, kv_head, d, PAGE_SIZE, KV_HEADS, DIM,
                         IEEE)  # [GROUP_P, BLOCK_N]
            s = tl.where(candidate[None, :], s, float("-inf"))
            tl.store(scores_ptr + head_row[:, None] * W + t[None, :], s,
                     mask=(g[:, None] < GROUP) & (t < hi)[None, :])
            if SOFT:
                top = tl.max(s, 1)
                shift = tl.where(top == float("-inf"), 0.0, top)
                tl.store(bmax_ptr + head_row * NB + block, top, mask=g < GROUP)
                tl.store(bsum_ptr + head_row * NB + block, tl.sum(tl.exp(s - shift[:, None]), 1), mask=g < GROUP)


@triton.jit
def _ordered_key(vote):
    """float32 -> int64 in [0, 2**32) with the same order (sign bit flipped for positives, all bits for negatives)."""
    bits = vote.to(tl.int32, bitcast=True)
    flipped = bits ^ ((bits >> 31) | -2147483648)
    return flipped.to(tl.uint32, bitcast=True).to(tl.int64)


@triton.jit
def _vote(scores_ptr, bmax_ptr, bsum_ptr, n_ptr, refresh_ptr, vote_ptr, W, NB, stride_n, HEADS: tl.constexpr,
          PER_SET: tl.constexpr, HP: tl.constexpr, SETS: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_V: tl.constexpr, SPLITS: tl.constexpr,
          SOFT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    split = tl.program_id(2)  # this program votes on blocks split, split + SPLITS, ...
    hi = tl.load(n_ptr + b * stride_n) - RECENT
    if tl.load(refresh_ptr + b) != 0:
        h = tl.arange(0, HP)
        heads = b * HEADS + s * PER_SET + h  # rows of this vote set's heads in scores
        in_set = h < PER_SET
        if SOFT:  # each head's softmax normaliser from the blocks' maxima and sums
            nb = tl.cdiv(hi, BLOCK_N)
            peak = tl.full([HP], float("-inf"), tl.float32)
            for j0 in range(0, nb, BLOCK_J):
                j = j0 + tl.arange(0, BLOCK_J)
                m = tl.load(bmax_ptr + heads[:, None] * NB + j[None, :], mask=in_set[:, None] & (j < nb)[None, :],
                            other=float("-inf"))
                peak = tl.maximum(peak, tl.max(m, 1))
            peak = tl.where(in_set, peak, 0.0)
            total = tl.zeros([HP], tl.float32)
            for j0 in range(0, nb, BLOCK_J):
                j = j0 + tl.arange(0, BLOCK_J)
                ok = in_set[:, None] & (j < nb)[None, :]
                m = tl.load(bmax_ptr + heads[:, None] * NB + j[None, :], mask=ok, other=float("-inf"))
                z = tl.load(bsum_ptr + heads[:, None] * NB + j[None, :], mask=ok, other=0.0)
                total += tl.sum(tl.where(ok, z * tl.exp(m - peak[:, None]), 0.0), 1)
            scale = tl.where(in_set, 1.0 / total, 0.0)
        for block in range(split, tl.cdiv(hi, BLOCK_V), SPLITS):
            t = block * BLOCK_V + tl.arange(0, BLOCK_V)
            candidate = (t >= SINK) & (t < hi)
            inside = in_set[:, None] & candidate[None, :]
            logits = tl.load(scores_ptr + heads[:, None] * W + t[None, :], mask=inside, other=float("-inf"))
            if SOFT:
                vote = tl.sum(tl.exp(logits - peak[:, None]) * scale[:, None], 0)
            else:
                vote = tl.sum(tl.where(inside, logits, 0.0), 0)
            tl.store(vote_ptr + (b * SETS + s) * W + t, vote, mask=candidate)


@triton.jit
def _select(vote_ptr, n_ptr, rows_ptr, refresh_ptr, top_ptr, out_ptr, W, stride_n, layer, LAYERS,
            SETS: tl.constexpr, SINK: tl.constexpr, K: tl.constexpr, RECENT: tl.constexpr, BLOCK_T: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    budget = SINK + K + RECENT
    n = tl.load(n_ptr + b * stride_n)
    out_row = out_ptr + (b * SETS + s) * budget
    if n <= budget:  # every stored slot; the caller's lengths cut the list at n
        for t0 in range(0, budget, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tl.store(out_row + t, t.to(tl.int64), mask=t < budget)
    else:
        hi = n - RECENT
        top_row = top_ptr + ((tl.load(rows_ptr + b).to(tl.int64) * LAYERS + layer) * SETS + s) * K
        start = (SINK // BLOCK_T) * BLOCK_T
        if tl.load(refresh_ptr + b) != 0:
            vote_row = vote_ptr + (b * SETS + s) * W
            # radix select: the k-th largest key, four bits a pass from the top; `need` counts how many of the
            # keys equal to the prefix so far still belong to the top k
            digits = tl.arange(0, 32)  # 16 digits; keys off the prefix go to bin 16, never counted
            prefix = tl.full([], 0, tl.int64)
            need = tl.full([], K, tl.int32)
            for p in tl.static_range(8):
                counts = tl.zeros([32], tl.int32)
                for t0 in range(start, hi, BLOCK_T):
                    t = t0 + tl.arange(0, BLOCK_T)
                    candidate = (t >= SINK) & (t < hi)
                    key = _ordered_key(tl.load(vote_row + t, mask=candidate, other=0.0))
                    match = candidate & ((key >> (32 - 4 * p)) == prefix)
                    digit = tl.where(match, (key >> (28 - 4 * p)) & 15, 16).to(tl.int32)
                    counts += tl.histogram(digit, 32)
                counts = tl.where(digits < 16, counts, 0)
                above = tl.sum(counts, 0) - tl.cumsum(counts, 0)  # keys with a larger digit
                pick = (above < need) & (above + counts >= need)
                chosen = tl.max(tl.where(pick, digits, -1), 0)
                need -= tl.sum(tl.where(digits == chosen, above, 0), 0)
                prefix = prefix * 16 + chosen
            written = tl.full([], 0, tl.int32)
            equal_seen = tl.full([], 0, tl.int32)
            for t0 in range(start, hi, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                candidate = (t >= SINK) & (t < hi)
                key = tl.where(candidate, _ordered_key(tl.load(vote_row + t, mask=candidate, other=0.0)), -1)
                equal = (key == prefix).to(tl.int32)
                take = (key > prefix) | ((equal != 0) & (equal_seen + tl.cumsum(equal, 0) <= need))
                at = written + tl.cumsum(take.to(tl.int32), 0) - 1
                tl.store(top_row + at, t.to(tl.int64), mask=take)
                tl.store(out_row + SINK + at, t.to(tl.int64), mask=take)
                written += tl.sum(take.to(tl.int32), 0)
                equal_seen += tl.sum(equal, 0)
        else:
            for i0 in range(0, K, BLOCK_T):
                i = i0 + tl.arange(0, BLOCK_T)
                tl.store(out_row + SINK + i, tl.load(top_row + i, mask=i < K, other=0), mask=i < K)
        for i0 in range(0, SINK, BLOCK_T):
            i = i0 + tl.arange(0, BLOCK_T)
            tl.store(out_row + i, i.to(tl.int64), mask=i < SINK)
        for i0 in range(0, RECENT, BLOCK_T):
            i = i0 + tl.arange(0, BLOCK_T)
            tl.store(out_row + SINK + K + i, (hi + i).to(tl.int64), mask=i < RECENT)


def token_select(q: torch.Tensor, k_pool: torch.Tensor, tables: torch.Tensor, num_slots: torch.Tensor, width: int,
                 rows: torch.Tensor, cache: SelectionCacheBuffers, layer: int, n_sink: int, n_recent: int,
                 theta: float, selection: str, kv_heads: int | None, block_n: int = 64, block_t: int = 2048,
                 num_warps: int = 16, splits: int = 32) -> torch.Tensor:
    """See `reference.token_select` (selection "soft_vote" or "top_k"). k_pool [pages, page_size, kv_heads, D]
    contiguous; tables and num_slots may be strided views (one layer of the step's tensors)."""
    batch, n_heads, dim = q.shape
    _, page_size, pool_kv_heads, _ = k_pool.shape
    sets, k = cache.top.shape[2], cache.top.shape[3]
    budget = n_sink + k + n_recent
    layers = cache.q.shape[1]
    q = q.contiguous()
    rows = rows.contiguous()
    refresh = torch.empty(batch, dtype=torch.int8, device=q.device)
    _cache_check[(batch,)](q, num_slots, rows, cache.q, cache.valid, cache.counts, refresh, layer,
                           num_slots.stride(0), layers, theta, BUDGET=budget, QS=n_heads * dim,
                           BLOCK=triton.next_power_of_2(n_heads * dim))
    blocks = triton.cdiv(width, block_n)
    scores = torch.empty(batch, n_heads, width, dtype=torch.float32, device=q.device)  # [B, heads, width]
    block_max = torch.empty(batch, n_heads, blocks, dtype=torch.float32, device=q.device)
    block_sum = torch.empty_like(block_max)
    group = n_heads // pool_kv_heads
    soft = selection == "soft_vote"
    _vote_scores[(pool_kv_heads, min(splits, blocks), batch)](
        q.to(k_pool.dtype), k_pool, tables, num_slots, refresh, scores, block_max, block_sum, width, blocks,
        tables.stride(0), num_slots.stride(0), SINK=n_sink, RECENT=n_recent, PAGE_SIZE=page_size,
        KV_HEADS=pool_kv_heads, GROUP=group, DIM=dim, GROUP_P=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=block_n, SPLITS=min(splits, blocks), SOFT=soft,
        IEEE=q.dtype == torch.float32)
    votes = torch.empty(batch, sets, width, dtype=torch.float32, device=q.device)  # [B, S, width]
    out = torch.empty(batch, sets, budget, dtype=torch.long, device=q.device)  # [B, S, budget]
    per_set = n_heads // sets
    hp = triton.next_power_of_2(per_set)
    block_v = max(4096 // hp, 16)
    vote_splits = min(splits, triton.cdiv(width, block_v))
    _vote[(batch, sets, vote_splits)](
        scores, block_max, block_sum, num_slots, refresh, votes, width, blocks, num_slots.stride(0), HEADS=n_heads,
        PER_SET=per_set, HP=hp, SETS=sets, SINK=n_sink, RECENT=n_recent, BLOCK_N=block_n, BLOCK_J=64,
        BLOCK_V=block_v, SPLITS=vote_splits, SOFT=soft)
    _select[(batch, sets)](votes, num_slots, rows, refresh, cache.top, out, width, num_slots.stride(0), layer, layers,
                           SETS=sets, SINK=n_sink, K=k, RECENT=n_recent, BLOCK_T=block_t, num_warps=num_warps)
    return out
