"""Serving beside vLLM (issues 54 and 53): `vllm serve` and `semkv serve` on the same model folder and card, one after
the other, each driven by vLLM's own load client `vllm bench serve` (streamed chat completions, greedy, EOS ignored)
with the same prompts: windows of Paul Graham's essays with a question, which each server puts in the chat template.

Phases (each server runs them in this order after an unrecorded warm-up of 4 prompts; no two phases share a prompt):
  prefill          64 prompts of --context tokens, 1 new token, concurrency 64: the server's prompt tokens/s
  c1, c16, c64     --context-token prompts, --output-len new tokens, at concurrency 1, 16, 64 (4, 32, 128 requests)
  shared_first     8 documents of --context tokens, the first question on each (concurrency 8) ...
  shared_followup  ... then the 7 other questions on each (56 requests, concurrency 8): TTFT on a cached document
Servers: "vllm" (its defaults: prefix caching on) and one fresh `semkv serve` per semkv method entry (the server's
default method), so no method reads pages another cached. Per phase: the client's JSON (`--save-detailed`), the
server's /metrics before and after (pages and requests still held, prefix-cache hits, preemptions), the peak KV
memory in use (polled /metrics) and the card's peak memory since the server started (nvidia-smi).

    python benchmarks/vllm_serve.py --model $QWEN --data $DATA --out /tmp/w/serve --servers vllm,full
    python benchmarks/vllm_serve.py --smoke --out /tmp/serve-smoke --client-path DIR    # semkv on the CPU

A finished phase (its JSON in --out/<server>/) is skipped, so the same command resumes a call cut short; --deadline
stops starting servers and phases in time for the call's limit. --engine-ttft (issue 53) first times `semkv bench
--ttft` on the card: the engine's own prefill rate, which the server's prefill phase is compared with.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vllm_servers import NAME, Server, ServerDown, idle, kv_in_use, kv_shape, metrics, shape_folder  # noqa: E402
from vllm_workload import (CardMemory, Essays, add_common, load_text, method_entry, safe, smoke_model,  # noqa: E402
                           write_json)

SERVERS = "vllm,full,chess[anchor=queries],chunkkv[neighbours=3]"
# seconds a semkv server needs left to start and run a phase (it starts in about 30 s on an H200 with FlashAttention
# 3, 50-60 s building cuDNN's plans); vLLM needs 240 (it started in 76-210 s)
START_S = 120


def phases(args) -> list[dict]:
    """Each phase: name, requests, concurrency, new tokens and its first essay window (the shared phases: the
    documents' first window)."""
    specs = [("warmup", args.warmup, args.warmup, 16), ("prefill", args.prefill, args.prefill, 1)]
    specs += [(f"c{c}", n, c, args.output_len) for c, n in zip(args.concurrency, args.requests)]
    specs += [("shared_first", args.documents, args.documents, args.output_len),
              ("shared_followup", args.documents * (args.questions - 1), args.documents, args.output_len)]
    out, first = [], 0
    for name, n, c, new in specs:
        out.append(dict(name=name, requests=n, concurrency=c, new_tokens=new, first=first))
        first += 0 if name == "shared_first" else args.documents if name == "shared_followup" else n
    return out


def write_prompts(args, folder: Path) -> None:
    """One jsonl per phase ({"prompt": document and question}, `vllm bench serve --dataset-name custom`)."""
    essays = Essays(load_text(args.model), args.data)
    for ph in phases(args):
        if ph["name"].startswith("shared"):  # document after document, each with its questions
            made = essays.prompts(ph["first"], args.documents, args.context, args.questions)
            per_doc = [made[d * args.questions:(d + 1) * args.questions] for d in range(args.documents)]
            # the first question on each document; then question after question, each round over every document
            made = ([doc[0] for doc in per_doc] if ph["name"] == "shared_first"
                    else [doc[q] for q in range(1, args.questions) for doc in per_doc])
        else:
            made = essays.prompts(ph["first"], ph["requests"], args.context)
        with open(folder / f"{ph['name']}.jsonl", "w") as f:
            for m in made:
                f.write(json.dumps({"prompt": f"{m.document}\n\n{m.question}"}) + "\n")


def run_phase(args, server: Server, ph: dict, folder: Path, prompts: Path, seconds: float) -> dict | None:
    before, peak, stop = idle(server), {}, threading.Event()

    def poll():
        while not stop.wait(1.0):
            for key, value in kv_in_use(metrics(server.url)).items():
                peak[key] = max(peak.get(key, 0.0), value)

    chat = args.backend == "openai-chat"  # the server applies the chat template, else the client does
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", args.backend,
           "--endpoint", "/v1/chat/completions" if chat else "/v1/completions", "--base-url", server.url,
           "--model", NAME, "--tokenizer", args.model, "--dataset-name", "custom",
           "--dataset-path", str(prompts / f"{ph['name']}.jsonl"), *(["--skip-chat-template"] if chat else []),
           "--disable-shuffle", "--num-prompts", str(ph["requests"]), "--max-concurrency", str(ph["concurrency"]),
           "--custom-output-len", str(ph["new_tokens"]), "--ignore-eos", "--temperature", "0", "--num-warmups", "0",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--save-result",
           "--save-detailed", "--result-dir", str(folder), "--result-filename", f"{ph['name']}.client.json",
           "--disable-tqdm"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [args.client_path, os.environ.get("PYTHONPATH")])))
    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        with open(folder / f"{ph['name']}.client.log", "w") as log:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=seconds).returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    finally:
        stop.set()
        thread.join()
    result = folder / f"{ph['name']}.client.json"
    if code != 0 or not result.is_file():
        print(f"  {ph['name']}: client exit {code}; see {ph['name']}.client.log", flush=True)
        return None
    record = dict(phase=ph, before=before, after=idle(server), kv_peak=peak)
    write_json(folder / f"{ph['name']}.metrics.json", record)
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common(p, "folder of the raw results (one subfolder per server)",
               "CPU check: semkv servers on the embedded model, tiny sizes")
    p.add_argument("--shape", help="instead of --model: a random-weight shape of semkv bench (e.g. llama3-8b), its "
                   "folder made once in /tmp with --tokenizer's files")
    p.add_argument("--tokenizer", help="with --shape (default: DATA/smollm2-tokenizer, whose vocabulary fits)")
    p.add_argument("--servers", default=SERVERS, help="'vllm' and semkv method entries, in order")
    p.add_argument("--phases", help="which phases run (default: all: prefill, c<N> of --concurrency, shared_first, "
                   "shared_followup)")
    p.add_argument("--budget", type=float, default=0.1, help="budget of the semkv methods other than Full KV")
    p.add_argument("--context", type=int, default=32000, help="prompt tokens (chat template and question included)")
    p.add_argument("--output-len", type=int, default=512, help="new tokens per request (EOS ignored)")
    p.add_argument("--concurrency", default="1,16,64", help="concurrency of the phases c<N>")
    p.add_argument("--requests", default="4,32,128", help="requests of each of those phases")
    p.add_argument("--prefill", type=int, default=64, help="requests (and concurrency) of the prefill phase")
    p.add_argument("--warmup", type=int, default=4, help="requests (and concurrency) of the unrecorded warm-up")
    p.add_argument("--documents", type=int, default=8, help="documents of the shared-document phases")
    p.add_argument("--questions", type=int, default=8, help="questions on each document")
    p.add_argument("--backend", default="openai-chat", choices=["openai-chat", "openai"],
                   help="the client's API: chat completions (the server applies the chat template) or completions "
                        "(the client does; it sends repetition_penalty=1.0, which semkv serve must accept)")
    p.add_argument("--vllm-flag", action="append", default=[], help="extra `vllm serve` argument (repeatable)")
    p.add_argument("--semkv-flag", action="append", default=[], help="extra `semkv serve` argument (repeatable)")
    p.add_argument("--engine-ttft", action="store_true", help="first time `semkv bench --ttft` at --context")
    p.add_argument("--deadline", type=float, default=570, help="seconds this command may take in all")
    p.add_argument("--client-path", default="", help="PYTHONPATH entry for the client's vllm (the CPU check)")
    args = p.parse_args()
    t0 = time.time()
    if args.shape:
        args.model = str(shape_folder(args.shape, args.tokenizer or f"{args.data}/smollm2-tokenizer"))
    smoke_model(p, args)
    if args.smoke:
        args.servers = ",".join(s for s in args.servers.split(",") if s != "vllm")
        args.context, args.output_len, args.concurrency, args.requests = 300, 8, "1,2", "2,4"
        args.documents, args.questions, args.prefill, args.warmup = 2, 3, 2, 1
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.requests = [int(n) for n in args.requests.split(",")]
    left = lambda: args.deadline - (time.time() - t0)  # noqa: E731
    out = Path(args.out)
    prompts = out / "prompts"
    made_for = dict(model=args.model, phases=phases(args), context=args.context, questions=args.questions)
    if not (prompts / "made_for.json").is_file() or json.loads((prompts / "made_for.json").read_text()) != made_for:
        prompts.mkdir(parents=True, exist_ok=True)
        write_prompts(args, prompts)
        write_json(prompts / "made_for.json", made_for)
    if args.engine_ttft and not (out / "engine_ttft" / "results.json").is_file():
        cmd = [sys.executable, "-m", "semkv.cli.main", "bench", "--model", args.model, "--methods", "full", "--batches",
               "1", "--contexts", str(args.context), "--steps", "8", "--ttft", "--out", str(out / "engine_ttft")]
        with open(out / "engine_ttft.log", "w") as log:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=max(left() - 60, 1))
    wanted = [ph["name"] for ph in phases(args)] if args.phases is None else args.phases.split(",")
    for spec in args.servers.split(","):
        label = "vllm" if spec == "vllm" else "semkv-" + method_entry(spec, args.budget)[3]
        folder = out / safe(label)
        folder.mkdir(parents=True, exist_ok=True)
        done = {ph["name"] for ph in phases(args) if (folder / f"{ph['name']}.metrics.json").is_file()}
        want = set(wanted) - done - {"warmup"}
        if "shared_followup" in want:  # the follow-ups need this server to have cached the documents
            want.add("shared_first")
        todo = [ph for ph in phases(args) if ph["name"] in want]
        if not todo or left() < (240 if spec == "vllm" else START_S):
            print(f"{label}: {'done before' if not todo else 'not started: too little time left'}", flush=True)
            continue
        ready_s = None
        with CardMemory() as card:
            server = Server(args, spec, folder / "server.log")
            try:
                ready_s = server.wait(min(900, left() - 60))
                print(f"{label}: ready in {ready_s} s on port {server.port}", flush=True)
                warm = next(ph for ph in phases(args) if ph["name"] == "warmup")
                run_phase(args, server, warm, folder, prompts, max(left() - 30, 1))
                for ph in todo:
                    if left() < 60:
                        print(f"  {ph['name']}: not started: too little time left", flush=True)
                        break
                    record = run_phase(args, server, ph, folder, prompts, left() - 20)
                    if record is not None:
                        client = json.loads((folder / f"{ph['name']}.client.json").read_text())
                        print(f"  {ph['name']}: {client['completed']} done, {client['failed']} failed, "
                              f"{client['output_throughput']:.0f} out tok/s, TTFT p50 {client['median_ttft_ms']:.0f} "
                              f"ms, ITL p50 / p99 {client['median_itl_ms']:.1f} / {client['p99_itl_ms']:.1f} ms",
                              flush=True)
            except ServerDown as exc:
                print(f"{label}: {exc}; see {folder / 'server.log'}", flush=True)
            finally:
                server.stop(card)
            write_json(folder / "server.json", dict(label=label, command=server.command, ready_s=ready_s,
                                                    card_peak_gib=card.peak_gib(), kv=kv_shape(args.model)))
    print(f"done in {time.time() - t0:.0f} s; tables: python benchmarks/vllm_page.py --serve {out}", flush=True)


if __name__ == "__main__":
    main()
