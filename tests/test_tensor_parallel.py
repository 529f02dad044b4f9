"""Tensor parallelism on the CPU: two gloo ranks, each holding half of the tiny Llama's heads and MLP and the KV cache
of its KV head, give exactly the greedy tokens of one process, for every method in its easy and hard configuration
(so methods whose choice is shared by a layer's heads add their scores over the ranks)."""
from __future__ import annotations

import pytest
import torch

import semkv
from semkv.engine.sequence import SamplingParams
from semkv.errors import SemkvError
from semkv.launch import check_size
from test_method_matrix import CASES, CONTEXTS, IDS, NEW, QUESTIONS, SMALL

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """(one process, two ranks) on the same tiny Llama."""
    path = tiny_model_dir("llama")
    one = semkv.LLM(path, device="cpu", prefill_chunk=48)
    two = semkv.LLM(path, device="cpu", prefill_chunk=48, tensor_parallel_size=2)
    yield one, two
    two.close()


def tokens(llm, method, **kw):
    out = llm.generate(CONTEXTS, method=method, questions=QUESTIONS, max_new_tokens=NEW, chat=False, ignore_eos=True,
                       **kw)
    return [o.token_ids for o in out]


def test_two_ranks_hold_half_the_model(pair):
    one, two = pair
    assert two.tensor_parallel_size == 2 and one.tensor_parallel_size == 1
    assert (two.config.num_heads, two.config.num_kv_heads) == (one.config.num_heads // 2, one.config.num_kv_heads // 2)
    assert two.engine.pool.k.shape[2] == one.engine.pool.k.shape[2] // 2  # the cache of its own KV heads
    qkv = two.engine.model.model.layers[0].self_attn.qkv_proj.weight
    assert qkv.shape[0] == one.engine.model.model.layers[0].self_attn.qkv_proj.weight.shape[0] // 2


def test_full_kv_and_sampling_equal_one_process(pair):
    one, two = pair
    assert tokens(two, "full") == tokens(one, "full")
    kw = dict(temperature=0.8, top_p=0.9, seed=3)
    assert tokens(two, "full", **kw) == tokens(one, "full", **kw)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_method_gives_the_tokens_of_one_process(pair, case):
    name, _, params = case
    one, two = pair
    expected = tokens(one, name, budget=SMALL, method_params=params)
    assert tokens(two, name, budget=SMALL, method_params=params) == expected


def test_nothing_stays_on_any_rank(pair):
    """After every method's requests (generate, and a compare stopped early), each rank's pool and method state are
    free again."""
    _, two = pair
    for name, _, params in CASES:
        tokens(two, name, budget=SMALL, method_params=params)
    for _ in two.compare_iter(CONTEXTS[0], [semkv.get_method("sentencekv", SMALL), semkv.get_method("infllm", SMALL)],
                              max_new_tokens=NEW, chat=False):
        break
    usage = two.memory()
    assert len(usage) == 2
    for rank in usage:
        assert (rank.pages_in_use, rank.requests, rank.state_bytes, rank.host_bytes) == (0, 0, {}, {})


def test_compare_and_continuous_batching_equal_one_process(pair):
    one, two = pair
    methods = [semkv.get_method(m, SMALL) for m in ("snapkv", "quest", "chess", "tokenselect")]
    a = [o.token_ids for o in one.compare(CONTEXTS[0], methods, QUESTIONS[0], max_new_tokens=NEW, chat=False)]
    b = [o.token_ids for o in two.compare(CONTEXTS[0], methods, QUESTIONS[0], max_new_tokens=NEW, chat=False)]
    assert a == b
    # an early stop of compare_iter on rank 0 still runs the other ranks' iteration to the end: later calls agree
    for _ in two.compare_iter(CONTEXTS[1], methods, max_new_tokens=NEW, chat=False):
        break
    assert tokens(two, "h2o", budget=SMALL) == tokens(one, "h2o", budget=SMALL)


def test_bad_sizes_are_named(tiny_model_dir):
    path = tiny_model_dir("llama")
    allowed = r"tensor_parallel_size=4 does not divide this model's 2 KV heads; allowed: 1, 2"
    with pytest.raises(SemkvError, match=allowed):
        semkv.LLM(path, device="cpu", tensor_parallel_size=4)
    with pytest.raises(SemkvError, match=r"tensor_parallel_size=0 must be an int >= 1"):
        semkv.LLM(path, device="cpu", tensor_parallel_size=0)
    with pytest.raises(SemkvError, match=r"tensor_parallel_size=2 asks for 2 GPUs; \d+ visible"):
        check_size(2, torch.device("cuda")) if torch.cuda.device_count() < 2 else check_size(99, torch.device("cuda"))


def test_a_server_with_two_ranks_answers_as_one_process(pair, tiny_model_dir):
    """`semkv serve --tensor-parallel-size 2`: concurrent requests with per-request methods, and a cancelled stream
    (which every rank must end), answered as the one-process LLM's `generate`. When a rank dies, the server says so:
    503 and /health."""
    pytest.importorskip("fastapi", reason="semkv serve needs its extra: pip install 'semkv[serve]'")
    import json
    import os
    import signal
    import time
    import urllib.error
    import urllib.request

    import openai
    from test_serve import MODEL, Server, children

    one, _ = pair
    server = Server("--model", str(tiny_model_dir("llama")), "--tensor-parallel-size", "2", "--prefill-chunk", "48")
    try:
        stream = server.client.completions.create(model=MODEL, prompt=CONTEXTS[2], max_tokens=200, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()  # cancelled on rank 0 and replayed on rank 1
        cases = [(p, m) for p in CONTEXTS for m in ("full", "chunkkv", "tokenselect")]

        def ask(case):
            prompt, method = case
            extra = {"ignore_eos": True} | ({} if method == "full" else {"kv_method": method, "kv_budget": SMALL})
            return server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0,
                                                    extra_body=extra).choices[0].text

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(cases)) as pool:
            answers = list(pool.map(ask, cases))
        expected = [one.generate(p, method=m, budget=None if m == "full" else SMALL, max_new_tokens=NEW, chat=False,
                                 ignore_eos=True)[0].text for p, m in cases]
        assert answers == expected
        rank1 = children(server.engine_pid(), "spawn_main")  # the engine process (rank 0) started rank 1
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGKILL)
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(f"{server.url}/health")
            except urllib.error.HTTPError as err:
                assert err.code == 503 and "tensor-parallel rank 1 was killed by SIGKILL" in json.loads(err.read())["reason"]
                break
            assert time.time() < deadline, "/health did not notice the dead rank"
            time.sleep(0.2)
        with pytest.raises(openai.InternalServerError, match="tensor-parallel rank 1 was killed by SIGKILL"):
            server.client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    finally:
        server.close()


