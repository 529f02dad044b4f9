"""TokenSelect's selective prefill chunk at 1M: a kernel-level profile of prefill_context + attention."""
import sys
sys.path.insert(0, "benchmarks")
import torch
from torch.profiler import profile, ProfilerActivity
from tokenselect_attention import paged_sequence
from tokenselect_kernels import HEADS, HEAD_DIM
from semkv.methods import TokenSelect
from semkv import kernels
seq = paged_sequence(2**20, 512, 16, "cuda", torch.bfloat16)
q = torch.randn(512, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
m = TokenSelect(budget=2688)
def run():
    ctx = m.prefill_context(0, seq, q, 2**20)
    return kernels.prefill_attention(q, seq.kv.pool.k, seq.kv.pool.v, seq.kv.table[0], 2**20, ctx, HEAD_DIM**-0.5)
for _ in range(3): run()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as p:
    for _ in range(5): run()
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=20))
