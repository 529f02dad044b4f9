"""The inference loop: chunked prefill of each request, then batched decode steps, through the paged cache, with
continuous batching and admission on free pool pages and device memory. The engine keeps the record of what each
request holds: `release` frees it when the request ends, however it ends, and `memory` reports it.

A decode step is prepared once on the host (`prepare_step`: its inputs and the method's plan) and handed to the
graphed path (`GraphRunner`) or the eager one (`forward_step`); the attention contexts are in `step.py`.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from semkv import kernels
from semkv.engine.cuda_graph import GraphRunner, PrefillGraphs
from semkv.engine.hooks import DecodeBatch, KVMethod, StepPlan
from semkv.engine.kv_cache import KVPool, SeqKV, append_slots, ensure_many, stack_tables
from semkv.engine.memory import MemoryUsage, held_bytes
from semkv.engine.offload import available_host_bytes
from semkv.engine.prefix_cache import PromptKeys
from semkv.engine.sampler import sample, token_logprob
from semkv.engine.scheduler import Scheduler
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.engine.staging import copy_early
from semkv.engine.step import (DecodeStep, PackedPrefillStep, PrefillStep, StepInputs, evict_layer, evict_layers,
                               plan_chunks)
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
# the chunks of its prefill: Triton compiles a kernel again for integer arguments divisible by 16 and not, so the
# short (Triton) and long (cuDNN, later chunks merged) paths run with lengths and starts of both kinds, as a server's
# step budget cuts them; otherwise a server's first requests wait for the compiler (an H200's first 32 requests of
# 32k: 18.4 s before, 13.2 s with it and the kernels' unspecialized sizes, 10.2-10.3 s for the next 32 either way;
# benchmarks/results/2026-11-28-h200-first-steps.md)
WARM_UP_BATCHES = (1, 2, 16)  # its decode steps' batch sizes: one row, a few, a multiple of 16 (as above)
WARM_UP_SPANS = ((0, 300), (300, 1325), (1325, 2349), (2349, 2352), (2352, 3376), (3376, 4401), (4401, 4417))
ACTIVATION_RESERVE = 2 * 2**30  # device bytes kept free for activations and captured graphs beside the KV pool


@dataclass
class PrefillPlan:
    """A prompt's prefill between the steps that run its chunks (`Engine.continue_prefill`)."""

    method: KVMethod
    spans: list[tuple[int, int, bool]]  # the chunks left: [a, b) and whether the layers evict after it
    first: int  # the first prompt position to compute (after the tokens found in the prefix cache)
    ids: torch.Tensor  # [n - first] the prompt from `first` on, on the device
    record_window: int  # the last chunk keeps this many queries per layer (`Sequence.window_queries`)
    by_layer: bool  # every chunk through one layer before the next (`KVMethod.prefill_by_layer`)
    cut: int | None  # chunks may be cut to a step's budget when the piece after the cut keeps this many tokens (the
    # method's window); None: the method prefills in chunks of its own, which stay whole
    layers: Generator[int, None, torch.Tensor] | None = None  # a prefill by layer under way (`LlamaModel.by_layer`)
    # a last chunk run in `Engine.prefill_together` whose layers evict: each layer's window queries [w, heads, D],
    # for `Engine.end_prompt`
    windows: list[torch.Tensor] | None = None


@dataclass
class StepRead:
    """What a decode step's accounting reads from the device (`Engine.read_step`)."""

    values: torch.Tensor  # [2 or 3, B] float64: attended tokens a layer, the most attended, the greedy tokens
    ready: torch.cuda.Event | None  # recorded after an early copy into pinned host memory; None: read when needed
    selection_s: float  # host seconds of the step's selection and plan, a row's share


@dataclass
class LaunchedStep:
    """A decode step whose forward is queued, waiting for `Engine.complete_step`."""

    running: list[Sequence]
    method: KVMethod
    logits: torch.Tensor  # [B, vocab]
    read: StepRead
    steady: bool  # no request is replaying a recomputed output
    pick: Callable  # the token choice of a non-greedy step (seq, logits) -> token
    host_s: float  # host time of the launch (the request's decode time counts it, not what ran in between)


def _sample(seq: Sequence, logits: torch.Tensor) -> int:
    return sample(logits, seq.params, seq.generator)


