"""Offload on the GPU (tiny model, bfloat16, CUDA graphs): SentenceKV and DynSplit-KV with K/V in pinned host memory
give the tokens of their resident runs, for batches of mixed lengths, with the working set reused; nothing held after."""
import time, torch, semkv
from semkv.methods import get_method
text = open(".gpu/essays.txt").read()
llm = semkv.LLM(".gpu/tiny", device="cuda", gpu_memory_utilization=0.5)
for lengths in ((3000, 2000, 1200), (5000, 900, 2600, 4100, 1500)):
    prompts = [text[i * 7:i * 7 + n] for i, n in enumerate(lengths)]
    for name, budget, kw in (("sentencekv", 0.1, {}), ("sentencekv", 96, dict(offload_chunk=32)),
                             ("dynsplit", 0.1, {}), ("dynsplit", 96, dict(offload_chunk=4, n_sink=4))):
        runs = {}
        for offload in (False, True):
            t = time.time()
            runs[offload] = llm.generate(prompts, method=get_method(name, budget, offload=offload, **kw),
                                         max_new_tokens=60, chat=False, ignore_eos=True)
            runs[offload, "s"] = time.time() - t
        on = runs[True]
        same = all(x.token_ids == y.token_ids for x, y in zip(on, runs[False]))
        print(len(lengths), name, budget, kw, "offload == resident:", same,
              "found/loaded", sum(o.stats.extra.get("kv_reused", 0) for o in on),
              sum(o.stats.extra.get("kv_reloaded", 0) for o in on),
              "resident slots", max(o.stats.kv_resident_tokens for o in on), "vs",
              max(o.stats.kv_resident_tokens for o in runs[False]),
              f"runs {runs[False, 's']:.1f} / {runs[True, 's']:.1f} s", flush=True)
print("held after", llm.engine.memory().held)
