"""Offline throughput beside vLLM (issue 54): `vllm.LLM.generate` and `semkv.LLM.generate` on the same prompts and
weights, each run in a process of its own (so each peak of memory is its own), one after the other on one card.

The prompts are windows of Paul Graham's essays (RULER's haystack) with a question, in the model's chat template;
semkv's encoding makes the token ids once, and both engines are given exactly those ids (`prompt_token_ids`; semkv's
`generate` takes ids too), so that neither run times the tokenizer (on the 2026-11-28 H200 run semkv was given the
text and tokenized 2M tokens on one thread inside its timed prefill pass). Greedy, EOS ignored, every prompt in one `generate` call; vLLM with prefix caching off, its other settings its
defaults. A short warm-up call first, then the timed call, then (unless --no-prefill-pass) the same prompts with one
new token, which times prefill alone. Per run: wall time, output tokens/s, the card's peak memory (nvidia-smi, the
engine's footprint: both take `--gpu-memory-utilization` of the card), the engine process's peak allocation and the
peak it needed (its KV pool counted by the pages its requests held: semkv's `needed_memory_gib`, vLLM's blocks of
every prompt's tokens), and whether each method's tokens equal vLLM's.

    python benchmarks/vllm_offline.py --model $QWEN --data $DATA --out /tmp/w/offline       # on the device
    python benchmarks/vllm_offline.py --smoke --out /tmp/offline-smoke                      # semkv runs on the CPU

A run whose `<run>.json` is in --out is skipped, so a call cut short is resumed by the same command.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vllm_workload import (CardMemory, Essays, add_common, load_text, method_entry, read_json, safe,  # noqa: E402
                           smoke_model, write_json)

RUNS = "full,vllm,chess[anchor=queries],chunkkv[neighbours=3]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common(p, "folder of the raw results",
               "CPU check: the embedded model, 2 x 300 tokens, 8 new (vLLM's run too where vllm imports)")
    p.add_argument("--runs", default=RUNS, help="'vllm' and semkv method entries (semkv eval's syntax), in order")
    p.add_argument("--budget", type=float, default=0.1, help="budget of the semkv methods other than Full KV")
    p.add_argument("--batch", type=int, default=64, help="prompts in the one generate call")
    p.add_argument("--context", type=int, default=32000, help="prompt tokens (chat template and question included)")
    p.add_argument("--new-tokens", type=int, default=512, help="tokens generated per prompt (EOS ignored)")
    p.add_argument("--no-prefill-pass", action="store_true", help="skip the timed one-token pass")
    p.add_argument("--niah", metavar="DIR", help="the vLLM run also runs vLLM's side of vllm_quality.py into DIR "
                   "(its defaults: the eight RULER NIAH tasks at 31,744 tokens, 20 samples)")
    p.add_argument("--niah-tasks", help="with --niah: other tasks (vllm_quality.py --tasks)")
    p.add_argument("--niah-samples", type=int, help="with --niah: samples per task")
    p.add_argument("--deadline", type=float, default=3600,
                   help="seconds this command may take: no run starts with less than 4 minutes left (vLLM's) or 2")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    smoke_model(p, args)
    if args.smoke:
        args.batch, args.context, args.new_tokens = 2, 300, 8
        if importlib.util.find_spec("vllm") is None:
            args.runs = ",".join(r for r in args.runs.split(",") if r != "vllm")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        return child(args, out)
    prompts = out / "prompts.json.gz"
    if not prompts.is_file():
        made = Essays(load_text(args.model), args.data).prompts(0, args.batch, args.context)
        write_json(prompts, [dict(document=x.document, question=x.question, ids=x.ids) for x in made])
    end = time.time() + args.deadline
    for run in args.runs.split(","):
        label = "vllm" if run == "vllm" else method_entry(run, args.budget)[3]
        if (out / f"{safe(label)}.json").is_file():
            print(f"{label}: done before", flush=True)
            continue
        if end - time.time() < (240 if run == "vllm" else 120):
            print(f"{label}: not started: too little time left", flush=True)
            continue
        cmd = [sys.executable, __file__, *sys.argv[1:], "--child", run]
        started = time.time()
        with CardMemory() as card, open(out / f"{safe(label)}.log", "w") as log:
            try:
                code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=end - time.time()).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        result = out / f"{safe(label)}.json"
        if code != 0 or not result.is_file():
            print(f"{label}: failed ({code}) after {time.time() - started:.0f} s; see {log.name}", flush=True)
            continue
        row = read_json(result) | dict(card_peak_gib=card.peak_gib(), process_s=round(time.time() - started, 1))
        if run == "vllm":  # what vLLM says it chose
            said = (out / f"{safe(label)}.log").read_text(errors="replace").splitlines()
            row["log"] = [line[-200:] for line in said if "backend" in line.lower() or "graph" in line.lower()][:12]
        write_json(result, row)
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, (list, dict))}), flush=True)
    print(compare(out))


def child(args, out: Path) -> None:
    prompts = read_json(out / "prompts.json.gz")
    if args.child == "vllm":
        row, tokens = run_vllm(args, [x["ids"] for x in prompts])
    else:
        row, tokens = run_semkv(args, prompts)
    write_json(out / f"{safe(row['run'])}.tokens.json.gz", tokens)
    write_json(out / f"{safe(row['run'])}.json", row)


def timed(call, cuda: bool) -> tuple[float, object]:
    import torch

    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    result = call()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started, result


def run_semkv(args, prompts: list[dict]) -> tuple[dict, list[list[int]]]:
    import torch

    import semkv
    from semkv.bench.run import needed_memory_gib

    name, params, budget, label = method_entry(args.child, args.budget)
    started = time.perf_counter()
    llm = semkv.LLM(args.model, gpu_memory_utilization=args.gpu_memory_utilization)
    load_s = time.perf_counter() - started
    cuda = llm.engine.device.type == "cuda"

    def generate(n: int, new: int, short: bool = False):
        # short: each prompt's last 1,000 tokens, no prefix of a timed prompt
        ids = [x["ids"][-1000:] if short else x["ids"] for x in prompts[:n]]
        return llm.generate(ids, name, budget, max_new_tokens=new, ignore_eos=True, method_params=params)

    generate(len(prompts), 4, short=True)  # compiles what the method's first batch compiles, captures its graphs
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    llm.engine.pool.peak_in_use = llm.engine.pool.in_use
    wall, outputs = timed(lambda: generate(len(prompts), args.new_tokens), cuda)
    row = dict(run=label, engine="semkv", method=name, params=params, budget=budget, load_s=round(load_s, 1),
               wall_s=round(wall, 3), prompts=len(prompts), prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
               new_tokens=sum(len(o.token_ids) for o in outputs),
               cached_tokens=sum(getattr(o.stats, "cached_tokens", 0) for o in outputs),
               same_prompt_ids=sum(o.prompt_token_ids == x["ids"] for o, x in zip(outputs, prompts)),
               mean_prefill_s=round(sum(o.stats.prefill_s for o in outputs) / len(outputs), 4),
               mean_decode_s=round(sum(o.stats.decode_s for o in outputs) / len(outputs), 4),
               kv_pages_peak=llm.engine.pool.peak_in_use, kv_pool_pages=llm.engine.pool.num_pages,
               device=torch.cuda.get_device_name() if cuda else "cpu")
    row["output_tok_s"] = round(row["new_tokens"] / wall, 1)
    if cuda:
        row |= dict(needed_gib=round(needed_memory_gib(llm.engine), 2),
                    allocated_peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                    reserved_gib=round(torch.cuda.memory_reserved() / 2**30, 2))
    if not args.no_prefill_pass:
        row["prefill_wall_s"] = round(timed(lambda: generate(len(prompts), 1), cuda)[0], 3)
    return row, [o.token_ids for o in outputs]


def worker_memory(worker) -> dict:
    """Run in vLLM's worker (`LLM.collective_rpc`): its peak allocation and its attention backend."""
    import torch

    try:
        backend = sorted({g.backend.get_name() for groups in worker.model_runner.attn_groups for g in groups})
    except Exception as exc:  # noqa: BLE001 - the runner's layout differs between versions: say so, keep the rest
        backend = f"unknown ({type(exc).__name__})"
    return dict(allocated_peak=torch.cuda.max_memory_allocated(), reserved=torch.cuda.memory_reserved(),
                backend=backend)


