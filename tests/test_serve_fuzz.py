"""`semkv serve` under malformed and hostile bodies (property-based, hypothesis): a real server process on a tiny
random Llama with a 256-token context (so that any valid request ends fast), spoken to over HTTP with httpx, black
box. Every body gets a 4xx with an OpenAI error object, or a valid 200 answer; never a 5xx. The server stays up, and
once every request has ended it holds nothing (/metrics: pages in use, live requests and method state at 0).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi", reason="semkv serve needs its extra: pip install 'semkv[serve]'")
httpx = pytest.importorskip("httpx", reason="the fuzz test needs httpx: pip install 'semkv[test]'")
hypothesis = pytest.importorskip("hypothesis", reason="the fuzz test needs hypothesis: pip install 'semkv[test]'")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "fuzz"
EXAMPLES = 300  # bodies hypothesis generates (the explicit examples come on top)
SENT = {"requests": 0}  # HTTP requests sent, every one checked


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """`semkv serve` on the tiny Llama with a 256-token context, one thread (its operations are too small to share);
    its log goes to a file (read when it fails)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path_factory.mktemp("fuzz") / "server.log"
    log = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "semkv.cli.main", "serve", "--model", str(tiny_model_dir("llama_short")), "--device",
         "cpu", "--port", str(port), "--served-model-name", MODEL, "--log-level", "warning", "--prefill-chunk", "64"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    deadline = time.time() + 300
    while True:
        assert process.poll() is None, log_path.read_text()
        try:
            if client.get("/v1/models").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.3)
    yield client, process, log_path
    client.close()
    process.terminate()
    process.wait(60)
    log.close()


# -- bodies ------------------------------------------------------------------------------------------------------------
SURROGATES = st.sampled_from(["\udcff", "\ud800", "a\udfffb", "\ud83d"])  # lone UTF-16 halves, as JSON escapes send
TEXT = st.one_of(st.text(max_size=12), SURROGATES, st.just(""), st.just("   "), st.just("x" * 5000))
NUMBERS = st.one_of(
    st.integers(-3, 40), st.integers(2**31 - 2, 2**80), st.integers(-(2**80), -1),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e-300,
                                                                     5e-324, 1e308, 0.0, -0.0, 0.5, 1.0, 2.0]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(TEXT, inner, max_size=3)), max_leaves=8)
METHOD_NAMES = st.sampled_from(["full", "streaming_llm", "h2o", "snapkv", "quest", "infllm", "chunkkv", "sentencekv",
                                "dynsplit", "tokenselect", "chess", "keydiff", "pyramidkv", "nope"])
PARAMS = st.dictionaries(st.sampled_from(["window", "n_sink", "n_recent", "block_size", "chunk_size", "offload",
                                          "budget", "recent_ratio", "keep_factor", "alpha", "theta", "pooling",
                                          "query_aware", "per_head", "cache_factor", "colour"]), VALUES, max_size=2)
FIELDS = {  # each field of the two bodies, with values a client may send (valid ones among them)
    "model": st.one_of(st.just(MODEL), TEXT, VALUES),
    "prompt": st.one_of(TEXT, st.lists(TEXT, max_size=3), st.lists(NUMBERS, max_size=5), VALUES),
    "messages": st.one_of(
        st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                        "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries(
                                            {"type": st.just("text"), "text": TEXT}), max_size=2))}), max_size=3),
        VALUES),
    "max_tokens": st.one_of(st.integers(1, 6), NUMBERS, SCALARS),
    "max_completion_tokens": st.one_of(st.integers(1, 6), NUMBERS),
    "temperature": st.one_of(NUMBERS, SCALARS),
    "top_p": NUMBERS, "top_k": NUMBERS, "seed": st.one_of(NUMBERS, SCALARS),
    "n": NUMBERS, "best_of": NUMBERS, "logprobs": st.one_of(NUMBERS, st.booleans()), "top_logprobs": NUMBERS,
    "presence_penalty": NUMBERS, "frequency_penalty": NUMBERS,
    "logit_bias": st.dictionaries(TEXT, NUMBERS, max_size=2),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3), VALUES),
    "stream": st.one_of(st.booleans(), SCALARS), "stream_options": st.one_of(
        st.fixed_dictionaries({"include_usage": st.booleans()}), VALUES),
    "echo": st.booleans(), "suffix": TEXT, "user": TEXT, "ignore_eos": st.one_of(st.booleans(), SCALARS),
    "kv_method": st.one_of(METHOD_NAMES, VALUES), "kv_budget": st.one_of(
        st.integers(1, 64), st.sampled_from([0.1, 0.5, 1.0, "10%", "50%", "lots", "nan%", "1e999"]), NUMBERS, SCALARS),
    "kv_params": st.one_of(PARAMS, VALUES),
    "colour": VALUES,  # not a field
}
VALID = {  # values a server must answer: each method, sampling settings at their edges
    "kv_method": METHOD_NAMES.filter(lambda name: name != "nope"), "kv_budget": st.sampled_from([8, 32, 0.5, "10%"]),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1e-300, 5e-324, 1e300]), "top_p": st.sampled_from([1e-9, 0.5, 1]),
    "top_k": st.integers(0, 3), "seed": st.integers(-(2**63), 2**64 - 1), "stream": st.booleans(),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2), "ignore_eos": st.booleans(),
    "max_tokens": st.integers(1, 12),
}
BASE = {"/v1/completions": {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4},
        "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}],
                                 "max_tokens": 4}}


