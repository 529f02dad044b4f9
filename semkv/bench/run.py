"""`semkv bench`: decode speed of methods over a batch x context grid, TTFT, peak memory, a per-step time breakdown and
TPOT over a long generation, on a model of a real shape with random weights (or a local model).

Decode measurements start from a cache filled with random K/V (`random_layers`: speed does not depend on the values), to
which each method's prefill-time work is applied (eviction with random window queries, summaries), layer after layer as
a real prefill of one chunk does (so peak memory holds one layer's whole prompt, not every layer's); TTFT runs a real
prefill. With a local model and texts (`TextContexts`) every sequence is instead prefilled for real with a window of the
texts, so the decode steps see the model's real queries: what a method whose work depends on them (TokenSelect's
Selection Cache, CHESS's re-selection trigger) does on real text. Methods that read token text (sentences, delimiters)
take a tokenizer (`--tokenizer`, by default a local model's own) whose vocabulary interprets the benchmark's token ids.
Steps are timed with CUDA events after warm-up (CUDA-graph capture included in the warm-up)."""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from semkv.engine.engine import Engine
from semkv.engine.kv_cache import SeqKV
from semkv.engine.offload import available_host_bytes
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.errors import SemkvError
from semkv.methods import KVMethod, get_method


@dataclass
class DecodeResult:
    method: str
    budget: int | float | None
    batch: int
    context: int
    tpot_ms: float  # median step
    tokens_per_s: float  # batch / mean step (periodic work such as re-selections and page allocation included)
    peak_memory_gib: float
    kv_pages_peak: int
    attended_per_layer: float
    graphs: bool
    tpot_mean_ms: float = 0.0
    forward_ms: float = 0.0  # median device time of the timed steps' graph replays, inputs copied in (0 eager)
    # selection time (host-side plan, per-layer selects, the plan's slots) / step time; None where the method selects
    # inside each layer of a captured graph, which host timing cannot see (the eager step breakdown shows it)
    selection_share: float | None = 0.0
    breakdown_ms: dict[str, float] = field(default_factory=dict)
    cache_hit_rate: float | None = None  # TokenSelect's Selection Cache over the timed steps (None: no such cache)
    host_gib: float = 0.0  # host memory the method's requests hold (offloaded K/V)
    h2d_mb_per_step: float = 0.0  # offloaded K/V read from host memory per timed step, all sequences (PCIe)
    served_tokens_per_s: float = 0.0  # as a server's scheduler runs the batch alone (`served_rate`): no wait a step


def random_layers(engine: Engine, seq: Sequence, context: int, seed: int = 0) -> Callable[[int], None]:
    """`fill(layer)`: stores `context` tokens of random K/V (unit-variance keys and values) and 64 random window
    queries in that layer of `seq`; layers are filled in order."""
    gen = torch.Generator(device=engine.device).manual_seed(seed)
    cfg, kv = engine.config, seq.kv

    def fill(layer: int) -> None:
        kv.ensure_slots(layer, context)
        for start in range(0, context, 8192):
            n = min(8192, context - start)
            shape = (n, cfg.num_kv_heads, cfg.head_dim)
            k = torch.randn(shape, generator=gen, device=engine.device).to(engine.dtype)
            v = torch.randn(shape, generator=gen, device=engine.device).to(engine.dtype)
            slots = torch.arange(start, start + n, device=engine.device)
            kv.write(layer, slots, k, v, slots)
        kv.num_slots[layer] = context
        seq.window_queries[layer] = torch.randn(64, cfg.num_heads, cfg.head_dim, generator=gen,
                                                device=engine.device).to(engine.dtype)

    seq.num_computed = context
    return fill


