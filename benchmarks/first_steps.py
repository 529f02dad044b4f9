"""A server's first requests against the same requests again: what the first ones wait for (Triton compiling kernels
for sizes the engine's warm-up did not run, CUDA-graph captures, cuDNN plans).

One process loads the model (random weights of `--shape` unless `--model`), then runs `--runs` sessions in turn, each
the same `--requests` prompts of `--context` tokens from `--text-file`, `--new-tokens` each (EOS ignored), at most
`--max-num-seqs` at once, steps of `--max-num-batched-tokens` (a server's `Session`, no web process, prefix caching
off). For each session: its wall time, output tokens/s, the steps by kind with their mean time (the scheduler's CUDA
events), the slowest steps, and the Triton kernels compiled meanwhile (folders new in `TRITON_CACHE_DIR`: give each
process its own to count them), each with the signature Triton specialized it for. One JSON line per session.
`--sync-debug` also counts, in the last session, every operation that made the host wait for the device (torch's
sync debug mode), by the semkv lines that called it: a step should wait once, to read its tokens. `--profile DIR`
runs `--profile-steps` steps of the last session, from its step `--profile-from`, under torch.profiler: the
operations by device time and by host time, and for each step the tokens it computed, its host time, and the
device's busy time against its span (a kernel counts for the step whose host range launched it: the runtime's or the
driver's launch), with the Chrome trace (gzipped) in DIR.

    TRITON_CACHE_DIR=/tmp/tc python benchmarks/first_steps.py --tokenizer DIR --text-file essays.txt
    # another version of semkv against this one, in one call: PYTHONPATH=OLD_TREE:benchmarks TRITON_CACHE_DIR=...
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import json
import os
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

import semkv
from semkv.bench.run import TextContexts
from semkv.cli.args import parse_params
from semkv.engine.sequence import SamplingParams
from semkv.llm import Session
from semkv.methods import get_method

from memory_soak import model_arguments, random_folder


def compiled() -> dict[str, str]:
    """Triton's cache folder: each compiled variant (its folder) -> kernel name and the `tt.func` line of its Triton
    IR (the arguments' types and the divisibility Triton specialized them on: what the variant was compiled for)."""
    folder = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    variants = {}
    for meta in folder.glob("*/*.json"):
        if meta.name.startswith("__grp__"):
            continue
        ir = meta.with_suffix(".ttir")
        lines = ir.read_text().splitlines() if ir.is_file() else []
        variants[meta.parent.name] = f"{meta.stem}: " + next((line.strip() for line in lines if "tt.func" in line), "")
    return variants


def counted(variants: dict[str, str]) -> dict[str, int]:
    """Kernel name -> how many of `variants` it has."""
    return dict(collections.Counter(text.split(":")[0] for text in variants.values()))


class SyncSites:
    """While entered: torch's sync debug mode, every synchronizing CUDA operation counted by the last three semkv
    frames (file:line) that led to it."""

    def __init__(self) -> None:
        self.sites: collections.Counter[str] = collections.Counter()

    def __enter__(self) -> "SyncSites":
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._count
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._warnings.__exit__(*exc)

    def _count(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchronizing" not in str(message):  # another warning: not a wait
            self.sites[f"other warning: {str(message)[:80]}"] += 1
            return
        frames = [f"{Path(f.filename).name}:{f.lineno}" for f in traceback.extract_stack()
                  if "/semkv/" in f.filename and "/benchmarks/" not in f.filename]
        self.sites[" < ".join(frames[::-1][:3]) or f"{Path(filename).name}:{lineno}"] += 1


def report_profile(profiler, folder: Path, step_tokens: dict[str, int]) -> None:
    """Print the profiled steps' kernels by device time and, for each step, the device's busy time (the union of
    the kernels its host range launched) against their span; write the Chrome trace, gzipped, into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    averages = profiler.key_averages()
    print(averages.table(sort_by="self_device_time_total", row_limit=40), flush=True)
    print(averages.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    trace = folder / "trace.json"
    profiler.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    with gzip.open(folder / "trace.json.gz", "wt") as out:
        json.dump(events, out)
    trace.unlink()
    steps = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e.get("cat") == "user_annotation" and e["name"].startswith("step "))
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    kernels = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e["args"].get("correlation") in launches:
            at = launches[e["args"]["correlation"]]
            for start, end, name in steps:
                if start <= at <= end:
                    kernels[name].append((e["ts"], e["ts"] + e["dur"]))
                    break
    for start, end, name in steps:
        spans = sorted(kernels[name])
        busy, reach = 0.0, None
        for a, b in spans:
            if reach is None or a > reach:
                busy += b - a
                reach = b
            elif b > reach:
                busy += b - reach
                reach = b
        span = spans[-1][1] - spans[0][0] if spans else 0.0
        print(json.dumps(dict(step=name, tokens=step_tokens.get(name), host_ms=round((end - start) / 1e3, 2),
                              device_span_ms=round(span / 1e3, 2), device_busy_ms=round(busy / 1e3, 2),
                              kernels=len(spans))), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_arguments(p)
    p.add_argument("--method", default="full")
    p.add_argument("--param", action="append", help="a method parameter, name=value (repeatable)")
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("--context", type=int, default=32_000)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--sync-debug", action="store_true", help="count the host's waits in the last session")
    p.add_argument("--profile", type=Path, help="profile steps of the last session; the trace goes here")
    p.add_argument("--profile-from", type=int, default=100, help="the first profiled step")
    p.add_argument("--profile-steps", type=int, default=40)
    args = p.parse_args()
    params = parse_params(args.param)
    seen = compiled()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        llm = semkv.LLM(args.model or random_folder(args.shape, args.tokenizer, Path(tmp)))
    now = compiled()
    print(json.dumps(dict(semkv=semkv.__file__, load_s=round(time.perf_counter() - started, 1),
                          compiled_at_load=counted({k: v for k, v in now.items() if k not in seen}))), flush=True)
    seen = now
    text = TextContexts.from_files(args.text_file, llm.tokenizer)
    prompts = [text.window(i, args.requests, args.context) for i in range(args.requests)]
    sampling = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    for run in range(args.runs):
        started = time.perf_counter()
        session = Session(llm, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                          enable_prefix_caching=False)
        setup = time.perf_counter() - started
        for i, ids in enumerate(prompts):
            session.submit(i, ids, sampling, get_method(args.method, args.budget, **params), args.method)
        walls = []
        syncs = SyncSites() if args.sync_debug and run == args.runs - 1 else contextlib.nullcontext()
        torch.cuda.synchronize()
        started = time.perf_counter()
        profiled = args.profile is not None and run == args.runs - 1
        step_tokens: dict[str, int] = {}  # profiled step -> the tokens it computed (decode rows and prompt chunks)
        with syncs:
            while session.scheduler.busy:
                if profiled and len(walls) == args.profile_from:
                    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                                  torch.profiler.ProfilerActivity.CUDA])
                    profiler.start()
                step = time.perf_counter()
                if profiled and args.profile_from <= len(walls) < args.profile_from + args.profile_steps:
                    with torch.profiler.record_function(f"step {len(walls)}"):
                        session.advance()
                    step_tokens[f"step {len(walls)}"] = session.scheduler.counters.step_tokens
                else:
                    session.advance()
                walls.append(time.perf_counter() - step)
                if profiled and len(walls) == args.profile_from + args.profile_steps:
                    torch.cuda.synchronize()
                    profiler.stop()
                    report_profile(profiler, args.profile, step_tokens)
                    profiled = False
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        session.advance()  # counts the steps whose end the device had not reached at the last one
        counters, now = session.scheduler.counters, compiled()
        new = {k: v for k, v in now.items() if k not in seen}
        print(json.dumps(dict(
            run=run, session_setup_s=round(setup, 1), seconds=round(seconds, 2),
            output_per_s=round(args.requests * args.new_tokens / seconds), steps=dict(counters.timed_steps),
            step_ms={kind: round(1e3 * counters.step_seconds[kind] / count, 2)
                     for kind, count in counters.timed_steps.items() if count},
            slowest_steps_ms=[round(1e3 * w) for w in sorted(walls)[-6:]], compiled=counted(new),
            compiled_variants=sorted(new.values()),
            **(dict(syncs=dict(syncs.sites.most_common(25)), syncs_total=sum(syncs.sites.values()))
               if isinstance(syncs, SyncSites) else {}))), flush=True)
        seen = now


if __name__ == "__main__":
    main()
