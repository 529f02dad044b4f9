"""ChunkKV: Algorithm 1 against a direct transcription, whole chunks, layer-wise index reuse, per-head and hybrid
variants (tiny random Llama, 3 layers, GQA 4/2); index reuse end to end on the embedded model (slow)."""
from __future__ import annotations

import math

import pytest
import torch

import semkv
from semkv.engine.kv_cache import KVPool, SeqKV
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.errors import SemkvError
from semkv.methods import ChunkKV, SnapKV, get_method
from semkv.methods.chunkkv import keep_chunks

TEXT = ("Paged attention stores keys and values in fixed-size pages. The passkey is 4821. "
        "Long documents are split into sentences, and each sentence has a meaning. ") * 4
QUESTION = "What is the passkey?"


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=48)


def kept_positions(llm, method, text=TEXT, question=QUESTION) -> tuple[list[torch.Tensor], dict, int]:
    """Prefill with `method`; kept positions per layer [kv_heads, n_keep], the method counters, prompt length."""
    method.bind(llm.config, llm.tokenizer, llm.engine.pool.page_size)
    ids, start = llm.encode(text, question, chat=False)
    seq = Sequence(0, ids, SamplingParams(), SeqKV(llm.engine.pool), start)
    seq.method_state = method.new_state(seq)
    llm.engine.prefill(seq, method)
    positions = [seq.kv.positions(layer).clone() for layer in range(llm.config.num_layers)]
    llm.engine.release(seq)
    return positions, seq.stats.extra, len(ids)


