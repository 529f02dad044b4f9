"""SentenceKV: sentence buckets on real text, the prefill pre-filter, real offload with bounded device memory."""
from __future__ import annotations

import math
import random
import re

import pytest
import torch

import semkv
from conftest import FIXTURES, tiny_hf_config
from semkv.engine.kv_cache import SeqKV
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.errors import SemkvError
from semkv.methods import SentenceKV, get_method
from semkv.methods.sentencekv.buckets import bucket_of
from semkv.methods.sentencekv.sentences import SentenceRule, is_terminal, length_limit, segment
from semkv.methods.sentencekv.vocab import token_texts, vocab_mask

BOOK = FIXTURES / "books" / "pg1661_adventures_of_sherlock_holmes.txt"


def book_text(chars: int, start: float = 0.5) -> str:
    raw = BOOK.read_text(encoding="utf-8-sig")
    text = raw[int(len(raw) * start):][:chars]
    return text[text.index("\n\n") + 2:]


@pytest.fixture(scope="module")
def tokenizer(tiny_llm):
    return tiny_llm.tokenizer  # the embedded model's tokenizer


@pytest.fixture(scope="module")
def long_llm(tmp_path_factory, tokenizer):
    """A tiny random Llama that takes 8k+ prompts."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_hf_config("llama", len(tokenizer))
    config.max_position_embeddings = 16384
    path = tmp_path_factory.mktemp("tiny-long")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return semkv.LLM(path, device="cpu")


def test_vocabulary_scan_finds_merged_punctuation(tokenizer):
    texts = token_texts(tokenizer)
    assert len(texts) == len(tokenizer) and token_texts(tokenizer) is texts  # cached per tokenizer
    terminal = vocab_mask(tokenizer, is_terminal)
    merged = [i for i, t in enumerate(texts) if terminal[i] and t.strip() not in (".", "!", "?")]
    assert len(merged) > 20  # '."', '.\n', '?)', ... that a fixed list of strings would miss
    for text in ('said "Stop."', "(the end).", 'Why?"'):
        assert terminal[tokenizer(text)["input_ids"][-1]]


def test_sentence_ends_match_the_text(tokenizer):
    """Bucket ends on a real book fall exactly where a character-level sentence splitter puts them."""
    text = book_text(20000)
    enc = tokenizer(text, return_offsets_mapping=True)
    ends = SentenceRule.for_tokenizer(tokenizer).ends(torch.tensor(enc["input_ids"]))
    got = {len(text[: enc["offset_mapping"][i][1]].rstrip()) for i in ends.nonzero().flatten().tolist()}
    expected = {m.end() for m in re.finditer(r"[.!?…][\"'”’)\]]*(?=\s)", text)}  # punctuation, then whitespace
    expected |= {len(text[: m.start()].rstrip()) for m in re.finditer(r"\n[ \t\r]*\n", text)}  # blank lines
    expected.add(len(text.rstrip()))
    assert len(expected) > 100 and got == expected


def test_the_decode_step_scan_equals_the_rule(tokenizer):
    """`SentenceScan`, the rule a token at a time that a decode step runs, says at every token exactly what `ends`
    says of the window (open sentence + next token): over a book passage with a special token and an id past the
    vocabulary, and over a shuffle of the same ids (closers, whitespace and newlines in every order)."""
    rule = SentenceRule.for_tokenizer(tokenizer)
    ids = tokenizer(book_text(6000))["input_ids"]
    ids[400:400] = [tokenizer.eos_token_id]
    ids[900:900] = [len(tokenizer) + 5]
    shuffled = ids[:]
    random.Random(0).shuffle(shuffled)
    for text in (ids, shuffled):
        start, scan, ended_count = 0, rule.scan(), 0
        scan.push(text[0])
        for i in range(1, len(text)):
            ended = scan.push(text[i])
            assert ended == bool(rule.ends(torch.tensor(text[start : i + 1]))[-2]), i
            if ended:
                start, scan = i, rule.scan()
                scan.push(text[i])
                ended_count += 1
        assert ended_count > 20


def test_text_without_punctuation_is_split_into_bounded_pieces(tokenizer):
    rule = SentenceRule.for_tokenizer(tokenizer)
    words = re.sub(r"[^A-Za-z ]+", " ", book_text(8000))
    ids = tokenizer(words)["input_ids"]
    starts, limit = segment(ids, rule, split_std=3.0, max_sentence=50)
    lengths = torch.diff(torch.tensor(starts + [len(ids)]))
    assert limit == 50 and int(lengths.max()) <= 50 and len(starts) == math.ceil(len(ids) / 50)
    assert int(lengths.max()) - int(lengths.min()) <= 1  # near-equal pieces


def test_outlier_sentences_split_at_mean_plus_n_std(tokenizer):
    rule = SentenceRule.for_tokenizer(tokenizer)
    prose = book_text(6000)
    run_on = re.sub(r"[^A-Za-z ]+", " ", book_text(3000, start=0.2))  # one very long "sentence"
    ids = tokenizer(prose + " " + run_on + ".")["input_ids"]
    plain = segment(ids, rule, split_std=1e9, max_sentence=10**6)[0]
    lengths = torch.diff(torch.tensor(plain + [len(ids)])).float()
    limit = math.floor(float(lengths.mean() + 2.0 * lengths.std(unbiased=False)))
    starts, got_limit = segment(ids, rule, split_std=2.0, max_sentence=10**6)
    assert got_limit == limit == length_limit(torch.tensor(plain), len(ids), 2.0, 10**6)
    assert int(lengths.max()) > limit  # the run-on sentence is an outlier...
    assert int(torch.diff(torch.tensor(starts + [len(ids)])).max()) <= limit  # ...and was split
    assert set(plain) <= set(starts)  # real sentence ends are kept


def test_retained_set_is_the_top_importances(tiny_llm):
    """Direct transcription: attention of the last N prompt queries, summed over the window and the query heads of
    each KV group; the top floor(r * budget) middle tokens per KV head go to the host store."""
    llm, budget, window = tiny_llm, 64, 32
    ids = llm.tokenizer(book_text(3000))["input_ids"][:600]
    method = SentenceKV(budget=budget, offload=True)
    method.bind(llm.config, llm.tokenizer, llm.engine.pool.page_size)
    params = SamplingParams(max_new_tokens=8)
    base = Sequence(0, ids, params, SeqKV(llm.engine.pool))
    llm.engine.prefill(base, get_method("full"), record_window=window)
    seq = llm.engine.fork(base, 1)
    llm.engine.apply_prefill(seq, method)
    state, n = seq.method_state, len(ids)
    n_keep = int(2.0 * budget)
    group = llm.config.num_heads // llm.config.num_kv_heads
    for layer in range(llm.config.num_layers):
        q = base.window_queries[layer]  # [w, heads, D]
        k = base.kv.keys(layer).repeat_interleave(group, dim=0)  # [heads, n, D]
        logits = torch.einsum("whd,hnd->hwn", q, k) / math.sqrt(q.shape[-1])
        future = torch.arange(n)[None, :] > torch.arange(n - window, n)[:, None]
        probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
        importance = probs.sum(1).view(-1, group, n).sum(1)  # [kv_heads, n]
        middle = importance[:, state.n_sink : n - state.n_recent]
        top = torch.topk(middle, n_keep).indices + state.n_sink
        stored = state.store.pos[layer][:, :n_keep]
        for head in range(top.shape[0]):
            assert set(top[head].tolist()) == set(stored[head].tolist())
        assert torch.equal(stored, stored.sort(dim=1).values)  # position order per head
    llm.engine.release(base)
    llm.engine.release(seq)


def test_retain_sentences_keeps_whole_sentences(tiny_llm):
    """retain="sentences": the retained tokens of a KV head are whole sentences (the last one may be cut), the best
    ones first; the paper's top tokens cut sentences (so the check can fail)."""
    llm, budget = tiny_llm, 64
    ids = llm.tokenizer(book_text(3000))["input_ids"][:600]
    cut = {}
    for retain in ("tokens", "sentences"):
        method = SentenceKV(budget=budget, offload=True, retain=retain)
        method.bind(llm.config, llm.tokenizer, llm.engine.pool.page_size)
        seq = Sequence(0, ids, SamplingParams(max_new_tokens=8), SeqKV(llm.engine.pool))
        seq.method_state = method.new_state(seq)
        llm.engine.prefill(seq, method)
        state = seq.method_state
        sizes = torch.diff(torch.tensor(state.starts))
        cut[retain] = 0
        for layer in range(llm.config.num_layers):
            for head in state.store.pos[layer][:, : state.retained]:
                buckets, counts = bucket_of(torch.tensor(state.starts), head).unique(return_counts=True)
                cut[retain] += int((counts < sizes[buckets]).sum())
                assert head.shape[0] == int(2.0 * budget)
        if retain == "sentences":
            per_head = llm.config.num_layers * llm.config.num_kv_heads
            assert cut[retain] <= per_head  # at most the last sentence of each head
        llm.engine.release(seq)
    assert cut["tokens"] > cut["sentences"]


