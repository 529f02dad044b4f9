"""CUDA-graph replay of the decode step for methods marked `graph_safe` (Full KV and the selection methods written
against DecodeBatch tensors).

One graph per batch-size bucket, captured over static buffers: token ids, positions, slot counts and write slots
(one int64 buffer), page tables, and the method's step plan (`KVMethod.plan_buffers`). Before each replay the step's
inputs are copied in from the device (`Engine.prepare_step` sent them in one copy and made the plan); a row's page
table is copied again only when the row holds another sequence or its sequence got new pages (`SeqKV.version`), and
the plan only when it changed.
Batches smaller than the bucket are padded with rows that point at the pool's scratch page. Shapes are fixed by
capacity (`max_slots`), so nothing in the captured step reads a device value back. Without CUDA the same
static-buffer step runs eagerly, which is how the CPU tests check the padding and reuse logic.
"""
from __future__ import annotations

import warnings

import torch

from semkv.engine.hooks import DecodeBatch, KVMethod, StepPlan
from semkv.engine.kv_cache import stack_tables
from semkv.engine.sequence import Sequence
from semkv.engine.step import DecodeStep, StepInputs

# batch sizes a graph is captured for (each when first needed); a larger batch runs eagerly, with a warning
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024)


class GraphedStep:
    def __init__(self, engine, method: KVMethod, size: int, max_pages: int, capture: bool):
        layers, heads = engine.config.num_layers, engine.config.num_kv_heads
        device, scratch = engine.device, engine.pool.scratch
        self.engine, self.method, self.size, self.max_pages = engine, method, size, max_pages
        # per row: token, position, slot counts [layers], write slots [layers * kv_heads]; padding rows hold one
        # slot, written and attended on the scratch page
        width = 2 + layers + layers * heads
        self.padding = torch.zeros(width, dtype=torch.long, device=device)
        self.padding[2 : 2 + layers] = 1
        self.inputs = self.padding.repeat(size, 1)
        self.tokens, self.positions = self.inputs[:, 0], self.inputs[:, 1]
        self.num_slots = self.inputs[:, 2 : 2 + layers]
        self.write = self.inputs[:, 2 + layers :].view(size, layers, heads)
        self.tables = torch.full((size, layers, max_pages), scratch, dtype=torch.long, device=device)
        self.table_versions: list[int | None] = [None] * size  # `SeqKV.version` of the table each row holds
        self.rows = 0  # rows holding sequences at the last replay
        max_slots = max_pages * engine.pool.page_size
        self.plan = method.plan_buffers(size, max_slots, device)
        self.last_plan, self.plan_rows = None, 0  # the plan the buffers hold, for how many rows
        self.batch = DecodeBatch([], self.positions, self.num_slots, engine.config, self.tables, max_slots,
                                 self.plan, engine.pool, graphed=True, tokens=self.tokens)
        self.graph = None
        if capture:
            self._capture()

    def _forward(self):
        self.step = DecodeStep(self.engine, self.batch, self.method, self.write)
        self.logits = self.engine.model(self.tokens, self.step)
        self.step.finish()

    def _capture(self) -> None:
        stream = self.engine.capture_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._forward()
        self.step.selection_s = 0.0  # host timing means nothing under replay; benches time selection with events

    def run(self, seqs: list[Sequence], inputs: StepInputs, plan: StepPlan | None) -> torch.Tensor:
        n, layers = len(seqs), self.engine.config.num_layers
        self.inputs[:n, : 2 + layers] = inputs.packed
        self.write[:n] = inputs.write
        if n < self.rows:  # rows that held sequences become padding
            self.inputs[n : self.rows] = self.padding
            self.tables[n : self.rows] = self.engine.pool.scratch
            self.table_versions[n : self.rows] = [None] * (self.rows - n)
        self.rows = n
        stale = [b for b, seq in enumerate(seqs) if self.table_versions[b] != seq.kv.version]
        # one copy for each run of consecutive rows whose tables changed (at a page boundary: one run, every row);
        # slices, not an index tensor, so that nothing waits for the device
        for first, last in _runs(stale):
            tables = [seq.kv.table for seq in seqs[first:last]]
            width = min(max(t.shape[1] for t in tables), self.max_pages)
            self.tables[first:last, :, :width] = stack_tables([t[:, :width] for t in tables])
            self.tables[first:last, :, width:] = self.engine.pool.scratch
            for b in range(first, last):
                self.table_versions[b] = seqs[b].kv.version
        if self.plan is not None and (plan is not self.last_plan or n != self.plan_rows):
            plan.copy_to(self.plan, n)
            self.last_plan, self.plan_rows = plan, n
        if self.graph is not None:
            self.graph.replay()
        else:
            self._forward()
        return self.logits[:n]


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Increasing row numbers -> their runs of consecutive rows, as [first, last) pairs."""
    runs: list[tuple[int, int]] = []
    for b in rows:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs


class GraphRunner:
    """Decode steps through captured graphs; a batch larger than the largest bucket or a sequence longer than the
    capacity is an error the engine avoids by falling back to eager steps."""

    def __init__(self, engine, method: KVMethod, max_pages: int):
        self.engine, self.method, self.max_pages = engine, method, max_pages
        self.capture = engine.device.type == "cuda"
        self.steps: dict[int, GraphedStep] = {}
        self.epoch = self._epoch()  # when either changes the graphs point at moved buffers
        self.replay_events: list | None = None  # a list: each step's (start, end) CUDA events (benches set it)
        self.warned = False  # a batch larger than the largest bucket was said to run eagerly

    def _epoch(self) -> tuple[int, int]:
        """`KVMethod.graph_epoch` and, for a method with state kept by page, the pool's `coverage_epoch` (that state
        grew)."""
        pool = self.engine.pool
        return self.method.graph_epoch, pool.coverage_epoch if self.method.page_state_bytes(pool) else 0

    def fits(self, seqs: list[Sequence]) -> bool:
        if len(seqs) > BUCKETS[-1] and not self.warned:
            warnings.warn(f"a batch of {len(seqs)} sequences is larger than the largest CUDA-graph batch "
                          f"({BUCKETS[-1]}): its decode steps run eagerly, with the host launching every kernel",
                          stacklevel=2)
            self.warned = True
        return len(seqs) <= BUCKETS[-1] and max(s.kv.widest for s in seqs) <= self.max_pages

    @torch.inference_mode()
    def decode_step(self, seqs: list[Sequence]) -> torch.Tensor:
        """`Engine.decode_step` through the graph of the batch's bucket."""
        logits, step = self.forward_step(seqs, *self.engine.prepare_step(seqs, self.method))
        self.engine.finish_step(seqs, step)
        return logits

    @torch.inference_mode()
    def forward_step(self, seqs: list[Sequence], inputs: StepInputs, plan: StepPlan | None):
        """`Engine.forward_step` through the graph: logits [B, vocab] and the captured step (its statistics)."""
        if self.epoch != self._epoch():
            self.steps.clear()
            self.epoch = self._epoch()
        size = next(b for b in BUCKETS if b >= len(seqs))
        if size not in self.steps:
            self.steps[size] = GraphedStep(self.engine, self.method, size, self.max_pages, self.capture)
        graphed = self.steps[size]
        if self.replay_events is None or not self.capture:
            return graphed.run(seqs, inputs, plan), graphed.step
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        logits = graphed.run(seqs, inputs, plan)
        end.record()
        self.replay_events.append((start, end))
        return logits, graphed.step


