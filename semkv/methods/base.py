"""Machinery several methods share: observation-window attention, GQA reduction, the best score over neighbouring
regions, top-k with forced slots, sink and recent masks. The method interface itself is `semkv.engine.hooks`."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from semkv import kernels
from semkv.engine.kv_cache import SeqKV


def window_attention(q_window: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor | None = None,
                     query_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of the observation window over all stored keys, per query head.

    q_window [w, heads, D], keys [kv_heads, n, D] -> probabilities [heads, w, n]. With positions ([kv_heads, n] of
    keys, [w] of queries) a key is visible to a query only if it is not in the query's future (causal).
    """
    w, n_heads, dim = q_window.shape
    kv_heads = keys.shape[0]
    group = n_heads // kv_heads
    keys_per_head = keys.repeat_interleave(group, dim=0)  # [heads, n, D]
    scores = torch.matmul(q_window.transpose(0, 1), keys_per_head.transpose(1, 2)).float() / math.sqrt(dim)
    if positions is not None and query_positions is not None:
        future = positions.repeat_interleave(group, dim=0)[:, None, :] > query_positions[None, :, None]
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1)


def window_mass(q_window: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                query_positions: torch.Tensor) -> torch.Tensor:
    """`window_attention`'s probabilities summed over the window's queries, without making them on a GPU
    (`kernels.window_mass`): q_window [w, heads, D], keys [kv_heads, n, D], positions [kv_heads, n], query_positions
    [w] -> float32 [heads, n]. The prefill-eviction methods' and CHESS's scoring of a prompt's keys."""
    return kernels.window_mass(q_window, keys, positions, query_positions, q_window.shape[-1] ** -0.5)


LAYERS_KEY_BYTES = 256 * 2**20  # keys a method scoring several layers at once gathers for one group


def layer_groups(kv: SeqKV, layers: list[int]) -> list[list[int]]:
    """`layers` in groups whose keys, gathered and copied by head (`layers_window_mass`), fit in `LAYERS_KEY_BYTES`:
    a method scoring every layer at once (`evict_prefill_layers`) scores and chooses a group at a time, so its
    temporaries (the keys, the [G, heads, n] float32 masses) stay near one group's, not every layer's."""
    n, pool = kv.num_slots[layers[0]], kv.pool
    at_once = max(1, LAYERS_KEY_BYTES // max(2 * n * pool.num_kv_heads * pool.head_dim * pool.k.element_size(), 1))
    return [layers[first : first + at_once] for first in range(0, len(layers), at_once)]


def layers_window_mass(kv: SeqKV, layers: list[int], q_windows: list[torch.Tensor],
                       query_positions: torch.Tensor) -> torch.Tensor:
    """`window_mass` of several layers of `kv` holding the same slots (a group of `layer_groups`) in one call, from
    each one's window queries q_windows ([w, heads, D] each, in the order of `layers`) -> float32 [len(layers), heads,
    n]: the layers' heads side by side as one layer's (the kernel's GQA groups pair each layer's query heads with its
    own key heads)."""
    w, heads, dim = q_windows[0].shape
    n = kv.num_slots[layers[0]]
    keys, positions = kv.stored(layers)  # [G, kv_heads, n, D], [G, kv_heads, n]
    q = torch.stack(q_windows, 1).view(w, len(layers) * heads, dim)
    mass = window_mass(q, keys.reshape(-1, n, dim), positions.reshape(-1, n), query_positions)
    return mass.view(len(layers), heads, n)


def per_kv_head(scores: torch.Tensor, kv_heads: int, reduce: str = "mean", dim: int = 0) -> torch.Tensor:
    """[..., heads, ...] (heads at `dim` >= 0) -> [..., kv_heads, ...] by averaging (or summing) the query heads of
    each KV group (GQA)."""
    shape = scores.shape
    grouped = scores.view(*shape[:dim], kv_heads, shape[dim] // kv_heads, *shape[dim + 1 :])
    return grouped.mean(dim + 1) if reduce == "mean" else grouped.sum(dim + 1)


def neighbour_max(scores: torch.Tensor, neighbours: int) -> torch.Tensor:
    """Scores [..., n] of regions in order -> each region's best over itself and `neighbours` regions on either side
    (CHESS's pages with anchor="queries", ChunkKV's chunks), so a region kept for its score brings its neighbours."""
    if not neighbours:
        return scores
    flat = scores.reshape(-1, 1, scores.shape[-1])
    return F.max_pool1d(flat, 2 * neighbours + 1, stride=1, padding=neighbours).view(scores.shape)


def keep_top(scores: torch.Tensor, n_keep: int, forced: torch.Tensor | None = None) -> torch.Tensor:
    """Slots to keep: scores [S, n] -> [S, n_keep] ascending; `forced` [n] or [S, n] bool slots always kept."""
    n = scores.shape[-1]
    if n_keep >= n:
        return torch.arange(n, device=scores.device)[None].expand(scores.shape[0], -1)
    scores = scores.float()
    if forced is not None:
        scores = scores.masked_fill(forced, float("inf"))
    return torch.topk(scores, n_keep, dim=-1).indices.sort(dim=-1).values


def sink_recent_mask(n: int, n_sink: int, n_recent: int, device: torch.device) -> torch.Tensor:
    """Bool [n]: the first n_sink and the last n_recent slots."""
    idx = torch.arange(n, device=device)
    return (idx < n_sink) | (idx >= n - n_recent)
