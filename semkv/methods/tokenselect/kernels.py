"""tokenselect's kernels: Triton on CUDA, the torch reference (`reference.py` beside this file) elsewhere."""
from __future__ import annotations

import torch

from semkv import kernels
from semkv.kernels import use_triton
from semkv.methods.tokenselect import reference


def token_select(q, k_pool, tables, num_slots, width, rows, cache, layer, parts, out_width, theta, selection,
                 kv_heads, tp=None, scales=None, pages=None):
    """See `reference.token_select`; the Triton path covers the soft vote and top-k with k >= 1 on one GPU (the
    hard vote, k = 0 and tensor parallelism, whose cosine and vote add over the ranks, run the reference)."""
    if use_triton(q.device) and selection != "hard_vote" and cache.top.shape[-1] > 0 and tp is None:
        from semkv.methods.tokenselect import triton_token_select as kernel

        return kernel.token_select(q, k_pool, tables, num_slots, width, rows, cache, layer, parts, out_width,
                                   theta, selection, kv_heads, scales=scales, pages=pages)
    return reference.token_select(q, k_pool, tables, num_slots, width, rows, cache, layer, parts, out_width, theta,
                                  selection, kv_heads, tp, scales, pages)


def head_vote(scores, k, selection, kv_heads, tp=None):
    """See `reference.head_vote`; the soft vote over a layer's heads on one GPU sums its softmaxes in Triton
    (`triton_soft_vote`), the rest runs the reference."""
    if use_triton(scores.device) and selection == "soft_vote" and kv_heads is None and tp is None and scores.dim() == 2:
        from semkv.methods.tokenselect import triton_soft_vote

        return triton_soft_vote.soft_vote(scores).topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    return reference.head_vote(scores, k, selection, kv_heads, tp)


def top_slots(q, k_pool, table, lo, hi, k, selection, kv_heads, tp=None):
    """The k voted slots among candidates [lo, hi) for the query q [heads, D], read through the page table: [S, k]
    ascending (the paged dot product, then `head_vote`)."""
    scores = kernels.paged_dot(q, k_pool, table, torch.arange(lo, hi, device=q.device))  # [heads, hi - lo]
    return head_vote(scores, k, selection, kv_heads, tp) + lo


def prefill_context(q, k_pool, table, sink, hi, start, k, selection, kv_heads, tp=None):
    """See `reference.prefill_context`; the soft vote over all heads on one GPU runs `triton_soft_vote`'s fused
    path, the rest `top_slots` (the paged dot product and the vote on their own kernels)."""
    if use_triton(q.device) and selection == "soft_vote" and kv_heads is None and tp is None:
        from semkv.methods.tokenselect import triton_soft_vote

        return triton_soft_vote.prefill_context(q, k_pool, table, sink, hi, start, k)
    return reference.around(top_slots(q, k_pool, table, sink, hi, k, selection, kv_heads, tp), sink, hi, start)
