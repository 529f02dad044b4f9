"""The serving core (`Scheduler` through `LLM.new_session`): prompts prefilled in chunks between decode steps, prefix
caching, preemption and admission past a request that does not fit, on a tiny random Llama (3 layers, GQA 4/2).
Every method of the matrix gives the tokens of whole-prompt prefill, of a cache miss and of a run alone."""
from __future__ import annotations

import copy

import numpy as np
import pytest

import semkv
from semkv.engine.prefix_cache import PrefixCache, PromptKeys, block_keys
from semkv.engine.scheduler import chunk_cost, chunk_tokens
from semkv.engine.sequence import SamplingParams
from semkv.errors import SemkvError
from semkv.methods import get_method
from test_method_matrix import CASES, CONTEXTS, HARD, IDS, NEW, QUESTIONS, SMALL

PROMPTS = [f"{c}\n\n{q}" for c, q in zip(CONTEXTS, QUESTIONS)]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=48)


def encode(llm, text: str) -> list[int]:
    return llm.encode(text, chat=False)[0]


def alone(llm, method, prompts: list[str], new: int = NEW) -> list[list[int]]:
    """Greedy tokens of each prompt, prefilled whole (`LLM.generate`: the same as one by one, test_method_matrix)."""
    return [o.token_ids for o in llm.generate(prompts, method=method, max_new_tokens=new, chat=False,
                                              ignore_eos=True)]


class Driver:
    """A session fed by hand: requests submitted when a condition on the session holds, one `advance` at a time."""

    def __init__(self, llm, **options):
        self.llm, self.session = llm, llm.new_session(**options)
        self.seqs = []
        self.started: list[int | None] = []  # the first request's tokens when each request was submitted
        self.answered: list[int | None] = []  # ... when each got its first token

    def submit(self, ids: list[int], method, new: int = NEW) -> None:
        params = SamplingParams(max_new_tokens=new, ignore_eos=True)
        self.seqs.append(self.session.submit(len(self.seqs), ids, params, method, repr(method)))
        self.started.append(len(self.seqs[0].output_ids))
        self.answered.append(None)

    def advance(self) -> None:
        self.session.advance()
        for i, seq in enumerate(self.seqs):
            if self.answered[i] is None and seq.output_ids:
                self.answered[i] = len(self.seqs[0].output_ids)

    def finish(self) -> list[list[int]]:
        while self.session.scheduler.busy:
            self.advance()
        assert not self.session.scheduler.failed, self.session.scheduler.failed
        return [s.output_ids for s in self.seqs]


def cached_document(llm, method, copies: int = 4, budget: int = 4096):
    """A session whose first question on a document (`copies` times the first context) is done, its pages in the
    prefix cache: the driver, the two questions' prompts on that document and their tokens without the cache."""
    prompts = [f"{CONTEXTS[0] * copies}\n\n{q}" for q in QUESTIONS[:2]]
    want = alone(llm, method, prompts)
    llm.engine.pool.clear_cache()
    driver = Driver(llm, max_num_batched_tokens=budget)
    driver.submit(encode(llm, prompts[0]), method)
    driver.finish()
    return driver, prompts, want


@pytest.mark.parametrize("name, i, params", CASES, ids=IDS)
def test_chunked_prefill_between_decode_steps_gives_the_tokens_of_whole_prompts(llm, name, i, params):
    """A prompt arriving while another decodes is prefilled 16 tokens a step between its decode steps (several
    chunks, the method's prefill work finished at the last one): the same greedy tokens as whole prompts."""
    method = get_method(name, SMALL, **params)
    prompts = PROMPTS[1:]
    want = alone(llm, method, prompts)
    driver = Driver(llm, max_num_batched_tokens=16, enable_prefix_caching=False)
    driver.submit(encode(llm, prompts[0]), method)
    while len(driver.seqs[0].output_ids) < 2:
        driver.advance()
    driver.submit(encode(llm, prompts[1]), method)
    assert driver.finish() == want
    assert driver.answered[1] - driver.started[1] >= 2  # the first one decoded while the second was prefilled
    assert llm.engine.memory().held == (0, 0, 0, 0)


@pytest.mark.parametrize("name, i, params", [c for c in CASES if c[1] == 0], ids=[i for c, i in zip(CASES, IDS)
                                                                                  if c[1] == 0])
def test_a_prefix_cache_hit_gives_the_tokens_of_a_miss(llm, name, i, params):
    """A second question on the same document starts from the first one's cached pages where the method shares
    prompt pages (`shares_prefix`: Full KV, selection and prefill eviction), with the tokens of a run without the
    cache; the pages go back to the pool, the cache keeps them idle."""
    method = get_method(name, SMALL, **params)
    document = CONTEXTS[0] * 2
    driver, prompts, want = cached_document(llm, method, copies=2, budget=64)
    driver.submit(encode(llm, prompts[1]), method)
    assert driver.finish() == want
    second, bound = driver.seqs[1], method.bound(llm.config, llm.tokenizer, 16)
    shares = bound.shares_prefix(second)
    page = llm.engine.pool.page_size
    # whole pages of the document, leaving the method's observation window to be computed
    blocks = min(len(encode(llm, document)), len(second.prompt_ids) - max(bound.window_size(), 1)) // page
    assert second.stats.cached_tokens == (blocks * page if shares else 0) and (blocks > 2 or not shares)
    assert llm.engine.memory().held == (0, 0, 0, 0)
    assert (llm.engine.pool.cached_pages > 0) == shares


# DynSplit-KV's token scores too, at a share of the context: its budget and split are made on the device
# (`plans_ahead`), its budget growing every few tokens; and SentenceKV's retrieving mode, its generated tokens joining
# their buckets every 4 (at the plan of the step that may attend to them); and TokenSelect's int8 key sketch, the last
# step's slot sketched at the plan of the next, and its and DynSplit-KV's page summaries, each step's key folded in by
# the step; and CHESS re-selecting at every step (asked by `observe_logits`)
PIPELINED = [("full", 0, {})] + [c for c in CASES if c[1] == 0] + [("chess", 1, HARD["chess"][0] | {"budget": 96}),
    ("dynsplit", 0, {"score": "tokens", "budget": 0.3}),
    ("sentencekv", 0, dict(keep_factor=1.0, query="current", score="tokens", retain="sentences", offload_chunk=4)),
    ("tokenselect", 0, dict(score_keys="int8", prefill="full")),
    ("tokenselect", 0, dict(score_keys="pages", superset=1.0, prefill="full")),
    ("dynsplit", 0, {"score": "tokens", "score_keys": "pages", "superset": 1.0, "budget": 0.3}),
    ("infllm", 0, {"budget": 0.3})]


