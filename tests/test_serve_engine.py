"""`semkv serve`'s two processes on a tiny random Llama: a bad flag or a model the engine process cannot load ends the
command with exit code 2 and one clear line (nothing hangs); when the engine process dies mid-request, every open
request gets an error (503 JSON, or an error event in a stream), new requests get 503 and /health says why; the API
key, request ids and /version; the engine settings reach the scheduler."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai", reason="the serve tests need the openai client: pip install 'semkv[test]'")
pytest.importorskip("fastapi", reason="semkv serve needs its extra: pip install 'semkv[serve]'")
from test_serve import MODEL, Server  # noqa: E402

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "semkv.cli.main", "serve", "--device", "cpu", "--port", "0"]


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of a GET."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {})) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


@pytest.mark.parametrize("flags,needle", [
    (["--max-num-seqs", "0"], "--max-num-seqs 0 must be a positive int"),
    (["--max-num-batched-tokens", "-8"], "--max-num-batched-tokens -8 must be a positive int"),
    (["--max-concurrent-requests", "0"], "--max-concurrent-requests 0 must be a positive int"),
    (["--api-key", ""], "--api-key is empty"),
    (["--max-num-seqs", "two"], "invalid int value: 'two'"),
    (["--num-pages", "1"], "--num-pages=1 is out of range; allowed: [2, "),
    (["--tokenizer-processes", "-1"], "--tokenizer-processes=-1 is out of range; allowed: [0, 64]"),
])
def test_a_bad_flag_exits_with_code_2_before_the_model_loads(flags, needle, tmp_path):
    # the model does not exist either: a flag checked after loading would fail on the model instead
    run = subprocess.run(CLI + ["--model", str(tmp_path / "nothing"), *flags], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and needle in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and "does not exist" not in run.stderr


def test_an_engine_that_cannot_start_exits_with_code_2(tmp_path):
    """The engine process fails to load the model: the web process says why and ends, with no engine left behind."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    for model, needle in [(tmp_path / "nothing", "does not exist"), (tmp_path, "unsupported architecture 'gpt2'")]:
        run = subprocess.run(CLI + ["--model", str(model)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 2 and "semkv: error: " in run.stderr and needle in run.stderr, run.stderr
        assert "Traceback" not in run.stderr


def test_settings_api_key_request_ids_and_version(tiny_model_dir):
    server = Server("--model", str(tiny_model_dir("llama")), "--max-num-seqs", "3", "--max-num-batched-tokens", "96",
                    "--no-enable-prefix-caching", "--api-key", "sesame", "--method", "quest", "--budget", "0.5",
                    "--num-pages", "700", "--enable-dynamic-chunking", "--tokenizer-processes", "0",
                    api_key="sesame")
    try:
        status, headers, body = get(f"{server.url}/v1/models")
        assert status == 401 and body["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            server.client.with_options(api_key="wrong").models.list()
        assert get(f"{server.url}/health")[0] == 200  # health, metrics and version need no key
        assert b"semkv_requests_in_flight" in urllib.request.urlopen(f"{server.url}/metrics").read()
        assert get(f"{server.url}/version")[2]["version"]
        out = server.client.completions.with_raw_response.create(
            model=MODEL, prompt="Hello there", max_tokens=4, extra_headers={"X-Request-Id": "abc-123"})
        assert out.headers["x-request-id"] == "abc-123" and out.parse().id == "cmpl-abc-123"
        assert out.parse().usage.prompt_tokens_details.cached_tokens == 0  # prefix caching is off
        # the flags reached the engine process's scheduler (it reports them back, and the start's log lines say them)
        server.process.terminate()
        log = server.process.stderr.read()
        assert ("engine steps of at most 96 tokens (and their cost: dynamic chunking); requests running at once: 3; "
                "prefix caching off; tokenizer processes: 0") in log, log
        assert "KV pool of 700 pages of 16 tokens" in log, log  # a fixed pool (--num-pages)
        assert server.tokenizer_pids() == []  # --tokenizer-processes 0: the web process tokenizes
        # the default method's state kept by page (Quest's page summaries) is what the pool leaves room for
        assert re.search(r"quest keeps [1-9]\d* bytes of state a KV page beside the pool", log), log
    finally:
        server.close()


def test_long_prompts_are_tokenized_in_tokenizer_processes_and_a_dead_one_is_replaced(tiny_model_dir, tiny_llm):
    """--tokenizer-processes 2: chat prompts of 4,096 characters or more go to a tokenizer process, shorter ones do
    not, and both get the answers `LLM.generate` gives (the same prompt tokens); when the processes die, a long prompt
    is tokenized in the web process and its process started again; they end with the server."""
    server = Server("--model", str(tiny_model_dir("llama")), "--tokenizer-processes", "2")
    document = " ".join(f"Line {i}: the river keeps its own counsel and the mill wheel turns." for i in range(80))
    assert len(document) > 4096

    def ask(content: str) -> None:
        out = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                    max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        ref = tiny_llm.generate(content, max_new_tokens=6, ignore_eos=True)[0]
        assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert out.choices[0].message.content == ref.text

    try:
        first = server.tokenizer_pids()
        assert len(first) == 2
        ask(document + "\n\nWhat turns?")
        ask(document + "\n\nWhat keeps its counsel?")  # a follow-up: the same process, from near the document's end
        for pid in first:
            os.kill(pid, signal.SIGKILL)
        deadline = time.time() + 30
        while server.tokenizer_pids():
            assert time.time() < deadline, "the killed tokenizer processes are still there"
            time.sleep(0.1)
        ask("Say something short.")  # tokenized in the web process: no tokenizer process is started again
        assert server.tokenizer_pids() == []
        ask(document + "\n\nWhat turns?")  # its process is dead: tokenized here, and the process started again
        deadline = time.time() + 30
        while len(server.tokenizer_pids()) != 1:
            assert time.time() < deadline, "no tokenizer process was started again"
            time.sleep(0.1)
        again = server.tokenizer_pids()
        ask(document + "\n\nWho turns it?")  # by the new process
        server.process.terminate()
        assert server.process.wait(60) in (0, -signal.SIGTERM)
        deadline = time.time() + 30
        while any(os.path.exists(f"/proc/{pid}/cmdline") and open(f"/proc/{pid}/cmdline").read() for pid in again):
            assert time.time() < deadline, "a tokenizer process outlived the server"
            time.sleep(0.1)
        assert "a tokenizer process ended; starting another" in server.process.stderr.read()
    finally:
        server.close()


def test_tokenizer_processes_wait_until_loaded_and_name_a_folder_they_cannot_load(tiny_model_dir, tmp_path):
    """`TokenizerProcesses.wait` (the server answers only after it): once it returns, a long text's tokens come from
    the process as the web process would make them; a process that cannot load the tokenizer makes it raise one
    SemkvError naming the folder, not a hang or a BrokenProcessPool at the first long prompt."""
    from semkv.errors import SemkvError
    from semkv.serve.tokenizer_processes import TokenizerProcesses
    from semkv.text import TextModel

    folder = str(tiny_model_dir("llama"))
    text = TextModel.load(folder)
    processes = TokenizerProcesses(folder, 1)
    try:
        processes.wait()
        long = " ".join(f"Line {i}: the mill wheel turns." for i in range(200))
        ids, ends = processes.tokens(long, True)
        here_ids, here_ends = text.tokens_here(long, True)
        assert ids == list(here_ids) and len(ids) > 100 and list(ends) == list(here_ends)
    finally:
        processes.close()
    broken = TokenizerProcesses(str(tmp_path), 1)
    try:
        with pytest.raises(SemkvError, match=f"could not load the tokenizer of {tmp_path}"):
            broken.wait()
    finally:
        broken.close()


def test_engine_death_errors_every_open_request_and_health_says_why(tiny_model_dir):
    server = Server("--model", str(tiny_model_dir("llama")))
    try:
        long = dict(model=MODEL, prompt="Once upon a time", max_tokens=3000, temperature=0,
                    extra_body={"ignore_eos": True})
        stream = server.client.completions.create(stream=True, **long)
        next(iter(stream))
        whole: dict = {}

        def wait_whole():
            try:
                server.client.completions.create(**long)
            except openai.APIStatusError as err:
                whole.update(status=err.status_code, body=err.body, at=time.time())

        waiting = threading.Thread(target=wait_whole)
        waiting.start()
        deadline = time.time() + 60
        while server.metrics()[("semkv_requests_running", ())] < 2:
            assert time.time() < deadline, "the second request did not start"
            time.sleep(0.1)
        os.kill(server.engine_pid(), signal.SIGKILL)
        killed = time.time()
        with pytest.raises(openai.APIError, match=r"the engine process ended \(exit code -9\)"):
            for _ in stream:
                pass
        waiting.join(30)
        assert whole["status"] == 503 and whole["body"]["code"] == "engine_unavailable"
        assert whole["at"] - killed < 5  # promptly, not at a timeout
        status, _, body = get(f"{server.url}/health")
        assert status == 503 and body["reason"] == "the engine process ended (exit code -9)"
        with pytest.raises(openai.InternalServerError) as err:
            server.client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        assert err.value.status_code == 503
        assert server.metrics()[("semkv_requests_in_flight", ())] == 0
        server.process.send_signal(signal.SIGTERM)  # it still shuts down cleanly
        assert server.process.wait(60) in (0, -signal.SIGTERM)
    finally:
        server.close()


def test_the_step_budget_and_the_running_limit_bind(tiny_model_dir, tiny_llm):
    """--max-num-seqs 2 --max-num-batched-tokens 64: six concurrent requests of about 150 prompt tokens run two at a
    time, the engine steps compute at most 64 tokens (long prompts prefilled over several steps) but for those in
    which no request decoded (at most one per pair of requests; they may prefill the engine's chunk, 512 tokens on
    the CPU), each step is timed under its kind, and the answers are those of one request at a time."""
    from concurrent.futures import ThreadPoolExecutor

    server = Server("--model", str(tiny_model_dir("llama")), "--max-num-seqs", "2", "--max-num-batched-tokens", "64")
    try:
        prompts = [f"Story {i}: " + "the cat sat on the mat and looked at the dog. " * 12 for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(lambda p: server.client.completions.create(
                model=MODEL, prompt=p, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}), prompts))
        expected = [o.text for o in tiny_llm.generate(prompts, max_new_tokens=16, chat=False, ignore_eos=True)]
        assert [o.choices[0].text for o in outs] == expected
        m = server.metrics()
        assert m[("semkv_decode_batch_size_bucket", (("le", "2.0"),))] == m[("semkv_decode_batch_size_count", ())] > 0
        steps = m[("semkv_engine_step_tokens_count", ())]
        within = m[("semkv_engine_step_tokens_bucket", (("le", "64.0"),))]
        assert steps >= 6 * 16 / 2 and steps - 3 <= within < steps
        assert m[("semkv_engine_step_tokens_bucket", (("le", "1024.0"),))] == steps
        # every step timed by its kind: prompts prefilled alone, beside a decoding request, and decode-only steps
        timed = {kind: m[("semkv_engine_steps_total", (("kind", kind),))] for kind in ("decode", "mixed", "prefill")}
        assert all(timed.values()) and sum(timed.values()) == steps
        assert all(m[("semkv_engine_step_seconds_total", (("kind", kind),))] > 0 for kind in timed)
    finally:
        server.close()


def test_a_tensor_parallel_rank_killed_mid_request_ends_the_engine_and_health_names_it(tiny_model_dir):
    """--tensor-parallel-size 2, rank 1's process killed while a stream runs: within seconds the stream ends with an
    error that names the rank, new requests get 503 and /health says which rank failed and how (rank 0 would
    otherwise wait in a collective rank 1 never joins)."""
    from test_serve import children

    server = Server("--model", str(tiny_model_dir("llama")), "--tensor-parallel-size", "2")
    try:
        ranks = children(server.engine_pid(), "spawn_main")  # rank 0 is the engine process; it started rank 1
        assert len(ranks) == 1
        stream = server.client.completions.create(stream=True, model=MODEL, prompt="Once upon a time", max_tokens=3000,
                                                  temperature=0, extra_body={"ignore_eos": True})
        next(iter(stream))
        os.kill(ranks[0], signal.SIGKILL)
        killed = time.time()
        with pytest.raises(openai.APIError, match="rank 1 was killed by SIGKILL"):
            for _ in stream:
                pass
        print(f"\nrank 1 killed under the server: the stream had the error {time.time() - killed:.1f} s after")
        assert time.time() - killed < 15
        status, _, body = get(f"{server.url}/health")
        assert status == 503 and "tensor-parallel rank 1 was killed by SIGKILL" in body["reason"], body
        with pytest.raises(openai.InternalServerError) as err:
            server.client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        assert err.value.status_code == 503
    finally:
        server.close()
