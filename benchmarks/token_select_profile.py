"""Per-kernel device times of TokenSelect's decode selection (`kernels/triton_token_select.py`) for one layer at
25 sequences x 32k tokens, Llama-3.1-8B heads, the paper's budget 2688 and 1% (328): every row missing the Selection
Cache (theta above 1) and every row hitting it (theta -2). Needs a CUDA device.

    PYTHONPATH=$PWD python benchmarks/token_select_profile.py
"""
import torch
from torch.profiler import profile, ProfilerActivity
from semkv.kernels import reference, triton_token_select as tts

B, H, HK, D, PAGE, ctx = 25, 32, 8, 128, 16, 32768
gen = torch.Generator(device="cuda").manual_seed(0)
pages = B * (ctx // PAGE + 4) + 1
k_pool = torch.randn(pages, PAGE, HK, D, device="cuda", dtype=torch.bfloat16, generator=gen)
tables = (torch.randperm(pages - 1, device="cuda", generator=gen)[: B * (ctx // PAGE + 4)] + 1).view(B, -1)
q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
n = ctx + torch.arange(B, device="cuda")
rows = torch.arange(1, B + 1, device="cuda")
for budget in (2688, 328):
    sink, recent = min(128, budget // 8), min(512, budget // 4)
    k = budget - sink - recent
    cache = reference.SelectionCacheBuffers.allocate(B + 1, 2, H * D, 1, k, torch.device("cuda"))
    for theta, label in ((1.5, "miss"), (-2.0, "hit")):
        for _ in range(3):
            tts.token_select(q, k_pool, tables, n, ctx + 64, rows, cache, 1, sink, recent, theta, "soft_vote", None)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                tts.token_select(q, k_pool, tables, n, ctx + 64, rows, cache, 1, sink, recent, theta, "soft_vote", None)
            torch.cuda.synchronize()
        print(f"budget {budget} {label}:", ", ".join(f"{e.key} {e.device_time_total / 10:.1f}us"
              for e in prof.key_averages() if e.device_time_total > 0))
