"""The server's Prometheus metrics (`/metrics`), kept in the web process: requests and tokens by KV method, latencies,
the queue, and what the engine process reports each loop iteration (`messages.Outputs`): the scheduler's counters
(prefix-cache hits, preemptions, tokens per step) and the engine's memory (`Engine.memory()`: KV pool pages, live
requests, method state on the device and in host memory)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from semkv.engine.memory import MemoryUsage
from semkv.engine.scheduler import Counters
from semkv.engine.sequence import GenerationStats
from semkv.serve.messages import Outputs

SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("semkv_requests", "requests that ended, by KV method and outcome "
                                "(finished, cancelled, error, rejected)", ["method", "outcome"], registry=registry)
        self.prompt_tokens = Counter("semkv_prompt_tokens", "prompt tokens of finished requests", ["method"],
                                     registry=registry)
        self.generation_tokens = Counter("semkv_generation_tokens", "tokens generated", ["method"], registry=registry)
        self.ttft = Histogram("semkv_time_to_first_token_seconds", "from a request's arrival to its first token",
                              registry=registry, buckets=SECONDS)
        self.latency = Histogram("semkv_request_duration_seconds", "from arrival to the last token of finished "
                                 "requests", registry=registry, buckets=(0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.queue_time = Histogram("semkv_request_queue_time_seconds", "from a request's arrival at the engine to "
                                    "its admission (waiting for memory or its turn)", registry=registry,
                                    buckets=SECONDS)
        self.batch = Histogram("semkv_decode_batch_size", "requests in a method's batch at each engine step",
                               registry=registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.step_tokens = Histogram("semkv_engine_step_tokens", "tokens one engine step computed: one per decoding "
                                     "request plus the prefill chunks", registry=registry,
                                     buckets=(1, 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536))
        self.steps = Counter("semkv_engine_steps", "engine steps by kind: decode (decode rows only), mixed (decode "
                             "rows and prompt chunks), prefill (prompt chunks only)", ["kind"], registry=registry)
        self.step_seconds = Counter("semkv_engine_step_seconds", "time of those steps, from a step's first kernel to "
                                    "its last as the device ran them (wall time on the CPU)", ["kind"],
                                    registry=registry)
        self.lag = Histogram("semkv_engine_output_lag_seconds", "from the engine process sending an iteration's "
                             "outputs to the web process routing them", registry=registry,
                             buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5))
        self.cache_queries = Counter("semkv_prefix_cache_queries", "prompt tokens of admitted requests (looked up in "
                                     "the prefix cache)", registry=registry)
        self.cache_hits = Counter("semkv_prefix_cache_hits", "prompt tokens read from the prefix cache instead of "
                                  "computed", registry=registry)
        self.cache_hit_rate = Gauge("semkv_prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries since "
                                    "the start", registry=registry)
        self.preemptions = Counter("semkv_preemptions", "running requests whose pages were freed to make room "
                                   "(recomputed later)", registry=registry)
        self.running = Gauge("semkv_requests_running", "requests admitted and running", registry=registry)
        self.waiting = Gauge("semkv_requests_waiting", "requests queued for admission", registry=registry)
        self.in_flight = Gauge("semkv_requests_in_flight", "requests accepted and not yet answered",
                               registry=registry)
        self.pool_pages = Gauge("semkv_kv_pool_pages", "KV pool pages (scratch page excluded from in_use)",
                                ["state"], registry=registry)
        self.page_bytes = Gauge("semkv_kv_page_bytes", "bytes of one KV page, every layer", registry=registry)
        self.live = Gauge("semkv_engine_live_requests", "requests holding pages or method state", registry=registry)
        self.state_bytes = Gauge("semkv_method_state_bytes", "bytes a method's live requests hold beside the KV pool",
                                 ["method", "memory"], registry=registry)
        self.counted = Counters()  # the engine's counters as last seen
        self.pool: MemoryUsage | None = None  # the engine's memory as last seen
        self.queue = (0, 0)  # requests (running, waiting) as last seen
        self.prefilled = self.generated = 0  # prompt tokens of requests with a first token; tokens generated
        self.logged = (0, 0)  # (prefilled, generated) at the last `summary`

    def ended(self, method: str, outcome: str, prompt_tokens: int = 0, seconds: float | None = None,
              stats: GenerationStats | None = None) -> None:
        """A request ended: "finished", "cancelled", "error" or "rejected" (429)."""
        self.requests.labels(method, outcome).inc()
        if outcome in ("error", "rejected"):
            return
        self.prompt_tokens.labels(method).inc(prompt_tokens)
        if outcome == "finished" and seconds is not None:
            self.latency.observe(seconds)
        if stats is not None and outcome == "finished":
            self.queue_time.observe(stats.queue_s)

    def first_token(self, seconds: float, prompt_tokens: int) -> None:
        self.ttft.observe(seconds)
        self.prefilled += prompt_tokens

    def tokens(self, method: str, n: int) -> None:
        self.generation_tokens.labels(method).inc(n)
        self.generated += n

    def summary(self, seconds: float) -> str | None:
        """What the server did in the last `seconds`, in one log line (as vLLM logs it); None when it did nothing."""
        done = (self.prefilled - self.logged[0], self.generated - self.logged[1])
        self.logged = (self.prefilled, self.generated)
        running, waiting = self.queue
        if not any(done) and not running and not waiting:
            return None
        pool, counted = self.pool, self.counted
        used = f"{100 * pool.pages_in_use / max(pool.pool_pages, 1):.1f}%" if pool else "?"
        hits = f"{100 * counted.cached_tokens / counted.prompt_tokens:.1f}%" if counted.prompt_tokens else "-"
        return (f"prompt throughput {done[0] / seconds:.1f} tokens/s, generation throughput {done[1] / seconds:.1f} "
                f"tokens/s, running {running}, waiting {waiting}, KV pool pages in use {used}, prefix cache hit rate "
                f"{hits}")

    def iteration(self, outputs: Outputs, lag: float) -> None:
        """One iteration of the engine loop, `lag` seconds after it was sent."""
        self.lag.observe(lag)
        self.queue = (outputs.running, outputs.waiting)
        self.running.set(outputs.running)
        self.waiting.set(outputs.waiting)
        for size in outputs.batch_sizes:
            self.batch.observe(size)
        now, before = outputs.counters, self.counted
        if now.steps > before.steps:
            self.step_tokens.observe(now.step_tokens)
        self.cache_queries.inc(now.prompt_tokens - before.prompt_tokens)
        self.cache_hits.inc(now.cached_tokens - before.cached_tokens)
        self.preemptions.inc(now.preemptions - before.preemptions)
        for kind, n in now.timed_steps.items():
            self.steps.labels(kind).inc(n - before.timed_steps[kind])
            self.step_seconds.labels(kind).inc(now.step_seconds[kind] - before.step_seconds[kind])
        if now.prompt_tokens:
            self.cache_hit_rate.set(now.cached_tokens / now.prompt_tokens)
        self.counted = now
        if outputs.memory is not None:
            self.memory(outputs.memory)

    def memory(self, memory: MemoryUsage) -> None:
        self.pool = memory
        self.pool_pages.labels("total").set(memory.pool_pages)
        self.pool_pages.labels("in_use").set(memory.pages_in_use)
        self.page_bytes.set(memory.page_bytes)
        self.live.set(memory.requests)
        self.state_bytes.clear()
        for where, by_method in (("device", memory.state_bytes), ("host", memory.host_bytes)):
            for method, n in by_method.items():
                self.state_bytes.labels(method, where).set(n)

    def text(self) -> bytes:
        return generate_latest(self.registry)
