"""`semkv bench` on the CPU: the largest batch Full KV fits in a fixed pool, a small grid run end to end with its
tables and plots, and batches prefilled for real from text (speed numbers themselves come from GPU runs, not from
tests)."""
from __future__ import annotations

import json

import pytest
import torch

from semkv.bench.cli import parse_batches, parse_hf_points
from semkv.bench.run import TextContexts, bench_decode, bound_method, largest_batch, prefilled_batch, served_rate
from semkv.cli.main import main
from semkv.engine.engine import Engine
from semkv.errors import SemkvError
from semkv.methods import get_method


def test_largest_full_batch_fits_and_one_more_does_not(tiny_llm):
    model, cfg = tiny_llm.engine.model, tiny_llm.config
    engine = Engine(model, cfg, tiny_llm.engine.device, tiny_llm.engine.dtype, num_pages=400)
    context, steps = 100, 3
    batch = largest_batch(engine, bound_method(engine, "full", None), context, steps)
    # per sequence: 3 layers x ceil((100 + 4 warm-up + 3 timed + 3 served + 2 breakdown) / 16) = 21 pages; 399 free
    # -> 19
    assert batch == (engine.pool.num_pages - 1) // (cfg.num_layers * -(-(context + 4 + 2 * steps + 2) // 16))
    row = bench_decode(engine, "full", None, batch, context, steps=steps)
    assert row.batch == batch and row.attended_per_layer == pytest.approx(context + (4 + 2 * steps + 2 + 1) / 2)
    assert row.served_tokens_per_s > 0  # attended above: 101..112, the served steps too
    assert engine.pool.in_use == 0  # the run gave its pages back
    with pytest.raises(MemoryError):
        bench_decode(engine, "full", None, batch + 1, context, steps=steps)
    with pytest.raises(SemkvError, match="needs a KV pool of fixed size"):
        largest_batch(tiny_llm.engine, bound_method(tiny_llm.engine, "full", None), context, steps)  # grows on demand


def test_the_largest_batch_counts_its_decode_steps_logits(tiny_llm):
    """A decode step's logits ([batch, vocabulary], the head's dtype, then float32) take memory beside the pool: with
    room for those of 5 rows only, `--batches max` gives 5, not the 19 the pool holds (on an H200 SnapKV's batch of
    3,295 at 32k ran out of memory making them), and that batch runs."""
    model, cfg, device, dtype = tiny_llm.engine.model, tiny_llm.config, tiny_llm.engine.device, tiny_llm.engine.dtype
    per_row = cfg.vocab_size * (dtype.itemsize + 4)
    engine = Engine(model, cfg, device, dtype, num_pages=400, state_memory=5 * per_row + per_row // 2)
    assert largest_batch(engine, bound_method(engine, "full", None), 100, 3) == 5
    assert bench_decode(engine, "full", None, 5, 100, steps=3).batch == 5


def test_an_offloading_method_reaches_a_larger_batch_and_reports_its_traffic(tiny_llm):
    """`--batches max` per method: offloading SentenceKV holds its budget per layer on the device, so the same pool
    runs more sequences than Full KV; the run reports the host memory it held and the K/V it read from the host per
    step, and gives every page and host byte back."""
    model, cfg = tiny_llm.engine.model, tiny_llm.config
    engine = Engine(model, cfg, tiny_llm.engine.device, tiny_llm.engine.dtype, num_pages=400)
    context, steps = 320, 3
    params = dict(n_sink=4, n_recent=4, offload=True)
    full = largest_batch(engine, bound_method(engine, "full", None), context, steps)
    method = bound_method(engine, "sentencekv", 32, params, tiny_llm.tokenizer)
    batch = largest_batch(engine, method, context, steps)
    assert batch >= 3 * full
    row = bench_decode(engine, "sentencekv", 32, batch, context, steps=steps, params=params,
                       tokenizer=tiny_llm.tokenizer)
    assert row.batch == batch and row.host_gib > 0 and row.h2d_mb_per_step > 0 and row.attended_per_layer <= 32
    assert engine.pool.in_use == 0 and engine.memory().held == (0, 0, 0, 0)


def test_the_engine_lets_segments_grow_in_place_unless_the_user_set_the_allocator(monkeypatch):
    """On CUDA the engine asks torch's allocator for expandable segments (state regrown beside the pool fragmented
    fixed segments until a growth of GiBs failed with GiBs free), never over a user's own allocator settings, and
    nothing on the CPU."""
    from semkv.engine import engine

    settings = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", settings.append)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    engine.grow_segments_in_place(torch.device("cpu"))
    assert settings == []
    engine.grow_segments_in_place(torch.device("cuda"))
    assert settings == ["expandable_segments:True"]
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        with monkeypatch.context() as patch:
            patch.setenv(name, "max_split_size_mb:512")
            engine.grow_segments_in_place(torch.device("cuda"))
    assert settings == ["expandable_segments:True"]


def test_a_row_growth_that_runs_out_of_memory_empties_the_cache_and_tries_once_more(tiny_llm, monkeypatch):
    """Admission counts torch's cached, unused blocks as room, which may be too fragmented for a large growth of an
    offloading method's rows (SentenceKV at 32k on an H200): the growth gives them back (`torch.cuda.empty_cache`)
    and tries once more, so a run whose first try fails gives the tokens of one that did not; a second failure is
    the caller's error and nothing stays held."""
    from semkv.methods.state import rows

    prompt = "The quick brown fox jumps over the lazy dog. " * 30
    params = dict(n_sink=4, n_recent=4, offload=True)
    want = tiny_llm.generate(prompt, method=get_method("sentencekv", 32, **params), max_new_tokens=6, chat=False)
    made, emptied = rows.regrown, []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))

    def failing(times):
        calls = []

        def regrown(old, shape):
            calls.append(1)
            if len(calls) <= times:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
            return made(old, shape)
        return regrown

    monkeypatch.setattr(rows, "regrown", failing(1))
    got = tiny_llm.generate(prompt, method=get_method("sentencekv", 32, **params), max_new_tokens=6, chat=False)
    assert got[0].token_ids == want[0].token_ids and emptied == [1]
    monkeypatch.setattr(rows, "regrown", failing(2))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        tiny_llm.generate(prompt, method=get_method("sentencekv", 32, **params), max_new_tokens=6, chat=False)
    assert emptied == [1, 1] and tiny_llm.engine.memory().held == (0, 0, 0, 0)


