"""Engine behaviour on a tiny random model: invariances of the paged cache, chunking and batching; sampling; stops."""
from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pytest
import torch

import semkv
from semkv.engine.hooks import StepPlan
from semkv.engine.staging import HostStaging
from semkv.engine.step import plan_chunks
from semkv.engine.kv_cache import KVPool, SeqKV, append_slots
from semkv.engine.memory import held_bytes
from semkv.engine.scheduler import Scheduler
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.methods import METHODS, get_method
from semkv.errors import SemkvError

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 12,
    "A paged cache stores keys and values in fixed-size pages. " * 5,
    "Short prompt.",
    "Numbers: " + " ".join(str(i) for i in range(60)),
]


def greedy(llm, prompts, **kw):
    return [o.token_ids for o in llm.generate(prompts, max_new_tokens=24, ignore_eos=True, chat=False, **kw)]


def test_plan_chunks_keeps_a_full_window_in_the_last_chunk():
    assert plan_chunks(0, 1000, 512, 32) == [(0, 512), (512, 1000)]
    assert plan_chunks(0, 1030, 512, 32) == [(0, 512), (512, 998), (998, 1030)]
    assert plan_chunks(0, 20, 512, 32) == [(0, 20)]
    assert plan_chunks(100, 1124, 512, 0) == [(100, 612), (612, 1124)]


@pytest.mark.parametrize("page_size", [1, 16, 32, 256])
def test_page_size_invariance(tiny_model_dir, tiny_llm, page_size):
    reference = greedy(tiny_llm, PROMPTS[:2])
    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu", page_size=page_size)
    assert greedy(llm, PROMPTS[:2]) == reference


def test_prefill_chunk_size_invariance(tiny_model_dir, tiny_llm):
    reference = greedy(tiny_llm, PROMPTS[:1])
    for chunk in (7, 64):
        assert greedy(semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=chunk), PROMPTS[:1]) == reference


def test_batch_equals_one_at_a_time(tiny_llm):
    batched = greedy(tiny_llm, PROMPTS)
    assert batched == [greedy(tiny_llm, [p])[0] for p in PROMPTS]


