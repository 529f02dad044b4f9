"""Automatic prefix caching: prompt pages found again by their content, as vLLM's block pool does.

A *block* is one page of prompt tokens [i * page_size, (i + 1) * page_size) in every layer: one physical page per
layer. Its key chains the previous block's key with the block's token ids (`block_keys`), so equal keys mean equal
whole prefixes. When a request's prefill has computed a block in every layer, the block is added to the cache (its
pages gain a reference count); a later request whose prompt starts with the same blocks takes those pages instead of
computing them (`KVPool.share`). A page is written only by the request that computed it: a method that rewrites
prompt slots (prefill eviction's compaction) first moves to pages of its own (`SeqKV.unshare`).

Cached pages that no request holds stay filled ("idle") and count as free: when the pool runs out of never-used and
released pages, the least recently used idle blocks are evicted, whole (`evict`).
"""
from __future__ import annotations

import array
import hashlib
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

RECENT = 8  # prompts whose page keys a new prompt may share (`PromptKeys`' like)


def block_keys(ids: list[int] | np.ndarray, page_size: int, count: int, key: bytes = b"") -> list[bytes]:
    """Chained keys of the first `count` full pages of the token ids `ids`, the chain going on from `key` (the key of
    the page before `ids`' first; b"" at a prompt's start)."""
    tokens = np.asarray(ids[: count * page_size], dtype=np.int64).reshape(count, page_size)
    keys = []
    for row in tokens:
        key = hashlib.blake2b(key + row.tobytes(), digest_size=16).digest()
        keys.append(key)
    return keys


class PromptKeys:
    """The keys of a prompt's full pages (`block_keys`), hashed as far as they are asked for: a lookup hashes runs of
    `RUN` pages only while the cache holds them (a new prompt's first run misses), and `Engine.cache_prompt` hashes
    the pages a chunk computed after the chunk is queued, while the device runs it; a prompt that starts with the
    same tokens as a recent one (`like`: a follow-up question on the same document) takes that one's keys of the
    pages they share, found by comparing the tokens. Hashing a 32k prompt's 2,000 pages took about 5 ms of the
    host's time at its admission, with the device idle when a step starts with new prompts."""

    RUN = 64

    def __init__(self, ids: list[int], page_size: int, like: Iterable[PromptKeys] = ()):
        # through an array of C integers: half np.asarray's time on a list (about 0.5 ms for a 32k prompt)
        self.tokens, self.page_size = np.frombuffer(array.array("q", ids), dtype=np.int64), page_size
        self.count = len(ids) // page_size  # full pages
        self.keys: list[bytes] = []  # the first ones, hashed
        for other in like:
            shared = min(len(other.keys), self.count) * page_size  # tokens of the pages the other has keys for
            if shared <= len(self.keys) * page_size or ids[:page_size] != other.tokens[:page_size].tolist():
                continue  # no more pages than found already, or another document (compared from its first page)
            same = self.tokens[:shared] == other.tokens[:shared]
            pages = (shared if same.all() else int(same.argmin())) // page_size
            if pages > len(self.keys):
                self.keys = other.keys[:pages]

    def first(self, count: int) -> list[bytes]:
        """The keys of the first `count` full pages (at most `self.count`)."""
        self._hash(count)
        return self.keys[:count]

    def runs(self, count: int) -> Iterator[list[bytes]]:
        """The keys of the first `count` full pages in runs: those hashed already, then `RUN` more at a time, hashed
        as they are reached."""
        done, count = 0, min(count, self.count)
        while done < count:
            if done == len(self.keys):
                self._hash(done + self.RUN)
            run = self.keys[done:count]
            done += len(run)
            yield run

    def _hash(self, count: int) -> None:
        """Hash the keys of the first `count` full pages (at most `self.count`) not hashed yet."""
        done, page = len(self.keys), self.page_size
        count = min(count, self.count)
        if count > done:
            self.keys += block_keys(self.tokens[done * page:count * page], page, count - done,
                                    self.keys[-1] if done else b"")


@dataclass(slots=True, eq=False)  # compared by identity: `None in blocks` (a miss) asks each block
class Block:
    key: bytes
    id: int  # its index in the cache's arrays (its pages: `PrefixCache.pages[id]`; reused once it is evicted)


