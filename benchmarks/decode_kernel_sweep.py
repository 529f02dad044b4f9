"""Launch settings of the decode kernels that read the paged cache, swept against their byte floors on random paged
caches of two real shapes: decode attention (`kernels.triton_decode._partial`, over per-head slot lists and over
every slot), TokenSelect's scoring of every candidate key on a Selection Cache miss
(`methods/tokenselect/triton_token_select._vote_scores`, from the exact keys and from the int8 key sketch) and
DynSplit-KV's best token of each chunk (`methods/dynsplit/triton_chunk_best`).

TokenSelect's decode step attends to ~2688 tokens per KV head scattered over a 32k context, so the kernel gathers one
K row and one V row (head_dim x 2 bytes each) per selected token. This script times, per case and setting (splits,
BLOCK_N, warps, pipeline stages), the partial kernel + the split merge inside a CUDA graph (as the engine replays
them), and divides by the bytes they must read (K and V of every attended token, the slot lists) over the bandwidth
of a large device copy measured in the same run. Every setting's output is checked against the torch reference
first. Rows: Triton's defaults (the settings before the sweep), the engine's `launch_settings` / `num_splits_for`,
and the fastest settings.

    python benchmarks/decode_kernel_sweep.py                          # CUDA, every case (~4 minutes on an H200)
    python benchmarks/decode_kernel_sweep.py --only full --best 200   # cases whose name has "full", every row
    python benchmarks/decode_kernel_sweep.py --only scoring           # the scoring kernels alone
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.testing

from semkv.bench.device import measured_bandwidth
from semkv.kernels import reference, triton_decode
from semkv.methods.dynsplit.triton_chunk_best import chunk_best
from semkv.methods.state.key_sketch import quantize
from semkv.methods.tokenselect import triton_token_select

CASES = {  # name: batch, query heads, KV heads, head_dim, context, selected tokens per KV head (0: every slot)
    "llama3-8b 25x32k, 2688 selected": (25, 32, 8, 128, 32768, 2688),
    "llama3-8b 25x32k, 328 selected": (25, 32, 8, 128, 32768, 328),
    "llama3-8b 25x32k, full": (25, 32, 8, 128, 32768, 0),
    "llama3-8b 1x32k, full": (1, 32, 8, 128, 32768, 0),
    "llama3-8b 1x4k, full": (1, 32, 8, 128, 4096, 0),
    "qwen2.5-0.5b 64x32k, 2688 selected": (64, 14, 2, 64, 32768, 2688),
    "qwen2.5-0.5b 64x32k, full": (64, 14, 2, 64, 32768, 0),
}
RULES = {  # name: (warps, stages) with BLOCK_N 64 and the old split rule (two programs per SM)
    "before (Triton's defaults)": (4, 3),
    "2 warps, 4 stages": (2, 4),
}


def random_case(batch, heads, kv_heads, dim, context, selected, page=16, seed=0):
    """A shuffled paged pool holding `context` tokens per sequence, and `selected` sorted random slots per KV head
    (slots None and lengths [B, 1] = context when selected is 0)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages_per_seq = context // page
    k = torch.randn(batch * pages_per_seq, page, kv_heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tables = torch.randperm(batch * pages_per_seq, generator=gen, device="cuda").view(batch, pages_per_seq)
    tables = tables.to(torch.int32)
    q = torch.randn(batch, heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    if not selected:
        return q, k, v, tables, None, torch.full((batch, 1), context, device="cuda", dtype=torch.int32)
    scores = torch.rand(batch, kv_heads, context, generator=gen, device="cuda")
    slots = scores.topk(selected, dim=-1).indices.sort(dim=-1).values.to(torch.int32)  # [B, kv_heads, n]
    lengths = torch.full((batch, kv_heads), selected, device="cuda", dtype=torch.int32)
    return q, k, v, tables, slots, lengths


def launch(q, k, v, tables, slots, lengths, scale, splits, block_n, warps, stages):
    """`triton_decode.decode_attention` with every launch setting explicit."""
    batch, heads, dim = q.shape
    _, page, kv_heads, _ = k.shape
    group = heads // kv_heads
    out = torch.empty(batch, heads, splits, dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(batch, heads, splits, device=q.device, dtype=torch.float32)
    kf, vf = k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)
    slot_arg = slots if slots is not None else lengths
    triton_decode._partial[(batch, kv_heads, splits)](
        q, kf, vf, tables, slot_arg, lengths, out, lse,
        q.stride(0), q.stride(1), kf.stride(0), kf.stride(1), tables.stride(0), slot_arg.stride(0),
        slot_arg.stride(1) if slots is not None else 0, lengths.stride(0), lengths.stride(1), out.stride(0),
        out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), scale,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=dim, BLOCK_N=block_n, PAGE=page,
        HAS_SLOTS=slots is not None, PER_HEAD=lengths.shape[1] > 1, num_warps=warps, num_stages=stages,
    )
    final = torch.empty_like(q)
    triton_decode._combine[(batch, heads)](
        out, lse, final, lse, out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        final.stride(0), final.stride(1), splits, SPLITS_PAD=triton_decode.splits_pad(splits), D=dim, LOG2=False,
        WRITE_LSE=False,
    )
    return final


def time_us(run) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(run, rep=20)


def print_rows(title, timed, floor_us, named, best=8):
    print(f"\n{title}")
    print(f"{'us':>8} {'x floor':>8} {'splits':>7} {'block_n':>8} {'warps':>6} {'stages':>7}")
    for label, key in named + [("best", key) for key in sorted(timed, key=timed.get)[:best]]:
        if key in timed:
            print(f"{timed[key]:>8.1f} {timed[key] / floor_us:>8.2f} {key[0]:>7} {key[1]:>8} {key[2]:>6} "
                  f"{key[3]:>7}  {label}")


SCORING = {  # name: batch, query heads, KV heads, head_dim, context (the retrieving modes' 31,744 and the batches of
    # issue 55's targets: 16 rows and Full KV's largest on an H200 for the 0.5B model, 11 rows for the 8B shape)
    "qwen2.5-0.5b 16x32k": (16, 14, 2, 64, 31744),
    "qwen2.5-0.5b 334x32k": (334, 14, 2, 64, 31744),
    "llama3-8b 11x32k": (11, 32, 8, 128, 31744),
}


def sweep_scoring(bandwidth, best, sink=128, recent=512):
    """TokenSelect's `_vote_scores` with every row refreshing (a Selection Cache miss: keys of every candidate slot
    in, a float32 logit of every head out), from the exact keys and from the int8 sketch (D + 4 bytes a key), and
    DynSplit-KV's `_chunk_best` (group mean, chunks of 16 slots: the keys in, a float32 best a chunk out), each against
    its byte floor, over splits / keys a block / warps / stages."""
    for name, (batch, heads, kv_heads, dim, context) in SCORING.items():
        q, k, _, tables, _, _ = random_case(batch, heads, kv_heads, dim, context, 0)
        sketch, scales = quantize(k)  # the int8 key sketch (`methods/state/key_sketch`) and its scales
        scales = scales.view(-1, kv_heads)
        n = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        parts = torch.tensor([sink, 0, recent], device="cuda", dtype=torch.int32).repeat(batch, 1)
        refresh = torch.ones(batch, dtype=torch.int8, device="cuda")
        group = heads // kv_heads
        candidates = context - sink - recent
        scores = torch.empty(batch, heads, context, device="cuda", dtype=torch.float32)
        for keys, key_bytes in (("exact", dim * 2), ("int8", dim + 4)):
            moved = batch * candidates * (kv_heads * key_bytes + heads * 4)
            floor_us = 1e6 * moved / bandwidth
            expected, timed = None, {}
            for splits, block_n, warps, stages in itertools.product((32,), (128, 256, 512), (4, 8), (2, 3)):
                smax = torch.empty(batch, heads, splits, device="cuda", dtype=torch.float32)
                ssum = torch.empty_like(smax)
                pool, scale = (k, k) if keys == "exact" else (sketch, scales)

                def run():
                    triton_token_select._vote_scores[(kv_heads, splits, batch)](
                        q, pool, scale, tables, n, parts, refresh, scores, smax, ssum, context, tables.stride(0),
                        n.stride(0), PAGE_SIZE=k.shape[1], KV_HEADS=kv_heads, GROUP=group, DIM=dim,
                        GROUP_P=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(dim)),
                        BLOCK_N=block_n, SPLITS=splits, SOFT=True, IEEE=False, SKETCH=keys == "int8",
                        num_warps=warps, num_stages=stages)
                try:
                    run()
                except triton.runtime.errors.OutOfResources:
                    continue
                if expected is None:
                    expected = scores[:, :, sink:context - recent].clone()
                torch.testing.assert_close(scores[:, :, sink:context - recent], expected)
                timed[splits, block_n, warps, stages] = time_us(run)
            print_rows(f"{name}, TokenSelect scoring from {keys} keys on a miss: floor {floor_us:.1f} us "
                       f"({moved / 1e6:.0f} MB)", timed, floor_us, [("engine", (32, 128, 4, 2))], best)
        del scores
        chunk_of = (torch.arange(context, device="cuda", dtype=torch.int32) // 16).expand(batch, -1).contiguous()
        chunks = -(-context // 16)
        lo, hi = torch.full((batch,), sink, device="cuda"), torch.full((batch,), context - recent, device="cuda")
        moved = batch * candidates * kv_heads * (dim * 2 + 4) + batch * kv_heads * chunks * 4
        floor_us = 1e6 * moved / bandwidth
        expected, timed = None, {}
        for block_n, warps, stages in itertools.product((128, 256, 512), (4, 8), (2, 3)):
            def run():
                return chunk_best(q, k, tables, chunk_of, lo, hi, chunks, "mean", block_n=block_n, num_warps=warps,
                                  num_stages=stages)
            try:
                got = run()
            except triton.runtime.errors.OutOfResources:
                continue
            if expected is None:
                expected = got
            torch.testing.assert_close(got, expected)
            timed[0, block_n, warps, stages] = time_us(run)
        print_rows(f"{name}, DynSplit-KV chunk_best (mean): floor {floor_us:.1f} us ({moved / 1e6:.0f} MB)", timed,
                   floor_us, [("engine", (0, 128, 4, 3))], best)
        del q, k, sketch, scales, tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the cases whose name contains this text")
    parser.add_argument("--best", type=int, default=8, help="print this many of the fastest settings")
    args = parser.parse_args()
    bandwidth = measured_bandwidth(torch.device("cuda"))
    print(f"bandwidth {bandwidth / 1e9:.0f} GB/s")
    for name, (batch, heads, kv_heads, dim, context, selected) in CASES.items():
        if args.only not in name:
            continue
        q, k, v, tables, slots, lengths = random_case(batch, heads, kv_heads, dim, context, selected)
        n = selected or context
        scale = dim**-0.5
        expected = reference.decode_attention(q, k, v, tables, slots, lengths, scale)
        moved = batch * kv_heads * n * (2 * dim * 2 + (4 if selected else 0))
        floor_us = 1e6 * moved / bandwidth
        default_splits = triton_decode.num_splits_for(n, batch * kv_heads, block_n=64, longest_split=1 << 30)  # before
        timed = {}
        for splits, block_n, warps, stages in itertools.product(
                sorted({default_splits, 1, 2, 4, 8, 16, 32, 64, 128}), (64, 128), (2, 4), (2, 3, 4)):
            if splits > -(-n // block_n):
                continue
            run = lambda: launch(q, k, v, tables, slots, lengths, scale, splits, block_n, warps,  # noqa: E731
                                 stages)
            try:
                torch.testing.assert_close(run(), expected, rtol=2e-2, atol=2e-2)
            except triton.runtime.errors.OutOfResources:
                continue
            timed[splits, block_n, warps, stages] = time_us(run)
        rules = [(rule, (default_splits, 64, *setting)) for rule, setting in RULES.items()]
        gathered = slots is not None
        block_n, warps, stages = triton_decode.launch_settings(dim, 2, gathered, q.device)
        splits = triton_decode.num_splits_for(n, batch * kv_heads, triton_decode.device_limits(0)[0], block_n)
        engine = (splits, block_n, warps, stages)
        timed[engine] = time_us(lambda: triton_decode.decode_attention(q, k, v, tables, slots, lengths, scale,
                                                                       max_len=n))
        rules.append(("engine (launch_settings)", engine))
        print_rows(f"{name}: floor {floor_us:.1f} us ({moved / 1e6:.0f} MB), default splits {default_splits}", timed,
                   floor_us, rules, args.best)
        del q, k, v, tables, slots, expected
    if args.only in ("", "scoring"):
        sweep_scoring(bandwidth, args.best)


if __name__ == "__main__":
    main()
