"""DynSplit-KV's device state for batched, graph-captured decoding (K/V resident, min/max pooling): for every sequence,
one row each, the min / max key of every chunk per layer and KV head (none when chunks are scored by their tokens), each
chunk's first position and the reuse counters; beside the KV pool, the step at which each slot was last attended (the
reuse statistics), with score_keys="channels" the chosen channels of every key (`KeyChannels`) and each row's choice of
them, and with score_keys="pages" the min / max key of every page (`PageSummaries`). The split goes on here during
decoding (DD-Select on the device, `DynSplitKV._split_step`): each row's open chunk, the delimiter weights of its last
chunk_size + max_deviation positions (a ring by position) and its own weight of every delimiter token (per-document
weights differ by row). Used by `semkv.methods.dynsplit.method`.
"""
from __future__ import annotations

import torch

from semkv.engine.kv_cache import KVPool
from semkv.methods.state.key_channels import KeyChannels
from semkv.methods.state.page_storage import PageStorage
from semkv.methods.state.page_summaries import PageSummaries
from semkv.methods.state.rows import DeviceRows


class DynSplitRows(DeviceRows):
    """Row 0 is the padding rows' (and the place where writes that are not needed land). Shapes grow with the
    longest row (`ensure`); a move makes captured graphs be captured again (the owner bumps its `graph_epoch`)."""

    # rows come one per admitted request (a row is about 290 MB at 32 layers and a 32k context): little slack;
    # chunks with an eighth more
    slack = (1, 64)
    layered = ("kmin", "kmax")

    def __init__(self, layers: int, kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device,
                 stamped: bool = True, summarised: bool = True, channels: int = 0, ring: int = 1,
                 delimiters: int = 0, pages: bool = False):
        super().__init__()
        self.layers, self.kv_heads, self.dim, self.dtype, self.device = layers, kv_heads, dim, dtype, device
        self.summary_layers = layers if summarised else 0  # score="tokens" keeps no summaries
        # L x [rows, chunks, H, D]
        self.kmin = [torch.zeros(1, 1, kv_heads, dim, dtype=dtype, device=device) for _ in range(self.summary_layers)]
        self.kmax = [torch.zeros_like(t) for t in self.kmin]
        self.start = torch.zeros(1, 1, dtype=torch.int32, device=device)  # [rows, chunks] first position
        self.reuse = torch.zeros(1, 2, dtype=torch.long, device=device)  # [rows, 2] tokens reused / reloaded
        # DD-Select: the open chunk [rows]; the weight of position p at [row, p % ring] for the open chunk's positions
        # (ring = chunk_size + max_deviation; -1: not a delimiter); each delimiter token's weight [rows, delimiters + 1]
        # (column 0: every other token, -1), float64 as the host's split computes
        self.open = torch.zeros(1, dtype=torch.long, device=device)
        self.ring = torch.full((1, ring), -1.0, dtype=torch.float64, device=device)
        self.weights = torch.full((1, delimiters + 1), -1.0, dtype=torch.float64, device=device)
        # step (of this method) at which each slot and KV head was last attended: [pages, page_size, kv_heads]
        # (not with offload: the working sets count reuse)
        self.stamps = PageStorage(lambda pool: (pool.page_size, pool.num_kv_heads), dtype=torch.int32) if stamped \
            else None
        # score_keys="channels": the key channels each row scores with, [rows, layers, H, channels] (`key_channels`),
        # and those channels of every slot's key, [pages, page_size, H, channels]
        self.channels = torch.zeros(1, layers, kv_heads, channels, dtype=torch.long, device=device)
        self.key_channels = KeyChannels(channels) if channels else None
        # score_keys="pages": each page's min / max key per KV head, [pages, H, D] each (Quest's summaries)
        self.page_summaries = PageSummaries(("min", "max")) if pages else None

    @property
    def chunks(self) -> int:
        return self.start.shape[1]

    def sizes(self) -> tuple[int, int]:
        return self.start.shape[0], self.chunks

    def shapes(self, rows: int, chunks: int) -> dict[str, tuple[int, ...]]:
        summary = (self.summary_layers, rows, chunks, self.kv_heads, self.dim)
        return dict(kmin=summary, kmax=summary, start=(rows, chunks), reuse=(rows, 2),
                    channels=(rows, *self.channels.shape[1:]), open=(rows,), ring=(rows, self.ring.shape[1]),
                    weights=(rows, self.weights.shape[1]))

    def ensure(self, needs: tuple[int, int], pool: KVPool) -> bool:
        """Room for needs = (rows, chunks per row), and the state kept by page (stamps, key channels, page summaries)
        for every page of the pool; True when a tensor moved."""
        moved = False
        for state in self.by_page:
            moved = state.ensure(pool) or moved
        return self.grow(needs) or moved

    @property
    def by_page(self) -> list:
        """The state kept by page that this configuration holds."""
        return [state for state in (self.stamps, self.key_channels, self.page_summaries) if state is not None]

    def growth_bytes(self, needs: tuple[int, int], pool: KVPool) -> int:
        return super().growth_bytes(needs, pool) + sum(state.growth_bytes(pool) for state in self.by_page)

    def clear(self, row: int) -> None:
        """Empty a row for a new sequence (a freed row holds its last owner's state)."""
        for t in (*self.kmin, *self.kmax, self.start, self.reuse, self.channels, self.open):
            t[row].zero_()  # a kernel: writing a Python number would wait for the device, twice a layer
        self.ring[row].fill_(-1.0)  # (its weights are written at the end of its prefill)