@st.composite
def requests(draw) -> tuple[str, str, bytes, bool]:
    """(HTTP method, path, body, whether the client goes away after the first event of a stream): a valid body with
    one to three fields set to drawn values or removed, a body of valid values, a JSON value that is no body, or
    bytes that are not JSON."""
    kind = draw(st.sampled_from(["fields"] * 6 + ["valid"] * 3 + ["value", "bytes", "route"]))
    path = draw(st.sampled_from(sorted(BASE)))
    if kind == "route":
        return draw(st.sampled_from(["GET", "PUT", "DELETE", "POST"])), draw(st.sampled_from(
            ["/v1/completions", "/v1/models", "/v1/nope", "/health", "/v1/chat/completions/x"])), b"", False
    if kind == "bytes":
        return "POST", path, draw(st.one_of(st.binary(max_size=40), st.sampled_from(
            [b"", b"{", b'{"model": "fuzz",', b"\xff\xfe{}", b"[" * 50_000 + b"]" * 50_000, b"null", b"NaN"]))), False
    if kind == "value":
        body = draw(VALUES)
    else:
        body = dict(BASE[path])
        fields = VALID if kind == "valid" else FIELDS
        for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=5 if kind == "valid" else 3,
                                  unique=True)):
            if kind == "fields" and draw(st.integers(0, 5)) == 0:
                body.pop(name, None)
            else:
                body[name] = draw(fields[name])
    cancel = isinstance(body, dict) and body.get("stream") is True and draw(st.booleans())
    return "POST", path, json.dumps(body).encode(), cancel  # NaN and Infinity as Python writes them


def check(client, method: str, path: str, body: bytes, cancel: bool = False) -> None:
    """One request: a 4xx with an OpenAI error object, or a 200 with an answer; nothing else. cancel: a client that
    goes away after the first event of a stream."""
    SENT["requests"] += 1
    headers = {"content-type": "application/json"}
    if cancel:
        with client.stream(method, path, content=body, headers=headers) as response:
            if response.status_code == 200:
                next(response.iter_lines())
                return
            response.read()
    else:
        response = client.request(method, path, content=body, headers=headers)
    status = response.status_code
    assert status < 500, (status, body[:300], response.text[:500])
    if status >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"] != "server_error"
        return
    assert status == 200, (status, response.text[:300])
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        for event in events[:-1]:
            data = json.loads(event)
            assert "error" not in data, data  # a request that failed in the engine
        return
    data = response.json()
    assert path not in BASE or data["choices"], data


COMPLETION = BASE["/v1/completions"]
KNOWN = [  # the three bodies that got a 500 before this test (issue 52), and others a client may well send
    ("/v1/completions", b'{"model": "fuzz", "prompt": "Hi", "max_tokens": 4, "temperature": NaN}'),
    ("/v1/completions", dict(COMPLETION, seed=2**80)),
    ("/v1/completions", dict(COMPLETION, prompt="\udcff")),
    ("/v1/chat/completions", dict(BASE["/v1/chat/completions"], messages=[{"role": "user", "content": "a\ud800b"}])),
    ("/v1/completions", dict(COMPLETION, kv_method="snapkv", kv_params={"budget": 8})),
    ("/v1/completions", dict(COMPLETION, temperature=1e-300, seed=3)),
    ("/v1/completions", dict(COMPLETION, **{"\udcff": 1})),
    ("/v1/completions", dict(COMPLETION, kv_method="h2o", kv_budget=8, kv_params={"recent_ratio": float("nan")})),
]


def known(test):
    for path, body in KNOWN:
        test = example(request=("POST", path, body if isinstance(body, bytes) else json.dumps(body).encode(), False))(
            test)
    return test


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(request=requests())
@known
def test_every_body_gets_a_4xx_or_an_answer(server, request):
    client, process, log = server
    check(client, *request)
    assert process.poll() is None, log.read_text()[-3000:]


def test_after_the_fuzz_the_server_serves_and_holds_nothing(server):
    """Runs after the fuzz (pytest keeps the order of a file): the server is up, and holds no page, request or byte
    of method state. Prints the count of requests sent."""
    client, process, log = server
    if SENT["requests"] == 0:  # run alone: a few bodies first
        for body in (b'{"model": "fuzz", "prompt": "Hi", "temperature": NaN}', b"{"):
            check(client, "POST", "/v1/completions", body)
    assert client.get("/health").status_code == 200
    deadline = time.time() + 30
    while True:  # the engine's part of /metrics is measured after steps, at most every 0.5 s
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(client.get("/metrics").text) for s in family.samples}
        held = (samples[("semkv_kv_pool_pages", (("state", "in_use"),))], samples[("semkv_engine_live_requests", ())],
                samples[("semkv_requests_in_flight", ())],
                sum(v for (name, _), v in samples.items() if name == "semkv_method_state_bytes"))
        if held == (0, 0, 0, 0) or time.time() > deadline:
            break
        time.sleep(0.2)
    assert held == (0, 0, 0, 0)
    answer = client.post("/v1/completions", json=dict(BASE["/v1/completions"], temperature=0)).json()
    assert answer["usage"]["completion_tokens"] >= 1
    assert process.poll() is None, log.read_text()[-3000:]
    print(f"\nfuzz: {SENT['requests']} requests, none answered 5xx")
