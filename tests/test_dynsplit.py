"""DynSplit-KV: Algorithm 1, DD-Select, V2F bounds and selection, KV reuse with offload, calibration round trip."""
from __future__ import annotations

import math
import random

import pytest
import torch

import semkv
from semkv.engine.kv_cache import SeqKV
from semkv.engine.memory import held_bytes
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.methods import DynSplitKV, calibration
from semkv.kernels import reference
from semkv.methods.dynsplit import kernels as dynsplit_kernels, reference as dynsplit_reference
from semkv.methods.dynsplit.method import prefilled_state
from semkv.methods.dynsplit.split import AttentionDependency, dd_select
from semkv.methods.dynsplit.v2f import DynSplitState, block_scores, block_summaries, v2f_select
from semkv.methods.state import key_channels

TEXT = ("The cache is split into chunks. Each chunk ends at a delimiter; the weight decides which one! Does it work? "
        "Yes: it does, mostly (as far as we know).\n") * 12  # 456 tokens: each delimiter 7 times past R = 128


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=48)


def generate(llm, method, prompt=TEXT, new=10):
    return llm.generate(prompt, method=method, max_new_tokens=new, chat=False, ignore_eos=True)[0]


# -- Algorithm 1 ------------------------------------------------------------------------------------------------------

def test_algorithm1_on_a_hand_computed_map():
    attention = torch.tensor([  # causal rows, each sums to 1
        [1.0, 0, 0, 0, 0, 0],
        [0.6, 0.4, 0, 0, 0, 0],
        [0.5, 0.25, 0.25, 0, 0, 0],
        [0.4, 0.1, 0.2, 0.3, 0, 0],
        [0.5, 0.1, 0.1, 0.1, 0.2, 0],
        [0.3, 0.1, 0.1, 0.2, 0.1, 0.2],
    ])
    is_delimiter = torch.tensor([False, True, True, True, False, True])
    ids = [10, 12, 12, 12, 13, 12]
    # W = 2, R = 2. i = 2: F = {3, 4}, O = {1, 2}, D = {0}: q3 0.3 - 0.4, q4 0.2 - 0.5 -> s = -0.2
    # i = 3: F = {4, 5}, O = {2, 3}, D = {0, 1}: q4 0.2 - 0.6, q5 0.3 - 0.4 -> s = -0.25
    # i = 1 < R and i = 5 (no future query) are not scored.
    for alpha, expected in ((1.0, {2: -0.2, 3: -0.25}), (0.5, {2: 0.025, 3: 0.0})):
        dep = AttentionDependency(is_delimiter, future_window=2, overlap=2, drop_penalty=alpha, limit=6)
        dep.add_rows(attention, torch.arange(6))
        scored = {i: float(dep.sums[i] / dep.counts[i]) for i in range(6) if dep.counts[i]}
        assert scored.keys() == expected.keys()
        for i, s in expected.items():
            assert scored[i] == pytest.approx(s, abs=1e-6)
        total, count = dep.by_token(ids)[12]
        assert count == 2 and total / count == pytest.approx(sum(expected.values()) / 2, abs=1e-6)


