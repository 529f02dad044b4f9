"""Kernel-time breakdown of one Full-KV 32k prefill (llama3-8b shape, chunk 8192)."""
import torch, time
from torch.profiler import profile, ProfilerActivity
from semkv.bench.shapes import random_model
from semkv.engine.engine import Engine
from semkv.bench.run import bench_ttft
dev = torch.device("cuda")
model = random_model("llama3-8b", dev, torch.bfloat16)
eng = Engine(model, model.config, dev, torch.bfloat16, gpu_memory_utilization=0.85)
print("ttft", bench_ttft(eng, "full", None, 32768))
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
    t = bench_ttft(eng, "full", None, 32768, repeats=1)
print("profiled ttft", t)
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
