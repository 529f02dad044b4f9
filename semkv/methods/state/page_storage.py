"""Method state stored beside the KV pool, by physical page like the keys (H2O's accumulated attention, InfLLM's
representative scores and block keys, DynSplit-KV's attended-step stamps): a batch reads and writes it through its
page tables, with no per-sequence copies, and a freed page frees its state with it.

It holds an entry for each page id the pool ever handed out (`KVPool.coverage`, grown by the pool when it hands out
new ids), not for the whole pool: a pool on a large card is sized by free memory, and state for every page of it
would not fit beside it."""
from __future__ import annotations

import math
from typing import Callable

import torch

from semkv.engine.kv_cache import KVPool


class PageStorage:
    """A tensor [pages, *trailing(pool)], one entry per physical page id the pool covers, in `dtype` or
    (`pool_dtype`) in the cache's dtype; grows with the pool's coverage (`KVPool.page_states`). The method writes
    every entry it later reads (a page handed out again holds its last owner's values)."""

    def __init__(self, trailing: Callable[[KVPool], tuple[int, ...]], pool_dtype: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        self.trailing, self.pool_dtype, self.dtype = trailing, pool_dtype, dtype
        self.data: torch.Tensor | None = None

    @property
    def pages(self) -> int:
        return 0 if self.data is None else self.data.shape[0]

    def _dtype(self, pool: KVPool) -> torch.dtype:
        return pool.dtype if self.pool_dtype else self.dtype

    def bytes_per_page(self, pool: KVPool) -> int:
        return math.prod(self.trailing(pool)) * self._dtype(pool).itemsize

    def growth_bytes(self, pool: KVPool) -> int:
        """Device bytes `ensure(pool)` allocates."""
        pages = pool.start_coverage
        return 0 if self.pages >= pages else pages * self.bytes_per_page(pool)

    def ensure(self, pool: KVPool) -> bool:
        """Cover the pages the pool covers, and grow with it from now on; True when the storage moved (captured
        graphs must be captured again)."""
        return pool.register(self)

    def cover(self, pool: KVPool, pages: int) -> bool:
        have = self.pages
        if have >= pages:
            return False
        with torch.inference_mode(False):  # a normal tensor, written outside generation too
            grown = torch.zeros(pages, *self.trailing(pool), dtype=self._dtype(pool), device=pool.device)
            if self.data is not None:
                grown[:have] = self.data
        self.data = grown
        return True


def slot_scores() -> PageStorage:
    """One float32 score per slot and KV head: [pages, page_size, kv_heads]."""
    return PageStorage(lambda pool: (pool.page_size, pool.num_kv_heads))


def resident_pages(pool: KVPool, tables: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """Physical pages of logical slots [0, width) under tables [..., max_pages] -> [..., ceil(width / page_size)];
    pages past each row's slot count `counts` [...] become the scratch page, so that no write lands on a page another
    sequence owns."""
    size = pool.page_size
    pages = tables[..., : -(-width // size)]
    held = torch.arange(pages.shape[-1], device=pages.device) * size < counts[..., None]
    return torch.where(held, pages, pool.scratch)
