"""Plain-torch attention over the paged cache: the reference every fast kernel is tested against, and the CPU path.

The attention functions take logical-slot index lists per KV head (or one list shared by all heads) and a page
table, so selection methods never copy K/V to build their context. A query head h reads KV head h // group (GQA).
With `key_rope` (methods that store keys before RoPE), the gathered keys are rotated by their rank in the attended
list; the caller rotates the queries by theirs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def physical_rows(tables: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """tables [B, max_pages], logical slots [B, ...] -> physical rows of the flattened pool [B, ...]."""
    pages = torch.gather(tables, 1, (slots // page_size).flatten(1)).view_as(slots)
    return pages * page_size + slots % page_size


def paged_dot(q: torch.Tensor, k_pool: torch.Tensor, table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Dot products of each query head with the keys of its KV group at the given slots of one layer.

    q [heads, D] with table [max_pages] (one sequence), or q [B, heads, D] with tables [B, max_pages] (a batch, the
    same slot list for every row); k_pool [pages, page_size, kv_heads, D]; slots [n] logical slots (any order).
    Returns float32 scores [heads, n] (or [B, heads, n]). This reference gathers the keys first;
    `kernels/triton_paged_dot.py` reads them in place on the GPU.
    """
    if q.dim() == 2:
        return paged_dot(q[None], k_pool, table[None], slots)[0]
    batch, n_heads, dim = q.shape
    page_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    rows = table[:, slots // page_size] * page_size + slots % page_size  # [B, n]
    keys = k_pool.view(-1, kv_heads, dim)[rows]  # [B, n, kv_heads, D]
    grouped = q.view(batch, kv_heads, n_heads // kv_heads, dim).float()
    return torch.einsum("bkgd,bnkd->bkgn", grouped, keys.float()).reshape(batch, n_heads, -1)


def min_max_bound(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, group_reduce: str) -> torch.Tensor:
    """Quest's bound of a block's best attention logit: q [B, heads, D], kmin / kmax [B, n, kv_heads, D] ->
    [B, kv_heads, n], sum_d max(q_hd * kmax_d, q_hd * kmin_d) reduced over the query heads h of each KV group by
    "mean" or "max". Since kmax >= kmin this is q+ . kmax + q- . kmin (the positive / negative parts of q): two
    matrix products."""
    batch, heads, dim = q.shape
    kv_heads = kmin.shape[2]
    grouped = q.float().view(batch, kv_heads, heads // kv_heads, dim)
    bound = (torch.einsum("bhgd,bphd->bhgp", grouped.clamp(min=0), kmax.float())
             + torch.einsum("bhgd,bphd->bhgp", grouped.clamp(max=0), kmin.float()))  # [B, kv_heads, group, n]
    return bound.mean(2) if group_reduce == "mean" else bound.amax(2)


def page_bound(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, tables: torch.Tensor, num_slots: torch.Tensor,
               page_size: int, group_reduce: str, k_pool: torch.Tensor | None = None) -> torch.Tensor:
    """`min_max_bound` of every page of each sequence, read through its page table, for Quest's page scoring.

    q [B, heads, D]; kmin / kmax [pool_pages, kv_heads, D], the summaries of each physical page; tables [B, W]
    physical page ids; num_slots [B] stored slots. Returns float32 [B, kv_heads, W] with +inf at each row's last
    page (the current token's) and -inf past it. With k_pool [pool_pages, page_size, kv_heads, D] it first folds
    the key just stored at each row's last slot into its page's kmin / kmax in place (a slot at a page start resets
    them), as a decode step needs before its next one. This reference gathers the summaries;
    `kernels/triton_page_select.py` reads them in place on the GPU and folds in the same pass."""
    if k_pool is not None:
        slot = num_slots - 1  # [B]
        page = tables.gather(1, (slot // page_size)[:, None])[:, 0]  # [B] physical pages of the current tokens
        key = k_pool[page, slot % page_size].float()  # [B, kv_heads, D]
        fresh = (slot % page_size == 0)[:, None, None]
        kmin[page] = torch.where(fresh, key, torch.minimum(kmin[page].float(), key)).to(kmin.dtype)
        kmax[page] = torch.where(fresh, key, torch.maximum(kmax[page].float(), key)).to(kmax.dtype)
    bound = min_max_bound(q, kmin[tables], kmax[tables], group_reduce)  # [B, kv_heads, W]
    page = torch.arange(tables.shape[1], device=q.device)
    last = (-(-num_slots // page_size) - 1)[:, None, None]
    return bound.masked_fill(page > last, float("-inf")).masked_fill(page == last, float("inf"))


def page_candidates(bound: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, tables: torch.Tensor, page_size: int,
                    count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `count` pages of each row with the highest bound (its maximum over the KV heads) among the pages holding a
    slot of [lo, hi): a first stage that keeps a share of the candidates to score exactly (TokenSelect's and
    DynSplit-KV's score_keys="pages"). bound [B, kv_heads, W] (`page_bound`); lo / hi [B]; tables [B, >= W] physical
    page ids; count <= W (rows with fewer such pages fill in others, outside [lo, hi)). Returns the chosen pages'
    physical ids [B, count], the pages [B, count] ascending and span [B, 2]: the compact slots [first, end) that
    stand for slots of [lo, hi) (compact slot c is slot pages[c // page_size] * page_size + c % page_size: an
    increasing map, so they are one range). Tensor operations alone (a CUDA graph captures them)."""
    start = torch.arange(bound.shape[-1], device=bound.device) * page_size  # [W] each page's first slot
    holds = (start + page_size > lo[:, None]) & (start < hi[:, None])  # [B, W]
    best = bound.amax(1).masked_fill(~holds, float("-inf"))
    pages = best.topk(count, dim=-1, sorted=False).indices.sort(dim=-1).values  # [B, count]
    first = pages * page_size
    span = torch.stack([(lo[:, None] - first).clamp(0, page_size).sum(1),
                        (hi[:, None] - first).clamp(0, page_size).sum(1)], 1)
    return torch.gather(tables, 1, pages), pages, span


def page_slots(top: torch.Tensor, budget: torch.Tensor, num_slots: torch.Tensor,
               page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's attended slots from its top pages: top [B, kv_heads, k] page indices (a top-k of `page_bound`, best
    first, the row's last page among them); budget / num_slots [B] each row's budget in tokens and stored slots.
    A row keeps its first budget // page_size pages (at least one), or all its pages when the budget covers its
    slots. Returns slots [B, kv_heads, k * page_size], the kept pages' slots ascending and then padding (page 0's),
    and lengths [B, kv_heads]: the kept pages' slots less the unfilled end of the last page."""
    k = top.shape[-1]
    n_pages = -(-num_slots // page_size)  # [B]
    keep = torch.where(budget >= num_slots, n_pages, (budget // page_size).clamp(min=1))  # [B]
    kept = torch.arange(k, device=top.device) < keep[:, None, None]  # [B, 1, k]
    big = 2**30
    pages = torch.where(kept, top, big).sort(dim=-1).values
    pages = torch.where(pages == big, 0, pages)  # [B, kv_heads, k]
    slots = (pages[..., None] * page_size + torch.arange(page_size, device=top.device)).flatten(2)
    lengths = keep * page_size - (n_pages * page_size - num_slots)  # [B]
    return slots, lengths[:, None].expand(-1, top.shape[1]).contiguous()


def ranked_before(scores: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Buckets (SentenceKV's sentences, DynSplit-KV's chunks) ranked by descending score, ties by bucket id (the order
    of a stable sort): scores / count [B, S, buckets] (float, tokens) -> for every bucket the tokens of the buckets
    ranked before it, int32 [B, S, buckets]."""
    count = count.int()
    order = torch.sort(scores.masked_fill(count == 0, float("-inf")), dim=-1, descending=True, stable=True).indices
    ranked = count.gather(-1, order)
    return torch.empty_like(count).scatter_(-1, order, ranked.cumsum(-1, dtype=torch.int32) - ranked)


def bucket_take(scores: torch.Tensor, count: torch.Tensor, capacity: torch.Tensor,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a capacity takes of buckets ranked as `ranked_before` ranks them: scores / count [B, S, buckets] (float,
    tokens), capacity [B] (tokens a row takes) -> `before`, `first` and `place`, int32 [B, S, buckets] each. Token o
    of a bucket (o < its count) is taken when before + o < capacity, as with the exact rank prefix (`ranked_before`):
    `before` is that prefix for the bucket the capacity ends in, 0 for a bucket taken whole and `capacity` for one
    taken not at all (an empty bucket too), so a kernel need not rank every bucket, only find where the capacity
    ends. `first` is the index of each bucket's first token (buckets are contiguous token ranges in id order).
    `place` is the index of a bucket's first taken token among all the taken ones in id order: the tokens the
    buckets before it take (clamp(capacity - before, 0, count) each), so that a token's place in a slot list needs
    no running count. What SentenceKV's `sentence_slots` and DynSplit-KV's `chunk_slots` take. With rows [B],
    count [R, S, buckets] holds the counts of state rows, row rows[b] for batch row b."""
    count = (count if rows is None else count[rows]).int()
    cap = capacity[:, None, None].int()
    exact = ranked_before(scores, count)
    before = torch.where(count == 0, cap, torch.where(exact + count <= cap, 0, torch.where(exact >= cap, cap, exact)))
    return before, count.cumsum(-1, dtype=torch.int32) - count, taken_place(before, count, capacity)


def taken_place(before: torch.Tensor, count: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
    """`bucket_take`'s `place` from any `before` it accepts (the exact rank prefix too): before / count [B, S,
    buckets], capacity [B] -> the tokens the buckets before each one in id order take, int32 [B, S, buckets]."""
    take = (capacity[:, None, None].int() - before).clamp(min=0).minimum(count.int())
    return take.cumsum(-1, dtype=torch.int32) - take


def compact_chosen(chosen: torch.Tensor, n: torch.Tensor, n_sink: torch.Tensor, tail: torch.Tensor,
                   max_sink: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sinks, the chosen slots (chosen [B, S, T]: slot n_sink + t) and the tail, compacted to the front of
    [B, S, width] (then 0), with lengths [B, S]."""
    batch, shared, tokens = chosen.shape
    device = chosen.device
    sinks, recent = torch.arange(max_sink, device=device), torch.arange(width, device=device)
    per_row = lambda x: x[:, None].expand(-1, shared, -1)  # noqa: E731  [B, n] -> [B, S, n]
    slots = torch.cat([per_row(sinks.expand(batch, -1)), per_row(n_sink[:, None] + torch.arange(tokens, device=device)),
                       per_row(n[:, None] - width + recent)], -1)  # [B, S, max_sink + T + width]
    valid = torch.cat([per_row(sinks < n_sink[:, None]), chosen, per_row(recent >= width - tail[:, None])], -1)
    return compact_slots(slots, valid, width)


def compact_slots(slots: torch.Tensor, valid: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate slots [B, S, m] whose valid entries (valid [B, S, m]) are ascending, compacted to the front by a
    scan: slots [B, S, width] (then 0) and lengths [B, S]."""
    position = valid.cumsum(-1) - 1
    out = torch.zeros(*slots.shape[:2], width + 1, dtype=torch.long, device=slots.device)
    out.scatter_(-1, torch.where(valid, position, width), slots)  # invalid entries land in the last column
    return out[..., :width], position[..., -1] + 1


def working_set(slots: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, n_sink: torch.Tensor,
                offloaded: torch.Tensor, cache: torch.Tensor, held: torch.Tensor, where: torch.Tensor,
                hand: torch.Tensor, stores: dict, table: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                pos_pool: torch.Tensor, traffic: torch.Tensor, layer: int) -> None:
    """An offloaded working set: a selection over virtual slots becomes device slots, loading what is missing.

    A row's virtual slots are its sinks [0, n_sink), its offloaded tokens (virtual slot n_sink + t: token t of its
    host store) and its tail; on the device the sinks stay, `cache` working-set slots follow (device slot n_sink + s)
    and the tail comes after them (virtual slot x >= n_sink + offloaded is device slot x - offloaded + cache).
    Working-set slots that no selected token holds are listed round the working set from the row's clock hand on;
    each selected offloaded token not on the device takes the next listed slot (in selection order; the slot's token,
    which no one selected, is then on the host only), its key, value and position are copied there from the host
    store, and the hand moves past the last slot taken. A token that leaves the selection thus stays on the device
    until its slot is needed: with more working-set slots than a row selects, re-selected tokens are found, not
    loaded. Modified in place: slots [B, S, width] (virtual -> device slots, order kept; S = kv heads), held
    [rows, S, capacity] (token + 1 in each working-set slot, 0: empty), where [rows, S, tokens] (slot + 1 of each
    token, 0: on the host only) and hand [rows, S] (the clock hand) of this layer, the pool's K/V/positions at the
    new slots, and traffic [rows, 2] (selected offloaded tokens found on the device, loaded). lengths [B, S];
    rows / n_sink / offloaded / cache [B]; stores: row -> store (`HostKVStore`: k, v [layers, S, capacity, D], pos
    [layers, S, capacity]); table [B, pages] this layer's page tables."""
    batch, heads, width = slots.shape
    capacity, tokens = held.shape[-1], where.shape[-1]
    ns, off, cache = n_sink[:, None, None], offloaded[:, None, None], cache[:, None, None]
    valid = torch.arange(width, device=slots.device) < lengths[..., None]
    middle = valid & (slots >= ns) & (slots < ns + off)
    t = torch.where(middle, slots - ns, 0)  # [B, S, width]
    held_rows, where_rows = held[rows].long(), where[rows].long()  # [B, S, capacity], [B, S, tokens]
    hands = hand[rows].long()[..., None]  # [B, S, 1]
    w = torch.where(middle, where_rows.gather(2, t), 0)
    hit = w > 0
    kept = torch.zeros(batch, heads, capacity + 1, dtype=torch.bool, device=slots.device)
    kept = kept.scatter(2, torch.where(hit, w - 1, capacity), True)[..., :capacity]
    s = torch.arange(capacity, device=slots.device)
    turn = torch.where(s < cache, (s - hands) % cache.clamp(min=1), capacity)  # [B, S, capacity] from the hand on
    free = torch.sort(turn + kept * 2 * capacity, dim=2, stable=True).indices  # listed slots first, round from hand
    miss = middle & ~hit
    missed = miss.sum(2, keepdim=True)  # [B, S, 1]
    rank = (miss.cumsum(2) - 1).clamp(min=0)
    slot = torch.where(miss, free.gather(2, rank), w - 1)  # [B, S, width]
    before = torch.where(miss, held_rows.gather(2, slot.clamp(min=0)), 0)  # the token a taken slot held, + 1
    where_rows = F.pad(where_rows, (0, 1)).scatter(2, torch.where(before > 0, before - 1, tokens), 0)[..., :tokens]
    where_rows = F.pad(where_rows, (0, 1)).scatter(2, torch.where(miss, t, tokens), slot + 1)[..., :tokens]
    held_rows = F.pad(held_rows, (0, 1)).scatter(2, torch.where(miss, slot, capacity), t + 1)[..., :capacity]
    last = free.gather(2, (missed - 1).clamp(min=0))  # [B, S, 1]
    hands = torch.where(missed > 0, (last + 1) % cache.clamp(min=1), hands)
    kf, vf, pf = (x.view(-1, heads, *x.shape[3:]) for x in (k_pool, v_pool, pos_pool))
    device_rows = physical_rows(table, torch.where(miss, ns + slot, 0).flatten(1), k_pool.shape[1]).view_as(slot)
    for b, row in enumerate(rows.tolist()):
        head, entry = miss[b].nonzero(as_tuple=True)
        if head.numel():
            store, token, at = stores[row], t[b, head, entry], device_rows[b, head, entry]
            kf[at, head] = store.k[layer, head.cpu(), token.cpu()].to(kf.device)
            vf[at, head] = store.v[layer, head.cpu(), token.cpu()].to(vf.device)
            pf[at, head] = store.pos[layer, head.cpu(), token.cpu()].to(pf.device)
    held[rows], where[rows], hand[rows] = held_rows.int(), where_rows.int(), hands[..., 0].int()
    traffic.index_add_(0, rows, torch.stack([(middle & hit).sum((1, 2)), miss.sum((1, 2))], 1))
    tail = torch.where(valid & (slots >= ns + off), slots - off + cache, slots)
    slots.copy_(torch.where(middle, ns + slot, tail))


def put_host(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, store_k: torch.Tensor, store_v: torch.Tensor,
             store_pos: torch.Tensor, first: int, n: int) -> None:
    """Tokens into a host store: keys and values [L', kv_heads, m, D], positions [L', kv_heads, m] become entries
    n..n+m-1 of layers first..first+L'-1 of store_k / store_v [layers, kv_heads, capacity, D] and store_pos [layers,
    kv_heads, capacity]."""
    layers, m = k.shape[0], k.shape[2]
    for src, dst in ((k, store_k), (v, store_v), (pos, store_pos)):
        dst[first : first + layers, :, n : n + m] = src


def _rotate_keys(k: torch.Tensor, key_rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """k [B, kv_heads, n, D] rotated by rank j along n with cos/sin [>= n, D]."""
    batch, heads, n, dim = k.shape
    cos, sin = key_rope[0][:n], key_rope[1][:n]
    flat = k.permute(2, 0, 1, 3).reshape(n, batch * heads, dim)
    return rotate(flat, cos, sin).view(n, batch, heads, dim).permute(1, 2, 0, 3)


def gather_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    slots: torch.Tensor | None,
    lengths: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys/values [B, kv_heads, n, D] and a validity mask [B, S, n] for each sequence's attended slots.

    slots: [B, S, n] logical slots, S in {1, kv_heads}, ascending, padded past `lengths` [B, S];
    None means every stored slot (lengths [B, 1]), gathered a page at a time.
    """
    pages, page_size, heads, dim = k_pool.shape
    batch = tables.shape[0]
    if slots is None:
        n = int(lengths.max())
        n_pages = -(-n // page_size)
        k = k_pool[tables[:, :n_pages]].reshape(batch, n_pages * page_size, heads, dim)[:, :n]
        v = v_pool[tables[:, :n_pages]].reshape(batch, n_pages * page_size, heads, dim)[:, :n]
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    else:
        n = slots.shape[-1]
        rows = physical_rows(tables, slots, page_size)
        kf, vf = k_pool.view(-1, heads, dim), v_pool.view(-1, heads, dim)
        if slots.shape[1] == 1:
            k, v = kf[rows[:, 0]].transpose(1, 2), vf[rows[:, 0]].transpose(1, 2)
        else:
            head_idx = torch.arange(heads, device=rows.device)[None, :, None]
            k, v = kf[rows, head_idx], vf[rows, head_idx]
    mask = torch.arange(n, device=lengths.device)[None, None, :] < lengths[:, :, None]
    return k, v, mask


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    slots: torch.Tensor | None,
    lengths: torch.Tensor,
    scale: float,
    key_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One query token per sequence. q [B, heads, D]; k_pool/v_pool [pages, page_size, kv_heads, D];
    tables [B, max_pages] (this layer); slots/lengths as in `gather_kv`; key_rope: cos/sin [>= n, D] by rank.
    Returns o [B, heads, D]."""
    batch, n_heads, dim = q.shape
    kv_heads = k_pool.shape[2]
    k, v, mask = gather_kv(k_pool, v_pool, tables, slots, lengths)
    if key_rope is not None:
        k = _rotate_keys(k, key_rope)
    qg = q.view(batch, kv_heads, n_heads // kv_heads, dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, kv_heads, group, n]
    scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(v.dtype), v).view(batch, n_heads, dim)


def prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    start: int,
    context: torch.Tensor | None,
    scale: float,
    key_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    lse: bool = False,
    query_block: int = 256,
):
    """A chunk of C query tokens stored at slots [start, start + C) of one sequence and layer.

    q [C, heads, D]; table [max_pages]; context: logical slots [S, n] (S in {1, kv_heads}) of earlier tokens the chunk
    attends to, or None for all slots < start. The chunk attends to itself causally. key_rope: cos/sin [>= n, D] by
    rank in the attended list (context, then the chunk). Returns out [C, heads, D]; with lse=True also the log-sum-exp
    of each query's visible logits `scale * q . k` [C, heads] float32: the attention is then computed from the
    logits it already holds, `query_block` queries at a time, instead of by SDPA (one pass over the logits, not two).
    """
    chunk, n_heads, dim = q.shape
    kv_heads = k_pool.shape[2]
    device = q.device
    own = torch.arange(start, start + chunk, device=device)
    if context is None:
        slots, lengths = torch.arange(start + chunk, device=device)[None, None], None
        n_ctx = start
    else:
        slots = torch.cat([context, own[None].expand(context.shape[0], -1)], dim=1)[None]
        n_ctx = context.shape[1]
    lengths = torch.full((1, slots.shape[1]), slots.shape[2], device=device)
    k, v, _ = gather_kv(k_pool, v_pool, table[None], slots, lengths)  # [1, kv_heads, n, D]
    if key_rope is not None:
        k = _rotate_keys(k, key_rope)
    n = k.shape[2]
    key_idx = torch.arange(n, device=device)[None, :]
    query_idx = torch.arange(chunk, device=device)[:, None]
    mask = (key_idx < n_ctx) | (key_idx - n_ctx <= query_idx)  # [C, n]: context visible, chunk causal
    if not lse:
        return F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k, v, attn_mask=mask, scale=scale, enable_gqa=kv_heads != n_heads
        )[0].transpose(0, 1)  # [C, heads, D]
    grouped = q.view(chunk, kv_heads, -1, dim).float()  # [C, KH, group, D]
    keys, values = k[0].float(), v[0].float()  # [KH, n, D]
    outs, sums = [], []
    for a in range(0, chunk, query_block):
        logits = torch.einsum("ckgd,knd->ckgn", grouped[a : a + query_block], keys) * scale
        logits = logits.masked_fill(~mask[a : a + query_block, None, None, :], float("-inf"))
        norm = torch.logsumexp(logits, -1, keepdim=True)  # [w, KH, group, 1]
        outs.append(torch.einsum("ckgn,knd->ckgd", torch.exp(logits - norm), values).flatten(1, 2))
        sums.append(norm[..., 0].flatten(1))
    return torch.cat(outs).to(q.dtype), torch.cat(sums)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [T, n] (+ residual) -> (RMSNorm(x + residual) * weight, x + residual), computed in float32 like HF."""
    if residual is not None:
        x = x + residual
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2n] -> SiLU(gate) * up [T, n]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE: x [T, heads, D] rotated by cos/sin [T, D] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def store(k, v, rows, positions, kf, vf, pf):
    """Store k, v [T, kv_heads, D] and positions [T] at the pool rows [T, kv_heads] of the flat pool views."""
    heads = torch.arange(k.shape[1], device=rows.device)[None, :]
    kf[rows, heads], vf[rows, heads] = k, v
    pf[rows, heads] = positions.to(torch.int32)[:, None]


def rope_store(q, k, v, cos, sin, rows, positions, kf, vf, pf):
    """Rotate q and k, store k, v and positions at the pool rows [T, kv_heads]; returns the rotated q."""
    store(rotate(k, cos, sin), v, rows, positions, kf, vf, pf)
    return rotate(q, cos, sin)


def window_mass(q_window: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, query_positions: torch.Tensor,
                scale: float) -> torch.Tensor:
    """The attention mass an observation window gives each key: q_window [w, heads, D] (the last prompt queries, at
    query_positions [w]) over keys [kv_heads, n, D] (at positions [kv_heads, n]), each query's softmax of its scaled
    scores over the keys not in its future, summed over the window: float32 [heads, n]. GQA: query head h reads KV
    head h // group. This reference makes the [heads, w, n] probabilities; `kernels/triton_window_mass.py` does not."""
    w, heads, dim = q_window.shape
    kv_heads = keys.shape[0]
    grouped = q_window.float().view(w, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("wkgd,knd->kgwn", grouped, keys.float()) * scale  # [kv_heads, group, w, n]
    future = positions[:, None, None, :] > query_positions[None, None, :, None]  # [kv_heads, 1, w, n]
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return probs.sum(2).reshape(heads, -1)
