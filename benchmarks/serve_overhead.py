"""What the two processes of `semkv serve` cost, and that a slow HTTP client does not slow the engine.

1. `transport`: the round trip of the messages between the web process and the engine process (pickle over ZeroMQ
   ipc, the sockets as `EngineClient` and `run_engine` set them) between two processes: one `Outputs` message of B
   requests' new tokens (what the engine sends each loop iteration) and one `Submit` of a 32k-token prompt.
2. `slow-clients`: a real `semkv serve`; one client streams a long answer and records its inter-token latencies,
   alone, beside as many clients that read at once (the engine's batch grows), and beside clients that stall (open a
   stream and read nothing) or read slowly (the same batch: the engine must not notice); the engine's own numbers
   come from /metrics (steps, the lag from the engine sending an iteration to the web process routing it).

    python benchmarks/serve_overhead.py transport
3. `long-prompts`: a real `semkv serve`; one client streams a long answer while long prompts arrive, which the web
   process tokenizes and refuses (longer than the context): whether handling them stalls the others' tokens.

    python benchmarks/serve_overhead.py slow-clients [--model PATH] [--device cpu] [--tokens 200] [--stalled 16]
    python benchmarks/serve_overhead.py long-prompts [--model PATH] [--device cpu] [--tokens 2000] [--every 0.5]
        [--serve-flag=--tokenizer-processes=0]
4. `tokenize-stall`: no server; in one process, how long a thread that stands for the event loop cannot run while a
   long prompt is tokenized in a worker thread, by the thread itself and through a tokenizer process.

    python benchmarks/serve_overhead.py tokenize-stall [--model PATH] [--prompt-chars 140000] --rounds 20
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import zmq

from semkv.engine.scheduler import Counters
from semkv.engine.sequence import SamplingParams
from semkv.serve.messages import MethodChoice, Outputs, Submit


def echo(inputs: str, outputs: str) -> None:
    """The far end: send back every message it gets (unpickled and pickled again, as the engine would)."""
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.connect(inputs)
    push.connect(outputs)
    while (data := pull.recv()) != b"end":
        push.send(pickle.dumps(pickle.loads(data), pickle.HIGHEST_PROTOCOL))
    context.destroy(linger=0)


def transport(rounds: int) -> None:
    folder = tempfile.mkdtemp(prefix="semkv-overhead-")
    addresses = [f"ipc://{folder}/in", f"ipc://{folder}/out"]
    context = zmq.Context()
    push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    for sock in (push, pull):
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    push.bind(addresses[0])
    pull.bind(addresses[1])
    far = multiprocessing.get_context("spawn").Process(target=echo, args=addresses)
    far.start()
    messages = {f"Outputs of {b} requests x 1 token": Outputs(
        list(range(b)), [[1234] for _ in range(b)], {}, [], Counters(), b, 0, [b], None, time.monotonic())
        for b in (1, 16, 64, 256)}
    messages["Submit of a 32k-token prompt"] = Submit(0, list(range(32768)), SamplingParams(512),
                                                      MethodChoice("full", None, ()))
    print(f"round trip web -> other process -> web, {rounds} rounds each (pickle both ways, ZeroMQ ipc)")
    for name, message in messages.items():
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            push.send(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
            pickle.loads(pull.recv())
            times.append(time.perf_counter() - start)
        times.sort()
        size = len(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
        print(f"  {name:34s} {size:>8,} bytes  median {1e6 * statistics.median(times):7.1f} us  "
              f"p99 {1e6 * times[int(0.99 * len(times))]:7.1f} us")
    push.send(b"end")
    far.join()
    context.destroy(linger=0)


def metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{url}/metrics").read().decode()
    totals: dict[str, float] = {}  # summed over the labels (methods, outcomes); histogram buckets left out
    for sample in (s for f in text_string_to_metric_families(text) for s in f.samples if "le" not in s.labels):
        totals[sample.name] = totals.get(sample.name, 0) + sample.value
    return totals


def stat_fields(pid: int) -> list[str]:
    """A process's /proc/PID/stat fields from the third on (its state), after the command's name (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux): what it computed, whatever else the machine runs."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_pid(server_pid: int) -> int:
    """The first child that multiprocessing spawned (the tokenizer processes start once the engine is ready)."""
    spawned = []
    for task in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as cmd:
                    if b"spawn_main" in cmd.read():
                        spawned.append((int(stat_fields(int(child))[19]), int(child)))  # its start time
    if not spawned:
        raise RuntimeError("no engine process")
    return min(spawned)[1]


