"""Paged KV cache: one pool of fixed-size pages shared by all sequences and layers, and a page table per
(sequence, layer).

A page holds `page_size` slots; a slot holds the key, value and original token position of every KV head, so a head
may keep other tokens than its neighbours after per-head eviction. Layers have their own page tables because
eviction methods keep different numbers of tokens per layer (PyramidKV); freeing a page returns it to the pool for
real. Methods address the cache by *logical slot* (0..num_slots-1 of one sequence and layer); `physical()` maps
slots to rows of the flattened pool.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Protocol

import numpy as np
import torch

from semkv.engine.prefix_cache import PrefixCache
from semkv.engine.staging import HostStaging
from semkv.errors import SemkvError


def _extended(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with `rows` zero rows appended, allocated once (a fixed pool is one allocation, no temporary copy). A normal
    tensor even when it grows inside `torch.inference_mode` (generation), so that writes outside it still work."""
    with torch.inference_mode(False):
        out = x.new_zeros((x.shape[0] + rows, *x.shape[1:]))
        out[: x.shape[0]] = x
    return out


class KVPool:
    """Pages of K, V and original positions, handed out to sequences and taken back.

    Page ids are handed out lowest first until released ones exist, which go out again first (a stack): so the ids
    handed out (`touched`) are about as many as the most pages held at once, and state kept by physical page beside the
    pool (`PageState`: Quest's summaries, InfLLM's block keys...) covers `coverage` >= `touched` ids, not the whole
    pool. When no page is held or cached any more, ids start from the lowest again (`_rewind`): state made after a large
    batch is sized by the requests it serves then, not by that batch (TokenSelect's int8 key sketch, 27% of the K/V,
    asked 30 GiB for 16 rows after a Full KV batch of 335 rows had touched the whole pool of an H200). With a
    `PrefixCache` (`cache`), pages of cached prompt blocks have reference counts and stay filled when no request holds
    them; they count as free (`available`) and are evicted, least recently used first, only when no other page is
    left: in a pool that grows (no `max_pages`), once it holds `keep_cached` pages (0: it evicts before it grows)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_pages: int = 64,
        max_pages: int | None = None,
    ):
        if not 1 <= page_size <= 256:
            raise SemkvError(f"page_size={page_size} is out of range; allowed: 1..256")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.dtype, self.device = page_size, dtype, device
        self.max_pages = max_pages  # None: grow as needed
        self.keep_cached = 0  # a growing pool's pages up to which it grows rather than evict idle cached pages
        self.k = torch.empty(0, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.pos = torch.empty(0, page_size, num_kv_heads, dtype=torch.int32, device=device)
        self.free: list[int] = []  # released pages, handed out again last in, first out
        self.scratch = 0  # never given out; padding rows of graph batches write here
        self.touched = 1  # ids below it were handed out at least once
        self.coverage = 1  # ids the per-page state beside the pool covers (>= touched)
        self.coverage_epoch = 0  # bumped when that state moves (captured graphs point at it)
        self.page_states: weakref.WeakSet = weakref.WeakSet()  # `PageState`s over this pool's pages
        self.cache: PrefixCache | None = None  # prefix caching, once a scheduler enables it
        self.staging = HostStaging(device)  # page ids reach the tables through it
        self.in_use = 0  # pages some request holds
        self.peak_in_use = 0
        self._grow(num_pages)

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    @property
    def bytes_per_page(self) -> int:
        return 2 * self.page_size * self.num_kv_heads * self.head_dim * self.k.element_size()

    @property
    def free_pages(self) -> int:
        """Pages no request holds and no cached block keeps: released ones and never-used ones."""
        return len(self.free) + self.num_pages - self.touched

    @property
    def ready_pages(self) -> int:
        """Free pages that can be handed out at once: without growing the per-page state or evicting cached blocks."""
        fresh = self.num_pages - self.touched
        return len(self.free) + (min(fresh, self.coverage - self.touched) if len(self.page_states) else fresh)

    @property
    def cached_pages(self) -> int:
        """Pages of cached blocks that no request holds (`available` counts them: they are evicted when needed)."""
        return 0 if self.cache is None else self.cache.evictable

    @property
    def available(self) -> int:
        return self.free_pages + self.cached_pages

    def page_state_bytes(self) -> int:
        """Device bytes per page of the state kept by physical page beside the pool (every live `PageState`)."""
        return sum(state.bytes_per_page(self) for state in self.page_states)

    def _grow(self, new_pages: int) -> None:
        # zeros, not empty: padded slots of a batch are read and multiplied by a zero probability, and 0 * NaN
        # garbage would poison the output; stale data of freed pages is always finite
        self.k, self.v, self.pos = (_extended(x, new_pages) for x in (self.k, self.v, self.pos))

    def coverage_for(self, pages: int, coverage: int | None = None) -> int:
        """The coverage `cover(pages)` grows to from `coverage` (default: now's): a quarter more and a sixteenth of
        the pool at least, so that it grows rarely (each growth moves the tables captured graphs point at)."""
        coverage = self.coverage if coverage is None else coverage
        step = max(coverage // 4, self.num_pages // 16)
        return min(max(pages + 16, coverage + step), max(self.num_pages, pages))

    def growth_peak(self, pages: int) -> int:
        """Page entries of per-page state allocated beyond today's tables, at the peak, while a run that takes pages
        one by one grows the coverage to hold ids below `pages`: its last growth makes the final tables beside the
        ones before them (today's, already held, when there is one growth only). A batch of 332 CHESS rows at 32k on
        an H200 counted the final tables alone and ran out of memory growing them."""
        before = now = self.coverage
        while now < pages:
            before, now = now, self.coverage_for(now + 1, now)
        return 0 if now == self.coverage else now + before - self.coverage

    def cover_bytes(self, pages: int) -> int:
        """Device bytes `cover(pages)` allocates: the grown tables, made beside the old ones (a state that holds
        them already, from before a `_rewind`, allocates none)."""
        if pages <= self.coverage:
            return 0
        target = self.coverage_for(pages)
        return sum(state.bytes_per_page(self) * target for state in self.page_states if state.pages < target)

    def cover(self, pages: int) -> None:
        """Grow every `PageState` to hold ids below `pages` (`coverage_for`). Raises MemoryError, with the coverage
        unchanged, when the device cannot hold them."""
        if pages <= self.coverage:
            return
        target = self.coverage_for(pages)
        moved = False
        try:
            for state in list(self.page_states):
                moved = state.cover(self, target) or moved
        except torch.OutOfMemoryError:
            raise self._no_room(self.page_state_bytes(), target - self.coverage) from None
        self.coverage = target
        if moved:
            self.coverage_epoch += 1

    @staticmethod
    def _no_room(bytes_per_page: int, pages: int) -> MemoryError:
        return MemoryError(f"no device memory for the state kept by KV page beside the pool "
                           f"({bytes_per_page * pages / 2**30:.2f} GiB for {pages} more pages); lower "
                           f"gpu_memory_utilization (the share of the card the pool is sized to) to leave it room")

    def allocate(self, n: int) -> list[int]:
        """n pages: released ones first, then never-used ones (lowest ids first), then (a growing pool: past
        `keep_cached` pages) pages of evicted cached blocks. MemoryError when the pool cannot hold them (nothing is
        taken then)."""
        fresh = max(n - len(self.free), 0)
        if fresh > self.num_pages - self.touched and self.cache is not None:
            short = fresh - (self.num_pages - self.touched)
            if self.max_pages is None:  # what growing would take past `keep_cached`
                short = min(short, max(self.num_pages + short - self.keep_cached, 0))
            self.free.extend(self.cache.evict(short))
            fresh = max(n - len(self.free), 0)
        if fresh > self.num_pages - self.touched:
            needed = fresh - (self.num_pages - self.touched)
            if self.max_pages is not None and self.num_pages + needed > self.max_pages:
                raise MemoryError(f"KV pool exhausted: need {needed} more pages, limit {self.max_pages}")
            self._grow(max(needed, self.num_pages // 2, 16))
        if fresh:
            self.cover(self.touched + fresh)
        pages = self.free[len(self.free) - (n - fresh):][::-1] if n > fresh else []
        del self.free[len(self.free) - (n - fresh):]
        pages += range(self.touched, self.touched + fresh)
        self.touched += fresh
        self.in_use += n
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return pages

    def share(self, blocks: list) -> np.ndarray:
        """A request holds these cached blocks' pages now (`PrefixCache.take`): their pages [blocks, layers]."""
        woken, pages = self.cache.take(blocks)
        self.in_use += woken
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return pages

    def release(self, pages: list[int] | np.ndarray) -> None:
        """A request gives pages back: its own ones become free, cached ones lose a holder (idle when none is
        left)."""
        if self.cache is not None and self.cache.blocks:
            private, idled = self.cache.unref(pages)
            self.free.extend(private)
            self.in_use -= len(private) + idled
            return
        pages = pages.tolist() if isinstance(pages, np.ndarray) else pages
        self.free.extend(pages)
        self.in_use -= len(pages)
        self._rewind()

    def clear_cache(self) -> None:
        """Evict every cached block no request holds."""
        if self.cache is not None:
            self.free.extend(self.cache.clear())
            self._rewind()

    def _rewind(self) -> None:
        """When every id handed out is free again (none held, none cached), hand ids out from the lowest again: a
        state made from now on covers only what the live ones hold (`start_coverage`)."""
        if len(self.free) == self.touched - 1:
            self.free, self.touched = [], 1
            self.coverage = self.start_coverage

    @property
    def start_coverage(self) -> int:
        """What a state kept by page made now covers: `coverage`, or while no id is handed out (after a `_rewind`)
        what the live states hold (states of methods gone since are not counted)."""
        if self.touched > 1:
            return self.coverage
        return max(min((state.pages for state in self.page_states), default=1), 1)

    def register(self, state: "PageState") -> bool:
        """Cover the pages handed out with `state` now, and grow it with the coverage from now on (the coverage falls
        to `start_coverage` first); True when its tensors moved. If covering fails `state` is not kept; the device's
        out of memory is raised as MemoryError naming what was missing."""
        self.coverage = self.start_coverage
        self.page_states.add(state)
        try:
            return state.cover(self, self.coverage)
        except BaseException as error:
            self.page_states.discard(state)
            if isinstance(error, torch.OutOfMemoryError):
                raise self._no_room(state.bytes_per_page(self), self.coverage - state.pages) from None
            raise

    def flat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views [num_pages * page_size, kv_heads, head_dim] (and positions [.., kv_heads]) indexed by physical slot."""
        rows = self.num_pages * self.page_size
        return (
            self.k.view(rows, self.num_kv_heads, self.head_dim),
            self.v.view(rows, self.num_kv_heads, self.head_dim),
            self.pos.view(rows, self.num_kv_heads),
        )


class PageState(Protocol):
    """Method state stored by physical page id beside the pool; the pool grows it with `coverage`."""

    def bytes_per_page(self, pool: KVPool) -> int: ...

    @property
    def pages(self) -> int:
        """Page ids it holds entries for."""
        ...

    def cover(self, pool: KVPool, pages: int) -> bool:
        """Hold entries for page ids below `pages`; True when the storage moved."""
        ...


_versions = itertools.count(1)
_NONE = np.zeros(0, dtype=np.int64)  # no page
COMPACT_BYTES = 256 * 2**20  # kept K/V (and positions) `SeqKV.compact` copies at once


def stack_tables(tables: list[torch.Tensor]) -> torch.Tensor:
    """Page tables [layers, width_i] -> [B, layers, max width], narrower ones padded with page 0 (the scratch page)."""
    width = max(t.shape[1] for t in tables)
    return torch.stack([t if t.shape[1] == width else torch.nn.functional.pad(t, (0, width - t.shape[1]))
                        for t in tables])


def ensure_many(requests: list[tuple["SeqKV", dict[int, int]]]) -> None:
    """`SeqKV.ensure_all` for several sequences of one pool: one allocation (all or nothing), one host-to-device copy
    of every new page id (that does not wait for the device) and the table writes: a sequence that grows one page in
    every layer (at a page boundary of a decode step, every sequence of the batch) gets its table's new column from
    one multi-tensor copy of them all, any other growth an indexed write a sequence. The host work per page is a few
    list operations, so that it stays below the device time of a step."""
    if not requests:
        return
    pool = requests[0][0].pool
    size = pool.page_size
    plans, total = [], 0  # (kv, [(layer, pages held, pages needed)])
    for kv, slots in requests:
        held = kv.page_count.tolist()
        grow = [(layer, held[layer], -(-n // size)) for layer, n in slots.items()]
        grow = [g for g in grow if g[2] > g[1]]
        if grow:
            plans.append((kv, grow))
            total += sum(need - have for _, have, need in grow)
    if not plans:
        return
    for kv, grow in plans:  # the tables first: one that cannot grow leaves no page taken
        kv.widen(max(need for _, _, need in grow))
    pages = np.asarray(pool.allocate(total), dtype=np.int64)
    layers, cols, ends, taken = [], [], [], 0
    for kv, grow in plans:
        for layer, have, need in grow:
            kv.pages[layer, have:need] = pages[taken : taken + need - have]
            kv.page_count[layer] = need
            taken += need - have
            layers += [layer] * (need - have)
            cols += range(have, need)
        ends.append(taken)
    index = pool.staging.send([layers, cols, pages])  # [3, total]: layer, column, page id
    columns, ids = [], []  # a sequence that grows one column in every layer (a decode step's page boundary)
    start = 0
    for (kv, grow), end in zip(plans, ends):
        part = index[:, start:end]
        have = grow[0][1]
        if len(grow) == len(kv.page_count) and all(g == (layer, have, have + 1) for layer, g in enumerate(grow)):
            columns.append(kv.table[:, have])
            ids.append(part[2])
        else:
            kv.table[part[0], part[1]] = part[2]
        start = end
    if columns:  # one multi-tensor copy instead of an indexed write a sequence (about 25 us of host time each)
        torch._foreach_copy_(columns, ids)


def append_slots(kvs: list["SeqKV"]) -> None:
    """One more slot in every layer of each sequence (a decode step that appends its token everywhere); the
    sequences whose last pages are full get new ones together (`ensure_many`)."""
    requests = []
    for kv in kvs:
        size, before = kv.pool.page_size, kv.num_slots
        kv.num_slots = [n + 1 for n in before]
        if not all(n % size for n in before):  # some layer's last page is full (slots [0, n) exist)
            held = kv.page_count.tolist()
            requests.append((kv, {layer: n for layer, n in enumerate(kv.num_slots) if n > held[layer] * size}))
    ensure_many(requests)


class SeqKV:
    """One sequence's page tables (a device tensor [layers, capacity_pages] and its host copy `pages`, numpy, so that
    a request's thousands of page ids are moved in vector operations) and slot counts per layer.

    `version` changes, to a value no other table ever had, whenever pages are added, so holders of a copy of the
    table (the CUDA-graph buffers) know when to copy it again; `widest` is the most pages any layer holds."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        layers = pool.num_layers
        self.pages = np.zeros((layers, 8), dtype=np.int64)  # [layers, capacity]: layer l holds pages[l, :page_count[l]]
        self.page_count = np.zeros(layers, dtype=np.int64)  # [layers]
        self.num_slots = [0] * layers
        self.widest = 0
        # prefix caching: the first `protect` pages of every layer are prompt pages to be cached, so a rewrite of
        # them (`unshare`) moves to new pages and keeps these aside for the cache
        self.protect = 0
        self.aside: list[np.ndarray] = [_NONE] * layers  # [pages] int64 each
        with torch.inference_mode(False):  # a normal tensor even when made during generation (see `_extended`)
            self.table = torch.zeros(layers, 8, dtype=torch.long, device=pool.device)
        self.version = next(_versions)

    def ensure_slots(self, layer: int, n: int) -> None:
        """Allocate pages so that slots [0, n) exist in `layer`."""
        self.ensure_all({layer: n})

    def append_slot(self) -> None:
        """One more slot in every layer (a decode step that appends its token everywhere)."""
        append_slots([self])

    def ensure_all(self, slots: dict[int, int]) -> None:
        """Allocate pages so that slots [0, slots[layer]) exist in each given layer; the new page ids reach the
        device table in one host-to-device copy that does not wait for the device."""
        ensure_many([(self, slots)])

    def widen(self, pages: int) -> None:
        """Record that a layer holds `pages` pages (before they are taken: `ensure_many`): the table grows (doubling)
        where it is too narrow, and the version changes."""
        self.widest = max(self.widest, pages)
        self.reserve(pages, doubling=True)
        self.version = next(_versions)

    def reserve(self, pages: int, doubling: bool = False) -> None:
        """A table at least `pages` wide (with `doubling`, at least twice its width when it grows), its entries
        kept. The engine reserves a request's whole length when it admits it, so that its table is made once, not
        grown as its prompt and output fill it (each growth a new device tensor: on a GPU whose memory the pool
        fills, milliseconds of the host's time that a server's step waits for)."""
        if pages <= self.table.shape[1]:
            return
        width = max(pages, 2 * self.table.shape[1] if doubling else pages)
        with torch.inference_mode(False):  # a normal tensor even when it grows during generation
            grown = torch.zeros(self.table.shape[0], width, dtype=torch.long, device=self.table.device)
            grown[:, : self.table.shape[1]] = self.table
        self.table = grown
        host = np.zeros((len(self.pages), width), dtype=np.int64)
        host[:, : self.pages.shape[1]] = self.pages
        self.pages = host

    def physical(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Logical slots (any shape) of `layer` -> physical rows of the flattened pool."""
        size = self.pool.page_size
        return self.table[layer][slots // size] * size + slots % size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Store tokens: slots [T] (all heads) or [T, kv_heads] (per head), k/v [T, kv_heads, D], pos [T] or
        [T, kv_heads] (heads holding different tokens)."""
        kf, vf, pf = self.pool.flat()
        rows = self.physical(layer, slots)
        pos = pos.to(torch.int32)
        pos = pos if pos.dim() == 2 else pos[:, None].expand(-1, self.pool.num_kv_heads)
        if rows.dim() == 1:
            kf[rows], vf[rows], pf[rows] = k, v, pos
        else:
            heads = torch.arange(self.pool.num_kv_heads, device=rows.device)[None, :]
            kf[rows, heads], vf[rows, heads], pf[rows, heads] = k, v, pos

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """slots [kv_heads or 1, n] -> keys, values [kv_heads, n, D] and positions [kv_heads, n]."""
        kf, vf, pf = self.pool.flat()
        rows = self.physical(layer, slots)
        heads = self.pool.num_kv_heads
        if rows.shape[0] == 1:
            return kf[rows[0]].transpose(0, 1), vf[rows[0]].transpose(0, 1), pf[rows[0]].transpose(0, 1)
        idx = torch.arange(heads, device=rows.device)[:, None]
        return kf[rows, idx], vf[rows, idx], pf[rows, idx]

    def all_slots(self, layer: int) -> torch.Tensor:
        return torch.arange(self.num_slots[layer], device=self.table.device)[None, :]

    def keys(self, layer: int) -> torch.Tensor:
        """All stored keys of `layer`: [kv_heads, num_slots, D]."""
        return self.gather(layer, self.all_slots(layer))[0]

    def positions(self, layer: int) -> torch.Tensor:
        """Original token position of every stored slot: [kv_heads, num_slots]."""
        return self.gather(layer, self.all_slots(layer))[2]

    def layer_pages(self, layer: int) -> np.ndarray:
        """The pages `layer` holds, in slot order: [pages] int64 (a view)."""
        return self.pages[layer, : self.page_count[layer]]

    def share(self, blocks: list) -> None:
        """Start from cached prompt blocks (`PrefixCache.match`): their pages, in every layer, hold this sequence's
        first slots."""
        pages = self.pool.share(blocks)  # [blocks, layers]
        n = len(blocks)
        self.widen(n)
        self.pages[:, :n] = pages.T
        self.page_count[:] = n
        self.num_slots = [n * self.pool.page_size] * len(self.num_slots)
        self.table[:, :n] = self.pool.staging.send(pages).t()

    def unshare(self, keep: dict[int, int]) -> None:
        """Before the first pages of each layer that `keep` gives (layer -> pages) are rewritten whole by the caller
        (nothing is copied) and the rest leave it: cached pages and the first `protect` pages among those it keeps are
        replaced by new pages of its own; protected pages leave for the side (for the cache), cached ones lose this
        holder, the rest go back to the pool. A follow-up question on a cached document compacted to its budget takes
        new pages for what it keeps, not for the whole document. The layers' new pages come in one allocation (before
        any page leaves: the cache keeps them), the leaving ones go in one release and the table's entries in one
        copy; the layers are handled together, as arrays [layers, pages]."""
        cache = self.pool.cache
        layers = np.fromiter(keep, dtype=np.int64, count=len(keep))  # [G]
        n = np.fromiter(keep.values(), dtype=np.int64, count=len(keep))[:, None]  # [G, 1] pages kept
        count = self.page_count[layers]  # [G]
        held = self.pages[layers, : count.max(initial=0)]  # [G, P] (a copy); past count[g]: not held
        column = np.arange(held.shape[1])  # [P]
        valid = column < count[:, None]
        guard = np.array([0 if len(self.aside[layer]) else self.protect for layer in layers.tolist()])[:, None]
        kept = valid & (column < n)
        cached = np.zeros_like(kept)  # asked of the cache only where it decides: kept pages past the protected ones
        if cache is not None:
            asked = kept & (column >= guard)
            cached[asked] = cache.cached_mask(held[asked])
        ours = kept & ((column < guard) | cached)  # rewritten: renewed with pages of its own
        gone = valid & (ours | (column >= n))  # leaving this sequence
        if not gone.any():
            return
        aside = gone & (column < guard)
        fresh = np.asarray(self.pool.allocate(int(ours.sum())), dtype=np.int64)  # before any page leaves
        for g in np.flatnonzero(aside.any(1)).tolist():
            self.aside[layers[g]] = held[g, aside[g]]
        leaving = held[gone & ~aside]  # layer by layer, in page order
        rows, cols = np.nonzero(ours)  # [k] each, layer by layer as `fresh` was taken
        held[rows, cols] = fresh
        self.pages[layers, : held.shape[1]] = held
        self.page_count[layers] = np.minimum(count, n[:, 0])
        if len(leaving):
            self.pool.release(leaving)
        if len(fresh):
            index = self.pool.staging.send(np.stack([layers[rows], cols, fresh]))  # [3, k]
            self.table[index[0], index[1]] = index[2]
        self.widest = int(self.page_count.max())
        self.version = next(_versions)

    def compact(self, keep: dict[int, torch.Tensor]) -> None:
        """Keep only the slots `keep` gives each layer ([kv_heads or 1, n_keep], ascending per head), moved to slots
        [0, n_keep); the pages no longer needed go back to the pool. Layers keeping as many slots in the same layout
        are gathered in one copy and written back in one, as many as `COMPACT_BYTES` of kept K/V allow (`unshare`
        moves the pages of all of them at once): a packed prompt chunk compacts every layer after its forward
        (`step.evict_layers`)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for layer, slots in keep.items():
            groups.setdefault(tuple(slots.shape), []).append(layer)
        size, pool = self.pool.page_size, self.pool
        for (_, n_keep), layers in groups.items():
            per_layer = n_keep * pool.num_kv_heads * (2 * pool.head_dim * pool.k.element_size() + 4)
            at_once = max(1, COMPACT_BYTES // per_layer)
            for part in (layers[first : first + at_once] for first in range(0, len(layers), at_once)):
                k, v, pos = self.gather_layers(part, torch.stack([keep[layer] for layer in part]))  # copies
                self.unshare({layer: -(-n_keep // size) for layer in part})
                kf, vf, pf = pool.flat()  # after `unshare`: its allocation may grow the pool
                rows = self._rows(part, n_keep)
                kf[rows], vf[rows], pf[rows] = k, v, pos
                for layer in part:
                    self.truncate(layer, n_keep)

    def _tables(self, layers: list[int]) -> torch.Tensor:
        """The page tables of `layers` [G, capacity] (a view for consecutive layers, else through the staging ring:
        a list index would copy to the device and wait)."""
        if layers == list(range(layers[0], layers[-1] + 1)):
            return self.table[layers[0] : layers[-1] + 1]
        return self.table[self.pool.staging.send(layers)]

    def _rows(self, layers: list[int], n: int) -> torch.Tensor:
        """Pool rows of slots [0, n) of `layers`: [G, n]."""
        size = self.pool.page_size
        tables = self._tables(layers)[:, : -(-n // size)]  # [G, pages]
        return (tables[:, :, None] * size + torch.arange(size, device=tables.device)).flatten(1)[:, :n]

    def stored(self, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored key and position of `layers`, which hold as many slots n: [G, kv_heads, n, D] and
        [G, kv_heads, n] (views of copies)."""
        kf, _, pf = self.pool.flat()
        rows = self._rows(layers, self.num_slots[layers[0]])
        return kf[rows].permute(0, 2, 1, 3), pf[rows].permute(0, 2, 1)

    def gather_layers(self, layers: list[int], slots: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """slots [G, kv_heads or 1, n] of `layers` -> keys, values [G, n, kv_heads, D] and positions [G, n, kv_heads]
        (a slot of every head when one is given for all)."""
        kf, vf, pf = self.pool.flat()
        size, groups = self.pool.page_size, slots.shape[0]
        pages = torch.gather(self._tables(layers), 1, (slots // size).view(groups, -1)).view_as(slots)
        rows = pages * size + slots % size
        if rows.shape[1] == 1:
            return kf[rows[:, 0]], vf[rows[:, 0]], pf[rows[:, 0]]
        heads = torch.arange(self.pool.num_kv_heads, device=rows.device)[None, :, None]
        return kf[rows, heads].transpose(1, 2), vf[rows, heads].transpose(1, 2), pf[rows, heads].transpose(1, 2)

    def truncate(self, layer: int, n: int) -> None:
        """Drop slots >= n and release the pages past them."""
        self.num_slots[layer] = n
        need, have = -(-n // self.pool.page_size), int(self.page_count[layer])
        if have > need:
            extra = self.pages[layer, need:have].copy()
            self.page_count[layer] = need
            self.pool.release(extra)
            self.widest = int(self.page_count.max())

    def drop_pages(self, first: int, count: int) -> None:
        """Remove pages [first, first + count) of every layer, which must be full: their slots go, the later slots
        move down by count * page_size without a copy (only the table's entries move), the pages go back to the
        pool (in one release, layer by layer)."""
        self.pool.release(self.pages[:, first : first + count].ravel())
        self.pages[:, first : self.widest - count] = self.pages[:, first + count : self.widest].copy()
        self.page_count -= count
        self.num_slots = [n - count * self.pool.page_size for n in self.num_slots]
        self.table[:, first : self.widest - count] = self.table[:, first + count : self.widest].clone()
        self.widest = int(self.page_count.max())
        self.version = next(_versions)

    @property
    def held_pages(self) -> int:
        """Pages this sequence holds, in every layer (those set aside for the prefix cache too)."""
        return int(self.page_count.sum()) + sum(map(len, self.aside))

    def resident_slots(self) -> float:
        """Mean stored slots per layer (per KV head)."""
        return sum(self.num_slots) / len(self.num_slots)

    def release(self) -> None:
        """Give every page back to the pool (in one release) and drop the table (it widens again if the sequence is
        refilled). Each layer's last pages first: cached prompt blocks become idle tail first, so the prefix cache
        evicts a prompt's tail before its head (a head evicted would make the rest unreachable)."""
        parts = [part for layer in range(len(self.aside))
                 for part in (self.aside[layer][::-1], self.layer_pages(layer)[::-1])]
        if parts:
            self.pool.release(np.concatenate(parts))
        self.page_count[:] = 0
        self.aside = [_NONE] * len(self.aside)
        self.num_slots = [0] * len(self.num_slots)
        self.protect = 0
        self.widest = 0
        self.table = self.table.new_zeros(self.table.shape[0], 0)
        self.pages = np.zeros((len(self.pages), 0), dtype=np.int64)
