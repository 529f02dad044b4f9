"""The server's Prometheus metrics (`/metrics`): requests and tokens by KV method, the queue, and the engine's memory
accounting (`Engine.memory()`: KV pool pages, live requests, method state on the device and in host memory)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from semkv.engine.memory import MemoryUsage


class Metrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("semkv_requests", "requests that ended, by KV method and outcome "
                                "(finished, cancelled, error, rejected)", ["method", "outcome"], registry=registry)
        self.prompt_tokens = Counter("semkv_prompt_tokens", "prompt tokens of finished requests", ["method"],
                                     registry=registry)
        self.generation_tokens = Counter("semkv_generation_tokens", "tokens generated", ["method"], registry=registry)
        self.ttft = Histogram("semkv_time_to_first_token_seconds", "from a request's arrival at the engine to its "
                              "first token", registry=registry,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.latency = Histogram("semkv_request_duration_seconds", "from arrival to the last token of finished "
                                 "requests", registry=registry, buckets=(0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.batch = Histogram("semkv_decode_batch_size", "requests in a method's batch at each decode step",
                               registry=registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.running = Gauge("semkv_requests_running", "requests admitted and decoding", registry=registry)
        self.waiting = Gauge("semkv_requests_waiting", "requests queued for admission", registry=registry)
        self.in_flight = Gauge("semkv_requests_in_flight", "requests accepted and not yet answered",
                               registry=registry)
        self.pool_pages = Gauge("semkv_kv_pool_pages", "KV pool pages (scratch page excluded from in_use)",
                                ["state"], registry=registry)
        self.page_bytes = Gauge("semkv_kv_page_bytes", "bytes of one KV page, every layer", registry=registry)
        self.live = Gauge("semkv_engine_live_requests", "requests holding pages or method state", registry=registry)
        self.state_bytes = Gauge("semkv_method_state_bytes", "bytes a method's live requests hold beside the KV pool",
                                 ["method", "memory"], registry=registry)

    def ended(self, method: str, outcome: str, prompt_tokens: int = 0, seconds: float | None = None) -> None:
        self.requests.labels(method, outcome).inc()
        if prompt_tokens:
            self.prompt_tokens.labels(method).inc(prompt_tokens)
        if seconds is not None and outcome == "finished":
            self.latency.observe(seconds)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens(self, method: str, n: int) -> None:
        self.generation_tokens.labels(method).inc(n)

    def update_engine(self, memory: MemoryUsage, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
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
