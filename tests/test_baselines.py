"""Each baseline's choice against a direct transcription of its paper's formula, on random keys and queries.

The methods run on a real paged cache (`SeqKV`) filled with random keys, through their hooks in the engine's order:
prefill chunk by chunk (write, `observe_prefill`), the engine's `evict_layer` after the last chunk (or every layer at
once after it, `evict_layers`, as a packed chunk does), `finish_prefill`, then decode steps (`begin_step`, write at the named slots, `select`). The references below are written from the
papers' definitions with plain loops and dense attention, independently of the methods' code.
"""
from __future__ import annotations

import math

import pytest
import torch

from semkv.engine.step import evict_layer, evict_layers, plan_chunks
from semkv.engine.hooks import DecodeBatch
from semkv.engine.kv_cache import KVPool, SeqKV
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.kernels import reference
from semkv.methods import get_method
from semkv.methods.pyramidkv import pyramid_budgets
from semkv.models.config import ModelConfig

LAYERS, HEADS, KV_HEADS, DIM, PAGE = 4, 4, 2, 16, 4
GROUP = HEADS // KV_HEADS
CONFIG = ModelConfig("llama", 100, 64, 128, LAYERS, HEADS, KV_HEADS, DIM, 1e-5, 4096, False, False, False, False,
                     False)


class Run:
    """Random queries/keys for n prompt tokens + decode steps, fed to a method over a real SeqKV."""

    def __init__(self, method, n: int, steps: int = 0, chunk: int = 16, seed: int = 0, at_once: bool = False):
        gen = torch.Generator().manual_seed(seed)
        total = n + steps
        self.q = torch.randn(LAYERS, total, HEADS, DIM, generator=gen) * 1.5  # [layers, tokens, heads, D]
        self.k = torch.randn(LAYERS, total, KV_HEADS, DIM, generator=gen) * 1.5  # [layers, tokens, kv_heads, D]
        self.method, self.n = method, n
        method.bind(CONFIG, None, PAGE)
        pool = KVPool(LAYERS, KV_HEADS, DIM, PAGE, torch.float32, torch.device("cpu"))
        self.seq = seq = Sequence(0, list(range(n)), SamplingParams(), SeqKV(pool))
        seq.method_state = method.new_state(seq)
        method.admit(seq)  # as the engine does when a request is admitted
        spans = plan_chunks(0, n, chunk, method.window_size())
        windows = []  # with at_once, each layer's window queries: every layer evicted after the last (`evict_layers`)
        for a, b in spans:
            seq.num_computed = b
            for layer in range(LAYERS):
                seq.kv.ensure_slots(layer, b)
                seq.kv.write(layer, torch.arange(a, b), self.k[layer, a:b], self.k[layer, a:b], torch.arange(a, b))
                seq.kv.num_slots[layer] = b
                lse = None
                if method.prefill_lse:  # the normalisers the engine's prefill attention gives
                    pool_k = seq.kv.pool.k
                    lse = reference.prefill_attention(self.q[layer, a:b], pool_k, pool_k, seq.kv.table[layer], a,
                                                      None, DIM**-0.5, lse=True)[1]
                method.observe_prefill(layer, seq, self.q[layer, a:b], a, lse)
                if b == n and at_once:
                    windows.append(self.q[layer, b - min(method.window_size(), b - a) : b])
                elif b == n:
                    evict_layer(method, seq, layer, self.q[layer, a:b])
        if at_once:
            evict_layers(method, seq, windows)
        method.finish_prefill(seq)
        self.selections = [self.decode(t) for t in range(n, total)]

    def decode(self, t: int) -> list:
        """One decode step of token t, as `Engine.decode_step` does it; returns each layer's Selection."""
        seq, kv = self.seq, self.seq.kv
        before = torch.tensor([kv.num_slots])
        write = self.method.begin_step(DecodeBatch([seq], torch.tensor([t]), before, CONFIG))
        if write is None:
            write = before[:, :, None].expand(-1, -1, KV_HEADS)
        for layer in range(LAYERS):
            slots = write[0, layer]  # [kv_heads]
            if bool((slots == kv.num_slots[layer]).any()):
                kv.num_slots[layer] += 1
                kv.ensure_slots(layer, kv.num_slots[layer])
            kv.write(layer, slots[None], self.k[layer, t][None], self.k[layer, t][None], torch.tensor([t]))
        batch = DecodeBatch([seq], torch.tensor([t]), torch.tensor([kv.num_slots]), CONFIG, kv.table[None],
                            max(kv.num_slots), pool=kv.pool)
        selections = [self.method.select(layer, batch, self.q[layer, t][None]) for layer in range(LAYERS)]
        seq.num_computed += 1
        return selections

    def kept(self, layer: int) -> list[set[int]]:
        """Original positions resident in `layer`, per KV head."""
        return [set(p.tolist()) for p in self.seq.kv.positions(layer)]


