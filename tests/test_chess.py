"""CHESS: the cascade on hand-built vectors, retained fractions, one product = level-by-level scoring, the budget
mapping, page vectors (Eq. 1) against the stored keys, uncertainty statistics, re-selection triggers, calibration."""
from __future__ import annotations

import math
import statistics
import warnings
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from semkv.engine.kv_cache import SeqKV
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.errors import SemkvError
from semkv.methods import Chess, FullKV, calibration
from semkv.methods.chess.cascade import cascade, cascade_ratios, level_scores
from semkv.methods.chess.method import PRESETS, PagePlan
from semkv.methods.chess.uncertainty import page_uncertainty, teacher_forced_entropies, token_entropy
from semkv.models.rotary import RotaryEmbedding

TEXT = "Paged attention stores keys and values in fixed-size pages, and a page table maps positions to pages. " * 6


def ones(*shape):
    return torch.ones(*shape, dtype=torch.bool)


def test_cascade_selects_the_expected_pages():
    # 4 grids of 2 chunks of 2 pages
    page_scores = torch.tensor([[1, 1, 1, 1, 9, 0, 0, 0, 3, 3, 3, 3, 0, 0, 0, 8]], dtype=torch.float)
    # grids score 1, 2.25, 3, 2 -> keep grids 2, 1; their chunks score 4.5, 0, 3, 3 -> keep chunks 2, 4 (tie: the
    # lower index); their pages score 9, 0, 3, 3 -> keep pages 4 and 8. Page 15 (score 8) sits in a pruned grid.
    keep = cascade(page_scores, ones(1, 16), 2, 2, torch.tensor([[0.5, 0.5, 0.5]]))
    assert keep[0].nonzero().flatten().tolist() == [4, 8]
    # a flat top-2 would take pages 4 and 15: the hierarchy matters
    assert torch.topk(page_scores[0], 2).indices.sort().values.tolist() == [4, 15]
    # non-candidate pages (sink, recent window) neither count in their parents' scores nor get selected
    candidates = ones(1, 16)
    candidates[0, [0, 4, 15]] = False
    keep = cascade(page_scores, candidates, 2, 2, torch.tensor([[0.5, 0.5, 0.5]]))
    # grids now score 1, 0, 3, 0 -> grids 2, 0; chunks 3, 3, 1, 1 -> chunks 4, 5; pages 3, 3, 3, 3 -> pages 8, 9
    assert keep[0].nonzero().flatten().tolist() == [8, 9]
    # max_pages caps the page level
    keep = cascade(page_scores, ones(1, 16), 2, 2, torch.ones(1, 3), torch.tensor([3]))
    assert keep[0].nonzero().flatten().tolist() == [4, 8, 15]


@pytest.mark.parametrize("preset, rho_p", [("conservative", 0.9), ("moderate", 0.7), ("aggressive", 0.1)])
def test_retained_fraction_is_the_product_of_the_ratios(preset, rho_p):
    torch.manual_seed(0)
    n_pages = 512
    rho = torch.tensor([[*PRESETS[preset], rho_p]] * 2)
    keep = cascade(torch.randn(2, n_pages), ones(2, n_pages), 4, 4, rho)
    expected = math.prod(rho[0].tolist())
    for row in keep:
        assert abs(row.sum().item() / n_pages - expected) <= 0.01 + 0.02 * expected


def test_level_scores_are_the_affinity_of_the_mean_vectors():
    """Eq. 2 then Eq. 4: a chunk's score is its mean candidate page vector dotted with the anchor, a grid's the mean
    of its chunk vectors dotted with the anchor; the cascade gets them from the page scores alone."""
    torch.manual_seed(1)
    vectors, anchor = torch.randn(3, 37, 16), torch.randn(3, 16)
    candidates = torch.rand(3, 37) > 0.2
    (s_g, s_c, s_p), (ok_g, ok_c, ok_p) = level_scores(torch.einsum("bpd,bd->bp", vectors, anchor), candidates, 3, 2)
    for b in range(3):
        pages = [vectors[b, i] if i < 37 and candidates[b, i] else None for i in range(s_p.shape[1])]
        chunk_vectors = []
        for c in range(s_c.shape[1]):
            members = [p for p in pages[3 * c : 3 * c + 3] if p is not None]
            assert bool(ok_c[b, c]) == bool(members)
            chunk_vectors.append(torch.stack(members).mean(0) if members else None)
            if members:
                assert torch.allclose(s_c[b, c], chunk_vectors[-1] @ anchor[b], atol=1e-4)
        for g in range(s_g.shape[1]):
            members = [v for v in chunk_vectors[2 * g : 2 * g + 2] if v is not None]
            assert bool(ok_g[b, g]) == bool(members)
            if members:
                assert torch.allclose(s_g[b, g], torch.stack(members).mean(0) @ anchor[b], atol=1e-4)
        assert torch.allclose(s_p[b, :37], vectors[b] @ anchor[b], atol=1e-4)


