"""Device time of one decode step, kernel by kernel (torch.profiler over eager steps, so every kernel is seen; the
device times are those a graph replay runs): the Llama-3.1-8B shape with random weights, bf16, random K/V as
`semkv bench` fills them. Prints the kernels that take the most device time per step, and the step's total.

    python profile_step.py TOKENIZER METHOD BUDGET BATCH CONTEXT [NAME=VALUE ...]     (method parameters)
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoTokenizer

from semkv.bench.run import bound_method, never_stop, prefilled_batch
from semkv.bench.shapes import random_model
from semkv.engine.engine import Engine

tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
name, budget, batch, context = sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
params = {k: eval(v) for k, v in (a.split("=", 1) for a in sys.argv[6:])}
device, dtype = torch.device("cuda"), torch.bfloat16
model = random_model("llama3-8b", device, dtype)
engine = Engine(model, model.config, device, dtype, gpu_memory_utilization=0.8)
method = bound_method(engine, name, budget if budget < 1 else int(budget), params, tokenizer)
seqs = prefilled_batch(engine, method, batch, context, 24)
steps = 3
with torch.inference_mode():
    for _ in range(3):  # compile what eager steps launch
        engine.step(seqs, method, None, never_stop)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step(seqs, method, None, never_stop)
        torch.cuda.synchronize()
rows = [(e.key, e.device_time_total / steps / 1e3, e.count // steps) for e in prof.key_averages()
        if e.device_time_total > 0]
rows.sort(key=lambda r: -r[1])
total = sum(r[1] for r in rows)
print(f"{name} {params} batch {batch} context {context}: device time per step {total:.2f} ms")
for key, ms, count in rows[:25]:
    print(f"{ms:8.3f} ms {count:6d}x  {key[:110]}")
engine.end(seqs, method)
