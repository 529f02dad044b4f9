"""Plain-torch attention over the paged cache: the reference every fast kernel is tested against, and the CPU path.

The attention functions take logical-slot index lists per KV head (or one list shared by all heads) and a page
table, so selection methods never copy K/V to build their context. A query head h reads KV head h // group (GQA).
With `key_rope` (methods that store keys before RoPE), the gathered keys are rotated by their rank in the attended
list; the caller rotates the queries by theirs.
"""
from __future__ import annotations

from dataclasses import dataclass

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


def summary_dots(sums: torch.Tensor, pages: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """Dot products of per-page key summaries with one direction per sequence and layer, summed over layers.

    sums [pool_pages, kv_heads, D] float32, one summary per physical page; pages [B, layers, w] physical page ids of
    each sequence's pages in each layer; directions [B, r, layers, kv_heads, D]. Returns float32 [B, w, r] with
    out[b, j, i] = sum over layers l of <sums[pages[b, l, j]], directions[b, i, l]>. This reference gathers one
    layer's summaries at a time; `kernels/triton_summary_dot.py` reads them in place on the GPU."""
    batch, layers, w = pages.shape
    dirs = directions.float().flatten(3)  # [B, r, layers, kv_heads * D]
    out = torch.zeros(batch, w, directions.shape[1], dtype=torch.float32, device=sums.device)
    for layer in range(layers):
        out += torch.bmm(sums[pages[:, layer]].flatten(2), dirs[:, :, layer].transpose(1, 2))
    return out


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


def block_slots(top: torch.Tensor, chosen: torch.Tensor, init: torch.Tensor, local: torch.Tensor, n: torch.Tensor,
                block_size: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """InfLLM's attended slots: the initial tokens [0, init), the chosen blocks and the local window [n - local, n).
    top [B, S, k] block indices, best first (a top-k of the block scores); chosen [B] how many of them each row takes
    (<= k); init / local / n [B] the row's initial tokens, local window and stored slots. A block's slots that also
    lie in the initial tokens or the local window count once; with n <= init + local a row attends to [0, n).
    Returns slots [B, S, capacity], ascending and then 0, and lengths [B, S]."""
    batch, shared, k = top.shape
    device = top.device
    slot = torch.arange(capacity, device=device)
    parts = [(slot.expand(batch, 1, -1), (slot < torch.minimum(init, n)[:, None])[:, None])]
    if k:
        taken = torch.arange(k, device=device) < chosen[:, None, None]  # [B, 1, k]
        blocks = torch.where(taken, top, -1).sort(dim=-1).values  # the chosen ones ascending, after the -1s
        slots = (blocks[..., None] * block_size + torch.arange(block_size, device=device)).flatten(2)
        inside = (slots >= init[:, None, None]) & (slots < (n - local)[:, None, None])
        parts.append((slots, (blocks >= 0).repeat_interleave(block_size, dim=-1) & inside))
    window = (n - local)[:, None] + slot  # [B, capacity]
    parts.append((window[:, None], ((window >= init[:, None]) & (window < n[:, None]))[:, None]))
    slots = torch.cat([p.expand(-1, shared, -1) for p, _ in parts], -1)  # [B, S, all candidates]
    valid = torch.cat([v.expand(-1, shared, -1) for _, v in parts], -1)
    return compact_slots(slots, valid, capacity)  # [initial | blocks | local]


def bucket_ranks(scores: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Buckets (SentenceKV's sentences, DynSplit-KV's chunks) ranked by descending score, ties by bucket id (the order
    of a stable sort): scores / count [B, S, buckets] (float, tokens) -> for every bucket the tokens of the buckets
    ranked before it and the index of its first token (buckets are contiguous token ranges in id order), int32
    [B, S, buckets] each. What `sentence_tokens` and `kernels.sentence_slots` take."""
    count = count.int()
    order = torch.sort(scores.masked_fill(count == 0, float("-inf")), dim=-1, descending=True, stable=True).indices
    ranked = count.gather(-1, order)
    before = torch.empty_like(count).scatter_(-1, order, ranked.cumsum(-1, dtype=torch.int32) - ranked)
    return before, count.cumsum(-1, dtype=torch.int32) - count


def sentence_tokens(bucket: torch.Tensor, rows: torch.Tensor, before: torch.Tensor, first: torch.Tensor,
                    retained: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
    """The tokens that ranked buckets take up to a capacity: buckets fill it in rank order and the last one keeps its
    leading tokens (token t of bucket k is taken when before[k] + t - first[k] < capacity). bucket [rows, S or 1, T]
    the bucket of every token of each state row (one map per KV head or one shared), rows [B] the batch's state rows,
    before / first [B, S, buckets] (`bucket_ranks`), retained / capacity [B]. -> bool [B, S, T] (token t:
    t < retained)."""
    index = torch.arange(bucket.shape[-1], device=bucket.device)
    bucket = bucket[rows].long().expand(-1, before.shape[1], -1)  # [B, S, T]
    offset_in_bucket = index - first.gather(-1, bucket)
    taken = before.gather(-1, bucket) + offset_in_bucket < capacity[:, None, None]
    return taken & (index < retained[:, None, None])


def sentence_slots(bucket: torch.Tensor, rows: torch.Tensor, before: torch.Tensor, first: torch.Tensor,
                   n: torch.Tensor, n_sink: torch.Tensor, retained: torch.Tensor, capacity: torch.Tensor,
                   tail: torch.Tensor, max_sink: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attended slots from ranked buckets (SentenceKV): the sinks [0, n_sink), the tokens the buckets take
    (`sentence_tokens`; token t at slot n_sink + t) and the last `tail` slots [n - tail, n). Arguments as
    `sentence_tokens`, plus n / n_sink / tail [B]; max_sink bounds n_sink, width bounds a row's total. Returns slots
    [B, S, width], ascending and then 0, and lengths [B, S]."""
    chosen = sentence_tokens(bucket, rows, before, first, retained, capacity)  # [B, S, T]
    return _compact(chosen, n, n_sink, tail, max_sink, width)


def chunk_slots(lo: torch.Tensor, count: torch.Tensor, before: torch.Tensor, n: torch.Tensor, n_sink: torch.Tensor,
                capacity: torch.Tensor, tail: torch.Tensor, max_sink: int, width: int,
                longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attended slots from ranked chunks (DynSplit-KV): chunks are ascending, disjoint slot ranges [lo, lo + count)
    (lo / count [B, chunks], at most `longest` slots each) inside [n_sink, n - tail); each takes its leading
    clamp(capacity - before, 0, count) slots (before [B, S, chunks]: `bucket_ranks`), between the sinks [0, n_sink)
    and the last `tail` slots. n / n_sink / capacity / tail [B]; max_sink bounds n_sink, width a row's total. Returns
    slots [B, S, width], ascending and then 0, and lengths [B, S]."""
    take = (capacity[:, None, None] - before).clamp(min=0).minimum(count[:, None])  # [B, S, chunks]
    lo = lo[:, None].expand_as(take)
    tokens = max(int((n - n_sink).max()), 1)  # slots after the sinks: token t is slot n_sink + t
    edges = torch.zeros(*take.shape[:2], tokens + 1, dtype=torch.long, device=take.device)
    start = (lo - n_sink[:, None, None]).clamp(0, tokens)
    edges.scatter_add_(-1, start, (take > 0).long())
    edges.scatter_add_(-1, (start + take).clamp(max=tokens), -(take > 0).long())
    chosen = edges.cumsum(-1)[..., :tokens] > 0  # [B, S, T]: inside a chunk's taken slots
    return _compact(chosen, n, n_sink, tail, max_sink, width)


def chunk_refresh(k_flat: torch.Tensor, tables: torch.Tensor, page_size: int, first: torch.Tensor, split: torch.Tensor,
                  n: torch.Tensor, targets: torch.Tensor, span: int, kmin: torch.Tensor, kmax: torch.Tensor) -> None:
    """Write the element-wise min / max key of two chunks inside each row's last `span` slots (DynSplit-KV: the chunk
    the new token joined, slots [first, split), and the next one, [split, n)). k_flat [pool rows, kv_heads, D]
    (`KVPool.flat`), tables [B, max_pages] (one layer), first / split / n [B]; targets [B, 2] the rows of kmin / kmax
    [summary rows, kv_heads, D] the two chunks go to. A chunk with no slot gets zeros."""
    positions = n[:, None] - span + torch.arange(span, device=n.device)  # [B, span]
    keys = k_flat[physical_rows(tables, positions.clamp(min=0), page_size)]  # [B, span, kv_heads, D]
    for chunk, (lo, hi) in enumerate(((first, split), (split, n))):
        member = ((positions >= lo[:, None]) & (positions < hi[:, None]) & (positions >= 0))[..., None, None]
        held = member.any(1)  # [B, 1, 1]
        kmin[targets[:, chunk]] = torch.where(held, keys.masked_fill(~member, float("inf")).amin(1), 0).to(kmin.dtype)
        kmax[targets[:, chunk]] = torch.where(held, keys.masked_fill(~member, float("-inf")).amax(1), 0).to(kmax.dtype)


def slot_stamps(stamps: torch.Tensor, tables: torch.Tensor, page_size: int, slots: torch.Tensor, lengths: torch.Tensor,
                current: torch.Tensor, step: torch.Tensor, first: torch.Tensor, reuse: torch.Tensor, rows: torch.Tensor,
                scratch: int) -> None:
    """Reuse counting from per-slot stamps (DynSplit-KV): of each row's attended slots (slots [B, S, width], the first
    lengths [B, S] of each list; `current` [B] the slot not counted: the new token), count those whose stamp in
    stamps [pool rows, S] (int32, by physical row through tables [B, max_pages]) is step - 1 (never at a row's first
    step: first [B] = 1) as reused and the others as reloaded, added to reuse [rows, 2] at rows [B]; then stamp every
    attended slot with step [B]. Entries past a list's length write the scratch page."""
    heads = slots.shape[1]
    held = torch.arange(slots.shape[-1], device=slots.device) < lengths[..., None]  # [B, S, width]
    flat = torch.where(held, physical_rows(tables, slots, page_size), scratch * page_size)
    head = torch.arange(heads, device=slots.device)[None, :, None]
    counted = held & (slots != current[:, None, None])
    reused = counted & (stamps[flat, head] == (step - 1)[:, None, None]) & (first == 0)[:, None, None]
    reused, counted = reused.sum((1, 2)), counted.sum((1, 2))
    reuse.index_put_((rows,), torch.stack([reused, counted - reused], 1), accumulate=True)
    stamps[flat, head] = step.int()[:, None, None].expand_as(flat)


def _compact(chosen: torch.Tensor, n: torch.Tensor, n_sink: torch.Tensor, tail: torch.Tensor, max_sink: int,
             width: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def head_vote(scores: torch.Tensor, k: int, selection: str, kv_heads: int | None) -> torch.Tensor:
    """TokenSelect's selection functions (Eqs. 5-7): scores [..., heads, n] (q_h . k of each candidate, -inf where
    not a candidate) -> indices of the k chosen candidates [..., S, k], ascending. "soft_vote": softmax per head,
    summed over the heads; "top_k": the logits summed; "hard_vote": each head's top-k counted, ties broken by the
    soft vote. kv_heads None: one vote over all heads (S = 1); otherwise one per KV group (S = kv_heads)."""
    def over_heads(x: torch.Tensor) -> torch.Tensor:  # [..., heads, n] -> [..., S, n]
        return x.sum(-2, keepdim=True) if kv_heads is None else x.unflatten(-2, (kv_heads, -1)).sum(-2)

    if selection == "top_k":
        total = over_heads(scores)
    else:
        soft = over_heads(torch.softmax(scores, dim=-1))
        if selection == "soft_vote":
            total = soft
        else:  # hard vote; soft / (2 * voters) < 1 only breaks ties between equal counts
            hits = torch.zeros_like(scores).scatter_(-1, scores.topk(k, dim=-1).indices, 1.0)
            voters = scores.shape[-2] // soft.shape[-2]
            total = over_heads(hits) + soft / (2 * voters)
    return total.topk(k, dim=-1).indices.sort(dim=-1).values


@dataclass
class SelectionCacheBuffers:
    """TokenSelect's Selection Cache on the device, one row per running sequence (row 0 is scratch for padding
    rows): the query of each layer's last selection q [rows, layers, heads * D] float32, its top-k slots
    top [rows, layers, S, k], whether that entry may be reused valid [rows, layers] int8, and per row the hits and
    lookups so far counts [rows, 2]."""

    q: torch.Tensor
    top: torch.Tensor
    valid: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, layers: int, query_size: int, sets: int, k: int,
                 device: torch.device) -> "SelectionCacheBuffers":
        return cls(q=torch.zeros(rows, layers, query_size, dtype=torch.float32, device=device),
                   top=torch.zeros(rows, layers, sets, k, dtype=torch.long, device=device),
                   valid=torch.zeros(rows, layers, dtype=torch.int8, device=device),
                   counts=torch.zeros(rows, 2, dtype=torch.long, device=device))


def token_select(q: torch.Tensor, k_pool: torch.Tensor, tables: torch.Tensor, num_slots: torch.Tensor, width: int,
                 rows: torch.Tensor, cache: SelectionCacheBuffers, layer: int, n_sink: int, n_recent: int,
                 theta: float, selection: str, kv_heads: int | None) -> torch.Tensor:
    """One layer of TokenSelect's decode selection for a batch, Selection Cache included (Algorithm 1).

    q [B, heads, D] current queries; tables [B, max_pages]; num_slots [B] stored slots (current token included);
    width >= num_slots; rows [B] each sequence's row in `cache`. With k = cache.top.shape[-1] and
    budget = n_sink + k + n_recent, a row with more than `budget` slots is sparse: it looks its query up in the
    cache (a hit: the entry is valid and cos(q, cached q) >= theta) and on a miss votes anew among the candidates
    [n_sink, num_slots - n_recent) and stores query and top-k. Returns slots [B, S, budget] ascending: the sinks,
    the top-k and the recent slots of a sparse row, 0..budget-1 for the others (the caller masks by length).
    Updates `cache` in place; `kernels/triton_token_select.py` does the same in kernels that skip hit rows."""
    batch, n_heads, _ = q.shape
    k = cache.top.shape[-1]
    budget = n_sink + k + n_recent
    flat = q.flatten(1).float()  # [B, heads * D]
    cached = cache.q[rows, layer]
    sparse = num_slots > budget  # [B]
    similar = F.cosine_similarity(flat, cached, dim=-1) >= theta
    hit = sparse & (cache.valid[rows, layer] != 0) & similar
    refresh = sparse & ~hit
    slot = torch.arange(width, device=q.device)
    scores = paged_dot(q, k_pool, tables, slot)  # [B, heads, width]
    candidate = (slot >= n_sink) & (slot < (num_slots - n_recent)[:, None])  # [B, width]
    scores = scores.masked_fill(~candidate[:, None], float("-inf"))
    top = torch.where(refresh[:, None, None], head_vote(scores, k, selection, kv_heads), cache.top[rows, layer])
    cache.top[rows, layer] = top  # [B, S, k]
    cache.q[rows, layer] = torch.where(refresh[:, None], flat, cached)
    cache.valid[rows, layer] = sparse.to(torch.int8)
    cache.counts[rows] += torch.stack([hit, sparse], 1).long()
    sets = top.shape[1]
    recent = (num_slots - n_recent)[:, None] + torch.arange(n_recent, device=q.device)  # [B, n_recent]
    chosen = torch.cat([slot[:n_sink].expand(batch, sets, -1), top, recent[:, None].expand(-1, sets, -1)], dim=-1)
    return torch.where(sparse[:, None, None], chosen, slot[:budget].expand(batch, sets, -1))


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


def accumulate_attention(logits: torch.Tensor, counts: torch.Tensor, pages: torch.Tensor, positions: torch.Tensor,
                         pos_pool: torch.Tensor, scores: torch.Tensor) -> None:
    """H2O's accumulated attention, updated in place. logits [B, heads, W] float32: scaled q . k of the logical slots
    [0, W) of each row, W = P * page_size; counts [B] resident slots (<= W); pages [B, P] physical pages of those
    slots (pages holding no resident slot must be the scratch page, which this reference may write); positions [B]
    the current token's position; pos_pool [pages, page_size, kv_heads] stored positions; scores [pages, page_size,
    kv_heads] float32. Each resident slot's score becomes (0 where its stored position is the current one, else its
    score) + the softmax of the row's logits over its resident slots, summed over the KV head's query group; other
    slots keep their scores. Normalised in float64, so that the result does not depend on the padded width."""
    batch, heads, width = logits.shape
    kv_heads = scores.shape[-1]
    resident = torch.arange(width, device=logits.device) < counts[:, None]  # [B, W]
    probs = torch.softmax(logits.double().masked_fill(~resident[:, None], float("-inf")), -1).float()
    added = probs.view(batch, kv_heads, -1, width).sum(2).transpose(1, 2)  # [B, W, kv_heads]
    old = scores[pages].flatten(1, 2)  # [B, W, kv_heads]
    fresh = pos_pool[pages].flatten(1, 2) == positions[:, None, None]
    new = torch.where(resident[..., None], torch.where(fresh, 0.0, old) + added, old)
    scores[pages] = new.view(batch, pages.shape[1], -1, kv_heads)


def prompt_attention_sums(q: torch.Tensor, k_pool: torch.Tensor, table: torch.Tensor, start: int, scale: float,
                          query_block: int = 256) -> torch.Tensor:
    """The attention each key of one sequence and layer receives from a prefill chunk (H2O's prompt scores).

    q [C, heads, D]: the chunk's queries, stored at slots [start, start + C), slot = position; table [max_pages];
    k_pool [pages, page_size, kv_heads, D] holds the keys of slots [0, start + C). Each query's causal softmax over
    those keys (logits `scale * q . k`, float32) is summed over the chunk's queries and each KV group's query heads:
    float32 [kv_heads, start + C]. Queries are taken `query_block` at a time, so at most [heads, query_block,
    start + C] logits exist at once."""
    chunk, n_heads, dim = q.shape
    kv_heads = k_pool.shape[2]
    end = start + chunk
    slots = torch.arange(end, device=q.device)
    rows = physical_rows(table[None], slots[None], k_pool.shape[1])[0]
    keys = k_pool.view(-1, kv_heads, dim)[rows].float()  # [end, kv_heads, D]
    grouped = q.view(chunk, kv_heads, n_heads // kv_heads, dim).float()
    sums = torch.zeros(kv_heads, end, dtype=torch.float32, device=q.device)
    for a in range(0, chunk, query_block):
        logits = torch.einsum("wkgd,nkd->kgwn", grouped[a : a + query_block], keys) * scale  # [KH, group, w, end]
        future = slots[None, :] > start + torch.arange(a, a + logits.shape[2], device=q.device)[:, None]  # [w, end]
        sums += torch.softmax(logits.masked_fill(future, float("-inf")), -1).sum((1, 2))
    return sums


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
) -> torch.Tensor:
    """A chunk of C query tokens stored at slots [start, start + C) of one sequence and layer.

    q [C, heads, D]; table [max_pages]; context: logical slots [S, n] (S in {1, kv_heads}) of earlier tokens the chunk
    attends to, or None for all slots < start. The chunk attends to itself causally. key_rope: cos/sin [>= n, D] by
    rank in the attended list (context, then the chunk). Returns [C, heads, D].
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
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v, attn_mask=mask, scale=scale, enable_gqa=kv_heads != n_heads
    )  # [1, heads, C, D]
    return out[0].transpose(0, 1)


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
