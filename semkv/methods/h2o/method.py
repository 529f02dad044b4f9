"""H2O: heavy hitters plus recent tokens, evicting during decoding (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for
Efficient Generative Inference of Large Language Models", https://arxiv.org/abs/2306.14048).

Every cached token accumulates the attention it receives from every query (all prompt queries, then each generated
token). The cache holds at most `budget` tokens per KV head and layer: the most recent ones and the heavy hitters
(highest accumulated attention); when it is full, each new token overwrites, per KV head, the resident token with the
lowest accumulated score outside the recent window.

Readings of the paper (each a choice a careful reimplementation makes):
- Prefill: the attention each prompt key receives from all prompt queries is accumulated chunk by chunk (never the
  full L x L matrix; on the GPU one Triton pass over the paged keys, `kernels.prompt_attention_sums`, normalised by
  the log-sum-exps the prefill attention kernel already computed); at the end
  of prefill each KV head keeps its `budget - n_recent` top-scored tokens plus the last `n_recent` prompt tokens (the
  reference code's prompt-time selection).
- Decode: the victim is chosen in `begin_step`, before the new token's query is seen, so the cache never exceeds the
  budget and attention covers exactly `budget` tokens (the reference code attends over budget + 1 and evicts after).
  The new token's own attention is accumulated once it has attended, in `select`.
- GQA: a KV head's score is the sum of the attention its group's query heads give the key (the total attention mass
  the key carries; the argmin is the same as with the mean).
- The recent window after each step holds the `n_recent` most recent tokens, the new one included.

Decoding is batched and captured in CUDA graphs: the accumulated scores live beside the KV pool, one float32 per
physical slot and KV head (`page_storage.slot_scores`), read and updated through the page tables like the keys; the
recent window comes from the positions the pool stores. `begin_step` (before the forward) picks every evicting row's
victims in one masked argmin; `select` (inside the graph) scores the resident keys with the paged dot-product kernel
and hands the logits to `kernels.accumulate_attention`, which softmaxes over each row's resident slots and adds the
result, restarting at zero the slot that holds the new token.

Parameters
----------
budget: resident tokens per KV head and layer (int), or a fraction of the current context (float).
recent_ratio: share of the budget for the recent window, 0.5 (the paper's equal heavy / recent split, e.g. 10% + 10%);
    `n_recent = floor(budget * recent_ratio)`, the rest are heavy hitters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from semkv import kernels
from semkv.engine.hooks import DecodeBatch, KVMethod, resolve_budget
from semkv.engine.kv_cache import KVPool, stack_tables
from semkv.engine.sequence import Sequence
from semkv.errors import check_range
from semkv.methods.base import keep_top
from semkv.methods.h2o import kernels as h2o_kernels
from semkv.methods.state.page_storage import resident_pages, slot_scores


@dataclass
class H2OState:
    """Per sequence, until its prefill ends: the attention each prompt key received."""

    prefill_scores: list[torch.Tensor] = field(default_factory=list)  # per layer [kv_heads, n]


@dataclass
class H2O(KVMethod):
    recent_ratio: float = 0.5

    name = "h2o"
    summary = "H2O: heavy hitters by accumulated attention + recent window; evicts the lightest token while decoding"
    kind = "decode_eviction"
    graph_safe = True
    prefill_lse = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("recent_ratio", self.recent_ratio, 0.0, 1.0, (int, float))

    def reset(self) -> None:
        self.scores = slot_scores()

    def n_recent(self, budget: int) -> int:
        return int(budget * self.recent_ratio)

    def new_state(self, seq: Sequence) -> H2OState:
        return H2OState()

    def admit(self, seq: Sequence) -> None:
        """The prompt's attention sums, one [kv_heads, n] per layer, until its prefill ends."""
        pool, n = seq.kv.pool, len(seq.prompt_ids)
        seq.method_state.prefill_scores = [torch.zeros(pool.num_kv_heads, n, device=pool.device)
                                           for _ in range(pool.num_layers)]

    def admission_bytes(self, seq: Sequence) -> int:
        pool = seq.kv.pool
        return pool.num_layers * pool.num_kv_heads * len(seq.prompt_ids) * 4 + self.scores.growth_bytes(pool)

    def page_state_bytes(self, pool: KVPool) -> int:
        return self.scores.bytes_per_page(pool)

    def batch_state_bytes(self, seq: Sequence, batch: int) -> int:
        pool = seq.kv.pool  # each request's prompt scores; the decode scores are kept by page (`page_state_bytes`)
        return batch * pool.num_layers * pool.num_kv_heads * len(seq.prompt_ids) * 4

    # -- prefill ----------------------------------------------------------------------------------------------------
    def observe_prefill(self, layer: int, seq: Sequence, q: torch.Tensor, start: int,
                        lse: torch.Tensor | None) -> None:
        """Add the attention the chunk's queries give every stored key (causal; `kernels.prompt_attention_sums`,
        normalised by the log-sum-exps the prefill attention computed)."""
        kv = seq.kv
        received = h2o_kernels.prompt_attention_sums(q, kv.pool.k, kv.table[layer], start, q.shape[-1] ** -0.5, lse)
        seq.method_state.prefill_scores[layer][:, : received.shape[1]] += received

    def evict_prefill(self, layer: int, seq: Sequence, q_window: torch.Tensor) -> torch.Tensor | None:
        n = seq.kv.num_slots[layer]
        n_keep = resolve_budget(self.budget, n)
        if n_keep >= n:
            return None
        state = seq.method_state
        recent = torch.arange(n, device=q_window.device) >= n - self.n_recent(n_keep)
        keep = keep_top(state.prefill_scores[layer][:, :n], n_keep, recent)  # [kv_heads, n_keep]
        state.prefill_scores[layer] = torch.gather(state.prefill_scores[layer], 1, keep)
        return keep

    def finish_prefill(self, seq: Sequence) -> None:
        """Move the kept prompt slots' scores into the pool-side storage."""
        state, kv = seq.method_state, seq.kv
        flat = self._score_storage(kv.pool).view(-1, kv.pool.num_kv_heads)  # [pages * page_size, kv_heads]
        for layer, scores in enumerate(state.prefill_scores):
            n = kv.num_slots[layer]
            flat[kv.physical(layer, torch.arange(n, device=scores.device))] = scores[:, :n].T
        state.prefill_scores = []

    def _score_storage(self, pool: KVPool) -> torch.Tensor:
        """The pool-side scores, grown with the pool first (a move makes captured graphs be captured again)."""
        if self.scores.ensure(pool):
            self.graph_epoch += 1
        return self.scores.data

    # -- decode -----------------------------------------------------------------------------------------------------
    def begin_step(self, batch: DecodeBatch) -> torch.Tensor:
        """Per sequence, layer and KV head: append while below the budget, else overwrite the lightest token outside
        the recent window. Which rows evict is known on the host; their victims come from one masked argmin."""
        seqs, heads = batch.seqs, batch.model.num_kv_heads
        write = batch.num_slots[:, :, None].expand(-1, -1, heads).clone()  # [B, layers, kv_heads]
        capacity = [resolve_budget(self.budget, seq.num_computed + 1) for seq in seqs]  # the current token's context
        evicting = [b for b, seq in enumerate(seqs) if max(seq.kv.num_slots) >= capacity[b]]
        if not evicting:
            return write
        pool = seqs[0].kv.pool
        # per evicting row, one copy: its index, budget, the oldest position of the recent window, slot counts
        host = pool.staging.send([[b, capacity[b], seqs[b].num_computed - self.n_recent(capacity[b]),
                                   *seqs[b].kv.num_slots] for b in evicting])  # [E, 3 + layers]
        index, budget, oldest_recent, counts = host[:, 0], host[:, 1], host[:, 2], host[:, 3:]
        width = max(max(seqs[b].kv.num_slots) for b in evicting)
        pages = resident_pages(pool, stack_tables([seqs[b].kv.table for b in evicting]), counts, width)  # [E, L, P]
        valid = torch.arange(pages.shape[-1] * pool.page_size, device=pages.device) < counts[..., None]  # [E, L, W]
        positions = pool.pos[pages].flatten(2, 3)  # [E, layers, W, kv_heads]
        protected = (positions > oldest_recent[:, None, None, None]) | ~valid[..., None]
        victim = self.scores.data[pages].flatten(2, 3).masked_fill(protected, math.inf).argmin(2)  # [E, L, kv_heads]
        full = (counts >= budget[:, None])[..., None]  # [E, layers, 1]
        write[index] = torch.where(full, victim, write[index])
        return write

    def select(self, layer: int, batch: DecodeBatch, q: torch.Tensor) -> None:
        """Add the current query's attention over the resident slots to their scores (the new token's slot starts
        at zero); attention itself stays dense. From the batch tensors alone: the width is the capacity under a
        CUDA graph (the budget at the longest context), the widest row in an eager step. q [B, heads, D]."""
        pool = batch.pool
        scores = self._score_storage(pool)
        eager = not batch.graphed
        width = batch.max_slots if eager else min(resolve_budget(self.budget, batch.max_slots), batch.max_slots)
        counts = batch.num_slots[:, layer]  # [B]
        pages = resident_pages(pool, batch.tables[:, layer], counts, width)  # [B, P]
        slots = torch.arange(pages.shape[-1] * pool.page_size, device=q.device)  # [W'], whole pages
        logits = kernels.paged_dot(q, pool.k, pages, slots) * q.shape[-1] ** -0.5  # [B, heads, W'] float32
        h2o_kernels.accumulate_attention(logits, counts, pages, batch.positions, pool.pos, scores)
        return None
