"""bucket_best at 16 and 335 rows: BLOCK_N x num_warps (one layer, 10% of 32k retained, 1,400 buckets)."""
import json, sys
import torch, triton
from triton.testing import do_bench
sys.path.insert(0, "benchmarks")
import kernel_check as kc
from semkv.methods.sentencekv import reference as ref, triton_bucket_best as tb

H, HK, D = 14, 2, 64  # Qwen2.5-0.5B
gen = torch.Generator(device="cuda").manual_seed(0)
bw = kc.measured_bandwidth(torch.device("cuda"))
for batch, kind in ((16, 'sentences'), (335, 'sentences'), (16, 'scattered')):
    tokens, buckets = 3328, 1400
    k_pool, _, tables = kc.pool(32768, batch, gen, kv_heads=HK, dim=D)
    query = torch.randn(batch, H, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    rows = torch.randperm(batch + 3, device="cuda", generator=gen)[:batch]
    if kind == 'scattered':  # 2-3 retained tokens a bucket: the atomics' worst case
        bucket = torch.sort(torch.randint(0, buckets, (batch + 3, HK, tokens), device="cuda", generator=gen), dim=-1).values.int()
    else:  # retain="sentences": whole sentences of 10-40 tokens, about 130 of the 1,400
        lengths = torch.randint(10, 41, (batch + 3, HK, 400), device="cuda", generator=gen)
        chosen = torch.sort(torch.rand(batch + 3, HK, buckets, device="cuda", generator=gen).argsort(-1)[..., :400], -1).values
        bucket = torch.stack([torch.stack([chosen[r, h].repeat_interleave(lengths[r, h])[:tokens] for h in range(HK)])
                              for r in range(batch + 3)]).int()
    full = torch.full((batch,), tokens, device="cuda")
    args = (query, k_pool, tables, bucket, rows, torch.full_like(full, 32), full, buckets)
    want = ref.bucket_best(*args)
    floor = 1e3 * batch * tokens * HK * D * 2 / bw
    for block in (64, 128, 256):
        for warps in (2, 4):
            f = lambda: tb.bucket_best(*args, block_n=block, num_warps=warps)
            got = f()
            ok = torch.equal(want.isfinite(), got.isfinite()) and kc.rel_err(got[want.isfinite()], want[want.isfinite()]) < 2e-2
            print(json.dumps(dict(kind=kind, batch=batch, block=block, warps=warps, ok=bool(ok), ms=round(do_bench(f), 4),
                                  floor_ms=round(floor, 4))), flush=True)
    del k_pool, tables