@pytest.mark.parametrize("name, params", [("sentencekv", dict(n_sink=4, n_recent=4, offload=True)),
                                          ("dynsplit", dict(offload=True))])
def test_a_batch_counts_each_row_growth_beside_the_old_rows(tiny_llm, monkeypatch, name, params):
    """Admitting a batch grows an offloading method's rows and working sets now and then, each growth making the new
    tensors while the old ones are alive: the state `--batches max` fits for the batch (`batch_state_bytes`) is at
    least the largest such moment of the real run, which is more than the final tensors (what it counted before, and
    where the offloading modes ran out of memory on an H200 at 32k)."""
    from semkv.bench.run import synthetic_ids
    from semkv.engine.kv_cache import SeqKV
    from semkv.engine.sequence import SamplingParams, Sequence
    from semkv.methods.state.rows import DeviceRows

    model, cfg = tiny_llm.engine.model, tiny_llm.config
    engine = Engine(model, cfg, tiny_llm.engine.device, tiny_llm.engine.dtype, num_pages=400)
    context, steps, batch, moments = 320, 2, 12, []
    grow = DeviceRows.grow

    def recording(self, needs):
        before = self._bytes(list(self.sizes()))
        moved = grow(self, needs)
        if moved:  # the old tensors and the new ones, alive together while it grew
            moments.append(before + self._bytes(list(self.sizes())))
        return moved

    monkeypatch.setattr(DeviceRows, "grow", recording)
    bench_decode(engine, name, 32, batch, context, steps=steps, params=params, tokenizer=tiny_llm.tokenizer)
    method = bound_method(engine, name, 32, params, tiny_llm.tokenizer)
    seq = Sequence(0, synthetic_ids(engine, 0, context), SamplingParams(max_new_tokens=4 + steps + 8),
                   SeqKV(engine.pool))
    seq.method_state = method.new_state(seq)
    sets = method.set_needs(seq, batch)
    final = method._rows.growth_bytes(method.row_needs(seq, batch), engine.pool) + (
        0 if sets is None else method._sets.growth_bytes(sets, engine.pool))  # rows and working sets at the end
    assert len(moments) > 2 and final < max(moments) <= method.batch_state_bytes(seq, batch)


