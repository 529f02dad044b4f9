"""Per-kernel device times of TokenSelect's decode selection (`methods/tokenselect/triton_token_select.py`) for one layer at
25 sequences x 32k tokens, Llama-3.1-8B heads, the paper's budget 2688 and 1% (328), in three cases: every row
missing the Selection Cache (theta above 1), every row hitting it (theta -2), and 4 of the 25 rows missing (theta 0.5
with those rows' queries alternating between two unrelated ones, the others repeating theirs). Needs a CUDA device.

    PYTHONPATH=$PWD python benchmarks/studies/token_select_profile.py
"""
import torch
from torch.profiler import profile, ProfilerActivity
from semkv.methods.tokenselect import reference as tokenselect_reference, triton_token_select as tts

B, H, HK, D, PAGE, ctx, MISSING, REPEAT = 25, 32, 8, 128, 16, 32768, 4, 10
gen = torch.Generator(device="cuda").manual_seed(0)
pages = B * (ctx // PAGE + 4) + 1
k_pool = torch.randn(pages, PAGE, HK, D, device="cuda", dtype=torch.bfloat16, generator=gen)
tables = (torch.randperm(pages - 1, device="cuda", generator=gen)[: B * (ctx // PAGE + 4)] + 1).view(B, -1)
q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
q_other = q.clone()
q_other[:MISSING] = torch.randn(MISSING, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
n = ctx + torch.arange(B, device="cuda")
rows = torch.arange(1, B + 1, device="cuda")
for budget in (2688, 328):
    sink, recent = min(128, budget // 8), min(512, budget // 4)
    k = budget - sink - recent
    parts = torch.tensor([[sink, k, recent]], device="cuda").expand(B, -1)  # [B, 3] each row's split
    cache = tokenselect_reference.SelectionCacheBuffers.allocate(B + 1, 2, H * D, 1, k, torch.device("cuda"))
    for theta, label, queries in ((1.5, "miss", (q, q)), (-2.0, "hit", (q, q)),
                                  (0.5, f"{MISSING} of {B} miss", (q, q_other))):
        def select(i):
            return tts.token_select(queries[i % 2], k_pool, tables, n, ctx + 64, rows, cache, 1, parts, budget, theta,
                                    "soft_vote", None)
        for i in range(4):
            select(i)
        torch.cuda.synchronize()
        before = cache.counts[rows].sum(0)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(REPEAT):
                select(i)
            torch.cuda.synchronize()
        hits, lookups = (cache.counts[rows].sum(0) - before).tolist()
        times = {e.key: e.device_time_total / REPEAT for e in prof.key_averages() if e.device_time_total > 0}
        print(f"budget {budget} {label} (hit rate {hits / lookups:.2f}): total {sum(times.values()):.1f}us; "
              + ", ".join(f"{key} {t:.1f}us" for key, t in times.items()))
