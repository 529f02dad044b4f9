"""dynsplit's kernels: Triton on CUDA, the torch reference (`reference.py` beside this file) elsewhere."""
from __future__ import annotations

from semkv.kernels import use_triton
from semkv.methods.dynsplit import reference


def chunk_slots(lo, count, before, place, n, n_sink, capacity, tail, max_sink, width, longest):
    """See `reference.chunk_slots`; place [B, S, chunks] (`kernels.bucket_take`) is what the Triton kernel reads
    besides (the reference marks and compacts instead)."""
    if use_triton(lo.device):
        from semkv.methods.dynsplit import triton_chunk_slots

        return triton_chunk_slots.chunk_slots(lo, count, before, place, n, n_sink, capacity, tail, max_sink, width,
                                              longest)
    return reference.chunk_slots(lo, count, before, n, n_sink, capacity, tail, max_sink, width, longest)


def chunk_refresh(k_flat, tables, page_size, first, split, n, targets, span, kmin, kmax):
    """See `reference.chunk_refresh` (in place)."""
    if use_triton(k_flat.device):
        from semkv.methods.dynsplit import triton_chunk_refresh

        return triton_chunk_refresh.chunk_refresh(k_flat, tables, page_size, first, split, n, targets, span, kmin, kmax)
    return reference.chunk_refresh(k_flat, tables, page_size, first, split, n, targets, span, kmin, kmax)


def slot_stamps(stamps, tables, page_size, slots, lengths, current, step, first, reuse, rows, scratch):
    """See `reference.slot_stamps` (in place)."""
    if use_triton(stamps.device):
        from semkv.methods.dynsplit import triton_slot_stamps

        return triton_slot_stamps.slot_stamps(stamps, tables, page_size, slots, lengths, current, step, first, reuse,
                                              rows, scratch)
    return reference.slot_stamps(stamps, tables, page_size, slots, lengths, current, step, first, reuse, rows, scratch)


def chunk_best(q, k_pool, tables, chunk_of, lo, hi, chunks, group_reduce, kept=None):
    """See `reference.chunk_best`."""
    if use_triton(q.device):
        from semkv.methods.dynsplit import triton_chunk_best

        return triton_chunk_best.chunk_best(q, k_pool, tables, chunk_of, lo, hi, chunks, group_reduce, kept)
    return reference.chunk_best(q, k_pool, tables, chunk_of, lo, hi, chunks, group_reduce, kept)
