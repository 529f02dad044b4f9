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
                                 self.plan, engine.pool, graphed=True)
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
