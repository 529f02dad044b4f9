"""SentenceKV's state. On the device, for every sequence at once (`SentenceRows`, one row per sequence): the bucket
(sentence) of every retained token, each bucket's retained-token count and sentence vector (mean retained key: kept
for score="vector" only), and the sum of the current sentence's queries; the ranking of buckets against a query runs for a whole batch in tensor
operations. On the host, per sequence (`SentenceState`): the budget split, bucket starts and, when retained K/V live in
host memory, the store (the working set that holds the chosen tokens on the device is a `WorkingSets` row).

Retained tokens are numbered 0..n-1 per KV head in position order (their index in the host store, or their offset
in the device region that holds them without offloading); bucket ids grow with positions, so each bucket's tokens of
one head are a contiguous index range.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from semkv.engine.offload import HostKVStore
from semkv import kernels
from semkv.methods.sentencekv.sentences import SentenceScan
from semkv.methods.state.rows import DeviceRows


def bucket_of(starts: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Bucket id of each token position, given the bucket start positions [buckets] (ascending)."""
    return torch.searchsorted(starts, positions.long().contiguous(), right=True) - 1


class SentenceRows(DeviceRows):
    """The device state of every sequence, by row (row 0 serves the padding rows of a graphed step and the
    sequences that keep everything). Shapes grow with the longest row (`ensure`); a move makes captured graphs be
    captured again (the owner bumps its `graph_epoch`). Without `vectors` (score="tokens" ranks buckets by their
    retained keys in the cache) a row holds no sentence vectors: at 32k and 24 layers about 1 MB instead of 20 (on an
    H200, 335 rows of Qwen2.5-0.5B ran out of memory growing them beside a pool that Full KV's batch fills)."""

    # rows come one per admitted request (a row is about 200 MB at 32 layers and 1400 buckets): little slack
    slack = (1, 64, 256)

    def __init__(self, layers: int, heads: int, kv_heads: int, dim: int, device: torch.device, vectors: bool = True):
        super().__init__()
        self.layers, self.heads, self.kv_heads, self.dim, self.device = layers, heads, kv_heads, dim, device
        # [L, rows, H, buckets, D] mean retained key of each bucket, or None
        self.vectors = torch.zeros(layers, 1, kv_heads, 1, dim, device=device) if vectors else None
        self.count = torch.zeros(layers, 1, kv_heads, 1, dtype=torch.int32, device=device)  # [L, rows, H, buckets]
        self.bucket = torch.zeros(layers, 1, kv_heads, 1, dtype=torch.int32, device=device)  # [L, rows, H, tokens]
        self.q_sum = torch.zeros(layers, 1, heads, dim, device=device)  # [L, rows, heads, D] this sentence's queries

    @property
    def tokens(self) -> int:
        """Retained tokens a row can hold: the width of the token -> bucket map."""
        return self.bucket.shape[-1]

    def sizes(self) -> tuple[int, int, int]:
        return self.count.shape[1], self.count.shape[3], self.tokens

    def shapes(self, rows: int, buckets: int, tokens: int) -> dict[str, tuple[int, ...]]:
        layers, heads, dim = self.layers, self.kv_heads, self.dim
        vectors = {} if self.vectors is None else dict(vectors=(layers, rows, heads, buckets, dim))
        return vectors | dict(count=(layers, rows, heads, buckets), bucket=(layers, rows, heads, tokens),
                              q_sum=(layers, rows, self.heads, dim))

    def clear(self, row: int) -> None:
        """Empty a row for a new sequence (a freed row holds its last owner's state)."""
        for name in self.shapes(*self.sizes()):
            getattr(self, name)[:, row] = 0

    def add(self, rows: torch.Tensor, layers: slice, keys: torch.Tensor | None, bucket: torch.Tensor,
            at: torch.Tensor) -> None:
        """Retained tokens numbered at[r].. of each row of rows [R] join their buckets: bucket ids [L', R, kv_heads,
        m] (after every earlier retained token's of the row); counts grow, and with sentence vectors kept their keys
        [L', R, kv_heads, m, D] (else None) move the means, mean + sum(key - mean) / new count (one scatter for every
        row: SentenceKV's tokens that leave the recent windows of many rows at one step)."""
        span = range(self.layers)[layers]
        dev = self.count.device
        index = (torch.arange(span.start, span.stop, device=dev)[:, None, None, None], rows[None, :, None, None],
                 torch.arange(self.kv_heads, device=dev)[None, None, :, None], bucket.long())
        self.count.index_put_(index, torch.ones((), dtype=torch.int32, device=dev), accumulate=True)
        if self.vectors is not None:
            old = self.vectors[index]  # [L', R, H, m, D] the means before these tokens
            self.vectors.index_put_(index, (keys.float() - old) / self.count[index][..., None], accumulate=True)
        slots = at[None, :, None, None] + torch.arange(bucket.shape[-1], device=dev)  # [1, R, 1, m]
        self.bucket[index[:3] + (slots,)] = bucket.int()

    def mean_query(self, layer: int, rows: torch.Tensor, q: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """The mean of the current sentence's queries, this one included: q [B, heads, D], rows [B], steps [B] earlier
        queries of the sentence (0: it starts here) -> [B, heads, D] float32."""
        total = torch.where((steps == 0)[:, None, None], 0.0, self.q_sum[layer, rows]) + q.float()
        self.q_sum[layer, rows] = total
        return total / (steps + 1)[:, None, None]

    def rank(self, layer: int, rows: torch.Tensor, query: torch.Tensor,
             capacity: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What `capacity` [B] takes of the buckets ranked by descending query . sentence vector: query [B, kv_heads,
        D], rows [B] -> `kernels.bucket_take` ([B, kv_heads, buckets] int32 each)."""
        every = torch.zeros(self.vectors.shape[1], *query.shape[1:], device=query.device)  # [rows, H, D]
        every[rows] = query.float()  # padding rows all write row 0; what they read is not used
        scores = torch.matmul(self.vectors[layer], every[..., None])[..., 0][rows]  # [B, H, buckets]
        return kernels.bucket_take(scores, self.count[layer], capacity, rows)

    def rank_best(self, layer: int, rows: torch.Tensor, best: torch.Tensor,
                  capacity: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What `capacity` [B] takes of the buckets ranked by descending best token: best [B, kv_heads, buckets]
        (each bucket's best query . key of its retained tokens, `kernels.bucket_best`), rows [B] ->
        `kernels.bucket_take`."""
        return kernels.bucket_take(best, self.count[layer], capacity, rows)

    def row_bytes(self) -> int:
        """Device bytes of one row: sentence vectors, counts, token -> bucket map and query sum."""
        return self.held_bytes() // self.sizes()[0]


@dataclass
class SentenceState:
    """One sequence's SentenceKV state on the host. Device layout per layer: sinks [0, n_sink), then the retained
    tokens (offload off) or the working set of `cache` slots (offload on), then the recent window (`tail`)."""

    dense: bool  # the budget covers the whole generation: nothing is dropped or moved
    budget: int
    n_sink: int
    n_recent: int
    capacity: int  # tokens of chosen buckets attended per step
    offload: bool
    starts: list[int]  # start position of every bucket, the prompt's then the generated text's
    limit: int  # longest bucket of generated text
    row: int  # in `SentenceRows` (0 when dense or not admitted yet)
    retained: int  # tokens retained per layer and KV head so far
    store: HostKVStore | None
    cache: int = 0  # offload: working-set slots (`capacity`, rounded so that the recent window starts a page)
    scan: SentenceScan | None = None  # the sentence rule over the open generated bucket (buckets="sentences")
    q_count: int = 0  # earlier queries of the current sentence
    h2d_step_max: int = 0
    device_peak: int = 0
    tail_pos: int = 0  # position of the oldest token of the tail (the recent window and what waits to leave it)
    # buckets and retained tokens its device row holds room for from admission on: every generated token may join
    # the retained ones, and (without sentence vectors, whose room is 64x larger) start a bucket
    room: tuple[int, int] = (0, 0)

    @property
    def tail_start(self) -> int:
        return self.n_sink + (self.cache if self.offload else self.retained)
