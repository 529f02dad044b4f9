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
from semkv.methods.base import per_kv_head, window_mass
from semkv.methods.eviction import ScoredEviction, window_positions


def pooled_window_scores(q_window: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                         query_positions: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """SnapKV's score of every key: [kv_heads, n]. Keys of the window get +inf-like max scores (always kept)."""
    mass = window_mass(q_window, keys, positions, query_positions)  # [heads, n]
    w = q_window.shape[0]
    n = keys.shape[1]
    prefix = mass[:, : n - w] / w  # [heads, n - w] the window's mean attention
    if kernel_size > 1 and prefix.shape[-1] > 0:
        pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
        prefix = pool(prefix[:, None], kernel_size, stride=1, padding=kernel_size // 2)[:, 0]
    scores = per_kv_head(prefix, keys.shape[0])
    if not scores.numel():
        return scores.new_ones(scores.shape[0], w)
    # the window's keys score the highest score, on the device (reading it would make the host wait, once a layer)
    return torch.cat([scores, scores.max().expand(scores.shape[0], w)], dim=-1)


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
        return pooled_window_scores(q_window, keys, positions, window_positions(seq, q_window), self.kernel_size,
                                    self.pooling)
