"""Quest: query-aware page selection by an upper bound of attention (Tang et al., 2024, "QUEST: Query-Aware Sparsity
for Efficient Long-Context LLM Inference", https://arxiv.org/abs/2406.10774).

Every KV page keeps the element-wise min and max of its keys. At each decode step the current query bounds a page's
best attention logit by `sum_d max(q_d * max_d, q_d * min_d)`; each KV head attends to its top pages (the bound is
averaged over the query heads of the group, a reading for GQA models the paper does not cover; `group_reduce="max"`
takes the loosest bound instead). The page holding the current token is always attended. All K/V stay stored; only
attention is sparse. Quest pages are the engine's KV pages (zero-copy), 16 tokens by default as in the paper.

Parameters
----------
budget: attended tokens per KV head and layer; `budget // page_size` whole pages (at least one). A float is a
    fraction of the current context.
group_reduce: "mean" or "max" over the query heads of a KV group.
dense_layers: leading layers that attend densely; 0 here so every layer respects the budget (the paper uses 2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from semkv.engine.sequence import Sequence
from semkv.errors import SemkvError
from semkv.methods.base import DecodeBatch, KVMethod, Selection, check_range, resolve_budget
from semkv.methods.page_summaries import PageSummaries


def page_upper_bound(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, group_reduce: str) -> torch.Tensor:
    """q [B, heads, D], kmin/kmax [B, pages, kv_heads, D] -> bound [B, kv_heads, pages]. Since kmax >= kmin,
    max(q_d * max_d, q_d * min_d) is q_d * max_d where q_d >= 0 and q_d * min_d elsewhere: two matrix products."""
    batch, heads, dim = q.shape
    kv_heads = kmin.shape[2]
    qg = q.float().view(batch, kv_heads, heads // kv_heads, dim)
    bound = (torch.einsum("bhgd,bphd->bhgp", qg.clamp(min=0), kmax.float())
             + torch.einsum("bhgd,bphd->bhgp", qg.clamp(max=0), kmin.float()))  # [B, kv_heads, group, pages]
    return bound.mean(2) if group_reduce == "mean" else bound.amax(2)


@dataclass
class Quest(KVMethod):
    group_reduce: str = "mean"
    dense_layers: int = 0

    kind = "selection"
    name = "quest"
    summary = "Quest: per-head top pages by a min/max key bound on the query's attention, each decode step"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_reduce not in ("mean", "max"):
            raise SemkvError(f"group_reduce={self.group_reduce!r}; allowed: 'mean', 'max'")
        check_range("dense_layers", self.dense_layers, 0, None, int)
        self.summaries = PageSummaries(("min", "max"))

    def finish_prefill(self, seq: Sequence) -> None:
        for layer in range(seq.kv.pool.num_layers):
            self.summaries.build(seq.kv, layer)

    def select(self, layer: int, batch: DecodeBatch, q: torch.Tensor) -> Selection | None:
        pool = batch.seqs[0].kv.pool
        size = pool.page_size
        num_slots = batch.num_slots[:, layer]  # [B]
        n_pages = -(-num_slots // size)
        width = int(n_pages.max())
        tables = batch.tables[:, layer][:, :width]  # [B, width]
        self.summaries.add_tokens(pool, tables, (num_slots - 1)[:, None].expand(-1, pool.num_kv_heads))
        budgets = torch.tensor([resolve_budget(self.budget, s.num_computed + 1) for s in batch.seqs])
        if layer < self.dense_layers or bool((budgets >= num_slots.cpu()).all()):
            return None
        bound = page_upper_bound(q, self.summaries.gather("min", tables), self.summaries.gather("max", tables),
                                 self.group_reduce)  # [B, kv_heads, width]
        page_idx = torch.arange(width, device=q.device)[None, None, :]
        last = (n_pages - 1)[:, None, None]
        bound = bound.masked_fill(page_idx > last, float("-inf")).masked_fill(page_idx == last, float("inf"))
        keep_pages = torch.clamp(budgets.to(q.device) // size, min=1)
        keep_pages = torch.where(budgets.to(q.device) >= num_slots, n_pages, keep_pages)  # full budget: all pages
        k = int(keep_pages.max())
        top = torch.topk(bound, min(k, width), dim=-1).indices  # [B, kv_heads, k]
        rank_ok = torch.arange(top.shape[-1], device=q.device)[None, None, :] < keep_pages[:, None, None]
        mask = torch.zeros_like(bound, dtype=torch.bool)
        mask.scatter_(-1, top, rank_ok.expand_as(top))
        return Selection.from_pages(mask, size, num_slots)
