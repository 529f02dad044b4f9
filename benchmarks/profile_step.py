"""Where the time of decode steps goes: torch.profiler over a run of the engine's loop (graph replay when the method
is graph-safe), with the table of the costliest operations by device time and by host time, and a Chrome trace.

    python benchmarks/profile_step.py --method chess --budget 0.01 --param chess.preset=aggressive \
        --batch 16 --context 32k --steps 40 --out OUT

40 steps cover a CHESS re-selection (every generated page of 32 tokens where the model is uncertain: always with
random weights). Model: `--shape` with random weights, as `semkv bench`, or `--model PATH` with `--text-file` for a
real prefill of text (real queries and logits: CHESS's uncertainty trigger and TokenSelect's Selection Cache as on real
text). The wall time of every profiled step is printed too, so a slow step (a re-selection) stands out.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from semkv.bench.cli import build_engine, load_tokenizer, method_params, parse_sizes
from semkv.bench.run import (WARMUP_STEPS, TextContexts, bound_method, largest_batch, never_stop, prefilled_batch,
                             sync)
from semkv.cli.args import parse_budget
from semkv.methods import get_method
from semkv.models.loader import resolve_device


def labelled(owner, names: tuple[str, ...], prefix: str) -> None:
    """Wrap the named methods of `owner` in profiler ranges, so the tables show the engine's and the method's
    phases (host time of each, device time of what they launch)."""
    for name in names:
        inner = getattr(owner, name, None)
        if inner is None:
            continue

        def wrapped(*a, _inner=inner, _label=f"{prefix}.{name}", **kw):
            with torch.profiler.record_function(_label):
                return _inner(*a, **kw)

        setattr(owner, name, wrapped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="chess")
    parser.add_argument("--budget", default="0.01")
    parser.add_argument("--param", action="append", default=[], help="M.name=value, as in semkv bench")
    parser.add_argument("--batch", default="16", help="batch size, or max: the largest Full KV fits")
    parser.add_argument("--context", default="32k")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=WARMUP_STEPS)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--model", default=None, help="a local model instead of a shape")
    parser.add_argument("--text-file", action="append", default=None, help="with --model: prefill from this text")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder for methods that read token text (sentencekv, dynsplit) on a shape")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of GPU memory for the KV pool (lower it for methods with large device state)")
    parser.add_argument("--out", type=Path, default=Path("profile"))
    args = parser.parse_args()
    engine_args = argparse.Namespace(dtype="auto", model=args.model, shape=args.shape, page_size=16, prefill_chunk=None,
                                     no_graphs=False, gpu_memory_utilization=args.gpu_memory_utilization)
    engine, label, tokenizer = build_engine(engine_args, resolve_device("auto"))
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else tokenizer
    text = TextContexts.from_files(args.text_file, tokenizer) if args.text_file else None
    params = method_params(args.param).get(args.method, {})
    budget = params.pop("budget", None if args.method == "full" else parse_budget(args.budget))
    method = get_method(args.method, budget, **params)
    method.bind(engine.config, tokenizer, engine.pool.page_size)
    context = parse_sizes(args.context, "context")[0]
    if args.batch == "max":
        args.batch = largest_batch(engine, bound_method(engine, "full", None), context, args.steps, args.warmup)
    args.batch = int(args.batch)
    with torch.inference_mode():
        seqs = prefilled_batch(engine, method, args.batch, context, args.warmup + args.steps + 8, text)
        graphs = engine.graph_runner(method, seqs)
        labelled(engine, ("prepare_step", "finish_step"), "engine")
        labelled(method, ("step_plan", "reselect", "fold", "page_dots", "mean_vector", "end_step", "select"),
                 args.method)
        for _ in range(args.warmup):
            engine.step(seqs, method, graphs, never_stop)
        sync(engine.device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
        step_ms = []
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                started = time.perf_counter()
                engine.step(seqs, method, graphs, never_stop)
                sync(engine.device)
                step_ms.append(round(1e3 * (time.perf_counter() - started), 2))
    args.out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(args.out / f"{args.method}_trace.json"))
    events = prof.key_averages()
    tables = {key: events.table(sort_by=key, row_limit=40)
              for key in ("self_cuda_time_total", "cpu_time_total")
              if key == "cpu_time_total" or engine.device.type == "cuda"}
    for key, table in tables.items():
        print(f"## {args.method} B={args.batch} ctx={context}: {args.steps} steps, sorted by {key}\n{table}")
    summary = dict(model=label, method=args.method, budget=budget, batch=args.batch, context=context,
                   steps=args.steps, graphs=graphs is not None, step_ms=step_ms)
    print(json.dumps(summary))
    (args.out / f"{args.method}_profile.md").write_text(json.dumps(summary) + "\n\n" + "\n\n".join(tables.values()))


if __name__ == "__main__":
    main()