def test_budget_maps_onto_the_ratios():
    for preset in PRESETS.values():
        g, c = preset
        rho = cascade_ratios(preset, torch.tensor([0.0, g * c / 2, (g * c + 1) / 2, 1.0]))
        assert rho[0].tolist() == pytest.approx([g, c, 0.0])
        assert rho[1].tolist() == pytest.approx([g, c, 0.5])
        assert rho[2, 2].item() == 1.0 and rho[2, 0] >= g and rho[2, 1] >= c
        assert rho[2, :2].prod().item() == pytest.approx((g * c + 1) / 2, rel=1e-5)
        assert rho[3].tolist() == [1.0, 1.0, 1.0]  # budget >= context: Full KV


def test_plan_selection_is_the_sink_the_best_kept_pages_and_the_window(tiny_llm):
    """The step's slots, computed by index arithmetic from the plan, against a direct construction: the sink page,
    the best k of the kept pages (k from what the budget leaves) and the recent window from its start."""
    from semkv.engine.hooks import DecodeBatch

    layers = tiny_llm.config.num_layers
    for budget in (0.25, 100, 10_000):
        method = Chess(budget=budget, block_size=16)
        method.bind(tiny_llm.config, tiny_llm.tokenizer, 16)
        n = [300, 200, 150, 1]
        window = [17, 11, 8, 0]  # first page of each row's window (row 3: a padding row)
        ranked = [[5, 2, 9, 1, 14, 3], [7, 1, 4], [], []]  # kept pages, best first
        pages = torch.tensor([r + [-1] * (6 - len(r)) for r in ranked])
        counts = torch.tensor(n)
        batch = DecodeBatch([], counts - 1, counts[:, None].expand(-1, layers), tiny_llm.config, max_slots=300)
        selection = method.plan_selection(batch, PagePlan(pages, torch.tensor(window)))
        for b in range(4):
            limit = math.ceil(budget * n[b]) if isinstance(budget, float) else budget
            recent = min(n[b] - 16 * window[b], limit)
            sink = min(16 if window[b] else 0, limit - recent)
            k = (limit - recent - sink) // 16
            want = set(range(sink)) | set(range(n[b] - recent, n[b]))
            for page in ranked[b][:k]:
                want |= set(range(16 * page, 16 * page + 16))
            got = selection.slots[b, 0, : int(selection.lengths[b, 0])].tolist()
            assert got == sorted(want), (budget, b)


def test_parameters_are_validated(tiny_llm):
    for bad in (dict(preset="greedy"), dict(mode="never"), dict(recent_pages=0), dict(block_size=0), dict(trigger="all"),
                dict(entropy_threshold=-1.0), dict(center=1), dict(anchor="query"), dict(query_window=0),
                dict(anchor="queries", rope_free=True), dict(anchor="queries", center=True),
                dict(anchor="queries", mode="always"), dict(anchor="queries", entropy_threshold=1.0),
                dict(neighbours=2), dict(anchor="queries", neighbours=-1)):
        with pytest.raises(SemkvError):
            Chess(budget=64, **bad)
    with pytest.raises(SemkvError, match="multiple"):
        Chess(budget=64, block_size=24).bind(tiny_llm.config, tiny_llm.tokenizer, 16)