def test_token_scores_rank_sentences_by_their_best_retained_token(tiny_llm):
    """score="tokens": each layer and KV head attends its sinks, its recent window and whole retained sentences in
    the order of their best retained token's dot product with the query (the group's mean query), the last one cut
    to its leading tokens; the sentence-vector ranking of the paper chooses differently (so the check can fail)."""
    llm, budget = tiny_llm, 64
    ids = llm.tokenizer(book_text(3000))["input_ids"][:600]
    differ = 0
    for score in ("tokens", "vector"):
        method = SentenceKV(budget=budget, query="current", retain="sentences", score=score)
        method.bind(llm.config, llm.tokenizer, llm.engine.pool.page_size)
        seen, select = {}, method.select

        def recording(layer, batch, q):
            seen[layer] = (q.clone(), select(layer, batch, q))
            return seen[layer][1]

        method.select = recording
        seq = Sequence(0, ids, SamplingParams(max_new_tokens=8), SeqKV(llm.engine.pool))
        seq.method_state = st = method.new_state(seq)
        method.admit(seq)
        seq.output_ids.append(int(llm.engine.prefill(seq, method).argmax()))
        seq.output_ids.append(int(llm.engine.decode_step([seq], method).argmax()))
        kv_heads, n = llm.config.num_kv_heads, seq.kv.num_slots[0]
        for layer, (q, selection) in seen.items():
            keys = seq.kv.gather(layer, seq.kv.all_slots(layer))[0][:, st.n_sink : st.n_sink + st.retained].float()
            query = q[0].float().view(kv_heads, -1, q.shape[-1]).mean(1)  # [kv_heads, D]
            dots = torch.einsum("hd,hnd->hn", query, keys)  # [kv_heads, retained]
            bucket = method._rows.bucket[layer, st.row, :, : st.retained]
            for h in range(kv_heads):
                best = {}
                for t, j in enumerate(bucket[h].tolist()):
                    best[j] = max(best.get(j, float("-inf")), float(dots[h, t]))
                chosen = []
                for j in sorted(best, key=lambda j: (-best[j], j)):
                    chosen += [t for t in range(st.retained) if bucket[h, t] == j]
                want = (list(range(st.n_sink)) + sorted(st.n_sink + t for t in chosen[: st.capacity])
                        + list(range(n - st.n_recent, n)))
                got = selection.slots[0, h, : selection.lengths[0, h]].tolist()
                if score == "tokens":
                    assert got == want, (layer, h)
                else:
                    differ += got != want
        llm.engine.release(seq)
    assert differ