@dataclass
class TextContexts:
    """Real contexts: sequence i of a batch of B prefills `context` tokens of the texts' token stream, starting i/B of
    the way through it (the stream repeats where a window runs past its end)."""
    ids: list[int]  # the texts' tokens, concatenated

    @classmethod
    def from_files(cls, paths: list[str], tokenizer) -> "TextContexts":
        texts = []
        for path in paths:
            try:
                texts.append(Path(path).read_text(encoding="utf-8-sig"))
            except (OSError, UnicodeDecodeError) as exc:
                raise SemkvError(f"--text-file {path!r}: cannot read it as UTF-8 text ({exc})") from None
        ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]
        if not ids:
            raise SemkvError(f"--text-file {', '.join(paths)}: no tokens (the files are empty)")
        return cls(ids)

    def window(self, index: int, batch: int, context: int) -> list[int]:
        start = index * len(self.ids) // batch
        repeats = -(-(start + context) // len(self.ids))
        return (self.ids * repeats)[start:start + context]


WARMUP_STEPS = 4  # untimed decode steps before a timed run (CUDA-graph capture, compilation)


def synthetic_ids(engine: Engine, index: int, context: int) -> list[int]:
    """The token ids of sequence `index` of a batch on random K/V (spread over the vocabulary, so that methods that
    read token text see ordinary text statistics, not one repeated token)."""
    return [1 + (index * 7919 + t) % (engine.config.vocab_size - 2) for t in range(context)]


def bench_tokens(steps: int, warmup: int = WARMUP_STEPS) -> int:
    """The generation a `bench_decode` run of `steps` timed steps allows: the warm-up, the timed and the served steps
    (`served_rate`), the breakdown's and some room."""
    return warmup + 2 * steps + 8


def largest_batch(engine: Engine, method: KVMethod, context: int, steps: int, warmup: int = WARMUP_STEPS) -> int:
    """The largest batch of `context`-token sequences a `bench_decode` run of `steps` steps keeps: its KV pages in
    the engine's fixed pool (each sequence at the method's `device_tokens` bound, or every token: Full KV, while the
    last one prefills: `Engine.pages_needed`), its state beside the pool (rows of requests, and state kept by page for
    every page the batch holds, as the pool grows it: `KVPool.growth_peak`, the last grown tables beside the ones
    before, and a decode step's logits), and its offloaded K/V in host memory."""
    if engine.pool.max_pages is None:
        raise SemkvError("--batches max needs a KV pool of fixed size (a CUDA device); give batch sizes")
    new = bench_tokens(steps, warmup)
    layers, page = engine.config.num_layers, engine.pool.page_size
    seq = Sequence(0, synthetic_ids(engine, 0, context), SamplingParams(max_new_tokens=new), SeqKV(engine.pool))
    if method.device_tokens(context, new, page) is None:  # Full KV: the warm-up, timed, served and 2 breakdown steps
        prefill = per_seq = layers * -(-(context + warmup + 2 * steps + 2) // page)
    else:
        prefill, per_seq = engine.pages_needed(seq, method, prefill=True), engine.pages_needed(seq, method)
    pool = engine.pool
    free = pool.available
    if free < prefill:
        raise SemkvError(f"one sequence of {context} tokens needs {prefill} KV pages; the pool has {free} free")
    batch = (free - prefill) // per_seq + 1
    seq.method_state = method.new_state(seq)  # a request like the benchmark's, not admitted
    host, room = method.admission_host_bytes(seq), engine.state_room(method)
    if host:
        batch = min(batch, int(available_host_bytes() // host))

    logits = engine.config.vocab_size * (engine.dtype.itemsize + 4)  # a decode step's, a row: the head's, float32

    def state(batch: int) -> int:
        covered = pool.touched + prefill + (batch - 1) * per_seq
        per_page = pool.page_state_bytes() + method.page_state_bytes(pool)
        return method.batch_state_bytes(seq, batch) + batch * logits + per_page * pool.growth_peak(covered)

    if math.isfinite(room) and state(batch) > room:  # the largest batch whose state fits (state grows with it)
        low, high = 1, batch
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if state(mid) <= room else (low, mid - 1)
        batch = low
    method.reset()
    return max(batch, 1)


def bound_method(engine: Engine, name: str, budget, params: dict | None = None, tokenizer=None) -> KVMethod:
    """A method of the registry, bound to the engine's model (what `bench_decode` runs)."""
    method = get_method(name, budget, **(params or {}))
    method.bind(engine.config, tokenizer, engine.pool.page_size)
    return method


def prefilled_batch(engine: Engine, method: KVMethod, batch: int, context: int, new_tokens: int,
                    text: TextContexts | None = None) -> list[Sequence]:
    """`batch` sequences of `context` tokens with the method's prefill work done and a first output token: random K/V
    under synthetic token ids, or a real prefill of windows of `text` (then the first token is the model's greedy
    one)."""
    seqs = []
    try:
        for i in tqdm(range(batch), desc="prefill batch", unit="seq", disable=text is None or batch == 1, leave=False):
            ids = text.window(i, batch, context) if text is not None else synthetic_ids(engine, i, context)
            seq = Sequence(i, ids, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), SeqKV(engine.pool))
            seqs.append(seq)
            if text is not None:
                seq.method_state = method.new_state(seq)
                seq.output_ids.append(int(engine.prefill(seq, method).argmax()))
                continue
            fill = random_layers(engine, seq, context, seed=i)
            if engine.prefill_order(context, method) == "by chunk":
                for layer in range(engine.config.num_layers):  # several chunks, chunk after chunk: every layer's
                    fill(layer)                                # prompt at once
                fill = None
            engine.apply_prefill(seq, method, fill)  # else one layer's at a time (one chunk, or a prefill by layer)
            seq.output_ids.append(ids[-1])
    except (MemoryError, torch.OutOfMemoryError):  # the pool or the device cannot hold the batch: give back what
        engine.end(seqs, method)                    # was filled
        raise
    return seqs


class EventTimer:
    """Times regions of the decode step with CUDA events (or the host clock on the CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list] = {}

    def start(self, name: str):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return name, event
        return name, time.perf_counter()

    def stop(self, token) -> None:
        name, begin = token
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.spans.setdefault(name, []).append((begin, end))
        else:
            self.spans.setdefault(name, []).append(time.perf_counter() - begin)

    def totals_ms(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            return {k: sum(b.elapsed_time(e) for b, e in v) for k, v in self.spans.items()}
        return {k: 1e3 * sum(v) for k, v in self.spans.items()}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(engine: Engine, method: KVMethod, seqs: list[Sequence], steps: int, graphs) -> list[float]:
    """Seconds per decode step for `steps` steps of the engine's loop: the forward, sampling and the method's
    per-step bookkeeping (`end_step`), as in generation."""
    times = []
    for _ in range(steps):
        sync(engine.device)
        started = time.perf_counter()
        engine.step(seqs, method, graphs, never_stop)
        sync(engine.device)
        times.append(time.perf_counter() - started)
    return times


def served_rate(engine: Engine, method: KVMethod, seqs: list[Sequence], steps: int, graphs) -> float:
    """Tokens/s of `steps` decode steps run as a server's scheduler runs a batch decoding alone: where the method's
    steps may be pipelined (`Engine.pipelines`), each is launched before the last one is completed, from the inputs
    that one prepared, so the host's work of a step overlaps the device's of the last; else one after another. The
    host waits only to read each step's tokens, not for the device to go idle between steps."""
    pipeline = engine.pipelines(method)
    sync(engine.device)
    started = time.perf_counter()
    launched = engine.launch_step(seqs, method, graphs, early=True)
    for _ in range(steps - 1):
        if pipeline and engine.ready_ahead(seqs):
            after = engine.launch_step(seqs, method, graphs, early=True, behind=1)
            engine.complete_step(launched, never_stop)
            launched = after
        else:
            engine.complete_step(launched, never_stop)
            launched = engine.launch_step(seqs, method, graphs, early=True)
    engine.complete_step(launched, never_stop)
    sync(engine.device)
    return len(seqs) * steps / (time.perf_counter() - started)


def never_stop(seq: Sequence) -> None:
    return None


@torch.inference_mode()
def bench_decode(engine: Engine, name: str, budget, batch: int, context: int, steps: int = 32,
                 warmup: int = WARMUP_STEPS, params: dict | None = None, tokenizer=None,
                 text: TextContexts | None = None) -> DecodeResult:
    method = bound_method(engine, name, budget, params, tokenizer)
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    engine.pool.peak_in_use = engine.pool.in_use
    seqs = prefilled_batch(engine, method, batch, context, bench_tokens(steps, warmup), text)
    try:
        graphs = engine.graph_runner(method, seqs)
        time_steps(engine, method, seqs, warmup, graphs)
        selection_before, decode_before = sum(s.stats.selection_s for s in seqs), seqs[0].stats.decode_s
        lookups_before = cache_counts(seqs)
        h2d_before = sum(s.stats.h2d_bytes for s in seqs)
        if graphs is not None:
            graphs.replay_events = []
        times = sorted(time_steps(engine, method, seqs, steps, graphs))
        h2d = (sum(s.stats.h2d_bytes for s in seqs) - h2d_before) / steps
        host = sum(engine.memory().host_bytes.values())
        forward = median_event_seconds(graphs.replay_events) if graphs is not None else 0.0
        if graphs is not None:
            graphs.replay_events = None
        hit_rate = cache_hit_rate(lookups_before, cache_counts(seqs))
        tpot, mean = times[len(times) // 2], sum(times) / len(times)
        selection = sum(s.stats.selection_s for s in seqs) - selection_before + steps * plan_selection_s(engine, graphs)
        share = selection / (seqs[0].stats.decode_s - decode_before)
        if forward and type(method).select is not KVMethod.select:
            share = None
        served = served_rate(engine, method, seqs, steps, graphs)
        breakdown = step_breakdown(engine, method, seqs)
        attended = sum(s.attended_total / max(s.num_computed - context, 1) for s in seqs) / batch
        peak = needed_memory_gib(engine)
    finally:
        engine.end(seqs, method)
    return DecodeResult(name, budget, batch, context, 1e3 * tpot, batch / mean, peak, engine.pool.peak_in_use,
                        attended, graphs is not None, 1e3 * mean, 1e3 * forward, share, breakdown, hit_rate,
                        host / 2**30, h2d / 2**20, served)


def cache_counts(seqs: list[Sequence]) -> tuple[int, int] | None:
    """Selection Cache hits and lookups of a batch so far (None: the method keeps no such cache)."""
    extras = [s.stats.extra for s in seqs if "selection_cache_lookups" in s.stats.extra]
    if not extras:
        return None
    return sum(e["selection_cache_hits"] for e in extras), sum(e["selection_cache_lookups"] for e in extras)


def cache_hit_rate(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    if before is None or after is None or after[1] == before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _graphed(graphs):
    return next(iter(graphs.steps.values())) if graphs is not None and graphs.steps else None


def _event_seconds(engine: Engine, work, repeat: int = 10) -> float:
    """Median device time of `work()` (CUDA events), 0 off CUDA."""
    if engine.device.type != "cuda":
        return 0.0
    events = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        events.append((start, end))
    return median_event_seconds(events)


def median_event_seconds(events: list) -> float:
    """Median of (start, end) CUDA event pairs in seconds (0 for none: eager steps off CUDA)."""
    times = sorted(start.elapsed_time(end) / 1e3 for start, end in events)
    return times[len(times) // 2] if times else 0.0


def plan_selection_s(engine: Engine, graphs) -> float:
    """Device time of a method's `plan_selection` as it runs inside the decode graph: captured alone in a CUDA graph
    over the decode graph's static buffers and replayed."""
    graphed = _graphed(graphs)
    if graphed is None or graphed.plan is None or graphed.graph is None:
        return 0.0

    def select():
        return graphed.method.plan_selection(graphed.batch, graphed.plan)

    stream = engine.capture_stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        planned = select()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    if planned is None:  # the method selects inside each layer (TokenSelect): nothing runs before the forward
        return 0.0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        select()
    return _event_seconds(engine, graph.replay)


def needed_memory_gib(engine: Engine) -> float:
    """Peak GPU memory the run needed: the peak of everything allocated, with the pre-allocated KV pool counted by
    its pages in use at the peak (the pool itself is sized from free memory, the same for every method)."""
    if engine.device.type != "cuda":
        return 0.0
    pool = engine.pool
    pool_bytes = sum(x.numel() * x.element_size() for x in (pool.k, pool.v, pool.pos))
    used = pool_bytes * pool.peak_in_use / pool.num_pages
    return (torch.cuda.max_memory_allocated(engine.device) - pool_bytes + used) / 2**30


def step_breakdown(engine: Engine, method: KVMethod, seqs: list[Sequence]) -> dict[str, float]:
    """One eager step with its selection (the method's work before, inside and after the forward) and attention
    regions timed (ms); `rest` is everything else. An untimed eager step first compiles what eager steps launch
    (graph replays did not)."""
    engine.step(seqs, method, None, never_stop)
    timer = EventTimer(engine.device)
    engine.timer = timer
    try:
        whole = timer.start("step")
        engine.step(seqs, method, None, never_stop)
        timer.stop(whole)
    finally:
        engine.timer = None
    totals = timer.totals_ms()
    step = totals.pop("step")
    return dict(step=step, **totals, rest=step - sum(totals.values()))


def prefill_flops(config, context: int) -> float:
    """Floating-point operations of a prefill of `context` tokens: every token through the linear layers, causal
    attention (q . k and p . v over each query's earlier tokens), the LM head at the last token."""
    heads, kv_heads, dim, hidden = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size
    linear = hidden * (heads + 2 * kv_heads) * dim + heads * dim * hidden + 3 * hidden * config.intermediate_size
    attention = 4 * heads * dim * context * (context + 1) / 2
    return config.num_layers * (2 * context * linear + attention) + 2 * hidden * config.vocab_size


@torch.inference_mode()
def bench_ttft(engine: Engine, name: str, budget, context: int, params: dict | None = None, tokenizer=None,
               text: TextContexts | None = None, repeats: int = 2) -> list[float]:
    """Seconds from prompt to first token (a real prefill) for one request, `repeats` requests one after the other:
    the first pays what the method's first request pays in a process (the engine's own warm-up is done at load)."""
    method = bound_method(engine, name, budget, params, tokenizer)
    ids = (text.window(0, 1, context) if text is not None
           else [1 + t % (engine.config.vocab_size - 2) for t in range(context)])
    times = []
    for _ in range(repeats):
        seq = Sequence(0, ids, SamplingParams(max_new_tokens=1), SeqKV(engine.pool))
        seq.method_state = method.new_state(seq)
        sync(engine.device)
        started = time.perf_counter()
        engine.prefill(seq, method)
        sync(engine.device)
        times.append(time.perf_counter() - started)
        engine.end([seq], method)
    return times


@torch.inference_mode()
def bench_long_generation(engine: Engine, name: str, budget, context: int, new_tokens: int, every: int = 100,
                          params: dict | None = None, tokenizer=None,
                          text: TextContexts | None = None) -> list[tuple[int, float]]:
    """(generated tokens, TPOT ms) every `every` steps over a long generation at batch 1."""
    method = bound_method(engine, name, budget, params, tokenizer)
    seqs = prefilled_batch(engine, method, 1, context, new_tokens + 8, text)
    graphs = engine.graph_runner(method, seqs)
    curve = []
    for done in range(0, new_tokens, every):
        times = sorted(time_steps(engine, method, seqs, min(every, new_tokens - done), graphs))
        curve.append((done + every, 1e3 * times[len(times) // 2]))
    engine.end(seqs, method)
    return curve
