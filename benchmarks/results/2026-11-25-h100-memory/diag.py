import gc, sys, time, tempfile, torch, json
from pathlib import Path
sys.path.insert(0, "benchmarks")
import semkv
from memory_soak import random_folder
from semkv.bench.run import TextContexts
tmp = tempfile.mkdtemp()
llm = semkv.LLM(random_folder("qwen2.5-0.5b", ".gpu/tok", Path(tmp)))
text = TextContexts.from_files([".gpu/essays.txt"], llm.tokenizer)
texts = [llm.tokenizer.decode(text.window(i, 5, 4000)) for i in range(5)]
def go(method="full", n=5):
    llm.generate(texts[:n], method=method, budget=0.1, max_new_tokens=8, chat=False, ignore_eos=True)
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()
a = [go() for _ in range(4)]
gc.collect(); a.append(torch.cuda.memory_allocated())
print("graphs on, full:", [round((x - a[0]) / 2**20, 2) for x in a], flush=True)
llm.engine.cuda_graphs = False
b = [go() for _ in range(4)]
print("graphs off, full:", [round((x - b[0]) / 2**20, 2) for x in b], flush=True)
llm.engine.cuda_graphs = True
go()
torch.cuda.memory._record_memory_history(max_entries=200000)
before = go()
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
after = torch.cuda.memory_allocated()
print("recorded call growth MiB", (after - before) / 2**20, flush=True)
# live blocks whose allocation was recorded (i.e. made during the recorded call) and are still allocated
found = {}
for seg in snap["segments"]:
    for blk in seg["blocks"]:
        if blk["state"] == "active_allocated" and blk.get("frames"):
            key = tuple(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in blk["frames"] if "semkv" in f["filename"] or "diag" in f["filename"])[:8]
            found.setdefault(key, [0, 0]); found[key][0] += blk["size"]; found[key][1] += 1
for key, (size, count) in sorted(found.items(), key=lambda kv: -kv[1][0])[:12]:
    print(f"{size / 2**20:8.2f} MiB {count:4d} blocks", " <- ".join(key))
