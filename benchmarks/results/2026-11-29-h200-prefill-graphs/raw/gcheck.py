"""Prefill logits with the piecewise graphs against eager chunks (same model, same process), spans of every kind."""
import sys, tempfile, time
from pathlib import Path
import torch
import semkv
from semkv.bench.run import TextContexts
from semkv.engine.kv_cache import SeqKV
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.methods import get_method
from memory_soak import random_folder

with tempfile.TemporaryDirectory() as tmp:
    llm = semkv.LLM(random_folder(sys.argv[1], ".carry/data/smollm2-tokenizer", Path(tmp)))
eng = llm.engine
graphs = eng.prefill_graphs
print("sizes captured at load", sorted(graphs.graphs))
text = TextContexts.from_files(["/tmp/essays.txt"], llm.tokenizer)
ids = text.window(0, 1, 24000)
SPANS = [(0, 8192), (8192, 16368), (16368, 17400), (17400, 17403), (17403, 23000), (23000, 24000)]
for name, budget in (("full", None), ("chess", 0.1), ("tokenselect", 0.1), ("h2o", 0.1)):
    outs = []
    for g in (None, graphs):
        eng.prefill_graphs = g
        m = get_method(name, budget).bound(llm.config, llm.tokenizer, eng.pool.page_size)
        seq = Sequence(-1, ids, SamplingParams(max_new_tokens=8), SeqKV(eng.pool))
        seq.method_state = m.new_state(seq)
        eng.start_prefill(seq, m)
        evict = seq.prefill.spans[-1][2]
        seq.prefill.spans = [(a, b, evict and b == len(ids)) for a, b in SPANS]
        torch.cuda.synchronize(); t = time.perf_counter()
        logits = eng.run_prefill(seq)
        torch.cuda.synchronize()
        outs.append((logits.float(), time.perf_counter() - t))
        eng.end([seq], m)
    (a, ta), (b, tb) = outs
    print(f"{name:12s} max|diff| {(a - b).abs().max().item():.4g}  max|logit| {a.abs().max().item():.4g}  argmax equal {bool(a.argmax() == b.argmax())}  top5 overlap {len(set(a.topk(5).indices.tolist()) & set(b.topk(5).indices.tolist()))}  eager {ta*1e3:.0f} ms graphs {tb*1e3:.0f} ms", flush=True)
eng.prefill_graphs = graphs
print("sizes captured", sorted(graphs.graphs), "pool held pages", eng.memory().held)
from semkv.llm import Session
from semkv.engine import cuda_graph
calls = []
orig = cuda_graph.PrefillGraphs.forward
def counted(self, input_ids, *a):
    calls.append(input_ids.shape[0]); return orig(self, input_ids, *a)
cuda_graph.PrefillGraphs.forward = counted
s = Session(llm, max_num_batched_tokens=8192, max_num_seqs=16, enable_prefix_caching=False)
for i in range(4):
    s.submit(i, text.window(i, 4, 20000), SamplingParams(max_new_tokens=32, ignore_eos=True), get_method("full", None), "full")
while s.scheduler.busy:
    s.advance()
print("graphed chunks in a session", len(calls), calls[:12], dict(s.scheduler.counters.timed_steps))
