"""DynSplit-KV's V2F (variable-to-fixed mapping): per-chunk key summaries, chunk scores for the current query, and the
per-head top-`budget` token selection in one fixed-shape operation; plus the per-sequence state that keeps the
summaries of every layer up to date as tokens arrive (only the open chunk is recomputed). Used by
`semkv.methods.dynsplit.method`.
"""
from __future__ import annotations

import torch

from semkv.engine.offload import HostKVStore, grown_capacity
from semkv.engine.sequence import Sequence
from semkv.kernels.reference import min_max_bound


def block_summaries(keys: torch.Tensor, labels: torch.Tensor, n_blocks: int, pooling: str) -> torch.Tensor:
    """keys [kv_heads, m, D] with chunk labels [m] in [0, n_blocks) -> [stats, kv_heads, n_blocks, D]: element-wise
    (min, max) of each chunk's keys in the keys' dtype (exact: a min or max is one of the keys), or (mean,) in
    float32 for mean pooling. A chunk without tokens is all zeros."""
    heads, m, dim = keys.shape
    index = labels[None, :, None].expand(heads, m, dim)
    if pooling == "mean":
        blank = torch.zeros(heads, n_blocks, dim, device=keys.device)  # [kv_heads, n_blocks, D]
        return blank.scatter_reduce(1, index, keys.float(), "mean", include_self=False)[None]
    blank = torch.zeros(heads, n_blocks, dim, dtype=keys.dtype, device=keys.device)
    return torch.stack([blank.scatter_reduce(1, index, keys, op, include_self=False) for op in ("amin", "amax")])


