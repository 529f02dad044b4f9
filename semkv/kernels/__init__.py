"""Attention over the paged cache: Triton kernels on CUDA, the plain-torch reference elsewhere (or when
`SEMKV_KERNELS=reference`). Both take the same arguments, so the engine and the methods never see which one runs."""
from __future__ import annotations

import os

import torch

from semkv.kernels import reference


def use_triton(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get("SEMKV_KERNELS") == "reference":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def decode_attention(q, k_pool, v_pool, tables, slots, lengths, scale, max_len: int = 0):
    """See `reference.decode_attention`. max_len: an upper bound of `lengths` when slots is None (0: read it)."""
    if use_triton(q.device):
        from semkv.kernels import triton_decode

        return triton_decode.decode_attention(q, k_pool, v_pool, tables, slots, lengths, scale, max_len=max_len)
    return reference.decode_attention(q, k_pool, v_pool, tables, slots, lengths, scale)


def prefill_attention(q, k_pool, v_pool, table, start, context, scale):
    """See `reference.prefill_attention`."""
    if use_triton(q.device):
        from semkv.kernels import triton_prefill

        return triton_prefill.prefill_attention(q, k_pool, v_pool, table, start, context, scale)
    return reference.prefill_attention(q, k_pool, v_pool, table, start, context, scale)


def rms_norm(x, weight, eps, residual=None):
    """See `reference.rms_norm`."""
    if use_triton(x.device):
        from semkv.kernels import triton_fused

        return triton_fused.rms_norm(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def silu_mul(gate_up):
    """See `reference.silu_mul`."""
    if use_triton(gate_up.device):
        from semkv.kernels import triton_fused

        return triton_fused.silu_mul(gate_up)
    return reference.silu_mul(gate_up)


def rope_store(q, k, v, cos, sin, rows, positions, kf, vf, pf):
    """See `reference.rope_store`."""
    if use_triton(q.device):
        from semkv.kernels import triton_fused

        return triton_fused.rope_store(q, k, v, cos, sin, rows, positions, kf, vf, pf)
    return reference.rope_store(q, k, v, cos, sin, rows, positions, kf, vf, pf)


def paged_dot(q, k_pool, table, slots):
    """See `reference.paged_dot`."""
    if use_triton(q.device):
        from semkv.kernels import triton_paged_dot as kernel

        return kernel.paged_dot(q, k_pool, table, slots)
    return reference.paged_dot(q, k_pool, table, slots)


def accumulate_attention(logits, counts, pages, positions, pos_pool, scores):
    """See `reference.accumulate_attention`."""
    if use_triton(logits.device):
        from semkv.kernels import triton_attention_scores

        return triton_attention_scores.accumulate_attention(logits, counts, pages, positions, pos_pool, scores)
    return reference.accumulate_attention(logits, counts, pages, positions, pos_pool, scores)


def prompt_attention_sums(q, k_pool, table, start, scale):
    """See `reference.prompt_attention_sums`."""
    if use_triton(q.device):
        from semkv.kernels import triton_attention_scores

        return triton_attention_scores.prompt_attention_sums(q, k_pool, table, start, scale)
    return reference.prompt_attention_sums(q, k_pool, table, start, scale)


def block_slots(top, chosen, init, local, n, block_size, capacity):
    """See `reference.block_slots`."""
    if use_triton(top.device):
        from semkv.kernels import triton_block_slots

        return triton_block_slots.block_slots(top, chosen, init, local, n, block_size, capacity)
    return reference.block_slots(top, chosen, init, local, n, block_size, capacity)


def sentence_slots(bucket, rows, before, first, n, n_sink, retained, capacity, tail, max_sink, width):
    """See `reference.sentence_slots`."""
    if use_triton(bucket.device):
        from semkv.kernels import triton_sentence_slots

        return triton_sentence_slots.sentence_slots(bucket, rows, before, first, n, n_sink, retained, capacity,
                                                    tail, max_sink, width)
    return reference.sentence_slots(bucket, rows, before, first, n, n_sink, retained, capacity, tail, max_sink, width)


def chunk_slots(lo, count, before, n, n_sink, capacity, tail, max_sink, width, longest):
    """See `reference.chunk_slots`."""
    if use_triton(lo.device):
        from semkv.kernels import triton_chunk_slots

        return triton_chunk_slots.chunk_slots(lo, count, before, n, n_sink, capacity, tail, max_sink, width, longest)
    return reference.chunk_slots(lo, count, before, n, n_sink, capacity, tail, max_sink, width, longest)


def chunk_refresh(k_flat, tables, page_size, first, split, n, targets, span, kmin, kmax):
    """See `reference.chunk_refresh` (in place)."""
    if use_triton(k_flat.device):
        from semkv.kernels import triton_chunk_refresh

        return triton_chunk_refresh.chunk_refresh(k_flat, tables, page_size, first, split, n, targets, span, kmin, kmax)
    return reference.chunk_refresh(k_flat, tables, page_size, first, split, n, targets, span, kmin, kmax)


def slot_stamps(stamps, tables, page_size, slots, lengths, current, step, first, reuse, rows, scratch):
    """See `reference.slot_stamps` (in place)."""
    if use_triton(stamps.device):
        from semkv.kernels import triton_slot_stamps

        return triton_slot_stamps.slot_stamps(stamps, tables, page_size, slots, lengths, current, step, first, reuse,
                                              rows, scratch)
    return reference.slot_stamps(stamps, tables, page_size, slots, lengths, current, step, first, reuse, rows, scratch)


def summary_dots(sums, pages, directions):
    """See `reference.summary_dots`."""
    if use_triton(sums.device):
        from semkv.kernels import triton_summary_dot

        return triton_summary_dot.summary_dots(sums, pages, directions)
    return reference.summary_dots(sums, pages, directions)


def page_bound(q, kmin, kmax, tables, num_slots, page_size, group_reduce, k_pool=None):
    """See `reference.page_bound`."""
    if use_triton(q.device):
        from semkv.kernels import triton_page_select

        return triton_page_select.page_bound(q, kmin, kmax, tables, num_slots, page_size, group_reduce, k_pool)
    return reference.page_bound(q, kmin, kmax, tables, num_slots, page_size, group_reduce, k_pool)


def page_slots(top, budget, num_slots, page_size):
    """See `reference.page_slots`."""
    if use_triton(top.device):
        from semkv.kernels import triton_page_select

        return triton_page_select.page_slots(top, budget, num_slots, page_size)
    return reference.page_slots(top, budget, num_slots, page_size)


def token_select(q, k_pool, tables, num_slots, width, rows, cache, layer, n_sink, n_recent, theta, selection,
                 kv_heads):
    """See `reference.token_select`; the Triton path covers the soft vote and top-k with k >= 1 (the hard vote and
    k = 0 run the reference)."""
    if use_triton(q.device) and selection != "hard_vote" and cache.top.shape[-1] > 0:
        from semkv.kernels import triton_token_select as kernel

        return kernel.token_select(q, k_pool, tables, num_slots, width, rows, cache, layer, n_sink, n_recent,
                                   theta, selection, kv_heads)
    return reference.token_select(q, k_pool, tables, num_slots, width, rows, cache, layer, n_sink, n_recent, theta,
                                  selection, kv_heads)
