"""Triton kernels against the torch reference on random inputs, run by Triton's interpreter on the CPU (the same
checks run on a GPU in benchmarks/kernel_check.py). Skipped when triton is not installed."""
from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported: keep this before any triton import

from semkv.kernels import reference  # noqa: E402
from semkv.methods.chess import reference as chess_reference
from semkv.methods.dynsplit import reference as dynsplit_reference
from semkv.methods.h2o import reference as h2o_reference
from semkv.methods.infllm import reference as infllm_reference
from semkv.methods.sentencekv import reference as sentencekv_reference

triton = pytest.importorskip("triton")


def random_pool(pages=48, page=4, kv_heads=2, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(pages, page, kv_heads, dim, generator=gen)
    v = torch.randn(pages, page, kv_heads, dim, generator=gen)
    return k, v, gen


def sorted_subsets(gen, batch, heads, n, limit):
    """[batch, heads, n] ascending distinct slots below limit[b]."""
    out = torch.zeros(batch, heads, n, dtype=torch.long)
    for b in range(batch):
        for h in range(heads):
            pick = torch.randperm(int(limit[b]), generator=gen)[:n]
            out[b, h, : len(pick)] = pick.sort().values
    return out


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_matches_reference(splits):
    from semkv.kernels.triton_decode import decode_attention

    k, v, gen = random_pool()
    batch, heads = 3, 8
    tables = torch.stack([torch.randperm(48, generator=gen)[:14] for _ in range(batch)])
    q = torch.randn(batch, heads, 16, generator=gen)
    stored = torch.tensor([45, 7, 30])
    # every stored slot
    lengths = stored[:, None]
    want = reference.decode_attention(q, k, v, tables, None, lengths, 0.25)
    got = decode_attention(q, k, v, tables, None, lengths, 0.25, num_splits=splits, block_n=16)
    assert (got - want).abs().max() < 1e-5
    # per-head and shared index lists of different lengths
    slots = sorted_subsets(gen, batch, 2, 6, stored)
    lengths = torch.tensor([[6, 4], [5, 6], [6, 1]])
    for s, n in ((slots, lengths), (slots[:, :1], lengths[:, :1])):
        want = reference.decode_attention(q, k, v, tables, s, n, 0.25)
        got = decode_attention(q, k, v, tables, s, n, 0.25, num_splits=splits, block_n=16)
        assert (got - want).abs().max() < 1e-5
    # a launch bound far above the rows (a CUDA graph sized for the prompt, rows an evicting method kept): each row
    # spreads its own length over the splits
    lengths = stored[:, None]
    want = reference.decode_attention(q, k, v, tables, None, lengths, 0.25)
    got = decode_attention(q, k, v, tables, None, lengths, 0.25, num_splits=splits, block_n=16, max_len=4096)
    assert (got - want).abs().max() < 1e-5


def test_decode_launch_settings_bound_split_length_and_fill_the_device():
    from semkv.kernels.triton_decode import launch_settings, num_splits_for

    # every stored slot: wide blocks; an index list: 64-row blocks on two warps (CPU: no shared-memory cut)
    assert launch_settings(128, 2, False, torch.device("cpu")) == (128, 4, 3)
    assert launch_settings(128, 2, True, torch.device("cpu")) == (64, 2, 4)
    for max_len, batch_heads, block_n in [(32768, 200, 128), (32768, 8, 128), (4096, 8, 128), (32768, 128, 128),
                                          (2688, 200, 64), (2688, 128, 64), (100, 8, 64)]:
        splits = num_splits_for(max_len, batch_heads, 132, block_n)
        longest = -(-max_len // splits)
        assert longest <= max(4096, 2 * block_n)  # no split longer than 4096 slots unless it is two blocks
        assert splits == 1 or longest >= 2 * block_n - 1  # none shorter than two blocks
        assert splits * batch_heads >= min(2 * 132, batch_heads * -(-max_len // (2 * block_n)))  # two per SM
    assert num_splits_for(32768, 200, 132, 128) == 8  # a large batch: the split length decides
    assert num_splits_for(32768, 8, 132, 128) == 33  # one sequence: the SM count decides


@pytest.mark.parametrize("start, chunk", [(0, 20), (37, 21), (50, 3)])
def test_prefill_kernel_matches_reference(start, chunk):
    from semkv.kernels.triton_prefill import prefill_attention

    k, v, gen = random_pool(seed=start)
    table = torch.randperm(48, generator=gen)[:30]
    q = torch.randn(chunk, 4, 16, generator=gen)
    contexts = [None]
    if start:
        contexts += [sorted_subsets(gen, 1, 1, 10, [start])[0], sorted_subsets(gen, 1, 2, 10, [start])[0]]
    for context in contexts:
        want, want_lse = reference.prefill_attention(q, k, v, table, start, context, 0.3, lse=True, query_block=7)
        assert (reference.prefill_attention(q, k, v, table, start, context, 0.3) - want).abs().max() < 1e-6
        # one part, and the context split over parts whose outputs are merged by their log-sum-exps
        for splits in (1, 3):
            got, got_lse = prefill_attention(q, k, v, table, start, context, 0.3, lse=True, tile=(16, 16, 4, 1),
                                             splits=splits)
            assert (got - want).abs().max() < 1e-5
            assert (got_lse - want_lse).abs().max() < 1e-5
        assert (prefill_attention(q, k, v, table, start, context, 0.3, tile=(16, 16, 4, 1)) - want).abs().max() < 1e-5



@pytest.mark.parametrize("splits", [1, 3])
def test_packed_prefill_kernel_equals_a_call_a_chunk(splits):
    """Three sequences' chunks one after another in one launch (a follow-up's short chunk, one longer than a query
    block, one at the start of its sequence), each over its own pages up to its own length: every row as
    `reference.prefill_attention` gives its chunk alone, with the context in one part or split over three."""
    from semkv.kernels.triton_prefill import packed_prefill_attention

    k, v, gen = random_pool(seed=5)
    spans = [(37, 3), (9, 21), (0, 12)]  # (start, chunk)
    tables = torch.stack([torch.randperm(48, generator=gen)[:16] for _ in spans]).to(torch.int32)  # [P, 16]
    q = torch.randn(sum(c for _, c in spans), 4, 16, generator=gen)
    cu_q = torch.tensor([0, 3, 24, 36], dtype=torch.int32)
    used_k = torch.tensor([a + c for a, c in spans], dtype=torch.int32)
    want = torch.cat([reference.prefill_attention(q[lo:hi], k, v, table.long(), a, None, 0.3)
                      for (a, c), table, lo, hi in zip(spans, tables, cu_q[:-1].tolist(), cu_q[1:].tolist())])
    got = packed_prefill_attention(q, k, v, tables, cu_q, used_k, 21, 40, 0.3, tile=(16, 16, 4, 1), splits=splits)
    assert got.shape == q.shape and (got - want).abs().max() < 1e-5


def test_packed_prefill_leaves_long_chunks_to_cudnn(monkeypatch):
    """Where FlashAttention 3 does not serve, a step's chunks attend in one Triton launch unless one is long enough
    for cuDNN's fused attention (a call a chunk, faster there), or the user chose the Triton kernel."""
    from semkv import kernels
    from semkv.kernels.cudnn_prefill import MIN_CHUNK

    monkeypatch.setattr(kernels, "use_triton", lambda device: True)  # the dispatch as on a GPU without vLLM
    q, k_pool = torch.zeros(4, 4, 16, dtype=torch.bfloat16), torch.zeros(8, 4, 2, 16, dtype=torch.bfloat16)
    assert kernels.packed_prefill_serves(q, k_pool, MIN_CHUNK - 1)
    assert not kernels.packed_prefill_serves(q, k_pool, MIN_CHUNK)
    monkeypatch.setenv("SEMKV_PREFILL_ATTENTION", "triton")
    assert kernels.packed_prefill_serves(q, k_pool, MIN_CHUNK)

def test_prefill_splits_fill_the_device_only_when_query_blocks_do_not():
    from semkv.kernels.triton_prefill import num_splits

    assert num_splits(2048, 32768, 132, 64) == 1  # an 8k chunk of 32 heads: enough programs
    assert num_splits(112, 2**20, 132, 64) == 2  # Figure-7 shape: 4 query blocks x 28 heads over 1M keys
    assert num_splits(40, 2**20, 132, 64) == 6
    assert num_splits(112, 8192, 132, 64) == 2  # parts of at least 64 key blocks
    assert num_splits(112, 2688, 132, 64) == 1  # TokenSelect's sparse context


def test_fused_norm_and_silu_match_reference():
    from semkv.kernels import triton_fused

    gen = torch.Generator().manual_seed(3)
    x, residual = torch.randn(5, 72, generator=gen), torch.randn(5, 72, generator=gen)
    weight = torch.randn(72, generator=gen)
    for res in (None, residual):
        want = reference.rms_norm(x, weight, 1e-5, res)
        got = triton_fused.rms_norm(x, weight, 1e-5, res)
        assert all((g - w).abs().max() < 1e-5 for g, w in zip(got, want))
    gate_up = torch.randn(4, 2 * 1500, generator=gen)
    assert (triton_fused.silu_mul(gate_up) - reference.silu_mul(gate_up)).abs().max() < 1e-5


def test_fused_rope_store_matches_reference():
    from semkv.kernels import triton_fused

    gen = torch.Generator().manual_seed(4)
    tokens, heads, kv_heads, dim, rows_total = 3, 4, 2, 16, 20
    q, k, v = (torch.randn(tokens, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    angles = torch.rand(tokens, dim // 2, generator=gen) * 6.28
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # RoPE tables repeat halves
    rows = torch.tensor([[3, 7], [11, 11], [0, 19]])
    # a column of packed step inputs [token, position, ...], as a decode step passes its positions (strided)
    positions = torch.tensor([[40, 5, 9], [41, 6, 9], [42, 7, 9]])[:, 1]
    pools = [[torch.zeros(rows_total, kv_heads, dim), torch.zeros(rows_total, kv_heads, dim),
              torch.zeros(rows_total, kv_heads, dtype=torch.int32)] for _ in range(2)]
    want = reference.rope_store(q, k, v, cos, sin, rows, positions, *pools[0])
    got = triton_fused.rope_store(q, k, v, cos, sin, rows, positions, *pools[1])
    assert (got - want).abs().max() < 1e-5
    assert all((a.float() - b.float()).abs().max() < 1e-5 for a, b in zip(*pools))
    shared = torch.tensor([2, 9, 4])[:, None].expand(-1, kv_heads)  # one row for all heads, as prefill passes it
    triton_fused.rope_store(q, k, v, cos, sin, shared, positions, *pools[1])
    reference.rope_store(q, k, v, cos, sin, shared, positions, *pools[0])
    assert all((a.float() - b.float()).abs().max() < 1e-5 for a, b in zip(*pools))
    # a prefill chunk: programs of 16 tokens, the last one partly past the end
    tokens = 300
    q, k, v = (torch.randn(tokens, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    angles = torch.rand(tokens, dim // 2, generator=gen) * 6.28
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rows = torch.randperm(tokens * kv_heads, generator=gen).view(tokens, kv_heads)
    positions = torch.arange(tokens) + 7
    pools = [[torch.zeros(tokens * kv_heads, kv_heads, dim), torch.zeros(tokens * kv_heads, kv_heads, dim),
              torch.zeros(tokens * kv_heads, kv_heads, dtype=torch.int32)] for _ in range(2)]
    want = reference.rope_store(q, k, v, cos, sin, rows, positions, *pools[0])
    got = triton_fused.rope_store(q, k, v, cos, sin, rows, positions, *pools[1])
    assert (got - want).abs().max() < 1e-5
    assert all((a.float() - b.float()).abs().max() < 1e-5 for a, b in zip(*pools))


@pytest.mark.parametrize("group_reduce, kv_heads, group, dim, dtype", [("mean", 2, 3, 16, torch.float32),
                                                                     ("max", 3, 2, 24, torch.bfloat16)])
def test_page_bound_kernel_matches_reference(group_reduce, kv_heads, group, dim, dtype):
    """Quest's page scoring: min / max summaries read through each row's page table (a page shared between rows
    included), rows of different lengths (+inf at the last page, -inf past it); dim not a power of two, and queries
    and summaries in bf16 (as decoding a bf16 cache has them), in the second case. With the K pool the current key
    of each row is folded into its page first, as `PageSummaries.add_tokens` does (one row starts a fresh page)."""
    from semkv.engine.kv_cache import KVPool
    from semkv.kernels.triton_page_select import page_bound
    from semkv.methods.state.page_summaries import PageSummaries

    gen = torch.Generator().manual_seed(dim)
    a, b = torch.randn(2, 150, kv_heads, dim, generator=gen)
    kmin, kmax = torch.minimum(a, b).to(dtype), torch.maximum(a, b).to(dtype)
    tables = torch.randperm(149, generator=gen)[:135].view(3, 45) + 1
    tables[1, 3] = tables[0, 7]
    num_slots = torch.tensor([700, 33, 16 * 45])  # 44 pages, 3 pages (the last one fresh), every page
    q = torch.randn(3, kv_heads * group, dim, generator=gen).to(dtype)
    want = reference.page_bound(q, kmin, kmax, tables, num_slots, 16, group_reduce)
    page = 1 + 7 if group_reduce == "mean" else 1
    q_heads = q[0, :group].float()  # the first KV head's query heads, by hand on one page
    kmin_page, kmax_page = kmin[tables[0, page], 0].float(), kmax[tables[0, page], 0].float()
    by_hand = torch.maximum(q_heads * kmin_page, q_heads * kmax_page).sum(-1)
    assert torch.allclose(want[0, 0, page], by_hand.mean() if group_reduce == "mean" else by_hand.max(), atol=1e-5)
    assert want[1, :, 2].isinf().all() and (want[1, :, 2] > 0).all() and (want[1, :, 3:] == float("-inf")).all()
    got = page_bound(q, kmin, kmax, tables, num_slots, 16, group_reduce, block_w=16)
    assert got.shape == (3, kv_heads, 45) and torch.allclose(got, want, atol=1e-4)
    assert torch.allclose(page_bound(q, kmin, kmax, tables, num_slots, 16, group_reduce), want, atol=1e-4)

    k_pool = torch.randn(150, 16, kv_heads, dim, generator=gen).to(dtype)
    folded = [(kmin.clone(), kmax.clone()) for _ in range(3)]
    pool = KVPool(1, kv_heads, dim, 16, dtype, torch.device("cpu"), num_pages=150)
    pool.k[:] = k_pool
    summaries = PageSummaries(("min", "max"))
    summaries.ensure(pool)
    pool.cover(150)  # the tables over every page, as the pool grows them for the pages it hands out
    summaries.data["min"][:], summaries.data["max"][:] = folded[0]
    summaries.add_tokens(pool, tables, (num_slots - 1)[:, None].expand(-1, kv_heads))
    want = reference.page_bound(q, *folded[1], tables, num_slots, 16, group_reduce, k_pool=k_pool)
    got = page_bound(q, *folded[2], tables, num_slots, 16, group_reduce, k_pool=k_pool, block_w=16)
    assert torch.equal(folded[1][0], summaries.data["min"]) and torch.equal(folded[1][1], summaries.data["max"])
    assert torch.equal(folded[2][0], folded[1][0]) and torch.equal(folded[2][1], folded[1][1])
    assert not torch.equal(folded[1][0], kmin)  # the fold changed something
    assert torch.allclose(got, want, atol=1e-4)


def page_bounds(seed: int, rows: int = 5, page_size: int = 4, pages: int = 80, kv_heads: int = 2, dim: int = 16):
    """Shuffled page tables, row lengths and each row's page bounds from the exact min / max of random keys."""
    gen = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(pages, page_size, kv_heads, dim, generator=gen)
    tables = torch.stack([torch.randperm(pages, generator=gen) for _ in range(rows)])
    q = torch.randn(rows, 4 * kv_heads, dim, generator=gen)
    n = torch.tensor([150, 190, 20, 301, 97][:rows])
    return tables, n, reference.page_bound(q, k_pool.amin(1), k_pool.amax(1), tables, n, page_size, "max")


def stands_for(pages: torch.Tensor, span: torch.Tensor, page_size: int) -> list[int]:
    """The slots a row's compact span of its chosen pages [count] stands for."""
    slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()
    return slots[span[0]:span[1]].tolist()


def test_page_candidates_keep_the_best_bounded_pages_as_one_span_of_candidates():
    """The reference keeps the `count` best pages by their bound (the maximum over KV heads) among those holding a
    slot of [lo, hi), ascending with their physical ids; the span's compact slots stand for exactly the candidate
    slots of those pages; a count covering every such page keeps every candidate."""
    size = 4
    tables, n, bound = page_bounds(5, rows=3)
    lo, hi = torch.tensor([3, 2, 3]), n - torch.tensor([5, 4, 5])
    for count in (7, 40):
        ids, pages, span = reference.page_candidates(bound, lo, hi, tables, size, count)
        assert torch.equal(ids, torch.gather(tables, 1, pages))
        for b in range(3):
            holding = [p for p in range(bound.shape[-1]) if p * size + size > lo[b] and p * size < hi[b]]
            best = sorted(holding, key=lambda p: -bound[b, :, p].max().item())[:count]
            chosen = pages[b].tolist()
            assert chosen == sorted(chosen) and set(best) <= set(chosen)
            every = (pages[b, :, None] * size + torch.arange(size)).flatten().tolist()
            assert stands_for(pages[b], span[b], size) == [t for t in every if lo[b] <= t < hi[b]]
            if count >= len(holding):
                assert stands_for(pages[b], span[b], size) == list(range(lo[b], hi[b]))


def test_page_candidates_kernel_chooses_the_pages_of_the_reference():
    """The kernel (a bitwise search for the count-th largest bound) chooses the reference's pages among those
    holding candidates, ascending with their physical ids, and the same span; with fewer such pages than the count
    it fills in other pages, outside the span."""
    from semkv.kernels.triton_page_select import page_candidates

    size = 4
    tables, n, bound = page_bounds(7)
    lo, hi = torch.tensor([3, 2, 3, 4, 1]), n - torch.tensor([5, 4, 5, 8, 2])
    for count in (9, 30, 80):
        ids, pages, span = page_candidates(bound, lo, hi, tables, size, count)
        _, want, want_span = reference.page_candidates(bound, lo, hi, tables, size, count)
        assert torch.equal(ids, torch.gather(tables, 1, pages)) and torch.equal(span, want_span)
        for b in range(5):
            assert pages[b].tolist() == sorted(set(pages[b].tolist()))
            assert stands_for(pages[b], span[b], size) == stands_for(want[b], want_span[b], size)


def test_page_slots_kernel_matches_reference():
    """Quest's slots from its top pages: rows with a sparse budget (kept pages sorted, the partial last page cut by
    the length), a budget that covers the row (every page) and a budget under one page (one page kept)."""
    from semkv.kernels.triton_page_select import page_slots

    gen = torch.Generator().manual_seed(0)
    num_slots = torch.tensor([150, 40, 300, 95])
    budget = torch.tensor([64, 64, 10, 200])  # sparse, covers the row, under a page, covers the row
    scores = torch.rand(4, 3, 19, generator=gen)
    pages = torch.arange(19)
    n_pages = -(-num_slots // 16)
    scores = torch.where(pages < n_pages[:, None, None], scores, -1.0)
    scores[torch.arange(4), :, n_pages - 1] = 2.0  # the current token's page first
    top = scores.topk(7, dim=-1).indices  # [B, kv_heads, k] best first
    slots, lengths = reference.page_slots(top, budget, num_slots, 16)
    assert lengths[:, 0].tolist() == [4 * 16 - 10, 40, 16 - 4, 95]
    for b in range(4):
        for h in range(3):
            keep = int(lengths[b, h])
            chosen = slots[b, h, :keep].tolist()
            assert chosen == sorted(chosen) and chosen[-1] == int(num_slots[b]) - 1
            kept = {s // 16 for s in chosen}
            assert kept == set(top[b, h, : len(kept)].tolist())
    got_slots, got_lengths = page_slots(top, budget, num_slots, 16)
    assert torch.equal(got_slots, slots) and torch.equal(got_lengths, lengths)


@pytest.mark.parametrize("r, kv_heads, dim", [(1, 2, 16), (2, 3, 24)])
def test_summary_dot_kernel_matches_reference(r, kv_heads, dim):
    """CHESS's page scoring: summaries read through page ids of every layer (shared ids included), dotted with one
    direction per sequence, layer and row; kv_heads * dim not a power of two in the second case."""
    from semkv.methods.chess.triton_summary_dot import summary_dots

    gen = torch.Generator().manual_seed(r)
    sums = torch.randn(60, kv_heads, dim, generator=gen)
    pages = torch.randint(0, 60, (3, 4, 37), generator=gen)  # [B, layers, w]
    directions = torch.randn(3, r, 4, kv_heads, dim, generator=gen)
    want = chess_reference.summary_dots(sums, pages, directions)
    direct = torch.einsum("bljhd,brlhd->bjr", sums[pages], directions)
    assert torch.allclose(want, direct, atol=1e-4)
    got = summary_dots(sums, pages, directions, block_w=16, block_hd=16, layers_per=3)
    assert got.shape == (3, 37, r) and torch.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("group", [3, 4])
def test_accumulate_attention_kernel_matches_reference(group):
    """H2O's score update: resident slots only (a padded width and pages past each row's count are ignored), the
    slot holding the current token restarted at zero, query groups that are not a power of two."""
    from semkv.methods.h2o import triton_attention_scores

    gen = torch.Generator().manual_seed(7)
    batch, kv_heads, page, n_pages, width_pages = 3, 2, 4, 40, 6
    heads = kv_heads * group
    logits = torch.randn(batch, heads, width_pages * page, generator=gen) * 3
    counts = torch.tensor([24, 9, 1])  # a full width, a partial last page, a single slot
    scratch = 0
    pages = torch.randperm(n_pages - 1, generator=gen)[: batch * width_pages].view(batch, width_pages) + 1
    held = torch.arange(width_pages) * page < counts[:, None]
    pages = torch.where(held, pages, scratch)
    pos_pool = torch.randint(0, 50, (n_pages, page, kv_heads), generator=gen, dtype=torch.int32)
    positions = torch.tensor([60, 61, 62])
    pos_pool[pages[0, 2], 1, 0] = 60  # this row's current token, in one KV head
    pos_pool[pages[1, 2], 0] = 61  # slot 8 of row 1: its last resident slot, both heads
    scores = [torch.rand(n_pages, page, kv_heads, generator=gen) * 5 for _ in range(2)]
    scores[1].copy_(scores[0])
    before = scores[0].clone()
    h2o_reference.accumulate_attention(logits, counts, pages, positions, pos_pool, scores[0])
    triton_attention_scores.accumulate_attention(logits, counts, pages, positions, pos_pool, scores[1], block=4,
                                                 chunk=8)
    real = torch.ones(n_pages, dtype=torch.bool)
    real[scratch] = False  # the reference may write the scratch page; the kernel never does
    assert (scores[1][real] - scores[0][real]).abs().max() < 1e-5
    # each row's added mass is its number of query heads, split over its KV heads
    for b in range(batch):
        rows = (pages[b, :, None] * page + torch.arange(page)).flatten()[: int(counts[b])]
        flat_now, flat_before = scores[1].view(-1, kv_heads)[rows], before.view(-1, kv_heads)[rows]
        flat_pos = pos_pool.view(-1, kv_heads)[rows]
        gained = flat_now - torch.where(flat_pos == positions[b], 0.0, flat_before)
        assert gained.sum(0).tolist() == pytest.approx([group] * kv_heads, rel=1e-5)
    untouched = torch.ones_like(before, dtype=torch.bool)
    for b in range(batch):
        for s in range(int(counts[b])):
            untouched[pages[b, s // page], s % page] = False
    untouched[scratch] = False
    assert torch.equal(scores[1][untouched], before[untouched])


@pytest.mark.parametrize("start,chunk", [(0, 37), (45, 20), (70, 64)])
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (16, 32), (32, 16)])
def test_prompt_attention_sums_kernel_matches_reference(start, chunk, block_m, block_n):
    """H2O's prompt scores: a first chunk (causal only), later chunks whose first key block is seen by part of the
    chunk, chunks and contexts that are not multiples of the blocks, query blocks shorter and longer than the key
    blocks (the masked diagonal and the unmasked rest), pages in random order, a query group of 3. Every query gives
    each KV group's heads a mass of one each, and the keys after a query get none of it."""
    from semkv.methods.h2o import triton_attention_scores

    k, _, gen = random_pool(pages=40, page=4, kv_heads=2, dim=16, seed=3)
    heads, kv_heads = 6, 2
    table = torch.randperm(40, generator=gen)
    q = torch.randn(chunk, heads, 16, generator=gen) * 2
    _, lse = reference.prefill_attention(q, k, k, table, start, None, 0.25, lse=True)  # the prefill's normalisers
    want = h2o_reference.prompt_attention_sums(q, k, table, start, 0.25, lse, query_block=16)
    direct = h2o_reference.prompt_attention_sums(q, k, table, start, 0.25, lse)
    assert want.shape == (kv_heads, start + chunk) and torch.allclose(want, direct, atol=1e-5)
    assert want.sum(1).tolist() == pytest.approx([chunk * heads / kv_heads] * kv_heads, rel=1e-5)
    got = triton_attention_scores.prompt_attention_sums(q, k, table, start, 0.25, lse, block_m=block_m,
                                                        block_n=block_n, num_warps=4)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    # the chunk's last key is seen by its last query only, which sees every key
    slots = torch.arange(start + chunk)
    keys = k.view(-1, kv_heads, 16)[table[slots // 4] * 4 + slots % 4]  # [n, kv_heads, D]
    probs = torch.softmax(torch.einsum("hd,nhd->hn", q[-1], keys.repeat_interleave(3, 1)) * 0.25, -1)  # [heads, n]
    assert want[:, -1].tolist() == pytest.approx(probs[:, -1].view(kv_heads, 3).sum(1).tolist(), rel=1e-5)


@pytest.mark.parametrize("block_size", [4, 6])
def test_block_slots_kernel_matches_reference(block_size):
    """InfLLM's slot lists: blocks given best first and taken ascending, a block overlapping the initial tokens, one
    overlapping the local window, a dense row (n <= init + local), a row taking no block, per-head sets."""
    from semkv.methods.infllm.triton_block_slots import block_slots

    bs = block_size
    top = torch.tensor([[[9, 2, 5, 7]], [[3, 1, 8, 0]], [[4, 6, 0, 1]], [[2, 3, 4, 5]]]).repeat(1, 2, 1)
    top[0, 1] = torch.tensor([5, 9, 2, 3])  # the second set of row 0 ranks other blocks
    chosen = torch.tensor([3, 2, 0, 4])
    init = torch.tensor([5, 7, 3, 0])  # row 1: its block 1 overlaps the initial tokens
    n = torch.tensor([12 * bs + 3, 9 * bs, 20, 6 * bs])
    local = torch.tensor([bs + 3, bs, 20, 2 * bs - 1])  # row 2: dense; row 3: its last block overlaps the window
    capacity = 5 + 4 * bs + 3 * bs
    want_slots, want_lengths = infllm_reference.block_slots(top, chosen, init, local, n, bs, capacity)
    for b in range(4):
        for s in range(2):
            expected = set(range(min(int(init[b]), int(n[b])))) | set(range(int(n[b] - local[b]), int(n[b])))
            for block in top[b, s, : int(chosen[b])].tolist():
                expected |= set(range(block * bs, (block + 1) * bs))
            expected = sorted(e for e in expected if 0 <= e < int(n[b]))
            assert want_slots[b, s, : int(want_lengths[b, s])].tolist() == expected
            assert (want_slots[b, s, int(want_lengths[b, s]):] == 0).all()
    got_slots, got_lengths = block_slots(top, chosen, init, local, n, bs, capacity, span=8)
    assert torch.equal(got_lengths, want_lengths) and torch.equal(got_slots, want_slots)


def test_sentence_slots_kernel_matches_reference():
    """SentenceKV's slot lists from bucket ranks: buckets fill the capacity in rank order and the last one keeps its
    leading tokens; rows read their own state rows (one three times, one padding row on row 0), a row with fewer
    retained tokens than the map holds, a row with no sinks, a row whose capacity covers everything it retained, a
    row that takes none of its retained tokens. The kernel places each block of 8 tokens (5 a row) on its own from
    each bucket's `place`."""
    from semkv.methods.sentencekv.triton_sentence_slots import sentence_slots

    gen = torch.Generator().manual_seed(0)
    heads, tokens, buckets = 2, 40, 9
    # state rows: ascending bucket ids over the retained tokens (buckets with no token in a head are allowed),
    # and 0 past each row's retained tokens
    held = torch.tensor([0, 31, 40, 12])  # retained tokens of each state row
    bucket = torch.sort(torch.randint(0, buckets, (4, heads, tokens), generator=gen), dim=-1).values.int()
    bucket = torch.where(torch.arange(tokens) < held[:, None, None], bucket, 0)
    count = torch.zeros(4, heads, buckets, dtype=torch.int32).scatter_add_(
        -1, bucket.long(), (torch.arange(tokens) < held[:, None, None]).int().expand_as(bucket).contiguous())
    rows = torch.tensor([2, 1, 0, 2, 3, 2])
    rank = torch.rand(len(rows), heads, buckets, generator=gen).argsort(-1)  # the buckets' order, best first
    ranked = count[rows].gather(-1, rank)
    before = torch.empty_like(ranked).scatter_(-1, rank, ranked.cumsum(-1, dtype=torch.int32) - ranked)
    first = count[rows].cumsum(-1, dtype=torch.int32) - count[rows]
    retained = held[rows]
    capacity = torch.tensor([17, 9, 0, 25, 30, 0])
    place = reference.taken_place(before, count[rows], capacity)  # as `bucket_take` gives it
    n_sink = torch.tensor([4, 0, 0, 4, 3, 2])
    tail = torch.tensor([5, 3, 1, 6, 2, 4])
    n = n_sink + retained + tail + torch.tensor([2, 0, 0, 7, 1, 0])  # tokens waiting between the retained and the tail
    width = 4 + 25 + 6
    args = (bucket, rows, before, first, n, n_sink, retained, capacity, tail, 4, width)
    want_slots, want_lengths = sentencekv_reference.sentence_slots(*args)
    for b in range(len(rows)):
        for h in range(heads):
            ids = bucket[rows[b], h, : int(retained[b])].tolist()
            order = rank[b, h].tolist()
            chosen = sorted(range(len(ids)), key=lambda t: (order.index(ids[t]), t))[: int(capacity[b])]
            expected = (list(range(int(n_sink[b]))) + sorted(int(n_sink[b]) + t for t in chosen)
                        + list(range(int(n[b] - tail[b]), int(n[b]))))
            assert want_slots[b, h, : int(want_lengths[b, h])].tolist() == expected
            assert (want_slots[b, h, int(want_lengths[b, h]):] == 0).all()
    got_slots, got_lengths = sentence_slots(*args[:4], place, *args[4:], span=8)
    assert torch.equal(got_lengths, want_lengths) and torch.equal(got_slots, want_slots)


def test_working_set_kernel_matches_reference_over_steps():
    """The offloaded working set over eight steps of changing selections: rows 2 and 1 offload (row 1 with a working
    set larger than what it selects, so tokens that left the selection stay until the clock hand reaches them), a
    row that offloads nothing is left as it is, padding past each list's length is untouched. After each step the
    kernel and the reference agree on the device slots, the maps, the clock hands, the pool and the traffic; every
    selected offloaded token is on the device at its slot (the host's key, value and position); exactly the selected
    tokens the working set held before the step are found (a token selected at the previous step among them), the
    rest loaded; sinks and tail map to their own device slots."""
    from semkv.engine.offload import HostKVStore
    from semkv.kernels.triton_working_set import working_set

    gen = torch.Generator().manual_seed(0)
    layers, layer, heads, dim, page = 2, 1, 2, 16, 4
    rows = torch.tensor([2, 1, 3])
    n_sink, offloaded, cache = torch.tensor([3, 0, 2]), torch.tensor([40, 25, 0]), torch.tensor([8, 12, 0])
    tail = torch.tensor([5, 6, 30])  # the last row keeps everything resident
    stores = {}
    host = torch.zeros(4, 4, dtype=torch.long)
    for row, n in ((2, 40), (1, 25)):
        store = HostKVStore(layers, heads, dim, 48, torch.float32, torch.device("cpu"))
        store.put(slice(None), torch.randn(layers, heads, n, dim, generator=gen),
                  torch.randn(layers, heads, n, dim, generator=gen),
                  torch.randint(0, 1000, (layers, heads, n), generator=gen, dtype=torch.int32))
        stores[row], host[row] = store, torch.tensor(store.pointers())
    table = torch.randperm(60, generator=gen)[:30].view(3, 10)  # 40 device slots a row
    k_pool, v_pool, _ = random_pool(pages=60, page=page, kv_heads=heads, dim=dim)
    pos_pool = torch.zeros(60, page, heads, dtype=torch.int32)
    state = [torch.zeros(4, heads, 12, dtype=torch.int32), torch.zeros(4, heads, 48, dtype=torch.int32),
             torch.zeros(4, heads, dtype=torch.int32), torch.zeros(4, 2, dtype=torch.long)]
    ours = [t.clone() for t in state] + [k_pool.clone(), v_pool.clone(), pos_pool.clone()]
    theirs = [t.clone() for t in state] + [k_pool.clone(), v_pool.clone(), pos_pool.clone()]
    width, previous, found_before, loaded_before, reselected = 3 + 12 + 30, None, 0, 0, 0
    for step in range(8):
        slots = torch.zeros(3, heads, width, dtype=torch.long)
        lengths = torch.zeros(3, heads, dtype=torch.long)
        chosen = {}
        for b in range(3):
            for h in range(heads):
                sinks = list(range(int(n_sink[b])))
                pick = int(min(cache[b] - b, 6 + step % 4)) if offloaded[b] else 0  # row 1 selects at most 11
                middle = sorted((torch.randperm(int(offloaded[b]), generator=gen)[:pick] + int(n_sink[b])).tolist())
                chosen[b, h] = [v - int(n_sink[b]) for v in middle]
                start = int(n_sink[b] + offloaded[b])
                entries = sinks + middle + list(range(start, start + int(tail[b])))[-int(tail[b]) + step:]
                slots[b, h, : len(entries)] = torch.tensor(entries)
                lengths[b, h] = len(entries)
        virtual = slots.clone()
        resident = {(b, h): set((theirs[1][rows[b], h] > 0).nonzero()[:, 0].tolist()) for b in range(3)
                    for h in range(heads)}  # the tokens each working set held before the step
        for out, run in ((ours, working_set), (theirs, None)):
            held, where, hand, traffic, kp, vp, pp = out
            got = slots.clone()
            if run is None:
                reference.working_set(got, lengths, rows, n_sink, offloaded, cache, held, where, hand, stores, table,
                                      kp, vp, pp, traffic, layer)
            else:
                run(got, lengths, rows, n_sink, offloaded, cache, held, where, hand, host, table, kp, vp, pp, traffic,
                    layer, span=8, block=4, loaders=2 if step % 2 else 1024)  # a program loops or takes one tile
            out.append(got)
        got, want = ours.pop(), theirs.pop()
        assert torch.equal(got, want)
        for a, b_ in zip(ours, theirs):
            assert torch.equal(a, b_)
        held, where, hand, traffic, kp, vp, pp = theirs
        device_rows = reference.physical_rows(table, want.flatten(1), page).view_as(want)
        for b in range(3):
            for h in range(heads):
                n = int(lengths[b, h])
                v, d = virtual[b, h, :n], want[b, h, :n]
                assert (want[b, h, n:] == 0).all()
                middle = (v >= n_sink[b]) & (v < n_sink[b] + offloaded[b])
                assert torch.equal(d[v < n_sink[b]], v[v < n_sink[b]])
                tail_at = v >= n_sink[b] + offloaded[b]
                assert torch.equal(d[tail_at], v[tail_at] - offloaded[b] + cache[b])
                if not offloaded[b]:
                    continue
                assert ((d[middle] >= n_sink[b]) & (d[middle] < n_sink[b] + cache[b])).all()
                tokens = torch.tensor(chosen[b, h], dtype=torch.long)
                at = device_rows[b, h, :n][middle]
                store = stores[int(rows[b])]
                assert torch.equal(kp.view(-1, heads, dim)[at, h], store.k[layer, h, tokens])
                assert torch.equal(vp.view(-1, heads, dim)[at, h], store.v[layer, h, tokens])
                assert torch.equal(pp.view(-1, heads)[at, h], store.pos[layer, h, tokens])
        loads = sum(len(c) for (b, _), c in chosen.items())
        found = sum(len(set(c) & resident[key]) for key, c in chosen.items())
        assert int(traffic[:, 0].sum()) - found_before == found
        assert int(traffic[:, 1].sum()) - loaded_before == loads - found
        if previous is not None:  # a token selected at the last step is still there
            assert all(set(c) & set(previous[key]) <= resident[key] for key, c in chosen.items())
            reselected += sum(len((set(c) & resident[key]) - set(previous[key])) for key, c in chosen.items())
        previous, found_before, loaded_before = chosen, int(traffic[:, 0].sum()), int(traffic[:, 1].sum())
    assert int(traffic[3].sum()) == 0  # the resident row moved nothing
    assert reselected > 0  # row 1 found tokens it had dropped before the last step


def test_put_host_kernel_writes_the_store_like_the_reference():
    """Tokens written into a host store through its addresses (how the device offloads without waiting): one layer
    of a store that already holds tokens, then every layer, from gathered (non-contiguous) keys and values; each
    entry lands where the reference puts it and nothing else changes."""
    from semkv.engine.offload import HostKVStore
    from semkv.kernels.triton_working_set import put_host

    gen = torch.Generator().manual_seed(2)
    stores = [HostKVStore(3, 2, 16, 40, torch.float32, torch.device("cpu")) for _ in range(2)]
    for store in stores:
        for t in (store.k, store.v, store.pos):
            t.zero_()
    for first, layers, n, m in ((1, 1, 0, 7), (0, 3, 7, 21)):
        k = torch.randn(layers, 21, 2, 16, generator=gen).transpose(1, 2)[:, :, :m]  # [L', H, m, D], strided
        v = torch.randn(layers, 2, m, 16, generator=gen)
        pos = torch.randint(0, 999, (layers, 2, m), generator=gen, dtype=torch.int32)
        reference.put_host(k, v, pos, stores[0].k, stores[0].v, stores[0].pos, first, n)
        put_host(k, v, pos, stores[1].k, stores[1].v, stores[1].pos, first, n, block=4)
        for want, got in zip((stores[0].k, stores[0].v, stores[0].pos), (stores[1].k, stores[1].v, stores[1].pos)):
            assert torch.equal(got, want)
        assert torch.equal(stores[1].k[first : first + layers, :, n : n + m], k)
    assert stores[1].k[:, :, 28:].abs().sum() == 0  # past the entries written


def test_chunk_slots_kernel_matches_reference():
    """DynSplit-KV's slot lists: contiguous chunks ranked per KV head take the capacity in rank order (the last one
    its leading slots, ties to the earlier chunk); a chunk cut by the sinks, chunks cut or emptied by a shorter
    context and the recent window, unused chunk columns, a capacity that covers everything, a capacity of 0. The
    kernel places each block of 4 chunks (3 a row, some taking nothing) on its own from `bucket_take`'s `place`, long
    chunks in runs."""
    from semkv.methods.dynsplit.triton_chunk_slots import chunk_slots

    gen = torch.Generator().manual_seed(1)
    heads = 3
    ends = torch.tensor([0, 7, 15, 22, 30, 41, 50, 60, 60, 60])  # chunk starts and the end; two unused columns
    n, n_sink, tail = torch.tensor([60, 45, 60, 52]), torch.tensor([3, 0, 2, 1]), torch.tensor([8, 4, 1, 3])
    lo = torch.maximum(ends[:-1][None], n_sink[:, None])
    hi = torch.minimum(ends[1:][None], (n - tail)[:, None])
    count = (hi - lo).clamp(min=0)  # [B, chunks] slots between the forced ones
    scores = torch.randn(4, heads, len(ends) - 1, generator=gen)
    scores[1] = torch.randint(-1, 2, scores[1].shape, generator=gen).float()  # ties
    capacity = torch.tensor([20, 13, 100, 0])
    before, _, place = reference.bucket_take(scores, count[:, None].expand(-1, heads, -1), capacity)
    args = (lo, count, before, n, n_sink, capacity, tail, 4, 64, 11)
    want_slots, want_lengths = dynsplit_reference.chunk_slots(*args)
    labels = torch.bucketize(torch.arange(60), ends[1:], right=True)
    for b in range(4):
        for h in range(heads):
            free = [p for p in range(int(n_sink[b]), int(n[b] - tail[b]))]
            order = sorted(free, key=lambda p: (-float(scores[b, h, labels[p]]), p))[: int(capacity[b])]
            expected = sorted(set(range(int(n_sink[b]))) | set(order) | set(range(int(n[b] - tail[b]), int(n[b]))))
            assert want_slots[b, h, : int(want_lengths[b, h])].tolist() == expected
            assert (want_slots[b, h, int(want_lengths[b, h]):] == 0).all()
    got_slots, got_lengths = chunk_slots(*args[:3], place, *args[3:], block=4, run=4, span=8)
    assert torch.equal(got_lengths, want_lengths) and torch.equal(got_slots, want_slots)


def test_chunk_refresh_kernel_matches_reference():
    """DynSplit-KV's refresh of two chunks from the last `span` slots of each row, read through the page tables: a
    chunk closed by the token (both chunks held), one still open (the next chunk is empty: zeros), a row shorter than
    the span, and rows whose empty chunk writes the padding row 0 (not compared). Exact: min and max do not round."""
    from semkv.methods.dynsplit.triton_chunk_refresh import chunk_refresh

    gen = torch.Generator().manual_seed(3)
    pages, page_size, kv_heads, dim, span = 40, 4, 2, 8, 11
    k_flat = torch.randn(pages * page_size, kv_heads, dim, generator=gen).to(torch.bfloat16)
    tables = torch.stack([torch.randperm(pages - 1, generator=gen)[:12] + 1 for _ in range(3)])  # [B, 12 pages]
    n = torch.tensor([37, 6, 20])
    first = torch.tensor([28, 0, 12])
    split = torch.tensor([33, 6, 20])  # row 0: a chunk closed at 33; rows 1 and 2: the joined chunk is still open
    targets = torch.tensor([[5, 9], [7, 0], [3, 0]])
    want = [torch.zeros(12, kv_heads, dim, dtype=torch.bfloat16) for _ in range(2)]
    got = [t.clone() for t in want]
    dynsplit_reference.chunk_refresh(k_flat, tables, page_size, first, split, n, targets, span, *want)
    chunk_refresh(k_flat, tables, page_size, first, split, n, targets, span, *got)
    for w, g in zip(want, got):
        assert torch.equal(w[1:], g[1:])
    keys = k_flat[reference.physical_rows(tables[:1], torch.arange(28, 33)[None], page_size)][0]  # row 0's chunk
    assert torch.equal(want[0][5], keys.amin(0)) and torch.equal(want[1][5], keys.amax(0))
    assert want[0][3].abs().sum() > 0 and want[0][7].abs().sum() > 0  # open chunks summarised


@pytest.mark.parametrize("group_reduce, dim", [("mean", 16), ("max", 16), ("mean", 8)])
def test_chunk_best_kernel_matches_reference(group_reduce, dim):
    """DynSplit-KV's score="tokens": each chunk's best (group-reduced) query . key over the slots in [lo, hi) of its
    row, keys read through the page tables; rows of different lengths and candidate ranges, a chunk wholly outside
    the range (-inf) and one past a row's chunks (-inf); dim 8: key channels (score_keys="channels"), narrower than
    the kernel's smallest block. Checked against a per-chunk loop too."""
    from semkv.methods.dynsplit.triton_chunk_best import chunk_best

    gen = torch.Generator().manual_seed(5)
    pages, page_size, heads, kv_heads, width = 30, 4, 6, 2, 40
    k_pool = torch.randn(pages, page_size, kv_heads, dim, generator=gen)
    tables = torch.stack([torch.randperm(pages, generator=gen)[: width // page_size] for _ in range(3)])
    q = torch.randn(3, heads, dim, generator=gen)
    lengths = torch.randint(1, 7, (3, width), generator=gen)  # chunk lengths: chunk_of counts the starts passed
    starts = lengths.cumsum(1) - lengths
    chunk_of = torch.stack([torch.searchsorted(r, torch.arange(width), right=True) - 1 for r in starts]).int()
    lo, hi = torch.tensor([2, 0, 9]), torch.tensor([38, 13, 40])
    chunks = int(chunk_of.max()) + 2
    want = dynsplit_reference.chunk_best(q, k_pool, tables, chunk_of, lo, hi, chunks, group_reduce)
    got = chunk_best(q, k_pool, tables, chunk_of, lo, hi, chunks, group_reduce)
    assert torch.allclose(got, want, atol=1e-4) and torch.equal(got.isinf(), want.isinf())
    # blocks of 16 slots: chunks that span blocks are folded by each and maximised by the atomics
    assert torch.allclose(chunk_best(q, k_pool, tables, chunk_of, lo, hi, chunks, group_reduce, block_n=16), got)
    # score_keys="pages": only the slots of kept pages (a row keeping none, one keeping every page)
    kept = (torch.rand(3, width // page_size, generator=gen) < 0.5).to(torch.uint8)
    kept[1], kept[2] = 0, 1
    want_kept = dynsplit_reference.chunk_best(q, k_pool, tables, chunk_of, lo, hi, chunks, group_reduce, kept)
    got_kept = chunk_best(q, k_pool, tables, chunk_of, lo, hi, chunks, group_reduce, kept, block_n=16)
    assert torch.allclose(got_kept, want_kept, atol=1e-4) and torch.equal(got_kept.isinf(), want_kept.isinf())
    assert want_kept[1].isinf().all() and torch.equal(want_kept[2], want[2]) and not torch.equal(want_kept[0], want[0])
    keys = k_pool.view(-1, kv_heads, dim)
    for b in range(3):
        for c in range(chunks):
            slots = [t for t in range(int(lo[b]), int(hi[b])) if chunk_of[b, t] == c]
            for h in range(kv_heads):
                if not slots:
                    assert want[b, h, c] == float("-inf")
                    continue
                rows = tables[b, torch.tensor(slots) // page_size] * page_size + torch.tensor(slots) % page_size
                dots = q[b, h * 3 : h * 3 + 3] @ keys[rows, h].T  # [group, slots]
                best = (dots.mean(0) if group_reduce == "mean" else dots.amax(0)).max()
                assert torch.allclose(want[b, h, c], best, atol=1e-5)


@pytest.mark.parametrize("map_heads", [2, 1])
def test_bucket_best_kernel_matches_reference(map_heads):
    """SentenceKV's score="tokens": each bucket's best query . key over a row's retained tokens (slot n_sink + t,
    t < retained), the query of a KV group the mean of its heads, keys read through the page tables; state rows taken
    out of order, rows with different sinks and retained counts, a bucket map per KV head or shared, bucket ids that
    jump, buckets with no retained token (-inf). Checked against a per-bucket loop too."""
    from semkv.methods.sentencekv.triton_bucket_best import bucket_best

    gen = torch.Generator().manual_seed(6)
    pages, page_size, kv_heads, dim, tokens, buckets = 40, 4, 2, 16, 30, 14
    k_pool = torch.randn(pages, page_size, kv_heads, dim, generator=gen)
    tables = torch.stack([torch.randperm(pages, generator=gen)[:10] for _ in range(3)])
    q = torch.randn(3, 3 * kv_heads, dim, generator=gen)  # 3 query heads a KV head
    query = q.view(3, kv_heads, 3, dim).mean(2)  # [B, kv_heads, D] each group's query
    lengths = torch.randint(1, 5, (4, map_heads, tokens), generator=gen)  # bucket lengths of 4 state rows
    starts = lengths.cumsum(-1) - lengths
    bucket = torch.stack([torch.stack([torch.searchsorted(r, torch.arange(tokens), right=True) - 1 for r in row])
                          for row in starts]).clamp(max=buckets - 1).int()  # [rows, map_heads, T] ascending
    bucket, buckets = bucket * 3, buckets * 3  # ids that jump, as the retained sentences' do
    rows, n_sink = torch.tensor([3, 1, 2]), torch.tensor([4, 0, 2])
    retained = torch.tensor([26, 30, 7])
    args = (q, k_pool, tables, bucket, rows, n_sink, retained, buckets)
    want = sentencekv_reference.bucket_best(*args)
    got = bucket_best(*args)
    assert torch.allclose(got, want, atol=1e-4) and torch.equal(got.isinf(), want.isinf())
    assert want.isinf().any() and want.isfinite().any()
    # blocks of 16 tokens: buckets that span blocks are folded by each and maximised by the atomics
    assert torch.allclose(bucket_best(*args, block_n=16), got)
    keys = k_pool.view(-1, kv_heads, dim)
    for b in range(3):
        for h in range(kv_heads):
            for k in range(buckets):
                ts = [t for t in range(int(retained[b])) if bucket[rows[b], h % map_heads, t] == k]
                if not ts:
                    assert want[b, h, k] == float("-inf")
                    continue
                slots = n_sink[b] + torch.tensor(ts)
                at = tables[b, slots // page_size] * page_size + slots % page_size
                assert torch.allclose(want[b, h, k], (keys[at, h] @ query[b, h]).max(), atol=1e-5)


def test_bucket_take_decides_as_the_full_ranking_and_the_kernel_matches():
    """`bucket_take` (what a capacity takes of ranked buckets, without ranking them all) takes exactly the tokens the
    exact rank prefix (`ranked_before`) takes, for every bucket and offset, and places them one after another in
    bucket-id order: scores with ties (ties go to the lower bucket id), -inf and -0.0 scores, empty buckets,
    capacities below 0, of 0, inside a bucket, on a bucket's edge and past every token; the count shared over the KV
    heads (an expanded tensor, as DynSplit-KV passes it) or per head. The Triton kernel gives the same integers, two or
    four bits of the threshold a step."""
    from semkv.kernels.triton_bucket_take import bucket_take

    gen = torch.Generator().manual_seed(7)
    batch, heads, n = 7, 2, 37
    scores = torch.randint(-3, 4, (batch, heads, n), generator=gen).float()  # many ties
    scores[0, 0, :5] = float("-inf")
    scores[1, 1, 3] = -0.0
    count = torch.randint(0, 6, (batch, heads, n), generator=gen).int()
    count[:, :, 10] = 0
    total = count.sum(-1)[:, 0]
    edge = int(count[3, 0][scores[3, 0] > 0].sum())  # the capacity ends exactly after the positive buckets
    capacity = torch.tensor([0, 17, int(total[2]) + 5, edge, int(total[4]), 1, -2])
    offsets = torch.arange(8)
    cap = capacity[:, None, None, None]

    def check(scores, counts):
        before, first, place = reference.bucket_take(scores, counts, capacity)
        exact = reference.ranked_before(scores, counts)
        assert torch.equal(first, counts.cumsum(-1, dtype=torch.int32) - counts)
        inside = offsets < counts[..., None]
        taken = lambda before: ((before[..., None] + offsets) < cap) & inside  # noqa: E731  [B, S, n, 8]
        assert torch.equal(taken(before), taken(exact))
        for b in range(batch):  # the taken tokens, each at place + offset, fill 0..taken-1 once each
            for h in range(heads):
                at = (place[b, h, :, None] + offsets)[taken(before)[b, h]]
                assert sorted(at.tolist()) == list(range(int(taken(before)[b, h].sum())))
        for bits in (2, 4):  # the threshold two bits a step (the default) or four
            got = bucket_take(scores, counts, capacity, bits=bits)
            assert all(torch.equal(g, w) for g, w in zip(got, (before, first, place)))
        rows = torch.randperm(batch + 2, generator=gen)[:batch]  # the counts of state rows, read in place
        table = torch.zeros(batch + 2, heads, n, dtype=torch.int32)
        table[rows] = counts
        for take in (reference.bucket_take, bucket_take):
            assert all(torch.equal(g, w) for g, w in zip(take(scores, table, capacity, rows), (before, first, place)))

    for shared in (False, True):
        check(scores, count[:, :1].expand(-1, heads, -1) if shared else count)
    # scores without ties: the capacity ends at a key found down to its last bits
    check(torch.randn(batch, heads, n, generator=gen) * torch.logspace(-30, 30, n), count)


def test_slot_stamps_kernel_matches_reference():
    """DynSplit-KV's reuse counting: slots attended at the previous step count as reused, the new token is not
    counted, a row at its first step reuses nothing, a padding row (counter row 0) writes only the scratch page; then
    every attended slot carries this step's stamp."""
    from semkv.methods.dynsplit.triton_slot_stamps import slot_stamps

    gen = torch.Generator().manual_seed(5)
    pages, page_size, heads, width = 30, 4, 2, 9
    tables = torch.stack([torch.randperm(pages - 1, generator=gen)[:6] + 1 for _ in range(4)])  # page 0: scratch
    tables[3] = 0  # the padding row
    slots = torch.sort(torch.stack([torch.stack([torch.randperm(24, generator=gen)[:width] for _ in range(heads)])
                                    for _ in range(4)]), dim=-1).values  # [B, S, width] ascending, distinct
    lengths = torch.tensor([[9, 5], [7, 7], [3, 8], [1, 1]])
    current = slots.gather(2, (lengths[:, :1] - 1)[..., None])[:, 0, 0]  # a row's last slot of head 0: the new token
    step, first, rows = torch.tensor([7, 7, 7, 7]), torch.tensor([0, 0, 1, 0]), torch.tensor([2, 1, 3, 0])
    stamps = torch.randint(5, 7, (pages * page_size, heads), generator=gen, dtype=torch.int32)  # steps 5 and 6
    reuse = torch.randint(0, 50, (4, 2), generator=gen)
    want = [stamps.clone(), reuse.clone()]
    got = [stamps.clone(), reuse.clone()]
    args = (tables, page_size, slots, lengths, current, step, first)
    dynsplit_reference.slot_stamps(want[0], *args, want[1], rows, 0)
    slot_stamps(got[0], *args, got[1], rows, 0, block=4)
    assert torch.equal(want[0][page_size:], got[0][page_size:]) and torch.equal(want[1][1:], got[1][1:])
    assert (want[1][1:] - reuse[1:]).sum() > 0 and (want[1][2:] - reuse[2:])[:, 0].sum() >= 0
    assert want[1][3, 0] == reuse[3, 0]  # first step: nothing reused


def test_cudnn_prefill_merge_kernel_matches_attention_over_both_key_sets():
    """The cuDNN path's merge of two partial attentions (context without a mask, the chunk's own keys) equals the
    attention over the union, cut to the real queries."""
    from semkv.kernels import cudnn_prefill

    gen = torch.Generator().manual_seed(5)
    heads, padded, chunk, dim = 3, 12, 10, 16
    q = torch.randn(1, heads, padded, dim, generator=gen)
    keys = [torch.randn(1, heads, n, dim, generator=gen) for n in (7, 9)]
    values = [torch.randn(1, heads, n, dim, generator=gen) for n in (7, 9)]

    def attend(k, v):
        logits = q @ k.transpose(-1, -2) * 0.3
        return torch.softmax(logits, -1) @ v, torch.logsumexp(logits, -1)

    want, want_lse = attend(torch.cat(keys, 2), torch.cat(values, 2))
    parts = [attend(k, v) for k, v in zip(keys, values)]
    got, got_lse = cudnn_prefill.merged(*parts[0], *parts[1], chunk)
    assert got.shape == (chunk, heads, dim) and got_lse.shape == (chunk, heads)
    assert (got - want[0, :, :chunk].transpose(0, 1)).abs().max() < 1e-5
    assert (got_lse - want_lse[0, :, :chunk].T).abs().max() < 1e-5


def test_tokenselect_soft_vote_kernel_matches_the_summed_softmaxes():
    """TokenSelect's prefill vote over one layer's heads: candidates not a multiple of the block, a head count that is
    not a power of two, non-candidates at -inf; the top-k it leads to is the reference's."""
    from semkv.methods.tokenselect import triton_soft_vote
    from semkv.methods.tokenselect.reference import head_vote

    gen = torch.Generator().manual_seed(6)
    scores = torch.randn(7, 1000, generator=gen) * 4
    scores[:, 990:] = float("-inf")
    want = torch.softmax(scores, -1).sum(0, keepdim=True)
    got = triton_soft_vote.soft_vote(scores, block=128)
    assert got.shape == (1, 1000) and torch.allclose(got, want, rtol=1e-5, atol=1e-7)
    top = got.topk(50, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(top, head_vote(scores, 50, "soft_vote", None))


@pytest.mark.parametrize("sink,hi,start,k", [(4, 200, 230, 37), (0, 150, 150, 20), (8, 131, 239, 100)])
def test_tokenselect_prefill_context_kernel_equals_the_reference(sink, hi, start, k):
    """TokenSelect's sparse-prefill selection in one fused pass (the scores and their block statistics written
    together, the k picked slots sorted in one program between the initial and the recent slots) gives the
    reference's list: paged dot product, summed softmaxes, top-k, concatenation. Candidates not a multiple of the
    block, no initial or no recent slots, pages in random order, a query group of 3."""
    from semkv.methods.tokenselect import reference as tokenselect_reference
    from semkv.methods.tokenselect import triton_soft_vote

    gen = torch.Generator().manual_seed(8)
    k_pool = torch.randn(60, 4, 2, 16, generator=gen)
    table = torch.randperm(60, generator=gen)
    q = torch.randn(6, 16, generator=gen) * 2
    want = tokenselect_reference.prefill_context(q, k_pool, table, sink, hi, start, k)
    got = triton_soft_vote.prefill_context(q, k_pool, table, sink, hi, start, k, block_n=32)
    assert want.shape == (1, sink + k + start - hi) and torch.equal(got, want)
    assert torch.equal(want, want.sort(dim=1).values) and want.unique().numel() == want.shape[1]


def test_cudnn_prefill_turns_itself_off_with_one_warning_when_cudnn_refuses():
    """A torch or cuDNN that cannot run the fused attention leaves prefill to the Triton kernel for the rest of the
    process, with one warning naming the error (the output stays the same; only the speed differs)."""
    from semkv.kernels import cudnn_prefill

    q = torch.zeros(2048, 4, 16, dtype=torch.bfloat16)
    try:
        with pytest.warns(RuntimeWarning, match="no cuDNN attention in this build"):
            cudnn_prefill.PATH.turn_off(RuntimeError("no cuDNN attention in this build"))
        assert not cudnn_prefill.usable(q, None)
    finally:
        cudnn_prefill.PATH.failed.clear()


def test_fa3_turns_itself_off_with_one_warning_when_it_refuses(monkeypatch):
    """FlashAttention 3 refusing a prefill call (a shape or build it does not run) leaves prefill to the next path for
    the rest of the process, with one warning naming the error, and decode to it still; a refused decode call leaves
    decode to the Triton kernel and prefill to FlashAttention 3."""
    from semkv.kernels import fa3

    monkeypatch.setattr(fa3, "available", lambda: True)  # as where vLLM is installed on a Hopper GPU
    q, k_pool = torch.zeros(64, 4, 16, dtype=torch.bfloat16), torch.zeros(4, 16, 2, 16, dtype=torch.bfloat16)
    assert fa3.usable(q, None, k_pool) and not fa3.usable(q, torch.zeros(1, 3), k_pool)
    for path, other in [(fa3.PATH, fa3.DECODE_PATH), (fa3.DECODE_PATH, fa3.PATH)]:
        try:
            with pytest.warns(RuntimeWarning, match="head_dim 80 is not supported"):
                path.turn_off(RuntimeError("head_dim 80 is not supported"))
            assert not fa3.usable(q, None, k_pool, path) and fa3.usable(q, None, k_pool, other)
        finally:
            path.failed.clear()


def test_fa3_decode_inputs_are_each_layers_int32_tables_and_counts():
    """A decode step's FlashAttention 3 arguments, made once for every layer: each layer's rows of page ids and slot
    counts contiguous in int32, and one query row a sequence."""
    from semkv.kernels import fa3

    tables = torch.arange(3 * 4 * 5).view(3, 4, 5)  # [B, layers, W] int64
    num_slots = torch.arange(12).view(3, 4) + 1  # [B, layers]
    inputs = fa3.decode_inputs(tables, num_slots, longest=80)
    assert inputs.tables.shape == (4, 3, 5) and inputs.used.shape == (4, 3) and inputs.longest == 80
    for layer in range(4):
        assert torch.equal(inputs.tables[layer], tables[:, layer].int()) and inputs.tables[layer].is_contiguous()
        assert torch.equal(inputs.used[layer], num_slots[:, layer].int()) and inputs.used[layer].is_contiguous()
    assert inputs.cu_q.tolist() == [0, 1, 2, 3] and inputs.cu_q.dtype == torch.int32


def test_fa3_prefill_lengths_are_made_on_the_device_once_a_chunk():
    """FlashAttention 3's cu_seqlens_q (0, chunk) and seqused_k (n,) of a chunk, made without copying from host
    memory (`torch.tensor(list).to(cuda)` waited for every queued kernel, once for each follow-up's chunk) and kept
    for the chunk's other layers."""
    from semkv.kernels import fa3

    device = torch.device("cpu")
    for chunk, n in [(1, 1), (37, 31_037), (8192, 32_000)]:
        cu_q, used_k = fa3.lengths(chunk, n, device)
        assert cu_q.tolist() == [0, chunk] and used_k.tolist() == [n]
        assert cu_q.dtype == used_k.dtype == torch.int32
        assert fa3.lengths(chunk, n, device)[0] is cu_q  # the chunk's next layers reuse them


@pytest.mark.parametrize("start, chunk", [(0, 40), (0, 1100), (700, 300), (1024, 50), (1500, 1200), (2048, 1024)])
def test_cudnn_prefill_calls_have_padded_lengths_and_equal_the_reference(monkeypatch, start, chunk):
    """The cuDNN path at any start and chunk length (a server's step budget cuts chunks anywhere): every fused call it
    makes has query and key lengths that are multiples of PAD (so cuDNN reuses its plans), and the output and lse
    equal the reference's. cuDNN's call is stood in for by the same attention in plain torch (causal: query i sees
    keys up to i), the merge kernel runs in Triton's interpreter."""
    from semkv.kernels import cudnn_prefill, reference

    shapes = []

    def attend(q, k, v, causal, scale, lse=True):  # q [1, H, M, D], k/v [1, KH, N, D]
        shapes.append((q.shape[2], k.shape[2]))
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        logits = (q.float() @ k.float().transpose(-1, -2)) * scale
        if causal:
            logits = logits.masked_fill(torch.ones_like(logits, dtype=torch.bool).triu(1), float("-inf"))
        return (torch.softmax(logits, -1) @ v.float()).to(q.dtype), torch.logsumexp(logits, -1) if lse else None

    monkeypatch.setattr(cudnn_prefill, "_attend", attend)
    gen = torch.Generator().manual_seed(9)
    page, kv_heads, heads, dim = 16, 2, 4, 16
    pages = -(-(start + chunk) // page) + 1
    k_pool, v_pool = (torch.randn(pages + 1, page, kv_heads, dim, generator=gen) for _ in range(2))
    table = torch.randperm(pages, generator=gen)[: pages - 1] + 1  # page 0: scratch
    q = torch.randn(chunk, heads, dim, generator=gen)
    want, want_lse = reference.prefill_attention(q, k_pool, v_pool, table, start, None, 0.25, lse=True)
    got, got_lse = cudnn_prefill.prefill_attention(q, k_pool, v_pool, table, start, 0.25, lse=True)
    assert (got - want).abs().max() < 1e-4 and (got_lse - want_lse).abs().max() < 1e-4
    assert shapes and all(m % cudnn_prefill.PAD == 0 and n % cudnn_prefill.PAD == 0 for m, n in shapes)


def test_a_servers_warm_up_builds_every_plan_its_cuts_use(monkeypatch):
    """torch keys a cuDNN plan by the call's shapes, strides, mask and lse flag. `warm_up_cuts` for a step budget
    makes, on zeros, every key that `prefill_attention` makes for chunks cut by that budget at any start (a prefix-
    cache hit starts a prompt mid-page; a step where nothing decodes takes the engine's whole chunk): so a server
    builds no plan while requests wait. The fused call is stood in for by a recorder; a chunk longer than the budget
    past the first context block would be a new key, and is checked to be one."""
    from semkv.kernels import cudnn_prefill

    pad = cudnn_prefill.PAD
    keys = []

    def attend(q, k, v, causal, scale, lse=True):  # q [1, H, M, D], k/v [1, KH, N, D]
        keys.append((tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), v.stride(), causal, lse))
        return torch.zeros_like(q), torch.zeros(q.shape[:3]) if lse else None

    monkeypatch.setattr(cudnn_prefill, "_attend", attend)
    monkeypatch.setattr(cudnn_prefill, "usable", lambda q, context: True)
    monkeypatch.setattr(cudnn_prefill, "merged", lambda a, la, b, lb, chunk: (a[0, :, :chunk].transpose(0, 1),
                                                                             la[0, :, :chunk].T))
    page, kv_heads, heads, dim, step, chunk, max_len = 16, 2, 4, 8, 1500, 3000, 5 * pad
    k_pool = v_pool = torch.zeros(max_len // page + 2, page, kv_heads, dim, dtype=torch.bfloat16)
    table = torch.arange(1, max_len // page + 2)
    cudnn_prefill.warm_up_cuts(k_pool, v_pool, heads, 0.25, step, chunk, max_len)
    built, keys[:] = set(keys), []
    assert built
    cuts = [(0, 1024), (0, step), (16, step), (1000, 1024), (1024, 1024), (1500, 1200), (2100, step), (16, chunk),
            (0, chunk), (max_len - 1024, 1024), (700, 1300)]
    for start, length in cuts:
        q = torch.zeros(length, heads, dim, dtype=torch.bfloat16)
        cudnn_prefill.prefill_attention(q, k_pool, v_pool, table, start, 0.25, lse=start % 3 == 0)
    assert set(keys) <= built, set(keys) - built
    keys[:] = []
    cudnn_prefill.prefill_attention(torch.zeros(chunk + 100, heads, dim, dtype=torch.bfloat16), k_pool, v_pool,
                                    table, 1024, 0.25)  # past the budget after a context block: not a server's cut
    assert not set(keys) <= built


@pytest.mark.parametrize("w, heads, kv_heads, dim, n", [(40, 4, 2, 16, 150), (8, 14, 2, 64, 1100), (64, 8, 8, 32, 70)])
def test_window_mass_kernel_matches_reference(w, heads, kv_heads, dim, n):
    """The window's attention mass of each key (`triton_window_mass`: a log-sum-exp pass with the keys split between
    programs, then a pass over key blocks), against the reference that makes the probabilities: GQA, keys at gapped
    positions (a compacted cache), queries that see only the keys at or before them, a window that is not a multiple
    of a query tile and keys that are not a multiple of a block or of a split (1,100 keys: 16 splits of 128)."""
    from semkv.kernels import triton_window_mass
    from semkv.methods.base import window_attention

    gen = torch.Generator().manual_seed(w)
    q, keys = torch.randn(w, heads, dim, generator=gen), torch.randn(kv_heads, n, dim, generator=gen)
    positions = torch.sort(torch.randperm(3 * n, generator=gen)[:n]).values[None].expand(kv_heads, -1)
    query_positions = positions[0, n - w:]
    want = reference.window_mass(q, keys, positions, query_positions, dim**-0.5)
    got = triton_window_mass.window_mass(q, keys, positions, query_positions, dim**-0.5)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    assert torch.allclose(want.sum(1), torch.full((heads,), float(w)), atol=1e-3)  # each query's probabilities: 1
    old = window_attention(q, keys, positions, query_positions).sum(1)  # what the methods summed before
    assert torch.allclose(want, old, atol=1e-6, rtol=1e-5)
    assert torch.all(want[:, n - w + 1:] < w)  # the window's later keys are in its first queries' future
