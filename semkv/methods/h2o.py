"""H2O: heavy hitters plus recent tokens, evicting during decoding (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for
Efficient Generative Inference of Large Language Models", https://arxiv.org/abs/2306.14048).

Every cached token accumulates the attention it receives from every query (all prompt queries, then each generated
token). The cache holds at most `budget` tokens per KV head and layer: the most recent ones and the heavy hitters
(highest accumulated attention); when it is full, each new token overwrites, per KV head, the resident token with the
lowest accumulated score outside the recent window.

Readings of the paper (each a choice a careful reimplementation makes):
- Prefill: the attention each prompt key receives from all prompt queries is accumulated chunk by chunk (never the
  full L x L matrix); at the end of prefill each KV head keeps its `budget - n_recent` top-scored tokens plus the last
  `n_recent` prompt tokens (the reference code's prompt-time selection).
- Decode: the victim is chosen in `begin_step`, before the new token's query is seen, so the cache never exceeds the
  budget and attention covers exactly `budget` tokens (the reference code attends over budget + 1 and evicts after).
  The new token's own attention is accumulated once it has attended, in `select`.
- GQA: a KV head's score is the sum of the attention its group's query heads give the key (the total attention mass
  the key carries; the argmin is the same as with the mean).
- The recent window after each step holds the `n_recent` most recent tokens, the new one included.

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

from semkv.engine.sequence import Sequence
from semkv.kernels import reference
from semkv.methods.base import DecodeBatch, KVMethod, check_range, keep_top, per_kv_head, resolve_budget, \
    window_attention

QUERY_BLOCK = 256  # prompt queries scored at once, so a chunk's scores stay [heads, 256, n]


@dataclass
class H2OState:
    """Per sequence: accumulated attention and original position of every resident slot."""

    prefill_scores: list[torch.Tensor] = field(default_factory=list)  # per layer [kv_heads, n], until prefill ends
    decode_scores: torch.Tensor | None = None  # [layers, kv_heads, n]: every layer holds the same count while decoding
    positions: torch.Tensor | None = None  # [layers, kv_heads, n]


@dataclass
class H2O(KVMethod):
    recent_ratio: float = 0.5

    name = "h2o"
    summary = "H2O: heavy hitters by accumulated attention + recent window; evicts the lightest token while decoding"
    kind = "decode_eviction"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("recent_ratio", self.recent_ratio, 0.0, 1.0, (int, float))

    def n_recent(self, budget: int) -> int:
        return int(budget * self.recent_ratio)

    def new_state(self, seq: Sequence) -> H2OState:
        layers, heads = seq.kv.pool.num_layers, seq.kv.pool.num_kv_heads
        n = len(seq.prompt_ids)
        return H2OState(prefill_scores=[torch.zeros(heads, n, device=seq.kv.pool.device) for _ in range(layers)])

    # -- prefill ----------------------------------------------------------------------------------------------------
    def observe_prefill(self, layer: int, seq: Sequence, q: torch.Tensor, start: int) -> None:
        """Add the attention the chunk's queries give every stored key (causal), block of queries by block."""
        kv, end = seq.kv, start + q.shape[0]
        keys = kv.gather(layer, torch.arange(end, device=q.device)[None])[0]  # [kv_heads, end, D]
        key_positions = torch.arange(end, device=q.device)[None].expand(keys.shape[0], -1)
        total = seq.method_state.prefill_scores[layer]
        for a in range(0, q.shape[0], QUERY_BLOCK):
            block = q[a : a + QUERY_BLOCK]
            probs = window_attention(block, keys, key_positions, torch.arange(start + a, start + a + len(block),
                                                                              device=q.device))  # [heads, w, end]
            total[:, :end] += per_kv_head(probs.sum(1), keys.shape[0], reduce="sum")

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
        state, kv = seq.method_state, seq.kv
        state.decode_scores = torch.stack([s[:, : kv.num_slots[i]] for i, s in enumerate(state.prefill_scores)])
        state.positions = torch.stack([kv.positions(i).long() for i in range(kv.pool.num_layers)])
        state.prefill_scores = []

    # -- decode -----------------------------------------------------------------------------------------------------
    def begin_step(self, batch: DecodeBatch) -> torch.Tensor:
        """Per sequence, layer and KV head: append while below the budget, else overwrite the lightest old token."""
        heads = batch.model.num_kv_heads
        write = batch.num_slots[:, :, None].expand(-1, -1, heads).clone()  # [B, layers, kv_heads]
        for b, seq in enumerate(batch.seqs):
            state, position = seq.method_state, int(batch.positions[b])
            capacity = resolve_budget(self.budget, position + 1)
            n = state.decode_scores.shape[-1]
            if n < capacity:
                fresh = state.positions[..., :1]  # [layers, kv_heads, 1]
                state.decode_scores = torch.cat([state.decode_scores, torch.zeros_like(fresh, dtype=torch.float)], -1)
                state.positions = torch.cat([state.positions, torch.full_like(fresh, position)], -1)
                continue
            recent = state.positions > position - self.n_recent(capacity)  # [layers, kv_heads, n]
            scores = state.decode_scores.masked_fill(recent, math.inf)
            victim = scores.argmin(-1, keepdim=True)  # [layers, kv_heads, 1]
            state.decode_scores.scatter_(-1, victim, 0.0)
            state.positions.scatter_(-1, victim, position)
            write[b] = victim[..., 0].to(write.device)
        return write

    def select(self, layer: int, batch: DecodeBatch, q: torch.Tensor) -> None:
        """Accumulate the current query's attention over the resident slots; attention itself stays dense."""
        pool = batch.seqs[0].kv.pool
        lengths = batch.num_slots[:, layer : layer + 1]  # [B, 1]
        _, probs = reference.decode_attention(q, pool.k, pool.v, batch.tables[:, layer], None, lengths,
                                              q.shape[-1] ** -0.5, return_probs=True)  # [B, heads, n]
        grouped = probs.view(batch.size, pool.num_kv_heads, -1, probs.shape[-1]).sum(2)  # [B, kv_heads, n]
        for b, seq in enumerate(batch.seqs):
            n = int(lengths[b])
            seq.method_state.decode_scores[layer, :, :n] += grouped[b, :, :n]
        return None