@pytest.mark.parametrize("name", ["snapkv", "chunkkv", "pyramidkv"])
def test_an_evicting_method_is_counted_at_what_it_keeps(tiny_llm, name):
    """A method that compresses the prompt at prefill holds its budget and its generated tokens afterwards
    (`device_tokens`): `--batches max` runs more sequences in the pool than Full KV, each within its bound, and the
    run gives every page back; with query_aware=False (the question appended after the compression) it is counted at
    its whole prompt."""
    model, cfg = tiny_llm.engine.model, tiny_llm.config
    engine = Engine(model, cfg, tiny_llm.engine.device, tiny_llm.engine.dtype, num_pages=400)
    context, steps = 320, 3
    full = largest_batch(engine, bound_method(engine, "full", None), context, steps)
    method = bound_method(engine, name, 32)
    batch = largest_batch(engine, method, context, steps)
    assert batch >= 3 * full
    row = bench_decode(engine, name, 32, batch, context, steps=steps)
    bound = method.device_tokens(context, 4 + steps + 8, engine.pool.page_size)
    assert row.batch == batch and row.kv_pages_peak <= batch * cfg.num_layers * -(-bound // engine.pool.page_size)
    assert engine.pool.in_use == 0 and engine.memory().held == (0, 0, 0, 0)
    assert bound_method(engine, name, 32, dict(query_aware=False)).device_tokens(context, 8, 16) is None


@pytest.mark.parametrize("chunk", [None, 64])
def test_synthetic_kv_is_evicted_layer_by_layer_as_one_prefill_chunk_is(tiny_llm, chunk):
    """The benchmark's random K/V reach an evicting method as a real prefill's do: a prompt of one chunk one layer at
    a time (the pool's peak is the earlier layers' kept pages and one layer's prompt), a prompt of several chunks in
    every layer before the last chunk evicts (the peak holds every layer's prompt)."""
    model, cfg = tiny_llm.engine.model, tiny_llm.config
    engine = Engine(model, cfg, tiny_llm.engine.device, tiny_llm.engine.dtype, num_pages=400, prefill_chunk=chunk)
    context, page = 320, engine.pool.page_size
    row = bench_decode(engine, "snapkv", 32, 1, context, steps=2)
    prompt, kept = context // page, -(-(32 + 4 + 2 + 2 + 8) // page)  # a layer's prompt; what a layer keeps at most
    if chunk is None:
        assert row.kv_pages_peak <= prompt + (cfg.num_layers - 1) * kept < cfg.num_layers * prompt
    else:
        assert row.kv_pages_peak == cfg.num_layers * prompt
    assert engine.pool.in_use == 0


@pytest.mark.parametrize("name", ["quest", "infllm"])
def test_state_kept_by_page_counts_once_whatever_the_batch(tiny_llm, name):
    """Quest's page summaries and InfLLM's block keys are kept by physical page (`page_state_bytes`): `--batches
    max` counts them once for each page the batch holds, not once per sequence, so with room for them over the whole
    pool twice (the last growth of the tables makes them beside the ones before) these methods reach Full KV's batch;
    with room for a tenth of the pool, a smaller batch."""
    model, cfg, device, dtype = tiny_llm.engine.model, tiny_llm.config, tiny_llm.engine.device, tiny_llm.engine.dtype
    context, steps, pages = 100, 3, 400
    probe = Engine(model, cfg, device, dtype, num_pages=pages)
    per_page = bound_method(probe, name, 32).page_state_bytes(probe.pool)
    assert per_page > 0
    rows = (pages - 1) // (cfg.num_layers * -(-(context + 4 + steps + 2) // 16))  # Full KV's batch in the pool
    logits = rows * cfg.vocab_size * (dtype.itemsize + 4)  # their decode step's
    engine = Engine(model, cfg, device, dtype, num_pages=pages, state_memory=2 * per_page * pages + logits)
    full = largest_batch(engine, bound_method(engine, "full", None), context, steps)
    assert full > 1 and largest_batch(engine, bound_method(engine, name, 32), context, steps) == full
    small = Engine(model, cfg, device, dtype, num_pages=pages, state_memory=per_page * pages // 10 + logits)
    assert 1 <= largest_batch(small, bound_method(small, name, 32), context, steps) < full


@pytest.mark.parametrize("name", ["chess", "quest", "infllm"])
def test_the_largest_batch_holds_the_state_kept_by_page_while_it_grows(tiny_llm, name, monkeypatch):
    """The tables kept by page grow by quarters as a run takes pages, each growth making the new tables beside the
    old: counting the final tables alone, an H200 picked 332 CHESS rows at 32k that ran out of memory growing them.
    With room for the final tables and a half more, `--batches max` gives fewer rows than Full KV's, and the growths
    of its run never held more than that room."""
    model, cfg, device, dtype = tiny_llm.engine.model, tiny_llm.config, tiny_llm.engine.device, tiny_llm.engine.dtype
    context, steps, pages = 100, 3, 400
    probe = Engine(model, cfg, device, dtype, num_pages=pages)
    per_page = bound_method(probe, name, 32).page_state_bytes(probe.pool)
    logits = 19 * cfg.vocab_size * (dtype.itemsize + 4)  # Full KV's 19 rows' decode step (the test above)
    room = int(1.5 * per_page * pages) + logits
    engine = Engine(model, cfg, device, dtype, num_pages=pages, state_memory=room)
    full = largest_batch(engine, bound_method(engine, "full", None), context, steps)
    batch = largest_batch(engine, bound_method(engine, name, 32), context, steps)
    assert 1 <= batch < full
    held, cover = [], type(engine.pool).cover

    def recording(pool, wanted):  # the tables alive at each growth: the old ones and the new ones beside them
        if wanted > pool.coverage:
            held.append(pool.coverage + pool.coverage_for(wanted))
        cover(pool, wanted)

    monkeypatch.setattr(type(engine.pool), "cover", recording)
    assert bench_decode(engine, name, 32, batch, context, steps=steps).batch == batch
    assert held and max(held) * per_page + batch * cfg.vocab_size * (dtype.itemsize + 4) <= room
    assert engine.pool.in_use == 0 and engine.memory().held == (0, 0, 0, 0)


def test_bench_runs_a_grid_and_writes_tables_and_plots(tiny_model_dir, tmp_path, capsys):
    """Each method and variant (a method with its own parameters, its rows named by the entry) at each batch; bad
    method names, in an entry or a --param, fail with exit code 2 before the model loads."""
    out = tmp_path / "bench"
    args = ["bench", "--model", str(tiny_model_dir("llama")), "--device", "cpu", "--methods",
            "full,chess,chess[budget=36]", "--budget", "48", "--param", "chess.block_size=16", "--batches", "1,2",
            "--contexts", "160", "--steps", "2", "--out", str(out)]
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["info"]["params"] == {"chess": {"block_size": 16}}
    rows = {(r["method"], r["batch"]): r for r in results["decode"]}
    assert set(rows) == {(m, b) for m in ("full", "chess", "chess[budget=36]") for b in (1, 2)}
    for (method, batch), row in rows.items():
        assert row["tokens_per_s"] > 0 and row["tpot_ms"] > 0 and not row["graphs"]
        # Full KV attends to the whole context; CHESS to its budget of 48 tokens, the variant to 36
        assert row["attended_per_layer"] > 160 if method == "full" else row["attended_per_layer"] <= (
            36 if "[" in method else 48)
        assert row["breakdown_ms"]["step"] > 0
    assert rows[("chess[budget=36]", 1)]["attended_per_layer"] < rows[("chess", 1)]["attended_per_layer"]
    assert rows[("chess", 2)]["breakdown_ms"]["selection"] > 0
    table = (out / "results.md").read_text()
    assert "| chess | 2 | 160 |" in table and "x Full KV" in table
    assert (out / "decode.png").stat().st_size > 0
    for largest in ("max", "fullmax"):
        assert main(args[:-10] + ["--batches", largest, "--contexts", "160", "--out", str(out)]) == 2
        assert "needs a KV pool of fixed size" in capsys.readouterr().err
    for methods, params, error in (("full,nosuch[x=1]", [], "unknown method 'nosuch'"),
                                   ("chess[block_size]", [], "must look like name=value"),
                                   ("full", ["--param", "nosuch.x=1"], "unknown method 'nosuch'")):
        assert main(["bench", "--device", "cpu", "--methods", methods, *params, "--out", str(out)]) == 2
        assert error in capsys.readouterr().err


def test_batch_and_hf_point_arguments():
    assert parse_batches("1, 16,max") == [1, 16, "max"]
    assert parse_batches("16,FullMax") == [16, "fullmax"]
    assert parse_hf_points("16x32k,maxx32k,1x4096") == [(16, 32768), ("max", 32768), (1, 4096)]
    for bad in ("16", "x32k", "maxx"):
        with pytest.raises(SemkvError, match="BxCTX|not a number"):
            parse_hf_points(bad)
    with pytest.raises(SemkvError, match="'many' is not a number"):
        parse_batches("1,many")


def test_report_marks_a_selection_share_it_could_not_measure(tmp_path):
    """A method that selects inside each layer of a captured graph gets '-' in the selection column, not the
    near-zero host time; a measured share is printed as a percentage."""
    from semkv.bench import report

    row = dict(method="full", budget=None, batch=2, context=4096, tpot_ms=10.0, tokens_per_s=200.0,
               peak_memory_gib=1.0, kv_pages_peak=10, attended_per_layer=4096, graphs=True, forward_ms=9.0,
               selection_share=0.0123, breakdown_ms=dict(step=12.0, selection=0.5, attention=6.0, rest=5.5))
    unmeasured = dict(row, method="tokenselect", selection_share=None, attended_per_layer=328)
    report.write(dict(info={}, decode=[row, unmeasured], ttft=[], long_generation={}, hf=[]), tmp_path)
    lines = (tmp_path / "results.md").read_text().splitlines()
    full_line = next(line for line in lines if line.startswith("| full | 2 | 4096 | 10.00"))
    tokenselect_line = next(line for line in lines if line.startswith("| tokenselect | 2 | 4096 | 10.00"))
    assert "| 1.23% |" in full_line and "| 9.00 | - |" in tokenselect_line


def test_text_windows_start_spread_over_the_text_and_wrap_around():
    text = TextContexts(list(range(50)))
    assert [text.window(i, 3, 20)[0] for i in range(3)] == [0, 16, 33]
    assert text.window(2, 3, 20) == list(range(33, 50)) + [0, 1, 2]
    assert text.window(0, 1, 120) == list(range(50)) * 2 + list(range(20))  # a text shorter than the context repeats


def test_a_text_batch_is_prefilled_for_real(tiny_model_dir, tiny_llm, essay_text, tmp_path):
    """Each sequence holds its window of the text with the model's own K/V, so its first token is HF transformers'
    greedy next token for that window; with TokenSelect the decode steps then look up the Selection Cache."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32).eval()
    engine = Engine(tiny_llm.engine.model, tiny_llm.config, tiny_llm.engine.device, tiny_llm.engine.dtype)
    method = get_method("tokenselect", 64)
    method.bind(tiny_llm.config, tiny_llm.tokenizer, engine.pool.page_size)
    text = TextContexts.from_files([str(write_text(tmp_path, essay_text))], tiny_llm.tokenizer)
    with torch.inference_mode():
        seqs = prefilled_batch(engine, method, 3, 150, 4, text)
    for i, seq in enumerate(seqs):
        assert seq.prompt_ids == text.window(i, 3, 150) and seq.num_computed == 150
        with torch.no_grad():
            logits = hf(torch.tensor([seq.prompt_ids])).logits[0, -1]
        assert seq.output_ids == [int(logits.argmax())]
        engine.release(seq)
    row = bench_decode(engine, "tokenselect", 64, 3, 150, steps=3, text=text)
    assert row.cache_hit_rate is not None and row.attended_per_layer <= 64
    assert engine.pool.in_use == 0


@pytest.mark.parametrize("name, budget, params", [
    ("full", None, {}), ("sentencekv", 48, dict(keep_factor=1.0, query="current", score="tokens", retain="sentences",
                                                offload_chunk=4)), ("sentencekv", 48, {})])
def test_served_steps_are_pipelined_where_the_method_allows_with_the_tokens_of_steps_one_by_one(
        tiny_llm, essay_text, tmp_path, monkeypatch, name, budget, params):
    """`served_rate` launches each step before it completes the last one where the method's steps may be pipelined
    (Full KV, SentenceKV's retrieving mode; not its mean query, whose plan follows the last step's sentence end):
    the tokens are those of the same steps run one after another."""
    engine = Engine(tiny_llm.engine.model, tiny_llm.config, tiny_llm.engine.device, tiny_llm.engine.dtype)
    method = bound_method(engine, name, budget, params, tiny_llm.tokenizer)
    text = TextContexts.from_files([str(write_text(tmp_path, essay_text))], tiny_llm.tokenizer)
    behind = []
    launch = engine.launch_step
    monkeypatch.setattr(engine, "launch_step", lambda *a, **k: behind.append(k.get("behind", 0)) or launch(*a, **k))

    def served(pipelines: bool) -> list[list[int]]:
        monkeypatch.setattr(Engine, "pipelines", staticmethod(lambda m: pipelines))
        with torch.inference_mode():
            seqs = prefilled_batch(engine, method, 3, 150, 24, text)
            assert served_rate(engine, method, seqs, 20, None) > 0
        tokens = [s.output_ids for s in seqs]
        engine.end(seqs, method)
        return tokens

    pipelines = Engine.pipelines(method)
    want = served(False)
    assert sum(behind) == 0
    assert served(pipelines) == want and (sum(behind) == 19) == pipelines == (name == "full" or bool(params))
    assert engine.pool.in_use == 0 and engine.memory().held == (0, 0, 0, 0)


def write_text(folder, text: str):
    path = folder / "essays.txt"
    path.write_text(text)
    return path


def test_text_contexts_need_a_local_model_and_readable_text(tiny_model_dir, tmp_path, capsys):
    args = ["bench", "--device", "cpu", "--contexts", "160", "--steps", "2", "--out", str(tmp_path / "out")]
    assert main(args + ["--shape", "smollm2-135m", "--text-file", "a.txt"]) == 2
    assert "--text-file needs --model" in capsys.readouterr().err
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes([0xFF, 0xFE, 0x00, 0x80]) * 8)
    assert main(args + ["--model", str(tiny_model_dir("llama")), "--text-file", str(binary)]) == 2
    assert f"--text-file {str(binary)!r}: cannot read it as UTF-8 text" in capsys.readouterr().err


def test_the_hf_reference_runs_with_its_default_sdpa_attention_and_eager(tmp_path):
    """`--hf` times transformers' decode with the attention a user gets by default (sdpa), or eager when asked;
    the report names which."""
    from semkv.bench import report
    from semkv.bench.hf_baseline import hf_decode_tpot_ms

    rows = []
    for attention in ("sdpa", "eager"):
        tpot = hf_decode_tpot_ms("smollm2-135m", 1, 64, 2, torch.device("cpu"), torch.float32, attention)
        assert tpot > 0
        rows.append(dict(batch=1, context=64, tpot_ms=tpot, tokens_per_s=1e3 / tpot, attention=attention))
    report.write(dict(info={}, decode=[], ttft=[], long_generation={}, hf=rows), tmp_path)
    lines = (tmp_path / "results.md").read_text().splitlines()
    assert [line.split(" | ")[0] for line in lines if line.startswith(("| sdpa", "| eager"))] == ["| sdpa", "| eager"]


def test_hf_generate_left_pads_a_batch_and_gives_full_kv_tokens(tiny_llm, tiny_model_dir):
    """`hf_generate` (the reference of `semkv eval --hf`): prompts of different lengths, left-padded into one
    `generate`, give semkv Full KV's greedy tokens; each row ends at its first EOS id."""
    from semkv.bench.hf_baseline import hf_generate, hf_model

    prompts = ["The quick brown fox jumps over the lazy dog. " * k for k in (1, 7, 20)]
    full = tiny_llm.generate(prompts, "full", max_new_tokens=16, questions=["What jumps?"] * 3)
    ids = [tiny_llm.encode(p, "What jumps?")[0] for p in prompts]
    assert len({len(i) for i in ids}) == 3 and [o.prompt_token_ids for o in full] == ids
    model = hf_model(tiny_model_dir("llama"), torch.device("cpu"), torch.float32)
    outputs = hf_generate(model, ids, 16, tiny_llm.config.eos_token_ids, 2)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in full]
    flash = hf_generate(model, ids, 16, tiny_llm.config.eos_token_ids, 2, "sdpa-flash")  # cuDNN's kernel off
    assert [o.token_ids for o in flash] == [o.token_ids for o in full]
    assert all(o.prefill_s > 0 and o.decode_s > 0 for o in outputs)
    stop = full[1].token_ids[3]  # taken as the EOS id: rows end with their first one
    cut = [o.token_ids[:o.token_ids.index(stop) + 1] if stop in o.token_ids else o.token_ids for o in full]
    assert [o.token_ids for o in hf_generate(model, ids, 16, [stop], 2)] == cut


def test_hf_generate_halves_its_batch_when_the_gpu_runs_out_of_memory(monkeypatch, capsys):
    """Out of GPU memory, `hf_generate` halves the batch until it fits (saying so once) and runs every prompt."""
    from semkv.bench import hf_baseline
    from semkv.bench.hf_baseline import HFOutput, hf_generate

    sizes = []

    def generate(model, prompts, *args):
        sizes.append(len(prompts))
        if len(prompts) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return [HFOutput(p[:1], 0.0, 0.0) for p in prompts]

    monkeypatch.setattr(hf_baseline, "_generate", generate)
    prompts = [[i] for i in range(7)]
    assert [o.token_ids for o in hf_generate(None, prompts, 4, [2], 2)] == prompts
    assert sizes == [7, 4, 2, 2, 2, 1]  # 7 and 4 fail; batches of 2 through the rest
    assert capsys.readouterr().err.count("out of GPU memory") == 1


def test_bench_hf_runs_a_local_model_with_its_real_weights(tiny_model_dir, tmp_path):
    """`--hf` with `--model`: HF transformers loads the model's own folder (not a shape) and its decode is timed."""
    from transformers import AutoModelForCausalLM

    from semkv.bench.hf_baseline import hf_model

    folder = tiny_model_dir("llama")
    model = hf_model(folder, torch.device("cpu"), torch.float32)
    saved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert all(torch.equal(t, saved[k]) for k, t in model.state_dict().items())
    assert model.config._attn_implementation == "sdpa"
    out = tmp_path / "bench"
    assert main(["bench", "--model", str(folder), "--device", "cpu", "--methods", "full", "--batches", "1",
                 "--contexts", "96", "--steps", "2", "--hf", "1x96", "--hf-attention", "sdpa,sdpa-flash",
                 "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["hf"]
    assert [(r["batch"], r["context"], r["attention"]) for r in rows] == [(1, 96, "sdpa"), (1, 96, "sdpa-flash")]
    assert all(r["tpot_ms"] > 0 for r in rows)
    assert "| sdpa | 1 | 96 |" in (out / "results.md").read_text()


def test_bench_refuses_an_unknown_hf_attention(capsys, tmp_path):
    assert main(["bench", "--device", "cpu", "--hf", "1x96", "--hf-attention", "sdpa,flash2",
                 "--out", str(tmp_path / "b")]) == 2
    assert "--hf-attention flash2: allowed: sdpa, sdpa-flash, eager" in capsys.readouterr().err


def test_a_method_out_of_device_memory_is_skipped_and_the_rest_is_written(tiny_model_dir, tmp_path, monkeypatch,
                                                                           capsys):
    """A method whose batch does not fit the device (torch's out-of-memory error, as a method's state outgrowing the
    card raises it) is reported and skipped; the other methods' rows are still written."""
    from semkv.bench import run as bench_run

    real = bench_run.bench_decode

    def failing(engine, name, *args, **kwargs):
        if name == "snapkv":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.21 GiB")
        return real(engine, name, *args, **kwargs)

    monkeypatch.setattr(bench_run, "bench_decode", failing)
    out = tmp_path / "bench"
    assert main(["bench", "--model", str(tiny_model_dir("llama")), "--device", "cpu", "--methods", "full,snapkv,quest",
                 "--budget", "48", "--batches", "1", "--contexts", "160", "--steps", "2", "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["decode"]
    assert [r["method"] for r in rows] == ["full", "quest"]
    assert "snapkv B=1 ctx=160: skipped (CUDA out of memory. Tried to allocate 2.21 GiB; at " in capsys.readouterr().out
