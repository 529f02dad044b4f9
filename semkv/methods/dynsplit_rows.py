"""DynSplit-KV's device state for batched, graph-captured decoding (K/V resident, min/max pooling): for every sequence,
one row each, the min / max key of every chunk per layer and KV head, each chunk's first position and the chunk of
every position; beside the KV pool, the step at which each slot was last attended (the reuse statistics). The
split itself (DD-Select) stays on the host and reaches these tensors between steps. Used by `semkv.methods.dynsplit`.
"""
from __future__ import annotations

import torch

from semkv.engine.kv_cache import KVPool
from semkv.methods.page_storage import PageStorage
from semkv.methods.state_rows import RowOwners, grown_sizes, regrown


class DynSplitRows:
    """Row 0 is the padding rows' (and the place where writes that are not needed land). Shapes grow with the
    longest row (`ensure`); a move makes captured graphs be captured again (the owner bumps its `graph_epoch`)."""

    def __init__(self, layers: int, kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device):
        self.layers, self.kv_heads, self.dim, self.dtype, self.device = layers, kv_heads, dim, dtype, device
        self.owners = RowOwners()
        self.kmin = torch.zeros(layers, 1, 1, kv_heads, dim, dtype=dtype, device=device)  # [L, rows, chunks, H, D]
        self.kmax = torch.zeros_like(self.kmin)
        self.start = torch.zeros(1, 1, dtype=torch.int32, device=device)  # [rows, chunks] first position
        self.labels = torch.zeros(1, 1, 1, dtype=torch.int32, device=device)  # [rows, 1, positions] chunk
        self.reuse = torch.zeros(1, 2, dtype=torch.long, device=device)  # [rows, 2] tokens reused / reloaded
        # step (of this method) at which each slot and KV head was last attended: [pages, page_size, kv_heads]
        self.stamps = PageStorage(lambda pool: (pool.page_size, pool.num_kv_heads), dtype=torch.int32)

    @property
    def chunks(self) -> int:
        return self.kmin.shape[2]

    def ensure(self, rows: int, chunks: int, positions: int, pool: KVPool) -> bool:
        """Room for `rows` rows, `chunks` chunks and `positions` positions per row, and stamps for every page of the
        pool; True when a tensor moved."""
        moved = self.stamps.ensure(pool)
        # each growth copies every row: rows come a few at a time, chunks and positions with an eighth more
        size = grown_sizes((rows, chunks, positions), (self.kmin.shape[1], self.chunks, self.labels.shape[2]),
                           (4, 64, 1024))
        if size is None:
            return moved
        n_rows, n_chunks, n_positions = size
        summary = (self.layers, n_rows, n_chunks, self.kv_heads, self.dim)
        self.kmin, self.kmax = regrown(self.kmin, summary), regrown(self.kmax, summary)
        self.start = regrown(self.start, (n_rows, n_chunks))
        self.labels = regrown(self.labels, (n_rows, 1, n_positions))
        self.reuse = regrown(self.reuse, (n_rows, 2))
        return True

    def clear(self, row: int) -> None:
        """Empty a row for a new sequence (a freed row holds its last owner's state)."""
        for t in (self.kmin, self.kmax):
            t[:, row] = 0
        for t in (self.start, self.labels, self.reuse):
            t[row] = 0
