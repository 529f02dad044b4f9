"""Plain-torch references of tokenselect's kernels: what the Triton kernels are tested against, and the CPU path."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from semkv.kernels.reference import paged_dot
from semkv.models.parallel import TensorParallel, cosine, over_heads


def head_vote(scores: torch.Tensor, k: int, selection: str, kv_heads: int | None,
              tp: TensorParallel | None = None) -> torch.Tensor:
    """TokenSelect's selection functions (Eqs. 5-7): scores [..., heads, n] (q_h . k of each candidate, -inf where
    not a candidate) -> indices of the k chosen candidates [..., S, k], ascending. "soft_vote": softmax per head,
    summed over the heads; "top_k": the logits summed; "hard_vote": each head's top-k counted, ties broken by the
    soft vote. kv_heads None: one vote over all heads (S = 1), every rank's heads with tensor parallelism (`tp`);
    otherwise one per KV group (S = kv_heads)."""
    def per_set(x: torch.Tensor) -> torch.Tensor:  # [..., heads, n] -> [..., S, n]
        if kv_heads is None:
            return over_heads(tp, x, -2, "sum", keepdim=True)
        return x.unflatten(-2, (kv_heads, -1)).sum(-2)

    if selection == "top_k":
        total = per_set(scores)
    else:
        soft = per_set(torch.softmax(scores, dim=-1))
        if selection == "soft_vote":
            total = soft
        else:  # hard vote; soft / (2 * voters) < 1 only breaks ties between equal counts
            hits = torch.zeros_like(scores).scatter_(-1, scores.topk(k, dim=-1).indices, 1.0)
            voters = scores.shape[-2] // soft.shape[-2] * (tp.size if tp is not None and kv_heads is None else 1)
            total = per_set(hits) + soft / (2 * voters)
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
                 theta: float, selection: str, kv_heads: int | None,
                 tp: TensorParallel | None = None) -> torch.Tensor:
    """One layer of TokenSelect's decode selection for a batch, Selection Cache included (Algorithm 1).

    q [B, heads, D] current queries; tables [B, max_pages]; num_slots [B] stored slots (current token included);
    width >= num_slots; rows [B] each sequence's row in `cache`. With k = cache.top.shape[-1] and
    budget = n_sink + k + n_recent, a row with more than `budget` slots is sparse: it looks its query up in the
    cache (a hit: the entry is valid and cos(q, cached q) >= theta) and on a miss votes anew among the candidates
    [n_sink, num_slots - n_recent) and stores query and top-k. Returns slots [B, S, budget] ascending: the sinks,
    the top-k and the recent slots of a sparse row, 0..budget-1 for the others (the caller masks by length).
    Updates `cache` in place; `triton_token_select.py` does the same in kernels that skip hit rows."""
    batch, n_heads, _ = q.shape
    k = cache.top.shape[-1]
    budget = n_sink + k + n_recent
    flat = q.flatten(1).float()  # [B, heads * D]
    cached = cache.q[rows, layer]
    sparse = num_slots > budget  # [B]
    similar = cosine(tp, flat, cached) >= theta  # over every rank's heads
    hit = sparse & (cache.valid[rows, layer] != 0) & similar
    refresh = sparse & ~hit
    slot = torch.arange(width, device=q.device)
    scores = paged_dot(q, k_pool, tables, slot)  # [B, heads, width]
    candidate = (slot >= n_sink) & (slot < (num_slots - n_recent)[:, None])  # [B, width]
    scores = scores.masked_fill(~candidate[:, None], float("-inf"))
    top = torch.where(refresh[:, None, None], head_vote(scores, k, selection, kv_heads, tp), cache.top[rows, layer])
    cache.top[rows, layer] = top  # [B, S, k]
    cache.q[rows, layer] = torch.where(refresh[:, None], flat, cached)
    cache.valid[rows, layer] = sparse.to(torch.int8)
    cache.counts[rows] += torch.stack([hit, sparse], 1).long()
    sets = top.shape[1]
    recent = (num_slots - n_recent)[:, None] + torch.arange(n_recent, device=q.device)  # [B, n_recent]
    chosen = torch.cat([slot[:n_sink].expand(batch, sets, -1), top, recent[:, None].expand(-1, sets, -1)], dim=-1)
    return torch.where(sparse[:, None, None], chosen, slot[:budget].expand(batch, sets, -1))
