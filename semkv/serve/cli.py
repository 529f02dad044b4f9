"""`semkv serve`: an OpenAI-compatible HTTP server on one model (`pip install semkv[serve]`)."""
from __future__ import annotations

import argparse
import importlib.util
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


def run(args: argparse.Namespace) -> int:
    missing = [name for name in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(name) is None]
    if missing:
        raise SemkvError(f"semkv serve needs {', '.join(missing)}: pip install 'semkv[serve]'")
    if not 0 <= args.port <= 65535:
        raise SemkvError(f"--port {args.port} is out of range; allowed: 0..65535")
    if args.max_concurrent_requests < 1:
        raise SemkvError(f"--max-concurrent-requests {args.max_concurrent_requests} must be >= 1")
    check_range("--timeout-keep-alive", args.timeout_keep_alive, 0, None)
    from semkv.methods import get_method

    budget, params = parse_budget(args.budget), parse_params(args.param)
    get_method(args.method, budget, **params)  # a bad default method fails before the model loads

    import uvicorn

    import semkv
    from semkv.serve.app import ServerConfig, create_app
    from semkv.serve.metrics import Metrics
    from semkv.serve.worker import Worker

    llm = semkv.LLM(args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
                    prefill_chunk=args.prefill_chunk, gpu_memory_utilization=args.gpu_memory_utilization,
                    tensor_parallel_size=args.tensor_parallel_size)
    name = args.served_model_name or Path(llm.source).name.removesuffix(".gguf")
    config = ServerConfig(name, args.method, budget, params, args.max_concurrent_requests)
    app = create_app(llm, Worker(llm, Metrics()), config)
    print(f"semkv serve: {name} on {llm.engine.device}, KV method {args.method} (budget {budget}); "
          f"OpenAI API at http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_keep_alive=args.timeout_keep_alive, timeout_graceful_shutdown=None)
    return 0
