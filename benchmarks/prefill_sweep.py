"""Prefill attention tiles and context splits on the GPU, against torch SDPA (flash and cuDNN) on contiguous K/V, and
H2O's column-sum pass, on random data. Picks `triton_prefill.TILE`; writes rows as JSON.

semkv_before: the kernel of commit 19133a3, where .gpu/orig holds that tree.

Shapes: Llama-3.1-8B attention (32 heads, 8 KV heads) for an 8k chunk after 0, 24k and 120k tokens; the TokenSelect
paper's Figure-7 shape (28 heads, 4 KV heads) for a 512-query chunk after 1M tokens.

    python benchmarks/prefill_sweep.py --out prefill_sweep.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from triton.testing import do_bench

from semkv.kernels import triton_prefill
from semkv.methods.h2o import triton_attention_scores

D = 128
TILES = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3),
         (64, 128, 8, 2)]


def paged(n: int, kv_heads: int, page: int = 16):
    pages = -(-n // page)
    k = torch.randn(pages, page, kv_heads, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(pages, page, kv_heads, D, device="cuda", dtype=torch.bfloat16)
    return k, v, torch.randperm(pages, device="cuda", dtype=torch.int32)


def contiguous(k, v, table, n):
    page = k.shape[1]
    rows = (table.long()[torch.arange(n, device="cuda") // page] * page + torch.arange(n, device="cuda") % page)
    kv_heads = k.shape[2]
    return (x.view(-1, kv_heads, D)[rows].transpose(0, 1)[None].contiguous() for x in (k, v))  # [1, KH, n, D]


def ms(fn) -> float:
    return do_bench(fn, warmup=5, rep=40, return_mode="median")


def attention_point(heads: int, kv_heads: int, start: int, chunk: int, splits_list) -> list[dict]:
    n = start + chunk
    k, v, table = paged(n, kv_heads)
    q = torch.randn(chunk, heads, D, device="cuda", dtype=torch.bfloat16)
    scale = D**-0.5
    flops = 4 * heads * D * chunk * (start + (chunk + 1) / 2)
    kc, vc = contiguous(k, v, table, n)
    qt = q.transpose(0, 1)[None]
    rows = []
    base = dict(heads=heads, kv_heads=kv_heads, start=start, chunk=chunk)
    want = None
    for backend, name in [(SDPBackend.FLASH_ATTENTION, "sdpa_flash"), (SDPBackend.CUDNN_ATTENTION, "sdpa_cudnn"),
                          (SDPBackend.EFFICIENT_ATTENTION, "sdpa_efficient")]:
        for gqa in (True, False):
            kk, vv = (kc, vc) if gqa else (x.repeat_interleave(heads // kv_heads, 1) for x in (kc, vc))

            def run():
                with sdpa_kernel(backend):
                    if start == 0:
                        return F.scaled_dot_product_attention(qt, kk, vv, is_causal=True, scale=scale,
                                                              enable_gqa=gqa)
                    return F.scaled_dot_product_attention(qt, kk, vv, attn_mask=causal_lower_right(chunk, n),
                                                          scale=scale, enable_gqa=gqa)
            try:
                out = run()
            except Exception as exc:  # the backend does not take this input
                rows.append(dict(base, kernel=name, gqa=gqa, error=str(exc).splitlines()[0][:160]))
                continue
            if want is None:
                want = out[0].transpose(0, 1).float()
            t = ms(run)
            rows.append(dict(base, kernel=name, gqa=gqa, ms=t, tflops=flops / t / 1e9,
                             err=float((out[0].transpose(0, 1).float() - want).abs().max())))
            break
    for tile in TILES:
        for splits in splits_list:
            try:
                fn = lambda: triton_prefill.prefill_attention(q, k, v, table, start, None, scale, tile=tile,  # noqa
                                                              splits=splits)
                out = fn()
                t = ms(fn)
            except Exception as exc:
                rows.append(dict(base, kernel="semkv", tile=tile, splits=splits, error=str(exc)[:160]))
                continue
            err = float((out.float() - want).abs().max()) if want is not None else None
            rows.append(dict(base, kernel="semkv", tile=tile, splits=splits, ms=t, tflops=flops / t / 1e9, err=err))
    auto = lambda: triton_prefill.prefill_attention(q, k, v, table, start, None, scale)  # noqa: E731
    auto()
    rows.append(dict(base, kernel="semkv_default", ms=ms(auto), tflops=flops / ms(auto) / 1e9))
    try:
        import importlib.util
        spec = importlib.util.spec_from_file_location("old_prefill", ".gpu/orig/semkv/kernels/triton_prefill.py")
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        fn = lambda: old.prefill_attention(q, k, v, table, start, None, scale)  # noqa: E731
        fn()
        t = ms(fn)
        rows.append(dict(base, kernel="semkv_before", ms=t, tflops=flops / t / 1e9))
    except Exception as exc:
        rows.append(dict(base, kernel="semkv_before", error=str(exc)[:160]))
    # H2O's column sums from the prefill's log-sum-exps
    if heads == 32:
        _, lse = triton_prefill.prefill_attention(q, k, v, table, start, None, scale, lse=True)
        for bm, bn, w in [(64, 128, 8), (64, 64, 4), (128, 128, 8), (64, 128, 4), (32, 128, 4)]:
            def fn():
                return triton_attention_scores.prompt_attention_sums(q, k, table, start, scale, lse, block_m=bm,
                                                                     block_n=bn, num_warps=w)
            try:
                fn()
                t = ms(fn)
                rows.append(dict(base, kernel="h2o_column_sums", tile=(bm, bn, w), ms=t, tflops=flops / 2 / t / 1e9))
            except Exception as exc:
                rows.append(dict(base, kernel="h2o_column_sums", tile=(bm, bn, w), error=str(exc)[:160]))
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def gemm_tflops() -> float:
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
    t = ms(lambda: a @ b)
    return 2 * 8192 * 4096 * 14336 / t / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rows = [dict(kernel="gemm", device=torch.cuda.get_device_name(), tflops=gemm_tflops())]
    print(json.dumps(rows[0]), flush=True)
    points = [(32, 8, 0, 8192, [1]), (32, 8, 24576, 8192, [1]), (32, 8, 122880, 8192, [1]),
              (32, 8, 31744, 1024, [1, 2]), (28, 4, 2**20, 512, [1, 2, 3, 4, 6])]
    for heads, kv_heads, start, chunk, splits in points[:2] if args.quick else points:
        rows += attention_point(heads, kv_heads, start, chunk, splits)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