def transcription(q_window, keys, n_keep, window, chunk_size, per_head):
    """Algorithm 1 of the paper written out with loops (float64): window attention, chunk sums, top chunks in
    original order cut to L_max - w, then the window."""
    w, heads, dim = q_window.shape
    kv_heads, n, _ = keys.shape
    group = heads // kv_heads
    q, k = q_window.double(), keys.double()
    token_scores = torch.zeros(kv_heads, n)
    for h in range(heads):
        for i in range(w):
            visible = n - w + i + 1  # causal inside the window
            logits = torch.stack([q[i, h] @ k[h // group, j] for j in range(visible)]) / math.sqrt(dim)
            token_scores[h // group, :visible] += torch.softmax(logits, 0).float() / group
    rows = token_scores if per_head else token_scores.mean(0, keepdim=True)
    n_window = min(window, n_keep)
    prefix, fill = n - n_window, n_keep - n_window
    kept = []
    for row in rows:
        chunks = [list(range(s, min(s + chunk_size, prefix))) for s in range(0, prefix, chunk_size)]
        ranked = sorted(range(len(chunks)), key=lambda i: -float(sum(row[j] for j in chunks[i])))
        chosen, held = [], 0
        for i in ranked:
            if held >= fill:
                break
            chosen.append(i)
            held += len(chunks[i])
        tokens = [j for i in sorted(chosen) for j in chunks[i]][:fill]
        kept.append(tokens + list(range(prefix, n)))
    return torch.tensor(kept)


@pytest.mark.parametrize("n, budget, window, chunk_size", [(47, 20, 4, 5), (60, 33, 8, 10), (50, 6, 8, 3),
                                                           (41, 30, 0, 7)])
@pytest.mark.parametrize("per_head", [False, True])
def test_algorithm_1_matches_transcription(n, budget, window, chunk_size, per_head):
    torch.manual_seed(n + budget)
    pool = KVPool(1, 2, 8, 4, torch.float32, torch.device("cpu"))
    kv = SeqKV(pool)
    kv.ensure_slots(0, n)
    keys = torch.randn(n, 2, 8) * 2
    kv.write(0, torch.arange(n), keys, torch.randn(n, 2, 8), torch.arange(n))
    kv.num_slots[0] = n
    seq = Sequence(0, list(range(n)), SamplingParams(), kv)
    seq.num_computed = n
    method = ChunkKV(budget=budget, window=window, chunk_size=chunk_size, per_head=per_head)
    seq.method_state = method.new_state(seq)
    q_window = torch.randn(window, 4, 8) * 2
    keep = method.evict_prefill(0, seq, q_window)
    assert keep.shape == (2 if per_head else 1, budget)
    assert torch.equal(keep, transcription(q_window, keys.transpose(0, 1), budget, window, chunk_size, per_head))


def assert_whole_chunks(kept: torch.Tensor, n_prompt: int, n_window: int, chunk_size: int) -> None:
    """Kept positions of one head: the window, and before it whole chunks except the last, which is a chunk's start."""
    prefix = n_prompt - n_window
    assert kept[-n_window:].tolist() == list(range(prefix, n_prompt))
    chunks: dict[int, list[int]] = {}
    for p in kept[:-n_window].tolist():
        chunks.setdefault(p // chunk_size, []).append(p)
    last = max(chunks)
    for c, members in chunks.items():
        start = c * chunk_size
        full = list(range(start, min(start + chunk_size, prefix)))
        assert members == full if c != last else members == full[: len(members)]


@pytest.mark.parametrize("chunk_size", [3, 10])
def test_kept_positions_are_whole_chunks(llm, chunk_size):
    budget, window = 41, 8
    positions, extra, n = kept_positions(llm, ChunkKV(budget=budget, window=window, chunk_size=chunk_size))
    assert n > 2 * budget
    for layer_positions in positions:
        assert layer_positions.shape[1] == budget
        assert (layer_positions == layer_positions[0]).all()  # one chunk set shared by the KV heads
        assert_whole_chunks(layer_positions[0], n, window, chunk_size)
    assert extra["scored_layers"] == llm.config.num_layers


@pytest.mark.parametrize("reuse_layers", [1, 2, 3])
def test_index_reuse_shares_positions_and_skips_scoring(llm, reuse_layers):
    positions, extra, _ = kept_positions(llm, ChunkKV(budget=30, window=4, reuse_layers=reuse_layers))
    layers = llm.config.num_layers
    for layer in range(layers):
        first = layer - layer % reuse_layers
        assert torch.equal(positions[layer], positions[first])
    assert extra["scored_layers"] == -(-layers // reuse_layers)
    if reuse_layers == 1:  # without reuse the layers choose differently (so the check above can fail)
        assert any(not torch.equal(positions[0], p) for p in positions[1:])


@pytest.mark.parametrize("reuse_layers", [1, 2])
def test_a_request_holds_no_kept_slots_after_its_prefill(llm, reuse_layers):
    """Index reuse is over once every layer is compressed: the request decodes without the kept slots of any layer
    (held through decoding they cost 1.9 GiB at 3,295 rows of 32k, and the largest batch ran out of memory)."""
    method = ChunkKV(budget=30, window=4, reuse_layers=reuse_layers)
    method.bind(llm.config, llm.tokenizer, llm.engine.pool.page_size)
    ids, start = llm.encode(TEXT, QUESTION, chat=False)
    seq = Sequence(0, ids, SamplingParams(), SeqKV(llm.engine.pool), start)
    seq.method_state = method.new_state(seq)
    llm.engine.prefill(seq, method)
    assert seq.method_state == {} and seq.stats.extra["scored_layers"] == -(-llm.config.num_layers // reuse_layers)
    llm.engine.release(seq)


def test_per_head_chunks(llm):
    window, chunk_size = 4, 5
    positions, _, n = kept_positions(llm, ChunkKV(budget=30, window=window, chunk_size=chunk_size, per_head=True))
    assert any(not torch.equal(p[0], p[1]) for p in positions)  # the KV heads choose on their own
    for layer_positions in positions:
        for head_positions in layer_positions:
            assert_whole_chunks(head_positions, n, window, chunk_size)


def test_hybrid_uses_snapkv_in_the_upper_layers(llm):
    params = dict(budget=30, window=4)
    hybrid, extra, _ = kept_positions(llm, ChunkKV(hybrid=True, **params))
    chunkkv, _, _ = kept_positions(llm, ChunkKV(**params))
    snapkv, _, _ = kept_positions(llm, SnapKV(**params))
    half = llm.config.num_layers // 2
    assert half >= 1
    for layer, kept in enumerate(hybrid):
        assert torch.equal(kept, (chunkkv if layer < half else snapkv)[layer])
    assert any(not torch.equal(chunkkv[layer], snapkv[layer]) for layer in range(half, len(hybrid)))
    assert extra["scored_layers"] == llm.config.num_layers


def test_compare_inspect_sees_each_compressed_cache(llm):
    """`LLM.compare(inspect=...)` shows the cache each method kept, shared prefill or own (query-agnostic)."""
    methods = [ChunkKV(budget=30, window=4), ChunkKV(budget=30, window=4, query_aware=False)]
    seen = {}
    llm.compare(TEXT, methods, question=QUESTION, max_new_tokens=2, chat=False,
                inspect=lambda m, seq: seen.setdefault(id(m), [seq.kv.positions(layer).clone()
                                                               for layer in range(llm.config.num_layers)]))
    for m in methods:
        expected, _, _ = kept_positions(llm, ChunkKV(budget=30, window=4, query_aware=m.query_aware))
        assert all(torch.equal(a, b) for a, b in zip(seen[id(m)], expected))
    assert not torch.equal(seen[id(methods[0])][0], seen[id(methods[1])][0])


@pytest.mark.parametrize("neighbours", [0, 1, 3])
def test_neighbours_keep_the_chunks_beside_the_best(neighbours):
    """One token takes most of the window's attention: the paper keeps its chunk and the next best chunks anywhere;
    `neighbours` keeps the chunks on either side of it."""
    n, window, chunk_size, hit = 100, 4, 5, 52  # the hit's chunk is 10 of the 20 before the window
    probs = torch.rand(2, window, n, generator=torch.Generator().manual_seed(0)) * 0.01  # [heads, w, n]
    probs[:, :, hit] = 1.0
    fill_chunks = 2 * max(neighbours, 1) + 1
    kept = keep_chunks(probs.sum(1)[None], 1, window + fill_chunks * chunk_size, window, chunk_size, False, None,
                       neighbours)[0, 0]
    chunks = set((kept[kept < n - window] // chunk_size).tolist())
    assert 10 in chunks and len(chunks) == fill_chunks
    near = set(range(10 - neighbours, 10 + neighbours + 1))
    assert near <= chunks
    if neighbours == 0:
        assert chunks != set(range(10 - 1, 10 + 2))  # the noise picks chunks elsewhere (so the check can fail)


@pytest.mark.parametrize("params", [dict(chunk_size=0), dict(reuse_layers=0), dict(chunk_size=2.5),
                                    dict(per_head=1), dict(hybrid="yes"), dict(neighbours=-1)])
def test_bad_parameters(params):
    with pytest.raises(SemkvError, match=next(iter(params))):
        get_method("chunkkv", 64, **params)


@pytest.mark.slow
def test_index_reuse_on_the_embedded_model(smol_llm, essay_text):
    reuse, layers = 2, smol_llm.config.num_layers
    positions, extra, n = kept_positions(smol_llm, ChunkKV(budget=0.1, reuse_layers=reuse), essay_text[:4000],
                                         "What is the essay about?")
    assert extra["scored_layers"] == layers // reuse
    for layer in range(0, layers, reuse):
        assert torch.equal(positions[layer], positions[layer + 1])
        assert positions[layer].shape[1] == math.ceil(0.1 * n)
        assert_whole_chunks(positions[layer][0], n, 32, 10)

