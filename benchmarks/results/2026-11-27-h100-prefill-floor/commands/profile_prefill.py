"""Kernel-time breakdown of one 32k prefill (Llama-3.1-8B shape, random weights, bf16) of each method named
(default full), after two unprofiled requests."""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from semkv.bench.run import bench_ttft
from semkv.bench.shapes import random_model
from semkv.engine.engine import Engine

dev = torch.device("cuda")
model = random_model("llama3-8b", dev, torch.bfloat16)
eng = Engine(model, model.config, dev, torch.bfloat16, gpu_memory_utilization=0.9)
for name in (sys.argv[1].split(",") if len(sys.argv) > 1 else ["full"]):
    budget = None if name == "full" else 0.1
    print(name, "ttft", bench_ttft(eng, name, budget, 32768), flush=True)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        t = bench_ttft(eng, name, budget, 32768, repeats=1)
    print(name, "profiled ttft", t)
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70), flush=True)