# prompt-chunk lengths whose dense work replays from graphs, a chunk's rows padded up to the next one; a longer chunk
# runs eagerly (its kernels outlast the host's launches). The short sizes serve a follow-up question on a cached
# document, whose prefill is its question's few dozen tokens (padded to 1,024 rows they cost the dense work of 1,024)
PREFILL_SIZES = (64, 256) + tuple(range(1024, 8193, 1024))


class PrefillGraphs:
    """The dense work of a prompt chunk (embedding, norms, projections, MLPs: all but the attention) replayed from
    CUDA graphs, piecewise as vLLM does it: for each chunk length of `PREFILL_SIZES`, a graph before the first
    layer's attention (`LlamaModel.enter`) and one after each layer's attention (`leave`), the attention itself (which
    the KV method steers: page allocation, sparse context, eviction) running eagerly between them. Eagerly, the host
    spends about 1.5 ms a layer launching a chunk's kernels, as long as an H200 takes to run those of an 8,192-token
    chunk of a 0.5B model; a server's steps then waited on the host.

    Static buffers of the longest size serve every size: token ids, the q/k/v a piece leaves for the next attention
    (one buffer for every layer), the attention's output the next piece reads, and the last piece's hidden states
    and residual. The graphs share one memory pool: a piece's intermediates (and the residual stream between two
    pieces) reuse memory that earlier pieces freed, which is safe because pieces replay in the order they were
    captured. Padding rows hold stale values; every dense operation works row by row, so they never reach a chunk's
    rows, and the attention sees the chunk's rows only. Without CUDA the same pieces run eagerly over the static
    buffers (how the CPU tests check them)."""

    def __init__(self, engine):
        model, device, dtype = engine.model, engine.device, engine.dtype
        first = model.model.layers[0].self_attn
        top, hidden = PREFILL_SIZES[-1], model.model.embed_tokens.embedding_dim
        self.engine, self.model, self.layers = engine, model, len(model.model.layers)
        self.capture = device.type == "cuda"
        self.ids = torch.zeros(top, dtype=torch.long, device=device)
        self.qkv = torch.zeros(top, first.qkv_proj.out_features, dtype=dtype, device=device)
        self.out = torch.zeros(top, first.o_proj.in_features, dtype=dtype, device=device)
        self.hidden = torch.zeros(top, hidden, dtype=dtype, device=device)
        self.residual = torch.zeros(top, hidden, dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.failed = False  # a capture ran out of memory: chunks run eagerly from then on

    def size(self, tokens: int) -> int | None:
        """The padded length a chunk of `tokens` replays at, or None (it runs eagerly)."""
        if self.failed or tokens > PREFILL_SIZES[-1]:
            return None
        return next(s for s in PREFILL_SIZES if s >= tokens)

    def prepare(self, tokens: int) -> None:
        """Capture every size up to the one of a chunk of `tokens`, longest first (a server's warm-up)."""
        top = self.size(min(tokens, PREFILL_SIZES[-1]))
        for size in sorted((s for s in PREFILL_SIZES if s <= (top or 0)), reverse=True):
            if self.capture and size not in self.graphs and not self.failed:
                self._capture(size)

    def forward(self, input_ids: torch.Tensor, ctx, logits_at: torch.Tensor | slice) -> torch.Tensor:
        """`LlamaModel.forward` of a chunk whose `size` is not None: input_ids [T] -> logits [len(logits_at), vocab]."""
        n, size = input_ids.shape[0], self.size(input_ids.shape[0])
        if self.capture and size not in self.graphs:
            self._capture(size)
        self.ids[:n] = input_ids
        graphs = self.graphs.get(size)
        residual = None
        for i in range(self.layers + 1):
            if i:
                self.out[:n] = self.model.model.layers[i - 1].self_attn.attend(self.qkv[:n], ctx)
            if graphs is not None:
                graphs[i].replay()
            else:
                residual = self._dense(i, size, residual)
        return self.model._logits(self.hidden[:n], self.residual[:n], logits_at)

    def _dense(self, i: int, size: int, residual: torch.Tensor | None) -> torch.Tensor | None:
        """Piece i over the buffers' first `size` rows (0: before the first attention; i: after layer i - 1's);
        the residual stream it leaves for the next piece (None after the last)."""
        rows = slice(0, size)
        if i == 0:
            return self.model.enter(self.ids[rows], self.qkv[rows])[1]
        if i < self.layers:
            return self.model.leave(i - 1, self.out[rows], residual, self.qkv[rows])[1]
        hidden, residual = self.model.leave(i - 1, self.out[rows], residual)
        self.hidden[rows] = hidden
        self.residual[rows] = residual
        return None

    def _capture(self, size: int) -> None:
        stream = self.engine.capture_stream
        try:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm up: Triton compiles, cuBLAS picks its kernels
                residual = None
                for i in range(self.layers + 1):
                    residual = self._dense(i, size, residual)
            torch.cuda.current_stream().wait_stream(stream)
            graphs = []
            for i in range(self.layers + 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    left = self._dense(i, size, residual)
                residual = left  # the previous piece's residual is free for the next pieces to reuse
                graphs.append(graph)
        except torch.cuda.OutOfMemoryError:
            self.failed = True
            warnings.warn(f"no device memory to capture the prefill's graphs of {size} tokens: prompt chunks run "
                          "eagerly, the host launching every kernel", RuntimeWarning, stacklevel=3)
            return
        self.graphs[size] = graphs