@pytest.mark.parametrize("method, budget", [("full", None), ("chess", 100_000)])
def test_batched_greedy_generation_equals_transformers_generate(tiny_model_dir, tiny_llm, method, budget):
    """The whole decode loop (continuous batching of prompts of different lengths, each step's inputs prepared while
    the previous step runs) gives HF transformers' greedy tokens, for Full KV and a selection method whose budget
    covers the context."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32).eval()
    outputs = tiny_llm.generate(PROMPTS, method, budget, max_new_tokens=24, ignore_eos=True, chat=False)
    for out in outputs:
        with torch.no_grad():
            want = hf.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=24, do_sample=False,
                               min_new_tokens=24, pad_token_id=0)[0, len(out.prompt_token_ids) :]
        assert out.token_ids == want.tolist()


@pytest.mark.parametrize("method, params, layers", [("full", {}, [0, 1, 2]), ("quest", dict(dense_layers=1), [0]),
                                                  ("pyramidkv", {}, [])])
def test_full_decode_through_flashattention_3s_arguments_gives_the_same_tokens(tiny_llm, monkeypatch, method, params,
                                                                               layers):
    """Where FlashAttention 3 serves full decode attention (the layers that select nothing, where they attend whole
    contexts: Full KV's, Quest's dense layer; not an evicting method's), a step hands it each layer's int32 page tables
    and slot counts, made once a step (`fa3.decode_inputs`): here its call is stood in for by the same attention in
    plain torch over exactly those arguments, so a table of the wrong layer or row, or a wrong count, changes the
    tokens. Eager steps and the static-buffer (CUDA-graph) steps both."""
    from semkv.engine.cuda_graph import GraphRunner
    from semkv.kernels import fa3, reference

    def run():
        return greedy(tiny_llm, PROMPTS, method=get_method(method, None if method == "full" else 48, **params))

    want = run()
    calls = []

    def flash_decode(q, k_pool, v_pool, inputs, layer, scale):  # FlashAttention 3's contract, in plain torch
        assert inputs.tables.dtype == inputs.used.dtype == inputs.cu_q.dtype == torch.int32
        assert inputs.tables.is_contiguous() and inputs.used.is_contiguous()
        assert inputs.cu_q.tolist() == list(range(q.shape[0] + 1)) and int(inputs.used.max()) <= inputs.longest
        calls.append(layer)
        return reference.decode_attention(q, k_pool, v_pool, inputs.tables[layer].long(), None,
                                          inputs.used[layer, :, None].long(), scale)

    monkeypatch.setattr(semkv.kernels, "fa3_decodes", lambda q, k_pool: True)
    monkeypatch.setattr(fa3, "decode_attention", flash_decode)
    assert run() == want
    assert sorted(set(calls)) == layers and calls[: len(layers)] == layers
    calls.clear()
    monkeypatch.setattr(tiny_llm.engine, "cuda_graphs", True)  # every step through the static buffers (no capture)
    static, forward_step = [], GraphRunner.forward_step
    monkeypatch.setattr(GraphRunner, "forward_step", lambda self, *a: static.append(1) or forward_step(self, *a))
    assert run() == want
    assert static and sorted(set(calls)) == layers


def test_pages_are_returned_after_generation(tiny_llm):
    greedy(tiny_llm, PROMPTS)
    assert tiny_llm.engine.pool.in_use == 0


def test_the_warm_ups_prepare_no_longer_context_than_every_layer_of_the_pool_holds(tiny_llm):
    model, cfg = tiny_llm.engine.model, tiny_llm.config
    engine = semkv.engine.engine.Engine(model, cfg, tiny_llm.engine.device, tiny_llm.engine.dtype, num_pages=400)
    longest = engine._longest_warm_up()  # 399 pages of 16 tokens beside the scratch page, shared by the 3 layers
    assert longest == 399 // cfg.num_layers * 16 < cfg.max_position_embeddings
    seq = Sequence(0, [1] * longest, SamplingParams(max_new_tokens=1), SeqKV(engine.pool))
    engine.prefill(seq, get_method("full"))  # a prompt of that length fills the pool
    assert engine.pool.free_pages < cfg.num_layers
    engine.release(seq)
    assert engine.pool.in_use == 0


def test_freeze_heap_takes_a_loaded_model_out_of_the_collectors_walks(tiny_llm):
    """What a serving process holds after its start (here the tiny model and everything the suite loaded) is frozen:
    a full collection walks only what came after."""
    from semkv.launch import freeze_heap

    model = tiny_llm.engine.model
    assert any(o is model for o in gc.get_objects())
    try:
        frozen = freeze_heap()
        walked = gc.get_objects()
        assert frozen > 10 * len(walked) and not any(o is model for o in walked)
    finally:
        gc.unfreeze()  # the rest of the suite collects as usual
    assert gc.get_freeze_count() == 0 and any(o is model for o in gc.get_objects())


def test_a_request_gets_its_whole_page_table_at_admission(tiny_llm):
    """The engine makes a request's page table as wide as its prompt and output can fill when it admits it, so that
    neither its prefill nor its decode steps make a new one (each a device allocation on the step's path)."""
    engine = tiny_llm.engine
    ids = list(range(5, 5 + 7 * engine.pool.page_size + 7))  # 8 pages: a new table fills them
    seq = Sequence(0, ids, SamplingParams(max_new_tokens=2 * engine.pool.page_size), SeqKV(engine.pool))
    method = get_method("full")
    seq.method_state = method.new_state(seq)
    with torch.inference_mode():
        seq.output_ids.append(int(engine.prefill(seq, method).argmax()))
        table = seq.kv.table
        assert table.shape[1] * engine.pool.page_size >= len(ids) + seq.params.max_new_tokens
        for _ in range(seq.params.max_new_tokens - 1):
            engine.step([seq], method, None, lambda s: "")
    assert seq.kv.table is table and seq.num_computed == len(ids) + seq.params.max_new_tokens - 1
    engine.end([seq], method)


def test_sampling_is_seeded(tiny_llm):
    kw = dict(max_new_tokens=16, temperature=1.0, top_k=50, top_p=0.9, chat=False, ignore_eos=True)
    a = tiny_llm.generate(PROMPTS[0], seed=3, **kw)[0].token_ids
    assert a == tiny_llm.generate(PROMPTS[0], seed=3, **kw)[0].token_ids
    assert a != tiny_llm.generate(PROMPTS[0], seed=4, **kw)[0].token_ids


@dataclasses.dataclass
class _Plan(StepPlan):
    row: torch.Tensor
    window: torch.Tensor = dataclasses.field(metadata={"pad": -1})


def test_a_packed_step_plan_is_one_tensor_and_fills_the_static_rows_below_with_padding():
    """A plan of [B] fields sent from host rows is one [fields, B] tensor whose rows are the fields; copied into packed
    static buffers, rows past the batch hold each field's padding, also after a larger batch wrote there; a plan made
    field by field fills packed buffers the same."""
    staging = HostStaging(torch.device("cpu"))
    static = _Plan.static(5, torch.device("cpu"))
    assert static.packed.shape == (2, 5) and static.window.tolist() == [-1] * 5
    _Plan.send(staging, [[1, 10], [2, 20], [3, 30], [4, 40], [5, 50]]).copy_to(static, 5)
    plan = _Plan.send(staging, [[7, 70], [8, 80]])
    assert plan.packed.shape == (2, 2) and plan.row.tolist() == [7, 8] and plan.window.is_contiguous()
    plan.copy_to(static, 2)
    assert static.row.tolist() == [7, 8, 0, 0, 0] and static.window.tolist() == [70, 80, -1, -1, -1]
    _Plan(torch.tensor([9]), torch.tensor([90])).copy_to(static, 1)
    assert static.row.tolist() == [9, 0, 0, 0, 0] and static.window.tolist() == [90, -1, -1, -1, -1]


def test_tokens_chosen_together_are_those_chosen_one_by_one():
    """`choose_each` then `chosen` (a step's first tokens, the greedy ones chosen on the device and read at once)
    give each request the token `sample` gives it: greedy rows their argmax (ties to the lower id), sampled rows from
    their own generator."""
    from semkv.engine.sampler import choose_each, chosen, sample

    def sample_each(*args):
        return chosen(choose_each(*args))

    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(50, generator=gen) for _ in range(5)]
    logits[1][[3, 7]] = 9.0  # a tie
    params = [SamplingParams(temperature=t, top_k=10) for t in (0.0, 0.0, 1.0, 0.0, 0.8)]
    seeds = [torch.Generator().manual_seed(i) for i in range(5)]
    again = [torch.Generator().manual_seed(i) for i in range(5)]
    assert sample_each(logits, params, seeds) == [sample(x, p, g) for x, p, g in zip(logits, params, again)]
    assert sample_each(logits, params, seeds)[1] == 3 and sample_each([], [], []) == []


def test_top_k_one_is_greedy(tiny_llm):
    sampled = tiny_llm.generate(PROMPTS[0], max_new_tokens=12, temperature=0.7, top_k=1, chat=False, ignore_eos=True)
    assert sampled[0].token_ids == greedy(tiny_llm, PROMPTS[:1])[0][:12]


def test_stop_string_ends_generation_and_is_cut(tiny_llm):
    full = tiny_llm.generate(PROMPTS[0], max_new_tokens=24, chat=False, ignore_eos=True)[0]
    stop = full.text[5:9]
    assert stop.strip()
    out = tiny_llm.generate(PROMPTS[0], max_new_tokens=24, chat=False, ignore_eos=True, stop=[stop])[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.find(stop)]


def test_eos_ends_generation(tiny_llm):
    full = tiny_llm.generate(PROMPTS[0], max_new_tokens=24, chat=False, ignore_eos=True)[0]
    tiny_llm.config.eos_token_ids.append(full.token_ids[3])
    try:
        out = tiny_llm.generate(PROMPTS[0], max_new_tokens=24, chat=False)[0]
    finally:
        tiny_llm.config.eos_token_ids.pop()
    assert out.finish_reason == "eos"
    assert out.token_ids == full.token_ids[: full.token_ids.index(full.token_ids[3]) + 1]


def test_stats_are_filled(tiny_llm):
    out = tiny_llm.generate(PROMPTS[0], max_new_tokens=10, chat=False, ignore_eos=True)[0]
    s = out.stats
    assert s.prompt_tokens == len(out.prompt_token_ids) and s.new_tokens == 10
    assert s.prefill_s > 0 and s.decode_s > 0
    # Full KV: the cache holds the prompt and the tokens fed back so far
    assert s.kv_resident_tokens == s.prompt_tokens + 9
    assert s.kv_attended_max == s.prompt_tokens + 9


def test_question_start_marks_the_question(tiny_llm):
    ids, start = tiny_llm.encode("Some long context.", "What is it?", chat=True)
    text = tiny_llm.tokenizer.decode(ids[start:])
    assert text.startswith("What is it?")
    ids_plain, start_plain = tiny_llm.encode("Some long context.", "What is it?", chat=False)
    assert tiny_llm.tokenizer.decode(ids_plain[start_plain:]).startswith("What is it?")


GRAPH_SAFE = {
    "full": dict(),
    "chess": dict(budget=64, block_size=16, recent_pages=1, chunk_pages=2, grid_chunks=2, mode="always"),
    "tokenselect": dict(budget=24, n_sink=4, n_recent=4, theta=0.5),  # Selection Cache rows on the device
    "quest": dict(budget=48),
    "quest-fraction": dict(budget=0.3),  # each row's budget from its own context, on the device
    "snapkv": dict(budget=40, window=8),
    "pyramidkv": dict(budget=40, window=8),  # layers keep different numbers of slots
    "streaming_llm": dict(budget=40),  # write slots chosen before the forward
    "h2o": dict(budget=40),  # victims chosen before the forward, scores accumulated beside the pool
    "h2o-fraction": dict(budget=0.3, recent_ratio=0.25),  # the cache grows with each row's context
    "infllm": dict(budget=40, n_sink=4, block_size=4, n_repr=2),  # scores and block keys beside the pool
    "infllm-fraction": dict(budget=0.3, n_sink=4, block_size=8, n_repr=2, per_head=True),  # W in the step plan
    # buckets ranked from device rows, tokens leaving the window join them between steps
    "sentencekv": dict(budget=40, window=8, n_sink=4, n_recent=4, offload_chunk=4),
    "sentencekv-fraction": dict(budget=0.3, n_sink=4, n_recent=4, query="current", offload_chunk=2),
    # the same over virtual slots, the chosen tokens loaded into the working set from host memory
    "sentencekv-offload": dict(budget=40, window=8, n_sink=4, n_recent=4, offload=True),
    # chunk summaries and starts in device rows; DD-Select on the host between steps; reuse stamps by slot
    "dynsplit": dict(budget=40, chunk_size=6, max_deviation=3),
    "dynsplit-fraction": dict(budget=0.3, chunk_size=8, max_deviation=4, n_sink=2, group_reduce="max"),
    # the same over virtual slots: the tail on the device, the rest in host memory behind a working set
    "dynsplit-offload": dict(budget=40, chunk_size=6, max_deviation=3, n_sink=2, offload=True, offload_chunk=4),
    # chunks and buckets scored by their best token: a paged dot product over the graph's widest row
    "dynsplit-tokens": dict(budget=0.3, chunk_size=6, max_deviation=3, n_sink=2, score="tokens"),
    "sentencekv-tokens": dict(budget=40, window=8, n_sink=4, n_recent=4, offload_chunk=4, score="tokens"),
}
# every registered method whose defaults are graph-safe joins at budget 40 unless configured above
GRAPH_SAFE = {**{name: dict(budget=40) for name, cls in METHODS.items() if name != "full" and cls(budget=40).graph_safe},
              **GRAPH_SAFE}


def test_every_graph_safe_method_is_checked():
    """A registered method whose defaults are graph-safe is in the static-buffer test, as every config listed is."""
    for name, cls in METHODS.items():
        if (cls(budget=40) if name != "full" else cls()).graph_safe:
            assert name in GRAPH_SAFE
    for name, params in GRAPH_SAFE.items():
        assert get_method(name.split("-")[0], **params).graph_safe, name


def test_warm_up_frees_everything_it_took(tiny_model_dir, tiny_llm, monkeypatch):
    """The warm-up that compiles the kernels at load on CUDA (a prefill cut at lengths and starts of every kind,
    decode steps of 1, 2 and 16 rows, eager and through the graph runner; all eager here) holds no page and no byte
    afterwards, and the engine gives the tokens it gave without it."""
    from semkv.engine.engine import WARM_UP_SPANS

    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu")
    engine = llm.engine
    # the tiny model's context (4096) is shorter than the warm-up's prompt: as a longer model's
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, max_position_embeddings=8192))
    engine.warm_up()
    assert engine.pool.peak_in_use >= engine.config.num_layers * -(-WARM_UP_SPANS[-1][1] // engine.pool.page_size)
    assert engine.pool.in_use == 0 and engine.memory().held == (0, 0, 0, 0)
    assert greedy(llm, PROMPTS[:2]) == greedy(tiny_llm, PROMPTS[:2])


@pytest.mark.parametrize("name", GRAPH_SAFE)
def test_static_buffer_decode_equals_eager(tiny_llm, name):
    """The CUDA-graph step of each graph-safe method (run eagerly here: same static buffers, padding rows on the
    scratch page, selections from the step's tensors alone) gives the logits of the plain decode step, with the
    method's `end_step` after each step as in a run."""
    from semkv.engine.cuda_graph import GraphRunner
    from semkv.engine.sequence import SamplingParams, Sequence
    from semkv.methods import get_method

    engine = tiny_llm.engine
    kind = name.split("-")[0]
    eager_method, method = get_method(kind, **GRAPH_SAFE[name]), get_method(kind, **GRAPH_SAFE[name])
    assert method.graph_safe
    for m in (eager_method, method):  # one instance per batch: methods may keep per-sequence device state
        m.bind(tiny_llm.config, tiny_llm.tokenizer, engine.pool.page_size)

    def prefilled(text, m):
        ids = tiny_llm.tokenizer(text)["input_ids"]
        seq = Sequence(0, ids, SamplingParams(), SeqKV(engine.pool))
        seq.method_state = m.new_state(seq)
        seq.output_ids.append(int(engine.prefill(seq, m).argmax()))
        return seq

    eager = [prefilled(p, eager_method) for p in PROMPTS]
    static = [prefilled(p, method) for p in PROMPTS]
    runner = GraphRunner(engine, method, max_pages=40)
    assert not runner.capture  # CPU: no capture, same code path
    for step in range(20):  # 20 steps cross KV page boundaries; the second request leaves after 8
        if step == 8:  # its pages go back to the pool and are handed out again at the next page boundary
            for batch in (eager, static):
                engine.release(batch.pop(1))
        want = engine.decode_step(eager, eager_method)
        got = runner.decode_step(static)  # the bucket of 4: full, then with a padding row where a request was
        assert (got - want).abs().max() < 1e-4
        tokens = want.argmax(-1).tolist()
        eager_method.end_step(eager, want, tokens)
        method.end_step(static, got, tokens)
        for e, s, token in zip(eager, static, tokens):
            e.output_ids.append(token)
            s.output_ids.append(token)
    assert list(runner.steps) == [4]
    for seq in eager + static:
        engine.release(seq)
    assert engine.memory().held == (0, 0, 0, 0)


@pytest.mark.parametrize("arch, method, budget", [("llama", "full", None), ("llama", "snapkv", 48),
                                                  ("llama", "h2o", 48), ("llama", "tokenselect", 48),
                                                  ("qwen2", "full", None), ("qwen3", "chess", 128)])
def test_prefill_graph_pieces_give_the_eager_tokens(tiny_model_dir, arch, method, budget):
    """The prefill's piecewise graphs (`PrefillGraphs`, run eagerly here: the same pieces over the static buffers,
    padding rows included, the attention between them) give the eager prefill's tokens, chunk after chunk, for
    methods that evict, score with the chunk's log-sum-exps and select a sparse context, and with q/k/v biases and
    q/k norms."""
    from semkv.engine.cuda_graph import PrefillGraphs

    plain = semkv.LLM(tiny_model_dir(arch), device="cpu", prefill_chunk=96)
    pieces = semkv.LLM(tiny_model_dir(arch), device="cpu", prefill_chunk=96)
    graphs = pieces.engine.prefill_graphs = PrefillGraphs(pieces.engine)
    kw = dict(method=method, budget=budget)
    assert greedy(pieces, PROMPTS[:2], **kw) == greedy(plain, PROMPTS[:2], **kw)
    assert graphs.hidden.abs().sum() > 0 and not graphs.graphs  # the pieces ran (nothing captured on the CPU)
    assert pieces.engine.memory().held == (0, 0, 0, 0)


def test_requests_wait_when_the_pool_is_full(tiny_model_dir):
    """Continuous batching: with a pool that holds about two requests, four still complete (the others wait), and
    give the same tokens as with a large pool."""
    small = semkv.LLM(tiny_model_dir("llama"), device="cpu", num_pages=3 * 2 * 12)
    big = semkv.LLM(tiny_model_dir("llama"), device="cpu")
    prompts = [p[:300] for p in PROMPTS]
    assert greedy(small, prompts) == greedy(big, prompts)
    assert small.engine.pool.peak_in_use <= small.engine.pool.num_pages
    with pytest.raises(MemoryError, match="needs .* KV pages"):
        semkv.LLM(tiny_model_dir("llama"), device="cpu", num_pages=4).generate(PROMPTS[0], chat=False)


def test_a_prompt_of_one_chunk_is_admitted_at_one_layer_of_it(tiny_model_dir):
    """An evicting method's prompt of one prefill chunk fills and evicts one layer at a time, so admission counts one
    layer's whole prompt and the others' bound: a pool smaller than every layer's prompt runs it (its peak within
    that count), and the same pool refuses it when the prompt needs several chunks (every layer holds it then)."""
    prompt = PROMPTS[0] * 3  # about 360 tokens: 23 pages a layer
    for chunk in (512, 64):
        llm = semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=chunk, num_pages=36)
        method = get_method("snapkv", 32)
        ids = llm.encode(prompt, chat=False)[0]
        seq = Sequence(0, ids, SamplingParams(max_new_tokens=8), SeqKV(llm.engine.pool))
        need = llm.engine.pages_needed(seq, method.bound(llm.config, llm.tokenizer, 16), prefill=True)
        assert 3 * -(-len(ids) // 16) > llm.engine.pool.num_pages - 1
        if chunk >= len(ids):
            assert need < llm.engine.pool.num_pages
            out = llm.generate(prompt, method=method, max_new_tokens=8, ignore_eos=True, chat=False)
            assert len(out[0].token_ids) == 8 and llm.engine.pool.peak_in_use <= need
            assert llm.engine.pool.in_use == 0
        else:
            with pytest.raises(MemoryError, match="needs .* KV pages"):
                llm.generate(prompt, method=method, max_new_tokens=8, chat=False)


def test_a_prefill_by_layer_computes_the_same_and_holds_one_layer_of_the_prompt(tiny_model_dir):
    """A method that prefills by layer (SentenceKV with offload) runs a prompt of several chunks layer after layer:
    the prompt's logits equal the resident method's, prefilled chunk after chunk, exactly; a pool smaller than every
    layer's prompt (which the resident prefill needs) runs it, never holding more than one layer's whole prompt
    beside the other layers' bound, and admission counts that; the tokens are the resident ones."""
    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=48, num_pages=40)
    big = semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=48)
    page, layers = llm.engine.pool.page_size, llm.config.num_layers
    prompt = PROMPTS[0] * 3  # about 360 tokens: 8 chunks, 23 pages a layer
    ids = llm.encode(prompt, chat=False)[0]
    params = dict(n_sink=4, n_recent=4)
    methods = {offload: get_method("sentencekv", 48, **params, offload=offload).bound(llm.config, llm.tokenizer, page)
               for offload in (True, False)}
    bound = methods[True].device_tokens(len(ids), 8, page)
    assert layers * -(-len(ids) // page) > llm.engine.pool.num_pages - 1 > (layers - 1) * -(-bound // page) + 23
    logits = {}
    for offload, engine in ((True, llm.engine), (False, big.engine), ("small", llm.engine)):
        method = methods[offload is True]
        seq = Sequence(0, ids, SamplingParams(max_new_tokens=8), SeqKV(engine.pool))
        seq.method_state = method.new_state(seq)
        try:
            logits[offload] = engine.prefill(seq, method)
        except MemoryError:
            logits[offload] = None
        finally:
            engine.end([seq], method)
    assert torch.equal(logits[True], logits[False])
    assert logits["small"] is None  # chunk after chunk, every layer's prompt does not fit the small pool
    kw = dict(max_new_tokens=8, ignore_eos=True, chat=False)
    llm.engine.pool.peak_in_use = 0
    got = llm.generate(prompt, method=get_method("sentencekv", 48, **params, offload=True), **kw)[0]
    assert llm.engine.pool.peak_in_use <= (layers - 1) * -(-bound // page) + -(-len(ids) // page)
    resident = big.generate(prompt, method=get_method("sentencekv", 48, **params, offload=False), **kw)[0]
    assert got.token_ids == resident.token_ids
    seq = Sequence(0, ids, SamplingParams(max_new_tokens=8), SeqKV(llm.engine.pool))
    hidden = llm.engine.hidden_state_bytes(seq, methods[True])  # kept for the prompt, counted at admission
    assert hidden == 2 * len(ids) * llm.config.hidden_size * 4 and not llm.engine.hidden_state_bytes(seq, methods[False])
    llm.engine.state_memory = 1
    with pytest.raises(MemoryError, match=r"GiB of its prompt's hidden states beside the KV pool"):
        llm.generate(prompt, method=get_method("sentencekv", 48, **params, offload=True), **kw)


def test_requests_that_end_at_their_first_token(tiny_llm):
    """One new token each: every request finishes at its prefill and the scheduler stops without a decode step."""
    outs = tiny_llm.generate(PROMPTS[:3], max_new_tokens=1, ignore_eos=True, chat=False)
    assert [len(o.token_ids) for o in outs] == [1, 1, 1]
    assert [o.token_ids for o in outs] == [g[:1] for g in greedy(tiny_llm, PROMPTS[:3])]


def test_method_state_is_taken_at_admission_and_requests_wait_for_its_memory(tiny_model_dir):
    """SentenceKV's device rows are taken when a request is admitted, not when it is submitted; with room beside the
    pool for the state of two requests, four identical ones run two at a time (rows 1 and 2 only) and give the
    tokens of the unlimited run, in which all four run at once; a request whose state cannot fit even alone is an
    error that says so."""
    from semkv.methods.sentencekv.method import SentenceKV

    prompts = [PROMPTS[0]] * 4

    class Recorded(SentenceKV):  # the copy `generate` binds holds the run's rows until the run ends: keep them
        def admit(self, seq) -> None:
            super().admit(seq)
            rows.append(self._rows)

    rows = []

    def run(state_memory):
        llm = semkv.LLM(tiny_model_dir("llama"), device="cpu")
        llm.engine.state_memory = state_memory
        tokens = greedy(llm, prompts, method=Recorded(budget=48, offload=False))
        return tokens, rows[-1]

    free_tokens, free_rows = run(None)
    assert free_rows.sizes()[0] >= 5  # rows 1..4 held at once

    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu")
    method = SentenceKV(budget=48, offload=False)
    method.bind(llm.config, llm.tokenizer, llm.engine.pool.page_size)
    seq = Sequence(0, llm.encode(prompts[0], chat=False)[0], SamplingParams(max_new_tokens=24), SeqKV(llm.engine.pool))
    seq.method_state = method.new_state(seq)
    before, growth = method._rows.held_bytes(), method.admission_bytes(seq)
    assert seq.method_state.row == 0 and before < growth // 100  # submitted: no row yet
    method.admit(seq)
    assert method._rows.held_bytes() == growth  # what it said it would take (the first tensors are all replaced)
    assert seq.method_state.row == 1 and method._rows.sizes()[0] == 3  # room for rows 1 and 2
    assert method.admission_bytes(seq) == 0
    # the engine measures everything the method holds (its vocabulary masks too): room for the rows of two requests
    room = held_bytes([method], llm.engine.device)[0] + before

    limited_tokens, limited_rows = run(room)
    assert limited_tokens == free_tokens
    assert limited_rows.sizes()[0] == 3 and limited_rows.held_bytes() == growth
    with pytest.raises(MemoryError, match="needs .* GiB of sentencekv state beside the KV pool"):
        run(growth // 2)


@pytest.mark.parametrize("name", ["h2o", "infllm", "quest", "chess"])
def test_state_beside_the_pool_is_announced_before_admission(tiny_model_dir, name):
    """H2O's prompt attention sums are taken at admission, not at submission; what H2O, InfLLM, Quest and CHESS keep
    by page beside a fixed pool (scores, block keys, page summaries) covers the pages handed out, not the pool: the
    admission counts it for the request's pages (`Engine.admission_state`), the request holds no more than that
    while it runs, and all of it is free again when the run ends."""
    from semkv.methods import get_method

    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu", num_pages=4000)
    method = get_method(name, 32)
    method.bind(llm.config, llm.tokenizer, llm.engine.pool.page_size)
    ids = llm.encode(PROMPTS[0], chat=False)[0]
    seqs = [Sequence(i, ids, SamplingParams(max_new_tokens=4), SeqKV(llm.engine.pool)) for i in range(2)]
    states = [method.new_state(s) for s in seqs]
    assert held_bytes([method, *states], llm.engine.device) == (0, 0) and not getattr(states[0], "prefill_scores", [])
    pool = llm.engine.pool
    prompt_sums = pool.num_layers * pool.num_kv_heads * len(ids) * 4 if name == "h2o" else 0
    need = llm.engine.pages_needed(seqs[0], method, prefill=True)
    announced = sum(llm.engine.admission_state(seqs[0], method, need))
    seqs[0].method_state = states[0]
    llm.engine.prefill(seqs[0], method)
    held = llm.engine.memory().state_bytes[name]
    assert 0 < held <= announced - prompt_sums  # the prompt sums are gone
    assert held == method.page_state_bytes(pool) * pool.coverage < method.page_state_bytes(pool) * pool.num_pages / 10
    assert method.admission_bytes(seqs[1]) == prompt_sums
    llm.engine.end(seqs[:1], method)
    assert llm.engine.memory().held == (0, 0, 0, 0)


def test_page_ids_start_from_the_lowest_again_once_none_is_held():
    """After a large batch has touched most of the pool and let every page go, ids are handed out from the lowest
    again: state kept by page that is made then covers the new requests' pages, not the old batch's (an int8 key
    sketch asked 30 GiB for 16 rows after a 335-row batch on an H200); state that lived through it is not moved,
    nor are captured graphs invalidated; while one page is held, or cached, nothing is rewound."""
    from semkv.methods.state.page_storage import slot_scores

    pool = KVPool(2, 2, 8, 4, torch.float32, torch.device("cpu"), num_pages=256, max_pages=256)
    old = slot_scores()
    old.ensure(pool)
    big = pool.allocate(200)
    assert pool.touched == 201 and old.pages >= 201
    kept = pool.allocate(1)
    pool.release(big)
    assert pool.touched == 202 and pool.free  # one page held: ids keep going up
    pool.release(kept)
    assert pool.touched == 1 and pool.free == [] and pool.coverage == old.pages
    epoch, data = pool.coverage_epoch, old.data
    assert pool.allocate(10) == list(range(1, 11)) and old.data is data and pool.coverage_epoch == epoch
    pool.release(list(range(1, 11)))
    assert pool.coverage == old.pages
    del old, data  # its method is gone
    new = slot_scores()
    assert new.growth_bytes(pool) == new.bytes_per_page(pool) and new.ensure(pool) and new.pages == 1  # scratch
    assert pool.cover_bytes(11) == new.bytes_per_page(pool) * pool.coverage_for(11) < 200 * new.bytes_per_page(pool)
    pool.allocate(10)
    assert 11 <= new.pages < 200 and pool.coverage == new.pages and pool.coverage_epoch == epoch + 1
    del new  # no state kept by page lives now (Full KV's runs); a large batch comes and goes
    pool.release(pool.allocate(190) + list(range(1, 11)))
    assert pool.touched == 1 and pool.coverage == 1
    pool.allocate(5)  # a request's prefill takes pages first; its method makes state kept by page afterwards (the
    late = slot_scores()  # int8 sketch after its prompt): it covers those pages, not the batch's before
    assert late.growth_bytes(pool) == late.bytes_per_page(pool) * pool.coverage_for(6, 1) and late.ensure(pool)
    assert 6 <= late.pages == pool.coverage < 200


def test_state_kept_by_page_that_the_device_cannot_hold_is_a_memory_error_and_is_not_kept():
    """`KVPool.register` covering a new state runs out of device memory: the caller gets one MemoryError naming the
    GiB and pages missing, the pool keeps no reference to the state, and a state that fits registers afterwards."""
    from semkv.methods.state.page_storage import PageStorage, slot_scores

    class Full(PageStorage):
        def cover(self, pool, pages):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 30.48 GiB")

    pool = KVPool(2, 2, 8, 4, torch.float32, torch.device("cpu"), num_pages=256, max_pages=256)
    pool.allocate(100)
    full = Full(lambda p: (p.page_size, p.num_kv_heads))
    with pytest.raises(MemoryError, match=r"no device memory for the state kept by KV page beside the pool "
                                          r"\(0\.00 GiB for \d+ more pages\); lower gpu_memory_utilization"):
        full.ensure(pool)
    assert full not in pool.page_states and len(pool.page_states) == 0
    fits = slot_scores()
    assert fits.ensure(pool) and fits.pages == pool.coverage >= 101 and list(pool.page_states) == [fits]


def test_a_pool_sized_for_a_method_that_keeps_state_by_page_leaves_it_room(tiny_model_dir, monkeypatch):
    """`LLM(reserve_for=method)` reads the method's state kept by KV page off the engine's shape (TokenSelect's int8
    key sketch: D + 4 bytes a slot and KV head; Quest's page summaries; nothing for Full KV) and the engine sizes a
    pool from free memory in pages of K/V and that state together (`pool_pages`), so that both fit in the card's
    share; a reserve_for that is no method object is one clear error."""
    from semkv import llm as llm_module
    from semkv.engine import engine as engine_module
    from semkv.engine.engine import ACTIVATION_RESERVE, pool_pages
    from semkv.methods.quest import Quest
    from semkv.methods.tokenselect import TokenSelect

    seen = []

    class Recording(engine_module.Engine):
        def __init__(self, *args, page_state_bytes=0, **kwargs):
            seen.append(page_state_bytes)
            super().__init__(*args, page_state_bytes=page_state_bytes, **kwargs)

    monkeypatch.setattr(llm_module, "Engine", Recording)
    folder = tiny_model_dir("llama")
    for method in (None, get_method("full"), TokenSelect(budget=0.1, score_keys="int8"), Quest(budget=0.1)):
        llm = semkv.LLM(folder, device="cpu", page_size=8, reserve_for=method)
        cfg = llm.config
        bound = None if method is None else method.bound(cfg, llm.tokenizer, 8)
        assert seen[-1] == (0 if bound is None else bound.page_state_bytes(llm.engine.pool))
    assert seen[:2] == [0, 0] and seen[2] == 8 * cfg.num_kv_heads * (cfg.head_dim + 4) and seen[3] > 0
    kv_page = 2 * 16 * 8 * 128 * 2  # a page of the Llama-3.1-8B shape's K/V in bfloat16
    total, free = 140 * 2**30, 120 * 2**30
    share = free - 0.1 * total - ACTIVATION_RESERVE
    for state in (0, 16 * 8 * (128 + 4)):
        pages = pool_pages(free, total, 0.9, kv_page + state)
        assert pages * (kv_page + state) <= share < (pages + 1) * (kv_page + state)
    assert pool_pages(free, total, 0.9, kv_page + 16 * 8 * 132) < 0.8 * pool_pages(free, total, 0.9, kv_page)
    with pytest.raises(SemkvError, match=r"reserve_for='quest' is not a method object; allowed: None or a KVMethod"):
        semkv.LLM(folder, device="cpu", reserve_for="quest")


def test_a_batch_grows_its_page_tables_together_as_one_sequence_at_a_time_would():
    """`append_slots` over a batch (one allocation, one copy of the new page ids) leaves every sequence with the
    pages, tables and slot counts that appending one sequence at a time gives, across page boundaries reached at
    different steps and a table that has to widen; a batch that does not fit raises before taking any page."""
    def grown(batched: bool) -> list[SeqKV]:
        pool = KVPool(3, 2, 4, 4, torch.float32, torch.device("cpu"))
        kvs = [SeqKV(pool) for _ in range(3)]
        for kv, n in zip(kvs, (4, 8, 30)):
            for layer in range(3):
                kv.ensure_slots(layer, n)
                kv.num_slots[layer] = n
        for _ in range(7):
            if batched:
                append_slots(kvs)
            else:
                for kv in kvs:
                    kv.append_slot()
        return kvs

    for batched_kv, single_kv in zip(grown(True), grown(False)):
        assert np.array_equal(batched_kv.page_count, single_kv.page_count)
        assert np.array_equal(batched_kv.pages, single_kv.pages) and batched_kv.num_slots == single_kv.num_slots
        assert torch.equal(batched_kv.table, single_kv.table)
        assert batched_kv.table.tolist() == batched_kv.pages.tolist()  # the host copy is the device table
    assert grown(True)[2].table.shape[1] > 8  # 37 slots of 4 take 10 pages: the 8-wide table widened

    pool = KVPool(1, 2, 4, 4, torch.float32, torch.device("cpu"), num_pages=6, max_pages=6)  # 5 pages to give
    kvs = [SeqKV(pool) for _ in range(3)]
    for kv in kvs:
        kv.ensure_slots(0, 4)
        kv.num_slots[0] = 4
    with pytest.raises(MemoryError):
        append_slots(kvs)  # three new pages, two left
    assert pool.in_use == 3 and [kv.page_count[0] for kv in kvs] == [1, 1, 1]


def test_a_cache_grown_during_generation_takes_writes_after_it():
    """Pool and page tables that grew inside torch.inference_mode (as generation runs) stay writable outside it."""
    pool = KVPool(1, 2, 4, 4, torch.float32, torch.device("cpu"), num_pages=2)
    with torch.inference_mode():
        kv = SeqKV(pool)
        kv.ensure_slots(0, 40)  # 10 pages: the pool grows and the 8-wide table widens
    slots = torch.arange(40)
    k, v = torch.randn(2, 40, 2, 4).unbind()
    kv.write(0, slots, k, v, slots)
    rows = kv.physical(0, slots)
    assert torch.equal(pool.flat()[0][rows], k) and torch.equal(pool.flat()[1][rows], v)
    kv.table[0, 0] = kv.table[0, 1]  # a method's own table edit


def test_a_request_refused_at_admission_leaves_the_engine_usable(tiny_model_dir):
    """A `MemoryError` at admission (no room for the method's state, or for the KV pages) leaves no page, request or
    state behind, and the same engine then serves the requests with the tokens of an unconstrained run."""
    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu", num_pages=200)
    kw = dict(method="sentencekv", budget=48, method_params=dict(offload=False))
    want = greedy(llm, PROMPTS[:2], **kw)
    llm.engine.state_memory = 1
    with pytest.raises(MemoryError, match="state beside the KV pool"):
        greedy(llm, PROMPTS[:2], **kw)
    assert llm.engine.memory().held == (0, 0, 0, 0)
    llm.engine.state_memory = None
    with pytest.raises(MemoryError, match="needs .* KV pages"):
        greedy(llm, [PROMPTS[0] * 20], **kw)
    assert llm.engine.memory().held == (0, 0, 0, 0)
    assert greedy(llm, PROMPTS[:2], **kw) == want


class Failure(RuntimeError):
    pass


def test_a_scheduler_that_contains_failures_serves_the_others(tiny_model_dir):
    """With `contain=True` (the server's scheduler), requests of several methods decode side by side, each in its own
    batch, with the tokens they get alone; a method that raises mid-decode fails its batch only, a request too large
    for the pool fails alone, and when every request has ended nothing is held."""
    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu", num_pages=300)
    full, quest = get_method("full"), get_method("quest", budget=32)
    want = {name: greedy(llm, PROMPTS, method=m) for name, m in (("full", full), ("quest", quest))}

    class Broken(type(full)):
        def end_step(self, seqs, logits, tokens):
            if seqs[0].num_tokens > seqs[0].params.max_new_tokens // 2 + len(seqs[0].prompt_ids):
                raise Failure("end_step")

    params = llm.sampling_params(24, 0.0, 0, 1.0, 0, None, True)
    bound = {name: m.bound(llm.config, llm.tokenizer, 16) for name, m in
             (("full", full), ("quest", quest), ("broken", Broken()))}
    scheduler = Scheduler(llm.engine, contain=True)
    seqs = {}
    for name in ("full", "quest", "broken"):
        for i, prompt in enumerate(PROMPTS):
            seq = llm.request(len(seqs), llm.encode(prompt, chat=False)[0], params, bound[name])
            seqs[name, i] = seq
            scheduler.submit(seq, bound[name], llm.stop_test(params))
    huge = llm.request(99, [5] * 5000, params, bound["full"])
    scheduler.submit(huge, bound["full"], llm.stop_test(params))
    while scheduler.busy:
        scheduler.advance()
        assert len(scheduler.batches) <= 3
    for name in ("full", "quest"):
        assert [seqs[name, i].output_ids for i in range(len(PROMPTS))] == want[name]
    failed = dict(scheduler.failed)
    assert {s.seq_id for s in failed} == {seqs["broken", i].seq_id for i in range(len(PROMPTS))} | {99}
    assert isinstance(failed[huge], MemoryError) and isinstance(failed[seqs["broken", 0]], Failure)
    assert all(s.finish_reason == "error" for s in failed)
    assert llm.engine.memory().held == (0, 0, 0, 0) and not scheduler.batches


def test_warm_up_leaves_no_request_and_no_page_behind(tiny_model_dir):
    """The load-time warm-up (run by default on CUDA) is a real prefill and decode step that ends like a request:
    afterwards the pool has no page in use and the engine no live request, and generation is unchanged."""
    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu")
    before = greedy(llm, PROMPTS[:1])
    llm.engine.warm_up()
    usage = llm.engine.memory()
    assert usage.pages_in_use == 0 and usage.requests == 0 and not usage.state_bytes
    assert greedy(llm, PROMPTS[:1]) == before


def test_a_method_caps_the_prefill_chunk(tiny_model_dir):
    """TokenSelect selects each chunk's context, so its prefill runs in chunks of at most its `chunk` (the paper's
    512) whatever the engine's chunk; the engine's shorter chunk wins."""
    from semkv.methods import TokenSelect

    starts, lengths = [], []

    class Recording(TokenSelect):
        def prefill_context(self, layer, seq, q, start):
            if layer == 0:
                starts.append(start)
                lengths.append(len(seq.prompt_ids))
            return super().prefill_context(layer, seq, q, start)

    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=64)
    prompt = " ".join(PROMPTS * 4)
    llm.generate([prompt], Recording(budget=32, chunk=40), max_new_tokens=1)
    n = lengths[0]
    assert n > 130 and starts == list(range(0, n, 40))
    starts.clear()
    llm.generate([prompt], Recording(budget=32, chunk=100), max_new_tokens=1)
    assert starts == list(range(0, n, 64))


def test_prompts_as_token_ids_give_the_tokens_of_their_text(tiny_llm):
    """`generate` takes token ids as vLLM's `prompt_token_ids` (one prompt or several, beside text prompts): the same
    tokens as the text they encode; ids out of the vocabulary, or ids with a question, are refused by name."""
    text = "The cat sat on the mat. Where did the cat sit?"
    ids, _ = tiny_llm.encode(text, None, chat=False)
    want = tiny_llm.generate(text, chat=False, max_new_tokens=6)[0].token_ids
    assert tiny_llm.generate(ids, max_new_tokens=6)[0].token_ids == want
    both = tiny_llm.generate([ids, text], chat=False, max_new_tokens=6)
    assert [o.token_ids for o in both] == [want, want] and both[0].prompt_token_ids == ids
    vocab = tiny_llm.config.vocab_size
    with pytest.raises(SemkvError, match=rf"prompt 1 must be non-empty text or a list of token ids in \[0, {vocab}\)"):
        tiny_llm.generate([ids, [vocab]], max_new_tokens=2)
    with pytest.raises(SemkvError, match="token ids: questions and answer prefixes go with text prompts"):
        tiny_llm.generate([ids], questions=["Where?"], max_new_tokens=2)
