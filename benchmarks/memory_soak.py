"""Memory soak: one `LLM` serves many long requests with every method; device memory must stay flat.

Per method, `--requests` requests of `--context` tokens through `LLM.generate` (`--per-call` prompts a call, so
continuous batching runs them together), then `LLM.compare` of every method over `--prompts` prompts. After each call
it records `torch.cuda.memory_allocated()` and `memory_reserved()`, the engine's accounting (`llm.engine.memory()`),
the process's resident host memory and any error (an out-of-memory error is what a leak looks like on a GPU). A phase
is flat when memory_allocated is the same after every call but the first (the warm-up: compiled kernels, caches of
fixed size) and the engine holds no page and no request after any call. Prints one JSON line per call and FLAT /
GROWS per phase; `--out` keeps them in a file. It also runs on code from before the engine's accounting (no `engine`
column then), for a before / after comparison.

    python benchmarks/memory_soak.py --shape qwen2.5-0.5b --tokenizer DIR --text-file essays.txt --out results/
    python benchmarks/memory_soak.py --model /path/to/model.gguf --text-file essays.txt

With `--shape` the model has random weights (what memory does is independent of them; the tokens are not).
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

import semkv
from semkv.bench.run import TextContexts
from semkv.bench.shapes import hf_config_for
from semkv.methods import METHODS, get_method


def random_folder(shape: str, tokenizer_dir: str, path: Path) -> Path:
    """A HF folder of `shape` with random weights (bfloat16) and the tokenizer files of `tokenizer_dir`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config_for(shape)).to(torch.bfloat16).save_pretrained(path)
    for item in Path(tokenizer_dir).iterdir():
        if item.is_file() and item.name != "config.json":
            shutil.copy(item, path / item.name)
    return path


def host_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return 0.0


class Recorder:
    def __init__(self, llm: semkv.LLM, out: Path | None):
        self.llm, self.rows = llm, []
        self.file = open(out / "memory_soak.jsonl", "w") if out else None
        self.cuda = llm.engine.device.type == "cuda"

    def record(self, phase: str, call: int, requests: int, seconds: float, error: str = "") -> None:
        row = dict(phase=phase, call=call, requests=requests, seconds=round(seconds, 2), error=error,
                   allocated=torch.cuda.memory_allocated() if self.cuda else 0,
                   reserved=torch.cuda.memory_reserved() if self.cuda else 0, host_rss_gib=round(host_rss_gib(), 3),
                   engine=self.llm.engine.memory().as_dict() if hasattr(self.llm.engine, "memory") else {})
        self.rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()

    def verdict(self, phase: str) -> str:
        rows = [r for r in self.rows if r["phase"] == phase]
        if not rows:
            return f"{phase:24s} not run (time limit)"
        errors = sum(bool(r["error"]) for r in rows)
        allocated = [r["allocated"] for r in rows]
        after = allocated[1:] or allocated  # after the warm-up call
        held = [r["engine"].get("pages_in_use", 0) + r["engine"].get("requests", 0) for r in rows]
        flat = len(set(after)) == 1 and not any(held) and not errors
        requests = sum(r["requests"] for r in rows if not r["error"])
        return (f"{phase:24s} {'FLAT' if flat else 'GROWS'}  {len(rows)} calls, {requests} requests, {errors} errors; "
                f"allocated after the first call {allocated[0] / 2**30:.3f} GiB, then {min(after) / 2**30:.3f} .. "
                f"{max(after) / 2**30:.3f} GiB ({(after[-1] - after[0]) / 2**20:+.1f} MiB); reserved max "
                f"{max(r['reserved'] for r in rows) / 2**30:.2f} GiB; host RSS {rows[0]['host_rss_gib']:.2f} -> "
                f"{rows[-1]['host_rss_gib']:.2f} GiB; engine holds {max(held)} pages + requests at most after a call")


def model_arguments(p: argparse.ArgumentParser) -> None:
    """The model (a local one, or a shape with random weights) and the texts prompts are cut from."""
    p.add_argument("--model", help="a local model (HF folder or GGUF); else --shape with random weights")
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--tokenizer", help="folder with the tokenizer files, for --shape")
    p.add_argument("--text-file", action="append", required=True, help="texts the prompts are cut from")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_arguments(p)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("--context", type=int, default=32_000, help="prompt tokens")
    p.add_argument("--requests", type=int, default=50, help="generate requests per method")
    p.add_argument("--per-call", type=int, default=5, help="prompts per generate call")
    p.add_argument("--prompts", type=int, default=10, help="prompts of the compare of all methods")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--phases", default="generate,compare")
    p.add_argument("--time-limit", type=float, default=560.0, help="seconds; stop starting calls after it")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    started = time.perf_counter()
    methods = args.methods.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or random_folder(args.shape, args.tokenizer, Path(tmp))
        llm = semkv.LLM(model)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    recorder = Recorder(llm, args.out)
    text = TextContexts.from_files(args.text_file, llm.tokenizer)
    windows = max(args.per_call, args.prompts)
    prompts = [text.window(i, windows, args.context) for i in range(windows)]
    texts = [llm.tokenizer.decode(ids) for ids in prompts]
    pool = llm.engine.pool
    print(f"{llm.engine.device} {torch.cuda.get_device_name() if recorder.cuda else ''}; pool "
          f"{pool.num_pages} pages ({pool.num_pages * pool.bytes_per_page / 2**30:.1f} GiB); "
          f"{args.context}-token prompts; budget {args.budget}", flush=True)

    def timed(phase: str, call: int, requests: int, work) -> None:
        begin = time.perf_counter()
        error = ""
        try:
            work()
        except (MemoryError, torch.OutOfMemoryError, RuntimeError) as exc:  # what a leak ends in
            error = f"{type(exc).__name__}: {str(exc)[:200]}"
        recorder.record(phase, call, requests, time.perf_counter() - begin, error)

    phases = []
    if "generate" in args.phases:
        for name in methods:
            phase = f"generate {name}"
            calls = -(-args.requests // args.per_call)
            for call in range(calls):
                if time.perf_counter() - started > args.time_limit:
                    break
                n = min(args.per_call, args.requests - call * args.per_call)
                timed(phase, call, n, lambda: llm.generate(texts[:n], method=name, budget=args.budget,
                                                           max_new_tokens=args.new_tokens, chat=False,
                                                           ignore_eos=True))
            phases.append(phase)
    if "compare" in args.phases:
        every = [get_method(name, args.budget) for name in methods]
        for i in range(args.prompts):
            if time.perf_counter() - started > args.time_limit:
                break
            timed("compare all methods", i, len(every),
                  lambda: llm.compare(prompts[i], every, max_new_tokens=args.new_tokens))
        phases.append("compare all methods")
    print()
    for phase in phases:
        print(recorder.verdict(phase))
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
