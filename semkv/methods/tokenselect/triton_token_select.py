"""TokenSelect's decode selection with its Selection Cache in kernels over fixed grids that capture in a CUDA graph
and cost next to nothing for the sequences whose cache hits.

Same arguments and result as `reference.token_select` (selections "soft_vote" and "top_k"):
1. `_cache_check`: one program per sequence compares the layer's query with the cached one (cosine), decides hit or
   refresh, stores the new query, counts hits and lookups and clears the row's radix histograms.
2. `_vote_scores`: the paged dot product (`triton_paged_dot.key_dots`) over the candidate slots of the rows to refresh,
   one program per (KV head, split, row) looping over every `splits`-th block of slots (a fixed, small grid, so
   rows that hit cost one early exit per program); it writes the per-head logits and, for the soft vote, the
   split's per-head maximum and sum of exponentials (online, as in flash attention).
3. `_vote`: one program per (row, vote set, split) combines the splits' statistics into each head's softmax
   normaliser, writes the vote of the candidates in its blocks and adds their top bytes to the row's first radix
   histogram.
4. `_radix_pass` (three launches): the exact k-th largest vote by a radix select over the votes' bits, a byte a pass,
   one program per (row, vote set, chunk of slots): each program derives the prefix chosen so far from the row's
   earlier histograms and adds the next byte of its matching votes to the next one. The last pass also keeps each
   chunk's own counts, from which every chunk knows where its winners go.
5. `_select`: one program per (row, vote set, chunk) writes its chunk's winners in slot order (ties to the lower
   slot) into the cache and the step's slots, and its share of the sinks, the cached top-k of rows that hit and the
   recent slots.
With `pages` (score_keys="pages") the tables are those of a row's chosen pages (`kernels.page_candidates`): kernels
2-5 read the candidates as the span of compact slots of those pages, and `_select` writes the slot each winner
stands for.
The integers that change from step to step and only enter scalar arithmetic (strides, the layer, the chunk count,
the cache's and the output's widths; each row's split is read from a tensor) are not specialised; the width keeps
Triton's divisibility specialisation for vector loads, so eager steps of any width compile at most two variants of a
kernel. Importing this module imports Triton; set TRITON_INTERPRET=1 before importing it to run on CPU tensors for
tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from semkv.methods.tokenselect.reference import SelectionCacheBuffers
from semkv.kernels.triton_decode import device_limits
from semkv.kernels.triton_page_select import ordered_key
from semkv.kernels.triton_paged_dot import key_dots, sketch_dots

RADIX_BITS = 8  # a byte a pass: four passes over the 32-bit ordered votes
RADIX_BINS = 1 << RADIX_BITS
RADIX_PASSES = 32 // RADIX_BITS


@triton.jit(do_not_specialize=["layer", "stride_n"])
def _cache_check(q_ptr, n_ptr, parts_ptr, rows_ptr, cq_ptr, valid_ptr, counts_ptr, refresh_ptr, hist_ptr, layer,
                 stride_n, LAYERS, theta, QS: tl.constexpr, BLOCK: tl.constexpr, HIST: tl.constexpr,
                 HIST_P: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + b).to(tl.int64)
    entry = row * LAYERS + layer
    budget = (tl.load(parts_ptr + b * 3) + tl.load(parts_ptr + b * 3 + 1) + tl.load(parts_ptr + b * 3 + 2)).to(tl.int32)
    sparse = tl.load(n_ptr + b * stride_n) > budget
    e = tl.arange(0, BLOCK)
    inside = e < QS
    q = tl.load(q_ptr + b * QS + e, mask=inside, other=0.0).to(tl.float32)
    cached = tl.load(cq_ptr + entry * QS + e, mask=inside, other=0.0)
    norms = tl.sqrt(tl.sum(q * q, 0)) * tl.sqrt(tl.sum(cached * cached, 0))
    similar = tl.sum(q * cached, 0) / tl.maximum(norms, 1e-8) >= theta
    hit = sparse & (tl.load(valid_ptr + entry) == budget) & similar
    refresh = sparse.to(tl.int32) - hit.to(tl.int32) > 0  # sparse and missed, kept boolean for the mask below
    tl.store(refresh_ptr + b, refresh.to(tl.int8))
    tl.store(cq_ptr + entry * QS + e, q, mask=inside & (e * 0 + refresh.to(tl.int32) > 0))  # a boolean vector
    tl.store(valid_ptr + entry, tl.where(sparse, budget, 0))
    tl.store(counts_ptr + row * 2, tl.load(counts_ptr + row * 2) + hit.to(tl.int64))
    tl.store(counts_ptr + row * 2 + 1, tl.load(counts_ptr + row * 2 + 1) + sparse.to(tl.int64))
    h = tl.arange(0, HIST_P)
    tl.store(hist_ptr + b * HIST + h, tl.zeros([HIST_P], tl.int32), mask=h < HIST)


@triton.jit(do_not_specialize=["stride_tb", "stride_n"])
def _vote_scores(q_ptr, k_pool_ptr, scale_ptr, tables_ptr, n_ptr, parts_ptr, span_ptr, refresh_ptr, scores_ptr,
                 smax_ptr, ssum_ptr, W, stride_tb, stride_n, PAGE_SIZE: tl.constexpr,
                 KV_HEADS: tl.constexpr, GROUP: tl.constexpr, DIM: tl.constexpr, GROUP_P: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, SOFT: tl.constexpr,
                 IEEE: tl.constexpr, SKETCH: tl.constexpr, COMPACT: tl.constexpr):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)  # this program scores blocks split, split + SPLITS, ...
    b = tl.program_id(2).to(tl.int64)
    sink, hi = _candidates(n_ptr, parts_ptr, span_ptr, b, stride_n, COMPACT)  # candidates are [sink, hi)
    if tl.load(refresh_ptr + b) != 0:
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + g
        head_row = b * KV_HEADS * GROUP + heads
        q = tl.load(q_ptr + head_row[:, None] * DIM + d[None, :], mask=(g[:, None] < GROUP) & (d[None, :] < DIM),
                    other=0.0)
        peak = tl.full([GROUP_P], float("-inf"), tl.float32)  # the split's running maximum and sum of exp(s - peak)
        total = tl.zeros([GROUP_P], tl.float32)
        for block in range(split, tl.cdiv(hi, BLOCK_N), SPLITS):
            t = block * BLOCK_N + tl.arange(0, BLOCK_N)
            candidate = (t >= sink) & (t < hi)
            if SKETCH:  # int8 keys and their scales
                s = sketch_dots(q, k_pool_ptr, scale_ptr, tables_ptr + b * stride_tb, t, candidate, kv_head, d,
                                PAGE_SIZE, KV_HEADS, DIM, IEEE)
            else:
                s = key_dots(q, k_pool_ptr, tables_ptr + b * stride_tb, t, candidate, kv_head, d, PAGE_SIZE,
                             KV_HEADS, DIM, IEEE)  # [GROUP_P, BLOCK_N]
            s = tl.where(candidate[None, :], s, float("-inf"))
            tl.store(scores_ptr + head_row[:, None] * W + t[None, :], s,
                     mask=(g[:, None] < GROUP) & (t < hi)[None, :])
            if SOFT:
                new_peak = tl.maximum(peak, tl.max(s, 1))
                shift = tl.where(new_peak == float("-inf"), 0.0, new_peak)
                total = total * tl.exp(peak - shift) + tl.sum(tl.exp(s - shift[:, None]), 1)
                peak = new_peak
        if SOFT:
            tl.store(smax_ptr + head_row * SPLITS + split, peak, mask=g < GROUP)
            tl.store(ssum_ptr + head_row * SPLITS + split, total, mask=g < GROUP)


@triton.jit
def _candidates(n_ptr, parts_ptr, span_ptr, b, stride_n, COMPACT: tl.constexpr):
    """The row's candidate slots [lo, hi): [initial, num_slots - recent), or with COMPACT the span of the compact
    slots of its chosen pages (`kernels.page_candidates`)."""
    if COMPACT:
        lo = tl.load(span_ptr + b * 2)
        hi = tl.load(span_ptr + b * 2 + 1)
    else:
        lo = tl.load(parts_ptr + b * 3)
        hi = tl.load(n_ptr + b * stride_n) - tl.load(parts_ptr + b * 3 + 2)
    return lo, hi


@triton.jit
def _radix_prefix(hist_row, k, PASSES: tl.constexpr, BITS: tl.constexpr):
    """The top PASSES * BITS bits of the k-th largest key (k >= 1), from the row's first PASSES histograms, and how
    many of the keys with exactly that prefix still belong to the top k."""
    bins = tl.arange(0, 1 << BITS)
    prefix = tl.full([], 0, tl.int64)
    need = k.to(tl.int32)
    for p in tl.static_range(PASSES):
        counts = tl.load(hist_row + p * (1 << BITS) + bins)
        above = tl.sum(counts, 0) - tl.cumsum(counts, 0)  # keys on the prefix with a larger digit
        pick = (above < need) & (above + counts >= need)
        chosen = tl.max(tl.where(pick, bins, -1), 0)
        need -= tl.sum(tl.where(bins == chosen, above, 0), 0)
        prefix = (prefix << BITS) + chosen
    return prefix, need


@triton.jit(do_not_specialize=["stride_n"])
def _vote(scores_ptr, smax_ptr, ssum_ptr, n_ptr, parts_ptr, span_ptr, refresh_ptr, vote_ptr, hist_ptr, W, stride_n,
          HEADS: tl.constexpr, PER_SET: tl.constexpr, HP: tl.constexpr, SETS: tl.constexpr,
          SCORE_SPLITS: tl.constexpr, SCORE_SPLITS_P: tl.constexpr, BLOCK_V: tl.constexpr, SPLITS: tl.constexpr,
          SOFT: tl.constexpr, BITS: tl.constexpr, PASSES: tl.constexpr, COMPACT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    split = tl.program_id(2)  # this program votes on blocks split, split + SPLITS, ...
    sink, hi = _candidates(n_ptr, parts_ptr, span_ptr, b, stride_n, COMPACT)
    if tl.load(refresh_ptr + b) != 0:
        h = tl.arange(0, HP)
        heads = b * HEADS + s * PER_SET + h  # rows of this vote set's heads in scores
        in_set = h < PER_SET
        if SOFT:  # each head's softmax normaliser from the scoring splits' maxima and sums
            j = tl.arange(0, SCORE_SPLITS_P)
            ok = in_set[:, None] & (j < SCORE_SPLITS)[None, :]
            m = tl.load(smax_ptr + heads[:, None] * SCORE_SPLITS + j[None, :], mask=ok, other=float("-inf"))
            z = tl.load(ssum_ptr + heads[:, None] * SCORE_SPLITS + j[None, :], mask=ok, other=0.0)
            peak = tl.where(in_set, tl.max(m, 1), 0.0)
            total = tl.sum(tl.where(m == float("-inf"), 0.0, z * tl.exp(m - peak[:, None])), 1)
            scale = tl.where(in_set, 1.0 / total, 0.0)
        bins = tl.arange(0, 1 << BITS)
        counts = tl.zeros([1 << BITS], tl.int32)  # top bytes of this program's candidate votes
        for block in range(split, tl.cdiv(hi, BLOCK_V), SPLITS):
            t = block * BLOCK_V + tl.arange(0, BLOCK_V)
            candidate = (t >= sink) & (t < hi)
            inside = in_set[:, None] & candidate[None, :]
            logits = tl.load(scores_ptr + heads[:, None] * W + t[None, :], mask=inside, other=float("-inf"))
            if SOFT:
                vote = tl.sum(tl.exp(logits - peak[:, None]) * scale[:, None], 0)
            else:
                vote = tl.sum(tl.where(inside, logits, 0.0), 0)
            tl.store(vote_ptr + (b * SETS + s) * W + t, vote, mask=candidate)
            digit = (ordered_key(vote) >> (32 - BITS)).to(tl.int32)
            counts += tl.histogram(digit, 1 << BITS, mask=candidate)
        tl.atomic_add(hist_ptr + (b * SETS + s) * PASSES * (1 << BITS) + bins, counts, mask=counts != 0)


@triton.jit(do_not_specialize=["stride_n", "CHUNKS"])
def _radix_pass(vote_ptr, n_ptr, parts_ptr, span_ptr, refresh_ptr, hist_ptr, chunk_hist_ptr, chunk_above_ptr, W,
                stride_n, CHUNKS, SETS: tl.constexpr, BLOCK_T: tl.constexpr,
                BITS: tl.constexpr, PASSES: tl.constexpr, PASS: tl.constexpr, COMPACT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    c = tl.program_id(2)
    sink, hi = _candidates(n_ptr, parts_ptr, span_ptr, b, stride_n, COMPACT)
    k = tl.load(parts_ptr + b * 3 + 1)
    if (tl.load(refresh_ptr + b) != 0) & (k > 0):
        row = b * SETS + s
        hist_row = hist_ptr + row * PASSES * (1 << BITS)
        prefix, need = _radix_prefix(hist_row, k, PASS, BITS)
        t = c * BLOCK_T + tl.arange(0, BLOCK_T)
        candidate = (t >= sink) & (t < hi)
        key = ordered_key(tl.load(vote_ptr + row * W + t, mask=candidate, other=0.0))
        match = candidate & ((key >> (32 - PASS * BITS)) == prefix)
        digit = ((key >> (32 - (PASS + 1) * BITS)) & ((1 << BITS) - 1)).to(tl.int32)
        counts = tl.histogram(digit, 1 << BITS, mask=match)
        bins = tl.arange(0, 1 << BITS)
        tl.atomic_add(hist_row + PASS * (1 << BITS) + bins, counts, mask=counts != 0)
        if PASS == PASSES - 1:  # the chunk's own counts: keys above the prefix, and on it by last digit
            above = tl.sum((candidate & ((key >> BITS) > prefix)).to(tl.int32), 0)
            tl.store(chunk_above_ptr + row * CHUNKS + c, above)
            tl.store(chunk_hist_ptr + (row * CHUNKS + c) * (1 << BITS) + bins, counts)


@triton.jit(do_not_specialize=["stride_n", "layer", "CHUNKS", "K_MAX", "OUT_W"])
def _select(vote_ptr, n_ptr, parts_ptr, span_ptr, map_ptr, rows_ptr, refresh_ptr, hist_ptr, chunk_hist_ptr,
            chunk_above_ptr, top_ptr, out_ptr, W, stride_n, layer, LAYERS, CHUNKS, K_MAX, OUT_W, SETS: tl.constexpr,
            BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BITS: tl.constexpr, PASSES: tl.constexpr,
            PAGE_SIZE: tl.constexpr, COMPACT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    c = tl.program_id(2)
    sink = tl.load(parts_ptr + b * 3)
    k = tl.load(parts_ptr + b * 3 + 1)
    recent = tl.load(parts_ptr + b * 3 + 2)
    n = tl.load(n_ptr + b * stride_n)
    row = b * SETS + s
    out_row = out_ptr + row * OUT_W
    i = c * BLOCK_T + tl.arange(0, BLOCK_T)  # this program's slots and its positions in the output's parts
    if n <= sink + k + recent:  # every stored slot; the caller's lengths cut the list at n
        tl.store(out_row + i, i.to(tl.int64), mask=i < OUT_W)
    else:
        hi = n - recent
        top_row = top_ptr + ((tl.load(rows_ptr + b).to(tl.int64) * LAYERS + layer) * SETS + s) * K_MAX
        if (tl.load(refresh_ptr + b) != 0) & (k > 0):
            prefix, need = _radix_prefix(hist_ptr + row * PASSES * (1 << BITS), k, PASSES, BITS)
            # where this chunk's winners start: the winners of the chunks before it (BLOCK_C at a time), the keys
            # equal to the k-th largest going to the lowest slots
            bins = tl.arange(0, 1 << BITS)
            last = prefix & ((1 << BITS) - 1)
            written = tl.full([], 0, tl.int32)
            equal_seen = tl.full([], 0, tl.int32)
            for c0 in range(0, c, BLOCK_C):
                chunks = c0 + tl.arange(0, BLOCK_C)
                before = chunks < c
                per_digit = tl.load(chunk_hist_ptr + (row * CHUNKS + chunks[:, None]) * (1 << BITS) + bins[None, :],
                                    mask=before[:, None], other=0)  # [BLOCK_C, bins]
                above = tl.load(chunk_above_ptr + row * CHUNKS + chunks, mask=before, other=0) + \
                    tl.sum(tl.where(bins[None, :] > last, per_digit, 0), 1)
                equal = tl.sum(tl.where(bins[None, :] == last, per_digit, 0), 1)
                equal_before = equal_seen + tl.cumsum(equal, 0) - equal
                written += tl.sum(above + tl.minimum(tl.maximum(need - equal_before, 0), equal), 0)
                equal_seen += tl.sum(equal, 0)
            lo, end = _candidates(n_ptr, parts_ptr, span_ptr, b, stride_n, COMPACT)
            candidate = (i >= lo) & (i < end)
            key = tl.where(candidate, ordered_key(tl.load(vote_ptr + row * W + i, mask=candidate, other=0.0)), -1)
            is_equal = (key == prefix).to(tl.int32)
            take = (key > prefix) | ((is_equal != 0) & (equal_seen + tl.cumsum(is_equal, 0) <= need))
            at = written + tl.cumsum(take.to(tl.int32), 0) - 1
            slot = i.to(tl.int64)
            if COMPACT:  # the slot a compact slot stands for
                page = tl.load(map_ptr + b * (W // PAGE_SIZE) + i // PAGE_SIZE, mask=take, other=0)
                slot = page * PAGE_SIZE + i % PAGE_SIZE
            tl.store(top_row + at, slot, mask=take)
            tl.store(out_row + sink + at, slot, mask=take)
        else:
            tl.store(out_row + sink + i, tl.load(top_row + i, mask=i < k, other=0), mask=i < k)
        tl.store(out_row + i, i.to(tl.int64), mask=i < sink)
        tl.store(out_row + sink + k + i, (hi + i).to(tl.int64), mask=i < recent)


def token_select(q: torch.Tensor, k_pool: torch.Tensor, tables: torch.Tensor, num_slots: torch.Tensor, width: int,
                 rows: torch.Tensor, cache: SelectionCacheBuffers, layer: int, parts: torch.Tensor, out_width: int,
                 theta: float, selection: str, kv_heads: int | None, block_n: int = 128, block_t: int = 2048,
                 num_warps: int = 8, splits: int = 32, vote_splits: int = 128, block_c: int = 32,
                 score_warps: int = 4, score_stages: int = 2, scales: torch.Tensor | None = None,
                 pages: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """See `reference.token_select` (selection "soft_vote" or "top_k"). k_pool [pages, page_size, kv_heads, D]
    contiguous; tables and num_slots may be strided views (one layer of the step's tensors). block_t: slots per
    program of the radix passes and the output; splits, vote_splits: programs per row and KV head of the scoring
    kernel, per row and vote set of the vote kernel; block_c: earlier chunks an output program reads at a time.
    block_n, score_warps, score_stages: the scoring kernel's keys per block, warps and pipeline stages (stages cut to
    the device's shared memory), from `benchmarks/decode_kernel_sweep.py` on an H200: 1.46x -> 1.1x its byte floor
    at Qwen2.5-0.5B's shape, 1.05x -> 0.98x at Llama-3.1-8B's. scales: k_pool is an int8 key sketch with these
    scales (`reference.token_select`). pages: (pages [B, count] int64, span [B, 2]) of `kernels.page_candidates`,
    tables those pages' physical ids and width count * page_size (`reference.token_select`)."""
    batch, n_heads, dim = q.shape
    _, page_size, pool_kv_heads, _ = k_pool.shape
    sets, k_max = cache.top.shape[2], cache.top.shape[3]
    parts = parts.contiguous()
    layers = cache.q.shape[1]
    q = q.contiguous()
    rows = rows.contiguous()
    device = q.device
    compact = pages is not None
    page_map, span = (pages[0].contiguous(), pages[1].contiguous()) if compact else (parts, parts)
    refresh = torch.empty(batch, dtype=torch.int8, device=device)
    hist = torch.empty(batch, sets, RADIX_PASSES, RADIX_BINS, dtype=torch.int32, device=device)  # cleared by the check
    hist_size = sets * RADIX_PASSES * RADIX_BINS
    _cache_check[(batch,)](q, num_slots, parts, rows, cache.q, cache.valid, cache.counts, refresh, hist, layer,
                           num_slots.stride(0), layers, theta, QS=n_heads * dim,
                           BLOCK=triton.next_power_of_2(n_heads * dim), HIST=hist_size,
                           HIST_P=triton.next_power_of_2(hist_size))
    score_splits = min(splits, triton.cdiv(width, block_n))
    scores = torch.empty(batch, n_heads, width, dtype=torch.float32, device=device)  # [B, heads, width]
    split_max = torch.empty(batch, n_heads, score_splits, dtype=torch.float32, device=device)
    split_sum = torch.empty_like(split_max)
    group = n_heads // pool_kv_heads
    soft = selection == "soft_vote"
    if device.type == "cuda":
        score_stages = max(1, min(score_stages, device_limits(device.index or 0)[1] //
                                  (block_n * triton.next_power_of_2(dim) * k_pool.element_size())))
    _vote_scores[(pool_kv_heads, score_splits, batch)](
        q if scales is not None else q.to(k_pool.dtype), k_pool, k_pool if scales is None else scales,
        tables, num_slots, parts, span, refresh, scores, split_max, split_sum, width,
        tables.stride(0), num_slots.stride(0), PAGE_SIZE=page_size,
        KV_HEADS=pool_kv_heads, GROUP=group, DIM=dim, GROUP_P=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=block_n, SPLITS=score_splits, SOFT=soft,
        IEEE=q.dtype == torch.float32, SKETCH=scales is not None, COMPACT=compact, num_warps=score_warps,
        num_stages=score_stages)
    votes = torch.empty(batch, sets, width, dtype=torch.float32, device=device)  # [B, S, width]
    per_set = n_heads // sets
    hp = triton.next_power_of_2(per_set)
    block_v = max(4096 // hp, 16)
    vote_splits = min(vote_splits, triton.cdiv(width, block_v))
    radix = dict(BITS=RADIX_BITS, PASSES=RADIX_PASSES)
    _vote[(batch, sets, vote_splits)](
        scores, split_max, split_sum, num_slots, parts, span, refresh, votes, hist, width, num_slots.stride(0),
        HEADS=n_heads, PER_SET=per_set, HP=hp, SETS=sets, SCORE_SPLITS=score_splits,
        SCORE_SPLITS_P=triton.next_power_of_2(score_splits), BLOCK_V=block_v, SPLITS=vote_splits, SOFT=soft,
        COMPACT=compact, **radix)
    chunks = triton.cdiv(width, block_t)
    chunk_hist = torch.empty(batch, sets, chunks, RADIX_BINS, dtype=torch.int32, device=device)
    chunk_above = torch.empty(batch, sets, chunks, dtype=torch.int32, device=device)
    for radix_pass in range(1, RADIX_PASSES):
        _radix_pass[(batch, sets, chunks)](
            votes, num_slots, parts, span, refresh, hist, chunk_hist, chunk_above, width, num_slots.stride(0), chunks,
            SETS=sets, BLOCK_T=block_t, PASS=radix_pass, COMPACT=compact, num_warps=num_warps, **radix)
    out = torch.empty(batch, sets, out_width, dtype=torch.long, device=device)  # [B, S, out_width]
    _select[(batch, sets, triton.cdiv(max(width, out_width), block_t))](
        votes, num_slots, parts, span, page_map, rows, refresh, hist, chunk_hist, chunk_above, cache.top, out, width,
        num_slots.stride(0), layer, layers, chunks, k_max, out_width, SETS=sets, BLOCK_T=block_t, BLOCK_C=block_c,
        PAGE_SIZE=page_size, COMPACT=compact, num_warps=num_warps, **radix)
    return out
