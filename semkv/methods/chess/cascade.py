"""The coarse-to-fine cascade of CHESS (Algorithm 1) over a hierarchy of pages, batched over sequences.

Pages are grouped into chunks of `chunk_pages` consecutive pages and grids of `grid_chunks` consecutive chunks (logical
views: only page scores exist in memory, the scores of chunks and grids follow from them by linearity). The top grids
are kept, then the top chunks inside kept grids, then the top pages inside kept chunks, all with masks over padded
tensors (sequences of different lengths), without Python loops over units or sequences.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def top_mask(scores: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Bool [b, n]: the k[b] highest-scoring eligible entries of each row (ties: the lower index)."""
    order = scores.masked_fill(~eligible, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    positions = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, positions)
    return (rank < k[:, None]) & eligible


def top_fraction(scores: torch.Tensor, eligible: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """Keep round(rho * eligible) entries per row, at least one where any is eligible."""
    n = eligible.sum(-1)
    k = torch.where(n > 0, torch.floor(rho * n + 0.5).clamp(min=1), 0).long()
    return top_mask(scores, eligible, k)


def level_scores(page_scores: torch.Tensor, candidates: torch.Tensor, chunk_pages: int, grid_chunks: int):
    """Page scores [b, P] and candidate pages [b, P] -> grid, chunk and page scores (pages padded to whole grids)
    with their eligibility. A chunk's vector is the mean of its candidate pages' vectors and a grid's the mean of its
    chunks' (Eq. 2); the affinity with the anchor is linear in the vectors, so a chunk scores the mean of its pages'
    scores and a grid the mean of its chunks' (Eq. 4 needs the product with page vectors only)."""
    b, n_pages = page_scores.shape
    pad = -n_pages % (chunk_pages * grid_chunks)
    s_p = F.pad(page_scores, (0, pad))  # [b, Pp]
    ok_p = F.pad(candidates, (0, pad))
    pages_in_chunk = ok_p.view(b, -1, chunk_pages).sum(-1)  # [b, C]
    s_c = torch.where(ok_p, s_p, 0.0).view(b, -1, chunk_pages).sum(-1) / pages_in_chunk.clamp(min=1)
    ok_c = pages_in_chunk > 0
    chunks_in_grid = ok_c.view(b, -1, grid_chunks).sum(-1)  # [b, G]
    s_g = torch.where(ok_c, s_c, 0.0).view(b, -1, grid_chunks).sum(-1) / chunks_in_grid.clamp(min=1)
    return (s_g, s_c, s_p), (chunks_in_grid > 0, ok_c, ok_p)


def cascade(page_scores: torch.Tensor, candidates: torch.Tensor, chunk_pages: int, grid_chunks: int,
            rho: torch.Tensor, max_pages: torch.Tensor | None = None) -> torch.Tensor:
    """Algorithm 1, batched: top rho_g of the eligible grids, top rho_c of the chunks in kept grids, top rho_p of the
    pages in kept chunks (at most max_pages [b]). page_scores [b, P] (affinity with the anchor), rho [b, 3].
    Returns the kept pages [b, P]."""
    n_pages = page_scores.shape[1]
    (s_g, s_c, s_p), (ok_g, ok_c, ok_p) = level_scores(page_scores, candidates, chunk_pages, grid_chunks)
    keep_g = top_fraction(s_g, ok_g, rho[:, 0])
    keep_c = top_fraction(s_c, ok_c & keep_g.repeat_interleave(grid_chunks, -1), rho[:, 1])
    active_p = ok_p & keep_c.repeat_interleave(chunk_pages, -1)
    keep_p = top_fraction(s_p, active_p, rho[:, 2])
    if max_pages is not None:
        keep_p = top_mask(s_p, keep_p, max_pages)
    return keep_p[:, :n_pages]


def cascade_ratios(preset: tuple[float, float], share: torch.Tensor) -> torch.Tensor:
    """(rho_g, rho_c, rho_p) [b, 3] that keep `share` [b] of the candidate pages with the preset's coarse ratios,
    raised by a common power where the share exceeds their product; share 1 gives (1, 1, 1)."""
    rho_g, rho_c = preset
    share = share.clamp(0.0, 1.0).double()
    coarse = rho_g * rho_c
    power = torch.where(share > coarse, torch.log(share.clamp(min=1e-12)) / math.log(coarse), 1.0)
    g, c = rho_g**power, rho_c**power
    return torch.stack([g, c, (share / (g * c)).clamp(max=1.0)], dim=-1).float()