def stalled(port: int, body: bytes) -> socket.socket:
    """A client that opens a stream and never reads it."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def start_server(args):
    """A `semkv serve` of `args.model` on `args.device` at a free port, once it answers: (process, url, client)."""
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = (["--model", args.model] if args.model else []) + args.serve_flag
    server = subprocess.Popen([sys.executable, "-m", "semkv.cli.main", "serve", "--device", args.device, "--port",
                               str(port), "--served-model-name", "m", "--log-level", "warning",
                               "--max-concurrent-requests", "256", *flags])
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    while True:
        try:
            client.models.list()
            return server, url, client
        except openai.APIConnectionError:
            assert server.poll() is None, "the server did not start"
            time.sleep(0.5)


def slow_clients(args) -> None:
    server, url, client = start_server(args)
    port = int(url.rsplit(":", 1)[1])
    try:
        request = dict(model="m", prompt="Once upon a time", max_tokens=args.tokens, temperature=0,
                       extra_body={"ignore_eos": True})
        body = (b'{"model": "m", "prompt": "Once upon a time", "max_tokens": %d, "stream": true, "temperature": 0, '
                b'"ignore_eos": true}' % (8 * args.tokens))

        def measured() -> list[float]:
            gaps, last = [], time.perf_counter()
            for _ in client.completions.create(stream=True, **request):
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
            return gaps[2:]  # from the second token on

        def reader(pause: float, stop: threading.Event) -> None:
            stream = client.completions.create(stream=True, **dict(request, max_tokens=8 * args.tokens))
            for _ in stream:
                if stop.wait(pause):
                    break
            stream.close()

        measured()  # warm up
        engine = engine_pid(server.pid)
        n = args.stalled
        fast, slow = (f"beside {2 * n} clients reading at once", 0, 0, 2 * n), \
            (f"beside {n} stalled clients + {n} reading every 0.2 s", n, n, 0)
        phases = [("alone", 0, 0, 0), fast, slow, slow, fast, ("alone", 0, 0, 0)]  # twice, against drifts
        for label, n_stalled, n_slow, n_fast in phases:
            socks = [stalled(port, body) for _ in range(n_stalled)]
            stop = threading.Event()
            readers = [threading.Thread(target=reader, args=(0.2 if i < n_slow else 0, stop))
                       for i in range(n_slow + n_fast)]
            for r in readers:
                r.start()
            time.sleep(2 if readers or socks else 0)
            before, start = metrics(url), time.perf_counter()
            cpu = (cpu_seconds(engine), cpu_seconds(server.pid))
            gaps = sorted(measured())
            after, took = metrics(url), time.perf_counter() - start
            cpu = (cpu_seconds(engine) - cpu[0], cpu_seconds(server.pid) - cpu[1])
            tokens = after["semkv_generation_tokens_total"] - before["semkv_generation_tokens_total"]
            stop.set()
            for sock in socks:
                sock.close()
            for r in readers:
                r.join()
            steps = after["semkv_decode_batch_size_count"] - before["semkv_decode_batch_size_count"]
            batch = (after["semkv_decode_batch_size_sum"] - before["semkv_decode_batch_size_sum"]) / max(steps, 1)
            lag_n = after["semkv_engine_output_lag_seconds_count"] - before["semkv_engine_output_lag_seconds_count"]
            lag = after["semkv_engine_output_lag_seconds_sum"] - before["semkv_engine_output_lag_seconds_sum"]
            print(f"{label}: ITL p50 {1e3 * statistics.median(gaps):.2f} ms, p99 "
                  f"{1e3 * gaps[int(0.99 * len(gaps))]:.2f} ms; engine steps {steps / took:.1f}/s of "
                  f"{batch:.1f} requests; engine CPU {1e3 * cpu[0] / max(steps, 1):.1f} ms a step, web CPU "
                  f"{1e3 * cpu[1] / max(tokens, 1):.2f} ms a token; output lag {1e3 * lag / max(lag_n, 1):.2f} ms")
            while metrics(url)["semkv_requests_in_flight"]:  # the cancelled streams end
                time.sleep(0.5)
    finally:
        server.terminate()
        server.wait(120)


def long_prompts(args) -> None:
    """One client streams a long answer while others send chat requests of `--prompt-chars` characters of fresh text
    (each its own, so no tokens are reused) that the web process tokenizes and then refuses, being longer than the
    model's context: the engine never sees them, so a gap in the stream while one is tokenized is the web process's.
    Printed: the stream's gaps while a long prompt was being handled against those while none was."""
    import openai

    server, url, client = start_server(args)
    try:
        request = dict(model="m", prompt="Once upon a time", max_tokens=args.tokens, temperature=0,
                       extra_body={"ignore_eos": True})
        list(client.completions.create(stream=True, **dict(request, max_tokens=8)))  # warm up
        words = "The quick brown fox jumps over the lazy dog near the river bank. " * (args.prompt_chars // 60 + 1)
        windows: list[tuple[float, float]] = []
        done = threading.Event()

        def sender() -> None:
            i = 0
            while not done.wait(args.every):
                text = f"Request {i}: " + words[: args.prompt_chars]
                start = time.perf_counter()
                try:
                    client.chat.completions.create(model="m", max_tokens=1,
                                                   messages=[{"role": "user", "content": text}])
                except openai.BadRequestError:
                    pass  # longer than the context: refused after it was tokenized
                windows.append((start, time.perf_counter()))
                i += 1

        times = []
        thread = threading.Thread(target=sender)
        thread.start()
        for _ in client.completions.create(stream=True, **request):
            times.append(time.perf_counter())
        done.set()
        thread.join()
        inside, outside = [], []
        for a, b in zip(times[1:], times[2:]):
            (inside if any(b >= w0 and a <= w1 for w0, w1 in windows) else outside).append(b - a)
        handled = statistics.median(w1 - w0 for w0, w1 in windows)
        print(f"{len(windows)} long prompts, each handled in {1e3 * handled:.1f} ms (median); the stream's gaps: "
              f"while none was handled p50 {1e3 * statistics.median(outside):.2f} ms, max {1e3 * max(outside):.2f}; "
              f"while one was, p50 {1e3 * statistics.median(inside):.2f} ms, max {1e3 * max(inside):.2f}")
    finally:
        server.terminate()
        server.wait(120)


def tokenize_stall(args) -> None:
    """In one process, as the web process tokenizes: prompts of `--prompt-chars` characters (each its own text, so none
    is tokenized from a recent one) tokenized in a worker thread, by the thread itself (`--tokenizer-processes 0`)
    and through a tokenizer process, while another thread, which wakes every 0.5 ms as the event loop would to send a
    token, records how long it could not run."""
    from semkv.serve.tokenizer_processes import TokenizerProcesses
    from semkv.text import TextModel

    text = TextModel.load(args.model)
    words = "The quick brown fox jumps over the lazy dog near the river bank. " * (args.prompt_chars // 60 + 1)
    prompts = [f"Request {i}: " + words[: args.prompt_chars] for i in range(args.rounds)]
    for where in ("this process", "a tokenizer process"):
        processes = None
        if where != "this process":
            processes = TokenizerProcesses(args.model, 1)
            text.long_texts = processes.tokens
            processes.wait()  # the process has loaded its tokenizer
        stalls, took = [], []
        for prompt in prompts:
            gaps, stop = [], threading.Event()

            def tick() -> None:
                last = time.perf_counter()
                while not stop.is_set():
                    time.sleep(0.0005)
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now

            ticker = threading.Thread(target=tick)
            ticker.start()
            time.sleep(0.02)
            start = time.perf_counter()
            worker = threading.Thread(target=text.tokens, args=(prompt, True))
            worker.start()
            worker.join()
            took.append(time.perf_counter() - start)
            stop.set()
            ticker.join()
            stalls.append(max(gaps))
        if processes is not None:
            processes.close()
            text.long_texts = None
        tokens = len(text.tokens_here(prompts[0], True)[0])
        print(f"{where}: {len(prompts)} prompts of {args.prompt_chars:,} characters ({tokens:,} tokens), each "
              f"tokenized in {1e3 * statistics.median(took):.1f} ms (median); the longest wait of a thread that wakes "
              f"every 0.5 ms: median {1e3 * statistics.median(stalls):.1f} ms, max {1e3 * max(stalls):.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["transport", "slow-clients", "long-prompts", "tokenize-stall"])
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=200, help="tokens of the measured stream")
    p.add_argument("--stalled", type=int, default=16, help="stalled clients, and as many slow readers")
    p.add_argument("--prompt-chars", type=int, default=200_000,
                   help="characters of each long prompt (long-prompts; longer than the model's context)")
    p.add_argument("--every", type=float, default=0.5, help="seconds between long prompts (long-prompts)")
    p.add_argument("--serve-flag", action="append", default=[], metavar="FLAG",
                   help="a flag for semkv serve (repeatable), e.g. --serve-flag=--tokenizer-processes=0")
    args = p.parse_args()
    {"transport": lambda: transport(args.rounds), "slow-clients": lambda: slow_clients(args),
     "long-prompts": lambda: long_prompts(args), "tokenize-stall": lambda: tokenize_stall(args)}[args.what]()


if __name__ == "__main__":
    main()