def prefilled_rows(llm, method, length: int, max_new_tokens: int) -> list[Sequence]:
    """Two requests of `length` and `length` + 37 tokens of the book, admitted under `method` and prefilled, with
    their first tokens."""
    seqs = []
    for i, start in enumerate((0.2, 0.6)):
        ids = llm.tokenizer(book_text(2500, start=start))["input_ids"][:length + 37 * i]
        seq = Sequence(i, ids, SamplingParams(max_new_tokens=max_new_tokens), SeqKV(llm.engine.pool))
        seq.method_state = method.new_state(seq)
        method.admit(seq)
        seq.output_ids.append(int(llm.engine.prefill(seq, method).argmax()))
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("offload, score", [(False, "vector"), (True, "vector"), (False, "tokens")])
def test_tokens_leaving_the_recent_window_join_the_bucket_of_their_position(tiny_llm, offload, score):
    """Every `offload_chunk` steps the oldest tokens of each row's recent window join their buckets (the prompt's
    last sentences, then the generated text's, bucketed as it is generated), two rows at a time: the bucket map of
    every retained token, on the device, is the bucket of its position by the sentence starts (also with offload,
    where the positions come from the host store, and with score="tokens", which keeps no sentence vectors)."""
    llm = tiny_llm
    page = llm.engine.pool.page_size
    method = SentenceKV(budget=64, n_sink=4, n_recent=8, offload=offload, offload_chunk=page if offload else 4,
                        score=score)
    method.bind(llm.config, llm.tokenizer, page)
    seqs = prefilled_rows(llm, method, 400, 60)
    with torch.inference_mode():
        for _ in range(40):
            llm.engine.step(seqs, method, None, lambda seq: "")
    for seq in seqs:
        st = seq.method_state
        assert st.retained > int(method.keep_factor * st.budget)  # tokens left the window and joined
        for layer in range(llm.config.num_layers):
            if offload:
                positions = st.store.pos[layer, :, : st.retained]  # [kv_heads, retained]
            else:
                slots = torch.arange(st.n_sink, st.n_sink + st.retained)
                positions = seq.kv.gather(layer, slots[None].expand(llm.config.num_kv_heads, -1))[2]
            want = bucket_of(torch.tensor(st.starts), positions)
            assert torch.equal(method._rows.bucket[layer, st.row, :, : st.retained].long(), want), layer
            count = method._rows.count[layer, st.row]  # [kv_heads, buckets]: every retained token counted once
            assert torch.equal(count.long(), torch.stack([w.bincount(minlength=count.shape[-1]) for w in want]))
            if score == "vector" and not offload:  # each bucket's vector: the mean of its retained keys
                keys = seq.kv.gather(layer, slots[None].expand(llm.config.num_kv_heads, -1))[0].float()
                sums = torch.zeros(*count.shape, keys.shape[-1]).index_put_(
                    (torch.arange(count.shape[0])[:, None], want), keys, accumulate=True)
                means = sums / count.clamp(min=1)[..., None]
                torch.testing.assert_close(method._rows.vectors[layer, st.row], means, rtol=1e-4, atol=1e-5)
    llm.engine.end(seqs, method)


