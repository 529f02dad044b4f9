"""Load on `semkv serve`: N concurrent clients replay long-document questions through the OpenAI API (streamed chat
completions, the official `openai` client); per KV method: output throughput, time to first token and inter-token
latency (p50 / p99), and the server's KV pool after the phase (it must be back at 0 pages in use).

The script starts the server itself (`--model`, or `--shape` with random weights: the tokens mean nothing then, the
speed is honest) and stops it at the end; `--url` loads a server that already runs instead. Each request is a window
of `--context` tokens of `--text-file` at its own offset, then a question; `ignore_eos` makes every answer
`--max-tokens` long, so methods are timed on the same work.

    python benchmarks/serve_load.py --shape qwen2.5-0.5b --tokenizer DIR --text-file essays.txt --context 32000 \
        --clients 8 --requests 32 --max-tokens 128 --methods full,snapkv:0.1,chunkkv:0.1 --out results/serve/
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

QUESTION = "\n\nIn one paragraph, what is the main argument of the text above?"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(q / 100 * len(ordered)), len(ordered) - 1)]


def start_server(model: str, flags: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "semkv.cli.main", "serve", "--model", model, "--port", str(port),
                                "--served-model-name", "load", "--log-level", "warning", *flags],
                               stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited: see {log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return process, url
        except OSError:
            time.sleep(1)
    raise SystemExit("the server did not start")


def pool_in_use(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics") as response:
        text = response.read().decode()
    wanted = ('semkv_kv_pool_pages{state="in_use"}', "semkv_engine_live_requests", "semkv_requests_running",
              "semkv_requests_total")
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith(wanted)}


async def one_request(client, model: str, prompt: list[int], method: dict, max_tokens: int) -> dict:
    started = time.perf_counter()
    arrivals: list[float] = []
    usage = None
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body=dict(method, ignore_eos=True))
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage
    ended = time.perf_counter()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"ttft_s": arrivals[0] - started if arrivals else float("nan"), "gaps_s": gaps,
            "tokens": usage.completion_tokens if usage else 0, "prompt_tokens": usage.prompt_tokens if usage else 0,
            "start": started, "end": ended}


async def phase(url: str, method: dict, prompts: list[list[int]], clients: int, max_tokens: int) -> list[dict]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600)
    queue = list(prompts)
    results: list[dict] = []

    async def worker():
        while queue:
            try:
                results.append(await one_request(client, "load", queue.pop(0), method, max_tokens))
            except Exception as error:  # noqa: BLE001 - counted and shown, the load goes on
                cause = error.__cause__ or error.__context__
                results.append({"error": f"{type(error).__name__}: {error} ({cause!r})"})

    await asyncio.gather(*(worker() for _ in range(clients)))
    await client.close()
    return results


def summary(name: str, results: list[dict]) -> dict:
    errors = [r["error"] for r in results if "error" in r]
    results = [r for r in results if "error" not in r]
    if not results:
        return {"method": name, "errors": len(errors), "first_error": errors[0]}
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    gaps = [g for r in results for g in r["gaps_s"]]
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] == r["ttft_s"]]  # not NaN: some text came
    return {"method": name, "requests": len(results), "prompt_tokens": results[0]["prompt_tokens"],
            "wall_s": round(wall, 3), "output_tok_s": round(tokens / wall, 1),
            "ttft_p50_s": round(percentile(ttft, 50), 4), "ttft_p99_s": round(percentile(ttft, 99), 4),
            "itl_p50_ms": round(1000 * percentile(gaps, 50), 2), "itl_p99_ms": round(1000 * percentile(gaps, 99), 2),
            "no_text": len(results) - len(ttft), "errors": len(errors), "first_error": errors[0] if errors else ""}


def parse_method(text: str) -> tuple[str, dict]:
    """'snapkv:0.1' -> ('snapkv@0.1', {'kv_method': 'snapkv', 'kv_budget': 0.1}); 'full' -> Full KV."""
    name, _, budget = text.partition(":")
    body: dict = {"kv_method": name}
    if budget:
        body["kv_budget"] = float(budget) if "." in budget else int(budget)
    return (f"{name}@{budget}" if budget else name), body


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server (else one is started)")
    p.add_argument("--model", help="a local model (HF folder or GGUF); else --shape with random weights")
    p.add_argument("--shape", default="qwen2.5-0.5b", help="a model shape of semkv bench (random weights)")
    p.add_argument("--tokenizer", help="folder with the tokenizer files (for --shape, and to cut the prompts)")
    p.add_argument("--server-flag", action="append", default=[], help="extra `semkv serve` flag (repeatable)")
    p.add_argument("--text-file", required=True, help="the documents' text")
    p.add_argument("--context", type=int, default=32000, help="prompt tokens of each request")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients")
    p.add_argument("--requests", type=int, default=32, help="requests per method")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--methods", default="full,snapkv:0.1,chunkkv:0.1", help="name[:budget], comma separated")
    p.add_argument("--out", help="folder for serve_load.jsonl and the server's log")
    args = p.parse_args()

    from transformers import AutoTokenizer

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    process = None
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.url is None and model is None:
            sys.path.insert(0, str(Path(__file__).parent))
            from memory_soak import random_folder

            model = str(random_folder(args.shape, args.tokenizer, Path(tmp)))
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model)
        ids = tokenizer(Path(args.text_file).read_text(encoding="utf-8", errors="replace"),
                        add_special_tokens=False)["input_ids"]
        question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
        body = args.context - len(question)
        if len(ids) < body:
            raise SystemExit(f"--text-file has {len(ids)} tokens; --context needs {body}")
        step = max((len(ids) - body) // max(args.requests, 1), 1)
        prompts = [ids[i * step % (len(ids) - body + 1):][:body] + question for i in range(args.requests)]
        if args.url is None:
            process, url = start_server(model, args.server_flag, out / "server.log")
        else:
            url = args.url
        try:
            rows = []
            with open(out / "serve_load.jsonl", "w") as f:
                for spec in args.methods.split(","):
                    name, method = parse_method(spec)
                    asyncio.run(phase(url, method, prompts[: args.clients], args.clients, 4))  # warm-up
                    results = asyncio.run(phase(url, method, prompts, args.clients, args.max_tokens))
                    row = dict(summary(name, results), clients=args.clients, max_tokens=args.max_tokens,
                               after=pool_in_use(url))
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    print(json.dumps(row), flush=True)
        finally:
            if process is not None:
                process.terminate()
                process.wait(120)
    base = next((r for r in rows if r["method"] == "full" and "wall_s" in r), None)
    print("\n| method | requests x prompt | output tok/s | vs Full KV | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) |")
    print("|---|---|---|---|---|---|")
    for r in [r for r in rows if "wall_s" in r]:
        ratio = f"{r['output_tok_s'] / base['output_tok_s']:.2f}x" if base else "-"
        print(f"| {r['method']} | {r['requests']} x {r['prompt_tokens']} | {r['output_tok_s']} | {ratio} | "
              f"{r['ttft_p50_s']} / {r['ttft_p99_s']} | {r['itl_p50_ms']} / {r['itl_p99_ms']} |")
    print(f"\nraw rows: {out / 'serve_load.jsonl'}")


if __name__ == "__main__":
    main()
