"""sentencekv's kernels: Triton on CUDA, the torch reference (`reference.py` beside this file) elsewhere."""
from __future__ import annotations

from semkv.kernels import use_triton
from semkv.methods.sentencekv import reference


def sentence_slots(bucket, rows, before, first, place, n, n_sink, retained, capacity, tail, max_sink, width):
    """See `reference.sentence_slots`; place [B, S, buckets] (`kernels.bucket_take`) is what the Triton kernel reads
    besides (the reference compacts instead)."""
    if use_triton(bucket.device):
        from semkv.methods.sentencekv import triton_sentence_slots

        return triton_sentence_slots.sentence_slots(bucket, rows, before, first, place, n, n_sink, retained, capacity,
                                                    tail, max_sink, width)
    return reference.sentence_slots(bucket, rows, before, first, n, n_sink, retained, capacity, tail, max_sink, width)


def bucket_best(q, k_pool, tables, bucket, rows, n_sink, retained, buckets):
    """See `reference.bucket_best`."""
    if use_triton(q.device):
        from semkv.methods.sentencekv import triton_bucket_best

        return triton_bucket_best.bucket_best(q, k_pool, tables, bucket, rows, n_sink, retained, buckets)
    return reference.bucket_best(q, k_pool, tables, bucket, rows, n_sink, retained, buckets)
