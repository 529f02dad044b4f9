"""Attention-only time of one prefill chunk: TokenSelect's selective attention vs full attention, over KV lengths,
the shape of the paper's Figure 7 (Qwen2-7B-Instruct: 28 heads, 4 KV heads, head_dim 128; chunk 512; random data).

One layer's paged cache holds `kv_len` earlier tokens (random keys/values, shuffled page table) plus the chunk.
- full_sdpa: torch SDPA over contiguous K/V of all kv_len + chunk tokens with the bottom-right causal mask (the
  flash / memory-efficient kernels on CUDA): the stand-in for the paper's FlashInfer baseline.
- full_paged: semkv's own full attention kernel over the paged cache (`kernels.prefill_attention` with every earlier
  slot: the Triton kernel on CUDA), what the engine runs for Full KV.
- tokenselect: the method's own `prefill_context` (paged dot product of the chunk's mean query, head soft vote,
  top-k; the Triton kernel on CUDA) then `kernels.prefill_attention` over initial + top-k + recent + the chunk.
  Reported as selection, attention and total; speedups = full_paged / tokenselect total (against our kernel) and
  full_sdpa / tokenselect total.

Two timings of each: a single call between CUDA events, then waiting for it (`*_ms`: a call of ~20 kernels then
includes the host's launch gaps, which the GPU waits through), and a stream of calls issued back to back, as a prefill
issues one layer's attention after the last one's without waiting (`*_stream_ms`: GPU time per call; `host_ms`: the
host's time to issue one call, which bounds it from below when larger). Speedups are given for both.

    python benchmarks/studies/tokenselect_attention.py --out tokenselect_attention.json      # CUDA, 8k..1M
    python benchmarks/studies/tokenselect_attention.py --smoke                               # CPU, tiny sizes
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from tokenselect_kernels import HEAD_DIM, HEADS, KV_HEADS, time_ms  # benchmarks/ is on the path when run as a script

from semkv.engine.kv_cache import KVPool, SeqKV
from semkv.engine.sequence import SamplingParams, Sequence
from semkv import kernels
from semkv.methods import TokenSelect


def or_oom(fn):
    """fn() or None when the device runs out of memory (the paged full path at the longest lengths)."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def stream_ms(fn, repeats: int, rounds: int = 5) -> tuple[float, float]:
    """(GPU ms per call, host ms to issue one call) over `repeats` calls issued back to back, the median of `rounds`."""
    fn()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        issued = time.perf_counter()
        for _ in range(repeats):
            fn()
        host.append((time.perf_counter() - issued) * 1000 / repeats)
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) / repeats)
    return sorted(gpu)[rounds // 2], sorted(host)[rounds // 2]


def paged_sequence(kv_len: int, chunk: int, page_size: int, device: str, dtype: torch.dtype) -> Sequence:
    """A one-layer sequence whose cache holds kv_len + chunk random tokens behind a shuffled page table."""
    n = kv_len + chunk
    pool = KVPool(1, KV_HEADS, HEAD_DIM, page_size, dtype, torch.device(device), num_pages=-(-n // page_size))
    pool.k.normal_()
    pool.v.normal_()
    seq = Sequence(0, [0] * n, SamplingParams(), SeqKV(pool))
    seq.kv.ensure_slots(0, n)
    pages = seq.kv.table.shape[1]
    seq.kv.table[0, :pages] = seq.kv.table[0, torch.randperm(pages, device=device)]
    seq.kv.num_slots[0] = n
    seq.num_computed = n
    return seq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+",
                        default=[8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576])
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--budget", type=int, default=2688, help="128 initial + 2048 top-k + 512 recent")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--skip-paged-full", action="store_true", help="leave out full_paged (slow at 1M)")
    parser.add_argument("--smoke", action="store_true", help="CPU, float32, kv lengths 1k and 2k, chunk 64")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if args.smoke:
        args.lengths, args.chunk, args.budget, args.repeats = [1024, 2048], 64, 256, 2
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    scale = HEAD_DIM**-0.5
    method = TokenSelect(budget=args.budget)
    rows = []
    print(f"{'kv_len':>8} {'full_sdpa':>10} {'full_paged':>11} {'select':>8} {'attend':>8} {'tokensel':>9} "
          f"{'vs sdpa':>8} {'vs paged':>8}   (ms)")
    for kv_len in args.lengths:
        seq = paged_sequence(kv_len, args.chunk, args.page_size, device, dtype)
        pool, table = seq.kv.pool, seq.kv.table[0]
        q = torch.randn(args.chunk, HEADS, HEAD_DIM, device=device, dtype=dtype)
        n = kv_len + args.chunk
        k_all, v_all, _ = seq.kv.gather(0, seq.kv.all_slots(0))  # contiguous [kv_heads, n, D], the baseline's layout
        causal = causal_lower_right(args.chunk, n)
        qt = q.transpose(0, 1)[None]

        def full_sdpa():
            return F.scaled_dot_product_attention(qt, k_all[None], v_all[None], attn_mask=causal, scale=scale,
                                                  enable_gqa=True)

        try:
            full_sdpa()
            gqa = "native"
        except RuntimeError:  # no GQA in the kernel that takes this mask: repeat K/V per query head
            k_all, v_all = (x.repeat_interleave(HEADS // KV_HEADS, dim=0) for x in (k_all, v_all))
            gqa = "repeated"

        def select():
            return method.prefill_context(0, seq, q, kv_len)

        context = select()
        if kv_len == args.lengths[0]:  # the two full paths agree (mask alignment, GQA)
            paged_out = kernels.prefill_attention(q, pool.k, pool.v, table, kv_len, None, scale)
            torch.testing.assert_close(full_sdpa()[0].transpose(0, 1), paged_out, rtol=2e-2, atol=2e-2)
        full = time_ms(full_sdpa, device, args.repeats)
        paged = None if args.skip_paged_full else or_oom(lambda: time_ms(
            lambda: kernels.prefill_attention(q, pool.k, pool.v, table, kv_len, None, scale), device, args.repeats))
        selecting = time_ms(select, device, args.repeats)
        attending = time_ms(lambda: kernels.prefill_attention(q, pool.k, pool.v, table, kv_len, context, scale),
                            device, args.repeats)
        total = selecting + attending
        row = dict(kv_len=kv_len, full_sdpa_ms=full, sdpa_gqa=gqa, full_paged_ms=paged, select_ms=selecting,
                   attend_ms=attending, tokenselect_ms=total, attended=context.shape[1] + args.chunk,
                   speedup_vs_sdpa=full / total, speedup_vs_paged=None if paged is None else paged / total)
        paged_text = "-" if paged is None else f"{paged:.2f}"
        vs_paged = "-" if paged is None else f"{paged / total:.2f}x"
        print(f"{kv_len:>8} {full:>10.2f} {paged_text:>11} {selecting:>8.2f} {attending:>8.2f} {total:>9.2f} "
              f"{full / total:>7.2f}x {vs_paged:>8}")
        if device == "cuda":
            sdpa_stream, sdpa_host = stream_ms(full_sdpa, args.repeats)
            chunk_stream, chunk_host = stream_ms(lambda: kernels.prefill_attention(q, pool.k, pool.v, table, kv_len,
                                                                                   select(), scale), args.repeats)
            row.update(full_sdpa_stream_ms=sdpa_stream, sdpa_host_ms=sdpa_host, tokenselect_stream_ms=chunk_stream,
                       tokenselect_host_ms=chunk_host, speedup_vs_sdpa_stream=sdpa_stream / chunk_stream)
            print(f"{'':>8} stream: sdpa {sdpa_stream:.2f} ms, tokenselect {chunk_stream:.3f} ms (host issues it in "
                  f"{chunk_host:.3f} ms): {sdpa_stream / chunk_stream:.2f}x")
        rows.append(row)
        del seq, pool, table, k_all, v_all
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        with open(args.out, "w") as f:
            json.dump(dict(device=name, dtype=str(dtype), chunk=args.chunk, budget=args.budget,
                           page_size=args.page_size, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, rows=rows),
                      f, indent=1)


if __name__ == "__main__":
    main()
