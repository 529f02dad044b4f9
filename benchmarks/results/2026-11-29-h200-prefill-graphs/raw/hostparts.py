"""Host time of a prefill chunk by part (wall time of each wrapped call, inclusive), one 32k request, steps of 8192;
then launch overheads of a Triton kernel and torch ops on small tensors."""
import collections, sys, tempfile, time
from pathlib import Path
import torch
import semkv
from semkv import kernels
from semkv.kernels import cudnn_prefill
from semkv.bench.run import TextContexts
from semkv.engine.sequence import SamplingParams
from semkv.engine.kv_cache import SeqKV
from semkv.engine.step import PrefillStep
from semkv.models import llama
from semkv.llm import Session
from semkv.methods import get_method
from memory_soak import random_folder

with tempfile.TemporaryDirectory() as tmp:
    llm = semkv.LLM(random_folder("qwen2.5-0.5b", ".carry/data/smollm2-tokenizer", Path(tmp)))
text = TextContexts.from_files(["/tmp/essays.txt"], llm.tokenizer)
prompt = text.window(0, 1, 32000)
acc, on = collections.defaultdict(float), [False]
cnt = collections.Counter()

def wrap(owner, name, label):
    fn = getattr(owner, name)
    def w(*a, **k):
        if not on[0]:
            return fn(*a, **k)
        t = time.perf_counter()
        r = fn(*a, **k)
        acc[label] += time.perf_counter() - t; cnt[label] += 1
        return r
    setattr(owner, name, w)

for n in ("rms_norm", "silu_mul", "rope_store", "prefill_attention"):
    wrap(kernels, n, n)
wrap(cudnn_prefill, "_attend", "cudnn._attend")
wrap(cudnn_prefill, "merged", "cudnn.merged")
wrap(torch.nn.Linear, "forward", "linear")
wrap(SeqKV, "physical", "kv.physical")
wrap(SeqKV, "ensure_all", "kv.ensure_all")
wrap(PrefillStep, "attend", "PrefillStep.attend")
wrap(PrefillStep, "__init__", "PrefillStep.__init__")
wrap(llama.DecoderLayer, "forward", "layer")
wrap(llama.MLP, "forward", "mlp")
wrap(llm.engine, "continue_prefill", "continue_prefill")

def run(instrument):
    s = Session(llm, max_num_batched_tokens=8192, max_num_seqs=16, enable_prefix_caching=False)
    s.submit(0, prompt, SamplingParams(max_new_tokens=2, ignore_eos=True), get_method("full", 0.1), "full")
    walls = []
    torch.cuda.synchronize()
    while s.scheduler.busy:
        on[0] = instrument
        t = time.perf_counter(); s.advance(); walls.append(time.perf_counter() - t)
        on[0] = False
        torch.cuda.synchronize()
    return walls

run(False)
print("plain advance walls ms", [round(1e3 * w, 1) for w in run(False)])
acc.clear(); cnt.clear()
print("instrumented walls ms", [round(1e3 * w, 1) for w in run(True)])
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
    print(f"{k:24s} calls {cnt[k]:5d}  total ms {1e3*v:8.2f}  us/call {1e6*v/cnt[k]:8.1f}")

x = torch.randn(64, 896, device="cuda", dtype=torch.bfloat16); w = torch.ones(896, device="cuda", dtype=torch.bfloat16)
lin = torch.nn.Linear(896, 896, device="cuda", dtype=torch.bfloat16)
for name, f in [("triton rms_norm", lambda: kernels.rms_norm(x, w, 1e-6, x)), ("torch add", lambda: x + x),
                ("F.linear 64x896", lambda: lin(x)), ("arange", lambda: torch.arange(64, device="cuda")),
                ("F.pad", lambda: torch.nn.functional.pad(x, (0, 0, 1, 1))), ("index", lambda: x[torch.arange(3, device="cuda")])]:
    for _ in range(50): f()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(500): f()
    el = time.perf_counter() - t; torch.cuda.synchronize()
    print(f"launch {name:20s} {1e6*el/500:7.1f} us")
