"""Full KV and H2O TTFT (first and second request) at 32k and 128k by prefill chunk, Llama-3.1-8B shape, random
weights, bf16, with the peak device memory of each run; one engine per chunk (its warm-up builds that chunk's plans)."""
import json
import sys

import torch

from semkv.bench.run import bench_ttft
from semkv.bench.shapes import random_model
from semkv.engine.engine import Engine

dev = torch.device("cuda")
model = random_model("llama3-8b", dev, torch.bfloat16)
methods = sys.argv[2].split(",") if len(sys.argv) > 2 else ["full"]
for chunk in [int(c) for c in sys.argv[1].split(",")]:
    eng = Engine(model, model.config, dev, torch.bfloat16, prefill_chunk=chunk, gpu_memory_utilization=0.9)
    for name in methods:
        for ctx in (32768, 131072):
            torch.cuda.reset_peak_memory_stats()
            try:
                t = bench_ttft(eng, name, None if name == "full" else 0.1, ctx)
            except Exception as exc:
                t = repr(exc)[:200]
            print(json.dumps(dict(chunk=chunk, method=name, context=ctx, ttft_s=t,
                                  peak_gib=torch.cuda.max_memory_allocated() / 2**30)), flush=True)
    del eng
    torch.cuda.empty_cache()
