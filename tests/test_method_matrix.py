"""The shared test matrix: every method, in an easy and hard configurations, through the same invariants.

Every registered method joins with its defaults (its "easy" case); MATRIX adds "hard" configurations where they are
written (an opt-in mode that another hard configuration cannot combine with gets its own). Invariants, on a tiny
random Llama (3 layers, GQA 4/2):
- with a budget at least the context, greedy output equals Full KV exactly (int and float budgets);
- the budget binds as the method's kind says (attended / resident tokens), and eviction returns pages to the pool;
- output is deterministic, a batch of prompts of different lengths equals one-by-one, and `LLM.compare` (methods
  applied to a shared Full-KV prefill) equals `LLM.generate`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import warnings
import weakref

import pytest
import torch

import semkv
from semkv.engine.engine import LaunchedStep, PrefillPlan, StepRead
from semkv.engine.hooks import Selection, StepPlan
from semkv.engine.kv_cache import SeqKV
from semkv.engine.memory import held_bytes
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.engine.step import DecodeStep, PrefillStep, StepInputs
from semkv.methods import METHODS, KVMethod, get_method

MATRIX: dict[str, dict | list[dict]] = {  # the hard configuration(s) of each method
    "streaming_llm": dict(n_sink=1),
    "snapkv": dict(window=8, kernel_size=1, pooling="max", query_aware=False),
    "quest": dict(group_reduce="max"),
    "h2o": dict(recent_ratio=0.2),
    "pyramidkv": dict(window=8, beta=2, query_aware=False),
    "keydiff": dict(window=4, query_aware=False),
    "infllm": dict(n_sink=2, block_size=4, n_repr=2, per_head=True),
    "chunkkv": dict(window=8, chunk_size=3, reuse_layers=2, per_head=True, query_aware=False, neighbours=1),
    "sentencekv": [dict(keep_factor=1.0, query="current", buckets="chunks", offload=True, retain="sentences",
                        cache_factor=1.5),
                   dict(keep_factor=1.5, score="tokens", retain="sentences"),
                   dict(keep_factor=1.0, query="current", score="tokens", retain="sentences")],  # for lookups
    "dynsplit": [dict(chunk_size=6, max_deviation=3, alpha=1.0, group_reduce="max", n_sink=2, n_recent=1,
                      offload=True, offload_chunk=1, cache_factor=2.0),
                 dict(chunk_size=6, max_deviation=3, score="tokens", group_reduce="max", n_sink=2),
                 dict(chunk_size=6, max_deviation=3, score="tokens", score_keys="channels", channels=4, n_recent=1),
                 dict(chunk_size=6, max_deviation=3, score="tokens", score_keys="pages", superset=1.0, n_recent=1,
                      reuse_layers=2)],
    "tokenselect": [dict(selection="hard_vote", scope="kv_head", theta=0.5, n_sink=1, prefill="full"),
                    dict(score_keys="pages", superset=1.0, theta=0.5, n_sink=1, prefill="full", reuse_layers=2)],
    "chess": dict(block_size=16, chunk_pages=2, grid_chunks=2, recent_pages=1, preset="aggressive", mode="always"),
}
HARD = {name: hard if isinstance(hard, list) else [hard] for name, hard in MATRIX.items()}
CASES = [(name, i, params) for name in METHODS if name != "full"
         for i, params in enumerate([dict()] + HARD.get(name, []))]
IDS = [f"{name}-{'easy' if i == 0 else 'hard' if i == 1 else f'hard{i}'}" for name, i, _ in CASES]
EVICTING = [(case, case_id) for case, case_id in zip(CASES, IDS)
            if METHODS[case[0]].kind in ("prefill_eviction", "decode_eviction")]  # selection keeps every token

CONTEXTS = [
    "Paged attention stores keys and values in fixed-size pages, and a page table maps positions to pages. " * 4,
    "Long documents are split into sentences. Each sentence has a meaning! Does the model keep it? " * 3,
    "The passkey is 4821. Remember it. " + "Grass is green and the sky is blue. " * 8,
]
QUESTIONS = ["What does the page table do?", "What is kept?", "What is the passkey?"]
NEW = 12
SMALL = 40  # tokens: well under every prompt (about 90-160 tokens)


def run(llm, method, prompts=CONTEXTS, questions=QUESTIONS, **params):
    return llm.generate(prompts, method=method, questions=questions, max_new_tokens=NEW, chat=False,
                        ignore_eos=True, **params)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=48)


@pytest.fixture(scope="module")
def full_tokens(llm):
    return [o.token_ids for o in run(llm, "full")]


def test_every_method_is_in_the_matrix():
    assert {name for name, _, _ in CASES} == set(METHODS) - {"full"}
    assert set(MATRIX) <= set(METHODS)


@pytest.mark.parametrize("name, i, params", CASES, ids=IDS)
@pytest.mark.parametrize("budget", [100_000, 1.0])
def test_full_budget_equals_full_kv(llm, full_tokens, name, i, params, budget):
    outs = run(llm, get_method(name, budget, **params))
    assert [o.token_ids for o in outs] == full_tokens


@pytest.mark.parametrize("name, i, params", CASES, ids=IDS)
@pytest.mark.parametrize("budget", [SMALL, 0.3])
def test_budget_is_respected(llm, name, i, params, budget):
    method = get_method(name, budget, **params)
    for out, context_text, question in zip(run(llm, method), CONTEXTS, QUESTIONS):
        s = out.stats
        context = s.prompt_tokens + NEW - 1  # tokens in the cache at the last decode step
        limit = budget if isinstance(budget, int) else int(-(-budget * context // 1))
        if method.kind == "prefill_eviction":
            # the compressed part is the whole prompt, or the text before the question when query-agnostic
            ids, start = llm.encode(context_text, question, chat=False)
            compressed = len(ids) if method.query_aware else start
            prompt_limit = budget if isinstance(budget, int) else -(-budget * compressed // 1)
            appended = len(ids) - compressed + NEW - 1
            # per-layer schedules (PyramidKV) bind the mean over layers; a layer keeps its own budget
            bound = method.bound(llm.config, llm.tokenizer, llm.engine.pool.page_size)  # as `generate` runs it
            layer_limit = max(bound.layer_budget(layer, compressed) for layer in range(llm.config.num_layers))
            assert s.kv_attended_max <= layer_limit + appended
            assert s.kv_attended_tokens <= prompt_limit + appended
            assert s.kv_resident_tokens <= prompt_limit + appended
        elif method.kind == "decode_eviction":
            assert s.kv_attended_max <= limit
            assert s.kv_resident_tokens <= limit
        else:
            assert method.kind == "selection"
            assert s.kv_attended_max <= limit
        assert s.kv_attended_tokens < s.prompt_tokens  # something was left out


@pytest.mark.parametrize("name, i, params", [case for case, _ in EVICTING], ids=[i for _, i in EVICTING])
def test_eviction_frees_pages(llm, name, i, params):
    method = get_method(name, SMALL, **params)
    pool = llm.engine.pool
    ids, start = llm.encode(CONTEXTS[0] * 3, QUESTIONS[0], chat=False)
    pages = {}
    for m in (get_method("full"), method):
        m.bind(llm.config, llm.tokenizer, pool.page_size)
        seq = Sequence(0, ids, SamplingParams(), SeqKV(pool), start)
        seq.method_state = m.new_state(seq)
        llm.engine.prefill(seq, m)
        pages[m.name] = pool.in_use
        llm.engine.end([seq], m)
    assert pool.in_use == 0
    layers = llm.config.num_layers
    assert pages["full"] >= layers * (len(ids) // pool.page_size)
    compressed = len(ids) if getattr(method, "query_aware", True) else start
    budget_pages = -(-(SMALL + len(ids) - compressed) // pool.page_size)
    assert pages[method.name] <= layers * budget_pages


@pytest.mark.parametrize("name, i, params", CASES, ids=IDS)
def test_deterministic_and_batch_invariant(llm, name, i, params):
    method = get_method(name, SMALL, **params)
    batched = [o.token_ids for o in run(llm, method)]
    assert batched == [o.token_ids for o in run(llm, method)]
    singles = [run(llm, method, prompts=[c], questions=[q])[0].token_ids for c, q in zip(CONTEXTS, QUESTIONS)]
    assert batched == singles


@pytest.mark.parametrize("name, i, params", CASES, ids=IDS)
def test_shared_prefill_equals_own_prefill(llm, name, i, params):
    method = get_method(name, SMALL, **params)
    own = run(llm, method, prompts=CONTEXTS[:1], questions=QUESTIONS[:1])[0]
    shared = llm.compare(CONTEXTS[0], [method], question=QUESTIONS[0], max_new_tokens=NEW, chat=False)[0]
    n = len(shared.token_ids)  # compare() stops at EOS
    assert shared.token_ids == own.token_ids[:n]


# -- nothing grows ----------------------------------------------------------------------------------------------------
def live_tensor_bytes(but: set[int] = frozenset()) -> int:
    """Bytes of every tensor storage alive in the process (what the garbage collector can reach), but the storages
    at the addresses `but`."""
    storages = {}
    with warnings.catch_warnings():  # isinstance on every object wakes deprecated module attributes
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in but:
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def frame_tensors(traceback) -> set[int]:
    """Storage addresses of the tensors the frames of a traceback hold as local variables (logits, token ids...), in
    lists of them or in a step's objects (a prefill chunk's positions and RoPE angles, a decode step's inputs,
    plan and selection, a prompt's prefill plan); not
    what they hold through a method or a request."""
    found, values = set(), []
    while traceback is not None:
        values.extend(traceback.tb_frame.f_locals.values())
        traceback = traceback.tb_next
    while values:
        value = values.pop()
        if isinstance(value, torch.Tensor):
            found.add(value.untyped_storage().data_ptr())
        elif isinstance(value, (list, tuple)):
            values.extend(value)
        elif isinstance(value, (PrefillPlan, PrefillStep, DecodeStep, StepInputs, StepPlan, Selection, LaunchedStep,
                                StepRead)):
            values.extend(vars(value).values())
    return found


@pytest.fixture(scope="module")
def queued_llm(tiny_model_dir):
    """A fixed pool that holds two of the queued requests at once (every one of them needs `NEED` pages)."""
    return semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=48, num_pages=2 * NEED + 2)


QUEUED = 6  # identical requests, run two at a time (more at once where a method holds less on the device)
NEED = 3 * -(-(160 + NEW) // 16)  # pages a request of at most 160 prompt tokens may hold (3 layers, 16-token pages)


@contextlib.contextmanager
def bound_copies():
    """Weak references to every copy of a method bound while inside (`generate` and `compare` bind their own)."""
    refs, bound = [], KVMethod.bound

    def recording(self, *args):
        method = bound(self, *args)
        refs.append(weakref.ref(method))
        return method

    KVMethod.bound = recording
    try:
        yield refs
    finally:
        KVMethod.bound = bound


def serve(llm, method, copies: list) -> list[int]:
    """Continuous batching, a compare (shared and own prefill) and a compare the caller stops after its first method
    (a cancelled request). Returns what the bound copy running the batched requests holds (`held_bytes`) each time
    the engine has released all of its running requests."""
    held = []
    release = llm.engine.release

    def recording(seq):
        live = llm.engine.memory().requests
        release(seq)
        if live and llm.engine.memory().requests == 0 and copies and copies[-1]() is not None:
            held.append(sum(held_bytes([copies[-1]()], llm.engine.device)))

    ids = llm.encode(CONTEXTS[0], QUESTIONS[0], chat=False)[0]
    assert 3 * -(-(len(ids) + NEW) // 16) <= NEED
    # a method that offloads or compresses the prompt holds less (the engine asks a copy bound to the model): three
    # batches of as many as fit
    bound = method.bound(llm.config, llm.tokenizer, 16).device_tokens(len(ids), NEW, 16)
    queued = QUEUED if bound is None else 3 * (1 + (2 * NEED - 3 * -(-len(ids) // 16)) // (3 * -(-bound // 16)))
    llm.engine.release = recording
    try:
        run(llm, method, prompts=[CONTEXTS[0]] * queued, questions=[QUESTIONS[0]] * queued)
    finally:
        del llm.engine.release
    llm.compare(CONTEXTS[1], [method, get_method("full")], question=QUESTIONS[1], max_new_tokens=NEW, chat=False)
    with contextlib.closing(llm.compare_iter(CONTEXTS[2], [get_method("full"), method, method], question=QUESTIONS[2],
                                             max_new_tokens=NEW, chat=False)) as outputs:
        next(outputs)
    return held


@pytest.mark.parametrize("name, i, params", CASES, ids=IDS)
def test_nothing_grows(queued_llm, name, i, params):
    """After a warm-up (caches of fixed size: vocabulary masks, compiled kernels), requests through continuous
    batching, compare and a cancelled compare leave the engine's accounting at zero and no tensor behind; while
    identical requests queue through one run, what the method's bound copy holds is the same each time the running
    ones have been released; every bound copy is freed by reference counting alone (no cycle keeps its buffers until
    the garbage collector runs)."""
    method = get_method(name, SMALL, **params)
    with bound_copies() as copies:
        serve(queued_llm, method, copies)
    gc.collect()
    baseline = live_tensor_bytes()
    gc.disable()
    try:
        with bound_copies() as copies:
            held = serve(queued_llm, method, copies)
        assert copies and all(copy() is None for copy in copies)
    finally:
        gc.enable()
    assert queued_llm.engine.memory().held == (0, 0, 0, 0)
    assert live_tensor_bytes() == baseline
    assert queued_llm.engine.pool.peak_in_use <= 2 * NEED  # the requests did queue
    # each time the batch emptied (twice at least where requests run in waves of two; where a method holds less, the
    # queued ones join as room frees and the batch may empty only at the end), the bound copy held the same
    assert held and len(set(held)) == 1


class Failure(RuntimeError):
    pass


def failing(method: KVMethod, hook: str, calls: int) -> KVMethod:
    """The method, failing at the given call of one of its hooks."""
    count = itertools.count(1)

    def fail(self, *args):
        if next(count) == calls:
            raise Failure(f"{hook} call {calls}")
        return getattr(type(method), hook)(self, *args)

    cls = type(f"Failing{type(method).__name__}", (type(method),), {hook: fail})
    return dataclasses.replace(cls(budget=method.budget), **{f.name: getattr(method, f.name)
                                                            for f in dataclasses.fields(method) if f.init})


@pytest.mark.parametrize("name, i, params", CASES, ids=IDS)
@pytest.mark.parametrize("hook, calls", [("finish_prefill", 2), ("end_step", 3)], ids=["prefill", "decode"])
def test_a_failing_request_leaves_nothing_behind(queued_llm, name, i, params, hook, calls):
    """A method that raises inside a request (the second prefill, while the first request runs; the third decode
    step) frees every request of the run, pages and method state, while the exception, and the traceback that
    refers to the method and its requests, is still held (only the frames' own tensor variables stay); the engine
    then serves the next requests with the same tokens as before."""
    method = get_method(name, SMALL, **params)
    want = [o.token_ids for o in run(queued_llm, method)]
    gc.collect()
    baseline = live_tensor_bytes()
    with pytest.raises(Failure) as failure:
        run(queued_llm, failing(method, hook, calls))
    assert queued_llm.engine.memory().held == (0, 0, 0, 0)
    assert live_tensor_bytes(but=frame_tensors(failure.value.__traceback__)) == baseline
    assert [o.token_ids for o in run(queued_llm, method)] == want
