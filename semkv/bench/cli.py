"""`semkv bench` command: run the grid, print tables, write JSON + markdown + PNG plots."""
from __future__ import annotations

import argparse
import itertools
import json
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from semkv.cli.args import HF_ATTENTIONS, known_method, parse_budget, parse_names, parse_params, split_variant
from semkv.errors import SemkvError


def parse_sizes(text: str, what: str) -> list[int]:
    """'1,4,16' or '4k,32k' -> ints."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        try:
            out.append(int(float(item[:-1]) * 1024) if item.endswith("k") else int(item))
        except ValueError:
            raise SemkvError(f"--{what} {text!r}: {item!r} is not a number (e.g. 1,4,16 or 4k,32k)") from None
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--shape", default="llama3-8b",
                     help="random-weight model shape: llama3-8b, llama3-70b, qwen2-7b, qwen2.5-0.5b, smollm2-135m")
    src.add_argument("--model", default=None, help="a local model instead of a shape")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on a GPU, float32 on the CPU), bfloat16, float16, "
                                                   "float32")
    p.add_argument("--methods", default="full",
                   help="comma-separated method names; a variant with its own parameters is name[param=value,...], "
                        "e.g. full,tokenselect,tokenselect[score_keys=int8] (rows named by the entry)")
    p.add_argument("--budget", default="0.01", help="budget of the non-full methods (tokens or fraction)")
    p.add_argument("--param", action="append", metavar="METHOD.NAME=VALUE", help="method parameter (repeatable)")
    p.add_argument("--batches", default="1",
                   help="batch sizes, e.g. 1,16; 'max': the largest batch each method fits at each context (its KV "
                        "pages at its device bound, its state and its offloaded K/V in host memory); 'fullmax': "
                        "Full KV's largest batch at each context, for every method (a speed-up at Full KV's batch)")
    p.add_argument("--contexts", default="4k,8k,16k,32k", help="context lengths in tokens, e.g. 4k,32k")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per point")
    p.add_argument("--ttft", action="store_true", help="also time a real prefill at each context (batch 1)")
    p.add_argument("--long-gen", type=int, default=0, help="TPOT over this many generated tokens (largest context)")
    p.add_argument("--hf", default="",
                   help="points 'BxCTX' (e.g. 1x4k,maxx32k) to time HF transformers' decode ('max' as in "
                        "--batches), on the shape or the real weights of --model")
    p.add_argument("--hf-attention", default="sdpa",
                   help="HF's attention for --hf, comma-separated to time several: sdpa (transformers' default: torch "
                        "picks the kernel, cuDNN's for bf16 on Hopper), sdpa-flash (SDPA without cuDNN's kernel), "
                        "eager")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder for methods that read token text (sentencekv, dynsplit) on a shape")
    p.add_argument("--text-file", action="append", default=None, metavar="FILE",
                   help="with --model: prefill every sequence for real with a window of these texts (repeatable), so "
                        "decode runs on the model's real queries (TokenSelect's cache hit rate as on real text)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per prefill step (default: 32768 on a GPU, 512 on the CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU the weights, KV pool and activations may take")
    p.add_argument("--no-graphs", action="store_true", help="eager decode steps (no CUDA graphs)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the model over N GPUs (one process each; the batch and memory columns are per GPU)")
    p.add_argument("--out", default="bench-results", help="output directory")


def parse_batches(text: str) -> list[int | str]:
    """'1,16,max' -> [1, 16, 'max'] ('max' resolves per method and context: `largest_batch`; 'fullmax' to Full KV's
    largest batch at the context)."""
    return [item.strip().lower() if item.strip().lower() in ("max", "fullmax") else parse_sizes(item, "batches")[0]
            for item in text.split(",")]


def parse_hf_points(text: str) -> list[tuple[int | str, int]]:
    """'16x32k,maxx32k' -> [(16, 32768), ('max', 32768)]."""
    points = []
    for point in filter(None, text.split(",")):
        batch, sep, ctx = point.strip().lower().rpartition("x")
        if not sep or not batch:
            raise SemkvError(f"--hf point {point!r} must look like BxCTX (e.g. 16x32k or maxx32k)")
        points.append((parse_batches(batch)[0], parse_sizes(ctx, "hf")[0]))
    return points


def method_params(items: list[str] | None) -> dict[str, dict]:

    out: dict[str, dict] = {}
    for item in items or []:
        method, sep, rest = item.partition(".")
        if not sep:
            raise SemkvError(f"--param {item!r} must look like method.name=value")
        out.setdefault(method, {}).update(parse_params([rest]))
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from semkv.bench import report
    from semkv.launch import check_size, run_ranks
    from semkv.models.loader import resolve_device

    methods = parse_names(args.methods)
    for entry in methods:
        split_variant(entry)  # an unknown method or a malformed entry fails here, before the model loads
    for name in method_params(args.param):
        known_method(name)
    grid = Grid(methods, parse_batches(args.batches), parse_sizes(args.contexts, "contexts"),
                parse_budget(args.budget), method_params(args.param))
    hf_points = parse_hf_points(args.hf)
    attentions = [a.strip() for a in args.hf_attention.split(",")]
    bad = [a for a in attentions if a not in HF_ATTENTIONS]
    if bad:
        raise SemkvError(f"--hf-attention {', '.join(bad)}: allowed: {', '.join(HF_ATTENTIONS)}")
    if args.text_file and not args.model:
        raise SemkvError("--text-file needs --model: a random-weight shape has no real queries to measure")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise SemkvError(f"--prefill-chunk {args.prefill_chunk} must be a positive number of tokens")
    device = resolve_device(args.device)
    check_size(args.tensor_parallel_size, device)
    if args.tensor_parallel_size > 1:
        from semkv.bench.shapes import hf_config_for
        from semkv.models.config import ModelConfig
        from semkv.models.loader import model_config
        from semkv.models.parallel import check_divisible

        cfg = model_config(args.model) if args.model else ModelConfig.from_hf(hf_config_for(args.shape))
        check_divisible(cfg, args.tensor_parallel_size)
    results = run_ranks(args.tensor_parallel_size, device, measure, (args, grid))
    if hf_points:
        from semkv.bench.hf_baseline import hf_decode_tpot_ms
        from semkv.models.loader import resolve_dtype

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        for (batch, context), attention in itertools.product(hf_points, attentions):
            if batch in ("max", "fullmax"):  # HF transformers' batch: Full KV's largest either way
                batch = results["max_batch"][str(context)]
            try:
                on = torch.device(results["info"]["device"])
                tpot = hf_decode_tpot_ms(hf_source(args), batch, context, min(args.steps, 16), on,
                                         resolve_dtype(args.dtype, on), attention)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                print(f"HF {attention} B={batch} ctx={context}: out of GPU memory")
                continue
            results["hf"].append(dict(batch=batch, context=context, tpot_ms=tpot, tokens_per_s=1e3 * batch / tpot,
                                      attention=attention))
            print(f"HF {attention} B={batch} ctx={context}: {tpot:.2f} ms/token")
    out = Path(args.out)
    report.write(results, out)
    print(f"wrote {out}/results.json, results.md and plots")
    return 0


@dataclass
class Grid:
    """What `run` measures, parsed from the command line once."""

    methods: list[str]
    batches: list[int | str]
    contexts: list[int]
    budget: int | float | None
    params: dict[str, dict]


def measure(tp, device, args: argparse.Namespace, grid: Grid) -> dict:
    """The measurements of `run` on one rank (every rank of a tensor-parallel run does the same; rank 0 prints)."""
    import torch

    from semkv.bench import report
    from semkv.bench.device import device_info, measured_gemm_tflops
    from semkv.bench.run import (TextContexts, bench_decode, bench_long_generation, bench_ttft, bound_method,
                                 largest_batch, prefill_flops)

    say = print if tp is None or tp.rank == 0 else (lambda *_: None)
    methods, batches, contexts, budget, params = grid.methods, grid.batches, grid.contexts, grid.budget, grid.params
    hf_ttft = []  # HF transformers' prefill, timed before the engine's KV pool takes the card's memory
    if args.ttft and tp is None and device.type == "cuda":
        from semkv.bench.hf_baseline import hf_prefill_s
        from semkv.models.loader import resolve_dtype

        for context in contexts:
            times = hf_prefill_s(hf_source(args), context, device, resolve_dtype(args.dtype, device))
            hf_ttft.append(dict(context=context, first_s=times[0], ttft_s=times[-1]))
            say(f"HF transformers (sdpa) ctx={context}: TTFT {times[-1]:.3f} s (first {times[0]:.3f} s)")
    engine, label, model_tokenizer = build_engine(args, device, tp)
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else model_tokenizer

    def resolved(batch: int | str, context: int, entry: str = "full", budget=None, given: dict | None = None) -> int:
        """A batch size of the grid for `entry` (its method's parameters `given`): 'max' its largest, 'fullmax' Full
        KV's."""
        if batch == "fullmax":
            batch, entry, budget, given = "max", "full", None, {}
        if batch != "max":
            return batch
        size = largest_batch(engine, bound_method(engine, split_variant(entry)[0], budget, dict(given or {}),
                                                  tokenizer), context, args.steps)
        results["method_max_batch"].setdefault(entry, {})[str(context)] = size
        return size

    text = TextContexts.from_files(args.text_file, tokenizer) if args.text_file else None
    info = device_info(engine.device) | dict(model=label, page_size=args.page_size, graphs=engine.cuda_graphs,
                                             contexts="random K/V" if text is None else
                                             f"real prefill of {', '.join(args.text_file)} ({len(text.ids)} tokens)")
    info["tensor_parallel_size"] = 1 if tp is None else tp.size
    if args.ttft and engine.device.type == "cuda":  # the floor a long prefill can reach (2.5 s: TTFT runs only)
        info["gemm_tflops_sustained"] = round(measured_gemm_tflops(engine.device, repeats=1000), 1)
    say(json.dumps(info))
    results: dict = dict(info=info, decode=[], ttft=[], hf_ttft=hf_ttft, long_generation={}, hf=[],
                         method_max_batch={})
    results["max_batch"] = {str(c): resolved("max", c) for c in contexts} if engine.pool.max_pages else {}
    cfg = engine.config
    results["info"]["weight_bytes"] = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    results["info"]["kv_token_bytes"] = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * engine.dtype.itemsize
    results["info"]["params"] = {name: dict(given) for name, given in params.items()}  # every --param, as given
    for entry in methods:  # a method, or a variant of it: its rows are named by the entry
        name, variant = split_variant(entry)
        given = dict(params.get(name, {})) | variant
        b = None if name == "full" else given.pop("budget", budget)  # `--param M.budget=` or the variant's wins
        for context in contexts:
            for batch in (resolved(size, context, entry, b, given) for size in batches):
                try:
                    row = replace(bench_decode(engine, name, b, batch, context, steps=args.steps, params=dict(given),
                                               tokenizer=tokenizer, text=text), method=entry)
                except (MemoryError, torch.OutOfMemoryError) as exc:  # the pool's pages, or the device itself
                    frames = traceback.extract_tb(exc.__traceback__)[-4:]  # where it ran out, innermost first
                    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
                    say(f"{entry} B={batch} ctx={context}: skipped ({str(exc).splitlines()[0]}; at {where})")
                    continue
                results["decode"].append(asdict(row))
                say(report.decode_line(row))
        if args.ttft:
            for context in contexts:
                times = bench_ttft(engine, name, b, context, params=dict(given), tokenizer=tokenizer, text=text)
                flops = prefill_flops(engine.config, context) / 1e12
                floor = flops / (info.get("gemm_tflops") or float("nan"))
                held = flops / (info.get("gemm_tflops_sustained") or float("nan"))
                results["ttft"].append(dict(method=entry, context=context, first_s=times[0], ttft_s=times[-1],
                                            floor_s=floor, floor_sustained_s=held))
                say(f"{entry:<12} ctx={context:<6} TTFT {times[-1]:.3f} s (first request {times[0]:.3f} s, "
                    f"FLOP floor {floor:.3f} s, at the sustained GEMM rate {held:.3f} s)")
        if args.long_gen:
            curve = bench_long_generation(engine, name, b, max(contexts), args.long_gen, params=dict(given),
                                          tokenizer=tokenizer, text=text)
            results["long_generation"][entry] = curve
    return results


def hf_source(args: argparse.Namespace) -> str | Path:
    """What HF transformers runs for `--hf` and `--ttft`: the shape, or the real weights of `--model` (a path, never
    taken for a shape's name)."""
    return args.shape if args.model is None else Path(args.model)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise SemkvError(f"--tokenizer {path!r} is not a folder with tokenizer files")
    return AutoTokenizer.from_pretrained(path)


def build_engine(args: argparse.Namespace, device, tp=None):
    from semkv.bench.shapes import random_model
    from semkv.engine.engine import Engine
    from semkv.models.loader import load_model, resolve_dtype

    dtype = resolve_dtype(args.dtype, device)
    tokenizer = None
    if args.model:
        loaded = load_model(args.model, device, dtype, tp)
        model, config, label, tokenizer = loaded.model, loaded.config, loaded.source, loaded.tokenizer
    else:
        model = random_model(args.shape, device, dtype, tp=tp)
        config, label = model.config, f"{args.shape} (random weights)"
    engine = Engine(model, config, device, dtype, page_size=args.page_size, prefill_chunk=args.prefill_chunk,
                    cuda_graphs=not args.no_graphs,
                    gpu_memory_utilization=args.gpu_memory_utilization)
    return engine, label, tokenizer