def run_vllm(args, ids: list[list[int]]) -> tuple[dict, list[list[int]]]:
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # lets collective_rpc carry `worker_memory`
    import torch
    import vllm
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=args.model, dtype="bfloat16", enable_prefix_caching=False, seed=0,
              gpu_memory_utilization=args.gpu_memory_utilization)
    load_s = time.perf_counter() - started

    def generate(prompts, new: int):
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        return llm.generate([{"prompt_token_ids": x} for x in prompts], params, use_tqdm=False)

    generate([x[-1000:] for x in ids], 4)  # the same warm-up as semkv's: ~1k tokens a prompt, no timed prefix
    llm.collective_rpc(lambda worker: torch.cuda.reset_peak_memory_stats())
    wall, outputs = timed(lambda: generate(ids, args.new_tokens), False)
    memory = llm.collective_rpc(worker_memory)[0]
    config = llm.llm_engine.vllm_config
    hf = AutoConfig.from_pretrained(args.model)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    token_bytes = hf.num_hidden_layers * 2 * hf.num_key_value_heads * head_dim * 2  # K and V, bf16, every layer
    block = config.cache_config.block_size
    pool = config.cache_config.num_gpu_blocks * block * token_bytes
    # prefix caching off and every prompt running at once: the blocks of every prompt's tokens and new tokens
    used = sum(-(-(len(x) + args.new_tokens) // block) for x in ids) * block * token_bytes
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    row = dict(run="vllm", engine="vllm", vllm=vllm.__version__, load_s=round(load_s, 1), wall_s=round(wall, 3),
               prompts=len(ids), prompt_tokens=sum(map(len, ids)), new_tokens=sum(map(len, tokens)),
               output_tok_s=round(sum(map(len, tokens)) / wall, 1), backend=memory["backend"],
               allocated_peak_gib=round(memory["allocated_peak"] / 2**30, 2),
               needed_gib=round((memory["allocated_peak"] - pool + used) / 2**30, 2),
               kv_pool_gib=round(pool / 2**30, 2),
               settings=dict(max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
                             max_num_seqs=config.scheduler_config.max_num_seqs, block_size=block,
                             compilation_mode=str(config.compilation_config.mode),
                             cudagraph_mode=str(config.compilation_config.cudagraph_mode),
                             enable_prefix_caching=config.cache_config.enable_prefix_caching),
               device=torch.cuda.get_device_name())
    if not args.no_prefill_pass:
        row["prefill_wall_s"] = round(timed(lambda: generate(ids, 1), False)[0], 3)
    if args.niah:
        import vllm_quality

        niah = vllm_quality.parser().parse_args(["--model", args.model, "--data", args.data, "--out", args.niah])
        niah.tasks, niah.samples = args.niah_tasks or niah.tasks, args.niah_samples or niah.samples
        started = time.perf_counter()
        vllm_quality.run_vllm(niah, Path(args.niah) / "vllm", llm)
        row["niah_s"] = round(time.perf_counter() - started, 1)
    return row, tokens


def compare(out: Path) -> str:
    """The runs in --out as a markdown table, with ratios against vLLM and token agreement with it."""
    rows = [read_json(f) for f in sorted(out.glob("*.json")) if not f.name.endswith(".tokens.json.gz")]
    base = next((r for r in rows if r["run"] == "vllm"), None)
    ref = read_json(out / "vllm.tokens.json.gz") if base else None
    lines = ["| run | wall s | output tok/s | x vLLM | prefill pass s | card peak GiB | needed GiB | tokens = vLLM's "
             "| tokens before the first difference (mean) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["run"] != "vllm", r["run"] != "full")):
        same = agree = "-"
        if ref and r["run"] != "vllm":
            mine = read_json(out / f"{safe(r['run'])}.tokens.json.gz")
            same = f"{sum(a == b for a, b in zip(mine, ref))} / {len(ref)}"
            first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                     for a, b in zip(mine, ref)]
            agree = f"{sum(first) / len(first):.0f}"
        ratio = f"{r['output_tok_s'] / base['output_tok_s']:.2f}" if base else "-"
        lines.append(f"| {r['run']} | {r['wall_s']} | {r['output_tok_s']} | {ratio} | {r.get('prefill_wall_s', '-')} "
                     f"| {r.get('card_peak_gib', '-')} | {r.get('needed_gib', '-')} | {same} | {agree} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
