"""TokenSelect: the selection functions against transcriptions of Eqs. 5-7, the paged dot-product kernel, the
Selection Cache, chunk-wise sparse prefill and the length-extrapolation mode (rank RoPE), on tiny random models."""
from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
import torch

import semkv
from semkv.engine.kv_cache import SeqKV
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.errors import SemkvError
from semkv.kernels import reference
from semkv.methods.tokenselect import reference as tokenselect_reference
from semkv.methods import DecodeBatch, FullKV, TokenSelect
from semkv.methods.tokenselect.reference import head_vote as vote

PROMPT = "The passkey is 4821. Remember it. " + "Grass is green and the sky is blue. " * 14
NEW = 8


@pytest.fixture
def interpreted():
    """Import a Triton kernel module under TRITON_INTERPRET=1 (read when its kernels are decorated, so the module and
    `triton_paged_dot`, whose `key_dots` the TokenSelect kernels call, are imported afresh); afterwards sys.modules
    holds what it held before."""
    names = ("semkv.methods.tokenselect.triton_token_select", "semkv.kernels.triton_paged_dot",
             "semkv.kernels.triton_page_select")
    saved = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        yield importlib.import_module
    for name in names:
        sys.modules.pop(name, None)
    sys.modules.update(saved)


def random_pool(heads=8, kv_heads=2, dim=16, page_size=4, pages=40, seed=0):
    """Random queries [heads, D], a key pool with a shuffled page table, and the keys in slot order [n, kv_heads, D]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, dim, generator=gen)
    k_pool = torch.randn(pages, page_size, kv_heads, dim, generator=gen)
    table = torch.randperm(pages, generator=gen)
    keys = k_pool[table].reshape(pages * page_size, kv_heads, dim)  # logical slot order
    return q, k_pool, table, keys


def logits_per_head(q, keys):
    """Direct q_h . k_i with query head h reading KV head h // group: [heads, n]."""
    group = q.shape[0] // keys.shape[1]
    return torch.stack([keys[:, h // group] @ q[h] for h in range(q.shape[0])])


@pytest.mark.parametrize("scope", ["layer", "kv_head"])
def test_soft_vote_equals_eq7(scope):
    q, k_pool, table, keys = random_pool()
    slots = torch.arange(keys.shape[0])
    k = 20
    got = vote(reference.paged_dot(q, k_pool, table, slots), k, "soft_vote", 2 if scope == "kv_head" else None)
    group = q.shape[0] // 2
    voters = [range(q.shape[0])] if scope == "layer" else [range(g * group, (g + 1) * group) for g in range(2)]
    for s, heads in enumerate(voters):
        total = sum(torch.softmax(keys[:, h // group] @ q[h], dim=0) for h in heads)  # Eq. 7
        assert got[s].tolist() == sorted(torch.topk(total, k).indices.tolist())


def test_top_k_and_hard_vote_follow_eqs_5_and_6():
    q, k_pool, table, keys = random_pool(seed=1)
    scores = reference.paged_dot(q, k_pool, table, torch.arange(keys.shape[0]))
    k = 16
    logits = logits_per_head(q, keys)
    assert vote(scores, k, "top_k", None)[0].tolist() == sorted(torch.topk(logits.sum(0), k).indices.tolist())
    counts = torch.zeros(keys.shape[0])
    for h in range(q.shape[0]):
        counts[torch.topk(logits[h], k).indices] += 1  # Eq. 6
    chosen = vote(scores, k, "hard_vote", None)[0]
    left_out = torch.ones_like(counts, dtype=torch.bool)
    left_out[chosen] = False
    assert counts[chosen].min() >= counts[left_out].max()


def test_paged_dot_reference_reads_the_right_keys():
    q, k_pool, table, keys = random_pool(heads=12, kv_heads=3, page_size=8)
    slots = torch.randperm(keys.shape[0])[:50]  # any order, not contiguous
    expected = logits_per_head(q, keys[slots])
    torch.testing.assert_close(reference.paged_dot(q, k_pool, table, slots), expected)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("heads, kv_heads, dim, page_size", [(28, 4, 128, 16), (9, 3, 64, 1)])
def test_triton_kernel_equals_reference_in_interpreter(interpreted, heads, kv_heads, dim, page_size):
    kernel = interpreted("semkv.kernels.triton_paged_dot")
    q, k_pool, table, keys = random_pool(heads, kv_heads, dim, page_size, pages=300 // page_size + 1)
    slots = torch.randperm(keys.shape[0])[:150]
    torch.testing.assert_close(kernel.paged_dot(q, k_pool, table, slots), reference.paged_dot(q, k_pool, table, slots))
    tables = torch.stack([table, table.roll(3)])  # a batch: one page table per row, the same slot list
    q2 = torch.stack([q, -q])
    got = kernel.paged_dot(q2, k_pool, tables, slots)
    torch.testing.assert_close(got, reference.paged_dot(q2, k_pool, tables, slots))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("selection, sets", [("soft_vote", 1), ("soft_vote", 2), ("top_k", 1)])
def test_token_select_kernel_equals_reference_in_interpreter(interpreted, selection, sets):
    """Three steps of one layer for a batch (a row below the budget, a padding row, rows that hit, miss and hit
    again): the kernels return the reference's slots and leave the Selection Cache in the same state."""
    kernel = interpreted("semkv.methods.tokenselect.triton_token_select")
    heads, kv_heads, dim, page_size, pages = 8, 2, 16, 4, 80
    gen = torch.Generator().manual_seed(3)
    k_pool = torch.randn(pages, page_size, kv_heads, dim, generator=gen)
    tables = torch.stack([torch.randperm(pages, generator=gen) for _ in range(4)])  # [4, pages]
    layer, width, out_width = 1, 200, 28
    caches = [tokenselect_reference.SelectionCacheBuffers.allocate(6, 2, heads * dim, sets, 20, torch.device("cpu"))
              for _ in range(2)]
    rows = torch.tensor([2, 5, 3, 0])  # the last row is padding (cache row 0)
    q = torch.randn(4, heads, dim, generator=gen)
    for step in range(3):
        num_slots = torch.tensor([150 + step, 190 + step, 20, 1])  # row 2 is below its budget of 28
        # each row's own split; row 1's budget grows at step 2 (a fraction of its context), so its entry is stale
        parts = torch.tensor([[3, 20, 5], [2, 14 + (step == 2), 4], [3, 20, 5], [0, 0, 1]])
        if step == 1:  # row 1 diverges, row 0 repeats its query
            q[1] = torch.randn(heads, dim, generator=gen)
        got = kernel.token_select(q, k_pool, tables, num_slots, width, rows, caches[0], layer, parts, out_width,
                                  0.9, selection, kv_heads if sets > 1 else None, block_n=16, block_t=32,
                                  num_warps=4, splits=3, vote_splits=3, block_c=2)  # programs loop over blocks
        want = tokenselect_reference.token_select(q, k_pool, tables, num_slots, width, rows, caches[1], layer, parts,
                                                  out_width, 0.9, selection, kv_heads if sets > 1 else None)
        for b, n in enumerate(torch.minimum(num_slots, parts.sum(1))[:3].tolist()):
            assert torch.equal(got[b, :, :n], want[b, :, :n])
        for name in ("q", "top", "valid", "counts"):
            assert torch.equal(getattr(caches[0], name)[1:], getattr(caches[1], name)[1:]), name
    assert caches[0].counts[[2, 5, 3]].tolist() == [[2, 3], [0, 3], [0, 0]]  # hits, lookups


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("selection", ["soft_vote", "top_k"])
def test_token_select_kernel_breaks_ties_to_lower_slots(interpreted, selection):
    """Every candidate has the same key except six strong ones in the last chunks: the radix select spread over
    chunks must take the strong slots and then the lowest equal slots, in slot order, whatever the chunk size."""
    kernel = interpreted("semkv.methods.tokenselect.triton_token_select")
    heads, kv_heads, dim, page_size, pages = 4, 2, 16, 4, 60
    base = torch.randn(dim, generator=torch.Generator().manual_seed(5))
    table = torch.randperm(pages, generator=torch.Generator().manual_seed(6))
    keys = base.expand(pages * page_size, kv_heads, dim).clone()  # logical slot order
    strong = torch.arange(150, 156)
    keys[strong] = 2 * base
    k_pool = torch.empty(pages, page_size, kv_heads, dim)
    k_pool[table] = keys.view(pages, page_size, kv_heads, dim)
    n_sink, k, n_recent, width = 3, 20, 5, 200
    q = base.expand(1, heads, dim).clone()  # q . key > 0, larger for the strong keys
    want = torch.cat([torch.arange(n_sink, n_sink + k - len(strong)), strong])
    for block_t, block_c in ((16, 2), (32, 4), (64, 32)):  # block_c: earlier chunks read a tile at a time
        cache = tokenselect_reference.SelectionCacheBuffers.allocate(2, 1, heads * dim, 1, k, torch.device("cpu"))
        got = kernel.token_select(q, k_pool, table[None], torch.tensor([190]), width, torch.tensor([1]), cache, 0,
                                  torch.tensor([[n_sink, k, n_recent]]), n_sink + k + n_recent, 0.9, selection, None,
                                  block_n=16, block_t=block_t, num_warps=4, splits=3, vote_splits=3, block_c=block_c)
        assert torch.equal(got[0, 0, n_sink:n_sink + k], want), block_t
        assert torch.equal(cache.top[1, 0, 0], want), block_t


def test_batched_paged_dot_equals_row_by_row():
    q, k_pool, table, _ = random_pool(heads=12, kv_heads=3, page_size=8)
    tables = torch.stack([table, table.flip(0)])
    queries = torch.stack([q, q * 2 + 1])
    slots = torch.randperm(200)[:70]
    got = reference.paged_dot(queries, k_pool, tables, slots)  # [2, heads, 70]
    for b in range(2):
        torch.testing.assert_close(got[b], reference.paged_dot(queries[b], k_pool, tables[b], slots))


def prefill(llm, method, prompt=PROMPT):
    """Prefill `prompt` under `method`: (the sequence, the logits of its last token [vocab])."""
    method.bind(llm.config, llm.tokenizer, llm.engine.pool.page_size)
    ids, _ = llm.encode(prompt, None, chat=False)
    seq = Sequence(0, ids, SamplingParams(), SeqKV(llm.engine.pool))
    seq.method_state = method.new_state(seq)
    return seq, llm.engine.prefill(seq, method)


def prefilled(llm, method, prompt=PROMPT):
    """The sequence prefilled, with its first output token (greedy), ready for a decode step."""
    seq, logits = prefill(llm, method, prompt)
    seq.output_ids.append(int(logits.argmax()))
    return seq


@pytest.mark.parametrize("path", ["host", "device"])
def test_selection_cache_reuses_on_similar_queries_and_recomputes_on_divergence(tiny_llm, path):
    """Algorithm 1 on both paths: per sequence with the cache on the host (fractional budgets) and batched with the
    cache on the device (`kernels.token_select`, what CUDA graphs capture)."""
    engine, cfg = tiny_llm.engine, tiny_llm.config
    cached = TokenSelect(budget=40, theta=0.9)
    seq = prefilled(tiny_llm, cached)
    gen = torch.Generator().manual_seed(0)
    q1, q2 = torch.randn(2, 1, cfg.num_heads, cfg.head_dim, generator=gen)
    q3 = q2 + 0.05 * torch.randn(q2.shape, generator=gen)  # cos(q2, q3) ~ 0.999
    fresh = TokenSelect(budget=40, theta=1.0)
    fresh_seq = prefilled(tiny_llm, fresh)

    def batch_of(s):
        return DecodeBatch([s], torch.tensor([s.num_computed]), torch.tensor([s.kv.num_slots]), cfg)

    def fresh_selection(q):
        fresh_seq.method_state = fresh.new_state(fresh_seq)
        for _ in range(seq.kv.num_slots[1] - fresh_seq.kv.num_slots[1]):  # as many slots as `seq`
            fresh_seq.kv.append_slot()
        return fresh.select_per_sequence(1, batch_of(fresh_seq), q).slots

    def select(q):
        if path == "host":
            return cached.select_per_sequence(1, batch_of(seq), q).slots
        batch = engine.step_batch([seq], *engine.prepare_step([seq], cached))  # appends the step's slot
        slots = cached.select_batched(1, batch, q).slots
        cached.end_step([seq], None, [])
        return slots

    def hits():
        return seq.stats.extra["selection_cache_hits"]

    kept = 40 - cached.split(40)[2]  # sinks and top-k (the recent slots move with each device step)
    first = select(q1)
    assert torch.equal(first, fresh_selection(q1))
    assert torch.equal(select(q1)[..., :kept], first[..., :kept])  # repeated query: a hit
    assert hits() == 1
    diverged = select(q2)  # cos(q1, q2) ~ 0: recomputed
    assert hits() == 1
    assert torch.equal(diverged, fresh_selection(q2)) and not torch.equal(diverged[..., :kept], first[..., :kept])
    assert torch.equal(select(q3)[..., :kept], diverged[..., :kept])  # similar query: the cached top-k
    assert hits() == 2
    assert seq.stats.extra["selection_cache_hit_rate"] == 2 / 4
    for s in (seq, fresh_seq):
        engine.release(s)


@pytest.mark.parametrize("scope, budget", [("layer", 40), ("kv_head", 40), ("layer", 0.3), ("kv_head", 0.3)])
def test_batched_selection_equals_row_by_row(tiny_llm, scope, budget):
    """The graph-safe path (theta = 1) selects for the whole batch from tensors what the per-sequence path selects
    row by row, for rows above and below the budget; a fractional budget resolves to each row's own split."""
    method = TokenSelect(budget=budget, n_sink=4, n_recent=8, theta=1.0, scope=scope)
    seqs = [prefilled(tiny_llm, method), prefilled(tiny_llm, method, PROMPT[:300]), prefilled(tiny_llm, method, "Hi.")]
    batch = tiny_llm.engine.step_batch(seqs, *tiny_llm.engine.prepare_step(seqs, method))
    cfg = tiny_llm.config
    q = torch.randn(len(seqs), cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    for layer in (0, 1):
        got = method.select_batched(layer, batch, q)
        want = method.select_per_sequence(layer, batch, q)
        assert torch.equal(got.lengths, want.lengths)
        for b, n in enumerate(want.lengths[:, 0].tolist()):
            assert torch.equal(got.slots[b, :, :n], want.slots[b, :, :n])
    for s in seqs:
        tiny_llm.engine.release(s)


def test_hit_rate_is_reported_by_generate(tiny_llm):
    out = tiny_llm.generate(PROMPT, method="tokenselect", budget=40, max_new_tokens=NEW, chat=False, ignore_eos=True)
    extra = out[0].stats.extra
    assert extra["selection_cache_lookups"] == tiny_llm.config.num_layers * (NEW - 1)  # one per layer and step
    assert 0 <= extra["selection_cache_hits"] <= extra["selection_cache_lookups"]


@pytest.fixture(scope="module")
def chunked_llm(tiny_model_dir):
    return semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=16)


def test_chunked_prefill_with_a_covering_budget_equals_full_prefill(tiny_llm, chunked_llm):
    n = len(tiny_llm.encode(PROMPT, None, chat=False)[0])
    full = tiny_llm.generate(PROMPT, max_new_tokens=NEW, chat=False, ignore_eos=True)[0]  # one prefill chunk
    method = TokenSelect(budget=n + NEW)
    assert chunked_llm.generate(PROMPT, method=method, max_new_tokens=NEW, chat=False,
                                ignore_eos=True)[0].token_ids == full.token_ids


class RecordingTokenSelect(TokenSelect):
    """TokenSelect that keeps what prefill_context returned, chunk by chunk."""

    def prefill_context(self, layer, seq, q, start):
        context = super().prefill_context(layer, seq, q, start)
        self.contexts.append((start, context))
        return context


def test_sparse_prefill_attends_to_sinks_top_k_and_recent_within_the_budget(chunked_llm):
    budget = 24
    method = RecordingTokenSelect(budget=budget, n_sink=2, n_recent=4)
    method.contexts = []
    seq = prefilled(chunked_llm, method)
    sink, k, recent = method.split(budget)
    assert (sink, k, recent) == (2, 18, 4)
    sparse = [(start, c) for start, c in method.contexts if c is not None]
    assert all(start <= budget for start, c in method.contexts if c is None)
    assert len(sparse) > len(method.contexts) // 2  # most chunks of this prompt are sparse
    for start, context in sparse:
        slots = context[0].tolist()
        assert len(slots) == budget and slots == sorted(set(slots))
        assert slots[:sink] == list(range(sink)) and slots[-recent:] == list(range(start - recent, start))
    chunked_llm.engine.release(seq)


def test_full_prefill_equals_full_kv_prefill_at_a_small_budget(chunked_llm):
    """prefill="full": the prompt is attended in full at any budget (the logits of its last token are Full KV's),
    and only decoding selects; the paper's sparse prefill at the same budget gives other logits."""
    def last_logits(method):
        seq, logits = prefill(chunked_llm, method)
        chunked_llm.engine.release(seq)
        return logits

    full = last_logits(FullKV())
    dense = last_logits(TokenSelect(budget=24, n_sink=2, n_recent=4, prefill="full"))
    sparse = last_logits(TokenSelect(budget=24, n_sink=2, n_recent=4))
    torch.testing.assert_close(dense, full)
    assert not torch.allclose(sparse, full, atol=1e-3)
    method = RecordingTokenSelect(budget=24, n_sink=2, n_recent=4, prefill="full")
    method.contexts = []
    chunked_llm.engine.release(prefilled(chunked_llm, method))
    assert len(method.contexts) > 2 and all(c is None for _, c in method.contexts)  # chunks of 16, all dense
    out = chunked_llm.generate(PROMPT, method=TokenSelect(budget=24, n_sink=2, n_recent=4, prefill="full"),
                               max_new_tokens=NEW, chat=False, ignore_eos=True)[0]
    assert out.stats.kv_attended_max <= 24 and chunked_llm.engine.pool.in_use == 0  # decoding selects


def test_extrapolation_with_a_covering_budget_equals_full_kv(tiny_llm):
    full = tiny_llm.generate(PROMPT, max_new_tokens=NEW, chat=False, ignore_eos=True)[0]
    out = tiny_llm.generate(PROMPT, method=TokenSelect(budget=1000, extrapolate=True), max_new_tokens=NEW,
                            chat=False, ignore_eos=True)[0]
    assert out.token_ids == full.token_ids  # ranks = positions when every slot is attended


def test_extrapolation_generates_past_the_model_context(tiny_model_dir):
    llm = semkv.LLM(tiny_model_dir("llama_short"), device="cpu", prefill_chunk=64)  # 256-token context
    prompt = PROMPT * 4
    n = len(llm.encode(prompt, None, chat=False)[0])
    assert n > 2 * llm.max_context
    with pytest.raises(SemkvError, match="context"):
        llm.generate(prompt, max_new_tokens=NEW, chat=False)
    method = TokenSelect(budget=96, n_sink=4, n_recent=32, extrapolate=True)  # ranks < 96 + 64 < 256
    out = llm.generate(prompt, method=method, max_new_tokens=NEW, chat=False, ignore_eos=True)[0]
    assert len(out.token_ids) == NEW and out.stats.kv_attended_max <= 96
    assert llm.engine.pool.in_use == 0


def test_invalid_parameters_are_rejected(tiny_llm):
    with pytest.raises(SemkvError, match="selection"):
        TokenSelect(budget=64, selection="vote")
    with pytest.raises(SemkvError, match="theta"):
        TokenSelect(budget=64, theta=1.5)
    with pytest.raises(SemkvError, match="int budget"):
        TokenSelect(budget=0.5, extrapolate=True)
    with pytest.raises(SemkvError, match="prefill='full'.*extrapolate"):
        TokenSelect(budget=64, prefill="full", extrapolate=True)
    with pytest.raises(SemkvError, match="prefill='dense'; allowed"):
        TokenSelect(budget=64, prefill="dense")
    with pytest.raises(SemkvError, match="below the model's context"):
        tiny_llm.generate(PROMPT, method=TokenSelect(budget=5000, extrapolate=True), chat=False)


def test_a_fractional_budget_sizes_the_selection_cache_for_the_whole_generation(tiny_llm):
    """With a budget that is a share of the context, the top-k grows as the request generates; the Selection Cache
    is sized for the request's last step at its first, so it never grows (a growth is a CUDA graph captured again)
    while the request runs."""
    engine = tiny_llm.engine
    method = TokenSelect(budget=0.5, n_sink=2, n_recent=4)
    method.bind(tiny_llm.config, tiny_llm.tokenizer, engine.pool.page_size)
    seq = Sequence(0, list(range(10, 90)), SamplingParams(max_new_tokens=60), SeqKV(engine.pool))
    batch = DecodeBatch([seq], torch.zeros(1), torch.zeros(1, 1), tiny_llm.config, pool=engine.pool)
    method.step_plan(batch)
    epoch, width = method.graph_epoch, method._cache.top.shape[-1]
    assert width >= method.split(int(0.5 * (80 + 60)))[1] > method.split(int(0.5 * 81))[1]
    for _ in range(59):
        seq.output_ids.append(1)
        seq.num_computed += 1
        method.step_plan(batch)
    assert method.graph_epoch == epoch and method._cache.top.shape[-1] == width


def test_selection_cache_rows_follow_the_batch(tiny_llm):
    """Device cache rows: one per running sequence (row 0 is padding), kept while the sequence runs, freed when it
    leaves, emptied for a newcomer; growing the buffers keeps their contents and bumps `graph_epoch` (captured
    graphs point at the old ones)."""
    engine = tiny_llm.engine
    method = TokenSelect(budget=40)
    method.bind(tiny_llm.config, tiny_llm.tokenizer, engine.pool.page_size)

    def plan(seqs):
        batch = DecodeBatch(seqs, torch.zeros(len(seqs)), torch.zeros(len(seqs), 1), tiny_llm.config, pool=engine.pool)
        return method.step_plan(batch)

    def rows(p):
        return p.cache_row.tolist()

    a, b, c = (Sequence(i, [1, 2], SamplingParams(), SeqKV(engine.pool)) for i in range(3))
    first = plan([a, b])
    assert plan([a, b]) is first  # the same batch: the same plan object (the graph copies nothing)
    row_a, row_b = rows(first)
    assert 0 not in (row_a, row_b) and row_a != row_b
    method._cache.valid[row_a] = 1
    method._cache.valid[row_b] = 1
    second = plan([b, c])  # a left: c may take its row, emptied
    assert rows(second)[0] == row_b and method._cache.valid[rows(second)[1]].sum() == 0
    assert method._cache.valid[row_b].sum() == tiny_llm.config.num_layers
    epoch, capacity = method.graph_epoch, method._cache.q.shape[0]
    crowd = [b, c] + [Sequence(i, [1, 2], SamplingParams(), SeqKV(engine.pool)) for i in range(3, 3 + capacity)]
    grown = rows(plan(crowd))
    assert method.graph_epoch == epoch + 1 and method._cache.q.shape[0] > capacity
    assert len(set(grown)) == len(crowd) and 0 not in grown and grown[0] == row_b
    assert method._cache.valid[row_b].sum() == tiny_llm.config.num_layers  # contents moved with the buffers


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("selection", ["soft_vote", "top_k"])
def test_token_select_kernel_scores_an_int8_key_sketch_as_the_reference(interpreted, selection):
    """score_keys="int8": the kernels read int8 keys and scale each dot product by its slot's scale, as the
    reference does, and that is the vote of the dequantized keys."""
    from semkv.methods.state.key_sketch import quantize

    kernel = interpreted("semkv.methods.tokenselect.triton_token_select")
    heads, kv_heads, dim, page_size, pages = 8, 2, 16, 4, 80
    gen = torch.Generator().manual_seed(4)
    keys, scales = quantize(torch.randn(pages, page_size, kv_heads, dim, generator=gen))
    tables = torch.stack([torch.randperm(pages, generator=gen) for _ in range(3)])
    num_slots, rows = torch.tensor([150, 190, 20]), torch.tensor([1, 2, 3])
    parts = torch.tensor([[3, 20, 5], [2, 14, 4], [3, 20, 5]])
    q = torch.randn(3, heads, dim, generator=gen)
    caches = [tokenselect_reference.SelectionCacheBuffers.allocate(4, 1, heads * dim, 1, 20, torch.device("cpu"))
              for _ in range(3)]
    common = (num_slots, 200, rows)
    got = kernel.token_select(q, keys, tables, *common, caches[0], 0, parts, 28, 0.9, selection, None, block_n=16,
                              block_t=32, num_warps=4, splits=3, vote_splits=3, block_c=2, scales=scales)
    want = tokenselect_reference.token_select(q, keys, tables, *common, caches[1], 0, parts, 28, 0.9, selection,
                                              None, scales=scales)
    dequantized = tokenselect_reference.token_select(q, keys.float() * scales[..., None], tables, *common, caches[2],
                                                     0, parts, 28, 0.9, selection, None)
    for b, n in enumerate(torch.minimum(num_slots, parts.sum(1)).tolist()):
        assert torch.equal(got[b, :, :n], want[b, :, :n]) and torch.equal(want[b, :, :n], dequantized[b, :, :n])


def stepped(llm, method: TokenSelect) -> tuple[list[Sequence], DecodeBatch]:
    """Two requests prefilled and decoded 6 steps with `method` (bound here: a bind starts it afresh), and their
    7th step planned."""
    engine = llm.engine
    method.bind(llm.config, llm.tokenizer, engine.pool.page_size)
    seqs = []
    for i, prompt in enumerate((PROMPT, PROMPT[:400])):
        seq = Sequence(i, llm.encode(prompt, None, chat=False)[0], SamplingParams(max_new_tokens=12,
                       ignore_eos=True), SeqKV(engine.pool))
        seq.method_state = method.new_state(seq)
        seq.output_ids.append(int(engine.prefill(seq, method).argmax()))
        seqs.append(seq)
    with torch.inference_mode():
        for _ in range(6):
            engine.step(seqs, method, None, lambda seq: "")
        return seqs, engine.step_batch(seqs, *engine.prepare_step(seqs, method))


def shared_share(llm, got: TokenSelect, batch: DecodeBatch) -> float:
    """The share of the slots the exact keys select (a fresh TokenSelect of `got`'s budget and split, no cache) that
    `got` selects too, over every layer of the planned `batch`, for random queries."""
    cfg = llm.config
    exact = TokenSelect(budget=got.budget, n_sink=got.n_sink, n_recent=got.n_recent, theta=1.0, prefill="full")
    exact.bind(cfg, llm.tokenizer, llm.engine.pool.page_size)
    same = total = 0
    with torch.inference_mode():
        exact._ensure_cache(3, got.budget, llm.engine.pool.k.device)
        q = torch.randn(len(batch.seqs), cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(0))
        for layer in range(cfg.num_layers):
            mine, want = got.select_batched(layer, batch, q), exact.select_batched(layer, batch, q)
            for b, n in enumerate(want.lengths[:, 0].tolist()):
                same += len(set(mine.slots[b, 0, :n].tolist()) & set(want.slots[b, 0, :n].tolist()))
                total += n
    return same / total


def summaries_follow_keys(method: TokenSelect, seqs: list[Sequence], layers) -> None:
    """score_keys="pages": in `layers`, each page's summaries are the min / max of the keys it stored before the
    planned step."""
    pool, size = seqs[0].kv.pool, seqs[0].kv.pool.page_size
    summaries = method._summaries.data
    for seq in seqs:
        for layer in layers:
            n = seq.kv.num_slots[layer] - 1  # not the planned step's own slot
            for p in range(-(-n // size)):
                page = seq.kv.pages[layer, p]
                keys = pool.k[page, : min(size, n - p * size)]  # [filled, kv_heads, D]
                assert torch.equal(summaries["min"][page], keys.amin(0))
                assert torch.equal(summaries["max"][page], keys.amax(0))


def covering_gives_full_kv(llm, score_keys: str) -> None:
    """A budget covering the context gives Full KV's tokens with these keys; they refuse extrapolation."""
    full = llm.generate(PROMPT, method="full", max_new_tokens=NEW, chat=False, ignore_eos=True)
    covering = llm.generate(PROMPT, method=TokenSelect(budget=4096, score_keys=score_keys), max_new_tokens=NEW,
                            chat=False, ignore_eos=True)
    assert covering[0].token_ids == full[0].token_ids
    with pytest.raises(SemkvError, match=f"score_keys='{score_keys}' cannot be used with extrapolate"):
        TokenSelect(budget=64, score_keys=score_keys, extrapolate=True)


def test_an_int8_key_sketch_holds_every_stored_key_and_picks_as_the_exact_keys_do(tiny_llm, monkeypatch):
    """score_keys="int8": once a decode step is planned the sketch holds the int8 form of every key the sequences
    stored before it, in every layer (the last step's slot is sketched at the next step's plan, before that step
    runs: a pipelined step finds it there too; a prompt's keys are written 7 rows at a time, as a long prompt's are
    written in parts); the batched selection from it picks nearly the tokens the exact keys pick; a budget covering
    the context gives Full KV's tokens; the sketch is counted per page beside the pool."""
    from semkv.methods.state import key_sketch
    from semkv.methods.state.key_sketch import quantize

    engine, cfg = tiny_llm.engine, tiny_llm.config
    monkeypatch.setattr(key_sketch, "WRITE_BYTES", 7 * cfg.num_kv_heads * cfg.head_dim * 4)
    method = TokenSelect(budget=40, n_sink=4, n_recent=8, theta=1.0, score_keys="int8", prefill="full")
    seqs, batch = stepped(tiny_llm, method)
    pool, size = engine.pool, engine.pool.page_size
    for seq in seqs:
        for layer in range(cfg.num_layers):
            n = seq.kv.num_slots[layer] - 1  # not the planned step's own slot
            rows = torch.tensor([seq.kv.pages[layer, t // size] * size + t % size for t in range(n)])
            keys, scales = quantize(pool.flat()[0][rows])
            assert torch.equal(method._sketch.keys.data.view(-1, cfg.num_kv_heads, cfg.head_dim)[rows], keys)
            assert torch.equal(method._sketch.scales.data.view(-1, cfg.num_kv_heads)[rows], scales)
    assert shared_share(tiny_llm, method, batch) >= 0.95
    engine.end(seqs, method)
    assert method.page_state_bytes(pool) == size * cfg.num_kv_heads * (cfg.head_dim + 4)
    covering_gives_full_kv(tiny_llm, "int8")
    with pytest.raises(SemkvError, match="score_keys='int4'; allowed"):
        TokenSelect(budget=64, score_keys="int4")


def page_case(seed=5, heads=8, kv_heads=2, dim=16, page_size=4, pages=80, rows=3):
    """Random pool, shuffled tables, queries and each row's page bounds from the exact min / max of its keys."""
    gen = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(pages, page_size, kv_heads, dim, generator=gen)
    tables = torch.stack([torch.randperm(pages, generator=gen) for _ in range(rows)])
    q = torch.randn(rows, heads, dim, generator=gen)
    n = torch.tensor([150, 190, 20, 301, 97][:rows])
    bound = reference.page_bound(q, k_pool.amin(1), k_pool.amax(1), tables, n, page_size, "max")  # [B, kv, W]
    return q, k_pool, tables, n, bound


@pytest.mark.parametrize("selection, sets", [("soft_vote", 1), ("soft_vote", 2), ("top_k", 1)])
def test_a_covering_page_stage_selects_as_the_exact_keys(selection, sets):
    """The reference with every candidate page chosen (compact tables, the span) picks what the exact mode picks,
    and the Selection Cache holds the same slots."""
    size = 4
    q, k_pool, tables, n, bound = page_case()
    parts = torch.tensor([[3, 20, 5], [2, 14, 4], [3, 20, 5]])
    kv_heads = None if sets == 1 else 2
    caches = [tokenselect_reference.SelectionCacheBuffers.allocate(4, 1, 8 * 16, sets, 20, torch.device("cpu"))
              for _ in range(2)]
    common = (n, torch.tensor([1, 2, 3]))
    want = tokenselect_reference.token_select(q, k_pool, tables, n, 320, common[1], caches[0], 0, parts, 28, 1.0,
                                              selection, kv_heads)
    compact, pages, span = reference.page_candidates(bound, parts[:, 0], n - parts[:, 2], tables, size, 80)
    got = tokenselect_reference.token_select(q, k_pool, compact, n, 320, common[1], caches[1], 0, parts, 28, 1.0,
                                             selection, kv_heads, pages=(pages, span))
    for b, length in enumerate(torch.minimum(n, parts.sum(1)).tolist()):
        assert torch.equal(got[b, :, :length], want[b, :, :length])
    assert torch.equal(caches[0].top[1:, :, :, :14], caches[1].top[1:, :, :, :14])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("selection, sets", [("soft_vote", 1), ("soft_vote", 2), ("top_k", 1)])
def test_token_select_kernel_scores_chosen_pages_as_the_reference(interpreted, selection, sets):
    """score_keys="pages": the kernels score the span of the chosen pages' compact slots and write the slots they
    stand for, as the reference does, with fewer pages than the candidates hold."""
    kernel = interpreted("semkv.methods.tokenselect.triton_token_select")
    size = 4
    q, k_pool, tables, n, bound = page_case(seed=6, rows=4)
    parts = torch.tensor([[3, 12, 5], [2, 14, 4], [3, 20, 5], [4, 10, 8]])
    compact, pages, span = reference.page_candidates(bound, parts[:, 0], n - parts[:, 2], tables, size, 9)
    kv_heads = None if sets == 1 else 2
    caches = [tokenselect_reference.SelectionCacheBuffers.allocate(5, 1, 8 * 16, sets, 20, torch.device("cpu"))
              for _ in range(2)]
    rows = torch.tensor([1, 2, 3, 4])
    got = kernel.token_select(q, k_pool, compact, n, 9 * size, rows, caches[0], 0, parts, 28, 0.9, selection,
                              kv_heads, block_n=16, block_t=16, num_warps=4, splits=3, vote_splits=3, block_c=2,
                              pages=(pages, span))
    want = tokenselect_reference.token_select(q, k_pool, compact, n, 9 * size, rows, caches[1], 0, parts, 28, 0.9,
                                              selection, kv_heads, pages=(pages, span))
    for b, length in enumerate(torch.minimum(n, parts.sum(1)).tolist()):
        assert torch.equal(got[b, :, :length], want[b, :, :length])
    assert torch.equal(caches[0].top[1:, :, :, :10], caches[1].top[1:, :, :, :10])


def test_page_summaries_follow_every_stored_key_and_pick_near_the_exact_keys(tiny_llm):
    """score_keys="pages": after prefill and decode steps each page's summaries are the min / max of the keys it
    stores (the bound kernel folds each step's key); the two-stage selection keeps nearly every token the exact keys
    pick at the default superset, and every one when the pages cover the candidates; a covering budget gives Full
    KV's tokens; the summaries are counted per page beside the pool and freed with it."""
    engine, cfg = tiny_llm.engine, tiny_llm.config
    method = TokenSelect(budget=40, n_sink=4, n_recent=8, theta=1.0, score_keys="pages", prefill="full")
    seqs, batch = stepped(tiny_llm, method)
    pool, size = engine.pool, engine.pool.page_size
    summaries_follow_keys(method, seqs, range(cfg.num_layers))
    for superset, share in ((4.0, 0.9), (100.0, 1.0)):
        paged = TokenSelect(budget=40, n_sink=4, n_recent=8, theta=1.0, prefill="full", score_keys="pages",
                            superset=superset)
        paged.bind(cfg, tiny_llm.tokenizer, size)
        paged._ensure_cache(3, 40, pool.k.device)
        paged._summaries = method._summaries
        assert shared_share(tiny_llm, paged, batch) >= share, superset
    engine.end(seqs, method)
    assert method.page_state_bytes(pool) == 2 * cfg.num_kv_heads * cfg.head_dim * pool.k.element_size()
    assert pool.in_use == 0
    covering_gives_full_kv(tiny_llm, "pages")
    with pytest.raises(SemkvError, match="superset"):
        TokenSelect(budget=64, score_keys="pages", superset=0.5)


@pytest.mark.parametrize("score_keys", ["exact", "pages"])
def test_reuse_layers_selects_in_each_groups_first_layer_only(tiny_llm, score_keys):
    """reuse_layers=2 (3 layers: groups {0, 1} and {2}): a decode step selects in layers 0 and 2 exactly as without
    reuse (with "pages", their summaries kept up to date, at a superset that leaves pages out), and layer 1 attends
    to layer 0's selection; the Selection Cache is looked up in the selecting layers only; a budget covering the
    context gives Full KV's tokens."""
    cfg = tiny_llm.config
    method = TokenSelect(budget=40, n_sink=4, n_recent=8, theta=1.0, prefill="full", score_keys=score_keys,
                         superset=1.0, reuse_layers=2)
    seqs, batch = stepped(tiny_llm, method)
    if score_keys == "pages":
        summaries_follow_keys(method, seqs, (0, 2))  # the selecting layers'
    alone = TokenSelect(budget=40, n_sink=4, n_recent=8, theta=1.0, prefill="full", score_keys=score_keys,
                        superset=1.0)
    alone.bind(cfg, tiny_llm.tokenizer, tiny_llm.engine.pool.page_size)
    alone._cache, alone._summaries = method._cache, method._summaries
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        got = [method.select(layer, batch, torch.randn(len(seqs), cfg.num_heads, cfg.head_dim, generator=gen))
               for layer in range(cfg.num_layers)]
        gen.manual_seed(1)
        want = [alone.select_batched(layer, batch, torch.randn(len(seqs), cfg.num_heads, cfg.head_dim,
                                                                generator=gen)) for layer in range(cfg.num_layers)]
    assert got[1] is got[0]
    for layer in (0, 2):
        assert torch.equal(got[layer].lengths, want[layer].lengths)
        for b, n in enumerate(want[layer].lengths[:, 0].tolist()):
            assert torch.equal(got[layer].slots[b, :, :n], want[layer].slots[b, :, :n])
    assert not torch.equal(want[1].slots, want[0].slots)  # layer 1 alone would attend elsewhere
    tiny_llm.engine.end(seqs, method)
    assert tiny_llm.engine.pool.in_use == 0 and method._reused is None
    out = tiny_llm.generate(PROMPT, method=TokenSelect(budget=40, reuse_layers=2), max_new_tokens=NEW, chat=False,
                            ignore_eos=True)
    assert out[0].stats.extra["selection_cache_lookups"] == 2 * (NEW - 1)  # layers 0 and 2 of each step
    full = tiny_llm.generate(PROMPT, method="full", max_new_tokens=NEW, chat=False, ignore_eos=True)
    covering = tiny_llm.generate(PROMPT, method=TokenSelect(budget=4096, reuse_layers=2), max_new_tokens=NEW,
                                 chat=False, ignore_eos=True)
    assert covering[0].token_ids == full[0].token_ids
    with pytest.raises(SemkvError, match="reuse_layers"):
        TokenSelect(budget=40, reuse_layers=0)
