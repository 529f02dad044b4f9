"""SentenceKV: sentence-level semantic KV caching (Zhu et al., 2025, "SentenceKV: Efficient LLM Inference via
Sentence-Level Semantic KV Caching", https://arxiv.org/abs/2504.00970).

At the end of prefill the prompt is cut into sentence buckets; the last `window` prompt queries score every token (the
attention it receives, summed over the window and the query heads of its KV group), the top floor(keep_factor *
budget) tokens of each KV head are retained across all sentences and the rest are dropped for good; each bucket gets
a sentence vector per KV head (the mean of its retained keys, kept on the device) and the retained K/V move to host
memory. At every decode step the mean query of the tokens generated since the last sentence end is scored against
the sentence vectors (dot product per KV head), the best buckets are loaded until the budget is filled, and
attention runs over them plus the attention sinks and the recent window.

Device memory during decoding: `n_sink` sinks + a working set of `budget - n_sink - n_recent` slots (the loaded
buckets; a bucket that stays chosen stays loaded, so only newly chosen tokens are copied) + the recent window, which
holds up to `offload_chunk` more tokens on their way out: tokens leaving the recent window are offloaded
`offload_chunk` at a time and join the bucket of the sentence they belong to (generated text is bucketed like the
prompt), so they can be retrieved later. Plus the sentence vectors and a token -> bucket map (one int per retained
token). Bytes moved are counted in `stats.h2d_bytes` / `d2h_bytes` (`h2d_bytes_step_max`: the largest decode step).

Choices where the paper is silent: sinks and recent window count in the budget (`budget // 4` each at most, so at
least half is left for buckets); the last bucket that does not fit keeps its leading tokens; a float budget is
resolved against the prompt length; with a budget covering the whole generation nothing is dropped or moved and the
output equals Full KV exactly; the mean query of a GQA group is its query heads' mean; the query resets whenever a
new generated bucket starts (a sentence end or an over-long split). The authors' code keeps all K/V on the GPU and
masks; here retained K/V really live in host memory (pinned on GPU runs) when `offload` is on.

Parameters
----------
budget: tokens one KV head of one layer attends to per decode step, sinks and recent window included.
keep_factor: r, the semantic keeping factor: floor(r * budget) tokens per KV head survive prefill; 2.0 (the paper's
    default, "typically r = 2 or 3").
window: N, the observation window of prompt queries that score token importance; 32 (paper).
n_sink: initial tokens always attended; 32 (the authors' code).
n_recent: most recent tokens always attended, the current one included; 32 (the authors' code).
split_std: n of the paper's A.7: sentences longer than mean + n * std tokens are split; 3.0 (only outliers; the
    paper proposes the rule without a value).
max_sentence: hard cap on a bucket's length, so text without punctuation is still bucketed; 128 (about four
    median sentences, which the paper puts at 25-30 tokens).
query: "mean" (mean query of the current generated sentence, the paper) or "current" (the current token's query,
    the paper's ablation, section 6.2).
buckets: "sentences" (the paper) or "chunks" (as many equal-size chunks as there are sentences, the ablation of
    section 6.1; generated text is chunked the same way).
offload: keep retained K/V in host memory and copy chosen tokens to the device (True), or keep them all resident
    and select in place (False); None: on when the engine runs on a GPU.
offload_chunk: tokens leaving the recent window are moved to the host this many at a time; 16 (one copy per
    layer every 16 steps instead of every step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from semkv.engine.offload import HostKVStore
from semkv.engine.sequence import Sequence
from semkv.errors import SemkvError
from semkv.methods.base import (DecodeBatch, KVMethod, Selection, check_range, keep_top, per_kv_head,
                                resolve_budget, window_attention)
from semkv.methods.eviction import window_positions
from semkv.methods.sentence_buckets import LayerBuckets, SentenceState, bucket_of, move_tail
from semkv.methods.sentences import SentenceRule, segment


@dataclass
class SentenceKV(KVMethod):
    keep_factor: float = 2.0
    window: int = 32
    n_sink: int = 32
    n_recent: int = 32
    split_std: float = 3.0
    max_sentence: int = 128
    query: str = "mean"
    buckets: str = "sentences"
    offload: bool | None = None
    offload_chunk: int = 16

    name = "sentencekv"
    summary = ("SentenceKV: prompt cut into sentence buckets, top r*budget tokens kept in host memory, mean-query "
               "sentence retrieval each decode step")
    kind = "selection"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("keep_factor", self.keep_factor, 1.0, 64.0)
        check_range("window", self.window, 1, None, int)
        check_range("n_sink", self.n_sink, 0, None, int)
        check_range("n_recent", self.n_recent, 1, None, int)
        check_range("split_std", self.split_std, 0.0, None)
        check_range("max_sentence", self.max_sentence, 1, None, int)
        check_range("offload_chunk", self.offload_chunk, 1, None, int)
        if self.query not in ("mean", "current"):
            raise SemkvError(f"query={self.query!r}; allowed: 'mean', 'current'")
        if self.buckets not in ("sentences", "chunks"):
            raise SemkvError(f"buckets={self.buckets!r}; allowed: 'sentences', 'chunks'")
        if self.offload not in (None, True, False):
            raise SemkvError(f"offload={self.offload!r}; allowed: True, False, None (on when the device is a GPU)")

    def bind(self, model: Any, tokenizer: Any, page_size: int) -> None:
        super().bind(model, tokenizer, page_size)
        self.rule = SentenceRule.for_tokenizer(tokenizer)

    def window_size(self) -> int:
        return self.window

    def new_state(self, seq: Sequence) -> SentenceState:
        n = len(seq.prompt_ids)
        final = n + seq.params.max_new_tokens - 1  # tokens in the cache at the last decode step
        budget = resolve_budget(self.budget, n)
        n_sink = min(self.n_sink, budget // 4, n)
        n_recent = max(1, min(self.n_recent, budget // 4))
        starts, limit = segment(seq.prompt_ids, self.rule, self.split_std, self.max_sentence,
                                self.buckets == "chunks")
        pool = seq.kv.pool
        offload = pool.device.type == "cuda" if self.offload is None else self.offload
        return SentenceState(
            dense=self.budget is None or resolve_budget(self.budget, final) >= final,
            budget=budget, n_sink=n_sink, n_recent=n_recent, capacity=budget - n_sink - n_recent,
            offload=offload, starts=starts + [n], limit=limit,
            layers=[LayerBuckets.empty(pool.num_kv_heads, pool.head_dim, pool.device) for _ in range(pool.num_layers)],
            store=HostKVStore(pool.num_layers, pool.device) if offload else None, q_sum=[None] * pool.num_layers)

    # -- prefill --------------------------------------------------------------------------------------------------
    def evict_prefill(self, layer: int, seq: Sequence, q_window: torch.Tensor) -> torch.Tensor | None:
        """Retain the top floor(r * budget) middle tokens per KV head; keep sinks, the retained tokens (offload
        off) or the first `capacity` of them (offload on: all of them go to the host) and the recent window."""
        st: SentenceState = seq.method_state
        if st.dense:
            return None
        kv = seq.kv
        n = kv.num_slots[layer]
        recent = min(st.n_recent, n - st.n_sink)
        keys, values, positions = kv.gather(layer, kv.all_slots(layer))  # [kv_heads, n, D]
        probs = window_attention(q_window, keys, positions, window_positions(seq, q_window))  # [heads, w, n]
        importance = per_kv_head(probs.sum(1), keys.shape[0], "sum")[:, st.n_sink : n - recent]  # [kv_heads, mid]
        retained = keep_top(importance, int(self.keep_factor * st.budget)) + st.n_sink  # [kv_heads, R] ascending
        heads = torch.arange(keys.shape[0], device=keys.device)[:, None]
        st.layers[layer].add(keys[heads, retained], bucket_of(st.starts, retained))
        resident = retained
        if st.offload:
            st.store.put(layer, keys[heads, retained], values[heads, retained], positions[heads, retained])
            resident = retained[:, : st.capacity]
            held = torch.arange(resident.shape[1], device=keys.device)[None].expand(keys.shape[0], -1)
            st.layers[layer].loaded = torch.nn.functional.pad(held, (0, st.capacity - held.shape[1]), value=-1)
        own = torch.arange(n, device=keys.device)[None].expand(keys.shape[0], -1)
        return torch.cat([own[:, : st.n_sink], resident, own[:, n - recent :]], dim=1)

    def finish_prefill(self, seq: Sequence) -> None:
        """Offload on: move the recent window behind the working set (which may be larger than what was retained)."""
        st: SentenceState = seq.method_state
        if st.dense:
            return
        for layer, buckets in enumerate(st.layers):
            if st.offload:
                move_tail(seq.kv, layer, st.n_sink + min(st.capacity, buckets.size), st.tail_start(layer))
        self._record(seq)

    # -- decode ---------------------------------------------------------------------------------------------------
    def select(self, layer: int, batch: DecodeBatch, q: torch.Tensor) -> Selection | None:
        states: list[SentenceState] = [s.method_state for s in batch.seqs]
        if all(st.dense for st in states):
            return None
        num_slots = [seq.kv.num_slots[layer] for seq in batch.seqs]  # host copies: no device read
        mask = torch.zeros(batch.size, batch.model.num_kv_heads, max(num_slots), dtype=torch.bool,
                           device=q.device)  # [B, kv_heads, n]
        for b, (seq, st) in enumerate(zip(batch.seqs, states)):
            n = num_slots[b]
            if st.dense:
                mask[b, :, :n] = True
                continue
            buckets = st.layers[layer]
            wanted = buckets.wanted(self._query(st, layer, q[b]), st.capacity)  # [kv_heads, retained]
            if st.offload:
                buckets.load(seq.kv, st.store, layer, wanted, st.n_sink)
                mask[b, :, st.n_sink : st.n_sink + st.capacity] = buckets.loaded >= 0
            else:
                mask[b, :, st.n_sink : st.n_sink + buckets.size] = wanted
            mask[b, :, : st.n_sink] = True
            mask[b, :, max(n - st.n_recent, st.tail_start(layer)) : n] = True
        return Selection.from_mask(mask)

    def _query(self, st: SentenceState, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [heads, D] of the current token -> the query buckets are scored with, per KV head [kv_heads, D]."""
        if self.query == "mean":
            total = q.float() if st.q_sum[layer] is None else st.q_sum[layer] + q.float()
            st.q_sum[layer] = total
            q = total / (st.q_count + 1)
        kv_heads = self.model.num_kv_heads
        return q.float().view(kv_heads, q.shape[0] // kv_heads, -1).mean(1)

    def end_step(self, seqs: list[Sequence], logits: torch.Tensor, tokens: list[int]) -> None:
        """Start a new generated bucket after a sentence end (reset the mean query); offload the tokens that left
        the recent window once `offload_chunk` of them wait."""
        for seq, token in zip(seqs, tokens):
            st: SentenceState = seq.method_state
            if st.dense:
                continue
            n_prompt, next_pos = len(seq.prompt_ids), seq.num_computed
            window = torch.tensor(seq.output_ids[st.starts[-1] - n_prompt :] + [token])  # open bucket + next token
            ended = self.buckets == "sentences" and bool(self.rule.ends(window)[-2])
            if ended or next_pos - st.starts[-1] >= st.limit:
                st.starts.append(next_pos)
                st.q_sum, st.q_count = [None] * len(st.layers), 0
            else:
                st.q_count += 1
            st.device_peak = max(st.device_peak, max(seq.kv.num_slots))
            waiting = seq.kv.num_slots[0] - st.tail_start(0) - st.n_recent
            if waiting >= self.offload_chunk:
                self._offload_waiting(seq, st, waiting)
            self._record(seq)

    def _offload_waiting(self, seq: Sequence, st: SentenceState, m: int) -> None:
        """The m oldest tokens of the recent window join their buckets (and move to the host when offloading)."""
        kv = seq.kv
        for layer, buckets in enumerate(st.layers):
            start = st.tail_start(layer)
            k, v, pos = kv.gather(layer, torch.arange(start, start + m, device=kv.table.device)[None])
            buckets.add(k, bucket_of(st.starts, pos))
            if st.offload:
                st.store.put(layer, k, v, pos)
                move_tail(kv, layer, start + m, start)

    @staticmethod
    def _record(seq: Sequence) -> None:
        st: SentenceState = seq.method_state
        stats = seq.stats
        if st.store is not None:
            st.h2d_step_max = max(st.h2d_step_max, st.store.h2d_bytes - stats.h2d_bytes)
            stats.h2d_bytes, stats.d2h_bytes = st.store.h2d_bytes, st.store.d2h_bytes
        stats.extra.update(
            sentences=len(st.starts), offload=st.offload, h2d_bytes_step_max=st.h2d_step_max,
            kv_device_peak=max(st.device_peak, max(seq.kv.num_slots)),
            sentence_vector_bytes=sum(b.nbytes() for b in st.layers))
