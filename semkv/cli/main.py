"""`semkv` command line: generate, methods, calibrate, bench, eval, report, serve, inspect.

Bad input prints one line `semkv: error: ...` and exits with code 2; no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Callable

from semkv.cli.args import add_model_args, parse_budget, parse_params
from semkv.errors import SemkvError, check_text


def _add_generate(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--method", default="full", help="KV method (see `semkv methods`)")
    p.add_argument("--budget", default=None, help="tokens per head and layer (512) or a fraction (0.1, 10%%)")
    p.add_argument("--param", action="append", metavar="NAME=VALUE", help="method parameter (repeatable)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file with the prompt (e.g. a long document)")
    p.add_argument("--question", default=None, help="question appended after the prompt (marks the query)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True, help="apply the chat template")
    p.add_argument("--allow-overlong", action="store_true", help="allow prompts longer than the model's context")
    p.add_argument("--json", action="store_true", help="print one JSON object with text and stats")


def _run_generate(args: argparse.Namespace) -> int:
    import semkv
    from semkv.engine.sequence import check_sampling
    from semkv.methods import get_method

    # everything that can be checked without the model, before it loads
    method = get_method(args.method, parse_budget(args.budget), **parse_params(args.param))
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise SemkvError(f"--prompt-file {args.prompt_file!r} does not exist")
        prompt = path.read_text(encoding="utf-8", errors="replace")
    else:
        prompt = args.prompt
    source = "--prompt" if args.prompt_file is None else f"--prompt-file {args.prompt_file!r}"
    check_text(source, prompt)  # an argument of bytes that are not UTF-8 comes as lone surrogates
    if not prompt.strip():
        raise SemkvError(f"{source} is empty; give some text")
    for what, text in [("--question", args.question), *(("--stop", s) for s in args.stop or [])]:
        if text is not None:
            check_text(what, text)
    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                   lambda name: "--" + name.replace("_", "-"), args.seed)
    llm = semkv.LLM(args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
                    prefill_chunk=args.prefill_chunk, tensor_parallel_size=args.tensor_parallel_size)
    out = llm.generate(
        prompt,
        method=method,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        chat=args.chat,
        questions=None if args.question is None else [args.question],
        allow_overlong=args.allow_overlong,
        progress=sys.stderr.isatty(),
    )[0]
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "method": args.method, "budget": parse_budget(args.budget), "model": llm.source,
                          "stats": out.stats.as_dict()}, indent=2))
    else:
        print(out.text)
        s = out.stats
        print(f"[{args.method}] prompt {s.prompt_tokens} tok, {s.new_tokens} new | prefill {s.prefill_s:.2f}s "
              f"({s.prefill_tokens_per_s:.0f} tok/s), decode {s.decode_s:.2f}s ({s.decode_tokens_per_s:.1f} tok/s) | "
              f"KV resident {s.kv_resident_tokens:.0f}, attended {s.kv_attended_tokens:.0f}/step/layer",
              file=sys.stderr)
    return 0


def _add_methods(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="one method: its paper and each parameter with its default and meaning")
    p.add_argument("--json", action="store_true", help="print JSON")


def _run_methods(args: argparse.Namespace) -> int:
    from semkv.methods.specs import SPECS  # plain data: no torch, so the list comes at once

    if args.name is not None:
        if args.name not in SPECS:
            raise SemkvError(f"unknown method {args.name!r}; available: {', '.join(SPECS)}")
        spec, docs = SPECS[args.name], SPECS[args.name].parameter_docs()
        if args.json:
            print(json.dumps(spec.describe() | {"parameter_docs": docs}, indent=2, default=str))
            return 0
        print(f"{spec.name}: {spec.summary}\n[{spec.kind}] {spec.paper or 'the exact reference'}\n")
        for name, default in ({"budget": None} | spec.params).items():
            print(f"  {name} = {default!r}\n      {docs.get(name, '')}")
        return 0
    if args.json:
        print(json.dumps({name: spec.describe() for name, spec in SPECS.items()}, indent=2, default=str))
        return 0
    for name, spec in SPECS.items():
        print(f"{name:<14} {spec.summary}")
        params = ", ".join(f"{k}={v!r}" for k, v in spec.params.items())
        print(f"{'':<14} [{spec.kind}] {params or 'no parameters'}")
    return 0


def _add_calibrate(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--method", required=True, help="method to calibrate (dynsplit, chess)")
    p.add_argument("--text-file", action="append", required=True, help="calibration text (repeatable)")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens of each text used")


def _run_calibrate(args: argparse.Namespace) -> int:
    import semkv
    from semkv.methods import METHODS, calibration

    if args.method not in METHODS:
        raise SemkvError(f"unknown method {args.method!r}; available: {', '.join(METHODS)}")
    texts = []
    for name in args.text_file:
        if not Path(name).is_file():
            raise SemkvError(f"text file {name!r} does not exist")
        texts.append(Path(name).read_text(encoding="utf-8", errors="replace"))
    llm = semkv.LLM(args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
                    prefill_chunk=args.prefill_chunk, tensor_parallel_size=args.tensor_parallel_size)
    data = llm.calibrate(args.method, texts, args.max_tokens)
    path = calibration.save(args.method, llm.config.source, data)
    print(json.dumps(data, indent=2, default=str))
    print(f"saved to {path}", file=sys.stderr)
    return 0


def _lazy(module: str, name: str) -> Callable:
    """A function of another module, imported on first call (`semkv.eval.cli` imports the helpers above)."""
    return lambda *args: getattr(importlib.import_module(module), name)(*args)


# subcommand -> (help, add_arguments, run)
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "generate": ("generate text with a KV method and budget", _add_generate, _run_generate),
    "methods": ("list the KV methods with their parameters", _add_methods, _run_methods),
    "calibrate": ("calibrate a method offline for a model (cached per model)", _add_calibrate, _run_calibrate),
    "bench": ("decode speed, TTFT, memory of methods on a model shape (random weights) or a model",
              _lazy("semkv.bench.cli", "add_arguments"), _lazy("semkv.bench.cli", "run")),
    "eval": ("evaluate methods x budgets on tasks x lengths (resumable)", _lazy("semkv.eval.cli", "add_eval"),
             _lazy("semkv.eval.cli", "run_eval")),
    "report": ("tables, plots and HTML views of a results directory", _lazy("semkv.eval.cli", "add_report"),
               _lazy("semkv.eval.cli", "run_report")),
    "serve": ("an OpenAI-compatible HTTP server with a KV method per request (pip install 'semkv[serve]')",
              _lazy("semkv.serve.cli", "add_arguments"), _lazy("semkv.serve.cli", "run")),
    "inspect": ("needle retention and critical-token recall of a method on one prompt, per layer and head",
                _lazy("semkv.eval.cli", "add_inspect"), _lazy("semkv.eval.cli", "run_inspect")),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="semkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add, _) in COMMANDS.items():
        add(sub.add_parser(name, help=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command][2](args)
    except SemkvError as exc:
        print(f"semkv: error: {exc}", file=sys.stderr)
        return 2
    except MemoryError as exc:
        print(f"semkv: error: out of memory: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