def grow_segments_in_place(device: torch.device) -> None:
    """On CUDA, unless the user configured torch's allocator (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF): the
    allocator's segments grow in place (`expandable_segments`, which torch's out-of-memory error suggests), so memory
    freed in pieces can back a large tensor again. Method state beside the pool grows by regrowing (every request's
    rows, an eighth more each time, the old tensor freed after the new one is made), and with fixed segments the
    freed tensors stayed split: on an H200 at 32k, SentenceKV's and DynSplit-KV's offloading rows failed to grow by
    3.4 and 6 GiB with 4-11 GiB free in pieces."""
    if device.type != "cuda" or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def pool_pages(free: int, total: int, gpu_memory_utilization: float, page_bytes: int) -> int:
    """Pages of `page_bytes` (a page's K/V and the state kept by page beside it) that a pool sized from free device
    memory takes: all the free memory but `1 - gpu_memory_utilization` of the card and `ACTIVATION_RESERVE`."""
    return int((free - (1 - gpu_memory_utilization) * total - ACTIVATION_RESERVE) // page_bytes)


class Engine:
    def __init__(self, model: LlamaModel, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 page_size: int = 16, prefill_chunk: int | None = None, cuda_graphs: bool = True,
                 num_pages: int | None = None, gpu_memory_utilization: float = 0.9, state_memory: int | None = None,
                 warm_up: bool = True, page_state_bytes: int = 0):
        """num_pages: size of the KV pool, fixed; None sizes it from free GPU memory (keeping
        `1 - gpu_memory_utilization` of the card and `ACTIVATION_RESERVE` for activations free) on CUDA, and lets
        it grow on demand on the CPU, where it grows rather than evict cached prompt pages until it fills half the
        host memory free at the start (`KVPool.keep_cached`). page_state_bytes: device bytes a page of the pool adds
        in state kept by KV page (`KVMethod.page_state_bytes` of the method most requests use: `LLM(reserve_for=)`),
        so that a pool sized from free memory leaves that state room in the card's share (`pool_pages`).
        state_memory: bytes a method's state beside the pool may take (SentenceKV's and DynSplit-KV's device rows);
        None: on CUDA whatever is free when a request is admitted, less the activation reserve; unbounded elsewhere.
        prefill_chunk: prompt tokens per prefill chunk; None: 32768 on CUDA, 512 on the CPU (`DEFAULT_CHUNK`).
        warm_up: on CUDA, compile the kernels and build the prefill attention's plans now (`warm_up`), so that the
        first request runs at the speed of the next."""
        kernels.prefill_path(device)  # SEMKV_PREFILL_ATTENTION and SEMKV_DECODE_ATTENTION checked before anything
        kernels.decode_path(device)  # loads
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        self.tp = config.tp  # tensor parallelism: every rank runs this engine in step with the others
        self.prefill_chunk = prefill_chunk or DEFAULT_CHUNK[device.type == "cuda"]
        self.state_memory = state_memory
        self.page_state_bytes = page_state_bytes
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
        grow_segments_in_place(device)  # before the pool and everything that follows it
        # the dense work of prompt chunks of up to 8,192 tokens from CUDA graphs (its static buffers before the pool;
        # not yet with tensor parallelism, whose all-reduces in these graphs no device run has checked)
        self.prefill_graphs = PrefillGraphs(self) if self.cuda_graphs and self.tp is None else None
        if num_pages is None and device.type == "cuda":
            torch.cuda.empty_cache()  # memory the caching allocator holds unused (e.g. weights cast after loading)
            free, total = torch.cuda.mem_get_info(device)
            page_bytes = 2 * page_size * config.num_kv_heads * config.head_dim * dtype.itemsize
            num_pages = pool_pages(free, total, gpu_memory_utilization, page_bytes + page_state_bytes)
            if self.tp is not None:  # every rank's pool the same size, so that all admit the same requests
                num_pages = int(self.tp.host_min(num_pages))
            if num_pages < 2:
                raise MemoryError(f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free)")
        if num_pages is None:
            self.pool = KVPool(*shape)
            # the CPU's pool keeps cached prompt pages in up to half the host memory free now (where that is known)
            if device.type == "cpu" and math.isfinite(host := available_host_bytes()):
                self.pool.keep_cached = int(host / 2 // self.pool.bytes_per_page)
        else:
            self.pool = KVPool(*shape, num_pages=num_pages, max_pages=num_pages)
        self._rank_cos_sin = (torch.empty(0), torch.empty(0))
        self._live: dict[Sequence, KVMethod] = {}  # admitted requests, not yet released, and their methods
        self.reserved = 0  # pool pages a scheduler promised to prompts being prefilled (decode steps leave them)
        if warm_up and device.type == "cuda":
            self.warm_up()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """What a process pays once, paid at load: a Full-KV prefill cut as `WARM_UP_SPANS` and decode steps of
        `WARM_UP_BATCHES` rows, eager and captured, compile the Triton kernels (Triton also keeps them on disk for
        later processes), and the prefill attention's plans for full chunks are built up to the longest context the
        model and the pool take (at most `WARM_UP_MAX_LEN`)."""
        method = KVMethod()  # the interface's defaults are Full KV
        method.bind(self.config, None, self.pool.page_size)
        # a pool or a model too small for it all warms up the first span and one row (every layer holds each prompt)
        pages = -(-(WARM_UP_SPANS[-1][1] + 8) // self.pool.page_size) + 2 * (max(WARM_UP_BATCHES) - 1)
        whole = ((self.pool.max_pages or math.inf) - 1 >= self.config.num_layers * pages
                 and WARM_UP_SPANS[-1][1] <= self.config.max_position_embeddings)
        spans, batches = (WARM_UP_SPANS, WARM_UP_BATCHES) if whole else (WARM_UP_SPANS[:1], (1,))
        seqs = [Sequence(-1 - i, [0] * (spans[-1][1] if i == 0 else 17), SamplingParams(max_new_tokens=8),
                         SeqKV(self.pool)) for i in range(max(batches))]
        try:
            self.start_prefill(seqs[0], method)
            seqs[0].prefill.spans = [(a, b, False) for a, b in spans]
            self.run_prefill(seqs[0])
            for seq in seqs[1:]:
                self.prefill(seq, method)
            for size in batches:
                batch = seqs[:size]
                graphs = self.graph_runner(method, batch)
                for graphed in (False, True) if graphs is not None else (False,):  # eager, then captured
                    for seq in batch:
                        self.append_token(seq, 0, lambda _: "")
                    if graphed:
                        graphs.decode_step(batch)
                    else:
                        self.decode_step(batch, method)
        finally:
            self.end(seqs, method)
        kernels.warm_up_prefill(self.pool.k, self.pool.v, self.config.num_heads, self.scale, self.prefill_chunk,
                                self._longest_warm_up())

    def room(self) -> float:
        """The tokens one request could hold alone in the pool: every layer holds them in pages of its own, beside
        the scratch page (inf for a pool that grows)."""
        if not self.pool.max_pages:
            return math.inf
        return (self.pool.max_pages - 1) // self.config.num_layers * self.pool.page_size

    def _longest_warm_up(self) -> int:
        """The longest context the warm-ups prepare: what the model and the pool take, at most `WARM_UP_MAX_LEN`."""
        return int(min(self.config.max_position_embeddings, self.room(), WARM_UP_MAX_LEN))

    @torch.inference_mode()
    def warm_up_cuts(self, step_tokens: int) -> None:
        """A server's warm-up (`Session`, on CUDA): the prefill attention's plans for the chunks a step budget of
        `step_tokens` cuts at any start (`kernels.warm_up_prefill_cuts`), and the prefill's graphs of those chunks
        (`PrefillGraphs.prepare`)."""
        kernels.warm_up_prefill_cuts(self.pool.k, self.pool.v, self.config.num_heads, self.scale, step_tokens,
                                     self.prefill_chunk, self._longest_warm_up())
        if self.prefill_graphs is not None:
            self.prefill_graphs.prepare(step_tokens)

    def rank_rope(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [n, head_dim] of ranks 0..n-1, for methods whose attention rotates keys by rank (cached)."""
        if self._rank_cos_sin[0].shape[0] < n:
            size = -(-n // 1024) * 1024
            self._rank_cos_sin = self.rotary.cos_sin(torch.arange(size, device=self.device), self.dtype, seq_len=n)
        return self._rank_cos_sin[0][:n], self._rank_cos_sin[1][:n]

    # -- prefill --------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seq: Sequence, method: KVMethod, progress: bool = False, record_window: int = 0) -> torch.Tensor:
        """Run the whole prompt through the model, chunk after chunk (or layer after layer, every chunk through one
        layer before the next, when the method prefills by layer); return the logits of its last token [vocab].

        record_window > 0 keeps the last queries of every layer in `seq.window_queries`, so that methods can later be
        applied to copies of this prefilled sequence (`fork` + `apply_prefill`)."""
        self.start_prefill(seq, method, record_window=record_window)
        return self.run_prefill(seq, progress)

    def run_prefill(self, seq: Sequence, progress: bool = False) -> torch.Tensor:
        """The chunks of a started prefill (`start_prefill`), all of them: the logits of the prompt's last token."""
        bar = tqdm(total=len(seq.prompt_ids) - seq.num_computed, desc="prefill", unit="tok", disable=not progress,
                   leave=False)
        logits = None
        while logits is None:
            done, plan = seq.num_computed, seq.prefill
            # a chunk (or a layer) a call, for the progress bar
            logits = self.continue_prefill(seq, 1 if plan.by_layer else plan.spans[0][1] - plan.spans[0][0])
            bar.update(seq.num_computed - done)
        bar.close()
        return logits

    def start_prefill(self, seq: Sequence, method: KVMethod, limit: int | None = None, record_window: int = 0) -> None:
        """Admit a request (its method takes its state) and plan its prefill from `seq.num_computed` (the tokens
        found in the prefix cache): in the method's own chunks when it has them, in chunks of at most `limit` tokens
        when it prefills by layer, else in the engine's chunks, which `continue_prefill` cuts to a step's budget;
        `continue_prefill` then runs them."""
        self._admit(seq, method)
        n = len(seq.prompt_ids)
        split = seq.question_start if method.uses_question_split() and seq.question_start else n
        phases = [(0, split, True)] + ([(split, n, False)] if split < n else [])
        window = max(method.window_size(), record_window)
        # chunks that a step may cut to its budget are planned at the engine's size: a step with room runs them whole
        chunk = self.chunk_of(method, None if method.prefill_chunk() is None and not method.prefill_by_layer()
                              else limit)
        start = seq.num_computed
        spans = [(a, b, evict and b == hi) for lo, hi, evict in phases if hi > start
                 for a, b in plan_chunks(max(lo, start), hi, chunk, window if evict else 0)]
        ids = self.pool.staging.send(seq.prompt_ids[start:])  # a follow-up on a cached document: its question
        by_layer = len(spans) > 1 and method.prefill_by_layer()
        seq.prefill = PrefillPlan(method, spans, start, ids, record_window, by_layer,
                                  None if method.prefill_chunk() is not None else window)

    @torch.inference_mode()
    def continue_prefill(self, seq: Sequence, budget: int) -> torch.Tensor | None:
        """Run the next planned chunks of a prefill, as many as `budget` tokens allow (0: all of them; a chunk
        longer than the budget is cut to it where the plan allows, else it runs whole: at least one chunk a call; a
        prefill by layer runs layers, a layer counting as its share of the prompt's tokens); the logits of the
        prompt's last token [vocab] once the prompt is done, after the method's `finish_prefill`, else None."""
        plan, started, n = seq.prefill, time.perf_counter(), len(seq.prompt_ids)
        logits = None
        if plan.by_layer:
            logits = self._prefill_layers(seq, budget)
        else:
            count = self._take(plan, budget)
            for a, b, evict in plan.spans[:count]:
                step = PrefillStep(self, seq, plan.method, a, b, evict, plan.record_window if b == n else 0)
                logits = self._chunk_forward(plan.ids[a - plan.first : b - plan.first], step,
                                             slice(b - a - 1, b - a))
            del plan.spans[:count]
        seq.stats.prefill_s += time.perf_counter() - started
        return self._chunks_done(seq, logits)

    def _chunk_forward(self, ids: torch.Tensor, step, logits_at: torch.Tensor | slice) -> torch.Tensor:
        """The forward of prompt tokens ids [T] through the attention context `step`: the dense work replayed from
        the prefill's graphs where one holds T tokens (`PrefillGraphs`), else eager; the logits at `logits_at`."""
        graphs = self.prefill_graphs
        if graphs is not None and graphs.size(ids.shape[0]) is not None:
            return graphs.forward(ids, step, logits_at)
        return self.model(ids, step, logits_at=logits_at)

    def _chunks_done(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor | None:
        """After a call's chunks: once the prompt is done, its end (`end_prompt`) and the logits of its last token
        [vocab]; else None."""
        if seq.prefill.spans:
            return None
        self.end_prompt(seq)
        return logits[0]

    def end_prompt(self, seq: Sequence) -> None:
        """The end of a prompt whose chunks have all run: the eviction of every layer where its last chunk ran in
        `prefill_together` (with the window queries that chunk kept), the method's `finish_prefill`; the request is
        ready to decode."""
        started, plan = time.perf_counter(), seq.prefill
        if plan.windows is not None:
            evict_layers(plan.method, seq, plan.windows)
        plan.method.finish_prefill(seq)
        self._prefill_done(seq)
        seq.prefill = None
        seq.stats.prefill_s += time.perf_counter() - started

    @staticmethod
    def _take(plan: PrefillPlan, budget: int) -> int:
        """How many of the plan's next chunks a call with `budget` tokens runs (0: all; at least one), the first cut
        to the budget where the plan allows (in place)."""
        a, b, evict = plan.spans[0]
        if budget and plan.cut is not None and b - a > budget and b - (a + budget) >= plan.cut:
            plan.spans[:1] = [(a, a + budget, False), (a + budget, b, evict)]
        count, tokens = 0, 0
        while count < len(plan.spans) and (count == 0 or not budget
                                           or tokens + plan.spans[count][1] - plan.spans[count][0] <= budget):
            tokens += plan.spans[count][1] - plan.spans[count][0]
            count += 1
        return count

    def prefill_span(self, seq: Sequence, budget: int) -> int | None:
        """The tokens of the chunk `continue_prefill(seq, budget)` would run (cut to the budget now, as it would be
        then), when that call runs one chunk and the chunk may share a forward with other prompts' chunks
        (`prefill_together`, `PackedPrefillStep`): no sparse context, keys stored with RoPE, no log-sum-exps, no
        recorded queries, every layer holding the slots before it; a chunk after which the layers evict only when
        slots come before it (every layer then holds the prompt's pages until the end of its prefill, as
        `pages_needed` counts them: the chunk takes them at once). None otherwise."""
        plan = seq.prefill
        method = type(plan.method)
        if (plan.by_layer or plan.method.rope_by_rank() or method.prefill_lse
                or method.prefill_context is not KVMethod.prefill_context or self._take(plan, budget) != 1):
            return None
        a, b, evict = plan.spans[0]
        if ((evict and a == 0 and method.evict_prefill is not KVMethod.evict_prefill)
                or (plan.record_window and b == len(seq.prompt_ids)) or any(n != a for n in seq.kv.num_slots)):
            return None
        return b - a

    @torch.inference_mode()
    def prefill_together(self, seqs: list[Sequence]) -> list[torch.Tensor | None]:
        """The next chunk of each prompt (`prefill_span` said so, with the budget that cut it) in one forward: the
        dense work once over their tokens, each chunk's attention over its own pages. For each prompt the logits of
        its last token [vocab] once its chunks have all run, else None; unlike `continue_prefill`, a prompt's end
        (its layers' eviction, the method's `finish_prefill`) is left to the caller's `end_prompt`, so that its first
        token may be chosen and sent first: the eviction changes only what later tokens attend to. Several follow-up
        questions on cached documents cost one forward, not one each."""
        started = time.perf_counter()
        spans = [seq.prefill.spans[0] for seq in seqs]
        step = PackedPrefillStep(self, seqs, spans)
        ids = torch.cat([seq.prefill.ids[a - seq.prefill.first : b - seq.prefill.first]
                         for seq, (a, b, _) in zip(seqs, spans)])
        last = self.pool.staging.send([end - 1 for end in step.bounds[1:]])  # [P] each chunk's last row
        logits = self._chunk_forward(ids, step, last)
        firsts = []
        for i, seq in enumerate(seqs):
            plan = seq.prefill
            del plan.spans[0]
            plan.windows = step.windows.get(i)
            seq.stats.prefill_s += time.perf_counter() - started
            firsts.append(None if plan.spans else logits[i])
        return firsts

    def lookup_prefix(self, seq: Sequence, method: KVMethod) -> None:
        """Prefix caching (`pool.cache`), for a request whose method shares prompt pages (`shares_prefix`): take the
        cached blocks its prompt starts with (leaving its last token, and the method's observation window, to be
        computed), and mark its full prompt pages for the cache (`cache_prompt`; `SeqKV.protect`)."""
        if self.pool.cache is None or not method.shares_prefix(seq):
            return
        page, n = self.pool.page_size, len(seq.prompt_ids)
        cache = self.pool.cache
        seq.block_keys = PromptKeys(seq.prompt_ids, page, like=cache.recent)
        cache.recent.append(seq.block_keys)
        blocks = cache.match(seq.block_keys.runs((n - max(method.window_size(), 1)) // page))
        if blocks:
            self.reserve_table(seq)
            seq.kv.share(blocks)
            seq.num_computed = len(blocks) * page
            if not seq.output_ids:  # not a recompute after preemption (its own pages may be cached by then)
                seq.stats.cached_tokens = seq.num_computed
        seq.cached_blocks = len(blocks)
        seq.kv.protect = seq.block_keys.count

    def cache_prompt(self, seq: Sequence) -> int:
        """Add the prompt pages its prefill has computed in every layer to the prefix cache (once the prompt is done,
        the protected pages a compaction set aside go back: the cache keeps them); how many blocks were added."""
        if seq.block_keys is None:
            return 0
        kv, done = seq.kv, min(seq.num_computed // self.pool.page_size, seq.block_keys.count)
        added = 0
        if done > seq.cached_blocks:
            held = [kv.aside[layer] if len(kv.aside[layer]) else kv.layer_pages(layer)
                    for layer in range(self.config.num_layers)]
            pages = np.array([pages[seq.cached_blocks : done] for pages in held], dtype=np.int64).T  # [blocks, layers]
            added = self.pool.cache.add(seq.block_keys.first(done)[seq.cached_blocks:], pages, held=True)
        seq.cached_blocks = max(seq.cached_blocks, done)
        if seq.prefill is None:  # the prompt is done
            if any(map(len, kv.aside)):  # tail first (`SeqKV.release`)
                self.pool.release(np.concatenate([aside[::-1] for aside in kv.aside]))
            kv.aside = [aside[:0] for aside in kv.aside]
            kv.protect = 0
            seq.block_keys = None
        return added

    def _prefill_layers(self, seq: Sequence, budget: int) -> torch.Tensor | None:
        """The next layers of a prefill by layer: as many as `budget` tokens pay for (a layer costs the prompt's
        tokens over the layers; at least one; 0: all), every chunk through each; the logits once the last is done."""
        plan, n, layers = seq.prefill, len(seq.prompt_ids), self.config.num_layers
        if plan.layers is None:
            first = plan.first  # rows of `plan.ids`: prompt positions from `first` on
            steps = [(a - first, b - first,
                      PrefillStep(self, seq, plan.method, a, b, evict, plan.record_window if b == n else 0))
                     for a, b, evict in plan.spans]
            plan.layers = self.model.by_layer(plan.ids, steps, slice(n - 1 - first, n - first))
        count = layers if not budget else max(1, budget * layers // max(n - plan.spans[0][0], 1))
        for _ in range(count):
            try:
                next(plan.layers)
            except StopIteration as done:
                plan.spans.clear()
                plan.layers = None
                return done.value
        return None

    def chunk_of(self, method: KVMethod, limit: int | None = None) -> int:
        """Prompt tokens per prefill chunk under `method`: its own chunk when it has one (its prefill depends on
        them), else the engine's, or `limit` (a scheduler's step budget) when shorter."""
        own = method.prefill_chunk()
        if own is not None:
            return min(own, self.prefill_chunk)
        return min(limit or self.prefill_chunk, self.prefill_chunk)

    def prefill_order(self, n: int, method: KVMethod, limit: int | None = None) -> str:
        """How a prompt of n tokens is prefilled under `method` in chunks of at most `limit` tokens: "one chunk"
        (each layer filled and evicted in turn), "by layer" (several chunks, every chunk through one layer before the
        next: `KVMethod.prefill_by_layer`) or "by chunk" (several chunks, every layer holding the prompt until the
        last one)."""
        if n <= self.chunk_of(method, limit):
            return "one chunk"
        return "by layer" if method.prefill_by_layer() else "by chunk"

    def _admit(self, seq: Sequence, method: KVMethod) -> None:
        self._live[seq] = method
        self.reserve_table(seq)
        method.admit(seq)

    def reserve_table(self, seq: Sequence) -> None:
        """Make a request's page table as wide as its prompt and output can fill (`SeqKV.reserve`)."""
        seq.kv.reserve(-(-(len(seq.prompt_ids) + seq.params.max_new_tokens) // self.pool.page_size) + 1)

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
        seq.prefill = None  # a prefill cut short: its prompt on the device, a prefill by layer's hidden states

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
                           host, cache, self.pool.cached_pages)

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
                src, dst = (kv.table[layer, : seq.kv.page_count[layer]] for kv in (seq.kv, twin.kv))
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

    def step_inputs(self, seqs: list[Sequence], method: KVMethod, ahead: int = 0) -> StepInputs:
        """The method picks write slots (decode eviction) or every layer appends; appended tokens get pages. The
        inputs reach the device in one copy that does not wait for it. ahead: for a step after the ones launched
        and not yet completed, this many steps after the last completed one (its token is not known yet: the caller
        fills it in on the device; positions are that much further)."""
        write = None
        if type(method).begin_step is not KVMethod.begin_step:
            before = [list(s.kv.num_slots) for s in seqs]
            sent = self.pool.staging.send([[s.num_computed, *n] for s, n in zip(seqs, before)])  # does not wait
            positions, slots_before = sent[:, 0], sent[:, 1:]  # [B], [B, layers]
            write = method.begin_step(DecodeBatch(seqs, positions, slots_before, self.config))
        if write is None:  # every layer appends
            append_slots([seq.kv for seq in seqs if not seq.slot_ready])
            for seq in seqs:
                seq.slot_ready = bool(ahead)
        else:
            appends = (write == slots_before[:, :, None]).any(-1).tolist()
            requests = []
            for b, seq in enumerate(seqs):
                grown = {layer: n + 1 for layer, n in enumerate(before[b]) if appends[b][layer]}
                for layer, n in grown.items():
                    seq.kv.num_slots[layer] = n
                requests.append((seq.kv, grown))
            ensure_many(requests)
        packed = self.pool.staging.send([[0 if ahead else s.next_input, s.num_computed + ahead, *s.kv.num_slots]
                                         for s in seqs])
        if write is None:  # the slot before the count, in every layer and head
            write = (packed[:, 2:] - 1)[:, :, None].expand(-1, -1, self.config.num_kv_heads)
        return StepInputs(packed, write)

    def step_batch(self, seqs: list[Sequence], inputs: StepInputs, plan: StepPlan | None) -> DecodeBatch:
        """The batch of a prepared eager step as `select` sees it (page tables stacked, shapes from the lengths)."""
        tables = stack_tables([s.kv.table for s in seqs])
        return DecodeBatch(seqs, inputs.positions, inputs.num_slots, self.config, tables,
                           max(max(s.kv.num_slots) for s in seqs), plan, self.pool, tokens=inputs.tokens)

    def finish_step(self, seqs: list[Sequence], step: DecodeStep,
                    tokens: torch.Tensor | None = None) -> list[int] | None:
        """Account a finished forward in one read from the device: the step's attention statistics and, given the
        next tokens [B] on the device, those tokens (returned)."""
        return self.finish_read(seqs, self.read_step(seqs, step, tokens))

    def read_step(self, seqs: list[Sequence], step: DecodeStep, tokens: torch.Tensor | None = None,
                  early: bool = False) -> StepRead:
        """What a decode step's accounting reads: its attention statistics and, given, the next tokens [B]; early
        (on CUDA): copied now into pinned host memory, without waiting."""
        n = len(seqs)
        rows = [step.attended_sum[:n].double() / self.config.num_layers, step.attended_max[:n].double()]
        if tokens is not None:
            rows.append(tokens.double())  # token ids are exact in float64
        values = torch.stack(rows)  # [2 or 3, B]
        selection_s = (step.selection_s + self.step_plan_s) / n
        if not early:
            return StepRead(values, None, selection_s)
        return StepRead(*copy_early(values), selection_s)

    def finish_read(self, seqs: list[Sequence], read: StepRead) -> list[int] | None:
        """`finish_step` from a `read_step`: waits for the read (only for it, when it was early), accounts the
        step's statistics, returns its tokens when it read them."""
        if read.ready is not None:
            read.ready.synchronize()
        values = read.values.tolist()
        for seq, attended, widest in zip(seqs, values[0], values[1]):
            if seq.finished:  # released since the step was launched (`complete_step` skips it)
                continue
            seq.num_computed += 1
            seq.attended_total += attended
            stats = seq.stats
            stats.kv_attended_max = max(stats.kv_attended_max, int(widest))
            stats.selection_s += read.selection_s
        return [int(t) for t in values[2]] if len(values) == 3 else None

    def run(self, seqs: list[Sequence], method: KVMethod, is_stop, progress: bool = False,
            prefix_caching: bool = False) -> None:
        """Continuous batching (`Scheduler`): admit waiting requests while the pool can hold their prompts and the
        device the method's state for them, prefill each on admission, decode the running batch one step at a time
        (preempting the newest request when the pages of a step are missing), release finished requests. A request
        that cannot fit waits; one that cannot fit even alone is an error. prefix_caching: reuse cached prompt
        pages (`Scheduler`)."""
        scheduler = Scheduler(self, prefix_caching=prefix_caching)
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
        statistics and stop checks (what `run`, `generate` and the benchmarks time): `launch_step` then
        `complete_step`."""
        self.complete_step(self.launch_step(running, method, graphs, pick), is_stop)

    def launch_step(self, running: list[Sequence], method: KVMethod, graphs: GraphRunner | None, pick=_sample,
                    early: bool = False, behind: int = 0) -> LaunchedStep:
        """A decode step up to its read: the forward (graph replay when it fits), the greedy tokens chosen on the
        device, the next step's inputs prepared while it runs, the method's `observe_logits`. early: the read is
        copied to the host as soon as the forward is done (CUDA), so that `complete_step` waits for this step only,
        not for work queued after it (a scheduler's prompt chunks or next step). behind: steps of these requests
        launched before this one and not yet completed (a pipelined launch, `pipelines`: 1)."""
        started = time.perf_counter()
        inputs = self._ahead[1] if self.ready_ahead(running) else None
        self._ahead = None
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
        read = self.read_step(running, step, chosen, early)
        steady = not any(s.replaying for s in running)  # a recomputed request's next input is its output, not this
        if (greedy and steady and method.graph_safe and method.steady_slots and type(method).begin_step is
                KVMethod.begin_step and self.can_grow(running, method)):
            # while the device runs this step, prepare the next one for the same batch (its tokens are this step's
            # greedy tokens, filled in on the device), when its pages are there beside the scheduler's `reserved`;
            # a request that finishes now leaves a spare slot behind, and the method's end_step must not move the
            # cache (`steady_slots`)
            upcoming = self.step_inputs(running, method, ahead=1 + behind)
            upcoming.packed[:, 0] = chosen
            self._ahead = (list(running), upcoming)
        span = self.timer.start("selection") if self.timer else None  # per-step bookkeeping of the method
        method.observe_logits(running, logits)
        if span:
            self.timer.stop(span)
        return LaunchedStep(running, method, logits, read, steady, pick, time.perf_counter() - started)

    @staticmethod
    def pipelines(method: KVMethod) -> bool:
        """True when a decode step of `method` may be launched before the one before it is completed: the step reads
        nothing that the last one's end leaves on the host (no step plan, `end_step` or `observe_logits` of its own,
        or a plan made without it: `plans_ahead`), so its tokens are those of steps run one after another."""
        hooks = ("begin_step",) if method.plans_ahead else ("begin_step", "step_plan", "end_step", "observe_logits")
        return all(getattr(type(method), hook) is getattr(KVMethod, hook) for hook in hooks)

    def ready_ahead(self, running: list[Sequence]) -> bool:
        """True when the last launched step prepared the inputs of the next one for exactly these requests, in this
        order (their tokens that step's, filled in on the device): that step may be launched before the last one is
        completed."""
        ahead = self._ahead
        return ahead is not None and len(ahead[0]) == len(running) and all(
            a is s and s.slot_ready for a, s in zip(ahead[0], running))

    def complete_step(self, launched: LaunchedStep, is_stop) -> None:
        """The rest of a launched decode step: its tokens and statistics in one read (greedy), the method's
        `end_step`, each request's next token and stop check."""
        started = time.perf_counter()
        running, method, logits, pick = launched.running, launched.method, launched.logits, launched.pick
        tokens = self.finish_read(running, launched.read)
        if any(s.finished for s in running):  # launched before the step that finished them was completed: their
            live = [b for b, s in enumerate(running) if not s.finished]  # tokens here are past their end
            running, logits = [running[b] for b in live], logits[live]
            tokens = None if tokens is None else [tokens[b] for b in live]
            if not running:
                return
        # a request recomputed after preemption (`Sequence.replaying`) knows its next token: its output's
        known = [s.output_ids[s.num_computed - len(s.prompt_ids)] if s.num_computed < s.num_tokens else None
                 for s in running]
        if tokens is None:
            tokens = self.agree([pick(s, logits[b]) if k is None else k
                                 for b, (s, k) in enumerate(zip(running, known))])
        elif not launched.steady:
            tokens = [t if k is None else k for t, k in zip(tokens, known)]
        span = self.timer.start("selection") if self.timer else None
        method.end_step(running, logits, tokens)
        if span:
            self.timer.stop(span)
        elapsed = launched.host_s + time.perf_counter() - started
        for b, (seq, token) in enumerate(zip(running, tokens)):
            resident = seq.kv.resident_slots() - seq.slot_ready  # not counting a slot prepared for the next step
            stats = seq.stats
            stats.kv_resident_tokens = max(stats.kv_resident_tokens, resident)
            stats.decode_s += elapsed
            if known[b] is None:
                self.append_token(seq, token, is_stop, None if seq.params.logprobs is None else logits[b])

    def agree(self, tokens: list[int]) -> list[int]:
        """Rank 0's tokens on every rank with tensor parallelism (its sampler decides), else the tokens."""
        return tokens if self.tp is None else self.tp.broadcast_object(tokens)

    def finish(self, seq: Sequence) -> None:
        """A request ended: its mean attended tokens are final and everything it holds is released."""
        seq.stats.kv_attended_tokens = seq.attended_total / max(len(seq.output_ids) - 1, 1)
        self.release(seq)

    def pages_needed(self, seq: Sequence, method: KVMethod, prefill: bool = False, limit: int | None = None) -> int:
        """Pages a request may hold at most: every layer keeps what the method keeps on the device
        (`device_tokens`), else its whole prompt and output (Full KV). With `prefill`, the most it holds until its
        prefill (in chunks of at most `limit` tokens) is done: Full KV's prompt; a prompt of one chunk, or of several
        under a method that prefills by layer, fills and evicts one layer at a time (one layer holds the whole
        prompt, the others their bound); otherwise every layer holds the prompt until its last chunk. A prompt whose
        pages go to the prefix cache keeps them while the method compacts the layers (`SeqKV.protect`): its bound
        comes on top."""
        n, new = len(seq.prompt_ids), seq.params.max_new_tokens
        page, layers = self.pool.page_size, self.config.num_layers
        bound = method.device_tokens(n, new, page)
        if bound is None:
            return layers * -(-(n if prefill else n + new) // page)
        if not prefill:
            return layers * -(-bound // page)
        if seq.kv.protect:
            return layers * (-(-n // page) + -(-bound // page))
        if self.prefill_order(n, method, limit) == "by chunk":
            return layers * -(-max(bound, n) // page)
        return (layers - 1) * -(-bound // page) + -(-max(bound, n) // page)

    def pages_available(self) -> int:
        """Pages requests can still take: free ones, cached ones no request holds (evicted when needed), and of the
        never-used ones as many as the device can hold the per-page state beside the pool for."""
        pool = self.pool
        if pool.max_pages is None:
            return math.inf
        fresh = pool.num_pages - pool.touched
        per_page = pool.page_state_bytes()
        if per_page and fresh > pool.coverage - pool.touched:
            room = self.state_room()
            if self.tp is not None:  # every rank decides alike
                room = self.tp.host_min(room)
            if math.isfinite(room):  # the coverage whose grown tables fit beside the old ones (a quarter more)
                fresh = min(fresh, max(pool.coverage, int(max(room, 0) // per_page) * 4 // 5) - pool.touched)
        return len(pool.free) + fresh + pool.cached_pages

    def can_grow(self, seqs: list[Sequence], method: KVMethod) -> bool:
        """Whether the next decode step of these requests has its pages without preempting anything: at once when
        the pool holds a page for every layer of every row beside the pages `reserved` by the scheduler."""
        pool = self.pool
        if pool.max_pages is None or pool.ready_pages - self.reserved >= len(seqs) * self.config.num_layers:
            return True
        return self.step_pages(seqs, method) <= self.pages_available() - self.reserved

    def step_pages(self, seqs: list[Sequence], method: KVMethod) -> int:
        """Pages the next decode step of these requests may take: a page in each layer whose last page is full, for
        a request below its bound (`pages_needed`)."""
        page, total = self.pool.page_size, 0
        for seq in seqs:
            if seq.slot_ready or all(n % page for n in seq.kv.num_slots):
                continue
            room = self.pages_needed(seq, method) - int(seq.kv.page_count.sum())
            total += max(min(sum(1 for n in seq.kv.num_slots if n % page == 0), room), 0)
        return total

    def blocked(self, seq: Sequence, method: KVMethod, reserved: int = 0, limit: int | None = None) -> str | None:
        """Why `seq` cannot be admitted now, or None when it can: the pages of its prefill (in chunks of at most
        `limit` tokens) beyond what the pool has available less `reserved` (pages promised to requests being
        prefilled), the device memory of its method state, of the per-page state its pages add and of its prompt's
        hidden states, or host memory for its offloaded K/V."""
        need = 0
        if self.pool.max_pages is not None:
            need = self.pages_needed(seq, method, prefill=True, limit=limit)
            room = self.pages_available() - reserved
            if room < need:
                return (f"request {seq.seq_id} needs {need} KV pages; {max(room, 0)} are available now and the pool "
                        f"has {self.pool.num_pages - 1} (raise gpu_memory_utilization or shorten it)")
        host = method.admission_host_bytes(seq)
        if host:
            room = available_host_bytes()
            if self.tp is not None:  # the ranks share the host; they decide alike
                room = self.tp.host_min(room / self.tp.size)
            if host > room:
                return (f"request {seq.seq_id} needs {host / 2**30:.2f} GiB of host memory for its offloaded K/V; "
                        f"{room / 2**30:.2f} GiB is available (lower the batch or shorten it)")
        state, pages, hidden = self.admission_state(seq, method, need, limit)
        room = self.state_room(method) if state or hidden or pages else math.inf  # most allocate nothing
        if (state or hidden or pages) and self.tp is not None:
            room = self.tp.host_min(room)
        if state + hidden + pages > room:
            what = [f"{state / 2**30:.2f} GiB of {method.name} state"] if state else []
            if pages:
                what.append(f"{pages / 2**30:.2f} GiB of state kept by KV page")
            if hidden:  # a prefill by layer keeps the prompt's hidden states
                what.append(f"{hidden / 2**30:.2f} GiB of its prompt's hidden states")
            return (f"request {seq.seq_id} needs {' and '.join(what)} beside the KV pool; "
                    f"{max(room, 0) / 2**30:.2f} GiB is free there (lower gpu_memory_utilization or shorten it)")
        return None

    def admission_state(self, seq: Sequence, method: KVMethod, pages: int,
                        limit: int | None = None) -> tuple[int, int, int]:
        """Device bytes beside the pool that admitting `seq` with `pages` more KV pages may allocate: (its method's
        state: `admission_bytes`; the state kept by page that the pool grows for those pages, the method's own too:
        `KVPool.cover_bytes`; its prompt's hidden states when prefilled by layer)."""
        covered = self.pool.touched + pages  # the most page ids in use once it is prefilled
        by_page = self.pool.cover_bytes(covered)
        if covered > self.pool.coverage:  # its own per-page state, if it is not grown with the others yet
            by_page += method.page_state_bytes(self.pool) * self.pool.coverage_for(covered)
        return method.admission_bytes(seq), by_page, self.hidden_state_bytes(seq, method, limit)

    def hidden_state_bytes(self, seq: Sequence, method: KVMethod, limit: int | None = None) -> int:
        """Device bytes a prefill by layer keeps for the whole prompt (its hidden states and residual stream); 0 for a
        prompt of one chunk or a prefill chunk after chunk."""
        n = len(seq.prompt_ids)
        if self.prefill_order(n, method, limit) != "by layer":
            return 0
        return 2 * n * self.config.hidden_size * self.dtype.itemsize

    def state_room(self, method: KVMethod | None = None) -> float:
        """Device bytes methods may still allocate beside the KV pool: `state_memory` less what the live methods
        hold (or `method`, when given), else on CUDA the free memory less the activation reserve, else unbounded.
        The free memory is the driver's and torch's cached blocks that could go back to it (whole free segments),
        not the free pieces of segments still in use: a state tensor of GiBs cannot use those fragments (on an H200
        at 32k, 4-11 GiB of them were counted, and SentenceKV's and DynSplit-KV's offloading rows ran out of memory
        growing)."""
        if self.state_memory is not None:
            methods = [method] if method is not None else list({id(m): m for m in self._live.values()}.values())
            return self.state_memory - sum(self._held(m)[0] for m in methods)
        if self.device.type != "cuda":
            return math.inf
        free, _ = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        cached = stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
        releasable = cached - stats.get("inactive_split_bytes.all.current", 0)
        return free + max(releasable, 0) - ACTIVATION_RESERVE

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
