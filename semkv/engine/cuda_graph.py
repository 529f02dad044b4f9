"""CUDA-graph replay of the decode step for methods marked `graph_safe` (Full KV and the selection methods written
against DecodeBatch tensors).

One graph per batch-size bucket, captured over static buffers: token ids, positions, slot counts, write slots and
page tables. Before each replay the host copies the step's values into them; batches smaller than the bucket are
padded with rows that point at the pool's scratch page. Shapes are fixed by capacity (`max_slots`), so nothing in
the captured step reads a device value back. Without CUDA the same static-buffer step runs eagerly, which is how
the CPU tests check the padding logic.
"""
from __future__ import annotations

import torch

from semkv.engine.sequence import Sequence
from semkv.methods.base import DecodeBatch, KVMethod, Selection

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


class GraphedStep:
    def __init__(self, engine, method: KVMethod, size: int, max_pages: int, capture: bool,
                 step_selection: Selection | None):
        layers, heads = engine.config.num_layers, engine.config.num_kv_heads
        device, scratch = engine.device, engine.pool.scratch
        self.engine, self.method, self.size, self.max_pages = engine, method, size, max_pages
        self.tokens = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.num_slots = torch.ones(size, layers, dtype=torch.long, device=device)
        self.write = torch.zeros(size, layers, heads, dtype=torch.long, device=device)
        self.tables = torch.full((size, layers, max_pages), scratch, dtype=torch.long, device=device)
        max_slots = max_pages * engine.pool.page_size
        self.selection = None
        if step_selection is not None:  # static copy of the per-step selection (padding rows attend to slot 0)
            shape = (size, step_selection.slots.shape[1])
            width = method.selection_width(max_slots)
            self.selection = Selection(torch.zeros(*shape, width, dtype=torch.long, device=device),
                                       torch.ones(shape, dtype=torch.long, device=device))
        self.batch = DecodeBatch(None, self.positions, self.num_slots, engine.config, self.tables, max_slots,
                                 self.selection, engine.pool)
        self.graph = None
        if capture:
            self._capture()

    def _forward(self):
        from semkv.engine.engine import DecodeStep

        self.step = DecodeStep(self.engine, self.batch, self.method, self.write)
        self.logits = self.engine.model(self.tokens, self.step)

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._forward()
        self.step.selection_s = 0.0  # host timing means nothing under replay; benches time selection with events

    def run(self, seqs: list[Sequence], batch: DecodeBatch, write: torch.Tensor) -> torch.Tensor:
        n = len(seqs)
        scratch = self.engine.pool.scratch
        self.tokens[:n] = torch.tensor([s.last_token for s in seqs], device=self.tokens.device)
        self.positions[:n] = batch.positions
        self.num_slots[:n] = batch.num_slots
        self.write[:n] = write
        width = min(batch.tables.shape[2], self.max_pages)
        self.tables[:n, :, :width] = batch.tables[:, :, :width]
        self.tables[:n, :, width:] = scratch
        self.tables[n:] = scratch
        self.num_slots[n:], self.positions[n:], self.write[n:] = 1, 0, 0
        if self.selection is not None:
            chosen = batch.step_selection
            width = chosen.slots.shape[2]
            self.selection.slots[:n, :, :width] = chosen.slots
            self.selection.lengths[:n] = chosen.lengths
            self.selection.lengths[n:] = 1
        if self.graph is not None:
            self.graph.replay()
        else:
            self._forward()
        return self.logits[:n]


class GraphRunner:
    """Decode steps through captured graphs; a batch larger than the largest bucket or a sequence longer than the
    capacity is an error the engine avoids by falling back to eager steps."""

    def __init__(self, engine, method: KVMethod, max_pages: int):
        self.engine, self.method, self.max_pages = engine, method, max_pages
        self.capture = engine.device.type == "cuda"
        self.steps: dict[int, GraphedStep] = {}

    def fits(self, seqs: list[Sequence]) -> bool:
        widest = max(max(len(p) for p in s.kv.pages) for s in seqs)
        return len(seqs) <= BUCKETS[-1] and widest <= self.max_pages

    @torch.inference_mode()
    def decode_step(self, seqs: list[Sequence]) -> torch.Tensor:
        batch, write = self.engine.prepare_step(seqs, self.method)
        size = next(b for b in BUCKETS if b >= len(seqs))
        if size not in self.steps:
            self.steps[size] = GraphedStep(self.engine, self.method, size, self.max_pages, self.capture,
                                           batch.step_selection)
        graphed = self.steps[size]
        logits = graphed.run(seqs, batch, write)
        self.engine.finish_step(seqs, graphed.step)
        return logits