def test_a_generating_row_never_grows_the_device_state(tiny_llm):
    """Admission makes room in the device rows for every token a request may generate (each may join the retained
    tokens and, with score="tokens", start a bucket), so no decode step grows them: a growth moves the tensors and
    makes every row's captured steps be captured again (`graph_epoch`)."""
    llm = tiny_llm
    method = SentenceKV(budget=64, n_sink=4, n_recent=8, offload_chunk=4, score="tokens", max_sentence=2)
    method.bind(llm.config, llm.tokenizer, llm.engine.pool.page_size)
    seqs = prefilled_rows(llm, method, 300, 320)
    epoch, sizes = method.graph_epoch, method._rows.sizes()
    starts = [len(seq.method_state.starts) for seq in seqs]
    with torch.inference_mode():
        for _ in range(318):
            llm.engine.step(seqs, method, None, lambda seq: "")
    # buckets of at most 2 tokens: generated text starts a bucket every other token or sooner (more than the rows'
    # slack of 64), and 300 tokens left each recent window into the retained region (more than its slack of 256)
    assert all(len(seq.method_state.starts) >= n + 150 for seq, n in zip(seqs, starts))
    assert all(seq.method_state.retained >= int(method.keep_factor * seq.method_state.budget) + 300 for seq in seqs)
    assert method.graph_epoch == epoch and method._rows.sizes() == sizes
    llm.engine.end(seqs, method)


