"""The inference loop: chunked prefill of each request, then batched decode steps, through the paged cache.

At every attention call the engine asks the KV method which cached slots to attend to and hands that decision to
the one sparse attention path (`semkv.kernels`); it never inspects what a method does.
"""
from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from semkv.engine.cuda_graph import GraphRunner
from semkv.engine.kv_cache import KVPool, SeqKV
from semkv.engine.sampler import sample
from semkv.engine.sequence import Sequence
from semkv.engine.trace import attended_positions
from semkv import kernels
from semkv.methods.base import DecodeBatch, KVMethod, Selection
from semkv.models.config import ModelConfig
from semkv.models.llama import LlamaModel
from semkv.models.rotary import RotaryEmbedding


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

    def __init__(self, engine: "Engine", seq: Sequence, method: KVMethod, positions: torch.Tensor, evict: bool,
                 record_window: int = 0):
        self.engine, self.seq, self.method, self.evict = engine, seq, method, evict
        self.positions = positions
        self.record_window = record_window  # keep the last queries of each layer for methods applied later
        self.cos, self.sin = engine.rotary.cos_sin(positions, engine.dtype, seq_len=len(seq.prompt_ids))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rotate = self.engine.rotary.rotate
        q, k = rotate(q, self.cos, self.sin), rotate(k, self.cos, self.sin)
        kv, pool, chunk = self.seq.kv, self.engine.pool, q.shape[0]
        start = kv.num_slots[layer]
        kv.ensure_slots(layer, start + chunk)
        kv.write(layer, torch.arange(start, start + chunk, device=q.device), k, v, self.positions)
        kv.num_slots[layer] = start + chunk
        self.method.observe_prefill(layer, self.seq, q, start)
        context = self.method.prefill_context(layer, self.seq, q, start)
        out = kernels.prefill_attention(q, pool.k, pool.v, kv.table[layer], start, context, self.engine.scale)
        if self.record_window:
            self.seq.window_queries[layer] = q[max(chunk - self.record_window, 0):].clone()
        if self.evict:
            evict_layer(self.method, self.seq, layer, q)
        return out


def evict_layer(method: KVMethod, seq: Sequence, layer: int, q_last: torch.Tensor) -> None:
    """Prefill-time eviction of one layer, given the queries of the last prompt tokens [w', heads, D]."""
    stats = seq.stats
    stats.kv_resident_prefill_peak = max(stats.kv_resident_prefill_peak, seq.kv.resident_slots())
    window = min(method.window_size(), q_last.shape[0])
    keep = method.evict_prefill(layer, seq, q_last[q_last.shape[0] - window:])
    if keep is not None:
        seq.kv.compact(layer, keep)


class DecodeStep:
    """AttentionContext for one decode step of a batch."""

    def __init__(self, engine: "Engine", batch: DecodeBatch, method: KVMethod, write_slots: torch.Tensor):
        self.engine, self.batch, self.method = engine, batch, method
        self.write_slots = write_slots  # [B, layers, kv_heads] logical slot of the new token
        self.tables = batch.tables  # [B, layers, max_pages]
        self.cos, self.sin = engine.rotary.cos_sin(batch.positions, engine.dtype)
        size = batch.positions.shape[0]
        self.attended_sum = torch.zeros(size, device=engine.device)
        self.attended_max = torch.zeros(size, dtype=torch.long, device=engine.device)
        self.selection_s = 0.0
        self.traced = [(b, s) for b, s in enumerate(batch.seqs or ())  # no seqs: a captured CUDA-graph step
                       if s.trace is not None and s.trace.wants(s.num_computed - len(s.prompt_ids))]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        engine, pool, batch = self.engine, self.engine.pool, self.batch
        rotate = engine.rotary.rotate
        q, k = rotate(q, self.cos, self.sin), rotate(k, self.cos, self.sin)
        size = pool.page_size
        tables = self.tables[:, layer]  # [B, max_pages]
        slots = self.write_slots[:, layer]  # [B, kv_heads]
        rows = torch.gather(tables, 1, slots // size) * size + slots % size
        kf, vf, pf = pool.flat()
        heads = torch.arange(pool.num_kv_heads, device=rows.device)[None, :]
        kf[rows, heads], vf[rows, heads] = k, v
        pf[rows, heads] = batch.positions.to(torch.int32)[:, None]
        started = time.perf_counter()
        selection = self.method.select(layer, batch, q)
        self.selection_s += time.perf_counter() - started
        if selection is None:
            lengths = batch.num_slots[:, layer : layer + 1]
            out = kernels.decode_attention(q, pool.k, pool.v, tables, None, lengths, engine.scale, batch.max_slots)
        else:
            lengths = selection.lengths
            out = kernels.decode_attention(q, pool.k, pool.v, tables, selection.slots, lengths, engine.scale)
        self.attended_sum += lengths.float().mean(-1)
        self.attended_max = torch.maximum(self.attended_max, lengths.max(-1).values)
        if self.traced:
            self._record(layer, tables, selection)
        return out

    def _record(self, layer: int, tables: torch.Tensor, selection: Selection | None) -> None:
        for b, seq in self.traced:
            slots = None if selection is None else selection.slots[b]
            lengths = None if selection is None else selection.lengths[b]
            positions = attended_positions(self.engine.pool, tables[b], slots, lengths,
                                           int(self.batch.num_slots[b, layer]))
            seq.trace.record_attended(seq.num_computed - len(seq.prompt_ids), layer, positions)


def _stack_tables(tables: list[torch.Tensor]) -> torch.Tensor:
    width = max(t.shape[1] for t in tables)
    return torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tables])


