"""Peak device memory with every sequence prefilled for real through the model (its activations included), not from
random K/V: the Llama-3.1-8B shape with random weights, bf16, 32k-token prompts of synthetic ids, budget 0.1, 8
timed decode steps. One JSON line (`DecodeResult`) per case.

    python real_prefill_peak.py TOKENIZER CASE [CASE ...]     CASE: method:batch[:cache_factor]  (offload on with a
                                                              cache_factor; full and resident methods without)
SHAPE, DEVICE, CONTEXT, BUDGET and UTIL in the environment change the shape, device, prompt length, budget (0.1; an
int is tokens) and gpu_memory_utilization (0.9).
"""
import dataclasses
import json
import os
import sys
import time

import torch
from transformers import AutoTokenizer

from semkv.bench.run import TextContexts, bench_decode, synthetic_ids
from semkv.bench.shapes import random_model
from semkv.engine.engine import Engine

tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
device = torch.device(os.environ.get("DEVICE", "cuda"))
dtype, context = torch.bfloat16 if device.type == "cuda" else torch.float32, int(os.environ.get("CONTEXT", 32768))
model = random_model(os.environ.get("SHAPE", "llama3-8b"), device, dtype)
engine = Engine(model, model.config, device, dtype, gpu_memory_utilization=float(os.environ.get("UTIL", 0.9)))
stream = TextContexts(synthetic_ids(engine, 0, 4 * context))  # sequence i of B starts i/B of the way through it
for case in sys.argv[2:]:
    name, batch, *factor = case.split(":")
    params = dict(offload=True, cache_factor=float(factor[0])) if factor else {}
    started = time.perf_counter()
    try:
        budget = float(os.environ.get("BUDGET", 0.1))
        row = bench_decode(engine, name, None if name == "full" else budget if budget < 1 else int(budget), int(batch),
                           context, steps=8,
                           params=params, tokenizer=tokenizer, text=stream)
        print(json.dumps(dict(case=case, run_s=time.perf_counter() - started, held=list(engine.memory().held),
                              **dataclasses.asdict(row))), flush=True)
    except (MemoryError, torch.OutOfMemoryError) as error:
        print(json.dumps(dict(case=case, error=str(error)[:300])), flush=True)