def test_one_fold_brings_the_page_sums_of_a_batch_up_to_date(tiny_llm):
    """A batched fold over sequences summarised to different points (40, 64, 5, 280 tokens) and grown by different
    amounts (to 100, 65, 300, 300) gives, page by page and layer by layer, the sums of the stored keys (the folded range of one
    sequence reaching past the stacked tables' width)."""
    engine, cfg = tiny_llm.engine, tiny_llm.config
    method = Chess(budget=64, block_size=32)
    method.bind(cfg, tiny_llm.tokenizer, engine.pool.page_size)
    gen = torch.Generator().manual_seed(0)
    spans = [(40, 100), (64, 65), (5, 300), (280, 300)]
    seqs = []
    for i, (start, end) in enumerate(spans):
        seq = Sequence(i, [1] * end, SamplingParams(), SeqKV(engine.pool))
        seq.method_state = method.new_state(seq)
        slots = torch.arange(end)
        for layer in range(cfg.num_layers):
            seq.kv.ensure_slots(layer, end)
            k = torch.randn(end, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(engine.dtype)
            seq.kv.write(layer, slots, k, k, slots)
            seq.kv.num_slots[layer] = start
        method.finish_prefill(seq)  # sums of the first `start` tokens
        seq.kv.num_slots = [end] * cfg.num_layers
        seqs.append(seq)
    try:
        size = engine.pool.page_size
        tables = method.stacked_tables(seqs, -(-300 // size))  # as a re-selection passes them: just wide enough
        method.fold(seqs, [end for _, end in spans], tables)
        for seq, (_, end) in zip(seqs, spans):
            pages = -(-end // size)
            for layer in range(cfg.num_layers):
                keys = torch.nn.functional.pad(seq.kv.keys(layer).float(), (0, 0, 0, pages * size - end))
                want = keys.view(cfg.num_kv_heads, pages, size, -1).sum(2).transpose(0, 1)  # [pages, H, D]
                got = method.summaries.gather("sum", seq.kv.table[layer, :pages])
                assert torch.allclose(got, want, atol=1e-4), (seq.seq_id, layer)
            assert seq.method_state.summarized == end
    finally:
        for seq in seqs:
            seq.kv.release()


@dataclass
class Probe(Chess):
    """CHESS that records, after each step, its logits, the page dot products and mean vector it reads from its page
    sums, the same computed from the keys directly, and its uncertainty state."""

    seen: list = field(default_factory=list)

    def observe_logits(self, seqs, logits):
        seq = seqs[0]
        before = [float(x) for x in seq.method_state.entropies]
        super().observe_logits(seqs, logits)
        kv = seq.kv
        n = seq.num_computed + 1  # keys stored: this step's token too (the next step's slot may be prepared already)
        self.fold([seq], [n])  # the page sums are brought up to date lazily (at a selection)
        pages = -(-n // self.block_size)
        keys = torch.stack([kv.keys(layer)[:, :n] for layer in range(kv.pool.num_layers)])  # [L, H, n, D] as stored
        if self.rope_free:  # RoPE undone: rotating forward again, as the model does, gives the stored keys back
            positions = torch.stack([kv.positions(layer)[:, :n] for layer in range(kv.pool.num_layers)])
            unrotate = self.summaries.transform
            stored, keys = keys, unrotate(keys, positions)
            cos, sin = unrotate.rotary.cos_sin(positions.flatten().long(), torch.float32)
            again = RotaryEmbedding.rotate(keys.reshape(-1, 1, keys.shape[-1]), cos, sin).view_as(keys)
            assert torch.allclose(again, stored, atol=1e-4) and not torch.allclose(keys, stored, atol=1e-2)
        keys = torch.nn.functional.pad(keys, (0, 0, 0, pages * self.block_size - n))
        sums = keys.view(*keys.shape[:2], pages, self.block_size, -1).sum(3).permute(2, 0, 1, 3)  # [pages, L, H, D]
        counts = (n - torch.arange(pages) * self.block_size).clamp(max=self.block_size)
        direct = sums / counts[:, None, None, None]  # Eq. 1
        directions = torch.randn(1, 2, *direct.shape[1:], generator=torch.Generator().manual_seed(len(self.seen)))
        chosen = torch.arange(pages) % 2 == 0
        got = (self.page_dots([seq], torch.tensor([n]), pages, directions)[0],
               self.mean_vector([seq], torch.tensor([n]), torch.arange(pages)[None], chosen[None], pages)[0])
        want = (torch.einsum("plhd,rlhd->rp", direct, directions[0]), direct[chosen].mean(0))
        state = seq.method_state
        self.seen.append((logits[0].clone(), got, want, seq.stats.extra["reselections"], before,
                          [float(x) for x in state.entropies]))


@pytest.mark.parametrize("rope_free", [False, True])
def test_page_vectors_follow_the_keys_and_entropies_the_logits(tiny_llm, rope_free):
    probe = Probe(budget=64, block_size=32, rope_free=rope_free, center=rope_free, entropy_threshold=1e9,
                  varentropy_threshold=1e9)
    tiny_llm.generate(TEXT, method=probe, max_new_tokens=40, chat=False, ignore_eos=True)
    assert len(probe.seen) == 39
    for logits, got, want, _, before, after in probe.seen:
        for x, y in zip(got, want):  # Eq. 1, brought up to date across page boundaries
            assert torch.allclose(x, y, atol=1e-3)
        p = torch.softmax(logits.double(), -1)
        if len(before) + 1 == probe.block_size:  # a page of generated tokens is complete: its entropies are used up
            assert after == []
        else:
            assert after[:-1] == before and after[-1] == pytest.approx(float(-(p * p.log()).sum()), rel=1e-4)


def test_entropy_and_varentropy_match_a_direct_computation():
    torch.manual_seed(2)
    logits = torch.randn(4, 32, 50) * 3
    entropy = token_entropy(logits)
    direct = [[-sum(p * math.log(p) for p in torch.softmax(row.double(), -1).tolist()) for row in page]
              for page in logits]
    assert torch.allclose(entropy.double(), torch.tensor(direct, dtype=torch.double), atol=1e-5)
    mean, var = page_uncertainty(entropy)
    for i, page in enumerate(direct):
        assert mean[i].item() == pytest.approx(statistics.fmean(page), rel=1e-5)
        assert var[i].item() == pytest.approx(statistics.pvariance(page), rel=1e-4)


def run(llm, new, **params):
    probe = Probe(budget=64, block_size=16, **params)
    out = llm.generate(TEXT, method=probe, max_new_tokens=new, chat=False, ignore_eos=True)[0]
    return probe, out.stats.extra["reselections"]


def test_reselection_fires_when_thresholds_are_crossed_and_not_otherwise(tiny_llm):
    new = 50  # 49 decode steps: pages of 16 generated tokens end at steps 16, 32, 48 and re-select at the next step
    assert run(tiny_llm, new, entropy_threshold=0.0)[1] == 3
    assert run(tiny_llm, new, entropy_threshold=1e9, varentropy_threshold=1e9)[1] == 0
    assert run(tiny_llm, new, mode="periodic", period=2)[1] == 1
    assert run(tiny_llm, new, mode="always")[1] == new - 2
    # a threshold between the pages' mean entropies: re-selects after exactly the pages above it
    probe, _ = run(tiny_llm, new, entropy_threshold=1e9, varentropy_threshold=1e9)
    means = page_uncertainty(token_entropy(torch.stack([s[0] for s in probe.seen[:48]])).view(3, 16))[0]
    threshold = float(means.median())
    probe, count = run(tiny_llm, new, entropy_threshold=threshold, varentropy_threshold=1e9)
    means = page_uncertainty(token_entropy(torch.stack([s[0] for s in probe.seen[:48]])).view(3, 16))[0]
    assert count == int((means > threshold).sum())
    fired = [s[3] for s in probe.seen]  # reselections counted after each step
    for page, above in enumerate((means > threshold).tolist()):
        assert fired[16 * page + 16] - fired[16 * page + 15] == int(above)
    both = Chess(budget=64, trigger="both", entropy_threshold=1.0, varentropy_threshold=1.0)
    both.bind(tiny_llm.config, tiny_llm.tokenizer, 16)
    assert both.uncertain(2.0, 2.0) and not both.uncertain(2.0, 0.5) and not both.uncertain(0.5, 2.0)


def test_calibration_is_the_99th_percentile_and_bind_reads_it(tiny_llm, monkeypatch, tmp_path):
    monkeypatch.setenv("SEMKV_CACHE_DIR", str(tmp_path))
    ids = tiny_llm.tokenizer(TEXT * 2)["input_ids"][:200]
    entropies = teacher_forced_entropies(tiny_llm, ids)
    for k in (40, 199):  # the entropy at token k is that of the last logits of a prefill of ids[:k + 1]
        seq = Sequence(0, ids[: k + 1], SamplingParams(), SeqKV(tiny_llm.engine.pool))
        assert entropies[k].item() == pytest.approx(token_entropy(tiny_llm.engine.prefill(seq, FullKV())).item(),
                                                    rel=1e-4)
        tiny_llm.engine.release(seq)
    data = Chess.calibrate(tiny_llm, [TEXT * 2], 200)
    pages = torch.stack(page_uncertainty(entropies[:192].view(6, 32)), -1)
    assert [data["entropy"], data["varentropy"]] == pytest.approx(torch.quantile(pages, 0.99, 0).tolist(), rel=1e-5)
    calibration.save("chess", tiny_llm.config.source, data)
    method = Chess(budget=64)
    method.bind(tiny_llm.config, tiny_llm.tokenizer, 16)
    assert method.thresholds == (data["entropy"], data["varentropy"])
    with pytest.raises(SemkvError, match="no full page"):
        Chess.calibrate(tiny_llm, ["short"], 200)


def test_query_anchor_scores_pages_by_the_prompt_windows_attention(tiny_llm):
    """anchor="queries": the pages' scores are the last prompt queries' softmax attention summed over each page's
    tokens, the query heads and the layers (computed here from the stored keys and recorded queries of a Full-KV
    prefill); the selection made once after prefill keeps the best-scored pages, and it is the same from the method's
    own prefill and from a shared one; a covering budget gives Full KV's tokens; nothing stays behind."""
    from semkv.methods.base import window_attention

    engine = tiny_llm.engine
    ids, _ = tiny_llm.encode(TEXT, None, chat=False)
    seq = Sequence(0, ids, SamplingParams(), SeqKV(engine.pool))
    engine.prefill(seq, FullKV(), record_window=8)
    n = len(ids)
    want = torch.zeros(-(-n // 16), dtype=torch.float64)
    for layer in range(tiny_llm.config.num_layers):
        keys, _, positions = seq.kv.gather(layer, seq.kv.all_slots(layer))
        q = seq.window_queries[layer]
        probs = window_attention(q, keys, positions, torch.arange(n - 8, n))  # [heads, 8, n]
        want += torch.nn.functional.pad(probs.double().mean(1).sum(0), (0, -n % 16)).view(-1, 16).sum(-1)
    engine.release(seq)

    seen: dict[str, list] = {"own": [], "shared": [], "pooled": []}

    @dataclass
    class Seen(Chess):  # the engine runs a bound copy: the record goes to `seen` under the copy's tag
        tag: str = "own"

        def reselect(self, seqs):
            super().reselect(seqs)
            seen[self.tag].append((seqs[0].method_state.page_mass.clone(), seqs[0].method_state.ranked.clone()))

    budget = 16 * 6
    own, shared, pooled = (Seen(budget=budget, block_size=16, chunk_pages=1, grid_chunks=1, anchor="queries",
                                query_window=8, neighbours=int(t == "pooled"), tag=t)
                           for t in seen)  # one page a chunk and a grid: the cascade keeps the top pages
    outs = tiny_llm.compare(TEXT, [FullKV(), shared, pooled, Chess(budget=budget, block_size=16)], max_new_tokens=20,
                            chat=False)
    tiny_llm.generate(TEXT, method=own, max_new_tokens=20, chat=False)
    assert len(seen["own"]) == len(seen["shared"]) == len(seen["pooled"]) == 1  # selected once, after prefill
    for tag, (mass, ranked) in ((t, seen[t][0]) for t in seen):
        torch.testing.assert_close(mass.double(), want, rtol=1e-4, atol=1e-6)
        scores = F.pad(mass, (0, -(-(n + 1) // 16) - mass.shape[0]))  # the first decode step's pages
        if tag == "pooled":  # a page scores the most of itself and its neighbours
            scores = torch.stack([scores, F.pad(scores[1:], (0, 1)), F.pad(scores[:-1], (1, 0))]).amax(0)
        candidates = scores[1:-2]  # neither the sink page nor the window
        best = (candidates.argsort(descending=True, stable=True)[:3] + 1).sort().values
        assert ranked[ranked >= 0].sort().values.tolist() == best.tolist(), tag  # (96 - 32 - 16) / 16 pages
    assert outs[1].stats.kv_attended_max <= budget
    full = tiny_llm.compare(TEXT, [FullKV(), Chess(budget=10_000, anchor="queries")], max_new_tokens=20,
                            chat=False)
    assert full[1].token_ids == full[0].token_ids
    assert engine.pool.in_use == 0 and not engine._live


@pytest.mark.slow
def test_embedded_model_full_budget_budgets_and_periodic_reselection(smol_llm, essay_text):
    doc = essay_text[:3000] + " The secret passkey is 73914. Remember it. " + essay_text[3000:6000]
    question = "What is the secret passkey? Answer with the number only."
    methods = [FullKV(), Chess(budget=100_000, mode="always"), Chess(budget=192),
               Chess(budget=192, preset="aggressive", rope_free=True, center=True)]
    full, at_full_budget, *limited = smol_llm.compare(doc, methods, question=question, max_new_tokens=16)
    assert at_full_budget.token_ids == full.token_ids
    for out in limited:
        assert out.stats.kv_attended_max <= 192 and out.stats.kv_attended_tokens < out.stats.prompt_tokens
    out = smol_llm.generate(doc, questions=[question], method=Chess(budget=0.2, mode="periodic", period=1),
                            max_new_tokens=70, ignore_eos=True)[0]
    assert out.stats.kv_attended_max <= math.ceil(0.2 * (out.stats.prompt_tokens + 69))
    assert out.stats.extra["reselections"] == 2  # generated pages end at decode steps 32 and 64 (of 69)


def test_a_budget_that_leaves_no_page_to_select_warns(tiny_llm):
    """The recent window (2 pages) and the sink page come first: with pages of 16 tokens a selected page needs a
    budget of 64 at least. Below it CHESS attends only the window and the sink, and says so; not where the budget
    holds a page, nor where it covers the prompt."""
    prompt = len(tiny_llm.tokenizer(TEXT)["input_ids"])
    for budget in (48, 0.1):
        with pytest.warns(UserWarning, match=f"budget={budget!r} leaves no page to select.*at least 64 tokens"):
            tiny_llm.generate(TEXT, method=Chess(budget=budget, block_size=16), max_new_tokens=2, chat=False)
    assert prompt * 0.1 < 64 < prompt
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for budget in (64, 0.5, prompt + 8):
            tiny_llm.generate(TEXT, method=Chess(budget=budget, block_size=16), max_new_tokens=2, chat=False)
        tiny_llm.generate(TEXT[:60], method=Chess(budget=48, block_size=16), max_new_tokens=2, chat=False)


def test_query_anchor_scores_every_layer_at_once_as_layer_by_layer(tiny_llm, monkeypatch):
    """anchor="queries" after a packed prompt chunk: every layer's window attention in a few calls
    (`evict_prefill_layers`; one a layer here, `layers_window_mass` gathering one layer's keys a call) gives the pages
    the scores of `evict_prefill` called layer by layer."""
    monkeypatch.setattr("semkv.methods.base.LAYERS_KEY_BYTES", 1)
    engine, layers = tiny_llm.engine, tiny_llm.config.num_layers
    method = Chess(budget=96, block_size=16, anchor="queries", query_window=8).bound(
        tiny_llm.config, tiny_llm.tokenizer, engine.pool.page_size)
    ids, _ = tiny_llm.encode(TEXT, None, chat=False)
    base = Sequence(0, ids, SamplingParams(), SeqKV(engine.pool))
    engine.prefill(base, FullKV(), record_window=8)
    masses = []
    for at_once in (False, True):
        seq = engine.fork(base, 1 + at_once)
        seq.method_state = method.new_state(seq)
        windows = [seq.window_queries[layer] for layer in range(layers)]
        if at_once:
            assert method.evict_prefill_layers(seq, windows) == [None] * layers
        else:
            assert all(method.evict_prefill(layer, seq, windows[layer]) is None for layer in range(layers))
        method.finish_prefill(seq)
        masses.append(seq.method_state.page_mass)
        engine.release(seq)
    engine.release(base)
    assert masses[0].shape == (-(-len(ids) // 16),) and torch.equal(masses[0], masses[1])