@pytest.mark.parametrize("name, i, params", PIPELINED, ids=["full"] + [i for c, i in zip(CASES, IDS) if c[1] == 0] + [
                         "chess-always", "dynsplit-tokens", "sentencekv-retrieving", "tokenselect-int8",
                         "tokenselect-pages", "dynsplit-pages", "infllm-share"])
def test_a_pipelined_decode_gives_the_tokens_of_steps_ended_one_by_one(llm, name, i, params, monkeypatch):
    """A batch decoding alone launches its next step before it ends the last one (`Scheduler.pipeline`, on CUDA:
    switched on here): every method gives the tokens of steps ended one at a time, requests that end at different
    steps (in the step launched after the one that ended them: its tokens past their end are dropped) and one
    cancelled while a step is pending included; every page and byte of state is free again after."""
    params = dict(params)
    method = get_method(name, params.pop("budget", None if name == "full" else SMALL), **params)
    lengths = [NEW, NEW - 5, NEW + 3, 2]
    ids = [encode(llm, p) for p in (PROMPTS * 2)[: len(lengths)]]

    def run(pipeline: bool) -> tuple[list[list[int]], int]:
        driver = Driver(llm, max_num_batched_tokens=4096)
        driver.session.scheduler.pipeline = pipeline
        pipelined, step = [], type(driver.session.scheduler)._pipelined
        monkeypatch.setattr(type(driver.session.scheduler), "_pipelined",
                            lambda self, started: pipelined.append(step(self, started)) or pipelined[-1])
        for prompt, new in zip(ids, lengths):
            driver.submit(prompt, method, new)
        driver.submit(ids[0], method, NEW)  # cancelled once a step is pending
        while driver.session.scheduler._pending is None and driver.session.scheduler.busy:
            driver.advance()
        driver.session.cancel(len(driver.seqs) - 1)
        tokens = driver.finish()
        assert llm.engine.pool.in_use == 0 and llm.engine.memory().held == (0, 0, 0, 0)
        return tokens[:-1], sum(pipelined)

    want, none = run(False)
    got, pipelined = run(True)
    assert got == want and none == 0
    assert [len(t) for t in got] == lengths
    assert (pipelined > 0) == llm.engine.pipelines(method)  # not H2O, StreamingLLM, SentenceKV (mean query)


def test_a_follow_ups_chunk_takes_every_layers_pages_at_once(llm):
    """A follow-up question on a cached document prefills only its question: a short last chunk, in the packed
    forward even alone. Its pages for every layer come in one allocation, one copy of their ids to the device: five
    copies in all (its prompt from the cache's end and the cached pages at admission, the new pages, the chunk's
    bounds and last row); where the method compacts the layers at prefill's end (SnapKV), one more in the next step,
    once its first token is chosen (every layer's new pages for the slots it keeps: the layers are compacted
    together). The tokens are those of a run without the cache."""
    for method, compactions in ((get_method("full"), 0), (get_method("snapkv", SMALL), 1)):
        driver, prompts, want = cached_document(llm, method, copies=2)
        staging, counted = llm.engine.pool.staging, []
        send = staging.send
        staging.send = lambda values: counted.append(1) or send(values)  # counts the copies to the device
        try:
            driver.submit(encode(llm, prompts[1]), method)
            driver.advance()  # its admission and its one chunk
            assert len(counted) == 5
            driver.advance()  # its first token, then its prompt's end
        finally:
            del staging.send
        assert driver.seqs[1].stats.cached_tokens > 0
        assert len(counted) == 5 + compactions
        assert driver.finish() == want