@pytest.mark.parametrize("method", ["chess", "dynsplit"])
def test_calibration_equals_one_process(pair, method):
    """Calibration runs on every rank (its prefills meet); the numbers are the one-process numbers up to the order
    in which the all-reduce adds the heads' float32 partial sums."""
    one, two = pair
    texts = [" ".join(CONTEXTS) * 2]
    a, b = one.calibrate(method, texts, 384), two.calibrate(method, texts, 384)
    assert a.keys() == b.keys()
    for key in a:
        assert b[key] == (pytest.approx(a[key], rel=1e-3) if isinstance(a[key], float) else a[key]), key


def test_what_cannot_be_sent_and_a_closed_llm_fail_clearly(pair, tiny_model_dir):
    import subprocess
    import sys

    _, two = pair
    with pytest.raises(SemkvError, match="cannot be pickled"):
        two.generate(CONTEXTS[0], method_params={"window": lambda: 8}, chat=False)
    assert len(two.generate(CONTEXTS[0], max_new_tokens=4, chat=False)[0].token_ids) == 4  # the ranks still agree
    # a process of its own: this one already belongs to the pair's group
    script = (f"import semkv\nllm = semkv.LLM({str(tiny_model_dir('llama'))!r}, device='cpu', tensor_parallel_size=2)\n"
              "llm.close()\ntry:\n    llm.generate('hello', chat=False)\nexcept semkv.SemkvError as e:\n    print(e)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "this LLM was closed" in run.stdout, run.stderr


def test_command_line_generate_and_bench_with_two_ranks(pair, tiny_model_dir, tmp_path):
    """`semkv generate` and `semkv bench` with --tensor-parallel-size 2 (own processes: this one already belongs to
    the pair's group)."""
    import json
    import subprocess
    import sys

    one, _ = pair
    path = str(tiny_model_dir("llama"))
    cli = [sys.executable, "-m", "semkv.cli.main"]
    run = subprocess.run(cli + ["generate", "--model", path, "--device", "cpu", "--prompt", CONTEXTS[2], "--no-chat",
                                "--prefill-chunk", "48",
                                "--method", "tokenselect", "--budget", str(SMALL), "--max-new-tokens", str(NEW),
                                "--tensor-parallel-size", "2", "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    expected = one.generate(CONTEXTS[2], method="tokenselect", budget=SMALL, max_new_tokens=NEW, chat=False)[0]
    assert json.loads(run.stdout)["token_ids"] == expected.token_ids
    run = subprocess.run(cli + ["bench", "--model", path, "--device", "cpu", "--contexts", "256", "--batches", "2",
                                "--steps", "2", "--methods", "full,chunkkv", "--budget", "64",
                                "--tensor-parallel-size", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["info"]["tensor_parallel_size"] == 2
    rows = [(r["method"], r["batch"], r["context"]) for r in results["decode"]]
    assert rows == [("full", 2, 256), ("chunkkv", 2, 256)]
    assert run.stdout.count("B=2 ") == 2  # rank 0 alone prints
    # semkv eval: the same predictions and scores as one process (no selection diagnostics: they need traces)
    from semkv.eval import runner

    grid = ["--task", "passkey,perplexity", "--methods", "full,snapkv", "--budgets", "64", "--lengths", "512",
            "--samples", "1", "--prefill-chunk", "48"]
    run = subprocess.run(cli + ["eval", "--model", path, "--device", "cpu", "--tensor-parallel-size", "2",
                                "--out", str(tmp_path / "ev2"), *grid], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    mine = runner.run(["passkey", "perplexity"], ["full", "snapkv"], [64], [512], 1, llm=one,
                      out=str(tmp_path / "ev1"), progress=False, prefill_chunk=48)
    theirs = runner.run(["passkey", "perplexity"], ["full", "snapkv"], [64], [512], 1, llm=one,
                        out=str(tmp_path / "ev2"), progress=False, prefill_chunk=48)  # its finished rows
    assert [(r["task"], r["method"], r.get("prediction")) for r in mine] == [
        (r["task"], r["method"], r.get("prediction")) for r in theirs]
    # the same up to the order in which the all-reduce adds float32 partial sums (perplexity of a random model ~1e5)
    assert [r["score"] for r in theirs] == pytest.approx([r["score"] for r in mine], rel=1e-6)
    assert all("diag" not in r for r in theirs) and any("diag" in r for r in mine)
    bad = subprocess.run(cli + ["generate", "--model", path, "--device", "cpu", "--prompt", "hi",
                                "--tensor-parallel-size", "3"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "tensor_parallel_size=3 does not divide" in bad.stderr


def test_a_servers_warm_up_leaves_nothing_on_any_rank(pair):
    """`Session.warm_up` with two ranks (rank 1 replays every call of rank 0's session): afterwards no rank holds a
    page, a cached page or method state, and the session answers as one process."""
    one, two = pair
    session = two.new_session(max_num_batched_tokens=64)
    method = semkv.get_method("chunkkv", SMALL)
    session.warm_up(method, "chunkkv")
    for rank in two.memory():
        assert (rank.pages_in_use, rank.requests, rank.cached_pages, rank.state_bytes) == (0, 0, 0, {})
    ids = one.encode(CONTEXTS[0], chat=False)[0]
    seq = session.submit(0, ids, SamplingParams(max_new_tokens=NEW, ignore_eos=True), method, "chunkkv")
    while session.scheduler.busy:
        session.advance()
    assert seq.output_ids == one.generate(ids, method="chunkkv", budget=SMALL, max_new_tokens=NEW, chat=False,
                                          ignore_eos=True)[0].token_ids
