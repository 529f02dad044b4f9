"""Plain-torch references of sentencekv's kernels: what the Triton kernels are tested against, and the CPU path."""
from __future__ import annotations

import torch

from semkv.kernels.reference import compact_chosen, paged_dot


def sentence_tokens(bucket: torch.Tensor, rows: torch.Tensor, before: torch.Tensor, first: torch.Tensor,
                    retained: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
    """The tokens that ranked buckets take up to a capacity: buckets fill it in rank order and the last one keeps its
    leading tokens (token t of bucket k is taken when before[k] + t - first[k] < capacity). bucket [rows, S or 1, T]
    the bucket of every token of each state row (one map per KV head or one shared), rows [B] the batch's state rows,
    before / first [B, S, buckets] (`kernels.bucket_take`), retained / capacity [B]. -> bool [B, S, T] (token t:
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
    return compact_chosen(chosen, n, n_sink, tail, max_sink, width)


def bucket_best(q: torch.Tensor, k_pool: torch.Tensor, tables: torch.Tensor, bucket: torch.Tensor,
                rows: torch.Tensor, n_sink: torch.Tensor, retained: torch.Tensor, buckets: int) -> torch.Tensor:
    """Each bucket's best retained token for the query (SentenceKV's score="tokens"): the query of each KV group (the
    float32 mean of its heads of q [B, heads, D], in the pool's dtype) against the keys of the retained tokens t <
    retained[b], at slots n_sink[b] + t of k_pool [pages, page_size, kv_heads, D] through tables [B, max_pages] (one
    layer), maximised over the tokens of each bucket (bucket [rows, kv_heads or 1, T] the bucket of every retained
    token of each state row, rows [B] the batch's). Returns float32 [B, kv_heads, buckets], -inf for a bucket with
    no retained token."""
    batch, heads, dim = q.shape
    kv_heads, tokens = k_pool.shape[2], bucket.shape[-1]
    query = q.float().view(batch, kv_heads, heads // kv_heads, dim).mean(2).to(k_pool.dtype)  # [B, kv_heads, D]
    width = min(int(n_sink.max()) + tokens, tables.shape[-1] * k_pool.shape[1])
    dots = paged_dot(query, k_pool, tables, torch.arange(width, device=query.device))  # [B, H, width] float32
    t = torch.arange(tokens, device=query.device)
    at = (n_sink[:, None] + t).clamp(max=width - 1)[:, None].expand(-1, dots.shape[1], -1)
    dots = dots.gather(2, at).masked_fill((t >= retained[:, None])[:, None], float("-inf"))  # [B, H, T]
    best = dots.new_full((*dots.shape[:2], buckets), float("-inf"))
    return best.scatter_reduce(2, bucket[rows].long().expand_as(dots), dots, "amax")
