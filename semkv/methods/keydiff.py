"""KeyDiff: keep the keys least similar to the mean key (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache
Eviction for Long-Context LLM Inference in Resource-Constrained Environments", https://arxiv.org/abs/2504.15364).

Distinctive keys draw high attention, so each KV head keeps its `budget` keys of lowest cosine similarity to the anchor,
the mean of its L2-normalised keys; no attention score is read (the method is query-agnostic: queries play no part,
`query_aware` only decides whether the question's keys are among those compressed). Compression happens once, at the
end of prefill.

Readings: the score is `-cos(k_i, mean_j k_j / |k_j|)` per KV head, on keys after RoPE, as in the paper's anchor
variant and kvpress's KeyDiffPress. The paper processes long prompts block by block, evicting after each block
(kvpress: `BlockPress(KeyDiffPress)`); here the whole prompt is prefilled and compressed once, as KeyDiffPress does.
KeyDiffPress protects no window, so the default window is 0; a window > 0 keeps the last prompt tokens as well.

Parameters
----------
budget: tokens kept per KV head and layer (int) or fraction of the prompt (float).
window: last prompt tokens always kept, 0 (kvpress's KeyDiffPress keeps none; the paper names none).
query_aware: compress the whole prompt (True) or only the text before the question (False).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from semkv.engine.sequence import Sequence
from semkv.methods.eviction import ScoredEviction


def key_diversity(keys: torch.Tensor) -> torch.Tensor:
    """keys [kv_heads, n, D] -> scores [kv_heads, n]: minus the cosine similarity to the mean normalised key."""
    keys = keys.float()
    anchor = F.normalize(keys, dim=-1).mean(dim=1, keepdim=True)  # [kv_heads, 1, D]
    return -F.cosine_similarity(keys, anchor, dim=-1)


@dataclass
class KeyDiff(ScoredEviction):
    window: int = 0

    name = "keydiff"
    summary = "KeyDiff: keep the keys least similar (cosine) to the mean key, per KV head, at prefill"

    def score(self, layer: int, seq: Sequence, q_window: torch.Tensor, keys: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
        return key_diversity(keys)