class Engine:
    def __init__(self, model: LlamaModel, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 page_size: int = 16, prefill_chunk: int = 512, cuda_graphs: bool = True):
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        self.prefill_chunk = prefill_chunk
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        self.rotary = RotaryEmbedding(config.hf_config, config.head_dim, device)
        self.scale = config.head_dim**-0.5
        self.pool = KVPool(config.num_layers, config.num_kv_heads, config.head_dim, page_size, dtype, device)

    # -- prefill --------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seq: Sequence, method: KVMethod, progress: bool = False, record_window: int = 0) -> torch.Tensor:
        """Run the prompt through the model; return the logits of its last token [vocab].

        record_window > 0 keeps the last queries of every layer in `seq.window_queries`, so that methods can later be
        applied to copies of this prefilled sequence (`fork` + `apply_prefill`)."""
        started = time.perf_counter()
        n = len(seq.prompt_ids)
        split = seq.question_start if method.uses_question_split() and seq.question_start else n
        phases = [(0, split, True)] + ([(split, n, False)] if split < n else [])
        window = max(method.window_size(), record_window)
        spans = [(a, b, evict and b == hi) for lo, hi, evict in phases
                 for a, b in plan_chunks(lo, hi, self.prefill_chunk, window if evict else 0)]
        ids = torch.tensor(seq.prompt_ids, device=self.device)
        bar = tqdm(total=n, desc="prefill", unit="tok", disable=not progress, leave=False)
        logits = None
        for a, b, evict in spans:
            positions = torch.arange(a, b, device=self.device)
            step = PrefillStep(self, seq, method, positions, evict, record_window if b == n else 0)
            seq.num_computed = b  # methods see the chunk's tokens as computed while it runs
            logits = self.model(ids[a:b], step, logits_at=torch.tensor([b - a - 1], device=self.device))
            bar.update(b - a)
        bar.close()
        method.finish_prefill(seq)
        self._prefill_done(seq)
        seq.stats.prefill_s = time.perf_counter() - started
        return logits[0]

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
        for layer in range(self.config.num_layers):
            n = seq.kv.num_slots[layer]
            twin.kv.ensure_slots(layer, n)
            twin.kv.num_slots[layer] = n
            src, dst = seq.kv.table[layer, : len(seq.kv.pages[layer])], twin.kv.table[layer, : len(seq.kv.pages[layer])]
            self.pool.k[dst], self.pool.v[dst], self.pool.pos[dst] = self.pool.k[src], self.pool.v[src], self.pool.pos[src]
        twin.num_computed = seq.num_computed
        twin.window_queries = dict(seq.window_queries)
        twin.stats.prefill_s = seq.stats.prefill_s
        return twin

    @torch.inference_mode()
    def apply_prefill(self, seq: Sequence, method: KVMethod) -> None:
        """Apply a method's prefill-time eviction and summaries to a sequence prefilled with Full KV."""
        started = time.perf_counter()
        seq.method_state = method.new_state(seq)
        for layer in range(self.config.num_layers):
            evict_layer(method, seq, layer, seq.window_queries[layer])
        method.finish_prefill(seq)
        self._prefill_done(seq)
        seq.stats.prefill_s += time.perf_counter() - started

    # -- decode ---------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode_step(self, seqs: list[Sequence], method: KVMethod) -> torch.Tensor:
        """Feed each sequence's last sampled token; return next-token logits [B, vocab]."""
        batch, write = self.prepare_step(seqs, method)
        step = DecodeStep(self, batch, method, write)
        tokens = torch.tensor([s.last_token for s in seqs], device=self.device)
        logits = self.model(tokens, step)
        self.finish_step(seqs, step)
        return logits

    def prepare_step(self, seqs: list[Sequence], method: KVMethod) -> tuple[DecodeBatch, torch.Tensor]:
        """Host-side work before a decode step: the method picks write slots (decode eviction), appended tokens get
        pages. Returns the batch as `select` will see it and the write slots [B, layers, kv_heads]."""
        layers = self.config.num_layers
        positions = torch.tensor([s.num_computed for s in seqs], device=self.device)
        slots_before = torch.tensor([s.kv.num_slots for s in seqs], device=self.device)  # [B, layers]
        pre = DecodeBatch(seqs, positions, slots_before, self.config)
        write = method.begin_step(pre)
        if write is None:
            write = slots_before[:, :, None].expand(-1, -1, self.config.num_kv_heads)
        appends = (write == slots_before[:, :, None]).any(-1).tolist()  # [B][layers]
        for b, seq in enumerate(seqs):
            for layer in range(layers):
                if appends[b][layer]:
                    seq.kv.num_slots[layer] += 1
                    seq.kv.ensure_slots(layer, seq.kv.num_slots[layer])
        slots_after = [s.kv.num_slots for s in seqs]
        tables = _stack_tables([s.kv.table for s in seqs])
        batch = DecodeBatch(seqs, positions, torch.tensor(slots_after, device=self.device), self.config, tables,
                            max(max(n) for n in slots_after))
        return batch, write.contiguous()

    def finish_step(self, seqs: list[Sequence], step: DecodeStep) -> None:
        layers = self.config.num_layers
        attended = (step.attended_sum[: len(seqs)] / layers).tolist()
        attended_max = step.attended_max[: len(seqs)].tolist()
        for b, seq in enumerate(seqs):
            seq.num_computed += 1
            seq.attended_total += attended[b]
            seq.stats.kv_attended_max = max(seq.stats.kv_attended_max, attended_max[b])
            seq.stats.selection_s += step.selection_s / len(seqs)

    def generate(self, seqs: list[Sequence], method: KVMethod, first_logits: list[torch.Tensor],
                 is_stop, pick=None) -> None:
        """Decode until every sequence finished. `is_stop(seq)` checks EOS / stop strings / length. `pick(seq,
        logits) -> token` chooses each next token (default: sample); a pick that returns given tokens teacher-forces
        them through the decode steps (`LLM.score_continuation`)."""
        pick = pick or (lambda seq, logits: sample(logits, seq.params, seq.generator))
        for seq, logits in zip(seqs, first_logits):
            self._append(seq, pick(seq, logits), is_stop)
        active = [s for s in seqs if not s.finished]
        graphs = self.graph_runner(method, seqs)
        started = time.perf_counter()
        while active:
            if graphs is not None and graphs.fits(active):
                logits = graphs.decode_step(active)
            else:
                logits = self.decode_step(active, method)
            tokens = [pick(s, logits[b]) for b, s in enumerate(active)]
            batch = DecodeBatch(active, torch.tensor([s.num_computed for s in active]),
                                torch.tensor([s.kv.num_slots for s in active]), self.config)
            method.end_step(batch, logits, tokens)
            for seq, token in zip(active, tokens):
                seq.stats.kv_resident_tokens = max(seq.stats.kv_resident_tokens, seq.kv.resident_slots())
                self._append(seq, token, is_stop)
            now = time.perf_counter()
            for seq in active:
                seq.stats.decode_s += now - started
            started = now
            active = [s for s in active if not s.finished]
        for seq in seqs:
            steps = max(len(seq.output_ids) - 1, 1)
            seq.stats.kv_attended_tokens = seq.attended_total / steps

    def graph_runner(self, method: KVMethod, seqs: list[Sequence]) -> GraphRunner | None:
        """CUDA graphs for this generation, when the device, the method and the RoPE variant allow them."""
        traced = any(s.trace is not None for s in seqs)  # a replayed graph runs no Python, so it records nothing
        if not (self.cuda_graphs and method.graph_safe and self.rotary.rope_type != "dynamic") or traced:
            return None
        longest = max(len(s.prompt_ids) + s.params.max_new_tokens for s in seqs)
        return GraphRunner(self, method, max_pages=-(-longest // self.pool.page_size) + 1)

    @staticmethod
    def _append(seq: Sequence, token: int, is_stop) -> None:
        seq.output_ids.append(token)
        seq.stats.new_tokens = len(seq.output_ids)
        reason = is_stop(seq)
        if reason:
            seq.finished, seq.finish_reason = True, reason