def test_a_follow_up_compacted_at_prefill_takes_new_pages_for_what_it_keeps_not_for_the_document(llm):
    """A follow-up question on a cached document under a method that compacts each layer at the end of prefill
    (SnapKV): the layer's kept slots get new pages (the cached ones stay the cache's), the document's other pages
    leave it without new ones being taken; the tokens are those of a run without the cache."""
    method = get_method("snapkv", SMALL)
    driver, prompts, want = cached_document(llm, method)
    pool = llm.engine.pool
    before = pool.peak_in_use = pool.in_use
    driver.submit(encode(llm, prompts[1]), method)
    assert driver.finish() == want
    follow_up, page, layers = driver.seqs[1], pool.page_size, llm.config.num_layers
    pages = -(-len(follow_up.prompt_ids) // page)
    assert follow_up.stats.cached_tokens >= 16 * page
    # its prompt's pages (cached or its own, kept for the cache until its prefill ends) and each layer's new pages
    # for its kept slots (new pages for a whole layer's document before: 95 here against 78)
    assert pool.peak_in_use - before <= layers * (pages + -(-SMALL // page))
    assert llm.engine.memory().held == (0, 0, 0, 0)


def test_a_follow_ups_first_token_goes_out_before_its_method_compacts_the_document(llm):
    """A follow-up question on a cached document under SnapKV: its first token is given, and the scheduler's
    `publish` called, while it still holds the whole document (its prompt's end, `Engine.end_prompt`: the
    compaction, then the document's pages back to the cache, comes after, before its first decode step); a request
    that ends at its first token is published too. The tokens are those of a run without the cache, and nothing is
    held after."""
    method = get_method("snapkv", SMALL)
    driver, prompts, want = cached_document(llm, method)
    pool, layers = llm.engine.pool, llm.config.num_layers
    seen = []  # at each publish: the follow-up's tokens, whether its prompt is ended, its pages in every layer
    driver.session.scheduler.publish = lambda: seen.append(
        (len(follow_up.output_ids), follow_up.prefill is None, int(follow_up.kv.page_count.min())))
    driver.submit(encode(llm, prompts[1]), method)
    follow_up = driver.seqs[1]
    while len(follow_up.output_ids) < 2:
        driver.advance()
    pages = -(-len(follow_up.prompt_ids) // pool.page_size)
    assert seen == [(1, False, pages)]  # every layer held the whole prompt when its first token went out
    assert follow_up.kv.page_count.max() < pages and layers > 1  # compacted before its first decode step
    assert driver.finish() == want
    assert len(seen) == 1  # decode steps' tokens go out with the step (the caller's, after `advance`)
    driver.submit(encode(llm, prompts[1]), method, new=1)
    assert driver.finish()[2] == want[1][:1] and len(seen) == 2
    assert llm.engine.memory().held == (0, 0, 0, 0)


@pytest.mark.parametrize("name", ["chunkkv", "chess"])
def test_a_servers_warm_up_runs_documents_and_follow_ups_then_leaves_nothing_behind(llm, name):
    """`Session.warm_up` (a server's start on CUDA) prefills two documents in chunks, then asks follow-up questions on
    both together from the prefix cache; after it nothing is held or cached, the counters start again, and the
    session's requests get the tokens of a run without it."""
    method = get_method(name, SMALL)
    prompts = [f"{CONTEXTS[0] * 2}\n\n{q}" for q in QUESTIONS[:2]]
    want = alone(llm, method, prompts)
    llm.engine.pool.clear_cache()
    driver = Driver(llm, max_num_batched_tokens=96)
    warmed = driver.session.scheduler.counters
    driver.session.warm_up(method, repr(method))
    assert warmed.admitted == 10 and warmed.cached_tokens >= 8 * 96 and warmed.steps > 4
    counters = driver.session.scheduler.counters
    assert (counters.admitted, counters.steps, counters.cached_tokens) == (0, 0, 0)
    memory = llm.engine.memory()
    assert (memory.pages_in_use, memory.requests, memory.cached_pages) == (0, 0, 0)
    assert sum(memory.state_bytes.values()) == 0 and not driver.session.requests
    for prompt in prompts:
        driver.submit(encode(llm, prompt), method)
    assert driver.finish() == want
    assert llm.engine.memory().held == (0, 0, 0, 0)


def test_a_step_of_little_prompt_work_gives_its_first_tokens_before_it_ends_any_prompt(llm):
    """A step that computed at most `read_at_once` prompt tokens (CUDA's steps: a short forward to wait for) gives
    its prompts their first tokens before it returns; the step publishes the first tokens of the step before first
    (before it waits), then its own, and only then ends the prompts of its packed forwards (SnapKV's compaction).
    Past the limit a follow-up awaits the next step (`Scheduler.awaiting`). The tokens are those of a run without the
    cache."""
    method = get_method("snapkv", SMALL)
    prompts = [f"{CONTEXTS[0] * 4}\n\n{q}" for q in QUESTIONS]
    want = alone(llm, method, prompts)
    llm.engine.pool.clear_cache()
    driver = Driver(llm, max_num_batched_tokens=4096)
    scheduler = driver.session.scheduler
    driver.submit(encode(llm, prompts[0]), method)
    driver.finish()
    scheduler.read_at_once = 8  # a follow-up's chunk is longer: it awaits the next step
    driver.submit(encode(llm, prompts[1]), method)
    driver.advance()
    first = driver.seqs[1]
    assert first in scheduler.awaiting and not first.output_ids and first.stats.cached_tokens > 0
    scheduler.read_at_once = 4096
    seen = []  # at each publish: each follow-up's tokens and whether its prompt is ended
    scheduler.publish = lambda: seen.append([(len(s.output_ids), s.prefill is None) for s in driver.seqs[1:]])
    driver.submit(encode(llm, prompts[2]), method)
    driver.advance()  # the first follow-up's token, the second's admission and token, then both prompts' ends
    assert seen == [[(1, False), (0, False)], [(1, False), (1, False)]]
    assert all(s.prefill is None and s in scheduler.running for s in driver.seqs[1:])
    assert driver.finish() == want
    assert llm.engine.memory().held == (0, 0, 0, 0)


@pytest.mark.parametrize("name, i, params", CASES, ids=IDS)
def test_the_warm_up_runs_every_method_of_the_matrix_and_leaves_nothing(llm, name, i, params):
    """A server may warm up with any method as its default: the warm-up's requests end without an error, and no page,
    cached page, request or method state is left."""
    method = get_method(name, SMALL, **params)
    llm.engine.pool.clear_cache()
    session = llm.new_session(max_num_batched_tokens=96)
    session.warm_up(method, repr(method))
    memory = llm.engine.memory()
    assert (memory.pages_in_use, memory.requests, memory.cached_pages) == (0, 0, 0)
    assert sum(memory.state_bytes.values()) == 0 and not session.scheduler.failed


def test_a_session_keeps_the_graphs_of_idle_methods_it_may_serve_again(llm):
    """A server's session keeps the batch (its decode steps' graphs) of an `idle_graphs` method while no request uses
    it: the next request of that method reuses them and gets the tokens of a fresh run; past IDLE_METHODS idle ones,
    the least recently used goes; a method whose steps read its own buffers (Quest) goes with its last request; a
    kept batch holds no request, no page and no method state, and does not keep the session busy."""
    from semkv.llm import IDLE_METHODS

    ids = encode(llm, PROMPTS[0])
    want = llm.generate([ids], "full", max_new_tokens=NEW, ignore_eos=True)[0].token_ids
    driver = Driver(llm, max_num_batched_tokens=64)
    scheduler = driver.session.scheduler
    full = get_method("full")
    driver.submit(ids, full)
    driver.finish()
    (kept,) = scheduler.batches.values()  # on CUDA it holds the graphs (`Batch.graphs`; none on the CPU)
    assert not scheduler.busy and not kept.running
    assert llm.engine.memory().held == (0, 0, 0, 0) and llm.engine.pool.in_use == 0
    driver.submit(ids, full)  # the same method key: the same bound method, batch and graphs
    assert driver.finish()[-1] == want and scheduler.batches[id(kept.method)] is kept
    others = [get_method("snapkv", 64), get_method("chunkkv", 64), get_method("quest", 64)]
    for method in others:
        driver.submit(ids, method)
        driver.finish()
    kept_methods = {batch.method.name for batch in scheduler.batches.values()}
    assert kept_methods == {"snapkv", "chunkkv"} and IDLE_METHODS == 2  # Full KV, the oldest, went; Quest at once
    assert set(driver.session.bound) == set(driver.session.idle) == {repr(m) for m in others[:2]}
    assert llm.engine.memory().held == (0, 0, 0, 0) and llm.engine.pool.in_use == 0


def test_prefix_cache_counts_holders_by_page_and_evicts_tails_first():
    """The cache's counts (numpy arrays by page and block id) through two requests holding a prompt's blocks, one
    layer given back early (as `unshare` does), and eviction: idle blocks go least recently used first, a prompt's
    tail before its head, and their ids are reused."""
    cache = PrefixCache(3)
    keys = [b"a", b"b", b"c"]
    pages = np.array([[10, 20, 30], [11, 21, 31], [12, 22, 32]])  # [blocks, layers]
    lru = lambda: copy.deepcopy(cache).evict(cache.evictable)  # noqa: E731  idle blocks' pages, in eviction order
    assert cache.add(keys, pages, held=True) == 3 and cache.add(keys[:1], pages[:1], held=True) == 0
    assert cache.cached_mask(np.array([21, 13, 5000])).tolist() == [True, False, False]
    woken, taken = cache.take(cache.match([[b"a"], [b"b", b"x"]]))
    assert woken == 0 and np.array_equal(taken, pages[:2])  # a second holder: no page was idle
    assert cache.unref([9, 30, 31]) == ([9], 0)  # the second holder's layer 2 given back early: still held
    for layer, idled in enumerate([1, 1, 3]):  # the first holder gives back every layer, tail first
        assert cache.unref(pages[::-1, layer].tolist()) == ([], idled)
    assert cache.evictable == 3 and lru() == [12, 22, 32]  # "a" and "b" are held by the second request
    assert cache.unref([11, 10]) == ([], 2) and cache.unref([21, 20]) == ([], 2)
    assert lru() == [12, 22, 32, 11, 21, 31, 10, 20, 30] and cache.evictable == 9  # tail first
    assert cache.take(cache.match([[b"a"]]))[0] == 3 and lru() == [12, 22, 32, 11, 21, 31] and cache.evictable == 6
    assert cache.evict(4) == [12, 22, 32, 11, 21, 31] and set(cache.blocks) == {b"a"}
    assert not cache.cached_mask(np.array([12]))[0]
    assert cache.add([b"d"], np.array([[40, 41, 42]]), held=False) == 1 and cache.blocks[b"d"].id in (1, 2)
    assert cache.take([cache.blocks[b"d"]])[1].tolist() == [[40, 41, 42]]  # a reused id holds its new pages
    assert cache.unref([40, 41, 42]) == ([], 3)
    assert lru() == [40, 41, 42] and cache.clear() == [40, 41, 42]


def test_a_new_prompt_hashes_its_pages_as_its_prefill_computes_them(llm):
    """A prompt's page keys are the chained keys of all its pages (`block_keys`) however they are hashed: a run at a
    time, or taken from a recent prompt that starts with the same tokens; a new prompt's admission hashes one run of
    them (its first page misses), its prefill the pages it computed; a follow-up on the same document takes the first
    prompt's keys and finds the pages it cached, and nothing stays held."""
    ids = list(range(1000, 1000 + 16 * 150 + 5))
    keys = PromptKeys(ids, 16)
    assert keys.first(3) == block_keys(ids, 16, 3) and keys.first(200) == block_keys(ids, 16, 150)
    assert sum(PromptKeys(ids, 16).runs(500), []) == keys.keys and keys.count == 150
    follow = ids[:16 * 100 + 7] + [5] * 300  # the same first 100 pages and 7 tokens
    shared = PromptKeys(follow, 16, like=[PromptKeys(ids[:50], 16), keys])  # the longest shared run, not hashed
    assert shared.keys == keys.keys[:100] and shared.first(200) == block_keys(follow, 16, len(follow) // 16)
    assert PromptKeys([7] + ids[1:], 16, like=[keys]).keys == []  # different from the first token
    full = get_method("full")
    llm.reset_prefix_cache()  # no recent prompt of another test to share keys with
    document = encode(llm, " ".join(CONTEXTS) * 6)  # more pages than a run
    assert len(document) // 16 > PromptKeys.RUN
    driver = Driver(llm, max_num_batched_tokens=64)
    driver.submit(document + encode(llm, QUESTIONS[0]), full, new=4)
    driver.advance()  # the first 64 tokens: 4 pages
    first = driver.seqs[0]
    assert len(first.block_keys.keys) == PromptKeys.RUN < first.block_keys.count
    driver.finish()
    assert set(llm.engine.pool.cache.blocks) == set(block_keys(first.prompt_ids, 16, len(first.prompt_ids) // 16))
    driver.submit(document + encode(llm, QUESTIONS[1]), full, new=4)
    driver.finish()
    follow = llm.engine.pool.cache.recent[-1]  # the follow-up's keys: the first prompt's for the document's pages
    pages = len(document) // 16
    assert follow.tokens.tolist() == driver.seqs[1].prompt_ids
    assert follow.keys[:pages] == block_keys(first.prompt_ids, 16, pages)
    assert driver.seqs[1].stats.cached_tokens == len(document) // 16 * 16
    assert llm.engine.memory().held == (0, 0, 0, 0)


@pytest.mark.parametrize("how", ["cancel", "preempt"])
def test_a_request_awaiting_its_first_token_may_be_cancelled_or_preempted(llm, how):
    """The step after a prompt's prefill reads its first token (`Scheduler.awaiting` until then): cancelled there it
    ends with no token and frees everything; preempted there it is recomputed and ends with the tokens it would have
    had; the other request is unaffected."""
    full = get_method("full")
    want = alone(llm, full, PROMPTS[:2], 6)
    driver = Driver(llm, max_num_batched_tokens=64, enable_prefix_caching=False)
    driver.submit(encode(llm, PROMPTS[0]), full, new=6)
    driver.submit(encode(llm, PROMPTS[1]), full, new=6)
    scheduler = driver.session.scheduler
    while not scheduler.awaiting:
        driver.advance()
    seq = next(iter(scheduler.awaiting))
    assert not seq.output_ids and seq not in scheduler.running and seq not in scheduler.prefilling
    if how == "cancel":
        driver.session.cancel(seq.seq_id)
    else:
        scheduler._preempt(seq)  # as `_make_room` does when a decode step's pages are missing
    outputs = driver.finish()
    other = driver.seqs[1 - driver.seqs.index(seq)]
    assert other.output_ids == want[driver.seqs.index(other)]
    if how == "cancel":
        assert seq.finish_reason == "cancelled" and seq.output_ids == []
    else:
        assert outputs == want and scheduler.counters.preemptions == 1
    assert not scheduler.awaiting and llm.engine.memory().held == (0, 0, 0, 0)


@pytest.mark.parametrize("how", ["cancel", "preempt"])
def test_a_follow_up_awaiting_its_first_token_and_its_prompts_end_may_be_cancelled_or_preempted(llm, how):
    """A follow-up question on a cached document under SnapKV, after its packed forward: it awaits its first token
    with its prompt not yet ended (its layers not yet compacted, every page still held: `Engine.end_prompt` comes
    after the token). Cancelled there it ends with no token; preempted there it is recomputed and ends with the tokens
    of a run without the cache; either way nothing is held after."""
    method = get_method("snapkv", SMALL)
    driver, prompts, want = cached_document(llm, method)
    driver.submit(encode(llm, prompts[1]), method)
    scheduler, follow_up = driver.session.scheduler, driver.seqs[1]
    driver.advance()
    assert follow_up in scheduler.awaiting and follow_up.prefill is not None and not follow_up.output_ids
    assert follow_up.stats.cached_tokens > 0 and follow_up.prefill.windows is not None
    if how == "cancel":
        driver.session.cancel(follow_up.seq_id)
    else:
        scheduler._preempt(follow_up)  # as `_make_room` does when a decode step's pages are missing
    outputs = driver.finish()
    if how == "cancel":
        assert follow_up.finish_reason == "cancelled" and follow_up.output_ids == []
    else:
        assert outputs == want and scheduler.counters.preemptions == 1
    assert not scheduler.awaiting and llm.engine.memory().held == (0, 0, 0, 0)


def test_cached_pages_are_evicted_when_the_pool_needs_them(tiny_model_dir):
    """On a pool of fixed size, finished requests leave their prompt pages cached (idle, counted as available); a
    request that needs more than the free pages evicts the least recently used ones and runs."""
    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=48, num_pages=40)
    pool, full = llm.engine.pool, get_method("full")
    driver = Driver(llm, max_num_batched_tokens=64)
    for context in [*CONTEXTS, CONTEXTS[0]]:  # the first one again: used most recently
        driver.submit(encode(llm, context), full, new=4)
        driver.finish()
        assert pool.in_use == 0 and pool.cached_pages > 0
    assert driver.seqs[-1].stats.cached_tokens > 0
    cached, blocks = pool.cached_pages, set(pool.cache.blocks)
    assert pool.free_pages < 3 * -(-len(encode(llm, CONTEXTS[0] * 2)) // 16)  # more than the free pages
    driver.submit(encode(llm, CONTEXTS[0] * 2 + " Another question?"), full, new=4)
    driver.finish()
    assert pool.in_use == 0 and pool.touched == pool.num_pages
    assert not blocks <= set(pool.cache.blocks)  # older blocks went
    assert driver.seqs[-1].stats.cached_tokens > 0  # the first context's blocks, used most recently, stayed
    assert pool.cached_pages <= cached + 3 * len(encode(llm, CONTEXTS[0] * 2)) // 16


@pytest.mark.parametrize("num_pages", [3000, None], ids=["fixed", "growing"])
def test_follow_ups_find_documents_compacted_together_cached(tiny_model_dir, num_pages):
    """ChunkKV on three documents prefilled in the same steps: each request keeps only its compacted pages and its
    document's pages go to the cache idle; in a pool of fixed size (`num_pages`, `semkv serve --num-pages`) with room
    for them, and in the CPU's growing pool (it grows rather than evict them: `KVPool.keep_cached`), every follow-up
    question finds its document's whole pages cached and gives the tokens of a miss."""
    method = get_method("chunkkv", SMALL)
    documents = [context * 4 for context in CONTEXTS]
    firsts, follow_ups = ([f"{document}\n\n{q}" for document in documents] for q in QUESTIONS[:2])
    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=48, num_pages=num_pages)
    want = alone(llm, method, follow_ups)
    llm.engine.pool.clear_cache()
    driver = Driver(llm, max_num_batched_tokens=4096)
    for prompt in firsts:
        driver.submit(encode(llm, prompt), method)
    driver.finish()
    for prompt in follow_ups:
        driver.submit(encode(llm, prompt), method)
    assert driver.finish()[len(firsts):] == want
    page, window = llm.engine.pool.page_size, max(method.bound(llm.config, llm.tokenizer, 16).window_size(), 1)
    for seq, document in zip(driver.seqs[len(firsts):], documents):
        blocks = min(len(encode(llm, document)), len(seq.prompt_ids) - window) // page
        assert blocks > 2 and seq.stats.cached_tokens == blocks * page
    assert llm.engine.memory().held == (0, 0, 0, 0)


@pytest.mark.parametrize("name, params", [("full", {}), ("quest", {}), ("tokenselect", {}), ("dynsplit", {}),
                                          ("sentencekv", dict(offload=True)), ("chess", {}), ("infllm", {}),
                                          ("snapkv", {})])
def test_a_preempted_request_ends_with_the_tokens_it_would_have_had(tiny_model_dir, name, params):
    """Three requests that the pool holds at admission but not to their end: the newest is preempted (pages and
    state freed), recomputed (prompt prefilled again, its output fed back) and ends with the tokens of a run alone,
    as do the others; nothing is left held."""
    method = get_method(name, SMALL, **params)
    new = 40
    big = semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=48)
    want = alone(big, method, PROMPTS, new)
    prompt_pages = sum(3 * -(-len(encode(big, p)) // 16) for p in PROMPTS)
    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=48, num_pages=prompt_pages + 8)
    driver = Driver(llm, max_num_batched_tokens=64, enable_prefix_caching=False)
    for prompt in PROMPTS:
        driver.submit(encode(llm, prompt), method, new)
    assert driver.finish() == want
    full_kv = method.bound(llm.config, llm.tokenizer, 16).device_tokens(100, new, 16) is None
    assert driver.session.scheduler.counters.preemptions >= (1 if full_kv else 0)
    assert llm.engine.memory().held == (0, 0, 0, 0)


def test_a_request_that_does_not_fit_now_does_not_hold_the_queue(tiny_model_dir):
    """A long request waiting for pages lets shorter ones behind it start (at most `BYPASS` of them), then runs."""
    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=48, num_pages=70)
    full = get_method("full")
    driver = Driver(llm, max_num_batched_tokens=64, enable_prefix_caching=False)
    driver.submit(encode(llm, CONTEXTS[1] * 2), full, new=32)  # holds most of the pool
    driver.advance()
    driver.submit(encode(llm, CONTEXTS[0] * 3), full, new=8)  # cannot fit beside it
    driver.submit(encode(llm, QUESTIONS[2]), full, new=8)  # can
    driver.advance()
    scheduler = driver.session.scheduler
    assert driver.seqs[1] in scheduler.waiting and driver.seqs[2] not in scheduler.waiting
    outputs = driver.finish()
    assert all(len(o) == n for o, n in zip(outputs, (32, 8, 8)))
    assert llm.engine.memory().held == (0, 0, 0, 0)


def test_a_step_keeps_to_its_budget_while_requests_decode_and_takes_the_engine_chunk_when_none_does(llm):
    """Budget 16, engine chunk 48: every step in which a request decodes computes at most 16 tokens; a step in
    which none does prefills up to 48 (the budget bounds the wait between a running request's tokens), so the first
    prompt starts in fewer steps than 16 a step would take; the tokens are those of whole prompts."""
    full = get_method("full")
    prompts = PROMPTS[:3]
    want = alone(llm, full, prompts, 8)
    driver = Driver(llm, max_num_batched_tokens=16, enable_prefix_caching=False)
    for prompt in prompts:
        driver.submit(encode(llm, prompt), full, new=8)
    scheduler, idle, busy = driver.session.scheduler, [], []
    while scheduler.busy:
        decoding = len(scheduler.running) + len(scheduler.awaiting)  # those awaiting their first token decode next
        driver.advance()
        (busy if decoding else idle).append(scheduler.counters.step_tokens)
    assert [s.output_ids for s in driver.seqs] == want
    first = len(encode(llm, prompts[0]))
    assert busy and max(busy) <= 16
    assert idle and max(idle) == 48 and len(idle) == -(-first // 48) < -(-first // 16)
    assert llm.engine.memory().held == (0, 0, 0, 0)


def multiply_adds(config, start: int, tokens: int) -> int:
    """A prompt chunk's multiply-adds a layer: each token's projections and MLP, and its q . k and p . v with every
    key up to itself."""
    heads, kv_heads = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden = config.hidden_size
    dense = hidden * (2 * heads + 2 * kv_heads) + 3 * hidden * config.intermediate_size
    return tokens * dense + 2 * heads * sum(start + i + 1 for i in range(tokens))


@pytest.mark.parametrize("name, params", [("full", {}), ("chunkkv", dict(neighbours=3)), ("chess", {})])
@pytest.mark.parametrize("dynamic", [True, False])
def test_dynamic_chunking_cuts_a_long_prompts_later_chunks_to_the_cost_of_its_first(tiny_model_dir, name, params,
                                                                                     dynamic):
    """Budget 32 while a request decodes, a prompt of about 500 tokens arriving (the engine's chunk, 512 tokens, cuts
    it nowhere): with dynamic chunking every chunk of it costs (multiply-adds, its attention to the keys before it
    counted) at most what 32 tokens at a prompt's start do, less the decoding row's dense work, so its chunks shrink
    as its prefix grows (to under half the first one's at 450 tokens on this model); without it every chunk is 31
    tokens. The tokens are those of whole prompts either way."""
    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu")
    method = get_method(name, 0.5, **params)
    prompts = [CONTEXTS[1] * 5 + "\n\n" + QUESTIONS[1], CONTEXTS[0] * 5 + "\n\n" + QUESTIONS[0]]
    want = alone(llm, method, prompts, 80)
    driver = Driver(llm, max_num_batched_tokens=32, enable_prefix_caching=False, dynamic_chunking=dynamic)
    driver.submit(encode(llm, prompts[0]), method, new=80)
    while not driver.seqs[0].output_ids:
        driver.advance()
    driver.submit(encode(llm, prompts[1]), method, new=80)
    long, chunks = driver.seqs[1], []
    while not long.output_ids:
        start = long.num_computed
        decoding = not driver.seqs[0].finished
        driver.advance()
        if decoding and long.num_computed > start:
            chunks.append((start, long.num_computed - start))
    assert driver.finish() == want
    assert llm.engine.memory().held == (0, 0, 0, 0)
    config = llm.config
    full_chunks = [tokens for start, tokens in chunks[:-1]]  # (the last one is what the prompt had left)
    assert len(full_chunks) >= 10 and chunks[-1][0] + chunks[-1][1] > 400
    if not dynamic:
        assert set(full_chunks) == {31}
        return
    cap = multiply_adds(config, 0, 32) - multiply_adds(config, 0, 1) + 2 * config.num_heads * config.head_dim
    assert all(multiply_adds(config, start, tokens) <= cap < multiply_adds(config, start, tokens + 1)
               for start, tokens in chunks[:-1])
    assert full_chunks[0] == 31 and full_chunks == sorted(full_chunks, reverse=True) and full_chunks[-1] <= 15


def test_chunk_tokens_is_the_most_tokens_within_a_cost(llm):
    with pytest.raises(SemkvError, match="give max_num_batched_tokens"):
        llm.new_session(dynamic_chunking=True)
    for weight in (1.2e-4, 3.8e-5, 3.5e-3):
        for start in (0, 1, 4_095, 31_000):
            for cost in (1.0, 37.5, 4_096.0, 1e5):
                tokens = chunk_tokens(start, cost, weight)
                assert chunk_cost(start, tokens, weight) <= cost < chunk_cost(start, tokens + 1, weight)


def test_a_prompt_asking_one_token_does_not_cut_the_next_step_to_the_budget(llm):
    """Budget 16, engine chunk 48, prompts of one new token each (a server's prefill-only load): a prompt awaiting
    its first token will not decode, so the step after its prefill still prefills up to 48 tokens of the next one;
    the tokens are those of whole prompts."""
    full = get_method("full")
    want = alone(llm, full, PROMPTS, 1)
    driver = Driver(llm, max_num_batched_tokens=16, enable_prefix_caching=False)
    for prompt in PROMPTS:
        driver.submit(encode(llm, prompt), full, new=1)
    scheduler, after_a_prompt = driver.session.scheduler, []
    while scheduler.busy:
        awaiting = bool(scheduler.awaiting)
        driver.advance()
        if awaiting and scheduler.counters.step_tokens:
            after_a_prompt.append(scheduler.counters.step_tokens)
    assert [s.output_ids for s in driver.seqs] == want
    assert after_a_prompt and max(after_a_prompt) == 48


def test_a_decode_step_ends_after_the_running_prompts_chunks_are_queued_and_before_admissions(llm, monkeypatch):
    """In a step with decoding requests, a prompt being prefilled and new ones waiting: the decode step is launched,
    the running prompt's chunk queued, then the decode step's tokens read (on a GPU the device runs the chunk
    meanwhile), then new prompts admitted (after the requests that finished are released); the tokens are those of
    whole prompts."""
    full = get_method("full")
    prompts = [p * 2 for p in PROMPTS]  # long enough for a prompt to be prefilled while another decodes
    want = alone(llm, full, prompts, 6)
    engine, calls = llm.engine, []

    def recorded(name):
        inner = getattr(engine, name)

        def call(*args, **kwargs):
            seqs = args[0] if name == "prefill_together" else [args[0]] if name.endswith("_prefill") else []
            calls.append((name, {seq.seq_id for seq in seqs}))
            return inner(*args, **kwargs)
        return call

    for name in ("launch_step", "complete_step", "continue_prefill", "prefill_together", "start_prefill"):
        monkeypatch.setattr(engine, name, recorded(name))
    driver = Driver(llm, max_num_batched_tokens=16, max_num_seqs=2, enable_prefix_caching=False)
    for prompt in prompts:
        driver.submit(encode(llm, prompt), full, new=6)
    scheduler, overlapped = driver.session.scheduler, 0
    while scheduler.busy:
        calls.clear()
        prefilling = {seq.seq_id for seq in scheduler.prefilling}
        driver.advance()
        names = [name for name, _ in calls]
        if "launch_step" not in names:
            continue
        complete = names.index("complete_step")
        assert names.index("launch_step") < complete
        chunks = [i for i, (name, seqs) in enumerate(calls)
                  if name in ("continue_prefill", "prefill_together") and seqs & prefilling]
        assert all(i < complete for i in chunks)  # the running prompts' chunks before the decode step's end
        assert all(i > complete for i, (name, _) in enumerate(calls) if name == "start_prefill")  # admissions after
        overlapped += bool(chunks)
    assert overlapped >= 3
    assert [s.output_ids for s in driver.seqs] == want
    assert engine.memory().held == (0, 0, 0, 0)



def arriving_together(llm, method, prompts: list[str], monkeypatch) -> tuple[list[list[int]], list[int]]:
    """The first prompt, then the others submitted together once it decodes (steps of 256 tokens, prefix caching
    on): every request's tokens, and how many prompts each `Engine.prefill_together` call ran."""
    packs = []
    together = llm.engine.prefill_together
    monkeypatch.setattr(llm.engine, "prefill_together", lambda seqs: packs.append(len(seqs)) or together(seqs))
    driver = Driver(llm, max_num_batched_tokens=256)
    driver.submit(encode(llm, prompts[0]), method)
    while not driver.seqs[0].output_ids:
        driver.advance()
    for prompt in prompts[1:]:
        driver.submit(encode(llm, prompt), method)
    return driver.finish(), packs


@pytest.mark.parametrize("name, i, params", [("full", 0, {})] + CASES, ids=["full"] + IDS)
def test_prompts_arriving_together_share_one_forward_with_the_tokens_of_each_alone(llm, name, i, params, monkeypatch):
    """Two follow-up questions on a cached document and a short new prompt, submitted while the document's first
    question decodes: the chunks whose methods need nothing but attention of them (`Engine.prefill_span`) run in one
    forward (`Engine.prefill_together`), each attending over its own pages; every request gets the greedy tokens it
    has alone, and nothing is held after."""
    method = get_method(name, SMALL, **params)
    prompts = [f"{CONTEXTS[0] * 2}\n\n{q}" for q in QUESTIONS] + [QUESTIONS[1]]
    want = alone(llm, method, prompts)
    llm.engine.pool.clear_cache()
    tokens, packs = arriving_together(llm, method, prompts, monkeypatch)
    assert tokens == want
    # the prompts packed: both follow-ups and the new prompt, or the follow-ups where the new prompt (one chunk)
    # evicts layer by layer; none where the prefill needs log-sum-exps (H2O) or a sparse context (TokenSelect)
    assert max(packs, default=0) == {"full": 3, "quest": 3, "chess": 2, "snapkv": 2, "chunkkv": 2}.get(name, 0) or (
        name not in ("full", "quest", "chess", "snapkv", "chunkkv", "h2o", "tokenselect"))
    assert llm.engine.memory().held == (0, 0, 0, 0)


@pytest.mark.parametrize("name", ["full", "chunkkv"])
def test_prompts_packed_through_the_prefill_graph_pieces_give_the_tokens_of_each_alone(tiny_model_dir, name,
                                                                                       monkeypatch):
    """The packed forward through the prefill's piecewise graphs (`PrefillGraphs`, run eagerly here over the static
    buffers, padding rows included), which read each chunk's last row for its logits: the tokens of each alone."""
    from semkv.engine.cuda_graph import PrefillGraphs

    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=48)
    graphs = llm.engine.prefill_graphs = PrefillGraphs(llm.engine)
    method = get_method(name, SMALL)
    prompts = [f"{CONTEXTS[1] * 2}\n\n{q}" for q in QUESTIONS]
    want = alone(llm, method, prompts)
    tokens, packs = arriving_together(llm, method, prompts, monkeypatch)
    assert tokens == want and [n for n in packs if n > 1] == [2] and graphs.hidden.abs().sum() > 0
    assert llm.engine.memory().held == (0, 0, 0, 0)


def test_a_compaction_whose_new_pages_grow_the_pool_writes_into_the_grown_pool():
    """A follow-up compacting shared pages takes new pages for what it keeps; when the pool has none left it grows
    (new tensors), and the kept keys, values and positions land in the grown pool: every layer reads back its kept
    slots, the first sequence's cached pages unchanged."""
    import torch

    from semkv.engine.kv_cache import KVPool, SeqKV

    layers, pages, size = 3, 6, 4
    pool = KVPool(layers, 1, 2, size, torch.float32, torch.device("cpu"), num_pages=layers * pages + 1)
    pool.cache = PrefixCache(layers)
    first = SeqKV(pool)
    first.ensure_all({layer: pages * size for layer in range(layers)})
    for layer in range(layers):
        slots = torch.arange(pages * size)
        values = (slots + 100 * layer).float()[:, None, None].expand(-1, 1, 2)
        first.write(layer, slots, values, -values, slots)
        first.num_slots[layer] = pages * size
    keys = block_keys(np.arange(pages * size), size, pages)
    pool.cache.add(keys, first.pages[:, :pages].T, held=True)
    follow_up = SeqKV(pool)
    follow_up.share(pool.cache.match([keys]))
    assert pool.num_pages == layers * pages + 1  # full: the kept pages must come from a grown pool
    keep = torch.tensor([[1, 2, 5, 9, 10, 17, 22]])
    follow_up.compact({layer: keep for layer in range(layers)})
    assert pool.num_pages > layers * pages + 1
    for layer in range(layers):
        k, v, pos = follow_up.gather(layer, follow_up.all_slots(layer))
        assert k[0, :, 0].tolist() == (keep[0] + 100 * layer).float().tolist() and torch.equal(v, -k)
        assert pos[0].tolist() == keep[0].tolist()
        cached = first.gather(layer, first.all_slots(layer))[0][0, :, 0]
        assert cached.tolist() == list(range(100 * layer, 100 * layer + pages * size))


def test_a_growing_pool_evicts_cached_pages_only_once_it_holds_keep_cached_pages():
    """A pool that grows (the CPU's: `KVPool.keep_cached` from the host memory) grows rather than evict idle cached
    blocks while it holds fewer than `keep_cached` pages; at that size it evicts them, least recently used first,
    before it grows."""
    import torch

    from semkv.engine.kv_cache import KVPool

    layers = 2
    pool = KVPool(layers, 1, 2, 4, torch.float32, torch.device("cpu"), num_pages=16)
    pool.cache = PrefixCache(layers)
    for i in range(6):  # six blocks cached and idle: 12 of the 15 pages after the scratch page
        pages = pool.allocate(layers)
        pool.cache.add([bytes([i])], np.array([pages]), held=True)
        pool.release(pages)
    assert pool.cached_pages == 12 and pool.num_pages - pool.touched == 3
    pool.keep_cached = 64
    held = pool.allocate(10)  # 7 more than the untouched pages: below 64 pages, the pool grows
    assert len(pool.cache.blocks) == 6 and pool.num_pages > 16
    pool.keep_cached = pool.num_pages
    held += pool.allocate(pool.num_pages - pool.touched + 4)  # 4 past the untouched: two blocks, the oldest, go
    assert set(pool.cache.blocks) == {bytes([i]) for i in range(2, 6)} and pool.num_pages == pool.keep_cached
    pool.release(held)
    assert pool.in_use == 0


def test_prefix_cache_keeps_its_eviction_order_through_many_takes():
    """The LRU order survives blocks taken and given back many times (each leaving a stale entry behind, which is
    skipped, and dropped when they outgrow the blocks): eviction takes the idle blocks least recently given back
    first, and the stale entries stay bounded."""
    cache = PrefixCache(2)
    keys = [bytes([i]) for i in range(4)]
    cache.add(keys, np.arange(8).reshape(4, 2) + 10, held=False)  # idle in the order 0, 1, 2, 3
    for turn in range(3000):  # block 0 or 1 taken and given back: the most recently used each time
        block = cache.blocks[keys[turn % 2]]
        cache.take([block])
        cache.unref(cache.pages[block.id].tolist())
    assert cache._queued <= 2 * len(cache.by_id) + 1024 + 1
    assert cache.evict(3) == [14, 15, 16, 17] and cache.evict(8) == [10, 11, 12, 13] and cache.evictable == 0


def test_a_follow_up_keeps_its_host_page_table_equal_to_the_device_one():
    """`SeqKV.pages` (numpy, what the host moves pages with) stays the device table through a follow-up's life: the
    cached document shared, its question's pages taken, the layers compacted to different budgets (its protected
    pages set aside, cached ones losing this holder), a layer truncated, every page released; then no page is in use
    and every cached block is idle again."""
    import torch

    from semkv.engine.kv_cache import KVPool, SeqKV

    layers, pages, size = 3, 6, 4
    pool = KVPool(layers, 1, 2, size, torch.float32, torch.device("cpu"), num_pages=4 * layers * pages)
    pool.cache = PrefixCache(layers)
    first = SeqKV(pool)
    first.ensure_all({layer: pages * size for layer in range(layers)})
    keys = block_keys(np.arange(pages * size), size, pages)
    pool.cache.add(keys, first.pages[:, :pages].T, held=True)
    first.release()
    assert pool.in_use == 0 and pool.cache.evictable == layers * pages

    def same_tables(kv):
        for layer in range(layers):
            count = kv.page_count[layer]
            assert kv.table[layer, :count].tolist() == kv.layer_pages(layer).tolist()
        assert kv.widest == kv.page_count.max() and kv.held_pages == kv.page_count.sum() + sum(map(len, kv.aside))

    follow_up = SeqKV(pool)
    follow_up.share(pool.cache.match([keys]))
    document = [follow_up.layer_pages(layer).tolist() for layer in range(layers)]
    follow_up.protect = pages + 1  # the question fills one more page
    follow_up.ensure_all({layer: (pages + 1) * size + 2 for layer in range(layers)})
    same_tables(follow_up)
    assert pool.in_use == layers * (pages + 2) and pool.cache.evictable == 0
    question = [follow_up.layer_pages(layer)[pages:].tolist() for layer in range(layers)]
    kept = {0: 7, 1: 11, 2: 3}
    follow_up.compact({layer: torch.arange(n)[None] * 2 for layer, n in kept.items()})
    same_tables(follow_up)
    for layer, n in kept.items():
        assert follow_up.page_count[layer] == -(-n // size) and follow_up.num_slots[layer] == n
        assert follow_up.aside[layer].tolist() == document[layer] + question[layer][:1]  # the protected pages
        assert not set(follow_up.layer_pages(layer).tolist()) & set(document[layer] + question[layer])
    follow_up.truncate(1, 4)
    same_tables(follow_up)
    assert follow_up.page_count.tolist() == [2, 1, 1]
    follow_up.release()
    assert pool.in_use == 0 and pool.cache.evictable == layers * pages and follow_up.held_pages == 0
