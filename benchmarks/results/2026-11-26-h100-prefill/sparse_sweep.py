"""TokenSelect's sparse prefill attention (512 queries, 28 heads, 4 KV heads, 2688 context slots of 1M) by tile and
context parts."""
import sys, json, torch
sys.path.insert(0, "benchmarks")
from triton.testing import do_bench
from tokenselect_attention import paged_sequence
from semkv.kernels import triton_prefill
from semkv.methods import TokenSelect
seq = paged_sequence(2**20, 512, 16, "cuda", torch.bfloat16)
q = torch.randn(512, 28, 128, device="cuda", dtype=torch.bfloat16)
ctx = TokenSelect(budget=2688).prefill_context(0, seq, q, 2**20)
pool, table = seq.kv.pool, seq.kv.table[0]
want = triton_prefill.prefill_attention(q, pool.k, pool.v, table, 2**20, ctx, 128**-0.5, tile=(64, 64, 4, 3), splits=1)
for tile in [(64, 64, 4, 3), (64, 32, 4, 3), (32, 64, 4, 3), (128, 64, 4, 3), (64, 64, 4, 2), (32, 32, 2, 3), (16, 64, 4, 3)]:
    for splits in [1, 2, 4, 8]:
        fn = lambda: triton_prefill.prefill_attention(q, pool.k, pool.v, table, 2**20, ctx, 128**-0.5, tile=tile, splits=splits)
        try:
            err = float((fn().float() - want.float()).abs().max())
            print(json.dumps(dict(tile=tile, splits=splits, us=round(1e3 * do_bench(fn, return_mode="median"), 1), err=err)), flush=True)
        except Exception as exc:
            print(tile, splits, repr(exc)[:150])