def test_dependency_chunk_by_chunk_equals_the_full_map():
    torch.manual_seed(0)
    n, heads, kv_heads, dim = 40, 4, 2, 8
    q, keys = torch.randn(n, heads, dim), torch.randn(kv_heads, n, dim)
    is_delimiter = torch.rand(n) < 0.4
    scores = torch.einsum("qhd,hkd->hqk", q, keys.repeat_interleave(heads // kv_heads, 0)) / math.sqrt(dim)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    full_map = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1).mean(0)  # [n, n]
    whole = AttentionDependency(is_delimiter, 3, 5, 1.0, n)
    whole.add_rows(full_map, torch.arange(n))
    chunked = AttentionDependency(is_delimiter, 3, 5, 1.0, n)
    for start in range(0, n, 7):
        end = min(start + 7, n)
        chunked.observe(q[start:end], keys[:, :end], start)
    assert torch.equal(whole.counts, chunked.counts) and int(whole.counts.sum()) > 0
    assert torch.allclose(whole.sums, chunked.sums, atol=1e-6)


def test_calibration_matches_transformers_attention_maps(llm, tiny_model_dir, monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("SEMKV_CACHE_DIR", str(tmp_path))
    data = DynSplitKV.calibrate(llm, [TEXT], 400)
    ids = llm.encode(TEXT, chat=False)[0][:400]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), attn_implementation="eager").eval()
    with torch.no_grad():
        maps = hf(torch.tensor([ids]), output_attentions=True).attentions  # layers x [1, heads, n, n]
    method = DynSplitKV(budget=1.0)
    method.bind(llm.config, llm.tokenizer, 16)
    dep = AttentionDependency(torch.tensor([t in method.candidates for t in ids]), 8, 128, 1.0, len(ids))
    dep.add_rows(torch.stack(maps)[:, 0].mean((0, 1)), torch.arange(len(ids)))
    expected = {t: s / c for t, (s, c) in dep.by_token(ids).items() if c >= 5}
    assert {row["id"]: row["score"] for row in data["table"]} == pytest.approx(expected, abs=1e-4)
    weights = {int(t): w for t, w in data["weights"].items()}
    assert max(weights.values()) == 1.0 and min(weights.values()) == 0.0
    # bind reads the saved calibration back; weights="table7" ignores it
    calibration.save("dynsplit", llm.config.source, data)
    method.bind(llm.config, llm.tokenizer, 16)
    assert all(method.token_weights[t] == w for t, w in weights.items())
    table7 = DynSplitKV(budget=1.0, weights="table7")
    table7.bind(llm.config, llm.tokenizer, 16)
    assert table7.token_weights[llm.tokenizer.convert_tokens_to_ids(".")] == 1.0


# -- DD-Select --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_dd_select_respects_the_range_and_picks_the_best_delimiter(seed):
    rng = random.Random(seed)
    n, size, deviation = rng.randint(50, 400), rng.randint(2, 40), rng.randint(0, 20)
    alpha = rng.choice([0.0, 0.3, 0.5, 1.0])
    weights = [rng.choice([-1.0, -1.0, -1.0, round(rng.random(), 1)]) for _ in range(n)]
    ends = dd_select(weights, 0, size, deviation, alpha)
    start = 0
    for end in ends:
        target = start + size
        assert max(1, size - deviation) <= end - start <= size + deviation
        window = range(max(start + 1, target - deviation), target + deviation + 1)
        candidates = [e for e in window if weights[e - 1] >= 0]

        def score(e):
            return alpha * weights[e - 1] + (1 - alpha) * (1 - abs(e - target) / deviation if deviation else 1.0)

        if candidates:
            best = max(score(e) for e in candidates)
            assert weights[end - 1] >= 0 and score(end) == best
            assert end == min(e for e in candidates if score(e) == best)  # ties: the earlier boundary
        else:
            assert end == target
        start = end
    assert start + size + deviation > n  # everything that could be closed was closed
    for m in (n // 3, n // 2, n - 1):  # a prefix is split as the whole sequence is (decode recomputes the tail only)
        prefix = dd_select(weights[:m], 0, size, deviation, alpha)
        assert prefix == ends[: len(prefix)] and (prefix[-1] if prefix else 0) + size + deviation > m
    assert dd_select(weights, 0, size, deviation, alpha, fixed=True) == list(range(size, n - deviation + 1, size))


def test_incremental_split_equals_one_shot():
    rng = random.Random(3)
    tokens = [rng.choice([1, 2, 3, 4, 5, 6]) for _ in range(300)]
    method = DynSplitKV(budget=1.0, chunk_size=12, max_deviation=5)
    weights = {2: 0.9, 5: 0.3}
    one_shot, stepwise = (DynSplitState(1, weights, torch.device("cpu")) for _ in range(2))
    method._extend(one_shot, tokens)
    method._extend(stepwise, tokens[:100])
    for t in tokens[100:]:
        method._extend(stepwise, [t])
    assert stepwise.ends == one_shot.ends and len(one_shot.ends) > 10
    assert torch.equal(stepwise.labels[:300], one_shot.labels[:300])
    assert torch.equal(one_shot.labels[:300], torch.searchsorted(torch.tensor(one_shot.ends), torch.arange(300),
                                                                 right=True))


def host_split(method: DynSplitKV, ids: list[int], weights: dict[int, float] | None = None) -> DynSplitState:
    """`ids` split on the host (`split.dd_select` as tokens arrive), with the method's weights or `weights`."""
    state = DynSplitState(1, method.token_weights if weights is None else weights, torch.device("cpu"))
    method._extend(state, ids)
    return state


@pytest.mark.parametrize("params", [dict(), dict(chunk_size=4, max_deviation=3, alpha=0.9), dict(max_deviation=0),
                                    dict(split="fixed", chunk_size=5), dict(score="tokens", n_sink=2),
                                    dict(document_tokens=200)])
@pytest.mark.parametrize("graphed", [False, True])
def test_decoding_splits_on_the_device_as_the_host_does(llm, params, graphed):
    """DD-Select on the device (a decode step's layer 0, every row at once) closes after every step the chunks
    `split.dd_select` closes over the same tokens with the row's weights (per-document ones too), in eager steps and
    through the static buffers of a graphed step (padding rows beside them); the chunk counts the host learns from
    its copies are the split's at the tokens they were counted at."""
    from semkv.engine.cuda_graph import GraphRunner

    engine = llm.engine
    method = DynSplitKV(budget=40, **params)
    method.bind(llm.config, llm.tokenizer, engine.pool.page_size)
    ids = llm.encode(TEXT, chat=False)[0]
    seqs = []
    for prompt in (ids[:230], ids[40:301], ids[:217]):
        seq = Sequence(len(seqs), prompt, SamplingParams(), SeqKV(engine.pool))
        seq.method_state = method.new_state(seq)
        method.admit(seq)
        seq.output_ids.append(int(engine.prefill(seq, method).argmax()))
        seqs.append(seq)
    runner = GraphRunner(engine, method, max_pages=40) if graphed else None
    closed = 0
    for _ in range(45):
        logits = runner.decode_step(seqs) if graphed else engine.decode_step(seqs, method)
        rows = method._rows
        for seq, token in zip(seqs, logits.argmax(-1).tolist()):
            state = seq.method_state
            fed = seq.prompt_ids + seq.output_ids
            ends = host_split(method, fed, state.token_weights).ends
            assert rows.start[state.row, : len(ends) + 1].tolist() == [0, *ends]
            assert int(rows.open[state.row]) == len(ends)
            known, at = state.split_at
            assert known == len(host_split(method, fed[:at], state.token_weights).ends)
            closed = max(closed, len(ends) - len(host_split(method, seq.prompt_ids, state.token_weights).ends))
            seq.output_ids.append(token)
    assert closed >= 2 and all(s.method_state.split_at[1] > len(s.prompt_ids) for s in seqs)
    for seq in seqs:
        engine.release(seq)
    assert engine.memory().held == (0, 0, 0, 0)


# -- V2F --------------------------------------------------------------------------------------------------------------

def random_chunks(n: int, gen: torch.Generator) -> torch.Tensor:
    """Chunk label of each of n positions, chunks of random lengths 1..9."""
    lengths = torch.randint(1, 10, (n,), generator=gen)
    return torch.repeat_interleave(torch.arange(n), lengths)[:n]


@pytest.mark.parametrize("group_reduce", ["mean", "max"])
def test_v2f_bound_is_never_below_the_true_max(group_reduce):
    gen = torch.Generator().manual_seed(1)
    kv_heads, group, n, dim = 3, 1 if group_reduce == "mean" else 3, 200, 16
    keys = torch.randn(kv_heads, n, dim, generator=gen)
    labels = random_chunks(n, gen)
    n_blocks = int(labels.max()) + 1
    summaries = block_summaries(keys, labels, n_blocks, "minmax")
    for _ in range(5):
        q = torch.randn(1, kv_heads * group, dim, generator=gen)
        bound = block_scores(q, summaries[None], "minmax", group_reduce)[0]  # [kv_heads, n_blocks]
        qk = torch.einsum("hgd,hnd->hgn", q[0].view(kv_heads, group, dim), keys).amax(1)  # [kv_heads, n]
        true_max = torch.full((kv_heads, n_blocks), float("-inf")).scatter_reduce(1, labels[None].expand(kv_heads, -1),
                                                                                 qk, "amax")
        assert (bound >= true_max - 1e-4).all()
    mean = block_summaries(keys, labels, n_blocks, "mean")[0]
    assert torch.allclose(mean[:, 0], keys[:, labels == 0].mean(1), atol=1e-6)


def reference_selection(scores, labels, k, forced):
    """Per head: forced tokens, then whole chunks by descending score (equal scores: earlier chunk), each from its
    start, until k tokens."""
    batch, heads, _ = scores.shape
    mask = torch.zeros(batch, heads, labels.shape[1], dtype=torch.bool)
    for b in range(batch):
        n = int((labels[b] >= 0).sum())
        for h in range(heads):
            chosen = [t for t in range(n) if forced[b, t]]
            blocks = sorted(set(labels[b, :n].tolist()), key=lambda j: (-float(scores[b, h, j]), j))
            for j in blocks:
                for t in range(n):
                    if labels[b, t] == j and not forced[b, t] and len(chosen) < k[b]:
                        chosen.append(t)
            mask[b, h, chosen] = True
    return mask


@pytest.mark.parametrize("seed", range(4))
def test_v2f_selection_equals_a_per_block_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = [150, 97]
    labels = torch.full((2, 150), -1)
    for b, n in enumerate(lengths):
        labels[b, :n] = random_chunks(n, gen)
    n_blocks = int(labels.max()) + 1
    scores = torch.randint(0, 6, (2, 3, n_blocks), generator=gen).float()  # few values: many ties
    k = torch.tensor([40, 97 if seed == 0 else 23])
    forced = torch.zeros(2, 150, dtype=torch.bool)
    forced[0, 140:150], forced[1, :2], forced[1, 95:97] = True, True, True
    mask = v2f_select(scores, labels, k, forced)
    assert torch.equal(mask, reference_selection(scores, labels, k, forced))
    assert torch.equal(mask.sum(-1), k[:, None].expand(-1, 3))


@pytest.mark.parametrize("group_reduce, score_keys, reuse_layers", [
    ("mean", "exact", 1), ("max", "exact", 1), ("mean", "channels", 1), ("max", "channels", 1), ("mean", "pages", 1),
    ("max", "pages", 1), ("mean", "exact", 2), ("max", "pages", 2)])
def test_token_scores_take_whole_chunks_by_their_best_token(llm, group_reduce, score_keys, reuse_layers):
    """score="tokens": in every layer and KV head of a decode step the attended slots are the sinks, the recent
    window and whole chunks ranked by the best (group-reduced) query . key of their other tokens, as the per-block
    reference takes them; with score_keys="channels" the dot products of the row's key channels of the layer, the
    tokens generated before the current one scored too (n_recent=1: their kept channels are read); with "pages" and
    a superset covering every page, the same tokens as the exact keys; with reuse_layers=2 a layer after the first of
    its group attends to the very selection its group's first layer made (its query and keys)."""
    recent = dict(n_recent=1, channels=4) if score_keys == "channels" else {}
    recent |= dict(superset=100.0) if score_keys == "pages" else {}
    method = DynSplitKV(budget=40, chunk_size=6, max_deviation=3, n_sink=2, score="tokens", group_reduce=group_reduce,
                        score_keys=score_keys, reuse_layers=reuse_layers, **recent)
    method.bind(llm.config, llm.tokenizer, llm.engine.pool.page_size)
    engine, seen = llm.engine, {}
    select = method.select

    def recording(layer, batch, q):
        seen[layer] = (q.clone(), select(layer, batch, q))
        return seen[layer][1]

    method.select = recording
    seq = Sequence(0, llm.encode(TEXT, chat=False)[0][:200], SamplingParams(), SeqKV(engine.pool))
    seq.method_state = state = method.new_state(seq)
    seq.output_ids.append(int(engine.prefill(seq, method).argmax()))
    for _ in range(3):  # the last step is checked
        seq.output_ids.append(int(engine.decode_step([seq], method).argmax()))
    fed = seq.prompt_ids + seq.output_ids[:-1]  # the last step's token is the one before its output
    split = host_split(method, fed)
    n, k = len(fed), min(method.budget, len(fed))
    labels = split.labels[:n].clone()[None]  # [1, n]
    forced = torch.zeros(1, n, dtype=torch.bool)
    forced[0, :2], forced[0, n - method.n_recent:] = True, True
    kv_heads = llm.config.num_kv_heads
    assert sorted(seen) == list(range(llm.config.num_layers))
    for layer, (_, selection) in seen.items():
        first = layer - layer % reuse_layers  # the layer that selected
        if layer != first:
            assert selection is seen[first][1]
        q = seen[first][0]
        keys = seq.kv.gather(first, seq.kv.all_slots(first))[0].float()  # [kv_heads, n, D]
        q = q[0].float().view(kv_heads, -1, q.shape[-1])  # [kv_heads, group, D]
        if score_keys == "channels":
            chosen = method._rows.channels[state.row, first]  # [kv_heads, channels]
            assert chosen.shape == (kv_heads, 4) and chosen.unique().numel() > 1
            keys, q = keys.gather(2, chosen[:, None].expand(-1, n, -1)), q.gather(2, chosen[:, None].expand_as(
                q[..., :4]))
        dots = torch.einsum("hgd,hnd->hgn", q, keys)
        dots = dots.mean(1) if group_reduce == "mean" else dots.amax(1)
        dots = dots.masked_fill(forced, float("-inf"))
        scores = torch.full((kv_heads, int(labels.max()) + 1), float("-inf")).scatter_reduce(
            1, labels.expand(kv_heads, -1), dots, "amax")[None]
        want = reference_selection(scores, labels, torch.tensor([k]), forced)
        got = torch.zeros_like(want)
        for h in range(kv_heads):
            got[0, h, selection.slots[0, h, : selection.lengths[0, h]]] = True
        assert torch.equal(got, want), layer
    engine.release(seq)


def test_page_scores_score_only_the_best_bounded_pages(llm):
    """score_keys="pages": after prefill and decode steps each page's summaries are the min / max of its keys; a step
    scores only the tokens of the pages with the highest Quest bound (about `superset` times the budget's tokens
    between the sinks and the recent window): its chunk scores are the per-block reference's over those pages'
    tokens; the summaries are counted by page; a covering budget gives Full KV's tokens."""
    method = DynSplitKV(budget=40, chunk_size=6, max_deviation=3, n_sink=2, score="tokens", score_keys="pages",
                        superset=1.0)
    method.bind(llm.config, llm.tokenizer, llm.engine.pool.page_size)
    engine, calls = llm.engine, []
    chunk_best = dynsplit_kernels.chunk_best

    def recording(q, keys, tables, chunk_of, lo, hi, chunks, group_reduce, kept=None):
        calls.append((q.clone(), tables.clone(), chunk_of.clone(), lo.clone(), hi.clone(), chunks, kept.clone()))
        return chunk_best(q, keys, tables, chunk_of, lo, hi, chunks, group_reduce, kept)

    seq = Sequence(0, llm.encode(TEXT, chat=False)[0][:200], SamplingParams(), SeqKV(engine.pool))
    seq.method_state = method.new_state(seq)
    seq.output_ids.append(int(engine.prefill(seq, method).argmax()))
    seq.output_ids.append(int(engine.decode_step([seq], method).argmax()))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dynsplit_kernels, "chunk_best", recording)
        seq.output_ids.append(int(engine.decode_step([seq], method).argmax()))
    pool, size = engine.pool, engine.pool.page_size
    summaries = method._rows.page_summaries.data
    n = seq.kv.num_slots[0]  # the last step's slots, its own token included
    assert len(calls) == llm.config.num_layers
    for layer, (q, tables, chunk_of, lo, hi, chunks, kept) in enumerate(calls):
        for p in range(-(-n // size)):  # every key stored, the step's own folded in by the bound kernel
            page, filled = seq.kv.pages[layer, p], min(size, n - p * size)
            assert torch.equal(summaries["min"][page], pool.k[page, :filled].amin(0))
            assert torch.equal(summaries["max"][page], pool.k[page, :filled].amax(0))
        width = -(-n // size)
        bound = reference.page_bound(q, summaries["min"], summaries["max"], tables[:, :width], torch.tensor([n]),
                                     size, "mean")
        count = min(width, -(-40 // size) + 2)
        _, pages, _ = reference.page_candidates(bound, lo, hi, tables[:, :width], size, count)
        assert set(torch.nonzero(kept[0]).flatten().tolist()) == set(pages[0].tolist()), layer
        got = chunk_best(q, pool.k, tables, chunk_of, lo, hi, chunks, "mean", kept)
        assert torch.equal(got, dynsplit_reference.chunk_best(q, pool.k, tables, chunk_of, lo, hi, chunks, "mean",
                                                              kept))
        every = dynsplit_reference.chunk_best(q, pool.k, tables, chunk_of, lo, hi, chunks, "mean")
        assert (got <= every).all() and not torch.equal(got, every)  # fewer tokens scored: some chunks lower
    engine.release(seq)
    assert method.page_state_bytes(pool) == 2 * llm.config.num_kv_heads * llm.config.head_dim * pool.k.element_size()
    full = llm.generate(TEXT[:400], method="full", max_new_tokens=6, chat=False, ignore_eos=True)
    covering = llm.generate(TEXT[:400], method=DynSplitKV(budget=4096, score="tokens", score_keys="pages"),
                            max_new_tokens=6, chat=False, ignore_eos=True)
    assert covering[0].token_ids == full[0].token_ids
    for params in (dict(score_keys="pages"), dict(score="tokens", score_keys="pages", superset=0.5)):
        with pytest.raises(semkv.SemkvError, match="pages|superset"):
            DynSplitKV(budget=40, **params)


def test_key_channels_are_the_pairs_that_rank_tokens():
    """`key_channels.choose` keeps whole rotary pairs (d, d + D/2), ranked by the variation of q . k they carry: a pair
    with large but constant keys ranks no token and is left out; a pair the queries ignore is left out too."""
    torch.manual_seed(0)
    n, dim = 500, 8  # pairs (0, 4), (1, 5), (2, 6), (3, 7)
    keys = torch.randn(2, n, dim) * 0.1
    keys[:, :, 0] += 100.0  # pair 0: large, constant
    keys[:, :, [1, 5]] *= 30  # pair 1: varies, the queries weigh it
    keys[:, :, [2, 6]] *= 60  # pair 2: varies most, the queries of KV head 0 ignore it
    keys[:, :, [3, 7]] *= 5  # pair 3: varies a little
    q = torch.ones(6, 4, dim)  # [w, heads, D]: 2 heads a KV group
    q[:, :2, [2, 6]] = 0.0
    chosen = key_channels.choose(q, keys, 4, mean=True)
    assert chosen.tolist() == [[1, 3, 5, 7], [1, 2, 5, 6]]
    assert key_channels.choose(q, keys, 2, mean=False).tolist() == [[1, 5], [2, 6]]


def test_key_channels_need_token_scores_and_fit_the_head(llm):
    for params in (dict(score_keys="channels"), dict(score="tokens", score_keys="channels", n_recent=0),
                   dict(score="tokens", score_keys="channels", channels=3)):
        with pytest.raises(semkv.SemkvError, match="channels"):
            DynSplitKV(budget=40, **params)
    method = DynSplitKV(budget=40, score="tokens", score_keys="channels", channels=2 * llm.config.head_dim)
    with pytest.raises(semkv.SemkvError, match="head_dim"):
        method.bind(llm.config, llm.tokenizer, 16)


def test_token_scores_need_resident_keys():
    for params in (dict(offload=True), dict(pooling="mean")):
        with pytest.raises(semkv.SemkvError, match="score='tokens'"):
            DynSplitKV(budget=40, score="tokens", **params)
    with pytest.raises(semkv.SemkvError, match="reuse_layers=2 needs score='tokens'"):
        DynSplitKV(budget=40, reuse_layers=2)
    with pytest.raises(semkv.SemkvError, match="reuse_layers"):
        DynSplitKV(budget=40, score="tokens", reuse_layers=0)


# -- KV reuse and offload ---------------------------------------------------------------------------------------------

def test_offload_equals_device_resident_and_holds_only_the_budget_on_the_device(llm):
    """Offload gives the resident tokens (same selection over virtual slots); the device holds the working set and
    the tail, not the context; each selected offloaded token was found in the working set or loaded from the host,
    tokens kept selected are not loaded again, and the bytes moved are the loads and the offloaded tokens."""
    new, budget = 40, 40
    device = generate(llm, DynSplitKV(budget=budget), new=new)
    method = DynSplitKV(budget=budget, offload=True, offload_chunk=4)
    offload = generate(llm, method, new=new)
    assert offload.token_ids == device.token_ids
    s, layers, heads, dim = offload.stats, llm.config.num_layers, llm.config.num_kv_heads, llm.config.head_dim
    found, loaded = s.extra["kv_reused"], s.extra["kv_reloaded"]
    assert 0 < loaded and 0 < found  # the working set is reused across steps
    assert found + loaded <= (new - 1) * layers * heads * budget
    assert s.h2d_bytes == loaded * (2 * dim * 4 + 4)  # key and value in float32, and the position
    page = llm.engine.pool.page_size
    bound = method.device_tokens(s.prompt_tokens, new, page)  # working set to a page boundary, tail, a page leaving
    assert bound == 48 + 31 + 16
    assert s.kv_resident_tokens <= bound < device.stats.kv_resident_tokens
    tail = s.prompt_tokens - (s.prompt_tokens - 31)  # the prompt's last chunk_size + max_deviation + 1 tokens stay
    left = new - 1 - (new - 1) % page  # generated tokens that left the tail, a page at a time
    assert s.d2h_bytes == (s.prompt_tokens - tail + left) * layers * heads * 2 * dim * 4


def test_an_offloaded_prefill_holds_one_layer_of_the_prompt_at_a_time(tiny_model_dir):
    """With the split known before the prompt is read, each layer's summaries and offload happen as soon as the
    layer is computed: a prompt of one chunk never has more than one layer's whole prompt on the device (the others
    hold their bound), and the tokens are the resident ones."""
    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=512)  # TEXT's 456 tokens in one chunk
    resident = generate(llm, DynSplitKV(budget=40), new=20)
    llm.engine.pool.peak_in_use = 0
    method = DynSplitKV(budget=40, offload=True, offload_chunk=16)
    offload = generate(llm, method, new=20)
    assert offload.token_ids == resident.token_ids
    page, layers, n = llm.engine.pool.page_size, llm.config.num_layers, offload.stats.prompt_tokens
    bound = method.device_tokens(n, 20, page)
    assert llm.engine.pool.peak_in_use <= -(-n // page) + (layers - 1) * -(-bound // page) < layers * -(-n // page)
    assert llm.engine.pool.in_use == 0


def test_mean_pooling_selects_sequence_by_sequence(llm):
    """Mean pooling (Appendix A.2) takes the per-sequence path: a budget covering the context gives Full KV's tokens,
    a small one attends the budget."""
    full = generate(llm, "full")
    assert generate(llm, DynSplitKV(budget=10**5, pooling="mean")).token_ids == full.token_ids
    small = generate(llm, DynSplitKV(budget=40, pooling="mean", group_reduce="max"))
    assert small.stats.kv_attended_max <= 40 < full.stats.kv_attended_max


def test_offload_needs_minmax_pooling():
    with pytest.raises(semkv.SemkvError, match="pooling='minmax'"):
        DynSplitKV(budget=40, offload=True, pooling="mean")


def test_device_rows_are_taken_at_admission_and_cost_what_was_announced(llm):
    """The batched path's rows (chunk summaries, starts, reuse counters) and the stamps beside the pool are allocated when
    the request is admitted, by exactly the bytes `admission_bytes` announced (the engine admits on that number);
    a second request of the same length then fits in the slack. Without `count_reuse` there are no stamps."""
    plain = DynSplitKV(budget=40)
    plain.bind(llm.config, llm.tokenizer, llm.engine.pool.page_size)
    assert plain.page_state_bytes(llm.engine.pool) == 0
    method = DynSplitKV(budget=40, count_reuse=True)
    method.bind(llm.config, llm.tokenizer, llm.engine.pool.page_size)
    ids = llm.encode(TEXT, chat=False)[0]
    seqs = [Sequence(i, ids, SamplingParams(max_new_tokens=10), SeqKV(llm.engine.pool)) for i in range(2)]
    for seq in seqs:
        seq.method_state = method.new_state(seq)
    def held() -> int:  # what the engine measures of the rows, stamps included
        return held_bytes([method._rows], llm.engine.device)[0]

    before, growth = held(), method.admission_bytes(seqs[0])
    assert seqs[0].method_state.row == 0 and before < growth // 20  # the padding row (its delimiter weights)
    method.admit(seqs[0])
    pool = llm.engine.pool
    stamps = pool.coverage * pool.page_size * pool.num_kv_heads * 4  # the page ids handed out, not the pool
    assert held() == growth and method._rows.stamps.data.nbytes == stamps
    assert method.admission_bytes(seqs[1]) == 0
    method.admit(seqs[1])
    assert [s.method_state.row for s in seqs] == [1, 2] and held() == growth


def test_per_document_weights(llm):
    method = DynSplitKV(budget=1.0, document_tokens=400)
    method.bind(llm.config, llm.tokenizer, 16)
    assert method.own_prefill(False) and not DynSplitKV(budget=1.0).own_prefill(False)
    ids = llm.encode(TEXT, chat=False)[0]
    state = prefilled_state(llm, method, ids)
    changed = {t for t, w in state.token_weights.items() if w != method.token_weights[t]}
    assert changed and changed <= set(ids[128:400])
    assert generate(llm, method).token_ids == generate(llm, "full").token_ids


@pytest.mark.parametrize("params", [dict(chunk_size=0), dict(max_deviation=-1), dict(alpha=1.5),
                                    dict(split="sentences"), dict(weights="learned"), dict(pooling="max"),
                                    dict(document_tokens=64), dict(offload=1), dict(delimiters="")])
def test_bad_parameters_are_rejected(params):
    with pytest.raises(semkv.SemkvError):
        DynSplitKV(budget=0.1, **params)


@pytest.mark.slow
def test_embedded_model_offload_equals_device_and_full_budget_is_exact(smol_llm, essay_text):
    doc = essay_text[:3000] + " The secret passkey is 73914. Remember it. " + essay_text[3000:4500]
    question = "What is the secret passkey? Answer with the number only."
    methods = [DynSplitKV(budget=0.2), DynSplitKV(budget=0.2, offload=True), DynSplitKV(budget=1.0, offload=True)]
    full, device, offload, exact = smol_llm.compare(doc, [semkv.methods.FullKV()] + methods, question=question,
                                                    max_new_tokens=12)
    assert exact.token_ids == full.token_ids
    assert offload.token_ids == device.token_ids
    assert device.stats.kv_attended_max <= math.ceil(0.2 * (device.stats.prompt_tokens + 12))
