"""Shared machinery of prefill-time eviction: score every cached slot, keep the top `budget` per KV head.

A subclass implements only `score(layer, seq, q_window, keys, positions) -> [kv_heads, n]` (or overrides `keep`
for chunk-level choices). The observation window (the last `window` prompt tokens) is always kept, and
`query_aware=False` compresses before the question is read when the caller marked where it starts.

Budget: the prompt is compressed to `budget` tokens per KV head and layer (a float is a fraction of the prompt);
tokens generated afterwards are appended, as in SnapKV, PyramidKV and ChunkKV.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from semkv.engine.hooks import KVMethod, resolve_budget
from semkv.engine.sequence import Sequence
from semkv.errors import check_range
from semkv.methods.base import keep_top


@dataclass
class ScoredEviction(KVMethod):
    window: int = 32
    query_aware: bool = True

    kind = "prefill_eviction"
    graph_safe = True  # decoding attends to every kept slot: the Full-KV step
    idle_graphs = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("window", self.window, 0, None, int)
        check_range("query_aware", self.query_aware, types=bool)

    def window_size(self) -> int:
        return self.window

    def uses_question_split(self) -> bool:
        return not self.query_aware

    def layer_budget(self, layer: int, n: int) -> int:
        """Slots layer `layer` keeps out of n."""
        return resolve_budget(self.budget, n)

    def device_tokens(self, prompt_tokens: int, max_new_tokens: int, page_size: int) -> int | None:
        """The prompt compressed to the largest layer budget, and every generated token (appended): admission and
        `semkv bench --batches max` count a request at what it keeps, not at its prompt. None with
        query_aware=False (the question, kept whole, is appended after the compression)."""
        if not self.query_aware:
            return None
        kept = max(self.layer_budget(layer, prompt_tokens) for layer in range(self.model.num_layers))
        return min(prompt_tokens, kept) + max_new_tokens

    def score(self, layer: int, seq: Sequence, q_window: torch.Tensor, keys: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
        """q_window [w, heads, D], keys [kv_heads, n, D], positions [kv_heads, n] -> scores [kv_heads, n]."""
        raise NotImplementedError

    def keep(self, layer: int, seq: Sequence, q_window: torch.Tensor, n_keep: int) -> torch.Tensor:
        """Slots to keep [kv_heads or 1, n_keep], ascending."""
        kv = seq.kv
        keys, _, positions = kv.gather(layer, kv.all_slots(layer))
        scores = self.score(layer, seq, q_window, keys, positions)
        n = scores.shape[-1]
        forced = torch.arange(n, device=scores.device) >= n - min(self.window, n_keep)
        return keep_top(scores, n_keep, forced)

    def evict_prefill(self, layer: int, seq: Sequence, q_window: torch.Tensor) -> torch.Tensor | None:
        n = seq.kv.num_slots[layer]
        n_keep = self.layer_budget(layer, n)
        if n_keep >= n:
            return None
        return self.keep(layer, seq, q_window, n_keep)


def window_positions(seq: Sequence, q_window: torch.Tensor) -> torch.Tensor:
    """Positions of the observation-window queries: the last prompt tokens computed so far."""
    end = seq.num_computed
    return torch.arange(end - q_window.shape[0], end, device=q_window.device)
