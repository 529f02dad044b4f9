"""Where a server's step goes when a follow-up question on a cached document is admitted (issue 53's shared-document
workload): the served follow-ups' prefill steps took about 25 ms (58 with decoding rows) on an H200 for a suffix of
about 40 tokens, against 2.5 ms for a decode step.

One process loads the model (random weights of `--shape` unless `--model`) and runs a server's `Session` with prefix
caching on: the first question on each of `--documents` documents of `--context` tokens (cut from `--text-file`),
then `--questions` follow-ups a document, `--concurrency` in flight (a new one submitted as one ends, as a load
client does), `--new-tokens` each (EOS ignored). For the follow-ups' steps: their wall time by kind (decode only,
with prompt work), the steps that admitted a follow-up under cProfile (host functions by own time) and every wait
of the host for the device in them, by semkv call site (torch's sync debug mode). One JSON line, then the tables.

    python benchmarks/followup_steps.py --shape qwen2.5-0.5b --tokenizer DIR --text-file essays.txt
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

import semkv
from semkv.bench.run import TextContexts
from semkv.engine.sequence import SamplingParams
from semkv.llm import Session
from semkv.methods import get_method

from first_steps import SyncSites
from memory_soak import model_arguments, random_folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_arguments(p)
    p.add_argument("--method", default="full")
    p.add_argument("--context", type=int, default=32_000, help="document tokens")
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--questions", type=int, default=7, help="follow-ups a document")
    p.add_argument("--question-tokens", type=int, default=40, help="tokens a question adds to its document")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llm = semkv.LLM(args.model or random_folder(args.shape, args.tokenizer, Path(tmp)))
    text = TextContexts.from_files(args.text_file, llm.tokenizer)
    docs = [text.window(i, args.documents, args.context) for i in range(args.documents)]
    question = lambda d, q: docs[d] + text.window(q + 1, 97, args.question_tokens)  # noqa: E731
    sampling = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    session = Session(llm, max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=True)
    cuda = llm.engine.device.type == "cuda"
    ids = iter(range(10**6))
    for d in range(args.documents):  # the first questions: they cache the documents
        session.submit(next(ids), question(d, 0), sampling, get_method(args.method, 0.1), args.method)
    while session.scheduler.busy:
        session.advance()
    todo = [(d, q) for q in range(1, args.questions + 1) for d in range(args.documents)]
    live: dict[int, object] = {}
    walls = {"decode": [], "admit": []}
    profile, syncs = cProfile.Profile(), SyncSites() if cuda else contextlib.nullcontext()
    started = time.perf_counter()
    while todo or live:
        while todo and len(live) < args.concurrency:
            seq_id = next(ids)
            live[seq_id] = session.submit(seq_id, question(*todo.pop(0)), sampling, get_method(args.method, 0.1),
                                          args.method)
        admitting = bool(session.scheduler.waiting or session.scheduler.prefilling)
        if cuda:
            torch.cuda.synchronize()
        step = time.perf_counter()
        if admitting:
            with syncs:
                profile.enable()
                session.advance()
                profile.disable()
        else:
            session.advance()
        if cuda:
            torch.cuda.synchronize()
        walls["admit" if admitting else "decode"].append(time.perf_counter() - step)
        live = {k: s for k, s in live.items() if not s.finished}
    seconds = time.perf_counter() - started
    session.advance()
    counters = session.scheduler.counters
    print(json.dumps(dict(
        seconds=round(seconds, 2), followups=args.documents * args.questions,
        wall_ms={k: dict(count=len(v), mean=round(1e3 * statistics.mean(v), 2) if v else None,
                         max=round(1e3 * max(v), 2) if v else None) for k, v in walls.items()},
        step_ms={kind: round(1e3 * counters.step_seconds[kind] / count, 2)
                 for kind, count in counters.timed_steps.items() if count},
        cached_tokens=counters.cached_tokens,
        syncs=dict(syncs.sites.most_common(20)) if cuda else None)), flush=True)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(35)
    print(out.getvalue())
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(45)
    print(out.getvalue())


if __name__ == "__main__":
    main()
