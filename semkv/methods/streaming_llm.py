"""StreamingLLM: attention sinks plus a sliding window of recent tokens (Xiao et al., 2024, "Efficient Streaming
Language Models with Attention Sinks", https://arxiv.org/abs/2309.17453).

The cache keeps the first `n_sink` tokens and the most recent `budget - n_sink`. At the end of prefill the middle of
the prompt is evicted; during decoding, once the cache holds `budget` tokens, each new token overwrites the oldest
non-sink slot, so resident memory stays at the budget. Keys are stored after RoPE, i.e.
with their original positions (the paper's in-cache re-positioning is not used; with the budget at least the context
the result equals Full KV exactly).

Parameters
----------
budget: resident tokens per KV head and layer, sinks included (a float: fraction of the current context).
n_sink: attention sinks, 4 (the paper's default).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from semkv.engine.hooks import DecodeBatch, KVMethod, resolve_budget
from semkv.engine.sequence import Sequence
from semkv.errors import check_range


@dataclass
class StreamingLLM(KVMethod):
    n_sink: int = 4

    name = "streaming_llm"
    summary = "StreamingLLM: attention sinks + recent window; evicts the oldest token as generation goes on"
    kind = "decode_eviction"
    graph_safe = True  # `begin_step` picks the write slots before the forward; decoding attends to every slot

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("n_sink", self.n_sink, 0, None, int)

    def new_state(self, seq: Sequence) -> list[deque[int]]:
        return [deque() for _ in range(seq.kv.pool.num_layers)]  # window slots per layer, oldest first

    def evict_prefill(self, layer: int, seq: Sequence, q_window: torch.Tensor) -> torch.Tensor | None:
        n = seq.kv.num_slots[layer]
        n_keep = resolve_budget(self.budget, n)
        if n_keep >= n:
            return None
        sinks = min(self.n_sink, n_keep)
        device = seq.kv.table.device  # made there: a copy from the host would wait for the device, once a layer
        keep = torch.cat([torch.arange(sinks, device=device), torch.arange(n - (n_keep - sinks), n, device=device)])
        return keep[None]

    def begin_step(self, batch: DecodeBatch) -> torch.Tensor | None:
        """Overwrite the oldest window slot wherever the cache is full; otherwise append. Decided on the host from
        each sequence's own slot counts, before the forward (so the step itself is the Full-KV one)."""
        slots = []  # [B][layers]
        for seq in batch.seqs:
            capacity = resolve_budget(self.budget, seq.num_computed + 1)
            row = []
            for n, window in zip(seq.kv.num_slots, seq.method_state):
                if not window:  # after prefill the window slots are in age order
                    window.extend(range(min(self.n_sink, n), n))
                slot = window.popleft() if n >= capacity and window else n
                if slot >= self.n_sink:
                    window.append(slot)
                row.append(slot)
            slots.append(row)
        write = batch.seqs[0].kv.pool.staging.send(slots)  # [B, layers], in a copy that does not wait
        return write[:, :, None].expand(-1, -1, batch.model.num_kv_heads)
