"""Attended slots from ranked buckets in one kernel (SentenceKV's sentences): the sinks, the tokens of the best-ranked
buckets (each token decided from its bucket's rank, compacted block by block with a running count) and the recent
window, written straight to their places in the slot list. One program per row and KV head; the bucket map is per
KV head or shared. Replaces the gathers, scan and scatter of the torch
reference `reference.sentence_slots`. What the budget takes of the ranked buckets comes from `kernels.bucket_take`
(a kernel comparing every pair of buckets measured 8x slower than a sort at 1400 buckets, a 32k prompt; that one
finds where the budget ends instead)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from semkv.kernels.triton_slot_lists import finish_slots, write_sinks


@triton.jit
def _sentence_slots(BUCKET, ROWS, BEFORE, FIRST, N, N_SINK, RETAINED, CAPACITY, TAIL, OUT, LENGTHS, heads, map_heads,
                    tokens, buckets, width, SPAN: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    out_row = b * heads + h  # [B, S] flattened
    OUT += out_row.to(tl.int64) * width
    BEFORE += out_row.to(tl.int64) * buckets
    FIRST += out_row.to(tl.int64) * buckets
    BUCKET += (tl.load(ROWS + b).to(tl.int64) * map_heads + h % map_heads) * tokens
    n, n_sink, tail = tl.load(N + b), tl.load(N_SINK + b), tl.load(TAIL + b)
    retained, capacity = tl.load(RETAINED + b), tl.load(CAPACITY + b)
    span = tl.arange(0, SPAN)
    write_sinks(OUT, n_sink, SPAN)
    written = n_sink
    for start in range(0, retained, SPAN):
        t = start + span
        inside = t < retained
        k = tl.load(BUCKET + t, mask=inside, other=0)
        offset = t - tl.load(FIRST + k, mask=inside, other=0)  # the token's place inside its bucket
        taken = inside & (tl.load(BEFORE + k, mask=inside, other=0) + offset < capacity)
        place = written + tl.cumsum(taken.to(tl.int32), 0) - 1
        tl.store(OUT + place, (n_sink + t).to(tl.int64), mask=taken)
        written += tl.sum(taken.to(tl.int32), 0)
    finish_slots(OUT, LENGTHS + out_row, written, n, tail, width, SPAN)


def sentence_slots(bucket: torch.Tensor, rows: torch.Tensor, before: torch.Tensor, first: torch.Tensor,
                   n: torch.Tensor, n_sink: torch.Tensor, retained: torch.Tensor, capacity: torch.Tensor,
                   tail: torch.Tensor, max_sink: int, width: int, span: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments and result as `reference.sentence_slots` (max_sink only bounds the reference's shapes)."""
    batch, heads, buckets = before.shape
    out = torch.empty(batch, heads, width, dtype=torch.long, device=before.device)
    lengths = torch.empty(batch, heads, dtype=torch.long, device=before.device)
    _sentence_slots[(batch, heads)](bucket.contiguous(), rows.contiguous(), before.contiguous(), first.contiguous(),
                                    n.contiguous(), n_sink.contiguous(), retained.contiguous(), capacity.contiguous(),
                                    tail.contiguous(), out, lengths, heads, bucket.shape[1], bucket.shape[-1],
                                    buckets, width, SPAN=span)
    return out, lengths
