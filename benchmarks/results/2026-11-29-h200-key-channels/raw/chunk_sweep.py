"""chunk_best on the device: exact keys (D=64) against key channels (8 or 16) at several block sizes, 16 and 335 rows of
31,744 slots (random keys, chunks of 16), ms a layer; plus Full KV's decode attention a layer for scale."""
import json
import sys

import torch

from semkv import kernels
from semkv.methods.dynsplit import reference, triton_chunk_best

torch.manual_seed(0)
dev = "cuda"
P, H, G, D, W = 16, 2, 7, 64, 31744


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


for B in (16, 335):
    pages = W // P
    perm = torch.randperm(B * pages, device=dev) + 1
    tables = perm.view(B, pages)
    chunk_of = (torch.arange(W, device=dev) // 16).int().expand(B, -1).contiguous()
    chunks = W // 16 + 2
    lo = torch.zeros(B, dtype=torch.long, device=dev)
    hi = torch.full((B,), W - 16, dtype=torch.long, device=dev)
    q = torch.randn(B, H * G, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B * pages + 1, P, H, D, device=dev, dtype=torch.bfloat16)
    row = dict(rows=B)
    for bn in (64, 128, 256):
        row[f"exact_{bn}"] = timed(lambda: triton_chunk_best.chunk_best(q, k, tables, chunk_of, lo, hi, chunks, "mean", bn))
    row["exact_max_128"] = timed(lambda: triton_chunk_best.chunk_best(q, k, tables, chunk_of, lo, hi, chunks, "max", 128))
    ref = reference.chunk_best(q[:2].float(), k.float(), tables[:2], chunk_of[:2], lo[:2], hi[:2], chunks, "mean")
    got = triton_chunk_best.chunk_best(q[:2], k, tables[:2], chunk_of[:2], lo[:2], hi[:2], chunks, "mean")
    fin = ref.isfinite()
    row["exact_err"] = float((ref[fin] - got[fin]).abs().max()) if torch.equal(fin, got.isfinite()) else "inf differ"
    del k
    for c in (8, 16):
        kc = torch.randn(B * pages + 1, P, H, c, device=dev, dtype=torch.bfloat16)
        qc = q[..., :c].contiguous()
        for bn in (64, 128, 256, 512):
            for w in (2, 4, 8):
                row[f"ch{c}_{bn}_w{w}"] = timed(
                    lambda: triton_chunk_best.chunk_best(qc, kc, tables, chunk_of, lo, hi, chunks, "mean", bn, w))
        ref = triton_chunk_best.chunk_best(qc, kc, tables, chunk_of, lo, hi, chunks, "mean", 64)
        for bn in (128, 256, 512):
            got = triton_chunk_best.chunk_best(qc, kc, tables, chunk_of, lo, hi, chunks, "mean", bn)
            fin = ref.isfinite()
            row[f"ch{c}_{bn}_err"] = float((ref[fin] - got[fin]).abs().max()) if torch.equal(fin, got.isfinite()) else "inf differ"
        del kc
    print(json.dumps(row), flush=True)
    torch.cuda.empty_cache()
