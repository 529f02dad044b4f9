"""Quest: query-aware page selection by an upper bound of attention (Tang et al., 2024, "QUEST: Query-Aware Sparsity
for Efficient Long-Context LLM Inference", https://arxiv.org/abs/2406.10774).

Every KV page keeps the element-wise min and max of its keys. At each decode step the current query bounds a page's
best attention logit by `sum_d max(q_d * max_d, q_d * min_d)`; each KV head attends to its top pages (the bound is
averaged over the query heads of the group, a reading for GQA models the paper does not cover; `group_reduce="max"`
takes the loosest bound instead). The page holding the current token is always attended. All K/V stay stored; only
attention is sparse. Quest pages are the engine's KV pages (zero-copy), 16 tokens by default as in the paper. The
min / max summaries are kept in the cache's dtype (exact: they are stored keys), as the paper keeps them in fp16;
the bound of every page is one kernel (`kernels.page_bound`) and the selection uses the batch tensors alone, so the
decode step replays in a CUDA graph.

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

from semkv import kernels
from semkv.engine.hooks import DecodeBatch, KVMethod, Selection, budget_tokens, resolve_budget
from semkv.engine.kv_cache import KVPool
from semkv.engine.sequence import Sequence
from semkv.errors import check_choice, check_range
from semkv.methods.state.page_summaries import PageSummaries


@dataclass
class Quest(KVMethod):
    group_reduce: str = "mean"
    dense_layers: int = 0

    kind = "selection"
    graph_safe = True  # `select` works from the batch tensors alone
    name = "quest"
    summary = "Quest: per-head top pages by a min/max key bound on the query's attention, each decode step"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("group_reduce", self.group_reduce, ("mean", "max"))
        check_range("dense_layers", self.dense_layers, 0, None, int)

    def reset(self) -> None:
        self.summaries = PageSummaries(("min", "max"))

    def admission_bytes(self, seq: Sequence) -> int:
        return self.summaries.growth_bytes(seq.kv.pool)

    def page_state_bytes(self, pool: KVPool) -> int:
        return self.summaries.bytes_per_page(pool)

    def batch_state_bytes(self, seq: Sequence, batch: int) -> int:
        return 0  # its state is kept by page (`page_state_bytes`)

    def finish_prefill(self, seq: Sequence) -> None:
        for layer in range(seq.kv.pool.num_layers):
            self.summaries.build(seq.kv, layer)

    def select(self, layer: int, batch: DecodeBatch, q: torch.Tensor) -> Selection | None:
        """Each KV head's top pages by the bound, from the batch tensors alone (no value read back, so the step is
        captured in a CUDA graph): fixed shapes from the capacity `batch.max_slots`, each row cut by its own budget
        (a fraction resolves against the row's own context). q [B, heads, D]."""
        pool = batch.pool
        size, kv_heads = pool.page_size, pool.num_kv_heads
        n = batch.num_slots[:, layer]  # [B] stored slots, the current token included
        width = min(batch.tables.shape[-1], -(-batch.max_slots // size))  # pages any row may hold
        tables = batch.tables[:, layer, :width]  # [B, width]
        capacity = resolve_budget(self.budget, batch.max_slots)  # the largest budget of any row
        dense = layer < self.dense_layers or (not isinstance(self.budget, float) and capacity >= batch.max_slots)
        if not dense and not batch.graphed:  # eager step: dense rows are known on the host
            dense = all(resolve_budget(self.budget, s.num_computed + 1) >= s.kv.num_slots[layer] for s in batch.seqs)
        if dense:  # every row attends to all its slots; the summaries still take the current key
            self.summaries.add_tokens(pool, tables, (n - 1)[:, None].expand(-1, kv_heads))
            return None
        self.summaries.ensure(pool)
        budget = budget_tokens(self.budget, batch.positions + 1)  # [B] tokens per row at its context
        bound = kernels.page_bound(q, self.summaries.data["min"], self.summaries.data["max"], tables, n, size,
                                   self.group_reduce, k_pool=pool.k)  # [B, kv_heads, width]; the current key folded
        top = torch.topk(bound, min(-(-capacity // size), width), dim=-1).indices  # [B, kv_heads, k] best first
        return Selection(*kernels.page_slots(top, budget, n, size))
