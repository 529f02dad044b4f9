"""`semkv serve` end to end: a real server (its web process and its engine process) on the embedded model, spoken to
with the official `openai` client. Greedy answers equal `LLM.generate` one by one, also for 8 concurrent clients and
per-request KV methods; every bad request gets a 400 that names it; a cancelled stream frees its pages; 429 past the
concurrency limit; SIGTERM drains."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai", reason="the serve tests need the openai client: pip install 'semkv[test]'")
pytest.importorskip("fastapi", reason="semkv serve needs its extra: pip install 'semkv[serve]'")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "smol"
PROMPTS = [
    "The capital of France is",
    "Here is a list of three fruits:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "To make a cup of tea, first",
]


class Server:
    def __init__(self, *flags: str, api_key: str = "none"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = open(os.devnull, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "semkv.cli.main", "serve", "--device", "cpu", "--port", str(self.port),
             "--served-model-name", MODEL, "--log-level", "warning", *flags],
            stdout=self.log, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=300)
        deadline = time.time() + 300
        while True:
            assert self.process.poll() is None, self.process.stderr.read()
            try:
                if self.client.with_options(timeout=5).models.list().data[0].id == MODEL:
                    return
            except openai.APIConnectionError:
                pass
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.5)

    def engine_pid(self) -> int:
        """The engine process: the first of the web process's children that multiprocessing spawned (not its
        resource tracker; the tokenizer processes start once the engine is ready)."""
        return self.spawned()[0]

    def tokenizer_pids(self) -> list[int]:
        return self.spawned()[1:]

    def spawned(self) -> list[int]:
        """The children that multiprocessing spawned, by their start time."""
        def started(pid: int) -> int:
            with open(f"/proc/{pid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command's name
        return sorted(children(self.process.pid, "spawn_main"), key=started)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        with urllib.request.urlopen(f"{self.url}/metrics") as response:
            text = response.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(60)
        self.log.close()


def children(pid: int, marker: str) -> list[int]:
    """The child processes of `pid` whose command line holds `marker` (Linux)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in map(int, f.read().split()):
                with open(f"/proc/{child}/cmdline", "rb") as cmd:
                    if marker.encode() in cmd.read():
                        found.append(child)
    return found


@pytest.fixture(scope="module")
def server():
    s = Server("--max-concurrent-requests", "16")
    yield s
    s.close()


def complete(server, prompt, **kw):
    return server.client.completions.create(model=MODEL, prompt=prompt, temperature=0, **kw)


