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

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


def block_keys(ids: list[int], page_size: int, count: int) -> list[bytes]:
    """Chained keys of the first `count` full pages of the token ids `ids`."""
    tokens = np.asarray(ids[: count * page_size], dtype=np.int64).reshape(count, page_size)
    keys, key = [], b""
    for row in tokens:
        key = hashlib.blake2b(key + row.tobytes(), digest_size=16).digest()
        keys.append(key)
    return keys


@dataclass(slots=True)
class Block:
    key: bytes
    pages: tuple[int, ...]  # one physical page per layer
    idle: int = 0  # pages of it that no request holds (all of them: the block can be evicted)


class PrefixCache:
    """The cached blocks of one pool, the requests holding each cached page, and the LRU order of idle blocks."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.blocks: dict[bytes, Block] = {}
        self.block_of: dict[int, Block] = {}  # cached page -> its block
        self.refs: dict[int, int] = {}  # cached page -> requests holding it
        self.lru: OrderedDict[bytes, Block] = OrderedDict()  # idle blocks, least recently used first
        self.evictable = 0  # pages of idle blocks
        self.hits = 0  # blocks taken by requests (counters for metrics)

    def match(self, keys: list[bytes]) -> list[Block]:
        """The cached blocks of the longest run of `keys` from the start."""
        found = []
        for key in keys:
            block = self.blocks.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def take(self, blocks: list[Block]) -> int:
        """A request holds these blocks' pages now; returns how many pages were idle (they leave the free count)."""
        woken = 0
        for block in blocks:
            for page in block.pages:
                self.refs[page] += 1
                if self.refs[page] == 1:
                    woken += 1
                    self._busy(block)
        self.hits += len(blocks)
        return woken

    def add(self, key: bytes, pages: tuple[int, ...], held: bool) -> bool:
        """Cache pages computed for `key`, held by one request (`held`) or by none; False when the key is cached
        already (the caller keeps its pages as its own)."""
        if key in self.blocks:
            return False
        block = self.blocks[key] = Block(key, pages)
        for page in pages:
            self.block_of[page] = block
            self.refs[page] = int(held)
        if not held:
            block.idle = len(pages)
            self._idle(block)
        return True

    def unref(self, pages: list[int]) -> tuple[list[int], int]:
        """A request gives back `pages`: (the ones not cached, to free; how many cached ones became idle)."""
        private, idled = [], 0
        for page in pages:
            block = self.block_of.get(page)
            if block is None:
                private.append(page)
                continue
            self.refs[page] -= 1
            if self.refs[page] == 0:
                idled += 1
                block.idle += 1
                if block.idle == len(block.pages):
                    self._idle(block)
        return private, idled

    def evict(self, pages: int) -> list[int]:
        """Drop least recently used idle blocks until `pages` pages are freed (or none is left): their pages."""
        freed: list[int] = []
        while len(freed) < pages and self.lru:
            _, block = self.lru.popitem(last=False)
            self.evictable -= len(block.pages)
            del self.blocks[block.key]
            for page in block.pages:
                del self.block_of[page], self.refs[page]
            freed.extend(block.pages)
        return freed

    def clear(self) -> list[int]:
        """Forget every idle block (their pages, to free); blocks still held stay cached."""
        return self.evict(self.evictable)

    def _idle(self, block: Block) -> None:
        self.lru[block.key] = block
        self.evictable += len(block.pages)

    def _busy(self, block: Block) -> None:
        """A page of `block` is held again."""
        if block.idle == len(block.pages):
            del self.lru[block.key]
            self.evictable -= len(block.pages)
        block.idle -= 1

    def cached(self, page: int) -> bool:
        return page in self.block_of
