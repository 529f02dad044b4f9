"""Per-page key summaries (element-wise min / max / sum of keys per KV head), stored by physical page id: min and max
in the pool's dtype (they are stored keys, so exact), sums and summaries of transformed keys in float32.

Summaries live beside the KV pool, so a batch gathers them through the page tables like the keys themselves: no
per-sequence copies, and freeing a page frees its summary. Used by page-level selection methods (Quest, CHESS).
"""
from __future__ import annotations

from typing import Callable

import torch

from semkv import kernels
from semkv.engine.hooks import DecodeBatch
from semkv.engine.kv_cache import KVPool, SeqKV
from semkv.models.parallel import TensorParallel, over_heads

STATS = ("min", "max", "sum")


class PageSummaries:
    """`transform(keys [..., D], positions [...]) -> keys`, if given, maps the stored keys (e.g. undoes RoPE) before
    they are summarised."""

    def __init__(self, stats: tuple[str, ...], transform: Callable | None = None):
        unknown = set(stats) - set(STATS)
        if unknown:
            raise ValueError(f"unknown summary statistics {sorted(unknown)}; allowed: {STATS}")
        self.stats = stats
        self.transform = transform
        self.data: dict[str, torch.Tensor] = {}

    def _dtype(self, stat: str, pool: KVPool) -> torch.dtype:
        # min / max of stored keys are stored keys: exact in the pool's dtype (half the bytes Quest reads)
        exact = stat in ("min", "max") and self.transform is None
        return pool.dtype if exact else torch.float32

    def _short(self, pool: KVPool, pages: int) -> list[str]:
        """The statistics whose tables hold fewer than `pages` pages."""
        return [stat for stat in self.stats if stat not in self.data or self.data[stat].shape[0] < pages]

    @property
    def pages(self) -> int:
        """Page ids every statistic's table holds."""
        return min((self.data[stat].shape[0] if stat in self.data else 0 for stat in self.stats), default=0)

    def ensure(self, pool: KVPool) -> bool:
        """Cover the pages the pool covers (`KVPool.coverage`), and grow with it from now on (`KVPool.page_states`);
        True when a table moved."""
        return pool.register(self)

    def cover(self, pool: KVPool, pages: int) -> bool:
        short = self._short(pool, pages)
        for stat in short:
            old = self.data.get(stat)
            have = 0 if old is None else old.shape[0]
            new = torch.empty(pages - have, pool.num_kv_heads, pool.head_dim, dtype=self._dtype(stat, pool),
                              device=pool.device)
            self.data[stat] = new if old is None else torch.cat([old, new])
        return bool(short)

    def bytes_per_page(self, pool: KVPool) -> int:
        return sum(pool.num_kv_heads * pool.head_dim * self._dtype(stat, pool).itemsize for stat in self.stats)

    def growth_bytes(self, pool: KVPool) -> int:
        """Device bytes `ensure(pool)` allocates (a grown table is a new one, the old one freed after)."""
        pages = pool.start_coverage
        return sum(pages * pool.num_kv_heads * pool.head_dim * self._dtype(stat, pool).itemsize
                   for stat in self._short(pool, pages))

    def build(self, kv: SeqKV, layer: int) -> None:
        """Summaries of every page of one sequence and layer, from its stored keys."""
        n, size = kv.num_slots[layer], kv.pool.page_size
        pages = -(-n // size)
        filled = (n - torch.arange(pages, device=kv.table.device) * size).clamp(max=size)
        self.rebuild(kv.pool, kv.table[layer, :pages], filled)

    def rebuild(self, pool: KVPool, page_ids: torch.Tensor, filled: torch.Tensor, block: int = 64) -> None:
        """Summaries of physical pages `page_ids` [..., m] from their first `filled` [..., m] slots (`block` pages of
        the last dim at a time, to bound the float32 copy of their keys)."""
        self.ensure(pool)
        size = pool.page_size
        for lo in range(0, page_ids.shape[-1], block):
            ids, count = page_ids[..., lo : lo + block], filled[..., lo : lo + block]
            keys = pool.k[ids].float()  # [..., block, size, kv_heads, D]
            if self.transform is not None:
                keys = self.transform(keys, pool.pos[ids])
            valid = (torch.arange(size, device=ids.device) < count[..., None])[..., None, None]
            for stat, fill, reduce in (("min", float("inf"), torch.amin), ("max", float("-inf"), torch.amax),
                                       ("sum", 0.0, torch.sum)):
                if stat in self.stats:
                    table = self.data[stat]
                    table[ids] = reduce(torch.where(valid, keys, fill), -3).to(table.dtype)

    def add_tokens(self, pool: KVPool, tables: torch.Tensor, slots: torch.Tensor) -> None:
        """Fold the keys just written at logical slots [B, kv_heads] into their pages' summaries (a slot at a page
        start resets the page). tables: [B, max_pages] of the layer."""
        self.ensure(pool)
        size = pool.page_size
        page_ids = torch.gather(tables, 1, slots // size)  # [B, kv_heads]
        rows = page_ids * size + slots % size
        heads = torch.arange(pool.num_kv_heads, device=slots.device)[None, :]
        kf = pool.flat()[0]
        keys = kf[rows, heads].float()  # [B, kv_heads, D]
        if self.transform is not None:
            keys = self.transform(keys, pool.flat()[2][rows, heads])
        fresh = (slots % size == 0)[..., None]
        for stat, op in (("min", torch.minimum), ("max", torch.maximum), ("sum", torch.add)):
            if stat in self.stats:
                table = self.data[stat]
                table[page_ids, heads] = torch.where(fresh, keys, op(table[page_ids, heads], keys)).to(table.dtype)

    def best_pages(self, batch: DecodeBatch, layer: int, q: torch.Tensor, n: torch.Tensor, lo: torch.Tensor,
                   hi: torch.Tensor, tokens: int, group_reduce: str,
                   tp: TensorParallel | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode step's first stage of score_keys="pages" (TokenSelect, DynSplit-KV): each row's pages with the
        highest Quest bound for q [B, heads, D] (`kernels.page_bound` over the min / max summaries, `group_reduce`
        over a KV group; it folds the current key, at slot n - 1 [B], into its page first) that hold about `tokens`
        slots of [lo, hi) [B], plus the two pages the range may cut. With tensor parallelism every rank keeps the
        same pages: the bound over every rank's heads. Returns `kernels.page_candidates`' (physical ids, pages,
        span)."""
        pool, size = batch.pool, batch.pool.page_size
        tables = batch.tables[:, layer, :min(batch.tables.shape[-1], -(-batch.max_slots // size))]  # [B, W]
        bound = kernels.page_bound(q, self.data["min"], self.data["max"], tables, n, size, group_reduce,
                                   k_pool=pool.k)  # [B, kv_heads, W]
        if tp is not None:
            bound = over_heads(tp, bound, 1, "max", keepdim=True)  # [B, 1, W]
        count = min(tables.shape[-1], -(-tokens // size) + 2)
        return kernels.page_candidates(bound, lo, hi, tables, size, count)

    def gather(self, stat: str, tables: torch.Tensor) -> torch.Tensor:
        """tables [B, n_pages] physical ids -> [B, n_pages, kv_heads, D]."""
        return self.data[stat][tables]
