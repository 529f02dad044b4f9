"""The card's bf16 GEMM rate as `semkv bench` measures it (20 products of 8192x4096x14336, about 50 ms: the rate
the FLOP floor divides by) and sustained over about 2.5 s, like a prefill's GEMMs; and each of a Llama-3.1-8B
layer's four GEMMs at M=32768 sustained. Prints JSON."""
import json

import torch

from semkv.bench.device import measured_gemm_tflops

dev = torch.device("cuda")
rows = dict(burst=measured_gemm_tflops(dev), sustained=measured_gemm_tflops(dev, repeats=1000))
for name, (k, n) in dict(qkv=(4096, 6144), o=(4096, 4096), gate_up=(4096, 28672), down=(14336, 4096)).items():
    rows[name] = measured_gemm_tflops(dev, m=32768, k=k, n=n, repeats=max(20, int(4e14 / (2 * 32768 * k * n))))
rows["burst_after"] = measured_gemm_tflops(dev)
print(json.dumps(rows))
