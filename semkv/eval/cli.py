"""`semkv eval`, `semkv report` and `semkv inspect`: argument parsing; the work is in `runner.py`, `report.py`,
`html.py` and `inspect.py`."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from semkv.cli.args import HF_ATTENTIONS, add_model_args, parse_budget, parse_names, parse_params
from semkv.errors import SemkvError, check_range

DEFAULTS = dict(lengths="2k", budgets="128,512", samples=4)


def parse_lengths(text: str) -> list[int]:
    """'2k,4k,1500' -> [2048, 4096, 1500] (k = 1024 tokens)."""
    lengths = []
    for item in parse_names(text):
        match = re.fullmatch(r"(\d+(?:\.\d+)?)([kK]?)", item)
        if not match:
            raise SemkvError(f"length {item!r} is not a token count; give e.g. 2048, 2k or 0.5k")
        value = float(match.group(1)) * (1024 if match.group(2) else 1)
        if value < 1 or value != int(value):
            raise SemkvError(f"length {item!r} must be a whole positive number of tokens")
        lengths.append(int(value))
    return lengths


def parse_budgets(text: str) -> list[int | float]:
    return [parse_budget(item) for item in parse_names(text)]


def parse_method_params(items: list[str] | None) -> dict[str, dict[str, Any]]:
    """['snapkv.window=64'] -> {'snapkv': {'window': 64}}."""
    out: dict[str, dict[str, Any]] = {}
    for item in items or []:
        method, dot, rest = item.partition(".")
        if not dot or not method:
            raise SemkvError(f"--param {item!r} must look like method.name=value")
        out.setdefault(method, {}).update(parse_params([rest]))
    return out


def add_eval(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--task", help="tasks or groups, comma-separated (passkey, niah, ruler, longbench, perplexity, ...)")
    p.add_argument("--methods", default=None,
                   help="methods, comma-separated (default: every one of `semkv methods`); a variant with its own "
                        "parameters is name[param=value,...], e.g. full,chunkkv,chunkkv[neighbours=2]; an entry "
                        "ending in @BUDGET runs at that budget only, e.g. chess[preset=moderate]@0.392")
    p.add_argument("--budgets", default=None, help=f"tokens or fractions, comma-separated ({DEFAULTS['budgets']})")
    p.add_argument("--lengths", default=None, help=f"context lengths in tokens, k = 1024 ({DEFAULTS['lengths']})")
    p.add_argument("--samples", type=int, default=None, help=f"samples per task and length ({DEFAULTS['samples']})")
    p.add_argument("--query-aware", action=argparse.BooleanOptionalAction, default=None,
                   help="set query_aware of every method that has it (default: each method's own default)")
    p.add_argument("--param", action="append", metavar="METHOD.NAME=VALUE", help="method parameter (repeatable)")
    p.add_argument("--data-dir", default=None, help="data root (books/ for perplexity, paul_graham/ for niah, ...)")
    p.add_argument("--out", default="results", help="results directory (a rerun resumes it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ppl-tokens", type=int, default=None, help="scored tokens per perplexity sample (64)")
    p.add_argument("--trace-samples", type=int, default=1, help="samples per task and length traced for the HTML view")
    p.add_argument("--batched", action=argparse.BooleanOptionalAction, default=None,
                   help="run each method's samples of a task and length together through continuous batching and "
                        "record the run's speed (default: on a GPU; no selection diagnostics or traces then)")
    p.add_argument("--hf", action="store_true",
                   help="with --batched: also run HF transformers' generate on the same prompt ids as method 'hf', "
                        "the Full-KV reference for speed and correctness")
    p.add_argument("--hf-attention", default="sdpa", choices=HF_ATTENTIONS,
                   help="HF's attention for --hf: sdpa (transformers' default: torch picks the kernel, cuDNN's for "
                        "bf16 on Hopper), sdpa-flash (SDPA without cuDNN's kernel), eager")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU the weights, KV pool and activations may take (lower it to leave room "
                        "for --hf's model)")
    p.add_argument("--quick", action="store_true",
                   help="a small suite over every method: 200 runs of 512 and 1024 tokens (about 9 minutes on 2 idle "
                        "CPU cores, longer on a busy machine)")
    p.add_argument("--config", default=None, help="repeat the run of a config.json (other options are ignored)")


def run_eval(args: argparse.Namespace) -> int:
    from semkv.eval import runner

    if args.config is not None:
        runner.run_config(args.config, None if args.out == "results" else args.out)
        return 0
    if args.quick:
        preset = dict(runner.QUICK)
    else:
        if not args.task:
            raise SemkvError("give --task (e.g. --task passkey,perplexity), --quick or --config")
        preset = dict(tasks=parse_names(args.task), lengths=parse_lengths(DEFAULTS["lengths"]),
                      budgets=parse_budgets(DEFAULTS["budgets"]), samples=DEFAULTS["samples"], ppl_tokens=64)
    if args.task and args.quick:
        preset["tasks"] = parse_names(args.task)
    for key, parse in (("lengths", parse_lengths), ("budgets", parse_budgets)):
        if getattr(args, key) is not None:
            preset[key] = parse(getattr(args, key))
    for key in ("samples", "ppl_tokens"):
        if getattr(args, key) is not None:
            preset[key] = getattr(args, key)
    runner.run(preset.pop("tasks"), None if args.methods is None else parse_names(args.methods), **preset,
               query_aware=args.query_aware, model=args.model, device=args.device, dtype=args.dtype,
               page_size=args.page_size, prefill_chunk=args.prefill_chunk, data_dir=args.data_dir, out=args.out,
               seed=args.seed, method_params=parse_method_params(args.param), trace_samples=args.trace_samples,
               tensor_parallel_size=args.tensor_parallel_size, batched=args.batched, hf=args.hf,
               hf_attention=args.hf_attention, gpu_memory_utilization=args.gpu_memory_utilization)
    return 0


def add_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("results_dir", help="a directory written by `semkv eval`")
    p.add_argument("--html", action="append", metavar="SAMPLE_ID", help="only these traced samples' HTML views")
    p.add_argument("--png", action="store_true", help="also render each HTML view to PNG with headless Chromium")
    p.add_argument("--bench", action="append", default=[], metavar="DIR",
                   help="a `semkv bench` output folder (repeatable): its decode speed beside the scores, a table and "
                        "a Pareto plot per context length the two share")


def run_report(args: argparse.Namespace) -> int:
    from semkv.eval import html, report

    if not Path(args.results_dir).is_dir():
        raise SemkvError(f"results directory {args.results_dir!r} does not exist")
    path, pages = report.write_report(args.results_dir, args.html, args.bench)
    print(path.read_text(encoding="utf-8"))
    for page in pages:
        print(f"HTML view: {page}", file=sys.stderr)
        if args.png:
            print(f"rendered: {html.screenshot(page, page.with_suffix('.png'))}", file=sys.stderr)
    print(f"written: {path}", file=sys.stderr)
    return 0


def add_inspect(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--method", required=True, help="KV method (see `semkv methods`)")
    p.add_argument("--budget", default=None, help="tokens per head and layer (512) or a fraction (0.1, 10%%)")
    p.add_argument("--param", action="append", metavar="NAME=VALUE", help="method parameter (repeatable)")
    p.add_argument("--prompt-file", required=True, help="file with the prompt (e.g. a long document)")
    p.add_argument("--question", default=None, help="question appended after the prompt (marks the query)")
    p.add_argument("--needle", default=None, help="text of the prompt the answer depends on (for needle retention)")
    p.add_argument("--answer", default=None, help="the answer inside the needle (its span is what must be kept)")
    p.add_argument("--steps", type=int, default=8, help="decode steps traced and averaged over (8)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens of the answers printed (32)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True, help="apply the chat template")
    p.add_argument("--out", default="inspect", help="folder for the PNG heat map and the HTML view")


def run_inspect(args: argparse.Namespace) -> int:
    import semkv
    from semkv.eval import html
    from semkv.eval.inspect import heatmap, inspect, layer_table
    from semkv.methods import get_method

    method = get_method(args.method, parse_budget(args.budget), **parse_params(args.param))  # fail before loading
    path = Path(args.prompt_file)
    if not path.is_file():
        raise SemkvError(f"--prompt-file {args.prompt_file!r} does not exist")
    check_range("--steps", args.steps, 1, None, int)
    check_range("--max-new-tokens", args.max_new_tokens, 1, None, int)
    prompt = path.read_text(encoding="utf-8")
    if args.needle and args.needle not in prompt:
        raise SemkvError(f"the needle {args.needle[:60]!r} is not in {args.prompt_file}")
    llm = semkv.LLM(args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
                    prefill_chunk=args.prefill_chunk, tensor_parallel_size=args.tensor_parallel_size)
    result = inspect(llm, method, prompt, args.question, args.needle, args.answer, args.steps, args.chat, path.stem,
                     args.max_new_tokens)
    if not result["maps"]:
        raise SemkvError("nothing to measure: the method's first generated token already differs from Full KV's "
                         "and no --needle was given")
    label = f"{method.name}@{method.budget}"
    print(f"{label} on {path.name}: {len(result['output'].prompt_token_ids)} prompt tokens; Full KV: "
          f"{result['full'].text!r}; {label}: {result['output'].text!r}")
    print(layer_table(result["maps"]))
    out = Path(args.out)
    png = heatmap(result["maps"], f"{label} · {path.name}", out / f"{path.stem}__{method.name}.png")
    page = html.write(result["view"], out / f"{path.stem}__{method.name}.html")
    print(f"written: {png}\nwritten: {page}", file=sys.stderr)
    return 0
