"""SnapKV: keep the prompt tokens the last prompt queries attend to most (Li et al., 2024, "SnapKV: LLM Knows What
You Are Looking for Before Generation", https://arxiv.org/abs/2404.14469).

The last `window` prompt queries attend to every prompt key; the attention each key receives is averaged over the
window and smoothed by 1-D pooling along the sequence (so neighbours of a hit survive with it); the scores of the
query heads of a KV group are averaged (GQA), and each KV head keeps its own top `budget` tokens. The window itself is
always kept. Compression happens once, at the end of prefill.

Parameters
----------
budget: tokens kept per KV head and layer (int) or fraction of the prompt (float).
window: observation window, 32 (the SnapKV paper's default).
kernel_size: pooling kernel, 5 (SnapKV's reference code; kvpress uses the same).
pooling: "avg" (reference code) or "max".
query_aware: the window contains the question (True, as in the paper) or only the context (False).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from semkv.engine.sequence import Sequence
from semkv.errors import SemkvError, check_choice, check_range
from semkv.methods.base import keep_top, layer_groups, layers_window_mass, per_kv_head, window_mass
from semkv.methods.eviction import ScoredEviction, window_positions


def pooled_scores(mass: torch.Tensor, w: int, kv_heads: int, kernel_size: int, pooling: str) -> torch.Tensor:
    """SnapKV's score of every key from the window's attention mass [G, heads, n] of G layers (`window_mass`, w
    queries): [G, kv_heads, n]. Keys of the window get each layer's highest score (always kept)."""
    n = mass.shape[-1]
    prefix = mass[..., : n - w] / w  # [G, heads, n - w] the window's mean attention
    if kernel_size > 1 and prefix.shape[-1] > 0:
        pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
        prefix = pool(prefix.flatten(0, 1)[:, None], kernel_size, stride=1, padding=kernel_size // 2).view_as(prefix)
    scores = per_kv_head(prefix, kv_heads, dim=1)
    if not scores.shape[-1]:
        return scores.new_ones(*scores.shape[:2], w)
    # the window's keys score the highest score, on the device (reading it would make the host wait, once a layer)
    return torch.cat([scores, scores.amax((1, 2), keepdim=True).expand(-1, kv_heads, w)], dim=-1)


@dataclass
class SnapKV(ScoredEviction):
    kernel_size: int = 5
    pooling: str = "avg"

    name = "snapkv"
    summary = "SnapKV: keep tokens most attended by the last prompt queries (pooled, per KV head), at prefill"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("kernel_size", self.kernel_size, 1, 63, int)
        if self.kernel_size % 2 == 0:
            raise SemkvError(f"kernel_size={self.kernel_size} must be odd")
        check_choice("pooling", self.pooling, ("avg", "max"))

    def score(self, layer: int, seq: Sequence, q_window: torch.Tensor, keys: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
        mass = window_mass(q_window, keys, positions, window_positions(seq, q_window))  # [heads, n]
        return pooled_scores(mass[None], q_window.shape[0], keys.shape[0], self.kernel_size, self.pooling)[0]

    def evict_prefill_layers(self, seq: Sequence, q_windows: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Every layer at once (a packed prompt chunk's), where every layer holds the same slots: scored in a few
        calls (`layers_window_mass`, a `layer_groups` group a call), each group's top slots chosen in one pass when
        its layers keep as many (PyramidKV's budgets differ: a pass a layer); else layer by layer."""
        kv, layers = seq.kv, len(q_windows)
        n = kv.num_slots[0]
        if any(count != n for count in kv.num_slots):
            return super().evict_prefill_layers(seq, q_windows)
        budgets = [self.layer_budget(layer, n) for layer in range(layers)]
        evicting = [layer for layer in range(layers) if budgets[layer] < n]
        keeps: list[torch.Tensor | None] = [None] * layers
        if not evicting:
            return keeps
        query_positions, w = window_positions(seq, q_windows[0]), q_windows[0].shape[0]
        slots = torch.arange(n, device=query_positions.device)
        for group in layer_groups(kv, evicting):
            mass = layers_window_mass(kv, group, [q_windows[layer] for layer in group], query_positions)
            scores = pooled_scores(mass, w, kv.pool.num_kv_heads, self.kernel_size, self.pooling)  # [G, kv_heads, n]
            if len({budgets[layer] for layer in group}) == 1:
                n_keep = budgets[group[0]]
                chosen = keep_top(scores, n_keep, slots >= n - min(self.window, n_keep))  # [G, kv_heads, n_keep]
            else:
                chosen = [keep_top(scores[i], budgets[layer], slots >= n - min(self.window, budgets[layer]))
                          for i, layer in enumerate(group)]
            for layer, keep in zip(group, chosen):
                keeps[layer] = keep
        return keeps