class PrefixCache:
    """The cached blocks of one pool, the requests holding each cached page, and the LRU order of idle blocks.

    Per-page and per-block counts live in numpy arrays (indexed by page id and block id), so a request's thousands of
    pages are counted in a few vector operations: a 32k prompt's blocks are 48,000 pages at 24 layers, which counted
    one by one in Python took about 40 ms of the host's time a request (added, taken, given back), while the device
    waited between steps."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.blocks: dict[bytes, Block] = {}
        self.by_id: list[Block | None] = []  # block id -> block (None: a free id)
        self._free_ids: list[int] = []
        self.owner = np.full(0, -1, dtype=np.int64)  # page id -> id of the cached block holding it, or -1
        self.refs = np.zeros(0, dtype=np.int64)  # cached page id -> requests holding it
        self.idle = np.zeros(0, dtype=np.int64)  # block id -> its pages that no request holds
        self.pages = np.zeros((0, num_layers), dtype=np.int64)  # block id -> its page in every layer
        # the LRU order of fully idle blocks, kept without a Python operation a block (a follow-up question on a
        # 32k document takes and gives back 2,000 blocks): each block's clock reading when it went idle (-1: held or
        # free), and runs of (block ids, readings) in that order; an entry whose block was taken or evicted since
        # reads differently now and is skipped
        self.idled_at = np.zeros(0, dtype=np.int64)  # block id -> its reading, or -1
        self._runs: deque[tuple[np.ndarray, np.ndarray]] = deque()
        self._queued = 0  # entries in the runs, stale ones too (rebuilt when they outgrow the blocks)
        self._clock = 0
        self.evictable = 0  # pages of fully idle blocks
        self.recent: deque[PromptKeys] = deque(maxlen=RECENT)  # the last prompts looked up, whose keys others share

    def match(self, runs: Iterable[list[bytes]]) -> list[Block]:
        """The cached blocks of the longest run of keys from the start, the keys given in runs (`PromptKeys.runs`;
        read no further than the run of the first miss)."""
        found: list[Block] = []
        for run in runs:
            blocks = list(map(self.blocks.get, run))
            if None in blocks:
                return found + blocks[: blocks.index(None)]
            found += blocks
        return found

    def take(self, blocks: list[Block]) -> tuple[int, np.ndarray]:
        """A request holds these blocks' pages now: how many pages were idle (they leave the free count), and the
        pages [blocks, layers]."""
        ids = np.fromiter([block.id for block in blocks], dtype=np.int64, count=len(blocks))
        pages = self.pages[ids]  # [blocks, layers]
        if not blocks:
            return 0, pages
        refs = self.refs[pages]
        woken = (refs == 0).sum(1)  # [blocks]
        self.refs[pages] = refs + 1  # a request takes each page once
        wake = ids[self.idle[ids] == self.num_layers]  # fully idle until now
        self.idled_at[wake] = -1
        self.evictable -= self.num_layers * len(wake)
        self.idle[ids] -= woken
        return int(woken.sum()), pages

    def add(self, keys: list[bytes], pages: np.ndarray, held: bool) -> int:
        """Cache the blocks computed for `keys` (pages [blocks, layers]: each one's page in every layer), held by one
        request (`held`) or by none; a key cached already is skipped (its caller keeps those pages as its own).
        How many blocks were added."""
        new = [i for i, key in enumerate(keys) if key not in self.blocks]
        if not new:
            return 0
        pages = np.asarray(pages, dtype=np.int64)[new]
        self._fit(int(pages.max()) + 1)
        ids = self._new_ids(len(new))
        for i, block_id in zip(new, ids.tolist()):
            self.blocks[keys[i]] = self.by_id[block_id] = Block(keys[i], block_id)
        self.owner[pages] = ids[:, None]
        self.pages[ids] = pages
        self.refs[pages] = int(held)
        self.idle[ids] = 0 if held else self.num_layers
        if not held:
            self._idle(ids)
        return len(new)

    def unref(self, pages: list[int]) -> tuple[list[int], int]:
        """A request gives back `pages` (distinct): (the ones not cached, to free; how many cached ones became
        idle)."""
        pages = np.asarray(pages, dtype=np.int64)
        known = pages < len(self.owner)  # pages above every cached one are not cached
        owner = np.where(known, self.owner[np.where(known, pages, 0)], -1)  # (a masked write: 10x the time)
        cached = owner >= 0
        private = pages[~cached].tolist()
        mine, owner = pages[cached], owner[cached]
        refs = self.refs[mine] - 1
        self.refs[mine] = refs
        idled = owner[refs == 0]  # blocks of the pages no request holds now (one entry a page)
        np.add.at(self.idle, idled, 1)
        full = idled[self.idle[idled] == self.num_layers]  # a block once for each of its pages given
        if len(full):  # the blocks in the order of their first page given: a prompt's tail first is evicted first
            first = np.full(len(self.idle), len(full))  # (np.unique sorts: 4 ms for a 32k prompt's 48,000 pages)
            np.minimum.at(first, full, np.arange(len(full)))
            blocks = np.flatnonzero(first < len(full))
            self._idle(blocks[np.argsort(first[blocks])])
        return private, len(idled)

    def evict(self, pages: int) -> list[int]:
        """Drop least recently used idle blocks until `pages` pages are freed (or none is left): their pages, block
        by block."""
        freed: list[np.ndarray] = []
        count = 0
        while count < pages and self._runs:
            ids, readings = self._runs.popleft()
            self._queued -= len(ids)
            live = self.idled_at[ids] == readings
            ids, readings = ids[live], readings[live]
            need = -(-(pages - count) // self.num_layers)
            if len(ids) > need:  # the rest stay first in the order
                self._runs.appendleft((ids[need:], readings[need:]))
                self._queued += len(ids) - need
                ids = ids[:need]
            its = self.pages[ids]  # [k, layers]
            self.owner[its] = -1
            self.refs[its] = 0
            self.idled_at[ids] = -1
            for block_id in ids.tolist():
                del self.blocks[self.by_id[block_id].key]
                self.by_id[block_id] = None
            self._free_ids.extend(ids.tolist())
            self.evictable -= self.num_layers * len(ids)
            count += self.num_layers * len(ids)
            freed.append(its.ravel())
        return np.concatenate(freed).tolist() if freed else []

    def clear(self) -> list[int]:
        """Forget every idle block (their pages, to free) and the recent prompts' keys; blocks still held stay
        cached."""
        self.recent.clear()
        return self.evict(self.evictable)

    def _idle(self, ids: np.ndarray) -> None:
        """These blocks (ids [k], in this order) have no holder now: the most recently used of the idle ones."""
        readings = np.arange(self._clock, self._clock + len(ids))
        self._clock += len(ids)
        self.idled_at[ids] = readings
        self._runs.append((ids, readings))
        self._queued += len(ids)
        self.evictable += self.num_layers * len(ids)
        if self._queued > 2 * len(self.by_id) + 1024:  # mostly stale: one run of the live entries, in order
            ids, readings = (np.concatenate(part) for part in zip(*self._runs))
            live = self.idled_at[ids] == readings
            self._runs = deque([(ids[live], readings[live])])
            self._queued = int(live.sum())

    def cached_mask(self, pages: np.ndarray) -> np.ndarray:
        """Whether each page id of `pages` [n] int64 belongs to a cached block: bool [n]."""
        known = pages < len(self.owner)
        return known & (self.owner[np.where(known, pages, 0)] >= 0) if len(self.owner) else np.zeros(len(pages), bool)

    def _fit(self, pages: int) -> None:
        """Per-page arrays for page ids below `pages`."""
        self.owner, self.refs = _grown(self.owner, pages, -1), _grown(self.refs, pages, 0)

    def _new_ids(self, count: int) -> np.ndarray:
        """`count` block ids: freed ones first, then new ones (the per-block array grown to hold them)."""
        reused = self._free_ids[len(self._free_ids) - min(count, len(self._free_ids)):]
        del self._free_ids[len(self._free_ids) - len(reused):]
        first = len(self.by_id)
        fresh = list(range(first, first + count - len(reused)))
        self.by_id.extend([None] * len(fresh))
        self.idle = _grown(self.idle, len(self.by_id), 0)
        self.idled_at = _grown(self.idled_at, len(self.by_id), -1)
        self.pages = _grown(self.pages, len(self.by_id), 0)
        return np.asarray(reused + fresh, dtype=np.int64)


def _grown(values: np.ndarray, size: int, fill: int) -> np.ndarray:
    """`values` (indexed by its first dimension), or when shorter than `size` a copy grown to hold it (by half at
    least, 1024 at least), new entries `fill`."""
    if size <= len(values):
        return values
    grown = max(size, len(values) * 3 // 2, 1024)
    return np.concatenate([values, np.full((grown - len(values), *values.shape[1:]), fill, dtype=values.dtype)])
