"""GPU check of semkv's Triton kernels against the torch reference, then their speed.

    python benchmarks/kernel_check.py            # on a CUDA machine

Correctness: fresh random inputs (never zeros), outputs poisoned with NaN first, error ||out - ref|| / ||ref|| with
the reference computed in float32 from the same bf16 inputs; bf16 should land near 1e-3..1e-2, NaN never passes.
Speed: median of CUDA-event timings (triton.testing.do_bench), next to the bytes each kernel must read over the
measured bandwidth (the floor). Llama-3.1-8B head shape: 32 query heads, 8 KV heads, head_dim 128, page 16.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from semkv.bench.device import measured_bandwidth
from semkv.kernels import (cudnn_prefill, fa3, reference, triton_decode, triton_fused, triton_page_select,
                           triton_prefill)
from semkv.methods.chess import reference as chess_reference, triton_summary_dot
from semkv.methods.dynsplit import (reference as dynsplit_reference, triton_chunk_best, triton_chunk_refresh,
                                    triton_chunk_slots, triton_slot_stamps)
from semkv.methods.h2o import reference as h2o_reference, triton_attention_scores
from semkv.methods.infllm import reference as infllm_reference, triton_block_slots
from semkv.methods.sentencekv import reference as sentencekv_reference, triton_bucket_best, triton_sentence_slots
from semkv.methods.tokenselect import reference as tokenselect_reference, triton_token_select

H, HK, D, PAGE = 32, 8, 128, 16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def exact_row(kernel: str, shape: str, r: dict) -> str:
    """A table row for a kernel whose integer output must equal its reference's."""
    return (f"| {kernel} | {shape} | {'exact' if r['err'] == 0 else 'DIFFERS'} | {r['triton_ms']:.4f} | "
            f"{r['reference_ms']:.4f} | - |")


