"""Where a server's time goes: the same requests run by `LLM.generate` (whole prompts before decode steps) and by a
`Session` (the server's scheduler: steps of `max_num_batched_tokens`), with no web process in between.

For each method: `generate` of `--requests` prompts of `--context` tokens with `--new-tokens` each (one: the engine's
prompt rate, as `semkv bench --ttft` measures it, but for many prompts), then a `Session` per `--budgets` value given
all of them at once (at most `--max-num-seqs` running: a server at that concurrency) and stepped until done (prefix
caching off: every prompt is new), then, for `--profile` budgets, the same
session under cProfile (host functions by own time: where the host spends a step) and under torch's profiler (device
time of the run against its wall time: whether the steps wait on the host). One JSON line per run, and a table.

    python benchmarks/session_prefill.py --model qwen.gguf --text-file essays.txt --out DIR
    python benchmarks/session_prefill.py --shape qwen2.5-0.5b --tokenizer DIR --text-file essays.txt
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import tempfile
import time
from pathlib import Path

import torch

import semkv
from semkv.bench.run import TextContexts
from semkv.engine.sequence import SamplingParams
from semkv.llm import Session
from semkv.methods import get_method

from memory_soak import model_arguments, random_folder


def sync(llm: semkv.LLM) -> None:
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()


def run_session(llm: semkv.LLM, prompts: list[list[int]], method: str, budget: float, tokens: int, new: int,
                max_seqs: int | None) -> dict:
    """All prompts submitted at once to a session of `tokens` a step and `max_seqs` running requests, stepped until
    done."""
    session = Session(llm, max_num_batched_tokens=tokens, max_num_seqs=max_seqs, enable_prefix_caching=False)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    sync(llm)
    started = time.perf_counter()
    seqs = [session.submit(i, ids, params, get_method(method, budget), method) for i, ids in enumerate(prompts)]
    steps = 0
    while session.scheduler.busy:
        session.advance()
        steps += 1
    sync(llm)
    seconds = time.perf_counter() - started
    failed = [str(error) for _, error in session.scheduler.failed]
    counters = session.scheduler.counters
    return dict(seconds=seconds, steps=steps, failed=failed, output_tokens=sum(len(s.output_ids) for s in seqs),
                steps_by_kind=dict(counters.timed_steps),
                step_ms_by_kind={kind: round(1e3 * counters.step_seconds[kind] / count, 2)
                                 for kind, count in counters.timed_steps.items() if count},
                ttft_s=sorted(round(s.stats.queue_s + s.stats.prefill_s, 4) for s in seqs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_arguments(p)
    p.add_argument("--methods", default="full,chess,chunkkv")
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("--context", type=int, default=32_000)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=1, help="tokens each request generates (EOS ignored)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests a session runs at once")
    p.add_argument("--budgets", default="8192,32768", help="session step budgets (max_num_batched_tokens)")
    p.add_argument("--profile", default="8192", help="budgets profiled (host and device), with the first method")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llm = semkv.LLM(args.model or random_folder(args.shape, args.tokenizer, Path(tmp)))
    text = TextContexts.from_files(args.text_file, llm.tokenizer)
    prompts = [text.window(i, args.requests, args.context) for i in range(args.requests)]
    total = sum(map(len, prompts))
    out = args.out
    if out:
        out.mkdir(parents=True, exist_ok=True)
    rows = []

    def record(row: dict) -> None:
        row["tokens_per_s"] = round(total / row["seconds"])
        row["output_per_s"] = round(args.requests * args.new_tokens / row["seconds"])
        rows.append(row)
        line = json.dumps({k: v for k, v in row.items() if k != "ttft_s"})
        print(line, flush=True)
        if out:
            with open(out / "session_prefill.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    budgets = [int(b) for b in args.budgets.split(",")]
    session_args = (args.new_tokens, args.max_num_seqs)
    for method in args.methods.split(","):
        llm.generate(prompts[:2], method=method, budget=args.budget, max_new_tokens=2, ignore_eos=True)  # warm-up
        run_session(llm, prompts[:2], method, args.budget, budgets[0], 2, args.max_num_seqs)
        sync(llm)
        started = time.perf_counter()
        llm.generate(prompts, method=method, budget=args.budget, max_new_tokens=args.new_tokens, ignore_eos=True)
        sync(llm)
        record(dict(method=method, run="generate", seconds=time.perf_counter() - started))
        for tokens in budgets:
            record(dict(method=method, run=f"session {tokens}", **run_session(llm, prompts, method, args.budget,
                                                                              tokens, *session_args)))
    method = args.methods.split(",")[0]
    for tokens in [int(b) for b in args.profile.split(",") if b]:
        profiler = cProfile.Profile()
        profiler.enable()
        row = run_session(llm, prompts, method, args.budget, tokens, *session_args)
        profiler.disable()
        record(dict(method=method, run=f"session {tokens} under cProfile", **row))
        listing = io.StringIO()
        pstats.Stats(profiler, stream=listing).sort_stats("tottime").print_stats(30)
        print(listing.getvalue()[-6000:])
        if out:
            (out / f"cprofile_{tokens}.txt").write_text(listing.getvalue())
        if llm.engine.device.type == "cuda":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                row = run_session(llm, prompts, method, args.budget, tokens, *session_args)
            device_s = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
            record(dict(method=method, run=f"session {tokens} under torch.profiler", device_s=round(device_s, 3),
                        **row))
            table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25)
            print(table[-5000:])
            if out:
                (out / f"kernels_{tokens}.txt").write_text(table)
    print(f"\n{total} prompt tokens ({args.requests} x {args.context}), {args.new_tokens} new tokens each, "
          f"at most {args.max_num_seqs or 'all'} requests at once in a session")
    print(f"{'method':10s} {'run':34s} {'s':>8s} {'prompt tok/s':>12s} {'output tok/s':>12s} {'steps':>6s}")
    for row in rows:
        print(f"{row['method']:10s} {row['run']:34s} {row['seconds']:8.3f} {row['tokens_per_s']:12d} "
              f"{row['output_per_s']:12d} {row.get('steps', ''):>6}")


if __name__ == "__main__":
    main()
