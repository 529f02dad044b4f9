"""TokenSelect's paged dot-product kernel (Algorithm 2) vs the gather-then-matmul path, on random paged caches.

For every KV length and page size: a key pool of that many slots with a shuffled page table, one query per head
(Qwen2-7B's attention: 28 heads, 4 KV heads, head_dim 128), candidate slots = all of them. Checks the Triton kernel
against the torch reference (`semkv.kernels.reference.paged_dot`), then times the kernel, the gather-then-matmul path
in the pool's dtype (gather the keys into a contiguous copy, one batched matmul) and the float32 reference.

    python benchmarks/studies/tokenselect_kernels.py                  # CUDA; writes nothing unless --out
    python benchmarks/studies/tokenselect_kernels.py --smoke          # CPU, Triton interpreter, tiny sizes (runs anywhere)
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128  # Qwen2-7B-Instruct


def random_paged_keys(n: int, page_size: int, device: str, dtype: torch.dtype, seed: int = 0):
    """A pool of ceil(n / page_size) pages [pages, page_size, KV_HEADS, D] and a shuffled page table [pages]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = -(-n // page_size)
    k_pool = torch.randn(pages, page_size, KV_HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)
    table = torch.randperm(pages, generator=gen, device=device)
    return k_pool, table


def time_ms(fn, device: str, repeats: int) -> float:
    """Median wall time of fn() in milliseconds (CUDA events on the GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1000)
    return sorted(times)[len(times) // 2]


def gather_then_matmul(q, k_pool, table, slots):
    """The path the kernel replaces: copy the indexed keys out of the pool, then one matmul per KV group."""
    page_size = k_pool.shape[1]
    rows = table[slots // page_size] * page_size + slots % page_size
    keys = k_pool.view(-1, KV_HEADS, HEAD_DIM)[rows].permute(1, 2, 0)  # [kv_heads, D, n] contiguous copy below
    grouped = q.view(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    return torch.bmm(grouped, keys.contiguous()).view(HEADS, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072, 524288, 1048576])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny lengths")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # must be set before the kernel module is imported
        args.lengths, args.repeats = [256, 1024], 2
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    from semkv.kernels import reference
    from semkv.kernels.triton_paged_dot import paged_dot

    rows = []
    print(f"{'page':>5} {'kv_len':>8} {'max_err':>9} {'kernel_ms':>10} {'gather_mm_ms':>13} {'ref_fp32_ms':>12} "
          f"{'speedup':>8}")
    for page_size in args.page_sizes:
        for n in args.lengths:
            k_pool, table = random_paged_keys(n, page_size, device, dtype)
            q = torch.randn(HEADS, HEAD_DIM, device=device, dtype=dtype)
            slots = torch.arange(n, device=device)
            expected = reference.paged_dot(q, k_pool, table, slots)
            got = paged_dot(q, k_pool, table, slots)
            err = float((got - expected).abs().max() / expected.abs().max())
            tolerance = dict(rtol=1e-2, atol=1e-2 * float(expected.abs().max()))
            torch.testing.assert_close(got, expected, **tolerance)
            torch.testing.assert_close(gather_then_matmul(q, k_pool, table, slots).float(), expected, **tolerance)
            kernel = time_ms(lambda: paged_dot(q, k_pool, table, slots), device, args.repeats)
            gathered = time_ms(lambda: gather_then_matmul(q, k_pool, table, slots), device, args.repeats)
            ref = time_ms(lambda: reference.paged_dot(q, k_pool, table, slots), device, args.repeats)
            rows.append(dict(page_size=page_size, kv_len=n, max_rel_err=err, kernel_ms=kernel,
                             gather_matmul_ms=gathered, reference_fp32_ms=ref, speedup=gathered / kernel))
            print(f"{page_size:>5} {n:>8} {err:>9.2e} {kernel:>10.3f} {gathered:>13.3f} {ref:>12.3f} "
                  f"{gathered / kernel:>7.2f}x")
            del k_pool, table
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=device_name, dtype=str(dtype), heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
