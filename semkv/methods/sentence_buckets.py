"""SentenceKV's state: per sequence (`SentenceState`) the budget split, bucket starts and mean query; per layer
(`LayerBuckets`) the bucket (sentence) of every retained token, the per-bucket key sums whose means are the sentence
vectors, the ranking of buckets against a query, and the working set that holds the chosen tokens on the device when
the retained tokens live in host memory.

Retained tokens are numbered 0..n-1 per KV head in position order (their index in the host store, or their offset
in the device region that holds them without offloading); bucket ids grow with positions, so each bucket's tokens of
one head are a contiguous index range.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from semkv.engine.kv_cache import SeqKV
from semkv.engine.offload import HostKVStore


def bucket_of(starts: list[int], positions: torch.Tensor) -> torch.Tensor:
    """Bucket id of each token position, given the bucket start positions (ascending)."""
    bounds = torch.tensor(starts, device=positions.device, dtype=torch.long)
    return torch.searchsorted(bounds, positions.long().contiguous(), right=True) - 1


@dataclass
class LayerBuckets:
    bucket: torch.Tensor  # [kv_heads, n] bucket id of each retained token
    key_sum: torch.Tensor  # [kv_heads, n_buckets, D] float32 sum of the bucket's retained keys
    count: torch.Tensor  # [kv_heads, n_buckets] retained tokens per bucket
    loaded: torch.Tensor | None = None  # [kv_heads, capacity] token held by each working-set slot, -1 if empty
    vectors: torch.Tensor | None = None  # [kv_heads, n_buckets, D] sentence vectors: mean retained key

    @classmethod
    def empty(cls, kv_heads: int, dim: int, device: torch.device) -> "LayerBuckets":
        return cls(torch.zeros(kv_heads, 0, dtype=torch.long, device=device),
                   torch.zeros(kv_heads, 0, dim, device=device),
                   torch.zeros(kv_heads, 0, dtype=torch.long, device=device))

    @property
    def size(self) -> int:
        return self.bucket.shape[1]

    def nbytes(self) -> int:
        """Device bytes of the sentence vectors and the token -> bucket map."""
        return sum(t.numel() * t.element_size() for t in (self.bucket, self.key_sum, self.count, self.vectors)
                   if t is not None)

    def add(self, keys: torch.Tensor, bucket: torch.Tensor) -> None:
        """Append retained tokens (after all earlier ones): keys [kv_heads, m, D], bucket ids [kv_heads, m]."""
        if bucket.numel() == 0:
            return
        grow = int(bucket.max()) + 1 - self.count.shape[1]
        if grow > 0:
            self.key_sum = F.pad(self.key_sum, (0, 0, 0, grow))
            self.count = F.pad(self.count, (0, grow))
        dim = keys.shape[-1]
        self.key_sum.scatter_add_(1, bucket[..., None].expand(-1, -1, dim), keys.float())
        self.count.scatter_add_(1, bucket, torch.ones_like(bucket))
        self.bucket = torch.cat([self.bucket, bucket], dim=1)
        self.vectors = self.key_sum / self.count.clamp(min=1)[..., None]

    def wanted(self, query: torch.Tensor, capacity: int) -> torch.Tensor:
        """Tokens to attend: query [kv_heads, D] -> bool [kv_heads, n]. Buckets are taken by descending
        query . mean key until `capacity` tokens are taken; the last one is cut to its leading (earliest) tokens."""
        if self.vectors is None:
            return torch.zeros_like(self.bucket, dtype=torch.bool)
        scores = torch.bmm(self.vectors, query.float()[..., None])[..., 0]  # [kv_heads, n_buckets]
        scores = scores.masked_fill(self.count == 0, float("-inf"))
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices  # [kv_heads, n_buckets]
        ranked = self.count.gather(1, order)
        before = torch.zeros_like(self.count).scatter_(1, order, ranked.cumsum(1) - ranked)  # tokens of better ones
        first = self.count.cumsum(1) - self.count  # [kv_heads, n_buckets] index of each bucket's first token
        offset = torch.arange(self.size, device=query.device)[None, :] - first.gather(1, self.bucket)
        return before.gather(1, self.bucket) + offset < capacity

    def load(self, kv: SeqKV, store: HostKVStore, layer: int, wanted: torch.Tensor, base: int) -> None:
        """Make the working set (device slots [base, base + capacity)) hold exactly the wanted tokens: tokens already
        loaded stay where they are, only the missing ones are copied from the host store into freed slots."""
        heads, n = wanted.shape
        held = torch.where(self.loaded >= 0, self.loaded, n)  # [kv_heads, capacity], n = empty
        keep = F.pad(wanted, (0, 1)).gather(1, held)  # loaded and still wanted
        loaded = torch.where(keep, self.loaded, -1)
        present = torch.zeros(heads, n + 1, dtype=torch.bool, device=wanted.device)
        present.scatter_(1, torch.where(keep, held, n), True)
        head, index = (wanted & ~present[:, :n]).nonzero(as_tuple=True)  # missing tokens, head-major, ascending
        if head.numel():
            n_missing = torch.bincount(head, minlength=heads)  # [kv_heads]
            free = loaded < 0
            fill = free & (free.cumsum(1) <= n_missing[:, None])  # the first n_missing free slots of each head
            loaded[fill.nonzero(as_tuple=True)] = index  # same per-head counts and order as the missing tokens
            # one copy of m tokens per head: the filled slots, padded with slots re-copied unchanged (every head
            # holds as many tokens as it wants, the same number in every head, and at least m)
            m = int(n_missing.max())
            kind = torch.where(fill, 0, torch.where(loaded >= 0, 1, 2)).to(torch.int8)
            slots = torch.sort(kind, dim=1, stable=True).indices[:, :m]  # [kv_heads, m]
            k, v, pos = store.fetch(layer, loaded.gather(1, slots))
            kv.write(layer, (base + slots).T, k.transpose(0, 1), v.transpose(0, 1), pos.T)
        self.loaded = loaded


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


@dataclass
class SentenceState:
    """One sequence's SentenceKV state. Device layout per layer: sinks [0, n_sink), then the retained tokens
    (offload off) or the working set of `capacity` slots (offload on), then the recent window (`tail`)."""

    dense: bool  # the budget covers the whole generation: nothing is dropped or moved
    budget: int
    n_sink: int
    n_recent: int
    capacity: int  # tokens of loaded buckets attended per step
    offload: bool
    starts: list[int]  # start position of every bucket, the prompt's then the generated text's
    limit: int  # longest bucket of generated text
    layers: list[LayerBuckets]
    store: HostKVStore | None
    q_sum: list[torch.Tensor | None] = field(default_factory=list)  # per layer [heads, D], this sentence's queries
    q_count: int = 0
    h2d_step_max: int = 0
    device_peak: int = 0

    def tail_start(self, layer: int) -> int:
        return self.n_sink + (self.capacity if self.offload else self.layers[layer].size)
