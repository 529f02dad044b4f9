"""The offloaded working set in one kernel (`reference.working_set`): a selection over a sequence's virtual slots
becomes device slots, and the selected offloaded tokens that are not on the device yet are read from pinned host
memory in place (a host address is a device address under unified virtual addressing) into working-set slots that
no selected token holds. One program per row and KV head, in four passes separated by block barriers: mark the
working-set slots of selected tokens, list the others from the row's clock hand on (a token that left the selection
stays on the device until its slot is taken, so a working set larger than the selection keeps the recently dropped
tokens), give each missing token the next listed slot (its previous token goes back to the host only), listing
where it comes from and goes to, and write every entry's device slot, then copy the listed keys, values and
positions, a dense tile of missing tokens at a time. Nothing is read back to the host, so the step is captured in a
CUDA graph; the traffic is counted on the device. (A version that copied inside pass 3, masked by the block's
misses, wrote other tokens' keys on an H100 while Triton's CPU interpreter agreed with the reference:
`benchmarks/kernel_check.py` checks this kernel on the GPU.)"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

KEEP = tl.constexpr(1 << 30)  # added to a working-set entry while a selected token holds it


@triton.jit
def _working_set(SLOTS, LENGTHS, ROWS, N_SINK, OFFLOADED, CACHE, HELD, WHERE, HAND, FREE, SRC, DST, HOST, TABLE, K, V,
                 POS, TRAFFIC, layer, heads, width, cache_width, tokens, table_width, page_size,
                 DIM: tl.constexpr, SPAN: tl.constexpr, BLOCK: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    out_row = b * heads + h
    SLOTS += out_row.to(tl.int64) * width
    FREE += out_row.to(tl.int64) * cache_width
    SRC += out_row.to(tl.int64) * cache_width
    DST += out_row.to(tl.int64) * cache_width
    TABLE += b.to(tl.int64) * table_width
    row = tl.load(ROWS + b).to(tl.int64)
    HELD += (row * heads + h) * cache_width
    WHERE += (row * heads + h) * tokens
    HAND += row * heads + h
    n = tl.load(LENGTHS + out_row)
    n_sink, offloaded, cache = tl.load(N_SINK + b), tl.load(OFFLOADED + b), tl.load(CACHE + b)
    span = tl.arange(0, SPAN)
    # 1. the working-set slots that selected tokens hold are kept
    for start in range(0, n, SPAN):
        i = start + span
        v = tl.load(SLOTS + i, mask=i < n, other=0)
        middle = (i < n) & (v >= n_sink) & (v < n_sink + offloaded)
        t = v - n_sink
        w = tl.load(WHERE + t, mask=middle, other=0)
        tl.store(HELD + w - 1, (t + 1 + KEEP).to(tl.int32), mask=middle & (w > 0))
    tl.debug_barrier()
    # 2. the others are listed from the clock hand on, round the working set (the longest-filled first); their tokens
    # stay on the device until pass 3 takes the slot
    hand = tl.load(HAND)
    free = 0
    for start in range(0, cache, SPAN):
        r = start + span
        inside = r < cache
        s = (hand + r) % tl.maximum(cache, 1)
        held = tl.load(HELD + s, mask=inside, other=KEEP)
        keep = held >= KEEP
        listed = inside & ~keep
        tl.store(HELD + s, held - KEEP, mask=inside & keep)
        place = free + tl.cumsum(listed.to(tl.int32), 0) - 1
        tl.store(FREE + place, s, mask=listed)
        free += tl.sum(listed.to(tl.int32), 0)
    tl.debug_barrier()
    # 3. missing tokens take the listed slots (in selection order; the slot's token, selected by no one, is then on
    # the host only), listed with their store row and pool row; device slots out
    first = (layer * heads + h) * tl.load(HOST + row * 4 + 3)  # the head's first token in the store
    missed, found = 0, 0
    for start in range(0, n, SPAN):
        i = start + span
        inside = i < n
        v = tl.load(SLOTS + i, mask=inside, other=0)
        middle = inside & (v >= n_sink) & (v < n_sink + offloaded)
        t = v - n_sink
        w = tl.load(WHERE + t, mask=middle, other=0)
        miss = middle & (w == 0)
        rank = missed + tl.cumsum(miss.to(tl.int32), 0) - 1
        slot = tl.where(miss, tl.load(FREE + rank, mask=miss, other=0), w - 1)
        before = tl.load(HELD + slot, mask=miss, other=0)
        tl.store(WHERE + before - 1, tl.zeros_like(before), mask=miss & (before > 0))
        tl.store(WHERE + t, (slot + 1).to(tl.int32), mask=miss)
        tl.store(HELD + slot, (t + 1).to(tl.int32), mask=miss)
        device_slot = n_sink + slot
        page = tl.load(TABLE + device_slot // page_size, mask=miss, other=0).to(tl.int64)
        tl.store(SRC + rank, first + t, mask=miss)
        tl.store(DST + rank, (page * page_size + device_slot % page_size) * heads + h, mask=miss)  # pool row
        missed += tl.sum(miss.to(tl.int32), 0)
        found += tl.sum((middle & ~miss).to(tl.int32), 0)
        out = tl.where(middle, n_sink + slot, tl.where(v < n_sink, v, v - offloaded + cache))
        tl.store(SLOTS + i, out.to(tl.int64), mask=inside)
    if missed > 0:  # the hand moves past the last slot taken
        tl.store(HAND, (tl.load(FREE + missed - 1) + 1) % cache)
    tl.atomic_add(TRAFFIC + row * 2, found.to(tl.int64))
    tl.atomic_add(TRAFFIC + row * 2 + 1, missed.to(tl.int64))
    tl.debug_barrier()
    # 4. the listed tokens' keys, values and positions, read from host memory
    HOST += row * 4
    host_k = tl.load(HOST).to(tl.pointer_type(K.dtype.element_ty))
    host_v = tl.load(HOST + 1).to(tl.pointer_type(V.dtype.element_ty))
    host_pos = tl.load(HOST + 2).to(tl.pointer_type(tl.int32))
    block, dim = tl.arange(0, BLOCK), tl.arange(0, DIM)
    for start in range(0, missed, BLOCK):
        j = start + block
        listed = j < missed
        src = tl.load(SRC + j, mask=listed, other=0)
        dst = tl.load(DST + j, mask=listed, other=0)
        at = listed[:, None]
        tl.store(K + dst[:, None] * DIM + dim[None, :], tl.load(host_k + src[:, None] * DIM + dim[None, :], mask=at),
                 mask=at)
        tl.store(V + dst[:, None] * DIM + dim[None, :], tl.load(host_v + src[:, None] * DIM + dim[None, :], mask=at),
                 mask=at)
        tl.store(POS + dst, tl.load(host_pos + src, mask=listed), mask=listed)


def working_set(slots, lengths, rows, n_sink, offloaded, cache, held, where, hand, host, table, k_pool, v_pool,
                pos_pool, traffic, layer, span: int = 512, block: int = 32) -> None:
    """Same arguments and effect as `reference.working_set` (`stores` is not needed: the kernel reads `host`)."""
    batch, heads, width = slots.shape
    cache_width, tokens = held.shape[-1], where.shape[-1]
    free = torch.empty(batch, heads, cache_width, dtype=torch.int32, device=slots.device)
    src, dst = (torch.empty(batch, heads, cache_width, dtype=torch.long, device=slots.device) for _ in range(2))
    _working_set[(batch, heads)](slots, lengths.contiguous(), rows.contiguous(), n_sink.contiguous(),
                                 offloaded.contiguous(), cache.contiguous(), held, where, hand, free, src, dst, host,
                                 table.contiguous(), k_pool, v_pool, pos_pool, traffic, layer, heads, width,
                                 cache_width, tokens, table.shape[1], k_pool.shape[1], DIM=k_pool.shape[-1],
                                 SPAN=span, BLOCK=block)
