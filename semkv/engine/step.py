"""The attention contexts of one forward: `PrefillStep` for a chunk of one sequence, `DecodeStep` for one decode step
of a batch (eager, or captured in a CUDA graph over static buffers), and the step's inputs on the device.

At every attention call they ask the KV method which cached slots to attend to and hand that decision to the one
sparse attention path (`semkv.kernels`); they never inspect what a method does. `engine` is the `Engine` that runs
the forward (its pool, rotary embedding, scale and timer).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from semkv import kernels
from semkv.engine.hooks import DecodeBatch, KVMethod, Selection
from semkv.engine.kv_cache import ensure_many, stack_tables
from semkv.engine.sequence import Sequence
from semkv.engine.trace import attended_positions
from semkv.kernels import fa3, reference


def plan_chunks(lo: int, hi: int, chunk: int, min_last: int) -> list[tuple[int, int]]:
    """Split [lo, hi) into chunks of `chunk` tokens whose last one holds at least min(min_last, hi - lo) tokens."""
    bounds = list(range(lo, hi, chunk)) + [hi]
    spans = list(zip(bounds[:-1], bounds[1:]))
    need = min(min_last, hi - lo)
    if spans and spans[-1][1] - spans[-1][0] < need:
        last_start = hi - need
        spans = [(a, min(b, last_start)) for a, b in spans if a < last_start] + [(last_start, hi)]
    return spans


class PrefillStep:
    """AttentionContext for one chunk of one sequence."""

    def __init__(self, engine, seq: Sequence, method: KVMethod, start: int, end: int, evict: bool,
                 record_window: int = 0):
        self.engine, self.seq, self.method, self.evict = engine, seq, method, evict
        self.positions, self.end = torch.arange(start, end, device=engine.device), end  # the chunk's tokens
        self.record_window = record_window  # keep the last queries of each layer for methods applied later
        self.cos, self.sin = engine.rotary.cos_sin(self.positions, engine.dtype, seq_len=len(seq.prompt_ids))
        # a chunk that evicts nothing (not the eviction chunk, or a method with no prefill eviction) and runs through
        # every layer in turn gets every layer's pages at its first layer, in one allocation and one copy (a layer at
        # a time costs host time that a long prompt's steps, and a follow-up's short last chunk, wait for)
        evicts = evict and type(method).evict_prefill is not KVMethod.evict_prefill
        self.pages_at_once = not evicts and not method.prefill_by_layer()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        by_rank = self.method.rope_by_rank()
        kv, pool, chunk = self.seq.kv, self.engine.pool, q.shape[0]
        self.seq.num_computed = self.end  # methods see the chunk's tokens as computed while it runs
        start = kv.num_slots[layer]
        if not self.pages_at_once:
            kv.ensure_slots(layer, start + chunk)
        elif layer == 0:
            kv.ensure_all({i: n + chunk for i, n in enumerate(kv.num_slots)})
        rows = kv.physical(layer, torch.arange(start, start + chunk, device=q.device))
        rows = rows[:, None].expand(-1, k.shape[1])
        if by_rank:  # keys stay unrotated; queries are rotated by rank below
            reference.store(k, v, rows, self.positions, *pool.flat())
        else:
            q = kernels.rope_store(q, k, v, self.cos, self.sin, rows, self.positions, *pool.flat())
        kv.num_slots[layer] = start + chunk
        context = self.method.prefill_context(layer, self.seq, q, start)
        wants_lse = self.method.prefill_lse
        key_rope = None
        if by_rank:  # ranks: the context slots first, then the chunk
            n_ctx = start if context is None else context.shape[1]
            key_rope = self.engine.rank_rope(n_ctx + chunk)
            q = self.engine.rotary.rotate(q, key_rope[0][n_ctx:], key_rope[1][n_ctx:])
            out = reference.prefill_attention(q, pool.k, pool.v, kv.table[layer], start, context, self.engine.scale,
                                              key_rope, lse=wants_lse)
        else:
            out = kernels.prefill_attention(q, pool.k, pool.v, kv.table[layer], start, context, self.engine.scale,
                                            lse=wants_lse)
        out, lse = out if wants_lse else (out, None)
        self.method.observe_prefill(layer, self.seq, q, start, lse)
        if self.record_window:
            self.seq.window_queries[layer] = q[max(chunk - self.record_window, 0):].clone()
        if self.evict:
            evict_layer(self.method, self.seq, layer, q)
        return out


class PackedPrefillStep:
    """AttentionContext for the chunks of several sequences in one forward (`Engine.prefill_together`): their tokens
    one after another, so the dense work runs once over them all, and each chunk attends over its own sequence's pages
    (one call for all of them: FlashAttention 3's varlen call where it serves, else the Triton kernel's unless cuDNN
    would take a long chunk; else, and on the CPU, one call a chunk). Only chunks that need
    nothing else of a `PrefillStep` run here (`Engine.prefill_span` says which): no sparse context, keys stored with
    RoPE, no log-sum-exps, no recorded queries, every layer holding the slots before them; a method's
    `observe_prefill` sees its own chunk's queries, and a last chunk after which the layers evict keeps each layer's
    last queries (`windows`), to evict every layer at once after the forward (`Engine.end_prompt`: later layers never
    read an earlier one's pages, which the chunk holds until its prompt ends either way). Every layer's pages are
    taken at once."""

    def __init__(self, engine, seqs: list[Sequence], spans: list[tuple[int, int, bool]]):
        self.engine, self.seqs, self.spans = engine, seqs, spans
        pool, device = engine.pool, engine.device
        lengths = [b - a for a, b, _ in spans]
        self.bounds = np.cumsum([0] + lengths).tolist()  # each chunk's first row, then the rows in all
        total, size = self.bounds[-1], pool.page_size
        ensure_many([(seq.kv, {i: b for i in range(len(seq.kv.num_slots))}) for seq, (_, b, _) in zip(seqs, spans)])
        # [3, P]: each chunk's first slot, first row and last slot + 1, whence every row's owner and position
        meta = pool.staging.send([[a for a, _, _ in spans], self.bounds[:-1], [b for _, b, _ in spans]])
        owner = torch.repeat_interleave(torch.arange(len(seqs), device=device), meta[2] - meta[0], output_size=total)
        self.positions = torch.arange(total, device=device) - meta[1][owner] + meta[0][owner]  # [T] (= slots)
        self.tables = stack_tables([seq.kv.table for seq in seqs])  # [P, layers, W]
        layers = torch.arange(self.tables.shape[1], device=device)
        pages = self.tables[owner[:, None], layers[None, :], (self.positions // size)[:, None]]  # [T, layers]
        self.rows = pages * size + (self.positions % size)[:, None]
        # FlashAttention's lengths: cu_q [P + 1] each chunk's first row then T, used_k [P]; the longest of each
        self.cu_q = torch.cat([meta[1], meta.new_full((1,), total)]).to(torch.int32)
        self.used_k = meta[2].to(torch.int32)
        self.longest = (max(lengths), max(b for _, b, _ in spans))
        self.packed_tables: torch.Tensor | None = None  # [layers, P, W] int32, made at the first packed call
        if engine.rotary.rope_type == "dynamic":  # its frequencies depend on each prompt's length
            parts = [engine.rotary.cos_sin(self.positions[lo:hi], engine.dtype, seq_len=len(seq.prompt_ids))
                     for seq, lo, hi in zip(seqs, self.bounds, self.bounds[1:])]
            self.cos, self.sin = (torch.cat(x) for x in zip(*parts))
        else:
            self.cos, self.sin = engine.rotary.cos_sin(self.positions, engine.dtype)
        self.observers = [i for i, seq in enumerate(seqs)
                          if type(seq.prefill.method).observe_prefill is not KVMethod.observe_prefill]
        # chunk -> its window's queries in every layer so far, for the chunks that end an evicting prompt
        self.windows: dict[int, list[torch.Tensor]] = {i: [] for i, (_, _, evict) in enumerate(spans) if evict}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        engine, pool = self.engine, self.engine.pool
        for seq, (_, b, _) in zip(self.seqs, self.spans):
            seq.num_computed = seq.kv.num_slots[layer] = b  # methods see the chunk's tokens as computed while it runs
        q = kernels.rope_store(q, k, v, self.cos, self.sin, self.rows[:, layer, None].expand(-1, k.shape[1]),
                               self.positions, *pool.flat())
        if kernels.packed_prefill_serves(q, pool.k, self.longest[0]):
            if self.packed_tables is None:
                self.packed_tables = self.tables.transpose(0, 1).to(torch.int32).contiguous()
            out = kernels.packed_prefill_attention(q, pool.k, pool.v, self.packed_tables[layer], self.cu_q,
                                                   self.used_k, *self.longest, engine.scale)
        else:  # one call a chunk
            out = torch.cat([kernels.prefill_attention(q[lo:hi], pool.k, pool.v, seq.kv.table[layer], a, None,
                                                       engine.scale)
                             for seq, (a, _, _), lo, hi in zip(self.seqs, self.spans, self.bounds, self.bounds[1:])])
        for i in self.observers:
            seq, lo, hi = self.seqs[i], self.bounds[i], self.bounds[i + 1]
            seq.prefill.method.observe_prefill(layer, seq, q[lo:hi], self.spans[i][0], None)
        for i, windows in self.windows.items():
            lo, hi = self.bounds[i], self.bounds[i + 1]
            windows.append(q[hi - min(self.seqs[i].prefill.method.window_size(), hi - lo) : hi].clone())
        return out


def evict_layer(method: KVMethod, seq: Sequence, layer: int, q_last: torch.Tensor) -> None:
    """Prefill-time eviction of one layer, given the queries of the last prompt tokens [w', heads, D]."""
    stats = seq.stats
    stats.kv_resident_prefill_peak = max(stats.kv_resident_prefill_peak, seq.kv.resident_slots())
    window = min(method.window_size(), q_last.shape[0])
    keep = method.evict_prefill(layer, seq, q_last[q_last.shape[0] - window:])
    if keep is not None:
        seq.kv.compact({layer: keep})


def evict_layers(method: KVMethod, seq: Sequence, q_windows: list[torch.Tensor]) -> None:
    """Prefill-time eviction of every layer at once, given each layer's window queries [w, heads, D]: the method's
    choices (`evict_prefill_layers`) compacted together (`SeqKV.compact`)."""
    stats = seq.stats
    stats.kv_resident_prefill_peak = max(stats.kv_resident_prefill_peak, seq.kv.resident_slots())
    keeps = method.evict_prefill_layers(seq, q_windows)
    seq.kv.compact({layer: keep for layer, keep in enumerate(keeps) if keep is not None})


class DecodeStep:
    """AttentionContext for one decode step of a batch."""

    def __init__(self, engine, batch: DecodeBatch, method: KVMethod, write_slots: torch.Tensor):
        self.engine, self.batch, self.method = engine, batch, method
        self.tables = batch.tables  # [B, layers, max_pages]
        size = engine.pool.page_size
        # pool rows of the new tokens' K/V, every layer at once: [B, layers, kv_heads] (write_slots: logical slots)
        self.rows = torch.gather(self.tables, 2, write_slots // size) * size + write_slots % size
        self.cos, self.sin = engine.rotary.cos_sin(batch.positions, engine.dtype)
        self.lengths: list[torch.Tensor] = []  # attended slots of each layer [B, S]
        self.attended_sum = self.attended_max = None  # [B] set by `finish`
        self.selection_s = 0.0
        self.traced = [(b, s) for b, s in enumerate(batch.seqs)  # none in a captured CUDA-graph step
                       if s.trace is not None and s.trace.wants(s.num_computed - len(s.prompt_ids))]
        self.step_selection = None  # one selection for every layer (methods with a step plan)
        # FlashAttention 3's arguments for the layers that select nothing, made at the first of them where it serves
        # them (None: not decided yet; False: the Triton kernel's). It serves them where they attend whole contexts;
        # an evicting method's contexts are its budget, where the Triton kernel was faster (ChunkKV at 16 x 31,744,
        # 10%: forward 1.35 against 1.50 ms on an H200; Full KV 3.01 against 2.83)
        self.fa3: fa3.DecodeInputs | bool | None = None if method.kind in ("full", "selection") else False
        if batch.step_plan is not None:
            self.step_selection = self._timed(lambda: method.plan_selection(batch, batch.step_plan))

    def _timed(self, select):
        timer = self.engine.timer
        span = timer.start("selection") if timer else None
        started = time.perf_counter()
        selection = select()
        self.selection_s += time.perf_counter() - started
        if timer:
            timer.stop(span)
        return selection

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        engine, pool, batch = self.engine, self.engine.pool, self.batch
        by_rank = self.method.rope_by_rank()
        tables = self.tables[:, layer]  # [B, max_pages]
        rows = self.rows[:, layer]  # [B, kv_heads]
        if by_rank:
            reference.store(k, v, rows, batch.positions, *pool.flat())
        else:
            q = kernels.rope_store(q, k, v, self.cos, self.sin, rows, batch.positions, *pool.flat())
        selection = self.step_selection
        if selection is None:
            selection = self._timed(lambda: self.method.select(layer, batch, q))
        timer = engine.timer
        span = timer.start("attention") if timer else None
        slots = None if selection is None else selection.slots
        lengths = batch.num_slots[:, layer : layer + 1] if selection is None else selection.lengths  # [B, S]
        if by_rank:  # the query takes the rank of the last attended key, its own
            key_rope = engine.rank_rope(int(lengths.max()))
            ranks = (lengths - 1).repeat_interleave(q.shape[1] // lengths.shape[1], dim=1).flatten()  # [B * heads]
            q = engine.rotary.rotate(q.reshape(-1, 1, q.shape[-1]), key_rope[0][ranks], key_rope[1][ranks]).view_as(q)
            out = reference.decode_attention(q, pool.k, pool.v, tables, slots, lengths, engine.scale,
                                             key_rope=key_rope)
        else:
            out = None
            if selection is None and self.fa3 is None:  # decided once a step, not a layer
                self.fa3 = kernels.fa3_decodes(q, pool.k) and fa3.decode_inputs(self.tables, batch.num_slots,
                                                                                 batch.max_slots)
            if selection is None and self.fa3:
                out = fa3.attend_decode(q, pool.k, pool.v, self.fa3, layer, engine.scale)
                if out is None:  # refused (the path is off now): the Triton kernel for the rest of the step
                    self.fa3 = False
            if out is None:
                max_len = batch.max_slots if selection is None else 0
                out = kernels.decode_attention(q, pool.k, pool.v, tables, slots, lengths, engine.scale, max_len)
        if timer:
            timer.stop(span)
        self.lengths.append(lengths)
        if self.traced:
            self._record(layer, tables, selection, None if by_rank else q)
        return out

    def finish(self) -> None:
        """Statistics of the step, on the device (inside a captured graph): attended slots per head summed over
        layers and the most slots any head attended, both [B]."""
        if len({x.shape for x in self.lengths}) == 1:
            per_layer = torch.stack(self.lengths, 1)  # [B, layers, S]
            self.attended_sum = per_layer.float().mean(-1).sum(1)
            self.attended_max = per_layer.amax((1, 2))
        else:
            self.attended_sum = torch.stack([x.float().mean(-1) for x in self.lengths], 1).sum(1)
            self.attended_max = torch.stack([x.amax(-1) for x in self.lengths], 1).amax(1)

    def _record(self, layer: int, tables: torch.Tensor, selection: Selection | None, q: torch.Tensor | None) -> None:
        for b, seq in self.traced:
            slots = None if selection is None else selection.slots[b]
            lengths = None if selection is None else selection.lengths[b]
            query = q[b] if q is not None and seq.trace.weights else None
            positions, probs = attended_positions(self.engine.pool, tables[b], slots, lengths,
                                                  int(self.batch.num_slots[b, layer]), query, self.engine.scale)
            seq.trace.record_attended(seq.num_computed - len(seq.prompt_ids), layer, positions, probs)


@dataclass
class StepInputs:
    """What the host decided for one decode step, on the device: `packed` [B, 2 + layers] holds side by side the
    tokens, positions and slot counts after the append (the current token included); `write` [B, layers, kv_heads]
    the slots the new tokens are written to (derived from the counts where every layer appends)."""

    packed: torch.Tensor
    write: torch.Tensor

    @property
    def tokens(self) -> torch.Tensor:  # [B]
        return self.packed[:, 0]

    @property
    def positions(self) -> torch.Tensor:  # [B]
        return self.packed[:, 1]

    @property
    def num_slots(self) -> torch.Tensor:  # [B, layers]
        return self.packed[:, 2:]
