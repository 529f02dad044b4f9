"""Plain-torch references of dynsplit's kernels: what the Triton kernels are tested against, and the CPU path."""
from __future__ import annotations

import torch

from semkv.kernels.reference import compact_chosen, paged_dot, physical_rows


def chunk_slots(lo: torch.Tensor, count: torch.Tensor, before: torch.Tensor, n: torch.Tensor, n_sink: torch.Tensor,
                capacity: torch.Tensor, tail: torch.Tensor, max_sink: int, width: int,
                longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attended slots from ranked chunks (DynSplit-KV): chunks are ascending, disjoint slot ranges [lo, lo + count)
    (lo / count [B, chunks], at most `longest` slots each) inside [n_sink, n - tail); each takes its leading
    clamp(capacity - before, 0, count) slots (before [B, S, chunks]: `kernels.bucket_take`), between the sinks
    [0, n_sink) and the last `tail` slots. n / n_sink / capacity / tail [B]; max_sink bounds n_sink, width a row's
    total. Returns slots [B, S, width], ascending and then 0, and lengths [B, S]."""
    take = (capacity[:, None, None] - before).clamp(min=0).minimum(count[:, None])  # [B, S, chunks]
    lo = lo[:, None].expand_as(take)
    tokens = max(int((n - n_sink).max()), 1)  # slots after the sinks: token t is slot n_sink + t
    edges = torch.zeros(*take.shape[:2], tokens + 1, dtype=torch.long, device=take.device)
    start = (lo - n_sink[:, None, None]).clamp(0, tokens)
    edges.scatter_add_(-1, start, (take > 0).long())
    edges.scatter_add_(-1, (start + take).clamp(max=tokens), -(take > 0).long())
    chosen = edges.cumsum(-1)[..., :tokens] > 0  # [B, S, T]: inside a chunk's taken slots
    return compact_chosen(chosen, n, n_sink, tail, max_sink, width)


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


def chunk_best(q: torch.Tensor, k_pool: torch.Tensor, tables: torch.Tensor, chunk_of: torch.Tensor, lo: torch.Tensor,
               hi: torch.Tensor, chunks: int, group_reduce: str, kept: torch.Tensor | None = None) -> torch.Tensor:
    """Each chunk's best token for the current query (DynSplit-KV's score="tokens"): q [B, heads, D] against the keys
    of slots [lo, hi) of each row (lo / hi [B], within the first `width` slots) of k_pool [pages, page_size,
    kv_heads, D] through tables [B, max_pages] (one layer); the dot products reduced over each KV group's query heads
    ("mean" or "max") and maximised over the slots of each chunk (chunk_of [B, width]: the chunk of each slot, below
    `chunks`). With kept [B, >= width / page_size] (uint8, 1: kept), only the slots of kept pages are scored
    (score_keys="pages"). Returns float32 [B, kv_heads, chunks], -inf for a chunk with no slot in range."""
    width = chunk_of.shape[1]
    slots = torch.arange(width, device=q.device)
    dots = paged_dot(q, k_pool, tables, slots)  # [B, heads, width] float32
    kv_heads = k_pool.shape[2]
    dots = dots.view(dots.shape[0], kv_heads, -1, width)
    dots = dots.mean(2) if group_reduce == "mean" else dots.amax(2)  # [B, kv_heads, width]
    inside = (slots >= lo[:, None]) & (slots < hi[:, None])  # [B, width]
    if kept is not None:
        inside &= kept[:, slots // k_pool.shape[1]] != 0
    dots = dots.masked_fill(~inside[:, None], float("-inf"))
    best = dots.new_full((dots.shape[0], kv_heads, chunks), float("-inf"))
    return best.scatter_reduce(2, chunk_of.long()[:, None].expand_as(dots), dots, "amax")
