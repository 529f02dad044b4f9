"""Offloaded working sets, the device side of host offload (SentenceKV and DynSplit-KV with `offload=True`).

A method that offloads describes each sequence, per layer, by its *virtual* slots, the layout its device-resident
variant keeps: sinks [0, n_sink), offloaded tokens [n_sink, n_sink + offloaded) (token t of the sequence's
`HostKVStore` at virtual slot n_sink + t), then the tail (recent tokens not offloaded yet). It selects over virtual
slots exactly as the resident variant does, then `load` makes the selection device slots: on the device the sinks
stay, `cache` working-set slots follow, then the tail; the working set holds the selected offloaded tokens, and only
those it did not hold at the previous step are read from the host (`kernels.working_set`). Every row's maps, host
addresses and traffic counters live in device tensors (one row per sequence, numbered as the method's `DeviceRows`),
so a step is batched and captured in a CUDA graph.
"""
from __future__ import annotations

import math

import torch

from semkv import kernels
from semkv.engine.hooks import DecodeBatch, Selection
from semkv.engine.kv_cache import SeqKV, stack_tables
from semkv.engine.offload import HostKVStore, token_bytes
from semkv.engine.sequence import Sequence
from semkv.kernels import reference
from semkv.methods.state.rows import DeviceRows


def working_set_slots(n_sink: int, needed: int, page_size: int, factor: float = 1.0, most: int = 0) -> int:
    """Working-set slots for `needed` selected offloaded tokens behind `n_sink` sinks: rounded up so that the tail
    after them starts a KV page (tokens leave the tail a page at a time, without a copy: `SeqKV.drop_pages`). With
    factor > 1, `factor` times as many in whole pages, but no more than `most` (what the request can offload, so the
    device never holds more slots than the request has tokens)."""
    slots = -(-(n_sink + needed) // page_size) * page_size - n_sink
    if factor > 1:
        slots = max(slots, (min(math.ceil(factor * needed), most) + n_sink) // page_size * page_size - n_sink)
    return slots


class WorkingSets(DeviceRows):
    """Row 0 is the padding rows' (and the rows that offload nothing: they load nothing and their slots are not
    translated). Sizes: rows, working-set slots, offloaded tokens a row can hold."""

    slack = (1, 64, 256)

    def __init__(self, layers: int, kv_heads: int, device: torch.device):
        super().__init__()
        self.layers, self.kv_heads, self.device = layers, kv_heads, device
        with torch.inference_mode(False):  # normal tensors: written between steps, outside inference mode too
            self.held = torch.zeros(layers, 1, kv_heads, 1, dtype=torch.int32, device=device)  # [L, rows, H, capacity]
            self.where = torch.zeros(layers, 1, kv_heads, 1, dtype=torch.int32, device=device)  # [L, rows, H, tokens]
            self.hand = torch.zeros(layers, 1, kv_heads, dtype=torch.int32, device=device)  # [L, rows, H] clock hand
            self.host = torch.zeros(1, 4, dtype=torch.long, device=device)  # [rows, 4] `HostKVStore.pointers`
            self.traffic = torch.zeros(1, 2, dtype=torch.long, device=device)  # [rows, 2] tokens found / loaded
        self.stores: dict[int, HostKVStore] = {}  # by row, what the torch reference reads

    def sizes(self) -> tuple[int, int, int]:
        return self.held.shape[1], self.held.shape[3], self.where.shape[3]

    def shapes(self, rows: int, capacity: int, tokens: int) -> dict[str, tuple[int, ...]]:
        return dict(held=(self.layers, rows, self.kv_heads, capacity), where=(self.layers, rows, self.kv_heads, tokens),
                    hand=(self.layers, rows, self.kv_heads), host=(rows, 4), traffic=(rows, 2))

    def attach(self, row: int, store: HostKVStore) -> None:
        """Give an emptied row its sequence's store."""
        for t in (self.held, self.where, self.hand):
            t[:, row] = 0
        self.traffic[row] = 0
        self.host[row] = torch.tensor(store.pointers(), device=self.device)
        self.stores[row] = store

    def drop(self, row: int) -> None:
        """The row's request ended: forget its store (its pinned memory goes back). The row may lie past the tensors
        when the growth for it failed at admission."""
        self.stores.pop(row, None)
        if row < self.host.shape[0]:
            self.host[row] = 0

    def hold_first(self, layer: int, row: int, count: int) -> None:
        """The working set's first `count` slots hold offloaded tokens 0..count-1 (what prefill left there)."""
        held = torch.arange(1, count + 1, dtype=torch.int32, device=self.device)
        self.held[layer, row, :, :count] = held
        self.where[layer, row, :, :count] = held

    def load(self, layer: int, batch: DecodeBatch, selection: Selection, rows: torch.Tensor, n_sink: torch.Tensor,
             offloaded: torch.Tensor, cache: torch.Tensor) -> Selection:
        """The selection (over virtual slots, one list per KV head) as device slots, its offloaded tokens loaded;
        rows / n_sink / offloaded / cache [B] (a row that offloads nothing: 0 offloaded and 0 cache)."""
        pool = batch.pool
        kernels.working_set(selection.slots, selection.lengths, rows, n_sink, offloaded, cache, self.held[layer],
                            self.where[layer], self.hand[layer], self.host, self.stores, batch.tables[:, layer],
                            pool.k, pool.v, pool.pos, self.traffic, layer)
        return selection

    def counts(self, rows: list[int]) -> list[tuple[int, int]]:
        """(found, loaded) selected offloaded tokens of each row so far, every layer and KV head (one small read)."""
        return [tuple(c) for c in self.traffic[torch.tensor(rows, device=self.device)].tolist()]


def move_tail(kv: SeqKV, layer: int, src: int, dst: int) -> None:
    """Move the slots [src, num_slots) of a layer to start at dst, allocating or freeing pages as needed."""
    n = kv.num_slots[layer] - src
    if src == dst:
        return
    k, v, pos = kv.gather(layer, torch.arange(src, src + n, device=kv.table.device)[None])  # copies
    kv.truncate(layer, min(dst, kv.num_slots[layer]))
    kv.ensure_slots(layer, dst + n)
    kv.write(layer, torch.arange(dst, dst + n, device=kv.table.device), k.transpose(0, 1), v.transpose(0, 1), pos[0])
    kv.num_slots[layer] = dst + n


def slot_range(kv: SeqKV, layers: slice, start: int, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copies of the keys, values [L', kv_heads, m, D] and positions [L', kv_heads, m] at slots [start, start + m)
    of `layers` (the tokens a method offloads or hands to its buckets)."""
    count = len(range(kv.pool.num_layers)[layers])
    slots = torch.arange(start, start + m, device=kv.table.device).expand(count, -1)
    rows = reference.physical_rows(kv.table[layers], slots, kv.pool.page_size)  # [L', m] flat pool rows
    return tuple(x[rows].transpose(1, 2) for x in kv.pool.flat())


def slot_ranges(kvs: list[SeqKV], start: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`slot_range` of every layer of several sequences of one pool at once, sequence r from slot start[r] (a
    device tensor [R]): keys, values [L, R, kv_heads, m, D] and positions [L, R, kv_heads, m]."""
    pool = kvs[0].pool
    tables = stack_tables([kv.table for kv in kvs])  # [R, L, pages]
    count, layers = tables.shape[:2]
    slots = (start[:, None] + torch.arange(m, device=start.device))[:, None].expand(-1, layers, -1)  # [R, L, m]
    rows = reference.physical_rows(tables.flatten(0, 1), slots.flatten(0, 1), pool.page_size)  # [R * L, m]
    return tuple(x[rows].view(count, layers, m, *x.shape[1:]).transpose(2, 3).transpose(0, 1) for x in pool.flat())


def record_traffic(seq: Sequence, found: int, loaded: int) -> None:
    """A request's offload counters in its statistics: the selected offloaded tokens (token x KV head x layer,
    summed over steps) found in its working set and read from the host, and the bytes read."""
    pool = seq.kv.pool
    seq.stats.extra.update(kv_reused=found, kv_reloaded=loaded)
    seq.stats.h2d_bytes = loaded * token_bytes(1, pool.head_dim, pool.dtype)
