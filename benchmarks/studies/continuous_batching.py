"""Continuous batching of more long requests than fit at once, for a method with device state beside the KV pool
(DynSplit-KV's chunk rows, SentenceKV's sentence rows): every request completes, the batch never holds more than the
pool and the free memory allow, and the method's rows follow the requests running, not those submitted.

    python benchmarks/studies/continuous_batching.py --tokenizer DIR --text-file BOOK [--shape llama3-8b] [--method dynsplit]
        [--budget 2048] [--param NAME=VALUE] [--requests 14] [--context 32k] [--new-tokens 16]
        [--gpu-memory-utilization 0.9]

A model of the shape with random weights (speed and memory do not depend on the weights) prefills each request for
real with a window of the text (so the method sees delimiters) and decodes `--new-tokens` greedy tokens. Printed:
the largest running batch, the method's state beside the pool (the engine's accounting), peak GPU memory and the wall
time.
"""
from __future__ import annotations

import argparse
import time

import torch

from semkv.bench.cli import load_tokenizer, parse_sizes
from semkv.bench.run import TextContexts
from semkv.bench.shapes import random_model
from semkv.cli.args import parse_params
from semkv.engine.engine import Engine
from semkv.engine.kv_cache import SeqKV
from semkv.engine.memory import held_bytes
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.methods import get_method


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--method", default="dynsplit")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--param", action="append", metavar="NAME=VALUE", help="method parameter (repeatable)")
    p.add_argument("--requests", type=int, default=14)
    p.add_argument("--context", default="32k")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--text-file", required=True)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(args.shape, device, dtype)
    engine = Engine(model, model.config, device, dtype, gpu_memory_utilization=args.gpu_memory_utilization)
    tokenizer = load_tokenizer(args.tokenizer)
    text = TextContexts.from_files([args.text_file], tokenizer)
    method = get_method(args.method, args.budget, **parse_params(args.param))
    method.bind(model.config, tokenizer, engine.pool.page_size)
    context = parse_sizes(args.context, "context")[0]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    seqs = []
    for i in range(args.requests):
        seq = Sequence(i, text.window(i, args.requests, context), params, SeqKV(engine.pool))
        seq.method_state = method.new_state(seq)
        seqs.append(seq)
    submitted = held_bytes([method, *(s.method_state for s in seqs)], device)[0]
    batches, states, step = [], [], engine.step

    def counted_step(running, *rest, **kw):
        batches.append(len(running))
        states.append(sum(engine.memory().state_bytes.values()))
        return step(running, *rest, **kw)

    engine.step = counted_step
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    engine.run(seqs, method, lambda s: "length" if len(s.output_ids) >= params.max_new_tokens else "")
    elapsed = time.perf_counter() - started
    done = sum(len(s.output_ids) == params.max_new_tokens for s in seqs)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    print(f"{args.method} {args.requests} x {context} (+{args.new_tokens}): {done}/{args.requests} complete, "
          f"largest batch {max(batches)}, {len(batches)} decode steps; state beside the pool: "
          f"{submitted / 2**30:.3f} GiB once submitted, {max(states) / 2**30:.2f} GiB at most while running; "
          f"after the run the engine holds {engine.memory().held} (pages, requests, state and host bytes); "
          f"pool {engine.pool.num_pages} pages; peak GPU memory {peak:.1f} GiB; {elapsed:.1f} s")


if __name__ == "__main__":
    main()
