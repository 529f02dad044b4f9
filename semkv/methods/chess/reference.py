"""Plain-torch references of chess's kernels: what the Triton kernels are tested against, and the CPU path."""
from __future__ import annotations

import torch


def summary_dots(sums: torch.Tensor, pages: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """Dot products of per-page key summaries with one direction per sequence and layer, summed over layers.

    sums [pool_pages, kv_heads, D] float32, one summary per physical page; pages [B, layers, w] physical page ids of
    each sequence's pages in each layer; directions [B, r, layers, kv_heads, D]. Returns float32 [B, w, r] with
    out[b, j, i] = sum over layers l of <sums[pages[b, l, j]], directions[b, i, l]>. This reference gathers one
    layer's summaries at a time; `triton_summary_dot.py` reads them in place on the GPU."""
    batch, layers, w = pages.shape
    dirs = directions.float().flatten(3)  # [B, r, layers, kv_heads * D]
    out = torch.zeros(batch, w, directions.shape[1], dtype=torch.float32, device=sums.device)
    for layer in range(layers):
        out += torch.bmm(sums[pages[:, layer]].flatten(2), dirs[:, :, layer].transpose(1, 2))
    return out
