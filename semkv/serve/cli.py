"""`semkv serve`: an OpenAI-compatible HTTP server on one model (`pip install semkv[serve]`)."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from semkv.cli.args import add_model_args, parse_budget, parse_params
from semkv.errors import SemkvError, check_range


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port; the log line names it)")
    p.add_argument("--method", default="full", help="KV method of requests that name none (kv_method)")
    p.add_argument("--budget", default=None, help="its budget: tokens (512) or a fraction (0.1, 10%%)")
    p.add_argument("--param", action="append", metavar="NAME=VALUE", help="its parameter (repeatable)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name requests give and /v1/models lists (default: the model file's name)")
    p.add_argument("--max-concurrent-requests", type=int, default=64,
                   help="requests queued or running at once; more get HTTP 429")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU the weights, KV pool and method state may take")
    p.add_argument("--timeout-keep-alive", type=float, default=30,
                   help="seconds an idle client connection stays open (uvicorn's default is 5)")
    p.add_argument("--log-level", default="info", help="uvicorn's: critical | error | warning | info | debug")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, metavar="N",
                   help="tokens one engine step computes at most: a decode token per running request, then chunks "
                        "of prompts (default 8192, vLLM's on an H100)")
    p.add_argument("--enable-dynamic-chunking", action=argparse.BooleanOptionalAction, default=False,
                   help="while requests decode, cut a long prompt's later chunks shorter, so that each step costs "
                        "about what --max-num-batched-tokens tokens at a prompt's start do (their attention over the "
                        "prefix counted, as SGLang's dynamic chunking): steps of even length (default: off)")
    p.add_argument("--num-pages", type=int, default=None, metavar="N",
                   help="KV pool pages (of --page-size tokens of one layer), fixed (default: on a GPU what "
                        "--gpu-memory-utilization leaves; on the CPU grown on demand, keeping idle cached prefix "
                        "pages in up to half the host memory free at the start)")
    p.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="requests running at once (default: as many as memory holds)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV pages of a prompt prefix an earlier request computed (default: on)")
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                   help="on a GPU, run the default method on a text of its own before listening (documents in "
                        "chunks, follow-up questions on them together), so that the first requests do not wait for "
                        "Triton to compile kernels (default: on; a few seconds, less once Triton's cache has them)")
    p.add_argument("--tokenizer-processes", type=int, default=1, metavar="N",
                   help="processes that tokenize prompts of 4,096 characters or more, the same document always in the "
                        "same one, so that the web process does not hold its streams while it converts a long "
                        "prompt's tokens (0: in the web process's threads; default: 1)")
    p.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="log throughput, queue and KV pool use this often while busy (0: never)")
    p.add_argument("--api-key", default=os.environ.get("SEMKV_API_KEY"),
                   help="/v1 requests must send 'Authorization: Bearer KEY' (default: $SEMKV_API_KEY; none: open)")


def check(args: argparse.Namespace) -> None:
    """SemkvError (exit code 2) for a bad flag, before the engine process starts."""
    missing = [name for name in ("fastapi", "uvicorn", "prometheus_client", "zmq")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise SemkvError(f"semkv serve needs {', '.join(missing)}: pip install 'semkv[serve]'")
    if not 0 <= args.port <= 65535:
        raise SemkvError(f"--port {args.port} is out of range; allowed: 0..65535")
    for flag in ("max_concurrent_requests", "max_num_batched_tokens", "max_num_seqs"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise SemkvError(f"--{flag.replace('_', '-')} {value} must be a positive int")
    if args.log_stats_interval < 0:
        raise SemkvError(f"--log-stats-interval {args.log_stats_interval} must be >= 0 (0: never)")
    check_range("--timeout-keep-alive", args.timeout_keep_alive, 0, None)
    check_range("--tokenizer-processes", args.tokenizer_processes, 0, 64, int)
    if args.num_pages is not None:
        check_range("--num-pages", args.num_pages, 2, None, int)
    if args.api_key is not None and not args.api_key:
        raise SemkvError("--api-key is empty; give a key or leave the flag out")


def banner(name: str, args: argparse.Namespace, budget, ready) -> str:
    """The start's log lines: what is served, how, and where."""
    on = f"{ready.device} x{ready.tensor_parallel_size}" if ready.tensor_parallel_size > 1 else ready.device
    step = f"{ready.max_num_batched_tokens} tokens" if ready.max_num_batched_tokens else "one prefill chunk"
    if ready.dynamic_chunking:
        step += " (and their cost: dynamic chunking)"
    running = ready.max_num_seqs or "as many as memory holds"
    return (f"semkv serve: {name} on {on}, KV pool of {ready.memory.pool_pages} pages of {args.page_size} tokens; "
            f"default KV method {args.method} (budget {budget})\n"
            f"semkv serve: engine steps of at most {step}; requests running at once: {running}; prefix caching "
            f"{'on' if ready.prefix_caching else 'off'}; tokenizer processes: {args.tokenizer_processes}\n"
            f"semkv serve: OpenAI API at http://{args.host}:{args.port}/v1 (also /health, /metrics, /version)"
            + ("; /v1 needs the API key" if args.api_key else ""))


def run(args: argparse.Namespace) -> int:
    check(args)
    from semkv.launch import freeze_heap
    from semkv.methods import get_method

    budget, params = parse_budget(args.budget), parse_params(args.param)
    get_method(args.method, budget, **params)  # a bad default method fails before the model loads

    import uvicorn

    from semkv.serve.app import ServerConfig, create_app
    from semkv.serve.client import EngineClient
    from semkv.serve.messages import EngineSettings, MethodChoice
    from semkv.serve.metrics import Metrics
    from semkv.serve.tokenizer_processes import TokenizerProcesses
    from semkv.text import TextModel

    settings = EngineSettings(args.model, args.device, args.dtype, args.page_size, args.prefill_chunk,
                              args.gpu_memory_utilization, args.tensor_parallel_size, args.max_num_batched_tokens,
                              args.max_num_seqs, args.enable_prefix_caching,
                              MethodChoice.of(args.method, budget, params), args.warm_up, args.num_pages,
                              args.enable_dynamic_chunking)
    client = EngineClient(settings, Metrics())  # starts the engine process and waits until it is ready
    processes = None
    try:
        ready = client.ready
        if args.tokenizer_processes:  # they load the tokenizer while this process does
            processes = TokenizerProcesses(ready.folder, args.tokenizer_processes)
        text = TextModel.load(ready.folder)
        name = args.served_model_name or Path(ready.source).name.removesuffix(".gguf")
        config = ServerConfig(name, args.method, budget, params, args.max_concurrent_requests, args.api_key,
                              args.log_stats_interval)
        app = create_app(text, client, config)
        if processes is not None:
            processes.wait()
            text.long_texts = processes.tokens
        print(banner(name, args, budget, client.ready), file=sys.stderr, flush=True)
        freeze_heap()  # the tokenizer, the app: no collector pause over them between two streamed tokens
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_keep_alive=args.timeout_keep_alive, timeout_graceful_shutdown=None)
    finally:
        if processes is not None:
            processes.close()
        client.close()
    return 0