def block_scores(q: torch.Tensor, summaries: torch.Tensor, pooling: str, group_reduce: str) -> torch.Tensor:
    """q [B, heads, D], summaries [B, stats, kv_heads, n_blocks, D] -> scores [B, kv_heads, n_blocks]: the bound
    sum_d max(q_d * max_d, q_d * min_d) (minmax) or q . mean (mean pooling), reduced over each KV group's query
    heads by `group_reduce`."""
    if pooling == "minmax":
        return min_max_bound(q, summaries[:, 0].transpose(1, 2), summaries[:, 1].transpose(1, 2), group_reduce)
    batch, heads, dim = q.shape
    kv_heads = summaries.shape[2]
    qg = q.float().view(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("bhgd,bhpd->bhgp", qg, summaries[:, 0].float())  # [B, kv_heads, group, n_blocks]
    return scores.mean(2) if group_reduce == "mean" else scores.amax(2)


def v2f_select(scores: torch.Tensor, labels: torch.Tensor, k: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """Each token takes its chunk's score; every KV head keeps its top k[b] tokens. scores [B, kv_heads, n_blocks],
    labels [B, n] (chunk of each token, -1 past a sequence's end), k [B] (<= its tokens), forced [B, n] (always
    kept; at most k[b]) -> mask [B, kv_heads, n]. One stable descending sort: equal scores go to the earlier token,
    so a chunk is taken from its start and equal chunks in order."""
    heads = scores.shape[1]
    token = scores.gather(2, labels.clamp(min=0)[:, None].expand(-1, heads, -1))  # [B, kv_heads, n]
    token = token.masked_fill((labels < 0)[:, None], float("-inf")).masked_fill(forced[:, None], float("inf"))
    order = torch.sort(token, dim=-1, descending=True, stable=True).indices
    take = torch.arange(order.shape[-1], device=order.device)[None, None] < k[:, None, None]
    return torch.zeros_like(order, dtype=torch.bool).scatter_(-1, order, take.expand_as(order))


class DynSplitState:
    """One sequence: its tokens, the DD-Select chunk ends, the chunk of every position, and per layer the chunk
    summaries (closed chunks, then the open one), the keys of the open chunk and the previous step's selection."""

    def __init__(self, num_layers: int, token_weights: dict[int, float], device: torch.device):
        self.token_weights = token_weights  # token id -> delimiter weight
        self.ids: list[int] = []
        self.position_weights: list[float] = []  # weight of each position's token, -1 for non-delimiters
        self.ends: list[int] = []  # ends (exclusive) of the closed chunks
        self.pending = 0  # chunks closed by the latest tokens, not yet summarised
        self._labels = torch.zeros(64, dtype=torch.long, device=device)  # [capacity] chunk index of each position
        self._labelled = 0  # positions whose entry in `_labels` is up to date
        self.summaries: list[torch.Tensor | None] = [None] * num_layers  # [stats, kv_heads, capacity, D]
        self.open_keys: list[torch.Tensor | None] = [None] * num_layers  # [kv_heads, m, D]
        self.previous: list[torch.Tensor | None] = [None] * num_layers  # per-sequence path: selected mask [kv_heads, n]
        self.store: HostKVStore | None = None  # offload: its offloaded tokens (made at admission)
        self.sinks = 0  # offload: the first tokens, kept on the device
        self.offloaded = 0  # offload: tokens per layer in the store
        self.cache = 0  # offload: working-set slots per layer and KV head
        self.dependency = None  # AttentionDependency while per-document weights are estimated
        self.row = 0  # batched path: the sequence's row in `DynSplitRows` (0 until it is admitted)
        # batched path, where decoding splits on the device: the chunks closed after how many tokens, as the host
        # last learnt it (at the end of prefill, then from `DynSplitKV._count_chunks`'s copies), and the copy that
        # was asked to count them with the tokens at that step
        self.split_at = (0, 0)
        self.asked: tuple[torch.Tensor | None, int] = (None, 0)

    @property
    def open_start(self) -> int:
        return self.ends[-1] if self.ends else 0

    def append(self, tokens: list[int]) -> None:
        self.ids.extend(tokens)
        self.position_weights.extend(self.token_weights.get(t, -1.0) for t in tokens)

    def close(self, ends: list[int]) -> None:
        """Record the chunks just closed: the positions of the (old) open chunk onwards change chunk."""
        self._labelled = min(self._labelled, self.open_start)
        self.ends.extend(ends)
        self.pending = len(ends)

    @property
    def labels(self) -> torch.Tensor:
        """[capacity >= positions] the chunk of every position (closed chunks, then the open one), brought up to date
        when read: the batched path reads it only at prefill."""
        n = len(self.ids)
        if self._labelled < n:
            if n > self._labels.shape[0]:
                self._labels = torch.cat([self._labels, self._labels.new_zeros(n)])
            ends = torch.tensor(self.ends, dtype=torch.long, device=self._labels.device)
            positions = torch.arange(self._labelled, n, device=self._labels.device)
            self._labels[self._labelled:n] = torch.searchsorted(ends, positions, right=True)
            self._labelled = n
        return self._labels

    def summarise(self, layer: int, new_keys: torch.Tensor, pooling: str) -> None:
        """Fold the keys of the newest positions [kv_heads, t, D] in: summarise the chunks closed since the last call
        and the open chunk, from the open chunk's kept keys."""
        first = len(self.ends) - self.pending  # the chunk that was open before
        start = self.ends[first - 1] if first else 0
        old = self.open_keys[layer]
        keys = new_keys if old is None else torch.cat([old, new_keys], dim=1)  # positions [start, n)
        labels = self.labels[start: len(self.ids)] - first
        blocks = block_summaries(keys, labels, self.pending + 1, pooling)  # [stats, kv_heads, pending + 1, D]
        table = self.summaries[layer]
        need = len(self.ends) + 1
        if table is None or table.shape[2] < need:
            grown = blocks.new_zeros(*blocks.shape[:2], grown_capacity(need, 16), blocks.shape[-1])
            if table is not None:
                grown[:, :, : table.shape[2]] = table
            table = self.summaries[layer] = grown
        table[:, :, first:need] = blocks
        self.open_keys[layer] = keys[:, self.open_start - start:].clone()  # not a view: it would pin all of `keys`

    @staticmethod
    def stack(states: list["DynSplitState"], layer: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Summaries [B, stats, kv_heads, n_blocks, D] and labels [B, width] (-1 past each sequence's end)."""
        blocks = max(len(s.ends) + 1 for s in states)
        summaries = torch.stack([torch.nn.functional.pad(s.summaries[layer][:, :, : len(s.ends) + 1],
                                                         (0, 0, 0, blocks - len(s.ends) - 1)) for s in states])
        labels = torch.stack([torch.nn.functional.pad(s.labels[: len(s.ids)], (0, width - len(s.ids)), value=-1)
                              for s in states])
        return summaries, labels

    @staticmethod
    def count(seq: Sequence, reused: int, reloaded: int) -> None:
        """Reuse counters (token x KV head x layer, summed over steps) in the request's statistics."""
        extra = seq.stats.extra
        extra["kv_reused"] = extra.get("kv_reused", 0) + reused
        extra["kv_reloaded"] = extra.get("kv_reloaded", 0) + reloaded
