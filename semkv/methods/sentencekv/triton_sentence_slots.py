"""Attended slots from ranked buckets (SentenceKV's sentences): the sinks, the tokens of the best-ranked buckets and
the recent window, written straight to their places in the slot list. What the budget takes of the ranked buckets
comes from `kernels.bucket_take` (a kernel comparing every pair of buckets measured 8x slower than a sort at 1400
buckets, a 32k prompt; that one finds where the budget ends instead), with each bucket's `place`: where its first
taken token goes among all the taken ones. A token's slot-list index is then its bucket's place plus its offset in
the bucket, so blocks of tokens are independent: a program per row, KV head and block of `span` retained tokens (416
programs at 16 rows and 3,200 retained tokens a row, where one program per row and KV head compacting block after
block with a running count took 16 us a layer on an H200, results page 2026-11-28-h200x4-vllm-same-call). The
first block's program also writes the sinks, the recent window, the length and the padding. The bucket map is per KV
head or shared. Same result as the torch reference `reference.sentence_slots`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from semkv.kernels.triton_slot_lists import finish_slots, write_sinks


@triton.jit
def _sentence_slots(BUCKET, ROWS, BEFORE, FIRST, PLACE, N, N_SINK, RETAINED, CAPACITY, TAIL, OUT, LENGTHS, heads,
                    map_heads, tokens, buckets, width, SPAN: tl.constexpr):
    b, h, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    out_row = b * heads + h  # [B, S] flattened
    OUT += out_row.to(tl.int64) * width
    BEFORE += out_row.to(tl.int64) * buckets
    FIRST += out_row.to(tl.int64) * buckets
    PLACE += out_row.to(tl.int64) * buckets
    BUCKET += (tl.load(ROWS + b).to(tl.int64) * map_heads + h % map_heads) * tokens
    n_sink, retained, capacity = tl.load(N_SINK + b), tl.load(RETAINED + b), tl.load(CAPACITY + b)
    t = block * SPAN + tl.arange(0, SPAN)
    inside = t < retained
    k = tl.load(BUCKET + t, mask=inside, other=0)
    offset = t - tl.load(FIRST + k, mask=inside, other=0)  # the token's place inside its bucket
    taken = inside & (tl.load(BEFORE + k, mask=inside, other=0) + offset < capacity)
    at = n_sink + tl.load(PLACE + k, mask=inside, other=0) + offset
    tl.store(OUT + at, (n_sink + t).to(tl.int64), mask=taken)
    if block == 0:
        write_sinks(OUT, n_sink, SPAN)
        # the tokens taken: those of the buckets before the last retained token's, and of its bucket up to it
        last = tl.maximum(retained - 1, 0)
        k_last = tl.load(BUCKET + last)
        in_last = tl.minimum(tl.maximum(capacity - tl.load(BEFORE + k_last), 0), last - tl.load(FIRST + k_last) + 1)
        written = tl.where(retained > 0, tl.load(PLACE + k_last) + in_last, 0)
        finish_slots(OUT, LENGTHS + out_row, n_sink + written, tl.load(N + b), tl.load(TAIL + b), width, SPAN)


def sentence_slots(bucket: torch.Tensor, rows: torch.Tensor, before: torch.Tensor, first: torch.Tensor,
                   place: torch.Tensor, n: torch.Tensor, n_sink: torch.Tensor, retained: torch.Tensor,
                   capacity: torch.Tensor, tail: torch.Tensor, max_sink: int, width: int,
                   span: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.sentence_slots`'s arguments and result, with place [B, S, buckets] (`kernels.bucket_take`) after
    first (max_sink only bounds the reference's shapes). span: retained tokens a program."""
    batch, heads, buckets = before.shape
    out = torch.empty(batch, heads, width, dtype=torch.long, device=before.device)
    lengths = torch.empty(batch, heads, dtype=torch.long, device=before.device)
    tokens = bucket.shape[-1]
    _sentence_slots[(batch, heads, triton.cdiv(tokens, span))](
        bucket.contiguous(), rows.contiguous(), before.contiguous(), first.contiguous(), place.contiguous(),
        n.contiguous(), n_sink.contiguous(), retained.contiguous(), capacity.contiguous(), tail.contiguous(), out,
        lengths, heads, bucket.shape[1], tokens, buckets, width, SPAN=span)
    return out, lengths