@pytest.mark.parametrize("query", ["current", "mean"])
def test_the_step_plan_is_sent_again_only_when_its_values_change(tiny_llm, query):
    """Without query="mean" a row's plan changes only when tokens join its buckets (every `offload_chunk` steps): the
    steps between reuse the last plan (the same values); with query="mean" the count of the open sentence's queries
    changes every step, and so does the plan."""
    llm = tiny_llm
    method = SentenceKV(budget=64, n_sink=4, n_recent=8, offload_chunk=4, score="tokens", query=query)
    method.bind(llm.config, llm.tokenizer, llm.engine.pool.page_size)
    seqs = prefilled_rows(llm, method, 300, 40)
    plans, sent = [], []
    step_plan = method.step_plan

    def recording(batch):
        plan = step_plan(batch)
        plans.append(plan)
        sent.append(plan.packed.clone())
        return plan

    method.step_plan = recording
    with torch.inference_mode():
        for _ in range(12):
            llm.engine.step(seqs, method, None, lambda seq: "")
    new = [i for i in range(1, len(plans)) if plans[i] is not plans[i - 1]]
    if query == "mean":
        assert len(new) == len(plans) - 1
    else:
        assert 1 <= len(new) <= 4  # tokens join every 4 steps
        assert all(torch.equal(sent[i], sent[i - 1]) for i in range(1, len(plans)) if i not in new)
        assert all(not torch.equal(sent[i], sent[i - 1]) for i in new)
    llm.engine.end(seqs, method)


def test_token_scores_keep_no_sentence_vectors_so_more_rows_fit(tiny_llm):
    """score="tokens" ranks buckets by their retained keys in the cache, so its rows hold no sentence vectors (a
    float32 mean key per bucket, KV head and layer): a row holds a fraction of the bytes, and what admission and
    `--batches max` count for a batch of such requests shrinks alike."""
    llm = tiny_llm
    ids = llm.tokenizer(book_text(3000))["input_ids"][:600]
    row, batch = {}, {}
    for score in ("vector", "tokens"):
        method = SentenceKV(budget=64, score=score, retain="sentences")
        method.bind(llm.config, llm.tokenizer, llm.engine.pool.page_size)
        seq = Sequence(0, ids, SamplingParams(max_new_tokens=4), SeqKV(llm.engine.pool))
        seq.method_state = method.new_state(seq)
        batch[score] = method.batch_state_bytes(seq, 16)
        method.admit(seq)
        llm.engine.prefill(seq, method)
        assert (method._rows.vectors is None) == (score == "tokens")
        row[score] = method._rows.row_bytes()
        llm.engine.release(seq)
    assert row["tokens"] * 3 < row["vector"] and batch["tokens"] * 3 < batch["vector"]


def test_token_scores_need_resident_keys():
    with pytest.raises(SemkvError, match="score='tokens'"):
        SentenceKV(budget=40, score="tokens", offload=True)


def test_offload_gives_the_same_tokens_as_resident_selection(tiny_llm):
    text = book_text(2500)
    runs = {}
    for offload in (False, True):
        out = tiny_llm.generate(text, method="sentencekv", budget=96, max_new_tokens=40, chat=False,
                                ignore_eos=True, method_params=dict(offload=offload))[0]
        runs[offload] = out
    assert runs[True].token_ids == runs[False].token_ids
    on, off = runs[True].stats, runs[False].stats
    assert on.h2d_bytes > 0 and on.d2h_bytes > 0 and off.h2d_bytes == 0
    assert on.kv_resident_tokens < off.kv_resident_tokens
    assert on.kv_attended_max <= 96 and off.kv_attended_max <= 96


