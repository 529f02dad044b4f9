"""Plain-torch references of tokenselect's kernels: what the Triton kernels are tested against, and the CPU path."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from semkv.kernels.reference import paged_dot, physical_rows
from semkv.models.parallel import TensorParallel, cosine, over_heads


def vote_totals(scores: torch.Tensor, k: int | torch.Tensor, selection: str, kv_heads: int | None,
                tp: TensorParallel | None = None) -> torch.Tensor:
    """TokenSelect's selection functions (Eqs. 5-7) before the top-k: scores [..., heads, n] (q_h . k of each
    candidate, -inf where not a candidate) -> each candidate's total [..., S, n]. "soft_vote": softmax per head,
    summed over the heads; "top_k": the logits summed; "hard_vote": each head's top-k counted (k an int, or [B] per
    row of scores [B, heads, n]), ties broken by the soft vote. kv_heads None: one vote over all heads (S = 1), every
    rank's heads with tensor parallelism (`tp`); otherwise one per KV group (S = kv_heads)."""
    def per_set(x: torch.Tensor) -> torch.Tensor:  # [..., heads, n] -> [..., S, n]
        if kv_heads is None:
            return over_heads(tp, x, -2, "sum", keepdim=True)
        return x.unflatten(-2, (kv_heads, -1)).sum(-2)

    if selection == "top_k":
        return per_set(scores)
    soft = per_set(torch.softmax(scores, dim=-1))
    if selection == "soft_vote":
        return soft
    # hard vote; soft / (2 * voters) < 1 only breaks ties between equal counts
    if isinstance(k, int):
        hits = torch.zeros_like(scores).scatter_(-1, scores.topk(k, dim=-1).indices, 1.0)
    else:  # each row's own k: a head's rank of every candidate
        rank = scores.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        hits = (rank < k[:, None, None]).to(scores.dtype)
    voters = scores.shape[-2] // soft.shape[-2] * (tp.size if tp is not None and kv_heads is None else 1)
    return per_set(hits) + soft / (2 * voters)


def head_vote(scores: torch.Tensor, k: int, selection: str, kv_heads: int | None,
              tp: TensorParallel | None = None) -> torch.Tensor:
    """Indices of the k chosen candidates [..., S, k], ascending, by `vote_totals`."""
    return vote_totals(scores, k, selection, kv_heads, tp).topk(k, dim=-1).indices.sort(dim=-1).values


def prefill_context(q: torch.Tensor, k_pool: torch.Tensor, table: torch.Tensor, sink: int, hi: int, start: int,
                    k: int, selection: str = "soft_vote", kv_heads: int | None = None,
                    tp: TensorParallel | None = None) -> torch.Tensor:
    """A sparse prefill chunk's attended slots below `start`: the initial [0, sink), the k candidates of [sink, hi)
    that `head_vote` picks for the chunk's mean query q [heads, D], the recent [hi, start); [S, sink + k + start - hi]
    ascending (the picked slots lie between the two fixed ranges)."""
    scores = paged_dot(q, k_pool, table, torch.arange(sink, hi, device=q.device))  # [heads, hi - sink]
    return around(head_vote(scores, k, selection, kv_heads, tp) + sink, sink, hi, start)


def around(top: torch.Tensor, sink: int, hi: int, start: int) -> torch.Tensor:
    """Slots [0, sink), then top [S, k] (ascending, within [sink, hi)), then [hi, start): [S, sink + k + start - hi]."""
    lead, tail = (torch.arange(a, b, device=top.device).expand(top.shape[0], -1) for a, b in ((0, sink), (hi, start)))
    return torch.cat([lead, top, tail], dim=1)


def row_top(totals: torch.Tensor, k: torch.Tensor, width: int) -> torch.Tensor:
    """Each row's k[b] <= width highest totals [B, S, n] -> [B, S, width], ascending, then 0 (a top-`width` pass,
    not a sort of the n totals)."""
    order = totals.topk(min(width, totals.shape[-1]), dim=-1).indices  # [B, S, <= width] best first
    last = torch.iinfo(torch.long).max
    keep = torch.arange(order.shape[-1], device=k.device) < k[:, None, None]
    top = torch.where(keep, order, last).sort(dim=-1).values
    return F.pad(torch.where(top == last, 0, top), (0, width - order.shape[-1]))


