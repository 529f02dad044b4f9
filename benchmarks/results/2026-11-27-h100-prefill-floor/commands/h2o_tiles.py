"""H2O's prompt column sums (one layer, Llama-3.1-8B shape: 32 heads, 8 KV heads, D 128) by tile, against the kernel
before this page (`--before FILE`: its module), at a 32k prompt's one chunk and at a 128k prompt's last 32k chunk.
Prints one JSON row per tile: ms, TFLOP/s of the q . k products, and the largest relative difference to the
before kernel's sums."""
import argparse
import importlib.util
import json

import torch
from triton.testing import do_bench

from semkv.kernels import triton_prefill
from semkv.methods.h2o import triton_attention_scores

H, HK, D, PAGE = 32, 8, 128, 16
parser = argparse.ArgumentParser()
parser.add_argument("--before", required=True)
parser.add_argument("--second", action="store_true", help="the second call's tiles: around the first call's best")
args = parser.parse_args()
TILES = ([(64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 2), (32, 128, 4, 3), (128, 128, 4, 3), (64, 256, 4, 3),
          (32, 64, 2, 3), (64, 128, 8, 3)] if args.second else
         [(64, 128, 8, 3), (64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3),
          (128, 64, 8, 3), (64, 128, 8, 2), (64, 256, 8, 3)])
spec = importlib.util.spec_from_file_location("before", args.before)
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)
gen = torch.Generator(device="cuda").manual_seed(0)
for start, chunk in [(0, 32768), (98304, 32768), (16384, 16384)]:
    n = start + chunk
    k = torch.randn(n // PAGE, PAGE, HK, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(n // PAGE, device="cuda", generator=gen).int()
    q = torch.randn(chunk, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    _, lse = triton_prefill.prefill_attention(q, k, k, table, start, None, D**-0.5, lse=True)
    flops = 2 * H * D * chunk * (start + (chunk + 1) / 2)
    want = before.prompt_attention_sums(q, k, table, start, D**-0.5, lse)
    t = do_bench(lambda: before.prompt_attention_sums(q, k, table, start, D**-0.5, lse), return_mode="median")
    print(json.dumps(dict(start=start, chunk=chunk, kernel="before", ms=t, tflops=flops / t / 1e9)), flush=True)
    for bm, bn, w, st in TILES:
        def fn():
            return triton_attention_scores.prompt_attention_sums(q, k, table, start, D**-0.5, lse, block_m=bm,
                                                                 block_n=bn, num_warps=w, num_stages=st)
        try:
            got = fn()
            t = do_bench(fn, return_mode="median")
            err = ((got - want).abs() / want.abs().clamp(min=1e-3)).max().item()
            print(json.dumps(dict(start=start, chunk=chunk, tile=[bm, bn, w, st], ms=t, tflops=flops / t / 1e9,
                                  rel_diff=err)), flush=True)
        except Exception as exc:  # a tile that does not fit the SM's shared memory or registers
            print(json.dumps(dict(start=start, chunk=chunk, tile=[bm, bn, w, st], error=str(exc)[:200])), flush=True)
    del k, q, lse, want
    torch.cuda.empty_cache()
