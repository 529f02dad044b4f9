"""Plain-torch references of h2o's kernels: what the Triton kernels are tested against, and the CPU path."""
from __future__ import annotations

import torch

from semkv.kernels.reference import physical_rows


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
                          lse: torch.Tensor, query_block: int = 256) -> torch.Tensor:
    """The attention each key of one sequence and layer receives from a prefill chunk (H2O's prompt scores).

    q [C, heads, D]: the chunk's queries, stored at slots [start, start + C), slot = position; table [max_pages];
    k_pool [pages, page_size, kv_heads, D] holds the keys of slots [0, start + C); lse [C, heads]: each query's
    log-sum-exp over its causal keys (the prefill attention's, `kernels.prefill_attention(lse=True)`). Each query's
    probabilities `exp(scale * q . k - lse)` (float32) are summed over the chunk's queries and each KV group's query
    heads: float32 [kv_heads, start + C]. Queries are taken `query_block` at a time, so at most
    [heads, query_block, start + C] logits exist at once."""
    chunk, n_heads, dim = q.shape
    kv_heads = k_pool.shape[2]
    end = start + chunk
    slots = torch.arange(end, device=q.device)
    rows = physical_rows(table[None], slots[None], k_pool.shape[1])[0]
    keys = k_pool.view(-1, kv_heads, dim)[rows].float()  # [end, kv_heads, D]
    grouped = q.view(chunk, kv_heads, n_heads // kv_heads, dim).float()
    norms = lse.view(chunk, kv_heads, -1).permute(1, 2, 0)  # [KH, group, C]
    sums = torch.zeros(kv_heads, end, dtype=torch.float32, device=q.device)
    for a in range(0, chunk, query_block):
        logits = torch.einsum("wkgd,nkd->kgwn", grouped[a : a + query_block], keys) * scale  # [KH, group, w, end]
        future = slots[None, :] > start + torch.arange(a, a + logits.shape[2], device=q.device)[:, None]  # [w, end]
        probs = torch.exp(logits - norms[:, :, a : a + query_block, None]).masked_fill(future, 0.0)
        sums += probs.sum((1, 2))
    return sums
