"""The offloaded working set in two kernels (`reference.working_set`): a selection over a sequence's virtual slots
becomes device slots, and the selected offloaded tokens that are not on the device yet are read from pinned host
memory in place (a host address is a device address under unified virtual addressing) into working-set slots that
no selected token holds; `put_host` writes tokens into a host store the same way. `_working_set` runs one program
per row and KV head, in three passes separated by block barriers: mark the working-set slots of selected tokens,
list the others from the row's clock hand on (a token that left the selection stays on the device until its slot
is taken, so a working set larger than the selection keeps the recently dropped tokens), give each missing token the
next listed slot (its previous token goes back to the host only), listing where it comes from and goes to, and write
every entry's device slot. `_load` then copies the listed keys, values and positions with about a thousand programs
whatever the batch (each row and KV head's tiles shared among several), so that many reads of host memory are in
flight at once (one program per row and head left a batch of one with 8 programs reading over PCIe, a round trip per
tile). Nothing is read back to the host, so the step is captured in a CUDA graph; the traffic is counted on the
device. (A version that copied inside pass 3, masked by the block's misses, wrote other tokens' keys on an H100
while Triton's CPU interpreter agreed with the reference: `benchmarks/kernel_check.py` checks this kernel on the
GPU.)"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

KEEP = tl.constexpr(1 << 30)  # added to a working-set entry while a selected token holds it


@triton.jit
def _working_set(SLOTS, LENGTHS, ROWS, N_SINK, OFFLOADED, CACHE, HELD, WHERE, HAND, FREE, SRC, DST, MISSED, HOST,
                 TABLE, TRAFFIC, layer, heads, width, cache_width, tokens, table_width, page_size,
                 SPAN: tl.constexpr):
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
    tl.store(MISSED + out_row, missed)


@triton.jit
def _load(MISSED, SRC, DST, HOST, ROWS, K, V, POS, heads, cache_width, DIM: tl.constexpr, BLOCK: tl.constexpr):
    """Tiles tile, tile + T, ... (T programs a row and KV head) of a row and KV head's listed tokens: keys, values
    and positions read from host memory."""
    b, h, tile, programs = tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(2)
    out_row = b * heads + h
    missed = tl.load(MISSED + out_row)
    HOST += tl.load(ROWS + b).to(tl.int64) * 4
    host_k = tl.load(HOST).to(tl.pointer_type(K.dtype.element_ty))
    host_v = tl.load(HOST + 1).to(tl.pointer_type(V.dtype.element_ty))
    host_pos = tl.load(HOST + 2).to(tl.pointer_type(tl.int32))
    SRC += out_row.to(tl.int64) * cache_width
    DST += out_row.to(tl.int64) * cache_width
    dim = tl.arange(0, DIM)
    for start in range(tile * BLOCK, missed, programs * BLOCK):
        j = start + tl.arange(0, BLOCK)
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
                pos_pool, traffic, layer, span: int = 512, block: int = 32, loaders: int = 1024) -> None:
    """Same arguments and effect as `reference.working_set` (`stores` is not needed: the kernel reads `host`).
    `loaders`: about how many programs copy from host memory (each loops over its share of the tiles)."""
    batch, heads, width = slots.shape
    cache_width, tokens = held.shape[-1], where.shape[-1]
    free = torch.empty(batch, heads, cache_width, dtype=torch.int32, device=slots.device)
    src, dst = (torch.empty(batch, heads, cache_width, dtype=torch.long, device=slots.device) for _ in range(2))
    missed = torch.empty(batch, heads, dtype=torch.int32, device=slots.device)
    rows = rows.contiguous()
    _working_set[(batch, heads)](slots, lengths.contiguous(), rows, n_sink.contiguous(), offloaded.contiguous(),
                                 cache.contiguous(), held, where, hand, free, src, dst, missed, host,
                                 table.contiguous(), traffic, layer, heads, width, cache_width, tokens, table.shape[1],
                                 k_pool.shape[1], SPAN=span)
    tiles = min(triton.cdiv(cache_width, block), max(1, loaders // (batch * heads)))  # programs a row and head
    _load[(batch, heads, tiles)](missed, src, dst, host, rows, k_pool, v_pool, pos_pool, heads, cache_width,
                                 DIM=k_pool.shape[-1], BLOCK=block)


@triton.jit(do_not_specialize=["host_k", "host_v", "host_pos", "first", "n", "stride_kl", "stride_kh", "stride_km",
                               "stride_vl", "stride_vh", "stride_vm", "stride_pl", "stride_ph", "stride_pm", "heads",
                               "capacity", "m"])
def _put(K, V, POS, host_k, host_v, host_pos, first, n, stride_kl, stride_kh, stride_km, stride_vl, stride_vh,
         stride_vm, stride_pl, stride_ph, stride_pm, heads, capacity, m, DIM: tl.constexpr, BLOCK: tl.constexpr):
    """One layer and KV head's block of tokens, written at their host store addresses. No integer argument is
    specialised: one compiled kernel serves the prefill's layer-at-a-time writes and the decode steps' (a first
    write of another shape would compile inside a step)."""
    lh, block = tl.program_id(0), tl.program_id(1)
    layer, h = lh // heads, lh % heads
    i = block * BLOCK + tl.arange(0, BLOCK)
    inside = i < m
    d = tl.arange(0, DIM)
    entry = ((first + layer) * heads + h).to(tl.int64) * capacity + n + i  # [BLOCK] the store's row of each token
    # an address below 2**31 (a small store on a heap low in memory) arrives as a 32-bit int
    keys = host_k.to(tl.int64).to(tl.pointer_type(K.dtype.element_ty))
    values = host_v.to(tl.int64).to(tl.pointer_type(V.dtype.element_ty))
    positions = host_pos.to(tl.int64).to(tl.pointer_type(tl.int32))
    at = inside[:, None]
    tl.store(keys + entry[:, None] * DIM + d[None, :],
             tl.load(K + layer * stride_kl + h * stride_kh + i[:, None] * stride_km + d[None, :], mask=at), mask=at)
    tl.store(values + entry[:, None] * DIM + d[None, :],
             tl.load(V + layer * stride_vl + h * stride_vh + i[:, None] * stride_vm + d[None, :], mask=at), mask=at)
    tl.store(positions + entry, tl.load(POS + layer * stride_pl + h * stride_ph + i * stride_pm, mask=inside),
             mask=inside)


def put_host(k, v, pos, store_k, store_v, store_pos, first: int, n: int, block: int = 32) -> None:
    """Same arguments and effect as `reference.put_host`: k/v/pos on the device (last dimension contiguous), the
    store's tensors pinned host memory, written by the device through their addresses (no wait for the device)."""
    layers, heads, m, dim = k.shape
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    _put[(layers * heads, triton.cdiv(m, block))](
        k, v, pos, store_k.data_ptr(), store_v.data_ptr(), store_pos.data_ptr(), first, n, *k.stride()[:3],
        *v.stride()[:3], *pos.stride(), heads, store_k.shape[2], m, DIM=dim, BLOCK=block)