def attention_row(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """softmax(q . k / sqrt(D)) of one query head over the given keys [n, D] -> [n]."""
    return torch.softmax(keys @ q / math.sqrt(DIM), dim=0)


def top_positions(scores: dict[int, float], count: int) -> set[int]:
    return set(sorted(scores, key=lambda p: -scores[p])[:count])


def selected(selection, head: int) -> set[int]:
    row = 0 if selection.slots.shape[1] == 1 else head
    return set(selection.slots[0, row, : int(selection.lengths[0, row])].tolist())


# -- StreamingLLM ------------------------------------------------------------------------------------------------------
def test_streaming_llm_keeps_sinks_and_the_most_recent_tokens():
    budget, n_sink, n, steps = 20, 4, 50, 7
    run = Run(get_method("streaming_llm", budget, n_sink=n_sink), n, steps)
    last = n + steps - 1
    for layer in range(LAYERS):
        for kept in run.kept(layer):
            assert kept == set(range(n_sink)) | set(range(last - (budget - n_sink) + 1, last + 1))


# -- H2O ---------------------------------------------------------------------------------------------------------------
def h2o_reference(run: Run, layer: int, head: int, budget: int, n_recent: int, steps: int,
                  scores: dict[int, float] | None = None) -> list[set[int]]:
    """Resident positions of one KV head after prefill and after each decode step (H2O, Algorithm 1 with the victim
    chosen before the new token attends); `scores`, if given, receives each position's accumulated attention."""
    q, k, n = run.q[layer], run.k[layer, :, head], run.n
    score = {m: 0.0 for m in range(n)}
    for j in range(n):  # every prompt query attends causally to every earlier prompt key
        for h in range(head * GROUP, (head + 1) * GROUP):
            for m, p in enumerate(attention_row(q[j, h], k[: j + 1]).tolist()):
                score[m] += p
    recent = set(range(n - n_recent, n))
    cache = recent | top_positions({m: s for m, s in score.items() if m not in recent}, budget - n_recent)
    history = [set(cache)]
    for t in range(n, n + steps):
        if len(cache) >= budget:
            outside = [m for m in cache if m <= t - n_recent]
            cache.remove(min(outside, key=lambda m: score[m]))
        cache.add(t)
        score[t] = 0.0
        order = sorted(cache)
        for h in range(head * GROUP, (head + 1) * GROUP):
            for m, p in zip(order, attention_row(q[t, h], k[order]).tolist()):
                score[m] += p
        history.append(set(cache))
    if scores is not None:
        scores.update(score)
    return history


@pytest.mark.parametrize("recent_ratio", [0.5, 0.25])
def test_h2o_evicts_the_lightest_token_outside_the_recent_window(recent_ratio):
    budget, n, steps = 16, 40, 24  # generated tokens leave the recent window and compete with their own scores
    run = Run(get_method("h2o", budget, recent_ratio=recent_ratio), n, steps)
    kv = run.seq.kv
    for layer in (0, LAYERS - 1):
        resident = kv.physical(layer, torch.arange(kv.num_slots[layer]))
        for head in range(KV_HEADS):
            scores = {}
            expected = h2o_reference(run, layer, head, budget, int(budget * recent_ratio), steps, scores)
            assert run.kept(layer)[head] == expected[-1]
            # each resident token's accumulated attention, counted from the step it took its slot
            stored = run.method.scores.data.view(-1, KV_HEADS)[resident, head]
            got = dict(zip(kv.positions(layer)[head].tolist(), stored.tolist()))
            assert got == pytest.approx({m: scores[m] for m in got}, rel=1e-5)
    # the step-by-step history (each victim) on one head: replay with fewer steps
    for s in range(6):
        partial = Run(get_method("h2o", budget, recent_ratio=recent_ratio), n, s)
        assert partial.kept(0)[1] == h2o_reference(partial, 0, 1, budget, int(budget * recent_ratio), s)[-1]


# -- SnapKV / PyramidKV ------------------------------------------------------------------------------------------------
def snapkv_reference(run: Run, layer: int, head: int, n_keep: int, window: int, kernel: int) -> set[int]:
    """SnapKV (Li et al., 2024, Listing 1): window attention, mean over the window, 1-D average pooling, mean over the
    KV group, top-k of the prefix plus the window."""
    q, k, n = run.q[layer], run.k[layer, :, head], run.n
    prefix = n - window
    vote = [0.0] * prefix
    for h in range(head * GROUP, (head + 1) * GROUP):
        for j in range(prefix, n):
            probs = attention_row(q[j, h], k[: j + 1]).tolist()
            for m in range(prefix):
                vote[m] += probs[m] / window / GROUP
    r = kernel // 2
    pooled = {m: sum(vote[i] for i in range(m - r, m + r + 1) if 0 <= i < prefix) / kernel for m in range(prefix)}
    return set(range(prefix, n)) | top_positions(pooled, n_keep - window)


@pytest.mark.parametrize("kernel", [5, 1])
def test_snapkv_keeps_the_top_pooled_window_attention(kernel):
    budget, window, n = 24, 8, 60
    run = Run(get_method("snapkv", budget, window=window, kernel_size=kernel), n)
    for layer in range(LAYERS):
        for head in range(KV_HEADS):
            assert run.kept(layer)[head] == snapkv_reference(run, layer, head, budget, window, kernel)


def test_pyramid_budgets_follow_the_paper_schedule():
    for budget, window, n, layers, beta in [(128, 32, 1000, 30, 20), (64, 8, 100, 24, 2), (300, 32, 400, 30, 20)]:
        got = pyramid_budgets(budget, window, n, layers, beta)
        assert sum(got) == layers * budget  # mean = budget exactly
        assert all(a >= b for a, b in zip(got, got[1:]))  # more in lower layers
        extra = budget - window
        top, bottom = extra / beta, 2 * extra - extra / beta
        if bottom > n - window:  # capped at the prompt: the top layer takes the rest
            bottom, top = n - window, 2 * extra - (n - window)
        for layer, b in enumerate(got):
            assert abs(b - (window + bottom - (bottom - top) * layer / (layers - 1))) < 1
        assert max(got) <= n
    assert pyramid_budgets(500, 32, 400, 30, 20) == [400] * 30  # budget >= prompt: keep all


def test_pyramidkv_layers_keep_their_own_counts_of_the_top_snapkv_scores():
    budget, window, n = 24, 8, 60
    run = Run(get_method("pyramidkv", budget, window=window, beta=4), n)
    budgets = pyramid_budgets(budget, window, n, LAYERS, 4)
    assert budgets[0] > budget > budgets[-1]
    for layer in range(LAYERS):
        assert run.seq.kv.num_slots[layer] == budgets[layer]
        assert run.seq.kv.page_count[layer] == -(-budgets[layer] // PAGE)  # the rest went back to the pool
        for head in range(KV_HEADS):
            assert run.kept(layer)[head] == snapkv_reference(run, layer, head, budgets[layer], window, 5)


# -- Quest -------------------------------------------------------------------------------------------------------------
def test_quest_selects_the_top_pages_of_the_min_max_bound():
    budget, n = 16, 45  # 4 pages of 4 attended out of 12
    run = Run(get_method("quest", budget), n, steps=2)
    t = n + 1  # the last decode step's token
    for layer in range(LAYERS):
        for head in range(KV_HEADS):
            keys = run.k[layer, : t + 1, head]
            pages = [keys[p : p + PAGE] for p in range(0, t + 1, PAGE)]
            bound = {}
            for i, page in enumerate(pages):
                kmin, kmax = page.min(0).values, page.max(0).values
                heads = range(head * GROUP, (head + 1) * GROUP)
                bound[i] = sum(float(torch.maximum(run.q[layer, t, h] * kmin, run.q[layer, t, h] * kmax).sum())
                               for h in heads) / GROUP
            bound[len(pages) - 1] = math.inf  # the page of the current token
            chosen = top_positions(bound, budget // PAGE)
            expected = {s for p in chosen for s in range(p * PAGE, min((p + 1) * PAGE, t + 1))}
            assert selected(run.selections[-1][layer], head) == expected


# -- KeyDiff -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [0, 6])
def test_keydiff_keeps_the_keys_least_similar_to_the_mean_key(window):
    budget, n = 20, 50
    run = Run(get_method("keydiff", budget, window=window), n)
    for layer in range(LAYERS):
        for head in range(KV_HEADS):
            keys = run.k[layer, :n, head]
            anchor = sum(k / k.norm() for k in keys) / n
            score = {m: -float(keys[m] @ anchor / (keys[m].norm() * anchor.norm())) for m in range(n)}
            recent = set(range(n - window, n))
            expected = recent | top_positions({m: s for m, s in score.items() if m not in recent}, budget - window)
            assert run.kept(layer)[head] == expected


# -- InfLLM ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("per_head", [False, True])
def test_infllm_attends_initial_local_and_the_top_blocks_by_representative_keys(per_head):
    budget, n, steps, block, n_repr = 40, 71, 3, 4, 2  # a block leaves the window at the last step
    method = get_method("infllm", budget, n_sink=4, block_size=block, n_repr=n_repr, per_head=per_head)
    run = Run(method, n, steps)
    init, window, most = 4, 10, (budget - 4 - 10) // block  # init = min(4, 40 / 8), local >= 40 / 4
    t = n + steps - 1
    for layer in range(LAYERS):
        q, k = run.q[layer], run.k[layer]
        # blocks formed by the end of the previous step (the last query to see their last token was t - 1)
        block_score = [[0.0] * KV_HEADS for _ in range((t - window) // block)]
        for head in range(KV_HEADS):
            group = range(head * GROUP, (head + 1) * GROUP)
            # r_m = sum of q_{m+j} . k_m over the W following queries and the group's heads
            r = [sum(float(q[j, h] @ k[m, head]) for j in range(m + 1, min(m + window, t) + 1) for h in group)
                 for m in range(t + 1)]
            for b in range(len(block_score)):
                members = range(b * block, (b + 1) * block)
                reps = sorted(members, key=lambda m: -r[m])[:n_repr]
                key = sum(k[m, head] for m in reps) / n_repr
                block_score[b][head] = sum(float(q[t, h] @ key) for h in group) / GROUP
        candidates = range(init // block, len(block_score))
        chosen_blocks = min(most, len(candidates))
        local = budget - init - chosen_blocks * block
        for head in range(KV_HEADS):
            if per_head:
                ranking = {b: block_score[b][head] for b in candidates}
            else:
                ranking = {b: sum(block_score[b]) for b in candidates}
            blocks = top_positions(ranking, chosen_blocks)
            expected = set(range(init)) | set(range(t + 1 - local, t + 1))
            expected |= {m for b in blocks for m in range(b * block, (b + 1) * block)}
            assert selected(run.selections[-1][layer], head) == expected
            assert len(expected) <= budget


# -- every method on a real model: batches of very different lengths ---------------------------------------------------
@pytest.mark.parametrize("q_start, k_start, window", [(0, 0, 33), (100, 40, 50), (500, 300, 120), (10, 0, 1000)])
def test_infllm_band_scores_go_a_block_of_queries_at_a_time(q_start, k_start, window):
    """InfLLM's representative scores: sum over queries j and the group's heads of q_j . k_m for j - window <= m < j,
    computed `block` queries at a time against the keys their band reaches (a 32k prompt in one chunk asked 7.6 GiB
    of workspace at once on the H200), equal to the whole [kv_heads, C, K] product by hand."""
    from semkv.methods.infllm.method import band_scores

    gen = torch.Generator().manual_seed(window)
    n = 300
    q = torch.randn(n, 4, 8, generator=gen)  # 2 KV heads of 2 query heads
    keys = torch.randn(2, q_start + n - k_start, 8, generator=gen)
    qg = q.view(n, 2, 2, 8).sum(2).transpose(0, 1)
    j = torch.arange(q_start, q_start + n)[:, None]
    m = torch.arange(k_start, k_start + keys.shape[1])[None, :]
    want = (qg @ keys.transpose(1, 2)).masked_fill(~((m < j) & (m >= j - window)), 0.0).sum(1)
    got = band_scores(q, keys, q_start, k_start, window, block=64)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("name", ["streaming_llm", "h2o", "snapkv", "pyramidkv", "quest", "keydiff", "infllm"])
def test_a_batch_of_a_short_and_a_long_prompt_equals_one_by_one(tiny_llm, name):
    prompts = ["Hello there.", "Numbers: " + " ".join(str(i) for i in range(90))]  # ~10 and ~190 tokens
    kw = dict(method=name, budget=24, max_new_tokens=6, chat=False, ignore_eos=True)
    if name == "infllm":
        kw["method_params"] = dict(block_size=4, n_sink=4)
    batched = [o.token_ids for o in tiny_llm.generate(prompts, **kw)]
    assert batched == [tiny_llm.generate([p], **kw)[0].token_ids for p in prompts]


def test_page_summaries_of_a_bf16_cache_are_its_exact_min_and_max():
    """Quest's min / max summaries live in the pool's dtype (they are stored keys, so nothing rounds), built at
    prefill and folded forward token by token during decoding; sums stay float32."""
    from semkv.methods.state.page_summaries import PageSummaries

    pool = KVPool(1, KV_HEADS, DIM, PAGE, torch.bfloat16, torch.device("cpu"))
    kv = SeqKV(pool)
    keys = torch.randn(2 * PAGE + 3, KV_HEADS, DIM).bfloat16()
    kv.ensure_slots(0, keys.shape[0])
    slots = torch.arange(keys.shape[0])
    kv.write(0, slots, keys, keys, slots)
    summaries = PageSummaries(("min", "max", "sum"))
    kv.num_slots[0] = PAGE + 2  # prefill: one full page and two slots of the next
    summaries.build(kv, 0)
    for n in range(PAGE + 2, keys.shape[0]):  # decode: one slot at a time, the third page starts fresh
        summaries.add_tokens(pool, kv.table[0][None], torch.full((1, KV_HEADS), n))
    for page in range(3):
        block = keys[page * PAGE : (page + 1) * PAGE]
        physical = kv.table[0, page]
        assert summaries.data["min"].dtype == torch.bfloat16 and summaries.data["sum"].dtype == torch.float32
        assert torch.equal(summaries.data["min"][physical], block.amin(0))
        assert torch.equal(summaries.data["max"][physical], block.amax(0))
        assert torch.allclose(summaries.data["sum"][physical], block.float().sum(0), atol=1e-4)


@pytest.mark.parametrize("key_bytes", [256 * 2**20, 1])
@pytest.mark.parametrize("name, params", [("streaming_llm", {}), ("h2o", {}), ("snapkv", {}), ("pyramidkv", {}),
                                          ("keydiff", {}), ("chunkkv", {}),
                                          ("chunkkv", dict(per_head=True, neighbours=3)),
                                          ("chunkkv", dict(reuse_layers=2))])
def test_every_layer_evicted_at_once_keeps_what_each_layer_keeps(monkeypatch, key_bytes, name, params):
    """A prompt's last chunk packed with others evicts every layer after its forward (`evict_layers`): the methods
    that score every layer in a few calls (SnapKV, PyramidKV, ChunkKV; one layer a call when `key_bytes` is 1) and
    those evicting layer by layer keep each layer's slots of the layer-by-layer path, and compacting the layers
    together (or one a copy, `key_bytes` 1) leaves every layer the keys, values and positions one compaction a layer
    leaves."""
    monkeypatch.setattr("semkv.methods.base.LAYERS_KEY_BYTES", key_bytes)
    monkeypatch.setattr("semkv.engine.kv_cache.COMPACT_BYTES", key_bytes)
    runs = [Run(get_method(name, 56, **params), 120, steps=3, at_once=at_once) for at_once in (False, True)]
    stored = [[run.seq.kv.gather(layer, run.seq.kv.all_slots(layer)) for layer in range(LAYERS)] for run in runs]
    assert runs[0].seq.kv.num_slots == runs[1].seq.kv.num_slots and max(runs[0].seq.kv.num_slots) < 120
    assert len({frozenset(runs[0].kept(layer)[0]) for layer in range(LAYERS)}) > 1 or name == "streaming_llm"
    for tensors, tensors_at_once in zip(*stored):
        assert all(torch.equal(a, b) for a, b in zip(tensors, tensors_at_once))
