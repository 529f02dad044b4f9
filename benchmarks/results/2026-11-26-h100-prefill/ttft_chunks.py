"""Exploration: Full KV / H2O / SnapKV / ChunkKV TTFT at 32k for several prefill chunks; HF sdpa TTFT."""
import json, sys, time, torch
from semkv.bench.shapes import random_model
from semkv.engine.engine import Engine
from semkv.bench.run import bench_ttft
from semkv.bench.hf_baseline import hf_prefill_s

dev = torch.device("cuda")
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
print(json.dumps(dict(hf_sdpa=hf_prefill_s("llama3-8b", ctx, dev, torch.bfloat16, repeats=3))), flush=True)
model = random_model("llama3-8b", dev, torch.bfloat16)
for chunk in [512, 2048, 4096, 8192, 16384]:
    eng = Engine(model, model.config, dev, torch.bfloat16, prefill_chunk=chunk, gpu_memory_utilization=0.85)
    for name, b in [("full", None), ("full", None), ("snapkv", 0.1), ("chunkkv", 0.1), ("h2o", 0.1)]:
        try:
            t = bench_ttft(eng, name, b, ctx)
        except Exception as exc:
            t = repr(exc)[:200]
        print(json.dumps(dict(chunk=chunk, method=name, ttft_s=t, peak_gib=torch.cuda.max_memory_allocated() / 2**30)), flush=True)
    del eng
    torch.cuda.empty_cache()
