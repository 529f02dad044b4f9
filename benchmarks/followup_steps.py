"""Where a server's step goes when a follow-up question on a cached document is admitted (issue 53's shared-document
workload): the served follow-ups' prefill steps took about 25 ms (58 with decoding rows) on an H200 for a suffix of
about 40 tokens, against 2.5 ms for a decode step.

One process loads the model (random weights of `--shape` unless `--model`) and runs a server's `Session` with prefix
caching on: the first question on each of `--documents` documents of `--context` tokens (cut from `--text-file`),
then `--questions` follow-ups a document, `--concurrency` in flight (a new one submitted as one ends, as a load
client does), `--new-tokens` each (EOS ignored; with `--stagger` the requests ask for different counts, so that they
end in different steps and follow-ups are admitted one at a time, or with `--groups` a few at a time, as a served
load's arrive). For the follow-ups'
steps: their wall time by kind (decode only, or admitting k follow-ups), each follow-up's time to its first token
(from its submission to the token's publication inside a step, `Scheduler.publish`, or the step's end), the host
time of the admission's and the prefill's functions in the admitting steps (`TIMED`, timed inclusively), the caching
allocator's device allocations and every wait of the host for the device in them, by semkv call site (torch's sync
debug mode). With `--warm-up`, the server's warm-up (`Session.warm_up`) first. One JSON line; with
`--trace N` torch.profiler's tables over the first N admitting steps (and each one's host time against its device
busy time), with `--profile` cProfile's of them (which slows them about 1.3x).

    python benchmarks/followup_steps.py --shape qwen2.5-0.5b --tokenizer DIR --text-file essays.txt --stagger 16
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
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
from semkv.cli.args import parse_params
from semkv.engine import step as engine_step
from semkv.engine.engine import Engine
from semkv.engine.kv_cache import KVPool, SeqKV
from semkv.engine.prefix_cache import PrefixCache, PromptKeys
from semkv.engine.scheduler import Scheduler
from semkv.engine.sequence import SamplingParams
from semkv.llm import Session
from semkv.methods import get_method

from first_steps import SyncSites, report_profile
from memory_soak import model_arguments, random_folder


TIMED = {  # host functions timed (inclusive, nested ones too) in the steps that admit follow-ups
    "lookup_prefix": (Engine, "lookup_prefix"), "  PromptKeys": (PromptKeys, "__init__"),
    "  match": (PrefixCache, "match"), "  share": (SeqKV, "share"), "  reserve": (SeqKV, "reserve"),
    "start_prefill": (Engine, "start_prefill"), "blocked": (Engine, "blocked"),
    "prefill_together": (Engine, "prefill_together"), "continue_prefill": (Engine, "continue_prefill"),
    "cache_prompt": (Engine, "cache_prompt"), "_first_tokens": (Scheduler, "_first_tokens"),
    "_choose_first": (Scheduler, "_choose_first"), "_batch": (Scheduler, "_batch"),
    "graph_runner": (Engine, "graph_runner"), "launch_step": (Engine, "launch_step"),
    "complete_step": (Engine, "complete_step"),
    "  evict_layer": (engine_step, "evict_layer"), "  evict_layers": (engine_step, "evict_layers"),
    "    compact": (SeqKV, "compact"),
    "      unshare": (SeqKV, "unshare"), "        pool.release": (KVPool, "release"),
    "_chunks_done": (Engine, "_chunks_done"), "end_prompt": (Engine, "end_prompt"),
}


class Timers:
    """Host time of the `TIMED` functions while `on` (wrapped in place for the process)."""

    def __init__(self) -> None:
        self.on, self.seconds, self.calls = False, collections.Counter(), collections.Counter()
        for label, (owner, name) in TIMED.items():
            if hasattr(owner, name):  # (an older tree, for A/B runs, may lack one)
                setattr(owner, name, self._wrapped(label, getattr(owner, name)))

    def _wrapped(self, label: str, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            if not self.on:
                return function(*args, **kwargs)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1
        return timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_arguments(p)
    p.add_argument("--method", default="full")
    p.add_argument("--param", action="append", help="a method parameter, name=value (repeatable)")
    p.add_argument("--context", type=int, default=32_000, help="document tokens")
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--questions", type=int, default=7, help="follow-ups a document")
    p.add_argument("--question-tokens", type=int, default=40, help="tokens a question adds to its document")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--stagger", type=int, default=0,
                   help="the i-th of the concurrent requests asks for new-tokens + i * stagger tokens, so that they "
                        "end in different steps and follow-ups arrive one at a time, as a served load's do")
    p.add_argument("--groups", type=int, default=None,
                   help="with --stagger: the concurrent requests in this many groups, the g-th asking for new-tokens "
                        "+ g * stagger tokens (a round's follow-ups arrive over that many steps; default: one group "
                        "each)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--warm-up", action="store_true", help="Session.warm_up with the method first, as semkv serve does")
    p.add_argument("--profile", action="store_true", help="cProfile the admitting steps (slows them)")
    p.add_argument("--trace", type=int, default=0, help="torch.profiler over this many admitting steps")
    p.add_argument("--trace-dir", type=Path, default=Path("followup_trace"))
    args = p.parse_args()
    params = parse_params(args.param)
    with tempfile.TemporaryDirectory() as tmp:
        llm = semkv.LLM(args.model or random_folder(args.shape, args.tokenizer, Path(tmp)))
    text = TextContexts.from_files(args.text_file, llm.tokenizer)
    docs = [text.window(i, args.documents, args.context) for i in range(args.documents)]
    question = lambda d, q: docs[d] + text.window(q + 1, 97, args.question_tokens)  # noqa: E731
    groups = args.groups or args.concurrency
    sampling = lambda slot: SamplingParams(  # noqa: E731
        max_new_tokens=args.new_tokens + slot * groups // args.concurrency * args.stagger, ignore_eos=True)
    session = Session(llm, max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=True)
    cuda = llm.engine.device.type == "cuda"
    warm_up = time.perf_counter()
    if args.warm_up:
        session.warm_up(get_method(args.method, 0.1, **params), args.method)
    warm_up = time.perf_counter() - warm_up
    ids = iter(range(10**6))
    for d in range(args.documents):  # the first questions: they cache the documents
        session.submit(next(ids), question(d, 0), sampling(0), get_method(args.method, 0.1, **params), args.method)
    while session.scheduler.busy:
        session.advance()
    todo = [(d, q) for q in range(1, args.questions + 1) for d in range(args.documents)]
    live: dict[int, tuple[int, object]] = {}  # request id -> (its slot, its sequence)
    walls: dict[str, list[float]] = collections.defaultdict(list)  # "decode" / "admit k" -> step seconds
    timers, profile = Timers(), cProfile.Profile()
    syncs = SyncSites() if cuda else contextlib.nullcontext()
    # torch.profiler from the first admitting step to the last traced one
    tracer, traced = torch.profiler.profile() if args.trace else None, 0
    memory = torch.cuda.memory_stats() if cuda else {}
    # each follow-up's TTFT: from its submission to its first token given to the caller, inside a step where the
    # scheduler publishes it (`Scheduler.publish`, as the server sends it), else when the step returns
    submitted, ttft = {}, []

    def answered() -> None:
        now = time.perf_counter()
        for _, seq in live.values():
            if seq.output_ids and seq in submitted:
                ttft.append(now - submitted.pop(seq))

    session.scheduler.publish = answered
    started = time.perf_counter()
    while todo or live:
        free = sorted(set(range(args.concurrency)) - {slot for slot, _ in live.values()})
        for slot in free[: len(todo)]:
            seq_id = next(ids)
            live[seq_id] = slot, session.submit(seq_id, question(*todo.pop(0)), sampling(slot),
                                                get_method(args.method, 0.1, **params), args.method)
            submitted[live[seq_id][1]] = time.perf_counter()
        admitted = session.scheduler.counters.admitted
        admitting = bool(session.scheduler.waiting or session.scheduler.prefilling)
        if cuda:
            torch.cuda.synchronize()
        step = time.perf_counter()
        if admitting:
            timers.on = True
            if tracer is not None and traced == 0:
                tracer.start()
            with syncs, (torch.profiler.record_function(f"step {traced}: admitting")
                         if tracer is not None and traced < args.trace else contextlib.nullcontext()):
                if args.profile:
                    profile.enable()
                session.advance()
                if args.profile:
                    profile.disable()
                if cuda:
                    torch.cuda.synchronize()
            timers.on = False
            traced += 1
            if tracer is not None and traced == args.trace:
                tracer.stop()
        else:
            session.advance()
        if cuda:
            torch.cuda.synchronize()
        kind = f"admit {session.scheduler.counters.admitted - admitted}" if admitting else "decode"
        walls[kind].append(time.perf_counter() - step)
        answered()
        live = {k: v for k, v in live.items() if not v[1].finished}
    seconds = time.perf_counter() - started
    session.advance()
    counters = session.scheduler.counters
    after = torch.cuda.memory_stats() if cuda else {}
    admits = sum(len(v) for k, v in walls.items() if k != "decode")
    print(json.dumps(dict(
        seconds=round(seconds, 2), warm_up_seconds=round(warm_up, 2), followups=args.documents * args.questions,
        stagger=args.stagger, groups=groups,
        wall_ms={k: dict(count=len(v), mean=round(1e3 * statistics.mean(v), 2),
                         median=round(1e3 * statistics.median(v), 2), max=round(1e3 * max(v), 2))
                 for k, v in sorted(walls.items())},
        ttft_ms=dict(count=len(ttft), mean=round(1e3 * statistics.mean(ttft), 2),
                     median=round(1e3 * statistics.median(ttft), 2), max=round(1e3 * max(ttft), 2)),
        host_ms_per_admitting_step={k: round(1e3 * v / max(admits, 1), 3) for k, v in timers.seconds.items()},
        calls=dict(timers.calls), cached_tokens=counters.cached_tokens,
        allocator={k: after.get(k, 0) - memory.get(k, 0) for k in
                   ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")},
        syncs=dict(syncs.sites.most_common(20)) if cuda else None)), flush=True)
    if args.trace:
        report_profile(tracer, args.trace_dir, {})
    if args.profile:
        for order, rows in (("tottime", 35), ("cumulative", 45)):
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats(order).print_stats(rows)
            print(out.getvalue())


if __name__ == "__main__":
    main()
