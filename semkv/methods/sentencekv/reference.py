"""Plain-torch references of sentencekv's kernels: what the Triton kernels are tested against, and the CPU path."""
from __future__ import annotations

import torch

from semkv.kernels.reference import compact_chosen


def sentence_tokens(bucket: torch.Tensor, rows: torch.Tensor, before: torch.Tensor, first: torch.Tensor,
                    retained: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
    """The tokens that ranked buckets take up to a capacity: buckets fill it in rank order and the last one keeps its
    leading tokens (token t of bucket k is taken when before[k] + t - first[k] < capacity). bucket [rows, S or 1, T]
    the bucket of every token of each state row (one map per KV head or one shared), rows [B] the batch's state rows,
    before / first [B, S, buckets] (`bucket_ranks`), retained / capacity [B]. -> bool [B, S, T] (token t:
    t < retained)."""
    index = torch.arange(bucket.shape[-1], device=bucket.device)
    bucket = bucket[rows].long().expand(-1, before.shape[1], -1)  # [B, S, T]
    offset_in_bucket = index - first.gather(-1, bucket)
    taken = before.gather(-1, bucket) + offset_in_bucket < capacity[:, None, None]
    return taken & (index < retained[:, None, None])


def sentence_slots(bucket: torch.Tensor, rows: torch.Tensor, before: torch.Tensor, first: torch.Tensor,
                   n: torch.Tensor, n_sink: torch.Tensor, retained: torch.Tensor, capacity: torch.Tensor,
                   tail: torch.Tensor, max_sink: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attended slots from ranked buckets (SentenceKV): the sinks [0, n_sink), the tokens the buckets take
    (`sentence_tokens`; token t at slot n_sink + t) and the last `tail` slots [n - tail, n). Arguments as
    `sentence_tokens`, plus n / n_sink / tail [B]; max_sink bounds n_sink, width bounds a row's total. Returns slots
    [B, S, width], ascending and then 0, and lengths [B, S]."""
    chosen = sentence_tokens(bucket, rows, before, first, retained, capacity)  # [B, S, T]
    return compact_chosen(chosen, n, n_sink, tail, max_sink, width)
