"""The shared test matrix: every method, in an easy and a hard configuration, through the same invariants.

Every registered method joins with its defaults (its "easy" case); MATRIX adds a "hard" configuration where one is
written. Invariants, on a tiny random Llama (3 layers, GQA 4/2):
- with a budget at least the context, greedy output equals Full KV exactly (int and float budgets);
- the budget binds as the method's kind says (attended / resident tokens), and eviction returns pages to the pool;
- output is deterministic, a batch of prompts of different lengths equals one-by-one, and `LLM.compare` (methods
  applied to a shared Full-KV prefill) equals `LLM.generate`.
"""
from __future__ import annotations

import pytest

import semkv
from semkv.engine.kv_cache import SeqKV
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.methods import METHODS, get_method

MATRIX: dict[str, dict] = {  # the hard configuration of each method
    "streaming_llm": dict(n_sink=1),
    "snapkv": dict(window=8, kernel_size=1, pooling="max", query_aware=False),
    "quest": dict(group_reduce="max"),
    "h2o": dict(recent_ratio=0.2),
    "pyramidkv": dict(window=8, beta=2, query_aware=False),
    "keydiff": dict(window=4, query_aware=False),
    "infllm": dict(n_sink=2, block_size=4, n_repr=2, per_head=True),
    "chunkkv": dict(window=8, chunk_size=3, reuse_layers=2, per_head=True, query_aware=False),
    "sentencekv": dict(keep_factor=1.0, query="current", buckets="chunks", offload=True, offload_chunk=1),
    "dynsplit": dict(chunk_size=6, max_deviation=3, alpha=1.0, pooling="mean", group_reduce="max", n_sink=2,
                     n_recent=1, offload=True),
    "tokenselect": dict(selection="hard_vote", scope="kv_head", theta=0.5, n_sink=1),
    "chess": dict(block_size=16, chunk_pages=2, grid_chunks=2, recent_pages=1, preset="aggressive", mode="always"),
}
CASES = [(name, i, params) for name in METHODS if name != "full"
         for i, params in enumerate([dict()] + ([MATRIX[name]] if name in MATRIX else []))]
IDS = [f"{name}-{'easy' if i == 0 else 'hard'}" for name, i, _ in CASES]

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


@pytest.mark.parametrize("name, i, params", CASES, ids=IDS)
def test_eviction_frees_pages(llm, name, i, params):
    method = get_method(name, SMALL, **params)
    if method.kind not in ("prefill_eviction", "decode_eviction"):
        pytest.skip("selection methods keep every token stored")
    pool = llm.engine.pool
    ids, start = llm.encode(CONTEXTS[0] * 3, QUESTIONS[0], chat=False)
    pages = {}
    for m in (get_method("full"), method):
        m.bind(llm.config, llm.tokenizer, pool.page_size)
        seq = Sequence(0, ids, SamplingParams(), SeqKV(pool), start)
        seq.method_state = m.new_state(seq)
        llm.engine.prefill(seq, m)
        pages[m.name] = pool.in_use
        seq.kv.release()
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