def split_parts(budget: torch.Tensor, n_sink: int, n_recent: int) -> torch.Tensor:
    """TokenSelect's split of each row's budget [B] (`TokenSelect.split`, on the device) -> (initial, k, recent)
    attended slots [B, 3]."""
    sink = torch.minimum(budget // 8, torch.full_like(budget, n_sink))
    recent = torch.minimum((budget // 4).clamp(min=1), torch.full_like(budget, n_recent))
    return torch.stack([sink, budget - sink - recent, recent], 1)


@dataclass
class SelectionCacheBuffers:
    """TokenSelect's Selection Cache on the device, one row per running sequence (row 0 is scratch for padding
    rows): the query of each layer's last selection q [rows, layers, heads * D] float32, its top-k slots
    top [rows, layers, S, k_max] (the first k of the entry's split), the budget the entry was selected under
    valid [rows, layers] int32 (0: nothing to reuse; a hit needs the same budget, so the same split), and per row
    the hits and lookups so far counts [rows, 2]."""

    q: torch.Tensor
    top: torch.Tensor
    valid: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, layers: int, query_size: int, sets: int, k: int,
                 device: torch.device) -> "SelectionCacheBuffers":
        return cls(q=torch.zeros(rows, layers, query_size, dtype=torch.float32, device=device),
                   top=torch.zeros(rows, layers, sets, k, dtype=torch.long, device=device),
                   valid=torch.zeros(rows, layers, dtype=torch.int32, device=device),
                   counts=torch.zeros(rows, 2, dtype=torch.long, device=device))


def compact_slots(pages: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Compact slots [B, ...] of a list of pages [B, count] (`kernels.page_candidates`) -> the slots they stand
    for."""
    flat = slots.flatten(1)
    page = torch.gather(pages, 1, (flat // page_size).clamp(max=pages.shape[1] - 1))
    return (page * page_size + flat % page_size).view_as(slots)


def token_select(q: torch.Tensor, k_pool: torch.Tensor, tables: torch.Tensor, num_slots: torch.Tensor, width: int,
                 rows: torch.Tensor, cache: SelectionCacheBuffers, layer: int, parts: torch.Tensor, out_width: int,
                 theta: float, selection: str, kv_heads: int | None, tp: TensorParallel | None = None,
                 scales: torch.Tensor | None = None,
                 pages: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One layer of TokenSelect's decode selection for a batch, Selection Cache included (Algorithm 1).

    q [B, heads, D] current queries; tables [B, max_pages]; num_slots [B] stored slots (current token included);
    width >= num_slots; rows [B] each sequence's row in `cache`; parts [B, 3] each row's (initial, k, recent) split
    of its budget (`split_parts`; k <= cache.top.shape[-1]); out_width >= every row's budget. A row with more slots
    than its budget is sparse: it looks its query up in the cache (a hit: the entry holds the same budget and
    cos(q, cached q) >= theta) and on a miss votes anew among the candidates [initial, num_slots - recent) and stores
    query and top-k. Returns slots [B, S, out_width] ascending: the initial slots, the top-k and the recent slots of
    a sparse row, 0..out_width-1 for the others (the caller masks by length min(num_slots, budget)). Updates
    `cache` in place; `triton_token_select.py` does the same in kernels that skip hit rows. With `scales` [pages,
    page_size, kv_heads], k_pool is an int8 key sketch (`KeySketch`) and a score is its dot product times the
    slot's scale. With `pages` (`kernels.page_candidates`' pages and span), tables [B, count] are the physical ids
    of those pages and width = count * page_size: only the span's compact slots are scored, and the cache and the
    result hold the slots they stand for."""
    sink, k, recent = parts.unbind(1)  # [B] each
    budget = parts.sum(1)  # [B]
    flat = q.flatten(1).float()  # [B, heads * D]
    cached = cache.q[rows, layer]
    sparse = num_slots > budget  # [B]
    similar = cosine(tp, flat, cached) >= theta  # over every rank's heads
    hit = sparse & (cache.valid[rows, layer] == budget) & similar
    refresh = sparse & ~hit
    slot = torch.arange(width, device=q.device)
    scores = paged_dot(q, k_pool, tables, slot)  # [B, heads, width]
    if scales is not None:  # each slot's scale, for the query heads of its KV group
        groups = scales.shape[2]
        at = physical_rows(tables, slot.expand(tables.shape[0], -1), scales.shape[1])  # [B, width] flat rows
        scale = scales.view(-1, groups)[at].transpose(1, 2)  # [B, kv_heads, width]
        scores = scores * scale.repeat_interleave(q.shape[1] // groups, dim=1)
    lo, hi = (sink, num_slots - recent) if pages is None else pages[1].unbind(1)
    candidate = (slot >= lo[:, None]) & (slot < hi[:, None])  # [B, width]
    scores = scores.masked_fill(~candidate[:, None], float("-inf"))
    voted = row_top(vote_totals(scores, k, selection, kv_heads, tp), k, cache.top.shape[-1])  # [B, S, k_max]
    if pages is not None:
        voted = compact_slots(pages[0], voted, k_pool.shape[1])
    top = torch.where(refresh[:, None, None], voted, cache.top[rows, layer])
    cache.top[rows, layer] = top
    cache.q[rows, layer] = torch.where(refresh[:, None], flat, cached)
    cache.valid[rows, layer] = torch.where(sparse, budget, 0).int()
    cache.counts[rows] += torch.stack([hit, sparse], 1).long()
    j = torch.arange(out_width, device=q.device)[None]  # [1, out_width]
    in_top = (j - sink[:, None]).clamp(0, top.shape[-1] - 1)  # [B, out_width]
    from_top = torch.gather(top, 2, in_top[:, None].expand(-1, top.shape[1], -1))  # [B, S, out_width]
    recent_slot = num_slots[:, None] - budget[:, None] + j  # [B, out_width]: the recent part's slots
    chosen = torch.where((j < sink[:, None])[:, None], j[:, None],
                         torch.where((j < (sink + k)[:, None])[:, None], from_top, recent_slot[:, None]))
    return torch.where(sparse[:, None, None], chosen, j[:, None].expand_as(chosen))
