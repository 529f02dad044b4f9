"""Mixed steps timed by part: decode step and prefill chunks, host wall and device time (CUDA events); then a
profiler window over mixed steps (no stacks): long runtime calls, GPU busy per advance."""
import collections, json, sys, tempfile, time, gzip, statistics
from pathlib import Path
import torch
import semkv
from semkv.bench.run import TextContexts
from semkv.engine.sequence import SamplingParams
from semkv.llm import Session
from semkv.methods import get_method
from memory_soak import random_folder

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
N, NEW = int(sys.argv[2]), int(sys.argv[3])
with tempfile.TemporaryDirectory() as tmp:
    llm = semkv.LLM(random_folder("qwen2.5-0.5b", ".carry/data/smollm2-tokenizer", Path(tmp)))
text = TextContexts.from_files(["/tmp/essays.txt"], llm.tokenizer)
prompts = [text.window(i, N, 32000) for i in range(N)]
eng = llm.engine
log = []
orig_step, orig_cont = eng.step, eng.continue_prefill


def timed(kind, fn):
    def wrap(*a, **k):
        e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
        t = time.perf_counter(); e0.record()
        r = fn(*a, **k)
        e1.record(); log.append((kind, time.perf_counter() - t, e0, e1, getattr(a[0], "num_computed", 0), a[1] if kind == "chunk" else len(a[0])))
        return r
    return wrap


def session_run(n=N, steps_hook=None, tag=""):
    s = Session(llm, max_num_batched_tokens=8192, max_num_seqs=16, enable_prefix_caching=False)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    for i, ids in enumerate(prompts[:n]):
        s.submit(i, ids, params, get_method("full", 0.1), "full")
    walls = []
    torch.cuda.synchronize(); t0 = time.perf_counter()
    while s.scheduler.busy:
        log.append(("advance",))
        t = time.perf_counter()
        s.advance()
        walls.append(time.perf_counter() - t)
        if steps_hook:
            steps_hook()
    torch.cuda.synchronize()
    c = s.scheduler.counters
    print(tag, "seconds", round(time.perf_counter() - t0, 2), dict(c.timed_steps),
          {k: round(1e3 * c.step_seconds[k] / max(v, 1), 2) for k, v in c.timed_steps.items()}, flush=True)
    return walls

session_run(4, tag="warm")
session_run(tag="plain")
eng.step, eng.continue_prefill = timed("decode", orig_step), timed("chunk", orig_cont)
log.clear()
session_run(tag="instrumented")
eng.step, eng.continue_prefill = orig_step, orig_cont
torch.cuda.synchronize()
# group log by advance
steps, cur = [], None
for item in log:
    if item[0] == "advance":
        cur = []; steps.append(cur)
    else:
        cur.append((item[0], item[1] * 1e3, item[2].elapsed_time(item[3]), item[4], item[5]))
mixed = [s for s in steps if any(p[0] == "chunk" for p in s) and any(p[0] == "decode" for p in s)]
print("mixed steps", len(mixed))
for kind in ("decode", "chunk"):
    host = [p[1] for s in mixed for p in s if p[0] == kind]; dev = [p[2] for s in mixed for p in s if p[0] == kind]
    print(kind, "host ms mean/p50/max", round(statistics.mean(host), 2), round(statistics.median(host), 2), round(max(host), 2),
          "device ms mean/p50/max", round(statistics.mean(dev), 2), round(statistics.median(dev), 2), round(max(dev), 2))
for s in mixed[:40]:
    print(" | ".join(f"{p[0]} h{p[1]:.1f} d{p[2]:.1f} @{p[3]} b{p[4]}" for p in s))
pre = [s for s in steps if all(p[0] == "chunk" for p in s) and s]
for s in pre[:8]:
    print("prefill-only:", " | ".join(f"{p[0]} h{p[1]:.1f} d{p[2]:.1f} @{p[3]} b{p[4]}" for p in s))

# profiler window: steps 6..66 of a run (mixed steps of the first requests)
sched = torch.profiler.schedule(wait=6, warmup=2, active=60, repeat=1)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                            schedule=sched) as prof:
    session_run(steps_hook=prof.step, tag="profiled")
trace = out / "trace.json"
prof.export_chrome_trace(str(trace))
ev = json.load(open(trace))["traceEvents"]
rt = [e for e in ev if e.get("cat") == "cuda_runtime"]
agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
for r in rt:
    a = agg[r["name"]]; a[0] += 1; a[1] += r["dur"]; a[2] = max(a[2], r["dur"])
print("runtime calls by total host ms")
for name, (n, tot, mx) in sorted(agg.items(), key=lambda x: -x[1][1])[:15]:
    print(f"  {name:40s} {n:7d} {tot/1e3:9.2f} ms  max {mx/1e3:7.2f} ms")
kern = sorted([e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], key=lambda e: e["ts"])
busy = sum(e["dur"] for e in kern); span = kern[-1]["ts"] + kern[-1]["dur"] - kern[0]["ts"]
print(f"gpu busy {busy/1e3:.1f} of span {span/1e3:.1f} ms")
bykern = collections.Counter()
for k in kern:
    bykern[k["name"][:60]] += k["dur"]
for n, d in bykern.most_common(12):
    print(f"  {d/1e3:9.2f} ms  {n}")
gaps = sorted(((b["ts"] - a["ts"] - a["dur"], a["name"][:50], b["name"][:50]) for a, b in zip(kern, kern[1:])), reverse=True)
print("gap total >=100us", round(sum(g[0] for g in gaps if g[0] >= 100) / 1e3, 1), "ms; n", sum(1 for g in gaps if g[0] >= 100))
for g in gaps[:15]:
    print(f"  {g[0]/1e3:7.2f} ms after {g[1]} before {g[2]}")
gz = gzip.open(out / "trace2.json.gz", "wt"); gz.write(trace.read_text()); gz.close(); trace.unlink()