def pool(tokens: int, batch: int, gen: torch.Generator, kv_heads: int = HK, dim: int = D):
    pages = batch * (-(-tokens // PAGE)) + 1
    k = torch.randn(pages, PAGE, kv_heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(pages, PAGE, kv_heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    tables = torch.randperm(pages - 1, device="cuda", generator=gen)[: batch * (pages // batch)] + 1
    return k, v, tables.view(batch, -1)


def check_decode(gen, bandwidth: float) -> list[dict]:
    from triton.testing import do_bench

    rows = []
    # the 8B shape (32 heads, 8 KV heads, head_dim 128), then Qwen2.5-0.5B's (14, 2, 64): few KV heads to spread
    for batch, context, heads, kv_heads, dim in [(1, 4096, 32, 8, 128), (1, 32768, 32, 8, 128), (8, 8192, 32, 8, 128),
                                     (16, 32768, 32, 8, 128), (16, 32768, 14, 2, 64), (64, 32768, 14, 2, 64)]:
        k, v, tables = pool(context, batch, gen, kv_heads, dim)
        q = torch.randn(batch, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
        lengths = torch.full((batch, 1), context, device="cuda")
        want = reference.decode_attention(q.float(), k.float(), v.float(), tables, None, lengths, dim**-0.5)
        got = triton_decode.decode_attention(q, k, v, tables, None, lengths, dim**-0.5)
        # a per-head index list of 1% of the context
        n = max(context // 100, 64)
        slots = torch.sort(torch.stack([torch.randperm(context, device="cuda", generator=gen)[:n]
                                        for _ in range(batch * kv_heads)]).view(batch, kv_heads, n), -1).values
        sel_lengths = torch.full((batch, kv_heads), n, device="cuda")
        want_sel = reference.decode_attention(q.float(), k.float(), v.float(), tables, slots, sel_lengths, dim**-0.5)
        got_sel = triton_decode.decode_attention(q, k, v, tables, slots, sel_lengths, dim**-0.5)
        full_ms = do_bench(lambda: triton_decode.decode_attention(q, k, v, tables, None, lengths, dim**-0.5,
                                                                  max_len=context), return_mode="median")
        ref_ms = do_bench(lambda: reference.decode_attention(q, k, v, tables, None, lengths, dim**-0.5),
                          return_mode="median")
        sel_ms = do_bench(lambda: triton_decode.decode_attention(q, k, v, tables, slots, sel_lengths, dim**-0.5),
                          return_mode="median")
        floor_ms = 1e3 * batch * context * kv_heads * dim * 2 * 2 / bandwidth
        flash = {}
        if fa3.usable(q, None, k, fa3.DECODE_PATH):  # semkv's full decode path where vLLM brings FlashAttention 3
            inputs = fa3.decode_inputs(tables[:, None], lengths, context)  # one layer

            def fa3_decode():
                return fa3.decode_attention(q, k, v, inputs, 0, dim**-0.5)
            flash = dict(err_fa3=rel_err(fa3_decode(), want), fa3_ms=do_bench(fa3_decode, return_mode="median"))
        rows.append(dict(kernel="decode", batch=batch, context=context, heads=heads, kv_heads=kv_heads, head_dim=dim,
                         err_full=rel_err(got, want),
                         err_selected=rel_err(got_sel, want_sel), triton_ms=full_ms, reference_ms=ref_ms,
                         selected_1pct_ms=sel_ms, floor_ms=floor_ms, **flash))
    return rows


def check_prefill(gen) -> list[dict]:
    """The paged Triton prefill kernel (with its log-sum-exps; a short chunk over a long context splits it), the
    cuDNN path of long chunks (`kernels.cudnn_prefill`) and FlashAttention 3 where vLLM brings it
    (`kernels.fa3`), against the float32 reference."""
    from triton.testing import do_bench

    rows = []
    # the 8B shape (32 heads, 8 KV heads, head_dim 128), then Qwen2.5-0.5B's (14, 2, 64)
    cases = [(start, chunk, 32, 8, 128) for start, chunk in
             [(0, 512), (8192, 512), (32768, 2048), (0, 8192), (24576, 8192), (16401, 8176)]]
    cases += [(start, chunk, 14, 2, 64) for start, chunk in [(0, 8192), (24576, 8192), (16401, 8176), (31000, 37)]]
    for start, chunk, heads, kv_heads, dim in cases:
        k, v, tables = pool(start + chunk, 1, gen, kv_heads, dim)
        table = tables[0]
        q = torch.randn(chunk, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
        want, want_lse = reference.prefill_attention(q.float(), k.float(), v.float(), table, start, None, dim**-0.5,
                                                     lse=True)
        flops = 4 * chunk * (start + chunk / 2) * dim * heads
        paths = [("triton", lambda: triton_prefill.prefill_attention(q, k, v, table, start, None, dim**-0.5, lse=True))]
        if cudnn_prefill.usable(q, None):
            paths.append(("cudnn", lambda: cudnn_prefill.prefill_attention(q, k, v, table, start, dim**-0.5, lse=True)))
        if fa3.usable(q, None, k):
            paths.append(("fa3", lambda: fa3.prefill_attention(q, k, v, table, start, dim**-0.5, lse=True)))
        for path, fn in paths:
            got, got_lse = fn()
            ms = do_bench(fn, return_mode="median")
            rows.append(dict(kernel="prefill", path=path, start=start, chunk=chunk, heads=heads, kv_heads=kv_heads,
                             head_dim=dim,
                             err=max(rel_err(got, want), rel_err(got_lse, want_lse)), triton_ms=ms,
                             reference_ms=do_bench(lambda: reference.prefill_attention(q, k, v, table, start, None,
                                                                                        dim**-0.5),
                                                   return_mode="median"),
                             triton_tflops=flops / ms / 1e9))
    return rows


def check_packed_prefill(gen) -> list[dict]:
    """Several sequences' chunks in one FlashAttention 3 call (`fa3.packed_attention`, what
    `Engine.prefill_together` runs where it serves) against the float32 reference a chunk, and its time against one
    FlashAttention 3 call a chunk. Qwen2.5-0.5B's heads (14, 2, 64); 8 follow-up questions of 17-40 tokens on
    contexts of 32k, and the same with one new prompt's chunk of 4,096 tokens among them."""
    from triton.testing import do_bench

    rows, dim = [], 64
    for chunks in ([(32000 + 3 * i, 17 + 3 * i) for i in range(8)],
                   [(0, 4096)] + [(32000 + 3 * i, 17 + 3 * i) for i in range(7)]):
        k, v, tables = pool(max(a + c for a, c in chunks), len(chunks), gen, 2, dim)
        qs = [torch.randn(c, 14, dim, device="cuda", generator=gen, dtype=torch.bfloat16) for _, c in chunks]
        want = torch.cat([reference.prefill_attention(q.float(), k.float(), v.float(), table, a, None, dim**-0.5)
                          for q, table, (a, _) in zip(qs, tables, chunks)])
        paths = {}
        if fa3.available():
            q = torch.cat(qs)
            cu_q = torch.tensor([0] + [sum(c for _, c in chunks[: i + 1]) for i in range(len(chunks))],
                                dtype=torch.int32, device="cuda")
            used = torch.tensor([a + c for a, c in chunks], dtype=torch.int32, device="cuda")
            longest = (max(c for _, c in chunks), max(a + c for a, c in chunks))
            block = tables.to(torch.int32)
            paths["packed"] = lambda: fa3.packed_attention(q, k, v, block, cu_q, used, *longest, dim**-0.5)
            paths["each"] = lambda: torch.cat([fa3.prefill_attention(q_, k, v, table, a, dim**-0.5)
                                               for q_, table, (a, _) in zip(qs, tables, chunks)])
        for path, fn in paths.items():
            rows.append(dict(kernel="packed_prefill", path=path, chunks=len(chunks), tokens=sum(c for _, c in chunks),
                             err=rel_err(fn(), want), triton_ms=do_bench(fn, return_mode="median")))
    return rows


def check_fused(gen) -> list[dict]:
    x = torch.randn(4, 4096, device="cuda", generator=gen, dtype=torch.bfloat16)
    residual = torch.randn(4, 4096, device="cuda", generator=gen, dtype=torch.bfloat16)
    weight = torch.randn(4096, device="cuda", generator=gen, dtype=torch.bfloat16)
    want, want_sum = reference.rms_norm(x, weight, 1e-5, residual)
    got, got_sum = triton_fused.rms_norm(x, weight, 1e-5, residual)
    gate_up = torch.randn(4, 2 * 14336, device="cuda", generator=gen, dtype=torch.bfloat16)
    return [dict(kernel="rms_norm", err=max(rel_err(got, want), rel_err(got_sum, want_sum))),
            dict(kernel="silu_mul", err=rel_err(triton_fused.silu_mul(gate_up), reference.silu_mul(gate_up))),
            check_rope_store(gen)]


def check_rope_store(gen, batch: int = 16, heads: int = 32, kv_heads: int = 8, dim: int = 128) -> dict:
    """A decode step's rope_store: positions are a column of the packed step inputs (strided), each row and KV head
    writes its own pool row."""
    q, k, v = (torch.randn(batch, h, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
               for h in (heads, kv_heads, kv_heads))
    packed = torch.randint(0, 30000, (batch, 2 + 32), device="cuda", generator=gen)  # [token, position, counts...]
    angles = packed[:, 1, None].float() * torch.rand(dim // 2, device="cuda", generator=gen)
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    rows = torch.randperm(batch * kv_heads * 4, device="cuda", generator=gen)[: batch * kv_heads].view(batch, kv_heads)
    pools = [[torch.zeros(batch * kv_heads * 4, kv_heads, dim, device="cuda", dtype=torch.bfloat16) for _ in "kv"]
             + [torch.zeros(batch * kv_heads * 4, kv_heads, device="cuda", dtype=torch.int32)] for _ in range(2)]
    want = reference.rope_store(q, k, v, cos, sin, rows, packed[:, 1], *pools[0])
    got = triton_fused.rope_store(q, k, v, cos, sin, rows, packed[:, 1], *pools[1])
    stored = max(rel_err(a, b) for a, b in zip(pools[1][:2], pools[0][:2]))
    positions_equal = bool((pools[1][2] == pools[0][2]).all())
    return dict(kernel="rope_store", err=max(rel_err(got, want), stored) if positions_equal else float("inf"))


def check_accumulate(gen, batch: int = 16, width: int = 2048) -> list[dict]:
    """H2O's score update for one layer at budget 2048: logits of 32 query heads over each row's resident slots, rows
    of different counts, scores and positions beside a pool of bf16-sized pages."""
    from triton.testing import do_bench

    n_pages = width // PAGE
    logits = torch.randn(batch, H, width, device="cuda", generator=gen) * 3
    counts = width - torch.arange(batch, device="cuda") * 37
    pages = torch.randperm(batch * n_pages, device="cuda", generator=gen).view(batch, n_pages) + 1
    pages = torch.where(torch.arange(n_pages, device="cuda") * PAGE < counts[:, None], pages, 0)
    pos_pool = torch.randint(0, 4096, (batch * n_pages + 1, PAGE, HK), device="cuda", generator=gen,
                             dtype=torch.int32)
    positions = torch.full((batch,), 4096, device="cuda")
    pos_pool[pages[:, 3], 5] = 4096  # one slot per row holds the current token
    start = torch.rand(batch * n_pages + 1, PAGE, HK, device="cuda", generator=gen) * 5
    want, got = start.clone(), start.clone()
    args = (logits, counts, pages, positions, pos_pool)
    h2o_reference.accumulate_attention(*args, want)
    triton_attention_scores.accumulate_attention(*args, got)
    return [dict(kernel="accumulate_attention", batch=batch, width=width, err=rel_err(got[1:], want[1:]),
                 triton_ms=do_bench(lambda: triton_attention_scores.accumulate_attention(*args, got)),
                 reference_ms=do_bench(lambda: h2o_reference.accumulate_attention(*args, want)))]


def check_summary(gen, bandwidth: float, batch: int = 25, layers: int = 32, pages: int = 2050) -> list[dict]:
    """CHESS's page scoring at 32k context: float32 page sums of `pages` KV pages per layer and sequence."""
    from triton.testing import do_bench

    sums = torch.randn(batch * layers * pages + 1, HK, D, device="cuda", generator=gen)
    ids = torch.randperm(sums.shape[0] - 1, device="cuda", generator=gen).view(batch, layers, pages) + 1
    directions = torch.randn(batch, 1, layers, HK, D, device="cuda", generator=gen)
    want = chess_reference.summary_dots(sums, ids, directions)
    got = triton_summary_dot.summary_dots(sums, ids, directions)
    return [dict(kernel="summary_dots", batch=batch, pages=pages, err=rel_err(got, want),
                 triton_ms=do_bench(lambda: triton_summary_dot.summary_dots(sums, ids, directions)),
                 reference_ms=do_bench(lambda: chess_reference.summary_dots(sums, ids, directions)),
                 floor_ms=1e3 * ids.numel() * HK * D * 4 / bandwidth)]


def check_page_bound(gen, bandwidth: float, batch: int = 16, pages: int = 2050) -> list[dict]:
    """Quest's page scoring for one layer at 32k context: bf16 min / max summaries (as Quest keeps them) of `pages`
    KV pages per sequence, rows of different lengths, each row's current key folded into its last page first (the
    updated summaries must equal the reference's exactly)."""
    from triton.testing import do_bench

    a, b = torch.randn(2, batch * pages + 1, HK, D, device="cuda", generator=gen)
    kmin, kmax = torch.minimum(a, b).bfloat16(), torch.maximum(a, b).bfloat16()
    tables = torch.randperm(batch * pages, device="cuda", generator=gen).view(batch, pages) + 1
    num_slots = PAGE * pages - torch.arange(batch, device="cuda") * 5
    q = torch.randn(batch, H, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    k_pool = torch.randn(kmin.shape[0], PAGE, HK, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    ref_sums, got_sums = (kmin.clone(), kmax.clone()), (kmin.clone(), kmax.clone())
    want = reference.page_bound(q, *ref_sums, tables, num_slots, PAGE, "mean", k_pool)  # the current keys folded in
    got = triton_page_select.page_bound(q, *got_sums, tables, num_slots, PAGE, "mean", k_pool)
    folded_equal = all(torch.equal(a, b) for a, b in zip(ref_sums, got_sums))
    args = (q, kmin, kmax, tables, num_slots, PAGE, "mean", k_pool)
    finite = want.isfinite()
    same_inf = folded_equal and torch.equal(want[~finite], got[~finite])
    top = want.topk(2048 // PAGE + 1, dim=-1).indices  # a budget of 2048 tokens, 2040 of them on a row's own grid
    budget = torch.full_like(num_slots, 2048)
    slot_args = (top, budget, num_slots, PAGE)
    exact = all(torch.equal(a, b) for a, b in zip(reference.page_slots(*slot_args),
                                                   triton_page_select.page_slots(*slot_args)))
    return [dict(kernel="page_bound", batch=batch, pages=pages,
                 err=rel_err(got[finite], want[finite]) if same_inf else float("inf"),
                 triton_ms=do_bench(lambda: triton_page_select.page_bound(*args)),
                 reference_ms=do_bench(lambda: reference.page_bound(*args)),
                 floor_ms=1e3 * 2 * tables.numel() * HK * D * 2 / bandwidth),
            dict(kernel="page_slots", batch=batch, err=0.0 if exact else float("inf"),
                 triton_ms=do_bench(lambda: triton_page_select.page_slots(*slot_args)),
                 reference_ms=do_bench(lambda: reference.page_slots(*slot_args)))]


def sweep_page_bound(gen, bandwidth: float) -> list[dict]:
    """`page_bound`'s launch settings (pages a program, warps) at Qwen2.5-0.5B's shape at Full KV's largest batch on
    an H200 (334 rows of 31,744 tokens, 14 / 2 heads x 64) and Llama-3.1-8B's at 11 rows of 32k, with each row's
    pages in one run of the pool (as a fresh pool hands them out) and scattered over it; each setting's bounds
    against the default's. Rows print as kernel "page_bound_sweep"."""
    from triton.testing import do_bench

    rows = []
    for shape, batch, pages, heads, kv_heads, dim in [("qwen2.5-0.5b", 334, 1984, 14, 2, 64),
                                                      ("llama3-8b", 11, 2048, 32, 8, 128)]:
        a, b = torch.randn(2, batch * pages + 1, kv_heads, dim, device="cuda", generator=gen)
        kmin, kmax = torch.minimum(a, b).bfloat16(), torch.maximum(a, b).bfloat16()
        del a, b
        num_slots = PAGE * pages - torch.arange(batch, device="cuda") * 5
        q = torch.randn(batch, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
        floor_ms = 1e3 * 2 * batch * pages * kv_heads * dim * 2 / bandwidth
        for tables_kind in ("runs", "scattered"):
            order = torch.arange(batch * pages, device="cuda")
            if tables_kind == "scattered":
                order = torch.randperm(batch * pages, device="cuda", generator=gen)
            tables = order.view(batch, pages) + 1
            want = triton_page_select.page_bound(q, kmin, kmax, tables, num_slots, PAGE, "max")
            finite = want.isfinite()
            for block_w in (32, 64, 128):
                for num_warps in (4, 8):
                    got = triton_page_select.page_bound(q, kmin, kmax, tables, num_slots, PAGE, "max", block_w=block_w,
                                                        num_warps=num_warps)
                    same = torch.equal(want[~finite], got[~finite])
                    rows.append(dict(kernel="page_bound_sweep", shape=shape, batch=batch, tables=tables_kind,
                                     block_w=block_w, num_warps=num_warps,
                                     err=rel_err(got[finite], want[finite]) if same else float("inf"),
                                     triton_ms=do_bench(lambda: triton_page_select.page_bound(
                                         q, kmin, kmax, tables, num_slots, PAGE, "max", block_w=block_w,
                                         num_warps=num_warps)), floor_ms=floor_ms))
        del kmin, kmax
    return rows


def check_token_select(gen, bandwidth: float, batch: int = 25, context: int = 32768) -> list[dict]:
    """TokenSelect's decode selection (paper budget 128 + 2048 + 512) for one layer at 32k: the kernels against the
    reference on the same cache state. Votes are float sums in another order, so near-ties at the k-th place may
    swap: the error is the share of top-k slots that differ (plus any mismatch of the cache state). Times: every row
    misses (theta above 1), every row hits (theta -2), and the K bytes the scoring reads (the miss floor)."""
    from triton.testing import do_bench

    k_pool, _, tables = pool(context + 64, batch, gen)
    q = torch.randn(batch, H, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    num_slots = context + torch.arange(batch, device="cuda")  # [B] different lengths
    rows = torch.arange(1, batch + 1, device="cuda")
    width = context + 64
    sink, k, recent = 128, 2048, 512

    def fresh():
        return tokenselect_reference.SelectionCacheBuffers.allocate(batch + 1, 2, H * D, 1, k, torch.device("cuda"))

    args = (k_pool, tables, num_slots, width, rows)
    parts = torch.tensor([[sink, k, recent]], device="cuda").expand(batch, -1)  # [B, 3] each row's split
    ref_cache, got_cache = fresh(), fresh()
    want = tokenselect_reference.token_select(q, *args, ref_cache, 1, parts, sink + k + recent, 0.9, "soft_vote",
                                              None)
    got = triton_token_select.token_select(q, *args, got_cache, 1, parts, sink + k + recent, 0.9, "soft_vote", None)
    got_exact = got
    differ = sum(len(set(want[b, 0].tolist()) - set(got[b, 0].tolist())) for b in range(batch)) / (batch * k)
    state_equal = all(torch.equal(getattr(ref_cache, n), getattr(got_cache, n)) for n in ("q", "valid", "counts"))
    timing_cache = fresh()
    miss_ms = do_bench(lambda: triton_token_select.token_select(q, *args, timing_cache, 1, parts, sink + k + recent,
                                                                1.5, "soft_vote", None))
    hit_ms = do_bench(lambda: triton_token_select.token_select(q, *args, timing_cache, 1, parts, sink + k + recent,
                                                               -2.0, "soft_vote", None))
    key_bytes = float(num_slots.sum()) * HK * D * 2
    # score_keys="pages": the bound of every page from its keys' min / max, the pages holding 4k candidates, the
    # kernels over their compact slots against the reference on the same pages; the time includes the bound
    kmin, kmax = k_pool.amin(1).contiguous(), k_pool.amax(1).contiguous()
    count = -(-4 * k // PAGE) + 2

    def stage(table_width: int = -(-width // PAGE)):
        bound = triton_page_select.page_bound(q, kmin, kmax, tables[:, :table_width], num_slots, PAGE, "max")
        ids, chosen, span = triton_page_select.page_candidates(bound, parts[:, 0], num_slots - parts[:, 2], tables,
                                                               PAGE, count)
        return ids, (chosen, span)

    compact, pages = stage()
    paged = (k_pool, compact, num_slots, count * PAGE, rows)
    ref_cache, got_cache = fresh(), fresh()
    want = tokenselect_reference.token_select(q, *paged, ref_cache, 1, parts, sink + k + recent, 0.9, "soft_vote",
                                              None, pages=pages)
    got = triton_token_select.token_select(q, *paged, got_cache, 1, parts, sink + k + recent, 0.9, "soft_vote", None,
                                           pages=pages)
    paged_differ = sum(len(set(want[b, 0].tolist()) - set(got[b, 0].tolist())) for b in range(batch)) / (batch * k)
    exact_kept = sum(len(set(want[b, 0].tolist()) & set(got_exact[b, 0].tolist())) - sink - recent
                     for b in range(batch)) / (batch * k)
    paged_state = all(torch.equal(getattr(ref_cache, n), getattr(got_cache, n)) for n in ("q", "valid", "counts"))

    def paged_miss():
        compact, pages = stage()
        return triton_token_select.token_select(q, k_pool, compact, num_slots, count * PAGE, rows, timing_cache, 1,
                                                parts, sink + k + recent, 1.5, "soft_vote", None, pages=pages)

    paged_bytes = float(num_slots.sum()) / PAGE * 2 * HK * D * 2 + batch * count * PAGE * HK * D * 2
    return [dict(kernel="token_select", batch=batch, context=context, err=differ if state_equal else float("inf"),
                 miss_ms=miss_ms, hit_ms=hit_ms, floor_ms=1e3 * key_bytes / bandwidth),
            dict(kernel="token_select_pages", batch=batch, context=context, pages=count,
                 err=paged_differ if paged_state else float("inf"), exact_kept=exact_kept,
                 miss_ms=do_bench(paged_miss), floor_ms=1e3 * paged_bytes / bandwidth)]


def check_prompt_sums(gen) -> list[dict]:
    """H2O's prompt scores for one layer: the last 512-query chunk of a 32k prompt, whose queries see every key."""
    from triton.testing import do_bench

    context, chunk = 32768, 512
    k, _, tables = pool(context, 1, gen)
    q = torch.randn(chunk, H, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    _, lse = triton_prefill.prefill_attention(q, k, k, tables[0], context - chunk, None, D**-0.5, lse=True)
    args = (q, k, tables[0], context - chunk, D**-0.5, lse)
    want = h2o_reference.prompt_attention_sums(q.float(), k.float(), *args[2:])
    got = triton_attention_scores.prompt_attention_sums(*args)
    triton_ms = do_bench(lambda: triton_attention_scores.prompt_attention_sums(*args))
    flops = 2 * H * chunk * context * D  # q . k once: the log-sum-exps come from the prefill attention
    return [dict(kernel="prompt_attention_sums", context=context, chunk=chunk, err=rel_err(got, want),
                 triton_ms=triton_ms, reference_ms=do_bench(lambda: h2o_reference.prompt_attention_sums(*args)),
                 triton_tflops=flops / triton_ms / 1e9)]


def check_window_mass(gen) -> list[dict]:
    """The prefill-eviction methods' and CHESS's scores of a 32k prompt's keys by its last 32 queries, one layer
    (`triton_window_mass`), against the float32 reference; `torch_ms` is the torch path the methods took before
    (`methods.base.window_attention` in bfloat16, then the sum over the window)."""
    from triton.testing import do_bench

    from semkv.kernels import triton_window_mass
    from semkv.methods.base import window_attention

    rows = []
    for heads, kv_heads, dim in [(14, 2, 64), (32, 8, 128)]:  # Qwen2.5-0.5B's heads, then the 8B shape's
        w, n = 32, 32768
        q = torch.randn(w, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
        keys = torch.randn(kv_heads, n, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
        positions = torch.arange(n, device="cuda")[None].expand(kv_heads, -1)
        query_positions = torch.arange(n - w, n, device="cuda")
        args = (q, keys, positions, query_positions, dim**-0.5)
        want = reference.window_mass(q.float(), keys.float(), *args[2:])
        got = triton_window_mass.window_mass(*args)
        before = window_attention(q, keys, positions, query_positions).sum(1)
        rows.append(dict(kernel="window_mass", heads=heads, kv_heads=kv_heads, head_dim=dim, window=w, context=n,
                         err=rel_err(got, want), torch_err=rel_err(before, want),
                         triton_ms=do_bench(lambda: triton_window_mass.window_mass(*args), return_mode="median"),
                         torch_ms=do_bench(lambda: window_attention(q, keys, positions, query_positions).sum(1),
                                           return_mode="median")))
    return rows


def check_block_slots(gen, batch: int = 16, candidates: int = 256, blocks: int = 11) -> list[dict]:
    """InfLLM's slot list for one layer at budget 2048 (128 initial tokens, 11 blocks of 128, the local window) over
    32k contexts of different lengths, one set per layer and one per KV head: integers, so they must agree exactly."""
    from triton.testing import do_bench

    rows = []
    for shared in (1, HK):
        n = 32768 - torch.arange(batch, device="cuda") * 977
        top = torch.stack([torch.randperm(candidates - 40, device="cuda", generator=gen)[:blocks] + 1
                           for _ in range(batch * shared)]).view(batch, shared, blocks)
        chosen = torch.full((batch,), blocks, device="cuda")
        chosen[::4] = 7  # rows that take fewer blocks and leave more to the local window
        init = torch.full((batch,), 128, device="cuda")
        local = 2048 - init - chosen * 128
        args = (top, chosen, init, local, n, 128, 2048)
        want, got = infllm_reference.block_slots(*args), triton_block_slots.block_slots(*args)
        exact = all(torch.equal(a, b) for a, b in zip(want, got))
        rows.append(dict(kernel="block_slots", shared=shared, batch=batch, err=0.0 if exact else float("inf"),
                         triton_ms=do_bench(lambda: triton_block_slots.block_slots(*args)),
                         reference_ms=do_bench(lambda: infllm_reference.block_slots(*args))))
    return rows


def check_sentence_slots(gen, batch: int = 16, tokens: int = 4608, buckets: int = 1400) -> list[dict]:
    """SentenceKV's slot list from ranked buckets for one layer at budget 2048 (32 sinks, 1984 tokens of ranked
    buckets, 32 recent) in state rows of a larger table: a map per KV head, 4608 retained tokens in 1400 buckets.
    Integers: they must agree exactly."""
    from triton.testing import do_bench

    full = torch.full((batch,), tokens, device="cuda")
    rows = torch.randperm(batch + 3, device="cuda", generator=gen)[:batch]
    bucket = torch.sort(torch.randint(0, buckets, (batch + 3, HK, tokens), device="cuda", generator=gen),
                        dim=-1).values.int()
    count = torch.zeros(batch, HK, buckets, dtype=torch.int32, device="cuda").scatter_add_(
        -1, bucket[rows].long(), torch.ones_like(bucket[rows]))
    rank = torch.rand(batch, HK, buckets, device="cuda", generator=gen).argsort(-1)
    ranked = count.gather(-1, rank)
    before = torch.empty_like(ranked).scatter_(-1, rank, ranked.cumsum(-1, dtype=torch.int32) - ranked)
    first = count.cumsum(-1, dtype=torch.int32) - count
    capacity = torch.full_like(full, 1984)
    place = reference.taken_place(before, count, capacity)  # as `bucket_take` gives it
    args = (bucket, rows, before, first, 32 + full + 40, torch.full_like(full, 32), full, capacity,
            torch.full_like(full, 32), 32, 2048)
    placed = (*args[:4], place, *args[4:])  # the Triton kernel's arguments
    want, got = sentencekv_reference.sentence_slots(*args), triton_sentence_slots.sentence_slots(*placed)
    exact = all(torch.equal(a, b) for a, b in zip(want, got))
    return [dict(kernel="sentence_slots", batch=batch, tokens=tokens, err=0.0 if exact else float("inf"),
                 triton_ms=do_bench(lambda: triton_sentence_slots.sentence_slots(*placed)),
                 reference_ms=do_bench(lambda: sentencekv_reference.sentence_slots(*args)))]


def check_bucket_best(gen, bandwidth: float, batch: int = 16, context: int = 32768, tokens: int = 3328,
                      buckets: int = 1400) -> list[dict]:
    """SentenceKV's score="tokens" for one layer at 10% of 32k: each bucket's best query . key over 3,328 retained
    tokens a row and KV head (slots 32.., a map per KV head, 1,400 buckets), keys read through the page tables. Float
    sums in another order: relative error. Floor: the retained keys' bytes."""
    from triton.testing import do_bench

    k_pool, _, tables = pool(context, batch, gen)
    query = torch.randn(batch, H, D, device="cuda", generator=gen, dtype=torch.bfloat16)  # the heads' queries
    rows = torch.randperm(batch + 3, device="cuda", generator=gen)[:batch]
    bucket = torch.sort(torch.randint(0, buckets, (batch + 3, HK, tokens), device="cuda", generator=gen),
                        dim=-1).values.int()
    full = torch.full((batch,), tokens, device="cuda")
    args = (query, k_pool, tables, bucket, rows, torch.full_like(full, 32), full, buckets)
    want, got = sentencekv_reference.bucket_best(*args), triton_bucket_best.bucket_best(*args)
    finite = want.isfinite()
    err = rel_err(got[finite], want[finite]) if torch.equal(finite, got.isfinite()) else float("inf")
    return [dict(kernel="bucket_best", batch=batch, tokens=tokens, buckets=buckets, err=err,
                 triton_ms=do_bench(lambda: triton_bucket_best.bucket_best(*args)),
                 reference_ms=do_bench(lambda: sentencekv_reference.bucket_best(*args)),
                 floor_ms=1e3 * batch * tokens * HK * D * 2 / bandwidth)]


def check_bucket_take(gen, batch: int = 16) -> list[dict]:
    """What a budget of 1,984 tokens takes of ranked buckets of 0-6 tokens a row and KV head, against the reference's
    sort: 1,400 (SentenceKV's sentences at 32k) and 2,300 (DynSplit-KV's chunks with their table's slack), the
    threshold two bits a step (the default) or four. Integers: they must agree exactly."""
    from triton.testing import do_bench

    from semkv.kernels import triton_bucket_take

    rows = []
    for buckets in (1400, 2300):
        scores = torch.randn(batch, HK, buckets, device="cuda", generator=gen)
        count = torch.randint(0, 7, (batch, HK, buckets), device="cuda", generator=gen, dtype=torch.int32)
        args = (scores, count, torch.full((batch,), 1984, device="cuda"))
        want = reference.bucket_take(*args)
        reference_ms = do_bench(lambda: reference.bucket_take(*args))
        for bits in (2, 4):
            exact = all(torch.equal(a, b) for a, b in zip(want, triton_bucket_take.bucket_take(*args, bits=bits)))
            rows.append(dict(kernel="bucket_take", batch=batch, buckets=buckets, bits=bits,
                             err=0.0 if exact else float("inf"), reference_ms=reference_ms,
                             triton_ms=do_bench(lambda: triton_bucket_take.bucket_take(*args, bits=bits))))
    return rows


def check_working_set(gen, batch: int = 16, cache: int = 3200, offloaded: int = 6554) -> list[dict]:
    """The offloaded working set for one layer (SentenceKV / DynSplit-KV with offload): each row's selection of 3200
    of its 6554 offloaded tokens per KV head (32k at budget 0.1, keep factor 2), read from pinned host memory.
    Step 1 loads everything (every token missing), step 2 keeps 90% of the selection (10% missing), step 3 repeats
    step 2 (every token found). The kernel and the reference must agree exactly on the slots, the maps, the pool
    and the traffic; timed: the step with 10% missing (one run, CUDA events) and the all-found step."""
    from triton.testing import do_bench

    from semkv.engine.offload import HostKVStore
    from semkv.kernels import triton_working_set

    device, layers, layer = torch.device("cuda"), 2, 1
    rows = torch.arange(1, batch + 1, device=device)
    stores, host = {}, torch.zeros(batch + 1, 4, dtype=torch.long, device=device)
    for row in range(1, batch + 1):
        store = HostKVStore(layers, HK, D, offloaded, torch.bfloat16, device)
        keys = torch.randn(layers, HK, offloaded, D, device=device, generator=gen).to(torch.bfloat16)
        store.put(slice(None), keys, -keys, torch.arange(offloaded, dtype=torch.int32, device=device).expand(layers,
                                                                                                        HK, -1))
        stores[row], host[row] = store, torch.tensor(store.pointers(), device=device)
    n_sink, tail = 32, 32
    pages = -(-(n_sink + cache + tail) // PAGE)
    table = torch.randperm(batch * pages, device=device, generator=gen).view(batch, pages) + 1  # page 0 unused
    k_pool = torch.randn(batch * pages + 1, PAGE, HK, D, device=device, generator=gen).to(torch.bfloat16)
    pos_pool = torch.zeros(batch * pages + 1, PAGE, HK, dtype=torch.int32, device=device)
    full = lambda x: torch.full((batch,), x, device=device)  # noqa: E731
    args = (rows, full(n_sink), full(offloaded), full(cache))
    state = [torch.zeros(batch + 1, HK, cache, dtype=torch.int32, device=device),
             torch.zeros(batch + 1, HK, offloaded, dtype=torch.int32, device=device),
             torch.zeros(batch + 1, HK, dtype=torch.int32, device=device),
             torch.zeros(batch + 1, 2, dtype=torch.long, device=device)]
    ours = [t.clone() for t in state] + [k_pool.clone(), k_pool.clone(), pos_pool.clone()]
    theirs = [t.clone() for t in state] + [k_pool.clone(), k_pool.clone(), pos_pool.clone()]
    order = torch.rand(batch, HK, offloaded, device=device, generator=gen).argsort(-1)
    exact, miss_ms = True, 0.0
    for step in range(3):
        first = 0 if step == 0 else cache // 10  # steps 2 and 3: a tenth of the selection replaced
        middle = n_sink + order[..., first : first + cache].sort(-1).values
        slots = torch.cat([torch.arange(n_sink, device=device).expand(batch, HK, -1), middle,
                           (n_sink + offloaded + torch.arange(tail, device=device)).expand(batch, HK, -1)], -1)
        lengths = torch.full((batch, HK), slots.shape[-1], device=device)
        got, want = slots.clone(), slots.clone()
        held, where, hand, traffic, kp, vp, pp = theirs
        reference.working_set(want, lengths, *args, held, where, hand, stores, table, kp, vp, pp, traffic, layer)
        held, where, hand, traffic, kp, vp, pp = ours
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        triton_working_set.working_set(got, lengths, *args, held, where, hand, host, table, kp, vp, pp, traffic,
                                       layer)
        end.record()
        end.synchronize()
        if step == 1:
            miss_ms = start.elapsed_time(end)
        exact = exact and torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(ours, theirs))
    held, where, hand, traffic, kp, vp, pp = ours

    def all_found():
        triton_working_set.working_set(slots.clone(), lengths, *args, held, where, hand, host, table, kp, vp, pp,
                                       traffic, layer)

    moved = batch * HK * (cache // 10) * (2 * D * 2 + 4)
    return [dict(kernel="working_set", batch=batch, cache=cache, err=0.0 if exact else float("inf"),
                 miss_ms=miss_ms, hit_ms=do_bench(all_found), moved_mb=moved / 2**20)]


def check_chunk_slots(gen, batch: int = 16, context: int = 32768) -> list[dict]:
    """DynSplit-KV's slot list from ranked chunks for one layer at budget 2048 (16 recent, no sinks): chunks of 2-30
    positions over a 32k context (about 2000, in a table with unused columns), ranked per KV head. Integers: they
    must agree exactly."""
    from triton.testing import do_bench

    lengths = torch.randint(2, 31, (batch, context // 2), device="cuda", generator=gen)
    start = F.pad(lengths.cumsum(1), (1, 0))[:, :-1]  # [B, chunks] first position of every chunk
    chunks = int((start < context).sum(1).max()) + 64
    start = start[:, :chunks].clamp(max=context)
    n = torch.full((batch,), context, device="cuda")
    sinks, recent = torch.zeros_like(n), torch.full_like(n, 16)
    lo = torch.maximum(start, sinks[:, None])
    hi = torch.minimum(F.pad(start[:, 1:], (0, 1), value=context), (n - recent)[:, None])
    count = (hi - lo).clamp(min=0)
    scores = torch.randn(batch, HK, chunks, device="cuda", generator=gen)
    capacity = torch.full_like(n, 2048 - 16)
    before, _, place = reference.bucket_take(scores, count[:, None].expand(-1, HK, -1), capacity)
    args = (lo, count, before, n, sinks, capacity, recent, 0, 2048, 31)
    placed = (*args[:3], place, *args[3:])  # the Triton kernel's arguments
    want, got = dynsplit_reference.chunk_slots(*args), triton_chunk_slots.chunk_slots(*placed)
    exact = all(torch.equal(a, b) for a, b in zip(want, got))
    return [dict(kernel="chunk_slots", batch=batch, chunks=chunks, context=context, err=0.0 if exact else float("inf"),
                 triton_ms=do_bench(lambda: triton_chunk_slots.chunk_slots(*placed)),
                 reference_ms=do_bench(lambda: dynsplit_reference.chunk_slots(*args)))]


def check_chunk_refresh(gen, batch: int = 16, context: int = 32768) -> list[dict]:
    """DynSplit-KV's per-layer refresh of two chunk summaries from the last 31 slots of each row (chunk_size 16,
    max_deviation 14), read through page tables from a pool of 16 x 32k tokens. Min / max: exact."""
    from triton.testing import do_bench

    pages = batch * context // PAGE
    k_flat = torch.randn(pages * PAGE, HK, D, device="cuda", generator=gen).to(torch.bfloat16)
    tables = torch.randperm(pages, device="cuda", generator=gen).view(batch, -1)
    n = torch.full((batch,), context, device="cuda")
    first = n - torch.randint(1, 31, (batch,), device="cuda", generator=gen)
    split = torch.where(torch.arange(batch, device="cuda") % 2 == 0, n, first + 1)  # half the rows closed a chunk
    targets = torch.randperm(batch * 4, device="cuda", generator=gen)[: 2 * batch].view(batch, 2) + 1
    want = [torch.zeros(batch * 4 + 1, HK, D, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    got = [t.clone() for t in want]
    args = (k_flat, tables, PAGE, first, split, n, targets, 31)
    dynsplit_reference.chunk_refresh(*args, *want)
    triton_chunk_refresh.chunk_refresh(*args, *got)
    exact = all(torch.equal(a, b) for a, b in zip(want, got))
    return [dict(kernel="chunk_refresh", batch=batch, err=0.0 if exact else float("inf"),
                 triton_ms=do_bench(lambda: triton_chunk_refresh.chunk_refresh(*args, *got)),
                 reference_ms=do_bench(lambda: dynsplit_reference.chunk_refresh(*args, *want)))]


def check_chunk_best(gen, bandwidth: float, batch: int = 16, context: int = 32768) -> list[dict]:
    """DynSplit-KV's score="tokens" for one layer at 32k: each chunk's best group-mean query . key (chunks of 2-30
    slots, the forced 16 recent slots out of range), keys read through the page tables. Float sums in another order:
    relative error. Floor: the K bytes it must read."""
    from triton.testing import do_bench

    k_pool, _, tables = pool(context, batch, gen)
    q = torch.randn(batch, H, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    lengths = torch.randint(2, 31, (batch, context // 2), device="cuda", generator=gen)
    starts = F.pad(lengths.cumsum(1), (1, 0))[:, :-1]
    chunks = int((starts < context).sum(1).max()) + 64
    chunk_of = (torch.searchsorted(starts.contiguous(), torch.arange(context, device="cuda").expand(batch, -1)
                                   .contiguous(), right=True) - 1).int()
    lo, hi = torch.zeros(batch, dtype=torch.long, device="cuda"), torch.full((batch,), context - 16, device="cuda")
    args = (q, k_pool, tables, chunk_of, lo, hi, chunks, "mean")
    want, got = dynsplit_reference.chunk_best(*args), triton_chunk_best.chunk_best(*args)
    finite = want.isfinite()
    err = rel_err(got[finite], want[finite]) if torch.equal(finite, got.isfinite()) else float("inf")
    key_bytes = batch * context * HK * D * 2
    return [dict(kernel="chunk_best", batch=batch, context=context, chunks=chunks, err=err,
                 triton_ms=do_bench(lambda: triton_chunk_best.chunk_best(*args)),
                 reference_ms=do_bench(lambda: dynsplit_reference.chunk_best(*args)),
                 floor_ms=1e3 * key_bytes / bandwidth)]


def check_slot_stamps(gen, batch: int = 16, context: int = 32768) -> list[dict]:
    """DynSplit-KV's reuse counting for one layer at budget 2048: each row's 2048 attended slots per KV head (sorted,
    distinct, out of 32k) through page tables of a pool of 16 x 32k tokens. Integers: they must agree exactly."""
    from triton.testing import do_bench

    pages = batch * context // PAGE + 1
    tables = (torch.randperm(pages - 1, device="cuda", generator=gen) + 1).view(batch, -1)  # page 0: scratch
    slots = torch.sort(torch.rand(batch, HK, context, device="cuda", generator=gen).argsort(-1)[..., :2048],
                       dim=-1).values
    lengths = torch.full((batch, HK), 2048, device="cuda")
    n = torch.full((batch,), context, device="cuda")
    step, first, rows = torch.full_like(n, 9), torch.zeros_like(n), torch.arange(1, batch + 1, device="cuda")
    stamps = torch.randint(7, 9, (pages * PAGE, HK), device="cuda", generator=gen, dtype=torch.int32)
    reuse = torch.zeros(batch + 1, 2, dtype=torch.long, device="cuda")
    want, got = [stamps.clone(), reuse.clone()], [stamps.clone(), reuse.clone()]
    args = (tables, PAGE, slots, lengths, n - 1, step, first)
    dynsplit_reference.slot_stamps(want[0], *args, want[1], rows, 0)
    triton_slot_stamps.slot_stamps(got[0], *args, got[1], rows, 0)
    exact = torch.equal(want[0][PAGE:], got[0][PAGE:]) and torch.equal(want[1], got[1])
    return [dict(kernel="slot_stamps", batch=batch, err=0.0 if exact else float("inf"),
                 triton_ms=do_bench(lambda: triton_slot_stamps.slot_stamps(got[0], *args, got[1], rows, 0)),
                 reference_ms=do_bench(lambda: dynsplit_reference.slot_stamps(want[0], *args, want[1], rows, 0)))]


def check_plan_slots(gen, batch: int = 32, kept: int = 11) -> list[dict]:
    """CHESS's step slots (`plan_slots`) compiled by torch.compile against the same function run eagerly: integers,
    so they must agree exactly; device times of both captured in CUDA graphs."""
    from semkv.methods.chess.method import plan_slots, plan_slots_function

    n = torch.randint(20000, 40000, (batch,), device="cuda", generator=gen)
    start = n // 32 - 2
    pages = torch.stack([torch.randperm(600, device="cuda", generator=gen)[:kept] + 1 for _ in range(batch)])
    pages[::3, kept // 2 :] = -1  # rows with fewer kept pages
    args = (n, start, pages, 0.01, 32, 330)
    compiled = plan_slots_function(n.device)
    want, got = plan_slots(*args), compiled(*args)
    exact = all(torch.equal(a, b) for a, b in zip(want, got))

    def graphed(fn):
        fn(*args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(*args)
        return graph.replay

    from triton.testing import do_bench

    return [dict(kernel="plan_slots", err=0.0 if exact else float("inf"), compiled_ms=do_bench(graphed(compiled)),
                 eager_ms=do_bench(graphed(plan_slots)))]


def check_soft_vote(gen) -> list[dict]:
    """TokenSelect's prefill vote (a 512-query chunk's mean query over 1M candidates, 28 heads): the Triton soft
    vote against torch's softmax summed over the heads, and the top-2048 it leads to."""
    from triton.testing import do_bench

    from semkv.methods.tokenselect import triton_soft_vote

    scores = torch.randn(28, 2**20, device="cuda", generator=gen) * 3
    want = torch.softmax(scores, -1).sum(0, keepdim=True)
    got = triton_soft_vote.soft_vote(scores)
    same_top = torch.equal(got.topk(2048).indices.sort().values, want.topk(2048).indices.sort().values)
    return [dict(kernel="soft_vote", err=rel_err(got, want), same_top=same_top,
                 triton_ms=do_bench(lambda: triton_soft_vote.soft_vote(scores), return_mode="median"),
                 reference_ms=do_bench(lambda: torch.softmax(scores, -1).sum(0, keepdim=True),
                                       return_mode="median"))]


def check_prefill_context(gen) -> list[dict]:
    """TokenSelect's sparse-prefill selection at the paper's Figure-7 shape (28 heads, 4 KV heads, a chunk's mean
    query over 1M earlier tokens, budget 2688: 128 initial + 2048 picked + 512 recent): the fused path against the
    same steps on their own kernels (paged dot product, soft vote, top-k, sort, concatenation). Integers: they must
    agree exactly."""
    from triton.testing import do_bench

    from semkv.methods.tokenselect import kernels as tokenselect_kernels
    from semkv.methods.tokenselect import reference as tokenselect_reference
    from semkv.methods.tokenselect import triton_soft_vote

    heads, kv_heads, n, sink, k, recent = 28, 4, 2**20, 128, 2048, 512
    pages = n // PAGE
    k_pool = torch.randn(pages, PAGE, kv_heads, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    table = torch.randperm(pages, device="cuda", generator=gen).int()
    q = torch.randn(heads, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    hi = n - recent

    def steps():
        top = tokenselect_kernels.top_slots(q, k_pool, table, sink, hi, k, "soft_vote", None)
        return tokenselect_reference.around(top, sink, hi, n)

    def fused():
        return triton_soft_vote.prefill_context(q, k_pool, table, sink, hi, n, k)

    exact = torch.equal(fused(), steps())
    return [dict(kernel="prefill_context", err=0.0 if exact else float("inf"),
                 triton_ms=do_bench(fused, return_mode="median"), reference_ms=do_bench(steps, return_mode="median"))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Prints one table; exit code 1 on a "
                                     "mismatch or without a CUDA device.")
    parser.add_argument("--prefill-only", action="store_true", help="check the prefill attention paths alone")
    parser.add_argument("--attention-only", action="store_true", help="check the decode and prefill attention alone")
    parser.add_argument("--decode-only", action="store_true",
                        help="check the decode attention alone (the Triton kernel and FlashAttention 3's path)")
    parser.add_argument("--window-only", action="store_true", help="check the window's attention mass alone")
    parser.add_argument("--tokenselect-only", action="store_true",
                        help="check TokenSelect's decode selection alone (exact keys and score_keys='pages')")
    parser.add_argument("--page-bound-sweep", action="store_true",
                        help="time page_bound's launch settings at Qwen2.5-0.5B's and Llama-3.1-8B's shapes alone")
    parser.add_argument("--buckets-only", action="store_true",
                        help="check SentenceKV's and DynSplit-KV's ranking and slot-list kernels alone")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = measured_bandwidth(torch.device("cuda"))
    if args.prefill_only:
        rows = check_prefill(gen) + check_packed_prefill(gen)
    elif args.decode_only:
        rows = check_decode(gen, bandwidth)
    elif args.attention_only:
        rows = check_decode(gen, bandwidth) + check_prefill(gen) + check_packed_prefill(gen)
    elif args.window_only:
        rows = check_window_mass(gen)
    elif args.tokenselect_only:
        rows = check_token_select(gen, bandwidth)
    elif args.page_bound_sweep:
        rows = sweep_page_bound(gen, bandwidth)
    elif args.buckets_only:
        rows = (check_sentence_slots(gen) + check_bucket_best(gen, bandwidth) + check_bucket_take(gen)
                + check_chunk_slots(gen) + check_chunk_best(gen, bandwidth))
    else:
        rows = (check_decode(gen, bandwidth) + check_prefill(gen) + check_packed_prefill(gen) + check_fused(gen)
                + check_summary(gen, bandwidth)
                + check_page_bound(gen, bandwidth) + check_accumulate(gen) + check_prompt_sums(gen)
                + check_block_slots(gen) + check_sentence_slots(gen) + check_bucket_best(gen, bandwidth)
                + check_bucket_take(gen) + check_chunk_slots(gen) + check_chunk_refresh(gen) + check_slot_stamps(gen)
                + check_chunk_best(gen, bandwidth) + check_plan_slots(gen) + check_working_set(gen)
                + check_token_select(gen, bandwidth) + check_soft_vote(gen) + check_prefill_context(gen)
                + check_window_mass(gen))
    print(json.dumps(dict(device=torch.cuda.get_device_name(), bandwidth_gbs=bandwidth / 1e9, rows=rows), indent=1))
    bad = [r for r in rows if not all(e < 2e-2 for key, e in r.items() if key.startswith("err"))]
    print("| kernel | shape | error | triton ms | reference ms | note |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["kernel"] == "decode":
            print(f"| decode | B={r['batch']} ctx={r['context']} {r['heads']}/{r['kv_heads']}x{r['head_dim']} | "
                  f"{r['err_full']:.1e} / {r['err_selected']:.1e} | "
                  f"{r['triton_ms']:.3f} | {r['reference_ms']:.3f} | floor {r['floor_ms']:.3f} ms, "
                  f"1% list {r['selected_1pct_ms']:.3f} ms"
                  + (f", FlashAttention 3 {r['fa3_ms']:.3f} ms ({r['err_fa3']:.1e})" if "fa3_ms" in r else "") + " |")
        elif r["kernel"] == "summary_dots":
            print(f"| summary_dots | B={r['batch']} pages={r['pages']} x 32 layers | {r['err']:.1e} | "
                  f"{r['triton_ms']:.3f} | {r['reference_ms']:.3f} | floor {r['floor_ms']:.3f} ms |")
        elif r["kernel"] == "page_bound":
            print(f"| Quest page_bound (one layer) | B={r['batch']} pages={r['pages']} | {r['err']:.1e} | "
                  f"{r['triton_ms']:.3f} | {r['reference_ms']:.3f} | floor {r['floor_ms']:.3f} ms |")
        elif r["kernel"] == "page_bound_sweep":
            print(f"| page_bound {r['shape']} | B={r['batch']} {r['tables']}, block_w={r['block_w']} "
                  f"warps={r['num_warps']} | {r['err']:.1e} | "
                  f"{r['triton_ms']:.3f} | - | {r['triton_ms'] / r['floor_ms']:.2f}x floor {r['floor_ms']:.3f} ms |")
        elif r["kernel"] == "page_slots":
            print(exact_row("Quest page_slots (one layer)", f"B={r['batch']} k=129 pages", r))
        elif r["kernel"] == "token_select":
            print(f"| TokenSelect token_select (one layer) | B={r['batch']} ctx={r['context']} | {r['err']:.1e} "
                  f"(top-k slots that differ) | miss {r['miss_ms']:.3f} / hit {r['hit_ms']:.3f} | - | "
                  f"floor of a miss {r['floor_ms']:.3f} ms |")
        elif r["kernel"] == "token_select_pages":
            print(f"| TokenSelect token_select, score_keys=\"pages\" (bound + {r['pages']} pages) | B={r['batch']} "
                  f"ctx={r['context']} | {r['err']:.1e} | miss {r['miss_ms']:.3f} | - | exact top-k kept "
                  f"{r['exact_kept']:.3f}; floor {r['floor_ms']:.3f} ms |")
        elif r["kernel"] == "plan_slots":
            print(f"| CHESS plan_slots (torch.compile) | B=32 | {'exact' if r['err'] == 0 else 'DIFFERS'} | "
                  f"{r['compiled_ms']:.4f} | {r['eager_ms']:.4f} | both in a CUDA graph |")
        elif r["kernel"] == "block_slots":
            print(exact_row("InfLLM block_slots (one layer)", f"B={r['batch']} S={r['shared']} budget 2048", r))
        elif r["kernel"] == "sentence_slots":
            print(exact_row("SentenceKV sentence_slots (one layer)",
                            f"B={r['batch']} x {r['tokens']} tokens, budget 2048", r))
        elif r["kernel"] == "bucket_take":
            print(exact_row(f"bucket_take ({r['bits']} bits a step, one layer)",
                            f"B={r['batch']} x {r['buckets']} buckets, budget 1984", r))
        elif r["kernel"] == "working_set":
            print(f"| working_set (offload, one layer) | B={r['batch']} x {r['cache']} slots per KV head | "
                  f"{'exact' if r['err'] == 0 else 'DIFFERS'} | 10% missing {r['miss_ms']:.3f} / all found "
                  f"{r['hit_ms']:.3f} | - | {r['moved_mb']:.1f} MiB from host at 10% missing |")
        elif r["kernel"] == "slot_stamps":
            print(exact_row("DynSplit-KV slot_stamps (one layer)", f"B={r['batch']} x 2048 slots per KV head", r))
        elif r["kernel"] == "chunk_best":
            print(f"| DynSplit-KV chunk_best (score=\"tokens\", one layer) | B={r['batch']} ctx={r['context']} "
                  f"x {r['chunks']} chunks | {r['err']:.1e} | {r['triton_ms']:.3f} | {r['reference_ms']:.3f} | "
                  f"floor {r['floor_ms']:.3f} ms |")
        elif r["kernel"] == "chunk_refresh":
            print(exact_row("DynSplit-KV chunk_refresh (one layer)", f"B={r['batch']}, 2 chunks, 31 slots", r))
        elif r["kernel"] == "chunk_slots":
            print(exact_row("DynSplit-KV chunk_slots (one layer)",
                            f"B={r['batch']} x {r['chunks']} chunks ({r['context']} positions), budget 2048", r))
        elif r["kernel"] == "accumulate_attention":
            print(f"| H2O accumulate_attention (one layer) | B={r['batch']} x {r['width']} slots | {r['err']:.1e} | "
                  f"{r['triton_ms']:.4f} | {r['reference_ms']:.4f} | - |")
        elif r["kernel"] == "prompt_attention_sums":
            print(f"| H2O prompt_attention_sums (one layer) | {r['chunk']} queries x {r['context']} keys | "
                  f"{r['err']:.1e} | {r['triton_ms']:.3f} | {r['reference_ms']:.3f} | "
                  f"{r['triton_tflops']:.0f} TFLOP/s |")
        elif r["kernel"] == "soft_vote":
            print(f"| TokenSelect soft_vote (prefill) | 28 heads x 1M candidates | {r['err']:.1e} (top-2048 "
                  f"{'equal' if r['same_top'] else 'DIFFERS'}) | {r['triton_ms']:.3f} | {r['reference_ms']:.3f} | - |")
        elif r["kernel"] == "prefill_context":
            print(f"| TokenSelect prefill_context (fused) | 28 heads x 1M candidates, 2688 slots | "
                  f"{'exact' if r['err'] == 0 else 'DIFFERS'} | {r['triton_ms']:.3f} | {r['reference_ms']:.3f} | "
                  "reference: the same steps on their own kernels |")
        elif r["kernel"] == "window_mass":
            print(f"| window_mass (prefill eviction's scores, one layer) | {r['window']} queries x {r['context']} "
                  f"keys {r['heads']}/{r['kv_heads']}x{r['head_dim']} | {r['err']:.1e} (torch in bfloat16: "
                  f"{r['torch_err']:.1e}) | {r['triton_ms']:.3f} | {r['torch_ms']:.3f} (torch) | - |")
        elif r["kernel"] == "packed_prefill":
            print(f"| prefill, {r['chunks']} chunks in one call (FlashAttention 3, {r['path']}) | {r['tokens']} tokens "
                  f"14/2x64 | {r['err']:.1e} | {r['triton_ms']:.3f} | - | each: one call a chunk |")
        elif r["kernel"] != "prefill":
            print(f"| {r['kernel']} | - | {r['err']:.1e} | - | - | - |")
        else:
            print(f"| prefill ({r.get('path', 'triton')}) | start={r['start']} chunk={r['chunk']} "
                  f"{r['heads']}/{r['kv_heads']}x{r['head_dim']} | {r['err']:.1e} | "
                  f"{r['triton_ms']:.3f} | "
                  f"{r['reference_ms']:.3f} | {r['triton_tflops']:.0f} TFLOP/s |")
    print("ALL KERNELS MATCH" if not bad else f"MISMATCH in {len(bad)} rows")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