def test_device_memory_is_bounded_while_generating(long_llm):
    """8k-token prompt, 256 new tokens, offload on: pages in use after prefill stay within sinks + working set +
    recent window (+ the tokens waiting to be offloaded); host-to-device bytes per step are bounded."""
    llm = long_llm
    pool, cfg = llm.engine.pool, llm.config
    ids = llm.tokenizer(book_text(60000, start=0.1))["input_ids"][:8192]
    assert len(ids) == 8192
    budget, new = 256, 256
    method = SentenceKV(budget=budget, offload=True)
    method.bind(cfg, llm.tokenizer, pool.page_size)
    seq = Sequence(0, ids, SamplingParams(max_new_tokens=new, ignore_eos=True), SeqKV(pool))
    seq.method_state = state = method.new_state(seq)  # the engine drops it from the request when it ends
    first = llm.engine.prefill(seq, method)
    pool.peak_in_use = pool.in_use
    with torch.inference_mode():
        llm.engine.generate([seq], method, [first], lambda s: "length" if len(s.output_ids) >= new else "")
    stats = seq.stats
    # slots per layer and KV head: the budget, the working set's room beyond a step's selection (cache_factor 1.5)
    bound = budget + state.cache - state.capacity + method.offload_chunk
    assert state.cache - state.capacity >= state.capacity // 2 - pool.page_size
    assert stats.extra["kv_device_peak"] <= bound
    assert pool.peak_in_use <= cfg.num_layers * math.ceil(bound / pool.page_size)
    kept = int(method.keep_factor * budget)
    left_window = new - 1 - (new - 1) % method.offload_chunk  # tokens that left the window, offloaded in chunks
    assert all(state.store.size(layer) == kept + left_window for layer in range(cfg.num_layers))
    assert sum(start >= len(ids) for start in state.starts) > 1  # generated text is bucketed too
    full_reload = cfg.num_layers * cfg.num_kv_heads * state.capacity * 2 * cfg.head_dim * 4
    assert 0 < stats.extra["h2d_bytes_step_max"] <= full_reload
    assert stats.h2d_bytes / (new - 1) < full_reload  # loaded buckets stay cached between steps
    print(f"\nh2d bytes/step mean {stats.h2d_bytes / (new - 1):.0f}, max {stats.extra['h2d_bytes_step_max']}, "
          f"full working-set reload {full_reload}; device slots/layer peak {stats.extra['kv_device_peak']}")


def test_offloaded_tokens_leave_in_whole_pages(tiny_llm):
    """With offload, tokens leave the device a KV page at a time (its pages drop out of the table, no copy): an
    offload_chunk that is not a multiple of the page size is an error that names both."""
    method = SentenceKV(budget=96, offload=True, offload_chunk=4)
    with pytest.raises(SemkvError, match=r"offload_chunk=4 must be a multiple of the KV page size \(16\)"):
        method.bind(tiny_llm.config, tiny_llm.tokenizer, 16)
    SentenceKV(budget=96, offload=False, offload_chunk=4).bind(tiny_llm.config, tiny_llm.tokenizer, 16)


def test_budget_covering_the_generation_moves_nothing(tiny_llm):
    text = book_text(1500)
    full = tiny_llm.generate(text, method="full", max_new_tokens=10, chat=False, ignore_eos=True)[0]
    out = tiny_llm.generate(text, method="sentencekv", budget=full.stats.prompt_tokens + 9, max_new_tokens=10,
                            chat=False, ignore_eos=True, method_params=dict(offload=True))[0]
    assert out.token_ids == full.token_ids
    assert out.stats.h2d_bytes == out.stats.d2h_bytes == 0


@pytest.mark.parametrize("params, word", [(dict(keep_factor=0.5), "keep_factor"), (dict(query="last"), "query"),
                                          (dict(buckets="words"), "buckets"), (dict(offload="yes"), "offload"),
                                          (dict(max_sentence=0), "max_sentence"), (dict(retain="words"), "retain")])
def test_bad_parameters_are_named(params, word):
    with pytest.raises(SemkvError, match=word):
        SentenceKV(budget=128, **params)
