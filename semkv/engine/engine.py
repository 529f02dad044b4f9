"""The inference loop: chunked prefill of each request, then batched decode steps, through the paged cache, with
continuous batching and admission on free pool pages and device memory. The engine keeps the record of what each
request holds: `release` frees it when the request ends, however it ends, and `memory` reports it.

A decode step is prepared once on the host (`prepare_step`: its inputs and the method's plan) and handed to the
graphed path (`GraphRunner`) or the eager one (`forward_step`); the attention contexts are in `step.py`.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from semkv import kernels
from semkv.engine.cuda_graph import GraphRunner
from semkv.engine.hooks import DecodeBatch, KVMethod, StepPlan
from semkv.engine.kv_cache import KVPool, SeqKV, append_slots, ensure_many, stack_tables
from semkv.engine.memory import MemoryUsage, held_bytes
from semkv.engine.offload import available_host_bytes
from semkv.engine.sampler import sample, token_logprob
from semkv.engine.scheduler import Scheduler
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.engine.step import DecodeStep, PrefillStep, StepInputs, evict_layer, plan_chunks
from semkv.models.config import ModelConfig
from semkv.models.llama import LlamaModel
from semkv.models.rotary import RotaryEmbedding

# prefill chunk by "on CUDA": long chunks keep the GEMMs and the attention at full speed (Llama-3.1-8B shape on an
# H100, 32k Full-KV prefill: 2.12 s at 512, 1.24 s at 8192 and 16384, 1.23 s at 32768, where a 32k prompt is one
# causal attention call with nothing to merge; benchmarks/results/2026-11-27-h100-prefill-floor.md). The MLP takes
# at most `MLP_SLICE` tokens at a time, so a chunk's activations (about 3.5 GB at 32768 for that shape) come out of
# the memory `gpu_memory_utilization` leaves beside the pool. On the CPU the reference attention's mask grows with
# the chunk.
DEFAULT_CHUNK = {True: 32768, False: 512}
WARM_UP_MAX_LEN = 131072  # the longest context `warm_up` prepares the prefill for
WARM_UP_PROMPT = 300  # tokens of its short prefill: long enough for the kernels' prefill-sized variants
ACTIVATION_RESERVE = 2 * 2**30  # device bytes kept free for activations and captured graphs beside the KV pool


def _sample(seq: Sequence, logits: torch.Tensor) -> int:
    return sample(logits, seq.params, seq.generator)


class Engine:
    def __init__(self, model: LlamaModel, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 page_size: int = 16, prefill_chunk: int | None = None, cuda_graphs: bool = True,
                 num_pages: int | None = None, gpu_memory_utilization: float = 0.9, state_memory: int | None = None,
                 warm_up: bool = True):
        """num_pages: size of the KV pool, fixed; None sizes it from free GPU memory (keeping
        `1 - gpu_memory_utilization` of the card and `ACTIVATION_RESERVE` for activations free) on CUDA, and lets
        it grow on demand on the CPU. state_memory: bytes a method's state beside the pool may take (SentenceKV's
        and DynSplit-KV's device rows); None: on CUDA whatever is free when a request is admitted, less the
        activation reserve; unbounded elsewhere. prefill_chunk: prompt tokens per prefill chunk; None: 32768 on CUDA,
        512 on the CPU (`DEFAULT_CHUNK`). warm_up: on CUDA, compile the kernels and build the
        prefill attention's plans now (`warm_up`), so that the first request runs at the speed of the next."""
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        self.tp = config.tp  # tensor parallelism: every rank runs this engine in step with the others
        self.prefill_chunk = prefill_chunk or DEFAULT_CHUNK[device.type == "cuda"]
        self.state_memory = state_memory
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        # one side stream for every graph capture: cuBLAS keeps a workspace (32 MiB on Hopper) for each stream it
        # ever ran on, so a new stream per capture would grow memory with every generation
        self.capture_stream = torch.cuda.Stream(device) if self.cuda_graphs else None
        self.timer = None  # set by benchmarks to time the selection and attention of eager steps
        self.step_plan_s = 0.0  # host time of the last step's `KVMethod.step_plan`
        self._ahead: tuple[list[Sequence], StepInputs] | None = None  # the next step's inputs, prepared ahead
        self.rotary = RotaryEmbedding(config.hf_config, config.head_dim, device)
        self.scale = config.head_dim**-0.5
        shape = (config.num_layers, config.num_kv_heads, config.head_dim, page_size, dtype, device)
        if num_pages is None and device.type == "cuda":
            torch.cuda.empty_cache()  # memory the caching allocator holds unused (e.g. weights cast after loading)
            free, total = torch.cuda.mem_get_info(device)
            page_bytes = 2 * page_size * config.num_kv_heads * config.head_dim * dtype.itemsize
            num_pages = int((free - (1 - gpu_memory_utilization) * total - ACTIVATION_RESERVE) // page_bytes)
            if self.tp is not None:  # every rank's pool the same size, so that all admit the same requests
                num_pages = int(self.tp.host_min(num_pages))
            if num_pages < 2:
                raise MemoryError(f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free)")
        if num_pages is None:
            self.pool = KVPool(*shape)
        else:
            self.pool = KVPool(*shape, num_pages=num_pages, max_pages=num_pages)
        self._rank_cos_sin = (torch.empty(0), torch.empty(0))
        self._live: dict[Sequence, KVMethod] = {}  # admitted requests, not yet released, and their methods
        if warm_up and device.type == "cuda":
            self.warm_up()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """What a process pays once, paid at load: a short Full-KV prefill and decode step compile the Triton
        kernels (Triton also keeps them on disk for later processes), and the prefill attention's plans for full
        chunks are built up to the longest context the model and the pool take (at most `WARM_UP_MAX_LEN`)."""
        method = KVMethod()  # the interface's defaults are Full KV
        method.bind(self.config, None, self.pool.page_size)
        seq = Sequence(-1, [0] * WARM_UP_PROMPT, SamplingParams(max_new_tokens=2), SeqKV(self.pool))
        try:
            self.prefill(seq, method)
            self.append_token(seq, 0, lambda _: None)
            self.decode_step([seq], method)
        finally:
            self.end([seq], method)
        capacity = self.pool.max_pages * self.pool.page_size if self.pool.max_pages else WARM_UP_MAX_LEN
        longest = min(self.config.max_position_embeddings, capacity, WARM_UP_MAX_LEN)
        kernels.warm_up_prefill(self.pool.k, self.pool.v, self.config.num_heads, self.scale, self.prefill_chunk,
                                longest)

    def rank_rope(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [n, head_dim] of ranks 0..n-1, for methods whose attention rotates keys by rank (cached)."""
        if self._rank_cos_sin[0].shape[0] < n:
            size = -(-n // 1024) * 1024
            self._rank_cos_sin = self.rotary.cos_sin(torch.arange(size, device=self.device), self.dtype, seq_len=n)
        return self._rank_cos_sin[0][:n], self._rank_cos_sin[1][:n]

    # -- prefill --------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seq: Sequence, method: KVMethod, progress: bool = False, record_window: int = 0) -> torch.Tensor:
        """Run the prompt through the model, chunk after chunk (or layer after layer, every chunk through one layer
        before the next, when the method prefills by layer); return the logits of its last token [vocab].

        record_window > 0 keeps the last queries of every layer in `seq.window_queries`, so that methods can later be
        applied to copies of this prefilled sequence (`fork` + `apply_prefill`)."""
        started = time.perf_counter()
        self._admit(seq, method)
        n = len(seq.prompt_ids)
        split = seq.question_start if method.uses_question_split() and seq.question_start else n
        phases = [(0, split, True)] + ([(split, n, False)] if split < n else [])
        window = max(method.window_size(), record_window)
        chunk = self.chunk_of(method)
        spans = [(a, b, evict and b == hi) for lo, hi, evict in phases
                 for a, b in plan_chunks(lo, hi, chunk, window if evict else 0)]
        ids = torch.tensor(seq.prompt_ids, device=self.device)
        steps = [(a, b, PrefillStep(self, seq, method, a, b, evict, record_window if b == n else 0))
                 for a, b, evict in spans]
        if self.prefill_order(n, method) == "by layer":
            logits = self.model.forward_by_layer(ids, steps, torch.tensor([n - 1], device=self.device))
        else:
            bar = tqdm(total=n, desc="prefill", unit="tok", disable=not progress, leave=False)
            for a, b, step in steps:
                logits = self.model(ids[a:b], step, logits_at=torch.tensor([b - a - 1], device=self.device))
                bar.update(b - a)
            bar.close()
        method.finish_prefill(seq)
        self._prefill_done(seq)
        seq.stats.prefill_s = time.perf_counter() - started
        return logits[0]

    def chunk_of(self, method: KVMethod) -> int:
        """Prompt tokens per prefill chunk under `method` (the engine's, or the method's when shorter)."""
        return min(method.prefill_chunk() or self.prefill_chunk, self.prefill_chunk)

    def prefill_order(self, n: int, method: KVMethod) -> str:
        """How a prompt of n tokens is prefilled under `method`: "one chunk" (each layer filled and evicted in turn),
        "by layer" (several chunks, every chunk through one layer before the next: `KVMethod.prefill_by_layer`) or
        "by chunk" (several chunks, every layer holding the prompt until the last one)."""
        if n <= self.chunk_of(method):
            return "one chunk"
        return "by layer" if method.prefill_by_layer() else "by chunk"

    def _admit(self, seq: Sequence, method: KVMethod) -> None:
        self._live[seq] = method
        method.admit(seq)

    def release(self, seq: Sequence) -> None:
        """Free everything a request holds: its pages, its method state and the method's record of it. Called when
        the request ends, however it ends (finished, stopped, failed, cancelled); a second call does nothing."""
        method = self._live.pop(seq, None)
        if method is not None:
            method.release(seq)
        if self._ahead is not None and any(s is seq for s in self._ahead[0]):
            self._ahead = None  # the next step's inputs name it
        seq.kv.release()
        seq.method_state = None
        seq.window_queries = {}

    def end(self, seqs: list[Sequence], method: KVMethod) -> None:
        """After a run, however it ended (`run` and `generate` call it; a caller of the lower-level steps calls it
        itself): release its requests; the method drops its buffers unless another live request still uses it."""
        for seq in seqs:
            self.release(seq)
        if not any(m is method for m in self._live.values()):
            method.reset()

    def memory(self) -> MemoryUsage:
        """Pool pages in use, live requests, the state their methods hold beside the pool and in host memory
        (measured from the tensors the methods and the requests' states reach: `memory.held_bytes`), and the
        engine's fixed buffers. A method's buffers are dropped when its last request ends (`end`)."""
        device: dict[str, int] = {}
        host: dict[str, int] = {}
        for method in {id(m): m for m in self._live.values()}.values():
            for totals, n in zip((device, host), self._held(method)):
                if n:
                    totals[method.name] = totals.get(method.name, 0) + n
        cache = self.pool.staging.buffer.nbytes + sum(t.nbytes for t in self._rank_cos_sin)
        return MemoryUsage(self.pool.num_pages, self.pool.in_use, self.pool.bytes_per_page, len(self._live), device,
                           host, cache)

    def _held(self, method: KVMethod) -> tuple[int, int]:
        """(device, host) bytes a method and the states of its live requests hold (`memory.held_bytes`)."""
        states = [seq.method_state for seq, m in self._live.items() if m is method]
        return held_bytes([method, *states], self.device)

    @staticmethod
    def _prefill_done(seq: Sequence) -> None:
        resident = seq.kv.resident_slots()
        seq.stats.kv_resident_prefill_peak = max(seq.stats.kv_resident_prefill_peak, resident)
        seq.stats.kv_resident_tokens = resident
        if seq.trace is not None:
            seq.trace.record_resident(seq.kv)

    @torch.inference_mode()
    def fork(self, seq: Sequence, seq_id: int) -> Sequence:
        """A copy of a prefilled sequence with its own pages (the K/V are copied), ready for another method."""
        twin = Sequence(seq_id, seq.prompt_ids, seq.params, SeqKV(self.pool), seq.question_start)
        try:
            for layer in range(self.config.num_layers):
                n = seq.kv.num_slots[layer]
                twin.kv.ensure_slots(layer, n)
                twin.kv.num_slots[layer] = n
                src, dst = (kv.table[layer, : len(seq.kv.pages[layer])] for kv in (seq.kv, twin.kv))
                for x in (self.pool.k, self.pool.v, self.pool.pos):
                    x[dst] = x[src]
        except BaseException:  # the pool could not hold the copy
            twin.kv.release()
            raise
        twin.num_computed = seq.num_computed
        twin.window_queries = dict(seq.window_queries)
        twin.stats.prefill_s = seq.stats.prefill_s
        return twin

    @torch.inference_mode()
    def apply_prefill(self, seq: Sequence, method: KVMethod, fill: Callable[[int], None] | None = None) -> None:
        """Apply a method's prefill-time eviction and summaries to a sequence prefilled with Full KV. `fill(layer)`,
        when given, stores each layer's K/V (and its window queries) just before that layer's eviction, so the device
        holds one layer's whole prompt at a time, as a prompt prefilled in one chunk does (benchmarks' synthetic
        K/V)."""
        started = time.perf_counter()
        seq.method_state = method.new_state(seq)
        self._admit(seq, method)
        for layer in range(self.config.num_layers):
            if fill is not None:
                fill(layer)
            evict_layer(method, seq, layer, seq.window_queries[layer])
        method.finish_prefill(seq)
        self._prefill_done(seq)
        seq.stats.prefill_s += time.perf_counter() - started

    # -- decode ---------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode_step(self, seqs: list[Sequence], method: KVMethod) -> torch.Tensor:
        """Feed each sequence's last sampled token; return next-token logits [B, vocab] (an eager step)."""
        logits, step = self.forward_step(seqs, method, *self.prepare_step(seqs, method))
        self.finish_step(seqs, step)
        return logits

    @torch.inference_mode()
    def forward_step(self, seqs: list[Sequence], method: KVMethod, inputs: StepInputs,
                     plan: StepPlan | None) -> tuple[torch.Tensor, DecodeStep]:
        """The eager forward of a prepared decode step (nothing read back yet): logits [B, vocab] and the step."""
        step = DecodeStep(self, self.step_batch(seqs, inputs, plan), method, inputs.write)
        logits = self.model(inputs.tokens, step)
        step.finish()
        return logits, step

    def prepare_step(self, seqs: list[Sequence], method: KVMethod,
                     inputs: StepInputs | None = None) -> tuple[StepInputs, StepPlan | None]:
        """Host-side work before a decode step, done once for either path: its inputs (`step_inputs`, unless
        prepared ahead), then the method's plan of the step's selection (`step_plan`)."""
        if inputs is None:
            inputs = self.step_inputs(seqs, method)
        span = self.timer.start("selection") if self.timer else None
        started = time.perf_counter()
        plan = method.step_plan(DecodeBatch(seqs, inputs.positions, inputs.num_slots, self.config, pool=self.pool))
        self.step_plan_s = time.perf_counter() - started  # added to the sequences' selection time
        if span:
            self.timer.stop(span)
        return inputs, plan

    def step_inputs(self, seqs: list[Sequence], method: KVMethod, ahead: bool = False) -> StepInputs:
        """The method picks write slots (decode eviction) or every layer appends; appended tokens get pages. The
        inputs reach the device in one copy that does not wait for it. ahead: for the step after the one running
        (its token is not known yet: the caller fills it in on the device; positions are one further)."""
        write = None
        if type(method).begin_step is not KVMethod.begin_step:
            before = [list(s.kv.num_slots) for s in seqs]
            positions = torch.tensor([s.num_computed for s in seqs], device=self.device)
            slots_before = torch.tensor(before, device=self.device)  # [B, layers]
            write = method.begin_step(DecodeBatch(seqs, positions, slots_before, self.config))
        if write is None:  # every layer appends
            append_slots([seq.kv for seq in seqs if not seq.slot_ready])
            for seq in seqs:
                seq.slot_ready = ahead
        else:
            appends = (write == slots_before[:, :, None]).any(-1).tolist()
            requests = []
            for b, seq in enumerate(seqs):
                grown = {layer: n + 1 for layer, n in enumerate(before[b]) if appends[b][layer]}
                for layer, n in grown.items():
                    seq.kv.num_slots[layer] = n
                requests.append((seq.kv, grown))
            ensure_many(requests)
        packed = self.pool.staging.send([[0 if ahead else s.last_token, s.num_computed + ahead, *s.kv.num_slots]
                                         for s in seqs])
        if write is None:  # the slot before the count, in every layer and head
            write = (packed[:, 2:] - 1)[:, :, None].expand(-1, -1, self.config.num_kv_heads)
        return StepInputs(packed, write)

    def step_batch(self, seqs: list[Sequence], inputs: StepInputs, plan: StepPlan | None) -> DecodeBatch:
        """The batch of a prepared eager step as `select` sees it (page tables stacked, shapes from the lengths)."""
        tables = stack_tables([s.kv.table for s in seqs])
        return DecodeBatch(seqs, inputs.positions, inputs.num_slots, self.config, tables,
                           max(max(s.kv.num_slots) for s in seqs), plan, self.pool)

    def finish_step(self, seqs: list[Sequence], step: DecodeStep,
                    tokens: torch.Tensor | None = None) -> list[int] | None:
        """Account a finished forward in one read from the device: the step's attention statistics and, given the
        next tokens [B] on the device, those tokens (returned)."""
        n = len(seqs)
        rows = [step.attended_sum[:n].double() / self.config.num_layers, step.attended_max[:n].double()]
        if tokens is not None:
            rows.append(tokens.double())  # token ids are exact in float64
        read = torch.stack(rows).tolist()
        for b, seq in enumerate(seqs):
            seq.num_computed += 1
            seq.attended_total += read[0][b]
            seq.stats.kv_attended_max = max(seq.stats.kv_attended_max, int(read[1][b]))
            seq.stats.selection_s += (step.selection_s + self.step_plan_s) / n
        return [int(t) for t in read[2]] if tokens is not None else None

    def run(self, seqs: list[Sequence], method: KVMethod, is_stop, progress: bool = False) -> None:
        """Continuous batching (`Scheduler`): admit waiting requests while the pool can hold them to the end and the
        device the method's state for them, prefill each on admission, decode the running batch one step at a time,
        release finished requests. A request that cannot fit waits; one that cannot fit even alone is an error."""
        scheduler = Scheduler(self)
        try:
            for seq in seqs:
                scheduler.submit(seq, method, is_stop)
            while scheduler.busy:
                scheduler.advance(progress)
        finally:
            self.end(seqs, method)

    def generate(self, seqs: list[Sequence], method: KVMethod, first_logits: list[torch.Tensor],
                 is_stop, pick=None) -> None:
        """Decode already-prefilled sequences until each finished (see `run` for the scheduled path).
        `pick(seq, logits) -> token` chooses each next token (default: sample); a pick that returns given tokens
        teacher-forces them through the decode steps (`LLM.score_continuation`)."""
        pick = pick or _sample
        try:
            firsts = self.agree([pick(seq, logits) for seq, logits in zip(seqs, first_logits)])
            for seq, token in zip(seqs, firsts):
                self.append_token(seq, token, is_stop)
            running = [s for s in seqs if not s.finished]
            graphs = self.graph_runner(method, seqs)
            while running:
                self.step(running, method, graphs, is_stop, pick)
                running = [s for s in running if not s.finished]
            for seq in seqs:
                self.finish(seq)
        finally:
            self.end(seqs, method)

    def step(self, running: list[Sequence], method: KVMethod, graphs: GraphRunner | None, is_stop,
             pick=_sample) -> None:
        """One decode step of the running batch: the forward (graph replay when it fits), the method's
        `observe_logits` and the next step's inputs while it runs, the next tokens, the method's `end_step`,
        statistics and stop checks (what `run`, `generate` and the benchmarks time)."""
        started = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        inputs = ahead[1] if ahead is not None and len(ahead[0]) == len(running) and all(
            a is s and s.slot_ready for a, s in zip(ahead[0], running)) else None
        if inputs is not None:  # this step consumes the slots prepared for it
            for seq in running:
                seq.slot_ready = False
        inputs, plan = self.prepare_step(running, method, inputs)
        if graphs is not None and graphs.fits(running):
            logits, step = graphs.forward_step(running, inputs, plan)
        else:
            logits, step = self.forward_step(running, method, inputs, plan)
        greedy = pick is _sample and all(s.params.temperature <= 0 for s in running)
        chosen = logits.argmax(-1) if greedy else None
        if chosen is not None and self.tp is not None:
            self.tp.broadcast(chosen)  # rank 0's sampler decides
        if greedy and method.graph_safe and method.steady_slots and type(method).begin_step is KVMethod.begin_step:
            # while the device runs this step, prepare the next one for the same batch (its tokens are this step's
            # greedy tokens, filled in on the device); a request that finishes now leaves a spare slot behind, and
            # the method's end_step must not move the cache (`steady_slots`)
            upcoming = self.step_inputs(running, method, ahead=True)
            upcoming.packed[:, 0] = chosen
            self._ahead = (list(running), upcoming)
        span = self.timer.start("selection") if self.timer else None  # per-step bookkeeping of the method
        method.observe_logits(running, logits)
        if span:
            self.timer.stop(span)
        tokens = self.finish_step(running, step, chosen)  # greedy: one read for everything
        if tokens is None:
            tokens = self.agree([pick(s, logits[b]) for b, s in enumerate(running)])
        span = self.timer.start("selection") if self.timer else None
        method.end_step(running, logits, tokens)
        if span:
            self.timer.stop(span)
        elapsed = time.perf_counter() - started
        for b, (seq, token) in enumerate(zip(running, tokens)):
            resident = seq.kv.resident_slots() - seq.slot_ready  # not counting a slot prepared for the next step
            seq.stats.kv_resident_tokens = max(seq.stats.kv_resident_tokens, resident)
            seq.stats.decode_s += elapsed
            self.append_token(seq, token, is_stop, logits[b])

    def agree(self, tokens: list[int]) -> list[int]:
        """Rank 0's tokens on every rank with tensor parallelism (its sampler decides), else the tokens."""
        return tokens if self.tp is None else self.tp.broadcast_object(tokens)

    def finish(self, seq: Sequence) -> None:
        """A request ended: its mean attended tokens are final and everything it holds is released."""
        seq.stats.kv_attended_tokens = seq.attended_total / max(len(seq.output_ids) - 1, 1)
        self.release(seq)

    def pages_needed(self, seq: Sequence, method: KVMethod, prefill: bool = False) -> int:
        """Pages a request may hold at most: every layer keeps what the method keeps on the device
        (`device_tokens`), else its whole prompt and output (Full KV). During its prefill a prompt of one chunk, or
        of several under a method that prefills by layer, fills and evicts one layer at a time (one layer holds the
        whole prompt, the others their bound); otherwise every layer holds the prompt until its last chunk."""
        n, new = len(seq.prompt_ids), seq.params.max_new_tokens
        page, layers = self.pool.page_size, self.config.num_layers
        bound = method.device_tokens(n, new, page)
        if bound is None:
            return layers * -(-(n + new) // page)
        if not prefill:
            return layers * -(-bound // page)
        if self.prefill_order(n, method) == "by chunk":
            return layers * -(-max(bound, n) // page)
        return (layers - 1) * -(-bound // page) + -(-max(bound, n) // page)

    def blocked(self, seq: Sequence, running: list[Sequence], method: KVMethod) -> str | None:
        """Why `seq` cannot be admitted beside the running requests now (every running request may still grow to
        its own bound), or None when it can."""
        if self.pool.max_pages is not None:
            growth = sum(max(self.pages_needed(s, self._live.get(s, method)) - sum(map(len, s.kv.pages)), 0)
                         for s in running)
            need = self.pages_needed(seq, method, prefill=True)
            if len(self.pool.free) - growth < need:
                return (f"request {seq.seq_id} needs {need} KV pages; the pool has {self.pool.num_pages - 1} (raise "
                        "gpu_memory_utilization or shorten it)")
        host = method.admission_host_bytes(seq)
        if host:
            room = available_host_bytes()
            if self.tp is not None:  # the ranks share the host; they decide alike
                room = self.tp.host_min(room / self.tp.size)
            if host > room:
                return (f"request {seq.seq_id} needs {host / 2**30:.2f} GiB of host memory for its offloaded K/V; "
                        f"{room / 2**30:.2f} GiB is available (lower the batch or shorten it)")
        state, hidden = method.admission_bytes(seq), self.hidden_state_bytes(seq, method)
        room = self.state_room(method) if state or hidden else math.inf  # most admissions allocate nothing
        if (state or hidden) and self.tp is not None:
            room = self.tp.host_min(room)
        if state + hidden > room:
            what = f"{state / 2**30:.2f} GiB of {method.name} state" if state else ""
            if hidden:  # a prefill by layer keeps the prompt's hidden states
                what += (" and " if state else "") + f"{hidden / 2**30:.2f} GiB of its prompt's hidden states"
            return (f"request {seq.seq_id} needs {what} beside the KV pool; {max(room, 0) / 2**30:.2f} GiB is free "
                    "there (lower gpu_memory_utilization or shorten it)")
        return None

    def hidden_state_bytes(self, seq: Sequence, method: KVMethod) -> int:
        """Device bytes a prefill by layer keeps for the whole prompt (its hidden states and residual stream); 0 for a
        prompt of one chunk or a prefill chunk after chunk."""
        n = len(seq.prompt_ids)
        if self.prefill_order(n, method) != "by layer":
            return 0
        return 2 * n * self.config.hidden_size * self.dtype.itemsize

    def state_room(self, method: KVMethod) -> float:
        """Device bytes a method may still allocate beside the KV pool: `state_memory` less what it holds, else on
        CUDA the free memory less the activation reserve, else unbounded."""
        if self.state_memory is not None:
            return self.state_memory - self._held(method)[0]
        if self.device.type != "cuda":
            return math.inf
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return free + cached - ACTIVATION_RESERVE

    def graph_runner(self, method: KVMethod, seqs: list[Sequence], max_pages: int | None = None) -> GraphRunner | None:
        """CUDA graphs for these requests, when the device, the method and the RoPE variant allow them; their page
        tables hold `max_pages` (default: the longest request's)."""
        traced = any(s.trace is not None for s in seqs)  # a replayed graph runs no Python, so it records nothing
        if not (self.cuda_graphs and method.graph_safe and self.rotary.rope_type != "dynamic") or traced:
            return None
        if max_pages is None:
            longest = max(len(s.prompt_ids) + s.params.max_new_tokens for s in seqs)
            max_pages = -(-longest // self.pool.page_size) + 1
        return GraphRunner(self, method, max_pages)

    @staticmethod
    def append_token(seq: Sequence, token: int, is_stop, logits: torch.Tensor | None = None) -> None:
        """Add a request's next token, with its log-probability from `logits` [vocab] when the request asks for
        them, and apply its stop test."""
        if logits is not None and seq.params.logprobs is not None:
            seq.logprobs.append(token_logprob(logits, token, seq.params.logprobs))
        seq.output_ids.append(token)
        seq.stats.new_tokens = len(seq.output_ids)
        reason = is_stop(seq)
        if reason:
            seq.finished, seq.finish_reason = True, reason