def test_completion_and_chat_equal_generate(server, smol_llm):
    out = complete(server, PROMPTS[0], max_tokens=16)
    ref = smol_llm.generate(PROMPTS[0], max_new_tokens=16, chat=False)[0]
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ref.prompt_token_ids), 16)
    assert 0 <= out.usage.prompt_tokens_details.cached_tokens <= out.usage.prompt_tokens  # as OpenAI and vLLM fill it
    question = "What is the capital of France?"
    chat = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                 max_tokens=24, temperature=0)
    ref = smol_llm.generate(question, max_new_tokens=24)[0]
    assert chat.choices[0].message.content == ref.text and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == {"eos": "stop", "length": "length"}[ref.finish_reason]
    assert chat.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)
    system = [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": question}]
    chat = server.client.chat.completions.create(model=MODEL, messages=system, max_tokens=12, temperature=0)
    assert chat.usage.prompt_tokens == len(smol_llm.encode_chat(system))


def test_streams_equal_whole_answers_and_stop_strings_cut(server):
    whole = complete(server, PROMPTS[1], max_tokens=30, stop=["\n\n"]).choices[0]
    chunks = list(complete(server, PROMPTS[1], max_tokens=30, stop=["\n\n"], stream=True,
                           stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert "\n\n" not in whole.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens is not None
    messages = [{"role": "user", "content": "Name three colors."}]
    whole = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                                        temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_a_stream_sends_a_chunk_as_tokens_arrive_even_without_text(server):
    """A stop string of 200 characters holds back the text until the end (it might be forming), as a special token
    or half a character gives no text: the stream still sends a chunk for each arrival of tokens, as vLLM does (a
    load client times every token by its chunk; without them two tokens' gap counted as one), and the text is the
    whole answer's."""
    stop = ["~" * 200]
    whole = complete(server, PROMPTS[2], max_tokens=24, stop=stop, extra_body={"ignore_eos": True}).choices[0]
    chunks = [c for c in complete(server, PROMPTS[2], max_tokens=24, stop=stop, stream=True,
                                  extra_body={"ignore_eos": True}) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == whole.text and len(whole.text) < 200
    assert len([c for c in chunks if c.choices[0].finish_reason is None]) >= 12  # most tokens in a chunk of their own
    chat = list(server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=6, temperature=0, stop=stop, stream=True,
                                                      extra_body={"ignore_eos": True}))
    assert [c.choices[0].delta.content for c in chat[1:-1]] == [""] * (len(chat) - 2) and len(chat) >= 4


def test_a_stream_decodes_each_token_once_into_the_whole_text(smol_llm):
    """The streamed text (`Detokenizer`: each token decoded once) is at every token a prefix of the whole text, with
    no half character, and ends equal to it; a tokenizer that cleans up spaces after decoding decodes it all again."""
    import copy

    from semkv.text import Detokenizer

    tokenizer = smol_llm.tokenizer
    text = "Héllo wörld — 東京 🎉 café, naïve résumé.\n\n" + PROMPTS[1]
    ids = tokenizer.encode(text, add_special_tokens=False) + [smol_llm.config.eos_token_ids[0]]
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    cleaning = copy.copy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    for detokenizer in (Detokenizer(tokenizer), Detokenizer(cleaning)):
        texts = [detokenizer.text_of(ids[:n]) for n in range(1, len(ids) + 1)]
        assert all(whole.startswith(t) and "\ufffd" not in t for t in texts) and texts[-1] == whole
        assert len(set(texts)) > len(ids) // 2  # text comes as the tokens come
    assert Detokenizer(tokenizer).backend is not None and Detokenizer(cleaning).backend is None


def test_logprobs_are_the_models(server, smol_llm):
    out = complete(server, PROMPTS[0], max_tokens=4, logprobs=2).choices[0]
    ref = smol_llm.generate(PROMPTS[0], max_new_tokens=4, chat=False, logprobs=2)[0]
    assert out.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert all(len(top) == 2 and max(top.values()) == pytest.approx(lp, abs=1e-4)  # greedy: the top token
               for top, lp in zip(out.logprobs.top_logprobs, out.logprobs.token_logprobs))


def test_eight_concurrent_clients_equal_one_by_one(server, smol_llm):
    before = server.metrics()
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: complete(server, p, max_tokens=24, extra_body={"ignore_eos": True}), PROMPTS))
    for prompt, out in zip(PROMPTS, outs):
        ref = smol_llm.generate(prompt, max_new_tokens=24, chat=False, ignore_eos=True)[0]
        assert out.choices[0].text == ref.text
    after = server.metrics()

    def steps(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0)

    wide = steps("semkv_decode_batch_size_count") - steps("semkv_decode_batch_size_bucket", (("le", "4.0"),))
    assert wide > 0  # requests that arrived while others decoded joined their batch: steps of 5 to 8 requests
    assert steps("semkv_request_queue_time_seconds_count") == steps("semkv_time_to_first_token_seconds_count") == 8
    assert steps("semkv_generation_tokens_total", (("method", "full"),)) == 8 * 24
    assert steps("semkv_engine_output_lag_seconds_count") > 0  # the engine process's outputs reached the web process
    for name in ("semkv_prefix_cache_queries_total", "semkv_prefix_cache_hits_total", "semkv_prefix_cache_hit_rate",
                 "semkv_preemptions_total", "semkv_engine_step_tokens_count"):
        assert (name, ()) in after, name


def test_a_request_chooses_its_kv_method(server, smol_llm):
    prompt = ("Here is a story. " + " ".join(f"Sentence number {i} of the story is about a cat." for i in range(30))
              + " What was the story about?")
    snap = dict(kv_method="snapkv", kv_budget=64, kv_params={"window": 16})
    chosen = [("snapkv", 64, {"window": 16}), ("streaming_llm", "10%", {}), ("full", None, {})]
    with ThreadPoolExecutor(6) as pool:  # three methods at once: each batch decodes beside the others
        outs = list(pool.map(lambda c: complete(server, prompt, max_tokens=20, extra_body=dict(
            kv_method=c[0], kv_budget=c[1], kv_params=c[2])), chosen * 2))
    for (name, budget, params), out in zip(chosen * 2, outs):
        ref = smol_llm.generate(prompt, method=name, budget=0.1 if budget == "10%" else budget, max_new_tokens=20,
                                chat=False, method_params=params)[0]
        assert out.choices[0].text == ref.text, name
    snapped = complete(server, prompt, max_tokens=20, extra_body=snap)
    assert snapped.model_extra["semkv"]["kv_resident_tokens"] < 100 < outs[2].model_extra["semkv"]["kv_resident_tokens"]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(extra_body={"kv_method": "nope"}), "unknown method 'nope'"),
    (dict(extra_body={"kv_method": "snapkv", "kv_params": {"windwo": 8}}), "windwo"),
    (dict(extra_body={"kv_method": "snapkv", "kv_budget": -3}), "budget"),
    (dict(extra_body={"kv_budget": "lots"}), "kv_budget 'lots' is not a number"),
    (dict(extra_body={"colour": "red"}), "unknown parameter 'colour'"),
    (dict(max_tokens=9000), "model's context of 8192 tokens"),
    (dict(max_tokens=0), "max_tokens=0 must be an int >= 1"),
    (dict(temperature=-1.0), "temperature=-1.0 must be >= 0"),
    (dict(top_p=0.0), "top_p=0.0 must be in (0, 1]"),
    (dict(n=2), "n=2"),
    (dict(logprobs=3, stream=True), "logprobs"),
    (dict(prompt="   "), "the prompt is empty"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=["a", "b"]), "one prompt per request"),
    (dict(prompt=[10**9]), "token ids in [0, "),
])
def test_a_bad_completion_gets_a_400_naming_it(server, kwargs, needle):
    args = dict(model=MODEL, prompt="Hello", max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as err:
        server.client.completions.create(**args)
    assert err.value.status_code == 400 and needle in err.value.message
    assert err.value.body["type"] == "invalid_request_error" and "Traceback" not in err.value.message


def test_bad_chats_and_models(server):
    for messages, needle in [([], "messages"), ([{"role": "robot", "content": "hi"}], "messages.0.role"),
                             ([{"role": "user", "content": ""}], "every message is empty")]:
        with pytest.raises(openai.BadRequestError, match="400") as err:
            server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
        assert needle in err.value.message
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              top_logprobs=2)
    with pytest.raises(openai.NotFoundError, match="'gpt-4' does not exist"):
        server.client.completions.create(model="gpt-4", prompt="Hello", max_tokens=4)
    bad = urllib.request.Request(f"{server.url}/v1/completions", data=b"{not json",
                                 headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(bad)
    assert err.value.code == 400 and json.loads(err.value.read())["error"]["type"] == "invalid_request_error"


def test_a_repeated_prompt_reads_its_prefix_from_the_cache(server, essay_text):
    """The second request with the same 600-token document prefills it from the prefix cache: usage says how many
    prompt tokens were cached (as OpenAI and vLLM), /metrics counts them, and the answer is the same."""
    prompt = essay_text[:2400] + "\n\nQuestion: what is this text about? Answer:"
    before = server.metrics()
    first, second = (complete(server, prompt, max_tokens=8) for _ in range(2))
    after = server.metrics()
    n = first.usage.prompt_tokens
    assert second.choices[0].text == first.choices[0].text
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert n - 16 <= second.usage.prompt_tokens_details.cached_tokens < n  # every whole page of the prompt
    hits = after[("semkv_prefix_cache_hits_total", ())] - before.get(("semkv_prefix_cache_hits_total", ()), 0)
    queries = after[("semkv_prefix_cache_queries_total", ())] - before.get(("semkv_prefix_cache_queries_total", ()), 0)
    assert (hits, queries) == (second.usage.prompt_tokens_details.cached_tokens, 2 * n)
    assert 0 < after[("semkv_prefix_cache_hit_rate", ())] <= 1


def wait_until_idle(server, timeout=60):
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        held = (m[("semkv_kv_pool_pages", (("state", "in_use"),))], m[("semkv_engine_live_requests", ())],
                m[("semkv_requests_running", ())], m[("semkv_requests_in_flight", ())],
                sum(v for (name, _), v in m.items() if name == "semkv_method_state_bytes"))
        if held == (0, 0, 0, 0, 0) or time.time() > deadline:
            return m, held
        time.sleep(0.2)


def test_a_cancelled_stream_frees_its_pages(server):
    stream = complete(server, PROMPTS[3], max_tokens=400, stream=True,
                      extra_body={"ignore_eos": True, "kv_method": "h2o", "kv_budget": 64})
    got = 0
    for chunk in stream:
        got += bool(chunk.choices[0].text)
        if got == 3:
            break
    deadline = time.time() + 10  # the engine's part of /metrics is measured after steps, at most every 0.5 s
    while (running := server.metrics())[("semkv_kv_pool_pages", (("state", "in_use"),))] == 0:
        assert time.time() < deadline, "the running request holds no pages"
        time.sleep(0.1)
    assert running[("semkv_requests_in_flight", ())] == 1
    stream.close()  # the client goes away mid-answer
    m, held = wait_until_idle(server)
    assert held == (0, 0, 0, 0, 0)
    assert m[("semkv_requests_total", (("method", "h2o"), ("outcome", "cancelled")))] == 1
    assert complete(server, PROMPTS[0], max_tokens=4).choices[0].finish_reason == "length"  # still serving


def test_429_past_the_limit_and_sigterm_drains():
    server = Server("--max-concurrent-requests", "1")
    try:
        stream = complete(server, PROMPTS[4], max_tokens=48, stream=True, extra_body={"ignore_eos": True})
        chunks = [next(stream)]
        with pytest.raises(openai.RateLimitError) as err:
            complete(server, PROMPTS[0], max_tokens=4)
        assert err.value.status_code == 429 and "--max-concurrent-requests" in err.value.message
        server.process.send_signal(signal.SIGTERM)  # shut down while the stream runs: it must finish
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 48
        # uvicorn shuts down gracefully, then ends by the signal it caught (exit status -SIGTERM)
        assert server.process.wait(60) in (0, -signal.SIGTERM)
    finally:
        server.close()
