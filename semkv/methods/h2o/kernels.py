"""h2o's kernels: Triton on CUDA, the torch reference (`reference.py` beside this file) elsewhere."""
from __future__ import annotations

from semkv.kernels import use_triton
from semkv.methods.h2o import reference


def accumulate_attention(logits, counts, pages, positions, pos_pool, scores):
    """See `reference.accumulate_attention`."""
    if use_triton(logits.device):
        from semkv.methods.h2o import triton_attention_scores

        return triton_attention_scores.accumulate_attention(logits, counts, pages, positions, pos_pool, scores)
    return reference.accumulate_attention(logits, counts, pages, positions, pos_pool, scores)


def prompt_attention_sums(q, k_pool, table, start, scale, lse):
    """See `reference.prompt_attention_sums`."""
    if use_triton(q.device):
        from semkv.methods.h2o import triton_attention_scores

        return triton_attention_scores.prompt_attention_sums(q, k_pool, table, start, scale, lse)
    return reference.prompt_attention_sums(q, k_pool, table, start, scale, lse)
